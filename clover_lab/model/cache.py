"""The committed-prefix state: K,V per attention layer (preallocated to a max length) and
the conv ring + fp32 recurrent state S per GDN layer. Previews read it and never write it."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from clover_lab.config import CloverConfig
from clover_lab.errors import CloverError


class CacheFullError(CloverError, ValueError):
    """A commit would run past the cache's preallocated length."""


@dataclass
class AttentionCache:
    k: torch.Tensor  # [B, H_kv, max_len, head_dim]
    v: torch.Tensor  # [B, H_kv, max_len, head_dim]


@dataclass
class GDNCache:
    ring: torch.Tensor  # [B, conv_dim, K-1]: the last K-1 pre-convolution q,k,v rows
    state: torch.Tensor  # [B, H_v, d_k, d_v], fp32


def layer_shapes(config: CloverConfig, max_len: int, batch_size: int, dtype: torch.dtype):
    """Per layer (index, layer type, [(shape, dtype)] of its cache tensors in field order): the one
    place cache sizes are decided. K,V grow with ``max_len``; the GDN ring and state do not."""
    for i, kind in enumerate(config.layer_types):
        if kind == "full_attention":
            kv = (batch_size, config.num_key_value_heads, max_len, config.head_dim)
            yield i, kind, [(kv, dtype), (kv, dtype)]
        else:
            ring = (batch_size, config.conv_dim, config.linear_conv_kernel_dim - 1)
            state = (batch_size, config.linear_num_value_heads, config.linear_key_head_dim,
                     config.linear_value_head_dim)
            yield i, kind, [(ring, dtype), (state, torch.float32)]


def cache_bytes(config: CloverConfig, max_len: int, batch_size: int = 1, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of a cache of ``max_len`` positions, without allocating it."""
    return sum(math.prod(shape) * torch.empty((), dtype=dt).element_size()
               for _, _, shapes in layer_shapes(config, max_len, batch_size, dtype) for shape, dt in shapes)


class CloverCache:
    """State of the committed prefix for every layer; ``length`` tokens are committed.

    A batch whose rows hold different numbers of tokens (prompts of different lengths) keeps
    them in ``row_lengths``; ``length`` is then the longest. Each row's K,V lie at positions
    [0, its length) and attention masks the rest (the GDN state and ring hold no positions)."""

    def __init__(self, layers: dict[int, AttentionCache | GDNCache], max_len: int, batch_size: int):
        self.layers = layers
        self.max_len = max_len
        self.batch_size = batch_size
        self.length = 0
        self.row_lengths: list[int] | None = None

    @property
    def ragged(self) -> bool:
        """The rows hold different numbers of committed tokens."""
        return self.row_lengths is not None and len(set(self.row_lengths)) > 1

    def set_row_lengths(self, lengths: list[int]) -> None:
        if len(lengths) != self.batch_size or not all(0 <= n <= self.max_len for n in lengths):
            raise ValueError(f"row lengths {lengths}: expected {self.batch_size} lengths in [0, {self.max_len}]")
        self.row_lengths = list(lengths)
        self.length = max(lengths)

    def advance(self, n: int) -> None:
        """``n`` more tokens committed in every row."""
        self.length += n
        if self.row_lengths is not None:
            self.row_lengths = [length + n for length in self.row_lengths]

    def row(self, r: int) -> "CloverCache":
        """Row ``r`` as a cache of batch 1 whose tensors are views of this one's (commits into it
        land here); its length starts at 0: fill it, then :meth:`set_row_lengths`."""
        layers = {i: type(layer)(*(t[r:r + 1] for t in _fields(layer))) for i, layer in self.layers.items()}
        return CloverCache(layers, self.max_len, 1)

    def select(self, rows: list[int]) -> "CloverCache":
        """A new cache holding these rows, in this order (copies)."""
        index = _RowIndex(rows)
        layers = {i: type(layer)(*(t.index_select(0, index.on(t.device)) for t in _fields(layer)))
                  for i, layer in self.layers.items()}
        out = CloverCache(layers, self.max_len, len(rows))
        if self.row_lengths is not None:
            out.set_row_lengths([self.row_lengths[r] for r in rows])
        else:
            out.length = self.length
        return out

    @classmethod
    def allocate(cls, config: CloverConfig, max_len: int, batch_size: int = 1, device=None,
                 dtype: torch.dtype = torch.float32) -> "CloverCache":
        """``device``: one device, or a dict layer -> device (a model placed over devices)."""
        for name, v in (("max_len", max_len), ("batch_size", batch_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"cache {name} must be a positive integer, got {v!r}")
        if max_len > config.max_position_embeddings:
            raise CacheFullError(f"cache length {max_len} exceeds the context length "
                                 f"max_position_embeddings={config.max_position_embeddings}")
        layers: dict[int, AttentionCache | GDNCache] = {}
        for i, kind, shapes in layer_shapes(config, max_len, batch_size, dtype):
            where = device.get(i) if isinstance(device, dict) else device
            tensors = [torch.zeros(shape, device=where, dtype=dt) for shape, dt in shapes]
            layers[i] = AttentionCache(*tensors) if kind == "full_attention" else GDNCache(*tensors)
        return cls(layers, max_len, batch_size)

    def put(self, rows: list[int], part: "CloverCache") -> None:
        """Write ``part`` (a cache of len(rows) rows, as :meth:`select` gives; of as many positions
        as this one or fewer) into these rows."""
        if (part.batch_size != len(rows) or part.layers.keys() != self.layers.keys()
                or part.max_len > self.max_len):
            raise ValueError(f"put: a cache of {part.batch_size} rows x {part.max_len} positions cannot fill rows "
                             f"{rows} of {self.max_len} positions")
        index = _RowIndex(rows)
        for i, layer in self.layers.items():
            for mine, theirs in zip(_fields(layer), _fields(part.layers[i])):
                if isinstance(layer, AttentionCache) and part.max_len < self.max_len:
                    mine = mine.narrow(2, 0, part.max_len)  # K,V's positions: the part's first ones
                mine.index_copy_(0, index.on(mine.device), theirs.to(mine.device))

    @property
    def free(self) -> int:
        return self.max_len - self.length

    def check_room(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise CacheFullError(f"committing {n} tokens at length {self.length} would exceed the cache's "
                                 f"{self.max_len} positions")

    def tensors(self):
        for layer in self.layers.values():
            yield from _fields(layer)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def clone(self) -> "CloverCache":
        """An independent copy, to branch a generation (only the committed rows of K,V matter)."""
        layers = {}
        for i, layer in self.layers.items():
            if isinstance(layer, AttentionCache):
                layers[i] = AttentionCache(layer.k.clone(), layer.v.clone())
            else:
                layers[i] = GDNCache(layer.ring.clone(), layer.state.clone())
        out = CloverCache(layers, self.max_len, self.batch_size)
        out.length = self.length
        out.row_lengths = None if self.row_lengths is None else list(self.row_lengths)
        return out

    def restore(self, snapshot: "CloverCache") -> None:
        """Make this cache equal to ``snapshot`` (taken by :meth:`clone`), in place."""
        if snapshot.layers.keys() != self.layers.keys() or snapshot.max_len != self.max_len:
            raise ValueError("restore: the snapshot was taken from a cache of another shape")
        for mine, theirs in zip(self.tensors(), snapshot.tensors()):
            mine.copy_(theirs)
        self.length = snapshot.length
        self.row_lengths = None if snapshot.row_lengths is None else list(snapshot.row_lengths)

    def reset(self) -> None:
        for t in self.tensors():
            t.zero_()
        self.length = 0
        self.row_lengths = None


def _fields(layer: AttentionCache | GDNCache) -> tuple[torch.Tensor, torch.Tensor]:
    return (layer.k, layer.v) if isinstance(layer, AttentionCache) else (layer.ring, layer.state)


class _RowIndex:
    """Batch rows as an index tensor, made once per device (a placed model's cache spans several)."""

    def __init__(self, rows: list[int]):
        self.rows, self._on = rows, {}

    def on(self, device) -> torch.Tensor:
        if device not in self._on:
            self._on[device] = torch.tensor(self.rows, device=device)
        return self._on[device]
