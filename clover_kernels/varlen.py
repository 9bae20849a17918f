"""Variable-length packed batches (flash-linear-attention's and flash-attn's ``cu_seqlens``
convention): N rows' segments of different lengths on one token axis [1, T, ...], segment n the
tokens [cu_seqlens[n], cu_seqlens[n + 1]); per-row tensors (a ring, a GDN state, a cache row) have
N rows. The varlen ops (``gdn_commit_varlen``, ``gdn_preview_varlen``, ``cache_attention_varlen``)
check their arguments here, and their torch references run each segment alone through the dense
op (``segments``). Torch only: the Triton device function that finds a segment is
``gdn.common.segment``."""
from __future__ import annotations

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


def check_segments(op: str, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int | None,
                   **per_row: torch.Tensor) -> tuple[int, int]:
    """Validates a varlen call: ``x`` the packed input [1, T, ...], ``cu_seqlens`` [N + 1] int32 or
    int64 on x's device, each of ``per_row`` (name=tensor) N rows. Returns (N, the longest segment's
    length): ``max_seqlen`` when given (nothing is read on the host), else read from cu_seqlens,
    whose values are then checked too."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 \
            or cu_seqlens.dtype not in INDEX_DTYPES:
        got = (f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}" if isinstance(cu_seqlens, torch.Tensor)
               else type(cu_seqlens).__name__)
        raise ValueError(f"{op}: cu_seqlens must be [N + 1] int32 or int64 offsets (N >= 1 segments), got {got}")
    if cu_seqlens.device != x.device:
        raise ValueError(f"{op}: cu_seqlens is on {cu_seqlens.device}, the packed input on {x.device}")
    if x.dim() < 2 or x.shape[0] != 1:
        raise ValueError(f"{op}: the packed input must be [1, T, ...] (every segment on one token axis), "
                         f"got {tuple(x.shape)}")
    N, T = cu_seqlens.shape[0] - 1, x.shape[1]
    for name, t in per_row.items():
        if t.shape[0] != N:
            raise ValueError(f"{op}: {name} must have one row per segment ({N}), got {tuple(t.shape)}")
    if max_seqlen is not None:
        if int(max_seqlen) < 0:
            raise ValueError(f"{op}: max_seqlen {max_seqlen} < 0")
        return N, int(max_seqlen)
    bounds = spans(cu_seqlens)
    if bounds[0][0] != 0 or bounds[-1][1] != T or any(e < b for b, e in bounds):
        raise ValueError(f"{op}: cu_seqlens {cu_seqlens.tolist()} must start at 0, never decrease and end at "
                         f"the packed length {T}")
    return N, max(e - b for b, e in bounds)


def spans(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """[(begin, end)] of each segment, read on the host (the references' loop)."""
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def offsets(lengths, device=None) -> torch.Tensor:
    """cu_seqlens (int32) of segments of these lengths: 0 and their running sums."""
    lengths = torch.as_tensor(list(lengths), dtype=torch.int32)
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)]).to(device)
