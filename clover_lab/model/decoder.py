"""The Clover model: decoder layers and CloverModel, the reference path every kernel and fast
path is tested against.

Three modes per forward (spec section 3): **commit** (causal, exactly Qwen3.5-MoE; advances the
cache), **preview** (one denoising pass over the current block; reads the cache, writes nothing)
and both fused in one forward over ``[block to commit ; block to preview]``; plus the training
forward over a clean sequence and its noisy copy. The layers are in ``layers/``, the forward's
layout in ``context.py``; the engine's static steps and CUDA graphs in ``engine/runner.py``;
random weights (``random``, ``init_weights``) and packed CPU weight copies (``pack_weights``) are
methods here.

Shapes: B batch, T = c + m rows of a forward (c committed rows first, then m preview rows),
n the committed length before the forward, H hidden size, V vocabulary.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from clover_kernels import dense
from clover_lab.checkpoint import loading, saving
from clover_lab.config import CloverConfig
from clover_lab.errors import count, flag
from clover_lab.hooks import points
from clover_lab.hooks.events import NOWHERE, Where
from clover_lab.hooks.registry import HookRegistry
from clover_lab.model.cache import CacheFullError, CloverCache
from clover_lab.model.context import Coreset, ForwardContext
from clover_lab.model.drafts import DraftCommit
from clover_lab.model.layers.attention import GatedAttention
from clover_lab.model.layers.gdn import GatedDeltaNet
from clover_lab.model.layers.linear import FusedProjections, Linear
from clover_lab.model.layers.moe import Experts, Router, SparseMoE
from clover_lab.model.layers.norm import RMSNorm
from clover_lab.model.layers.residual import fire_head_rows, fire_residual
from clover_lab.model.layers.rotary import Rotary
from clover_lab.model.prediction_head import MTPHead, MTPUnavailable

__all__ = ["CloverModel", "Coreset", "StepOutput", "DecoderLayer", "TextModel"]


@dataclass
class StepOutput:
    commit_logits: torch.Tensor | None  # [B, c or 1, V]
    preview_logits: torch.Tensor | None  # [B, m or len(positions), V]


class DecoderLayer(nn.Module):
    device: torch.device | None = None  # where the layer runs, when placed over devices (placement/)

    def __init__(self, config: CloverConfig, layer: int, hooks: HookRegistry):
        super().__init__()
        self.layer_type = config.layer_types[layer]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, layer, hooks)
        else:
            self.self_attn = GatedAttention(config, layer)
        self.mlp = SparseMoE(config, layer, hooks)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layer = layer
        self.hooks = hooks
        self.input_point = points.layer_point(layer, points.INPUT)
        self.mixer_point = points.layer_point(layer, points.mixer_output(self.layer_type))
        self.moe_point = points.layer_point(layer, points.MOE_OUTPUT)
        self.output_point = points.layer_point(layer, points.OUTPUT)

    def _observe(self, name: str, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """A residual-stream point: one dict lookup with nothing attached."""
        if ctx.hooks and self.hooks.active(name):
            return fire_residual(self.hooks, name, self.layer, x, ctx)
        return x

    def forward(self, x: torch.Tensor, ctx: ForwardContext, normed: torch.Tensor | None = None,
                next_layer: "DecoderLayer | None" = None):
        """x [B, T, H] the residual stream -> (the stream after this layer, ``next_layer``'s input
        norm of it or None). ``normed``: this layer's input norm of x, when the layer before computed
        it (in its last kernel); it does so for ``next_layer`` where no hook point lies between."""
        x = self._observe(self.input_point, x, ctx)
        h = self.input_layernorm(x) if normed is None else normed
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, ctx)
        else:
            h = self.self_attn(h, ctx)
        x, h = self.post_attention_layernorm.after_add(x, self._observe(self.mixer_point, h, ctx))
        if ctx.hooks and (self.hooks.active(self.moe_point) or self.hooks.active(self.output_point)
                          or (next_layer is not None and self.hooks.active(next_layer.input_point))):
            next_layer = None  # a hook may see or replace the stream before the next norm
            if self.hooks.active(self.moe_point):
                return self._observe(self.output_point, x + self._observe(self.moe_point, self.mlp(h, ctx), ctx),
                                     ctx), None
        if next_layer is None:  # the MoE's output goes into the residual stream inside its last kernel
            return self._observe(self.output_point, self.mlp(h, ctx, residual=x), ctx), None
        return self.mlp(h, ctx, residual=x, next_norm=next_layer.input_layernorm)


class TextModel(nn.Module):
    def __init__(self, config: CloverConfig, hooks: HookRegistry):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, hooks) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)


class CloverModel(nn.Module):
    """Clover: Qwen3.5-MoE's causal path plus the block preview operator. Untied LM head.

    ``placement``: set when the model is placed over devices (``clover_lab.placement``): layers
    then run where they lie, the activations moving between them; ``device`` is the LM head's
    (where logits come out), ``input_device`` the embedding's."""

    placement = None
    checkpoint_dir = None  # the directory it was loaded from: an input no output may overwrite (writes.py)

    def __init__(self, config: CloverConfig):
        super().__init__()
        self.config = config
        self.hooks = HookRegistry(points.hook_points(config.layer_types))
        self.model = TextModel(config, self.hooks)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # the multi-token-prediction head (``mtp.py``): Qwen3.5/3.6's drafter, when the checkpoint has one
        self.mtp = MTPHead(config, DecoderLayer) if config.mtp_num_hidden_layers else None
        self._kept_hidden: list | None = None  # ``keeping_hidden``: the commit rows' last-layer states

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path, device=None, dtype=None, progress: bool | None = None, keep_fp8: bool | None = None,
                        placement=None, check_finite: bool | None = None) -> "CloverModel":
        """The model in the Hugging Face directory ``path`` (see ``clover_lab.checkpoint.loading``; ``keep_fp8``
        and ``placement`` there); ``check_finite`` refuses weights holding NaN or inf (default: for
        checkpoints up to 4 GiB)."""
        model = loading.load_model(cls, path, device=device, dtype=dtype, progress=progress, keep_fp8=keep_fp8,
                                   placement=placement, check_finite=check_finite)
        model.fuse_projections()
        return model

    def save_pretrained(self, path, max_shard_bytes: int | None = None) -> None:
        """``max_shard_bytes``: shards of at most that many bytes (None: 5 GiB)."""
        if max_shard_bytes is not None:
            max_shard_bytes = count("max_shard_bytes", max_shard_bytes)
        saving.save_model(self, path, max_shard_bytes=max_shard_bytes)

    def projection_groups(self):
        """(module, FusedProjections) for every group of projections that share an input."""
        for module in self.modules():
            for group in vars(module).values():
                if isinstance(group, FusedProjections):
                    yield module, group

    def fuse_projections(self) -> int:
        """Each group of projections reading one input as one GEMM, their weights views of one
        tensor (``layers.linear.FusedProjections``); run after loading and after every move or
        cast (``_apply``). Returns the groups fused."""
        return sum(group.fuse(module) for module, group in self.projection_groups())

    def check_projections(self) -> None:
        """Drop every fused weight whose parts moved on (``FusedProjections.current``): a host
        check, run before a compiled step, whose traced code trusts the fused weights it finds."""
        for module, group in self.projection_groups():
            group.current(module)

    def _apply(self, fn, *args, **kwargs):  # .to(), .cuda(), .half(), to_empty(): the parts are new tensors
        out = super()._apply(fn, *args, **kwargs)
        self.fuse_projections()
        return out

    def require_mtp(self) -> MTPHead:
        """The MTP head, or an MTPUnavailable naming what is missing."""
        if self.mtp is None:
            where = f" ({self.checkpoint_dir})" if self.checkpoint_dir is not None else ""
            raise MTPUnavailable(f"mode 'mtp' needs the model's multi-token-prediction head (mtp.fc, "
                                 f"mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.0.*, mtp.norm), "
                                 f"and this checkpoint{where} has none; use mode 'ar' or 'speculative'")
        return self.mtp

    @contextlib.contextmanager
    def keeping_hidden(self):
        """Within: every eager forward appends its commit rows' last-layer states [B, c, H] (before
        the final norm) to the yielded list: the MTP head's input (``engine/mtp.py``)."""
        self._kept_hidden = []
        try:
            yield self._kept_hidden
        finally:
            self._kept_hidden = None

    @torch.no_grad()
    def reset_preview_parameters(self) -> None:
        """Every GDN layer's preview weights back to the spec's defaults (an untrained preview)."""
        for module in self.modules():
            if isinstance(module, GatedDeltaNet):
                module.reset_preview_parameters()

    def set_preview_reading(self, reading: dict) -> None:
        """How the preview weights are read from now on (``CloverConfig.preview_reading``: the
        spec's reading when empty; spec 3.2.1); a bad one is a ConfigError, changing nothing."""
        self.config.preview_reading = self.config.replace(preview_reading=dict(reading)).preview_reading

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def input_device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the embedding's (FP8 checkpoints keep their linears in FP8)."""
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, max_len: int, batch_size: int = 1) -> CloverCache:
        """An empty cache for ``max_len`` positions on the model's device, in its dtype."""
        devices = (self.device if self.placement is None
                   else {i: layer.device for i, layer in enumerate(self.model.layers)})  # each layer's own
        return CloverCache.allocate(self.config, max_len, batch_size, device=devices, dtype=self.dtype)

    @classmethod
    def random(cls, config: CloverConfig | str, device=None, dtype=torch.float32, seed: int = 0) -> "CloverModel":
        """Random weights, materialised directly on ``device`` (built on ``meta`` first, so a
        full-size preset never exists twice in memory)."""
        if isinstance(config, str):
            config = CloverConfig.preset(config)
        with torch.device("meta"):
            model = cls(config)
        model = model.to(dtype).to_empty(device=device or "cpu")  # allocated once, in the target dtype
        model.init_weights(seed)
        return model.eval()

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        device = self.device
        gen = torch.Generator(device=device).manual_seed(seed)  # drawn where the weights live
        std = self.config.initializer_range

        def normal_(t: torch.Tensor, s: float = std):
            t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32, device=device).mul_(s))

        for name, param in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("linear_attn.norm.weight"):
                param.fill_(1.0)
            elif "norm" in name:
                param.zero_()  # zero-centred norms
            elif leaf == "dt_bias":
                param.fill_(1.0)
            elif leaf == "A_log":
                param.copy_(torch.empty(param.shape, device=device).uniform_(1.0, 16.0, generator=gen).log())
            elif leaf in ("block_scale", "history_bias", "history_log_n") or "conv1d_right" in name:
                continue
            elif "conv1d" in name:
                normal_(param, 1.0 / math.sqrt(param.shape[-1]))
            else:
                normal_(param)
        for module in self.modules():
            if isinstance(module, GatedDeltaNet):
                module.reset_preview_parameters()

    # ------------------------------------------------------------------ the forward
    def _check_ids(self, ids: torch.Tensor, name: str, batch_size: int) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name}: expected integer token ids of shape [B, T], got {tuple(ids.shape)} {ids.dtype}")
        if ids.shape[0] != batch_size:
            raise ValueError(f"{name}: batch size {ids.shape[0]} does not match the cache's {batch_size}")
        # range-checked where that costs no device-to-host sync: ids already on an accelerator
        # come from the engine itself
        if ids.device.type == "cpu" and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"{name}: token ids must be in [0, {self.config.vocab_size})")
        return ids.to(self.input_device, torch.long)

    @torch.no_grad()
    def forward(self, cache: CloverCache, commit_ids=None, preview_ids=None, *, commit_logits: str | None = "last",
                preview_positions=None, coreset: Coreset | None = None, where: Where = NOWHERE,
                drafts: dict | None = None, commit_rows: list[bool] | None = None) -> StepOutput:
        """One forward over ``[commit_ids ; preview_ids]`` (either may be None).

        ``commit_logits``: "last", "all" or None. ``preview_positions``: block positions whose
        logits are wanted (default: all). ``where``: the generation's block and step, handed to
        the events this forward fires. The cache advances by the committed rows only if the
        whole forward succeeds; a preview never changes it. ``drafts``: a dict the GDN layers fill
        with what :meth:`commit_draft` needs to keep only a prefix of the commit. ``commit_rows``:
        per batch row, whether its commit lands (None: every row's); a row whose does not previews
        right after its own length, and its commit rows are padding (their logits mean nothing).
        """
        parts = []
        if commit_ids is not None:
            commit_ids = self._check_ids(commit_ids, "commit_ids", cache.batch_size)
            parts.append(commit_ids)
        if preview_ids is not None:
            preview_ids = self._check_ids(preview_ids, "preview_ids", cache.batch_size)
            parts.append(preview_ids)
        if not parts:
            raise ValueError("forward needs commit_ids, preview_ids or both")
        c = 0 if commit_ids is None else commit_ids.shape[1]
        m = 0 if preview_ids is None else preview_ids.shape[1]
        if c + m == 0:
            raise ValueError("forward: no tokens given")
        if commit_rows is not None and (len(commit_rows) != cache.batch_size or drafts is not None):
            raise ValueError(f"forward: commit_rows must give one flag per batch row ({cache.batch_size}), "
                             f"got {len(commit_rows)}" + (" (and a draft commit commits every row)" if drafts else ""))
        if commit_rows is None:
            cache.check_room(c)
            top = cache.length + c + m
        else:  # only the rows that commit need room; one that does not previews after its own length
            lengths = cache.row_lengths or [cache.length] * cache.batch_size
            at = max((n for n, k in zip(lengths, commit_rows) if k), default=0)
            if at + c > cache.max_len:
                raise CacheFullError(f"committing {c} tokens at length {at} would exceed the cache's "
                                     f"{cache.max_len} positions")
            top = max(n + c * k + m for n, k in zip(lengths, commit_rows))
        if top > self.config.max_position_embeddings:
            raise ValueError(f"positions up to {top} exceed the context length "
                             f"{self.config.max_position_embeddings}")
        ctx = ForwardContext.cached(cache, c, m, self.input_device, coreset, where, commit_rows)
        ctx.drafts = drafts
        x = self.hidden_states(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0], ctx)
        if self._kept_hidden is not None and c:
            self._kept_hidden.append(x[:, :c])
        ctx.publish()  # the forward succeeded: the commit lands
        if ctx.committing is None:
            cache.advance(c)
        else:  # only the committing rows' lengths move
            lengths = cache.row_lengths or [cache.length] * cache.batch_size
            cache.set_row_lengths([n + c * k for n, k in zip(lengths, ctx.committing)])
        return self.heads(x, ctx, commit_logits, preview_positions)

    @torch.no_grad()
    def forward_packed(self, cache: CloverCache, segments: list, ids: torch.Tensor, wanted: torch.Tensor,
                       where: Where = NOWHERE, drafts: dict | None = None) -> torch.Tensor:
        """One forward over rows in different phases (``context.Segment``s of distinct cache rows):
        ``ids`` [N] every segment's tokens one after another (a segment's commit tokens, then its
        block), ``wanted`` [K] the indices of the tokens whose logits are wanted -> logits [K, V].
        The embedding, the norms, the MoE and the LM head run over the step's tokens at once; the
        mixers per group of segments of one shape. Each segment's row commits its commit tokens
        (its length advances by them) only if the whole forward succeeds; no hook inside the model
        runs (rows with one take forwards of their own). ``drafts``: a dict the GDN layers fill,
        per cache row of a ``draft`` segment, with what keeping only a prefix of its commit needs
        (``DraftCommit.keep`` on that row, ``drafts.py``)."""
        lengths = cache.row_lengths or [cache.length] * cache.batch_size
        if len({s.row for s in segments}) != len(segments) or not segments:
            raise ValueError(f"forward_packed: one segment per cache row, got rows {[s.row for s in segments]}")
        if ids.dim() != 1 or ids.shape[0] != sum(s.width for s in segments):
            raise ValueError(f"forward_packed: ids must be [{sum(s.width for s in segments)}] (every segment's "
                             f"tokens), got {tuple(ids.shape)}")
        for s in segments:
            if lengths[s.row] + s.commit > cache.max_len:
                raise CacheFullError(f"committing {s.commit} tokens at length {lengths[s.row]} would exceed the "
                                     f"cache's {cache.max_len} positions")
            if lengths[s.row] + s.width > self.config.max_position_embeddings:
                raise ValueError(f"positions up to {lengths[s.row] + s.width} exceed the context length "
                                 f"{self.config.max_position_embeddings}")
        ctx = ForwardContext.packed(cache, segments, self.input_device, where)
        ctx.drafts = drafts
        x = self.hidden_states(self._check_ids(ids[None], "ids", 1), ctx)
        ctx.publish()
        grown = list(lengths)
        for s in segments:
            grown[s.row] += s.commit
        cache.set_row_lengths(grown)
        return self.head(x[0, wanted.to(x.device)])

    def heads(self, x: torch.Tensor, ctx: ForwardContext, commit_logits: str | None = "last",
              preview_positions=None) -> StepOutput:
        """The forward's tail after the layers (every layout's, the static steps' too): logits of
        the commit rows ("last", "all" or None) and of the block rows (only ``preview_positions``,
        when given)."""
        c, m = ctx.c, ctx.m
        out_commit = out_preview = None
        if c and commit_logits is not None:
            lo = c - 1 if commit_logits == "last" else 0
            out_commit = self.head(x[:, lo:c], ctx, "commit", ctx.positions[..., lo:c])
        if m:
            rows, positions = x[:, c:], ctx.positions[..., c:]
            if preview_positions is not None:
                idx = torch.as_tensor(preview_positions, device=x.device, dtype=torch.long)
                rows, positions = rows[:, idx], positions[..., idx]
            out_preview = self.head(rows, ctx, "preview", positions)
        return StepOutput(out_commit, out_preview)

    def hidden_states(self, ids: torch.Tensor, ctx: ForwardContext, start: int = 0, stop: int | None = None,
                      x: torch.Tensor | None = None) -> torch.Tensor:
        """Embedding and every decoder layer over the rows of ``ctx`` -> the last layer's output
        [B, T, H] (before the final norm); the attention layers rotate at ``ctx.positions``.
        ``start``, ``stop``, ``x``: only layers [start, stop), from ``x`` entering layer ``start``
        (a split static step); the last of them fuses no next layer's norm."""
        if x is None:
            x = self.model.embed_tokens(ids)
        ctx.rope = self.model.rotary
        layers, normed = self.model.layers, None
        stop = len(layers) if stop is None else stop
        for i in range(start, stop):
            layer = layers[i]
            if layer.device is not None and x.device != layer.device:  # placed: the activations move
                x = x.to(layer.device)
                ctx.positions = ctx.positions.to(layer.device)
            # the next layer's input norm fused into this layer's last kernel: not in training, where
            # FSDP2 keeps the next layer's weights sharded (DTensors) until that layer runs
            nxt = layers[i + 1] if i + 1 < stop and not ctx.is_training else None
            x, normed = layer(x, ctx, normed, nxt if nxt is not None and nxt.device == layer.device else None)
        return x

    def head(self, rows: torch.Tensor, ctx: ForwardContext | None = None, mode: str | None = None,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and LM head: hidden rows [..., H] -> logits [..., V]. Given the forward's
        ``ctx``, the rows' ``mode`` and ``positions``, ``final_norm.output`` fires between the two.
        A placed model runs the norm on its device and the head on the model's."""
        if self.placement is not None:
            rows = rows.to(self.model.norm.weight.device)
        h = self.model.norm(rows)
        if ctx is not None and ctx.hooks and self.hooks.active(points.FINAL_NORM_OUTPUT):
            h = fire_head_rows(self.hooks, points.FINAL_NORM_OUTPUT, h, mode, positions, ctx)
        return self.lm_head(h.to(self.device) if self.placement is not None else h)

    def training_forward(self, clean_ids: torch.Tensor, noisy_ids: torch.Tensor, block_size: int | None = None,
                         router_stats: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Training forward (with gradients): the clean sequence causally and its noisy copy, each
        block previewed against the clean prefix before it, in one forward. Returns the logits
        (hidden states through the final norm and LM head) of the clean and the noisy rows [B, L, V]."""
        bs = block_size or self.config.block_size
        if clean_ids.shape != noisy_ids.shape or clean_ids.dim() != 2:
            raise ValueError(f"training_forward: clean and noisy ids must both be [B, L]; got "
                             f"{tuple(clean_ids.shape)} and {tuple(noisy_ids.shape)}")
        L = clean_ids.shape[1]
        if L % bs:
            raise ValueError(f"training_forward: length {L} is not a multiple of the block size {bs}")
        ctx = ForwardContext.training(L, bs, self.device, router_stats)
        logits = self.head(self.hidden_states(torch.cat([clean_ids, noisy_ids], dim=1), ctx))
        return logits[:, :L], logits[:, L:]

    block_forward = training_forward  # the name it had before; the engine's steps are elsewhere

    # ------------------------------------------------------------------ the three modes
    def commit(self, cache: CloverCache, ids, logits: str | None = "last", where: Where = NOWHERE) -> torch.Tensor | None:
        return self.forward(cache, commit_ids=ids, commit_logits=logits, where=where).commit_logits

    def preview(self, cache: CloverCache, block_ids, positions=None, coreset: Coreset | None = None,
                where: Where = NOWHERE) -> torch.Tensor:
        return self.forward(cache, preview_ids=block_ids, preview_positions=positions, coreset=coreset,
                            where=where).preview_logits

    def commit_and_preview(self, cache: CloverCache, commit_ids, block_ids, positions=None,
                           coreset: Coreset | None = None, commit_logits: str | None = None,
                           where: Where = NOWHERE) -> StepOutput:
        return self.forward(cache, commit_ids, block_ids, commit_logits=commit_logits,
                            preview_positions=positions, coreset=coreset, where=where)

    def commit_draft(self, cache: CloverCache, ids, where: Where = NOWHERE) -> DraftCommit:
        """Commit a drafted block ``ids`` [B, m] causally: its logits at every row score each
        drafted token under the causal model (``.logits`` [B, m, V]); ``.keep(lengths)`` then
        leaves the cache holding exactly each row's accepted prefix (``drafts.py``)."""
        records: dict = {}
        before = list(cache.row_lengths) if cache.row_lengths is not None else [cache.length] * cache.batch_size
        logits = self.forward(cache, commit_ids=ids, commit_logits="all", where=where, drafts=records).commit_logits
        return DraftCommit(self, cache, before, logits, records)

    def prefill(self, cache: CloverCache, ids, chunk_size: int = 1024, logits: str | None = "last",
                where: Where = NOWHERE):
        """Commit a long prompt in chunks (bounded activation memory)."""
        ids = self._check_ids(ids, "ids", cache.batch_size)
        cache.check_room(ids.shape[1])
        out = []
        for start in range(0, ids.shape[1], chunk_size):
            piece = ids[:, start:start + chunk_size]
            last = start + chunk_size >= ids.shape[1]
            r = self.commit(cache, piece, logits=logits if (last or logits == "all") else None, where=where)
            if r is not None:
                out.append(r)
        if not out:
            return None
        return torch.cat(out, dim=1) if logits == "all" else out[-1]

    # ------------------------------------------------------------------ packed CPU weights
    def pack_weights(self, enabled: bool = True) -> int:
        """CPU inference: keep every GEMM weight (projections, router, each expert, LM head) also in
        oneDNN's blocked layout, so products stop reordering it on every call: prefill and block
        previews get faster (``bench/compare_transformers.py``), at the price of a second copy of
        the weights in memory. A weight changed in place or replaced is repacked on its next use;
        writes through ``.data`` are not seen (call ``pack_weights()`` again). Returns the bytes
        packed; ``pack_weights(False)`` drops the copies."""
        enabled = flag("pack_weights enabled", enabled, none=False)
        if enabled and not dense.can_pack(self.model.embed_tokens.weight):
            raise ValueError(f"pack_weights: packed weights are for fp32 models (bf16 where the CPU has oneDNN's bf16 "
                             f"GEMM) on an x86 CPU with oneDNN; "
                             f"this model is {str(self.dtype).removeprefix('torch.')} on {self.device}")

        def pack(weight) -> dense.PackedWeight:
            packed = dense.PackedWeight()
            packed.get(weight)
            return packed

        fused = set()  # parts of a fused GEMM: its one weight is packed instead
        for module, group in self.projection_groups():
            if group.weight is not None:
                group.packed = pack(group.weight) if enabled and dense.can_pack(group.weight) else None
                fused.update(id(m) for m in group.modules(module))
        for module in self.modules():  # FP8 weights and offloaded experts are not packed
            if id(module) in fused:
                module.packed = None
            elif isinstance(module, (Linear, Router)) and dense.can_pack(module.weight):
                module.packed = pack(module.weight) if enabled else None
            elif isinstance(module, Experts) and module.store is None and dense.can_pack(module.gate_up_proj):
                module.packed = ([pack(w) for w in module.gate_up_proj],
                                 [pack(w) for w in module.down_proj]) if enabled else None
        return sum(p.nbytes for p in self._packs())

    def _packs(self):
        for _, group in self.projection_groups():
            if group.packed is not None:
                yield group.packed
        for module in self.modules():
            if isinstance(module, (Linear, Router)) and module.packed is not None:
                yield module.packed
            elif isinstance(module, Experts) and module.packed is not None:
                yield from (p for group in module.packed for p in group)

    @property
    def packed_weights(self) -> bool:
        """Whether ``pack_weights`` is on."""
        return self.lm_head.packed is not None

    # ------------------------------------------------------------------ convenience
    def logits(self, input_ids) -> torch.Tensor:
        """Causal next-token logits of whole sequences [B, T] -> [B, T, V]; no cache needed."""
        ids = torch.as_tensor(input_ids)
        ids = ids[None] if ids.dim() == 1 else ids
        cache = self.new_cache(ids.shape[1], ids.shape[0])
        return self.commit(cache, ids, logits="all")

    def denoise_logits(self, prefix_ids, block_ids) -> torch.Tensor:
        """The prefix committed, then one preview of the block: logits [B, m, V] at every block position."""
        prefix = torch.as_tensor(prefix_ids)
        prefix = prefix[None] if prefix.dim() == 1 else prefix
        cache = self.new_cache(max(prefix.shape[1], 1), prefix.shape[0])
        if prefix.shape[1]:
            self.commit(cache, prefix, logits=None)
        return self.preview(cache, block_ids)
