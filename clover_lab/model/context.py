"""The forward's layout: which rows a forward commits and previews, at which positions, against
which cache, and the per-block expert coreset. Three layouts, one named constructor each:

- ``cached``: the engine's forward. Rows [0, c) are committed at the cache's length n, rows
  [c, c + m) are a block previewed after them. The cache advances only when the forward succeeds.
  A batch whose rows stand at different lengths (``cache.ragged``) has positions [B, c + m],
  each row from its own length. ``commit_rows`` packs rows that commit beside rows that only
  preview into one forward: a row that does not commit previews right after its own length, its
  commit rows are padding (written past its length, never read, its GDN state and ring kept).
- ``static``: the same with static shapes for CUDA graphs and torch.compile: the rows'
  committed lengths are a [B] device tensor (positions [B, c + m], each row from its own length)
  and attention runs over the cache's whole buffer with a mask.
- ``packed``: rows in different phases in one forward (``segments``): every token of the step
  in one row [1, N] (the embedding, norms, MoE and LM head over all of them at once), each
  segment a cache row's commit (causal, at its own length: a prefill chunk, an AR token, a
  block) and/or its block's preview after it; the mixers run per group of segments of one shape.
- ``training``: no cache. Rows [0, L) are a clean sequence from position 0, run causally; rows
  [L, 2L) a noisy copy, each block of ``block_size`` rows previewed against the clean prefix
  before it, exactly as the engine previews it against its cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from clover_lab.hooks.events import NOWHERE, Where
from clover_lab.model.cache import CloverCache


@dataclass
class Coreset:
    """Per-block expert coreset (spec 3.3): the first preview of a block records, per MoE layer,
    the ``size`` experts with the largest router probability summed over the block's tokens;
    later previews of the block route only among them. Commit always routes over all experts.

    ``experts`` holds the recorded layers of the current block. Once recorded, a layer's tensor
    is reused (written in place) by later blocks, so that a CUDA graph can read it."""

    size: int
    experts: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [size] expert ids
    _buffers: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"Coreset size must be a positive integer, got {self.size!r}")

    def reset(self) -> None:
        self.experts.clear()

    def subset(self, rows: list[int]) -> "Coreset":
        """The recorded coresets of these batch rows, for a forward over them alone (read only:
        a coreset is recorded by the block's first preview, over every row)."""
        out = Coreset(self.size)
        for layer, ids in self.experts.items():
            out.experts[layer] = ids[torch.tensor(rows, device=ids.device)] if ids.dim() == 2 else ids
        return out

    def keep(self, rows: list[int]) -> None:
        """A batch lost rows mid-block: keep the per-row coresets of these rows, in this order."""
        for layer, ids in list(self.experts.items()):
            if ids.dim() == 2:
                kept = ids[torch.tensor(rows, device=ids.device)]
                self.record(layer, kept[0] if len(rows) == 1 else kept)  # one row's coreset is [size]

    def record(self, layer: int, ids: torch.Tensor) -> None:
        """A layer's coreset: ``ids`` [size] (one row) or [rows, size], into the buffer kept for
        that shape (a batch of another size has buffers of its own: a CUDA graph keeps reading its own)."""
        self.experts[layer] = self.buffer(layer, tuple(ids.shape), ids.device).copy_(ids)

    def buffer(self, layer: int, shape: tuple, device) -> torch.Tensor:
        """The int64 buffer kept for a layer's coreset of this shape, made on first use: the
        block's first preview records into it in place (the router's kernel writes it)."""
        key = (layer, tuple(shape))
        buf = self._buffers.get(key)
        if buf is None or buf.device != torch.device(device):
            buf = self._buffers[key] = torch.empty(shape, dtype=torch.long, device=device)
        return buf

    def buffers(self, rows: int) -> dict[int, torch.Tensor]:
        """layer -> the buffer a batch of ``rows`` rows records into (what a replayed graph wrote)."""
        lead = () if rows == 1 else (rows,)
        return {layer: buf for (layer, shape), buf in self._buffers.items() if shape[:-1] == lead}


@dataclass(frozen=True)
class Segment:
    """One cache row's part of a packed forward: ``commit`` tokens committed causally at the row's
    length, then ``preview`` block tokens previewed after them; its tokens lie at [offset,
    offset + commit + preview) of the forward."""

    row: int
    commit: int
    preview: int
    offset: int = 0
    draft: bool = False  # a drafted block's commit: the GDN layers record what keeping a prefix of it needs

    @property
    def width(self) -> int:
        return self.commit + self.preview


@dataclass
class SegmentGroup:
    """The segments of a packed forward that share a shape (commit, preview): their cache rows
    ``rows`` [G], their tokens ``tokens`` [G, c + m] (indices into the forward), their committed
    lengths (host) and positions [G, c + m]; a mixer runs them as one batch."""

    c: int
    m: int
    rows: torch.Tensor
    tokens: torch.Tensor
    lengths: list[int]
    positions: torch.Tensor
    draft: bool = False  # the segments are drafted blocks' commits (``drafts.py``)
    members: list = field(default_factory=list)  # the cache rows, on the host


class RouterStats:
    """Where a training forward's MoE layers append (router probs [T, E], expert ids [T, k]), into
    the caller's list. Deliberately neither a list nor a dataclass: FSDP2 rebuilds a layer's
    inputs (lists and dataclasses included) once they hold tensors that need a gradient, and the
    layers after the first would append to a copy; this object it hands on as it is."""

    __slots__ = ("rows",)

    def __init__(self, rows: list):
        self.rows = rows

    def append(self, item: tuple) -> None:
        self.rows.append(item)


@dataclass
class ForwardContext:
    """What one forward does; build it with :meth:`cached`, :meth:`static` or :meth:`training`."""

    c: int  # commit rows (training: the clean sequence's length)
    m: int  # preview rows
    positions: torch.Tensor  # [c + m] absolute positions of the rows ([B, c + m] when the rows differ)
    cache: CloverCache | None = None
    n: int | None = None  # committed length before the forward (cached layout)
    n_dev: torch.Tensor | None = None  # the rows' committed lengths [B] on the device (static layout)
    block_size: int | None = None  # training layout: the block size the noisy copy is split into
    coreset: Coreset | None = None
    router_stats: RouterStats | None = None  # training: (router probs, expert ids) per MoE part
    hooks: bool = True  # False: hook points are not even looked up (static steps refuse hooks)
    where: Where = NOWHERE  # where the generation stands, for the events the forward fires
    rope: object = None  # the model's ``Rotary`` (its frequencies), for every attention layer
    pending: list = field(default_factory=list)  # (destination, source) cache writes, applied on success
    drafts: dict | None = None  # a draft commit: GDN layer -> what its rollback needs (``drafts.py``)
    # a static step: points whose hooks all only observe, read after the step from what it
    # records here (``record``; ``engine/observed.py``)
    observed: frozenset = frozenset()
    observations: list = field(default_factory=list)
    # a static step off a CUDA graph: the cache rows its attention reads, a host bound on every
    # row's committed length plus the step's rows (None: the whole buffer)
    keys: int | None = None
    # the rows whose commit lands, [B] bool on the device (None: every row); ``committing`` the same
    # on the host
    commit_rows: torch.Tensor | None = None
    committing: list[bool] | None = None
    # a packed forward: its segments' groups by shape (the mixers run each group as a batch)
    groups: list[SegmentGroup] | None = None

    @classmethod
    def cached(cls, cache: CloverCache, c: int, m: int, device, coreset: Coreset | None = None,
               where: Where = NOWHERE, commit_rows: list[bool] | None = None) -> "ForwardContext":
        n = cache.length
        if commit_rows is None or all(commit_rows) or not c:
            return cls(c, m, row_positions(cache.row_lengths if cache.ragged else [n], c + m, device), cache=cache,
                       n=n, coreset=coreset, where=where)
        lengths = cache.row_lengths or [n] * cache.batch_size
        # [B, c + m]: a row's commit rows from its length; its block after them, or after its length
        # when it does not commit (its commit rows are padding past its length)
        top = cache.max_len - 1  # a padding row near the end of the cache writes its scratch K,V at the last position
        positions = torch.tensor([[min(n_r + j, top) if not k else n_r + j for j in range(c)]
                                  + [n_r + (c if k else 0) + j for j in range(m)]
                                  for n_r, k in zip(lengths, commit_rows)], device=device)
        return cls(c, m, positions, cache=cache, n=n, coreset=coreset, where=where,
                   commit_rows=torch.tensor(commit_rows, device=device), committing=list(commit_rows))

    @classmethod
    def packed(cls, cache: CloverCache, segments: list[Segment], device, where: Where = NOWHERE) -> "ForwardContext":
        """Segments of rows in different phases, their tokens one after another in one row: no hook
        inside the model runs (the step loop packs only rows without one)."""
        lengths = cache.row_lengths or [cache.length] * cache.batch_size
        positions, shapes = [], {}
        for s in segments:
            positions += range(lengths[s.row], lengths[s.row] + s.width)
            shapes.setdefault((s.commit, s.preview, s.draft), []).append(s)
        groups = []
        for (c, m, draft), members in shapes.items():
            tokens = torch.tensor([list(range(s.offset, s.offset + c + m)) for s in members], device=device)
            at = [lengths[s.row] for s in members]
            groups.append(SegmentGroup(c, m, torch.tensor([s.row for s in members], device=device), tokens, at,
                                       torch.tensor(at, device=device)[:, None] + torch.arange(c + m, device=device),
                                       draft, [s.row for s in members]))
        n = len(positions)
        return cls(n, 0, torch.tensor(positions, device=device), cache=cache, n=cache.length, hooks=False,
                   where=where, groups=groups)

    @classmethod
    def static(cls, cache: CloverCache, n: torch.Tensor, c: int, m: int,
               coreset: Coreset | None = None, observed: frozenset = frozenset(),
               keys: int | None = None) -> "ForwardContext":
        """``n``: each row's committed length, [B] on the device. ``observed``: points whose
        observers read the step's records afterwards (no hook is called inside a static step).
        ``keys``: the cache rows attention reads (``graphs.key_span``), None for the whole buffer."""
        return cls(c, m, n[:, None] + torch.arange(c + m, device=n.device), cache=cache, n_dev=n, coreset=coreset,
                   hooks=False, observed=observed, where=NOWHERE,  # given: torch.compile cannot wrap a default
                   keys=keys)

    @classmethod
    def training(cls, length: int, block_size: int, device, router_stats: list | None = None) -> "ForwardContext":
        clean = torch.arange(length, device=device)
        return cls(length, length, torch.cat([clean, clean]), block_size=block_size,  # noisy rows at clean positions
                   router_stats=None if router_stats is None else RouterStats(router_stats))

    def record(self, point: str, mode: str, lo: int, hi: int, flat: bool, **fields) -> None:
        """A static step's event at ``point`` for observers that read after the step: ``fields``
        the device tensors it carries (the point's declared ``recorded`` fields) for rows [lo, hi)
        of every batch row, flattened over the batch (``flat``: [B * (hi - lo), ...]) or one
        entry per batch row ([B, ...])."""
        self.observations.append((point, mode, lo, hi, flat, fields))

    def publish(self) -> None:
        """The forward succeeded: its deferred cache writes (GDN rings and states) land."""
        publish(self.pending)

    def flat_positions(self, lo: int, hi: int, batch: int) -> torch.Tensor:
        """Positions of rows [lo, hi) of every batch row, flattened over the batch: [batch * (hi - lo)]."""
        if self.positions.dim() == 2:
            return self.positions[:, lo:hi].reshape(-1)
        return self.positions[lo:hi].repeat(batch)

    @property
    def is_ragged(self) -> bool:
        return self.positions.dim() == 2

    @property
    def is_packed(self) -> bool:
        return self.groups is not None

    @property
    def is_training(self) -> bool:
        return self.block_size is not None

    @property
    def is_static(self) -> bool:
        return self.n_dev is not None


def row_positions(lengths: list[int], rows: int, device) -> torch.Tensor:
    """The absolute positions of ``rows`` rows after committed ``lengths``: [rows] from one
    length, [B, rows] from a batch's rows at different lengths (each row from its own)."""
    if len(set(lengths)) > 1:
        return torch.tensor(lengths, device=device)[:, None] + torch.arange(rows, device=device)
    return torch.arange(lengths[0], lengths[0] + rows, device=device)


def publish(pending: list) -> None:
    """Deferred cache writes, (destination, source) pairs (or (destination, batch rows, source)
    triples), land (a forward, or a static step
    whose observers have read, succeeded): one multi-tensor copy per device and dtype (a launch
    or few on a GPU, not two per layer)."""
    groups: dict = {}
    for write in pending:
        if len(write) == 3:  # (destination, batch rows, source): a packed forward's rows
            dst, rows, src = write
            dst.index_copy_(0, rows.to(dst.device), src.to(dst.dtype))
            continue
        dst, src = write
        dsts, srcs = groups.setdefault((dst.device, dst.dtype, src.device, src.dtype), ([], []))
        dsts.append(dst)
        srcs.append(src)
    for dsts, srcs in groups.values():
        torch._foreach_copy_(dsts, srcs)
