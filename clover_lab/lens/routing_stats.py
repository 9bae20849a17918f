"""Routing statistics over a corpus: which experts each MoE layer uses, with which others, how
evenly, and for which tokens (``route_stats``), one process or data-parallel over
torch.distributed (``torchrun``: each rank takes every world-th window, the sums are
all-reduced, rank 0 writes the file).

    stats = route_stats(engine, [Path("a.py"), Path("docs")], mode="commit", batch_size=8)
    stats.save("routes.npz")                       # ExpertView.from_stats("routes.npz") shows it

``mode="commit"``: the corpus run causally, as a prompt's prefill routes it. ``mode="preview"``:
every block of ``block_size`` tokens previewed fully masked against its clean prefix (the
training layout), which is the routing of a block's first denoising step, the one that
records the expert coreset.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from clover_lab.corpus import corpus_documents, corpus_inputs
from clover_lab.errors import CorpusError, flag
from clover_lab.hooks import points
from clover_lab.model.context import ForwardContext
from clover_lab.writes import atomic_path, model_inputs, refuse_inputs

MODES = ("commit", "preview")


@dataclass
class RouteStats:
    """Sums over every routed token of one mode. ``counts`` [L, E]: routed slots per expert;
    ``coactivation`` [L, E, E]: tokens whose top-k holds both experts (diagonal = counts);
    ``mass`` [L, E]: router probability summed over tokens; ``entropy_sum`` [L]: router-probability entropy in bits, summed over tokens; ``tokens``:
    tokens routed (per layer); ``token_keys`` / ``token_slots``: sparse counts by token id,
    key = (layer * vocab + token) * E + expert. L counts the MoE layers (every decoder layer)."""

    mode: str
    vocab_size: int
    top_k: int
    counts: np.ndarray
    coactivation: np.ndarray
    mass: np.ndarray
    entropy_sum: np.ndarray
    tokens: int = 0
    token_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    token_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    inputs: list = field(default_factory=list, repr=False, compare=False)  # (label, path) read: never written over

    @classmethod
    def empty(cls, mode: str, layers: int, experts: int, top_k: int, vocab_size: int) -> "RouteStats":
        return cls(mode, vocab_size, top_k, np.zeros((layers, experts), np.int64),
                   np.zeros((layers, experts, experts), np.int64), np.zeros((layers, experts), np.float64),
                   np.zeros(layers, np.float64))

    @property
    def num_layers(self) -> int:
        return self.counts.shape[0]

    @property
    def num_experts(self) -> int:
        return self.counts.shape[1]

    # ---------------------------------------------------------------- derived figures
    def entropy(self) -> np.ndarray:
        """[L] mean entropy of a token's router probabilities, in bits (max log2 E)."""
        return self.entropy_sum / max(self.tokens, 1)

    def load_entropy(self) -> np.ndarray:
        """[L] entropy of the routed-slot distribution over experts divided by log2 E (1 = even)."""
        p = self.counts / np.maximum(self.counts.sum(1, keepdims=True), 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -np.where(p > 0, p * np.log2(p), 0.0).sum(1)
        return h / math.log2(self.num_experts)

    def load_balance(self) -> np.ndarray:
        """[L] the busiest expert's load over the mean load (1 = even)."""
        mean = self.counts.mean(1)
        return np.where(mean > 0, self.counts.max(1) / np.maximum(mean, 1e-12), 0.0)

    def by_token(self, token_id: int) -> np.ndarray:
        """[L, E] routed slots of one token id, over every place it occurred."""
        V, E = self.vocab_size, self.num_experts
        layer, rest = np.divmod(self.token_keys, V * E)
        token, expert = np.divmod(rest, E)
        out = np.zeros((self.num_layers, E), np.int64)
        hit = token == token_id
        np.add.at(out, (layer[hit], expert[hit]), self.token_slots[hit])
        return out

    # ---------------------------------------------------------------- combining and files
    def merge(self, other: "RouteStats") -> "RouteStats":
        if (self.mode, self.counts.shape, self.vocab_size) != (other.mode, other.counts.shape, other.vocab_size):
            raise ValueError(f"cannot merge route stats of {self.mode} {self.counts.shape} and "
                             f"{other.mode} {other.counts.shape}")
        keys, slots = _coalesce(np.concatenate([self.token_keys, other.token_keys]),
                                np.concatenate([self.token_slots, other.token_slots]))
        return RouteStats(self.mode, self.vocab_size, self.top_k, self.counts + other.counts,
                          self.coactivation + other.coactivation, self.mass + other.mass,
                          self.entropy_sum + other.entropy_sum,
                          self.tokens + other.tokens, keys, slots)

    def save(self, path) -> Path:
        """``path`` (.npz added when missing), whole or not at all."""
        path = stats_path(path)
        refuse_inputs(path, self.inputs, "route stats")
        with atomic_path(path) as tmp:
            np.savez_compressed(tmp, mode=np.array(self.mode), vocab_size=self.vocab_size, top_k=self.top_k,
                                counts=self.counts, coactivation=self.coactivation, mass=self.mass,
                                entropy_sum=self.entropy_sum,
                                tokens=self.tokens, token_keys=self.token_keys, token_slots=self.token_slots,
                                entropy=self.entropy(), load_entropy=self.load_entropy(),
                                load_balance=self.load_balance())
        return path

    @classmethod
    def load(cls, path) -> "RouteStats":
        try:
            with np.load(path) as f:
                return cls(str(f["mode"]), int(f["vocab_size"]), int(f["top_k"]), f["counts"], f["coactivation"],
                           f["mass"], f["entropy_sum"], int(f["tokens"]), f["token_keys"], f["token_slots"])
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"{path}: not a route statistics file ({e})") from None


def _coalesce(keys: np.ndarray, slots: np.ndarray):
    uniq, inverse = np.unique(keys, return_inverse=True)
    return uniq, np.bincount(inverse, weights=slots, minlength=len(uniq)).astype(np.int64)


# --------------------------------------------------------------------------- the corpus
def windows(docs: list, tokenizer, seq_len: int, vocab_size: int) -> list[list[int]]:
    """Every document as token ids, cut into windows of at most ``seq_len`` tokens."""
    out = []
    for doc in docs:
        if isinstance(doc, str):
            if tokenizer is None:
                raise CorpusError("route_stats: text data needs a tokenizer, and the engine has none; pass token "
                                  "ids instead")
            doc = tokenizer(doc, add_special_tokens=False)["input_ids"]
        bad = [t for t in doc if not 0 <= t < vocab_size]
        if bad:
            raise CorpusError(f"route_stats: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        out += [doc[i:i + seq_len] for i in range(0, len(doc), seq_len)]
    out = [w for w in out if w]
    if not out:
        raise CorpusError(f"route_stats: the corpus holds no tokens ({len(docs)} empty document(s)); "
                          f"nothing to route")
    return out


# --------------------------------------------------------------------------- collecting
class _Collector:
    """The route hook: adds one forward's routing of the counted rows to the stats."""

    def __init__(self, stats: RouteStats):
        self.stats = stats
        self.valid: torch.Tensor | None = None  # [B * T] rows that are corpus tokens (not padding)
        self.token_ids: torch.Tensor | None = None  # [N] their ids
        self.keys: list[torch.Tensor] = []

    def begin(self, ids: torch.Tensor, valid: torch.Tensor) -> None:
        self.valid = valid.reshape(-1)
        self.token_ids = ids.reshape(-1)[self.valid]
        self.stats.tokens += int(self.valid.sum())

    def __call__(self, ev) -> None:
        if ev.mode != self.stats.mode:
            return
        s, layer, E = self.stats, ev.layer, self.stats.num_experts
        valid = self.valid.to(ev.expert_ids.device)
        ids = ev.expert_ids[valid].cpu()  # [N, k]
        probs = ev.router_probs[valid].double().cpu()  # [N, E]
        s.counts[layer] += np.bincount(ids.reshape(-1).numpy(), minlength=E)
        onehot = torch.zeros(len(ids), E, dtype=torch.float64).scatter_(1, ids, 1.0)
        s.coactivation[layer] += (onehot.T @ onehot).round().long().numpy()
        s.mass[layer] += probs.sum(0).numpy()
        s.entropy_sum[layer] += float(-(probs * torch.log2(probs.clamp_min(1e-300))).sum())
        self.keys.append(((layer * s.vocab_size + self.token_ids[:, None]) * E + ids).reshape(-1))

    def flush(self) -> None:
        """Fold the collected token keys into the sparse counts (once per batch: bounded memory)."""
        if not self.keys:
            return
        s = self.stats
        keys = torch.cat(self.keys).numpy()
        s.token_keys, s.token_slots = _coalesce(np.concatenate([s.token_keys, keys]),
                                                np.concatenate([s.token_slots, np.ones(len(keys), np.int64)]))
        self.keys.clear()


def route_stats(engine, data, mode: str = "commit", batch_size: int = 8, seq_len: int | None = None,
                progress: bool | None = None) -> RouteStats:
    """Routing statistics of ``data`` (a path, a list of paths and texts, or token ids; see
    ``clover_lab.corpus``) run through ``engine``'s model in ``mode`` ("commit" or "preview"),
    ``batch_size`` windows of ``seq_len`` tokens per forward (default 512, a multiple of the
    block size in preview). Under torch.distributed each rank takes every world-th window and
    every rank returns the all-reduced sums."""
    model = getattr(engine, "model", engine)
    c = model.config
    progress = flag("progress", progress)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {', '.join(MODES)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: expected a positive integer")
    block = getattr(engine, "block_size", c.block_size)
    mask_id = getattr(engine, "mask_token_id", c.mask_token_id)
    seq_len = _window_length(seq_len, mode, block, c.max_position_embeddings, mask_id)
    wins = windows(corpus_documents(data, "route_stats data"), getattr(engine, "tokenizer", None), seq_len, c.vocab_size)
    rank, world = _rank_world()
    mine = wins[rank::world]
    stats = RouteStats.empty(mode, c.num_hidden_layers, c.num_experts, c.num_experts_per_tok, c.vocab_size)
    collect = _Collector(stats)
    from tqdm.auto import tqdm

    show = (len(mine) > batch_size) if progress is None else progress
    bar = tqdm(total=len(mine), unit="window", desc=f"routes ({mode})", disable=not show or rank != 0)
    with model.hooks.scoped({points.every_layer(points.MOE_ROUTE): collect}):
        for start in range(0, len(mine), batch_size):
            ids, valid = _padded(mine[start:start + batch_size], block if mode == "preview" else 1)
            collect.begin(ids, valid)
            _route_forward(model, ids, mode, block, mask_id)
            collect.flush()
            bar.update(len(ids))
    bar.close()
    stats = _all_reduce(stats) if world > 1 else stats
    stats.inputs = model_inputs(model) + corpus_inputs(data, "route_stats data")
    return stats


def stats_path(path) -> Path:
    """Where ``RouteStats.save(path)`` writes: ``path``, .npz added when missing."""
    path = Path(path)
    return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")


def _window_length(seq_len, mode, block, context, mask_id) -> int:
    seq_len = min(512, context) if seq_len is None else seq_len
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1 or seq_len > context:
        raise ValueError(f"seq_len={seq_len!r}: expected a positive integer up to the context length {context}")
    if mode == "preview":
        if mask_id is None:
            raise ValueError("mode='preview' needs a mask token, and the model config has none")
        if seq_len < block:
            raise ValueError(f"seq_len={seq_len}: a preview needs at least one block of {block} tokens")
        seq_len -= seq_len % block
    return seq_len


def _padded(batch: list[list[int]], multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows right-padded to one length (a multiple of ``multiple``): ids [B, T], valid [B, T].
    Padding sits after every real token, so causal commit rows and block previews never see it."""
    T = max(len(w) for w in batch)
    T += (-T) % multiple
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    valid = torch.zeros(len(batch), T, dtype=torch.bool)
    for i, w in enumerate(batch):
        ids[i, :len(w)] = torch.tensor(w)
        valid[i, :len(w)] = True
    return ids, valid


@torch.no_grad()
def _route_forward(model, ids: torch.Tensor, mode: str, block: int, mask_id: int | None) -> None:
    """The layers only (no LM head): the routing is all that is read."""
    ids = ids.to(model.input_device)  # the embedding's device (a placed model's first)
    B, T = ids.shape
    if mode == "commit":
        ctx = ForwardContext.cached(model.new_cache(T, B), T, 0, model.input_device)
        model.hidden_states(ids, ctx)
    else:  # every block previewed fully masked against its clean prefix
        ctx = ForwardContext.training(T, block, model.input_device)
        model.hidden_states(torch.cat([ids, torch.full_like(ids, mask_id)], dim=1), ctx)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce(stats: RouteStats) -> RouteStats:
    """Every rank's sums added up (the process group's backend: gloo on CPUs, NCCL on GPUs)."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    ints = torch.from_numpy(np.concatenate([stats.counts.ravel(), stats.coactivation.ravel(), [stats.tokens]]))
    floats = torch.from_numpy(np.concatenate([stats.mass.ravel(), stats.entropy_sum]))
    ints, floats = ints.to(device), floats.to(device)
    dist.all_reduce(ints)
    dist.all_reduce(floats)
    ints, floats = ints.cpu().numpy(), floats.cpu().numpy()
    L, E = stats.counts.shape
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (stats.token_keys, stats.token_slots))
    keys, slots = _coalesce(np.concatenate([k for k, _ in parts]), np.concatenate([s for _, s in parts]))
    return RouteStats(stats.mode, stats.vocab_size, stats.top_k, ints[:L * E].reshape(L, E),
                      ints[L * E:L * E + L * E * E].reshape(L, E, E), floats[:L * E].reshape(L, E), floats[L * E:],
                      int(ints[-1]), keys, slots)
