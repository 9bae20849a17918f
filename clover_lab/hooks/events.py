"""The events hooks receive: model events (inside a forward: ``layers.{i}.moe.route``,
``layers.{i}.gdn.preview``, ``layers.{i}.gdn.state``) and engine events (between forwards:
``denoise.step``, ``block.commit``).

Every event carries ``where``: the generation, phase, block and step it fired at, so a
recording or a widget never needs to ask the engine. Events are built only when a hook is
attached to their point. Their tensors live on the model's device; positions and tokens the
engine already holds on the host are plain lists, so reading them costs no synchronisation.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

import torch


@dataclass(frozen=True)
class Where:
    """Where a generation stands when an event fires. ``run`` counts generations on the engine
    (0: a forward called directly, outside any generation); ``phase`` "prefill" or "decode";
    ``block`` / ``step`` the block being previewed and its denoising step; ``commit_block`` the
    block being committed by this forward (fused with a preview, or alone). ``rows``: in a
    batched generation, the request rows (indices into the prompts) that the event's batch
    dimension holds, in order (rows leave as they finish); a step or commit event concerns one
    row. None for a single generation. ``cached``: in a prefill, the prompt positions before this
    forward's that came from the engine's prefix cache (no forward ran them; 0: none)."""

    run: int = 0
    phase: str | None = None
    block: int | None = None
    step: int | None = None
    commit_block: int | None = None
    rows: tuple[int, ...] | None = None
    cached: int = 0

    @property
    def row(self) -> int | None:
        """The one request row an event concerns (a step or commit event of a batch), else None."""
        return self.rows[0] if self.rows is not None and len(self.rows) == 1 else None

    def at(self, mode: str) -> tuple[int | None, int | None]:
        """(block, step) of the rows of one mode: a commit's rows belong to ``commit_block`` at no
        step; a preview's to ``block`` at ``step``."""
        return (self.commit_block, None) if mode == "commit" else (self.block, self.step)

    def label(self) -> str:
        if self.phase == "prefill":
            return "prefill"
        if self.step is None:
            return f"commit of block {self.commit_block}"
        fused = "" if self.commit_block is None else f" (+ commit of block {self.commit_block})"
        return f"block {self.block} · step {self.step}{fused}"


NOWHERE = Where()


@dataclass(kw_only=True)
class Event:
    where: Where = NOWHERE

    @property
    def run(self) -> int:
        return self.where.run

    @property
    def phase(self) -> str | None:
        return self.where.phase

    def for_row(self, row: int):
        """This event as request row ``row`` of a batched generation saw it: tensors narrowed to
        that row (views, to read: edits of a narrowed event change nothing), or None when the
        event does not concern the row. Outside a batch, the event itself."""
        rows = self.where.rows
        if rows is None:
            return self
        if row not in rows:
            return None
        if len(rows) == 1:
            return self
        return self._narrow(rows.index(row), len(rows), replace(self.where, rows=(row,)))

    def _narrow(self, i: int, n: int, where: Where):
        """Batch row ``i`` of ``n``: a model event's tensors sliced (engine events are one row)."""
        return self


def _row_positions(positions: torch.Tensor, i: int) -> torch.Tensor:
    """Row ``i``'s positions: [B, T] per-row positions -> [T]; shared [T] positions as they are."""
    return positions[i] if positions.dim() == 2 else positions


class _RowsOfOneMode:
    """``block`` / ``step`` of a model event's rows, from its ``mode``: a commit's rows belong to
    the block being committed (no step), a preview's to the block and step being previewed."""

    mode: str

    @property
    def block(self) -> int | None:
        return self.where.at(self.mode)[0]

    @property
    def step(self) -> int | None:
        return self.where.at(self.mode)[1]


# --------------------------------------------------------------------------- model events
@dataclass
class RouteEvent(_RowsOfOneMode, Event):
    """After the router of one MoE layer, for one part (commit or preview) of a forward.

    ``router_probs`` [T, E] fp32 (softmax over all experts), ``expert_ids`` [T, k] and ``weights``
    [T, k] (renormalised over the top-k). ``ban`` and ``force`` change what the layer computes,
    as does assigning or editing ``expert_ids`` / ``weights``; a changed decision is checked
    (integer ids in [0, E), weights of the same shape, finite, within +-1e6).
    ``block`` / ``step``: the block and step of the routed rows (commit rows: no step).
    """

    layer: int
    mode: str  # "commit" | "preview"
    positions: torch.Tensor  # [T] absolute positions of the routed tokens (flattened over the batch)
    router_probs: torch.Tensor
    expert_ids: torch.Tensor
    weights: torch.Tensor
    # [E] bool (the block's coreset; [T, E] in a batch, each row its own), None = every expert
    selectable: torch.Tensor | None = field(default=None, repr=False)
    # the layer's routing rule, (probs, allowed) -> (expert ids, weights): ``Router.select``
    select: Callable | None = field(default=None, repr=False, kw_only=True)

    @property
    def top_k(self) -> int:
        return self.expert_ids.shape[-1]

    def _reroute(self, allowed: torch.Tensor) -> None:
        if int(allowed.sum(-1).min()) < self.top_k:
            raise ValueError(f"layer {self.layer}: fewer than top_k={self.top_k} experts left to route to")
        if self.select is None:
            raise ValueError(f"layer {self.layer}: this route event has no routing rule to re-route with")
        ids, weights = self.select(self.router_probs, allowed)
        self.expert_ids = ids
        self.weights = weights.to(self.weights.dtype)

    def ban(self, expert_ids) -> None:
        """Route around these experts: each token takes its top-k among the others, renormalised."""
        E = self.router_probs.shape[-1]
        ids = _expert_ids(expert_ids, "ban", self.router_probs.device).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= E):
            raise ValueError(f"ban: expert ids must be in [0, {E}), got {ids.tolist()}")
        allowed = torch.ones(E, dtype=torch.bool, device=ids.device) if self.selectable is None else self.selectable.clone()
        allowed[..., ids] = False
        self.selectable = allowed
        self._reroute(allowed)

    def force(self, expert_ids, weights=None) -> None:
        """Use exactly these experts: ids [k] (every token) or [T, k]; weights default to the
        router's probabilities of those experts, renormalised."""
        T, E = self.router_probs.shape
        ids = _expert_ids(expert_ids, "force", self.router_probs.device)
        ids = ids.expand(T, -1) if ids.dim() == 1 else ids
        if (ids.dim() != 2 or ids.shape[0] != T or ids.shape[1] < 1
                or int(ids.min()) < 0 or int(ids.max()) >= E):
            raise ValueError(f"force: expected expert ids [k] or [{T}, k] in [0, {E}), got "
                             f"{ids.tolist() if ids.numel() <= 16 else f'shape {tuple(ids.shape)}'}")
        if weights is None:
            w = self.router_probs.gather(-1, ids)
            w = w / w.sum(-1, keepdim=True).clamp_min(1e-20)
        else:
            w = torch.as_tensor(weights, dtype=torch.float32, device=ids.device)
            if w.shape not in (ids.shape, ids.shape[1:]):
                raise ValueError(f"force: weights must have shape [{ids.shape[1]}] or {list(ids.shape)} like the "
                                 f"expert ids, got {list(w.shape)}")
            w = w.expand(ids.shape)
        self.expert_ids = ids.contiguous()
        self.weights = w.to(self.weights.dtype).contiguous()

    def _narrow(self, i, n, where):
        T = self.router_probs.shape[0] // n  # the tensors are flattened over the batch, row by row
        rows = slice(i * T, (i + 1) * T)
        sel = self.selectable
        return replace(self, where=where, positions=self.positions[rows], router_probs=self.router_probs[rows],
                       expert_ids=self.expert_ids[rows], weights=self.weights[rows],
                       selectable=sel if sel is None or sel.dim() == 1 else sel[rows])


@dataclass
class GDNPreviewEvent(_RowsOfOneMode, Event):
    """In a preview of one GDN layer: how much each block token leans on the compressed memory."""

    layer: int
    positions: torch.Tensor  # [m] absolute positions of the block
    history_weights: torch.Tensor  # [B, m, H_v] p_tH, fp32
    history_reads: torch.Tensor  # [B, m, H_v, d_v] h_t = (q_t / sqrt(d_k)) @ S0, fp32
    mode = "preview"  # not a field: the rows are always a preview's

    def _narrow(self, i, n, where):
        return replace(self, where=where, positions=_row_positions(self.positions, i),
                       history_weights=self.history_weights[i:i + 1], history_reads=self.history_reads[i:i + 1])


@dataclass
class GDNStateEvent(_RowsOfOneMode, Event):
    """After a commit advanced one GDN layer. Edit ``state`` (or ``ring``) in place or assign a
    new tensor of the same shape; what it holds afterwards is what the cache keeps, once checked
    (finite floats of that shape: a HookError otherwise)."""

    layer: int
    state: torch.Tensor  # [B, H_v, d_k, d_v] fp32
    ring: torch.Tensor  # [B, conv_dim, K-1]
    length: int  # committed length after this commit (a batch's rows at different lengths: the longest)
    row_lengths: list[int] | None = None  # a batch's rows at different lengths: each row's
    mode = "commit"  # not a field: the rows are always a commit's

    def _narrow(self, i, n, where):
        length = self.length if self.row_lengths is None else self.row_lengths[i]
        return replace(self, where=where, state=self.state[i:i + 1], ring=self.ring[i:i + 1], length=length,
                       row_lengths=None)


class ResidualEvent(_RowsOfOneMode, Event):
    """A residual-stream tensor (``layers.{i}.input``, ``.attn.output`` / ``.gdn.output``,
    ``.moe.output``, ``.output``, or ``final_norm.output``) for one part (commit or preview) of a
    forward.

    ``value`` [B, T, H] the part's rows, ``positions`` [T] their absolute positions ([B, T] in a
    batch whose rows are at different lengths), ``layer``
    None for ``final_norm.output`` (whose rows are only those the LM head reads: the last commit
    row, or the requested preview positions). Edit ``value`` in place or assign a tensor of the
    same shape, dtype and device: what it holds afterwards is what the forward goes on with.
    """

    def __init__(self, point: str, layer: int | None, mode: str, positions: torch.Tensor, value: torch.Tensor,
                 where: Where = NOWHERE):
        self.where, self.point, self.layer, self.mode, self.positions = where, point, layer, mode, positions
        self._value = value
        self.replaced = False

    @property
    def value(self) -> torch.Tensor:
        return self._value

    @value.setter
    def value(self, new) -> None:
        old = self._value
        if not isinstance(new, torch.Tensor):
            raise TypeError(f"{self.point}: event.value must be a tensor, got {type(new).__name__}")
        if new.shape != old.shape or new.dtype != old.dtype or new.device != old.device:
            raise ValueError(f"{self.point} ({self.mode} rows): event.value must keep shape {tuple(old.shape)}, "
                             f"dtype {old.dtype} and device {old.device}; got shape {tuple(new.shape)}, "
                             f"dtype {new.dtype}, device {new.device}")
        self._value = new
        self.replaced = True

    def _narrow(self, i, n, where):
        return ResidualEvent(self.point, self.layer, self.mode, _row_positions(self.positions, i),
                             self._value[i:i + 1], where=where)

    def __repr__(self):
        return (f"ResidualEvent({self.point!r}, mode={self.mode!r}, block={self.block}, step={self.step}, "
                f"value={tuple(self._value.shape)})")


# --------------------------------------------------------------------------- engine events

class _Stoppable:
    stopped: bool

    def stop(self) -> None:
        """End the generation cleanly after this event (same as raising StopGeneration)."""
        self.stopped = True


TOP_CANDIDATES = 5  # the most probable tokens a step event keeps per masked position (what a trace saves)


@dataclass
class StepEvent(Event, _Stoppable):
    """After one preview's unmask decision (``denoise.step``), before it is applied.

    ``canvas`` [m] (a copy of the block before this step: mask tokens where still masked),
    ``masked`` the block positions still masked before this step, ``candidates`` [N] and
    ``confidences`` [N] aligned with ``masked`` (device tensors; copies, so editing them changes
    nothing), ``unmask`` the positions the rule chose to unmask now, ``time`` seconds since the
    generation started. ``logits`` [N, V] are what the step decided from (the preview's, after the
    row's penalties, before temperature and filtering), and ``top_ids`` / ``top_probs`` [N, k]
    their TOP_CANDIDATES most probable tokens, which a trace keeps (it keeps no logits).

    Change the decision by editing ``unmask`` (or :meth:`veto` / :meth:`add`), and the token
    placed at a position with :meth:`set_token`; stop with :meth:`stop`. The decision is checked
    (masked positions, tokens in the vocabulary, never the mask token): a HookError otherwise.
    """

    block: int
    step: int
    canvas: torch.Tensor
    masked: list[int]
    candidates: torch.Tensor
    confidences: torch.Tensor
    unmask: list[int]
    time: float
    tokens: dict[int, int] = field(default_factory=dict)  # position -> token overriding the candidate
    stopped: bool = False
    logits: torch.Tensor | None = field(default=None, repr=False)  # [N, V] decided from, aligned with masked
    top_ids: torch.Tensor | None = field(default=None, repr=False)  # [N, k] the most probable tokens of logits
    top_probs: torch.Tensor | None = field(default=None, repr=False)  # [N, k] their probabilities

    def __post_init__(self):
        if self.top_ids is None and self.logits is not None:
            self.top_probs, self.top_ids = self.logits.float().softmax(-1).topk(
                min(TOP_CANDIDATES, self.logits.shape[-1]), dim=-1)

    def top_candidates(self, k: int = TOP_CANDIDATES) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most probable tokens of the distribution this step decided from, at each masked
        position: (ids [N, k], probabilities [N, k]); from the logits when the event has them,
        else (a rebuilt event) from the TOP_CANDIDATES it kept."""
        if self.logits is not None and k > TOP_CANDIDATES:
            probs, ids = self.logits.float().softmax(-1).topk(min(k, self.logits.shape[-1]), dim=-1)
            return ids, probs
        if self.top_ids is None:
            raise ValueError("this step event carries no logits and no top candidates")
        return self.top_ids[:, :k], self.top_probs[:, :k]

    def veto(self, *positions: int | Iterable[int]) -> None:
        """Keep these block positions masked this step."""
        drop = set(_flatten(positions))
        self.unmask = [p for p in self.unmask if p not in drop]

    def add(self, *positions: int | Iterable[int]) -> None:
        """Unmask these (still masked) block positions too, with their candidates."""
        have = set(self.unmask)
        for p in _flatten(positions):
            if p not in have:
                self.unmask.append(p)
                have.add(p)

    def set_token(self, position: int, token: int) -> None:
        """Unmask ``position`` now with ``token`` instead of its candidate."""
        self.tokens[int(position)] = int(token)
        self.add(int(position))

    def candidate(self, position: int) -> int:
        """The candidate token at a block position (reads one value from the device)."""
        return int(self.candidates[self._row(position)])

    def confidence(self, position: int) -> float:
        return float(self.confidences[self._row(position)])

    def _row(self, position: int) -> int:
        if position not in self.masked:
            raise ValueError(f"block position {position!r} is not masked at this step, so it has no candidate "
                             f"(masked: {self.masked})")
        return self.masked.index(position)


@dataclass
class CommitEvent(Event, _Stoppable):
    """After a block is committed to the cache (``block.commit``).

    ``tokens`` the block's final tokens (after EOS / stop-string truncation), ``steps`` the
    previews it took, ``start`` its first position in the sequence, ``time`` seconds since the
    generation started. In AR mode every token is a block of one (``steps`` = 1). In speculative
    mode ``drafted`` tokens followed the causal one, the causal check ``accepted`` that many of
    them (the leading ones) and ``rejected`` the rest; None in the other modes. ``forwards``: the
    forwards this row has run since its prefill, this block's commit included, as its stats count
    them (``GenerationStats.forwards``: previews, fused commit+previews, commits, draft checks)."""

    block: int
    tokens: list[int]
    steps: int
    start: int
    time: float
    stopped: bool = False
    drafted: int | None = None
    accepted: int | None = None
    rejected: int | None = None
    forwards: int | None = None

    @property
    def step(self) -> None:
        return None


def _expert_ids(value, what: str, device) -> torch.Tensor:
    """Expert ids given to ban / force as a long tensor; anything but integers is an error."""
    try:
        ids = torch.as_tensor(value, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{what}: expected expert ids (integers), got {value!r}") from None
    if ids.numel() and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
        raise ValueError(f"{what}: expected integer expert ids, got {ids.dtype} {value!r}")
    return ids.long()


def _flatten(items) -> list[int]:
    out = []
    for item in items:
        if isinstance(item, torch.Tensor):
            out += [int(x) for x in item.reshape(-1).tolist()]
        elif isinstance(item, (list, tuple, set, frozenset, range)):
            out += [int(x) for x in item]
        else:
            out.append(int(item))
    return out


def edit_count(t) -> int | None:
    """A tensor's in-place edit counter, to tell whether a hook changed an event's tensor without
    reading the device (None for inference tensors and non-tensors, which keep none)."""
    return t._version if isinstance(t, torch.Tensor) and not t.is_inference() else None
