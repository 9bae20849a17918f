"""Split-KV attention of a step's rows over the live keys of the cache, in two Triton kernels.
Reference: ``attention/torch.py: cache_attention`` (same arguments, same result).

``last`` [B, T] is read on the device: each row sees keys [0, last[b, t]] (a block's rows, the final
``block_rows``, the final row's: each program picks the row it reads), and no program reads a key
past the largest of its rows, so a CUDA graph captured once reads the live keys at every length
(the grid depends on shapes only).

1. ``_split_kv_kernel``, one program per (batch row, kv head, tile of query rows, split). GQA:
   the G = Hq / Hkv query heads that share a kv head are folded into the query rows (row
   r = g * T + t), so each K,V tile is read once for the whole group (no repeat). The live range
   [0, max last + 1) of the tile is cut into SPLITS slices of whole key tiles; each program runs
   the online softmax over its slice and writes its unnormalised sum, running max and
   denominator (fp32). Slices past the live range read nothing.
2. ``_combine_kernel``, one program per (batch row, row, query head): the log-sum-exp merge of the
   slices, times sigmoid(gate), written as [B, T, Hq * D] (the layout o_proj takes).

``cache_attention_varlen``: the rows' segments packed on one token axis (``varlen.py``), the same
two kernels with ``VARLEN``: a program's batch row is a segment (its cache row), whose queries, last
keys and partials sit at the segment's offset of the packed axis; the merge runs as one batch row.
"""
import torch
import triton
import triton.language as tl

from ..gdn.common import segment
from ..varlen import check_segments

SMS = 132  # H200 streaming multiprocessors: the split count fills about two waves of programs
MAX_SPLITS = 32


@triton.jit
def _split_kv_kernel(q_ptr, k_ptr, v_ptr, last_ptr, acc_ptr, m_ptr, l_ptr, cu_ptr,
                     T, C, G, ROWS, HKV, D, R, s_qb, s_qh, s_qt, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_lb, s_lt,
                     scale_log2, SPLITS, DP: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tiles = tl.cdiv(ROWS, BLOCK_M)  # varlen: ROWS = G * the longest segment
    tile = pid % tiles
    h = (pid // tiles) % HKV
    b = (pid // tiles // HKV).to(tl.int64)  # varlen: the segment, its cache row b
    T_ALL = T  # the token axis' length (the partials' row stride)
    if VARLEN:  # segment b's rows of the packed axis (q's, last's and gate's batch strides 0)
        bos, length = segment(cu_ptr, b)
        length = length.to(tl.int32)  # (an int64 length made r // T a 64-bit division, which spilled)
        C = length
        ROWS = G * length
        T = tl.maximum(length, 1)  # (an empty segment: every row masked)
        q_ptr += bos * s_qt
        last_ptr += bos * s_lt
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = r < ROWS
    g, t = r // T, r % T
    hq = h * G + g
    last = tl.load(last_ptr + b * s_lb + tl.where(t < C, t, T - 1) * s_lt, mask=rm, other=-1)  # a block: its last row's
    live = tl.max(last, axis=0) + 1  # the tile's keys: [0, live)
    chunk = tl.cdiv(tl.cdiv(live, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, live)
    d = tl.arange(0, DP)
    dm = d < D
    q = tl.load(q_ptr + b * s_qb + hq[:, None] * s_qh + t[:, None] * s_qt + d[None, :], mask=rm[:, None] & dm[None, :],
                other=0.0)
    k_base = k_ptr + b * s_kb + h * s_kh
    v_base = v_ptr + b * s_vb + h * s_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DP], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nm = n < hi
        k = tl.load(k_base + n[None, :] * s_kl + d[:, None], mask=nm[None, :] & dm[:, None], other=0.0)  # [DP, N]
        s = tl.dot(q, k, input_precision=PREC) * scale_log2
        s = tl.where(n[None, :] <= last[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key here yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + n[:, None] * s_vl + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    # the partials as [SPLITS, B, Hq, T] rows (R of them per split; varlen: B = 1 over the packed axis)
    if VARLEN:
        out = split * R + hq * T_ALL + bos + t
    else:
        out = split * R + (b * HKV * G + hq) * T + t
    tl.store(acc_ptr + out[:, None] * D + d[None, :], acc, mask=rm[:, None] & dm[None, :])
    tl.store(m_ptr + out, m_i, mask=rm)
    tl.store(l_ptr + out, l_i, mask=rm)


@triton.jit
def _combine_kernel(acc_ptr, m_ptr, l_ptr, gate_ptr, o_ptr, T, HQ, R, D, s_gb, s_gt, s_gh, s_ob, s_ot, SPLITS,
                    BLOCK_S: tl.constexpr, DP: tl.constexpr):
    pid = tl.program_id(0)  # (b, hq, t) in the partials' row order
    t = pid % T
    hq = (pid // T) % HQ
    b = (pid // T // HQ).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    sm = s < SPLITS
    d = tl.arange(0, DP)
    dm = d < D
    m = tl.load(m_ptr + s * R + pid, mask=sm, other=float("-inf"))
    l = tl.load(l_ptr + s * R + pid, mask=sm, other=0.0)
    top = tl.max(m, axis=0)
    w = tl.exp2(m - tl.where(top == float("-inf"), 0.0, top))  # 0 for a slice with no visible key
    den = tl.sum(w * l, axis=0)
    acc = tl.load(acc_ptr + (s[:, None] * R + pid) * D + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(den == 0.0, 1.0, den)
    gate = tl.load(gate_ptr + b * s_gb + t * s_gt + hq * s_gh + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(o_ptr + b * s_ob + t * s_ot + hq * D + d, (o * tl.sigmoid(gate)).to(o_ptr.dtype.element_ty), mask=dm)


def tiles_for(dtype: torch.dtype, rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a head_dim of up to 256 (fp32 tiles are twice as wide)."""
    block_m = 16 if rows <= 16 else 32 if (dtype == torch.float32 or rows <= 32) else 64
    return block_m, 32, 4 if block_m <= 16 else 8


def split_count(programs: int, length: int, block_n: int, min_keys: int = 0) -> int:
    """Slices of the key range per (row tile, kv head): enough programs for two waves of the GPU,
    at most one per ``max(block_n, min_keys)`` keys of the buffer. A function of shapes only (a
    CUDA graph keeps its grid at every length)."""
    return max(1, min(MAX_SPLITS, -(-2 * SMS // programs), -(-length // max(block_n, min_keys))))


def min_split_keys(rows: int, tiles: int, elem_bytes: int) -> int:
    """Keys per slice at which a slice's fp32 partials (rows x (D + 2) x 4 bytes, written and read
    back) cost about a quarter of its K,V reads (tiles x 2 x D x elem_bytes per key)."""
    return 16 * rows // (tiles * elem_bytes)


def cache_attention(q, k, v, last, gate, block_rows: int = 0, splits: int | None = None):
    """Same contract as ``attention.torch.cache_attention``; ``splits`` overrides ``split_count``."""
    B, HQ, T, D = q.shape
    HKV, L = k.shape[1], k.shape[2]
    if (HQ % HKV or k.shape != v.shape or k.shape[-1] != D or k.shape[0] != B or last.shape != (B, T)
            or not 0 <= block_rows <= T):
        raise ValueError(f"cache_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"last {tuple(last.shape)}, block_rows {block_rows}: expected Hq a multiple of Hkv, "
                         f"k and v alike, last [B, T], 0 <= block_rows <= T")
    G = HQ // HKV
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    gate = gate.reshape(B, T, HQ, D) if gate.dim() == 3 else gate  # or q_proj's per-head views, read in place
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    rows = G * T
    block_m, block_n, warps = tiles_for(q.dtype, rows)
    tiles = triton.cdiv(rows, block_m)
    S = splits or split_count(B * HKV * tiles, L, block_n, min_split_keys(rows, tiles, q.element_size()))
    acc = torch.empty(S, B, HQ, T, D, dtype=torch.float32, device=q.device)
    m = torch.empty(S, B, HQ, T, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    out = torch.empty(B, T, HQ * D, dtype=q.dtype, device=q.device)
    if B * T == 0:
        return out
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    _split_kv_kernel[(B * HKV * tiles, S)](
        q, k, v, last, acc, m, l, last, T, T - block_rows, G, rows, HKV, D, B * HQ * T,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), last.stride(0), last.stride(1),
        1.4426950408889634 / D ** 0.5, S, DP=max(16, triton.next_power_of_2(D)), BLOCK_M=block_m, BLOCK_N=block_n,
        PREC=prec, VARLEN=False, num_warps=warps)
    _combine_kernel[(B * HQ * T,)](acc, m, l, gate, out, T, HQ, B * HQ * T, D, gate.stride(0), gate.stride(1),
                                   gate.stride(2), out.stride(0), out.stride(1), S, BLOCK_S=triton.next_power_of_2(S),
                                   DP=triton.next_power_of_2(D), num_warps=4)
    return out


def cache_attention_varlen(q, k, v, last, gate, cu_seqlens, max_seqlen: int | None = None, splits: int | None = None):
    """Same contract as ``attention.torch.cache_attention_varlen``: the rows' segments packed on one
    token axis (``varlen.py``), segment n's queries over cache row n. q [1, Hq, T, D] (a view of
    [1, T, Hq, D]), k, v [N, Hkv, L, D], last [1, T], gate [1, T, Hq * D] (or its per-head view);
    returns [1, T, Hq * D].

    ``max_seqlen``: the longest segment's length, which sizes the grid (row tiles per segment);
    None reads it from cu_seqlens (one host transfer; cu_seqlens is then checked). Given, nothing is
    read on the host (a CUDA graph can capture the call). ``splits`` overrides ``split_count``."""
    _, HQ, T, D = q.shape
    N, longest = check_segments("cache_attention_varlen", q.transpose(1, 2), cu_seqlens, max_seqlen, k=k, v=v)
    HKV, L = k.shape[1], k.shape[2]
    if HQ % HKV or k.shape != v.shape or k.shape[-1] != D or tuple(last.shape) != (1, T):
        raise ValueError(f"cache_attention_varlen: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"last {tuple(last.shape)}: expected Hq a multiple of Hkv, k and v alike [N, Hkv, L, {D}], "
                         f"last [1, {T}]")
    G = HQ // HKV
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    gate = gate.reshape(1, T, HQ, D) if gate.dim() == 3 else gate
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    rows = G * max(longest, 1)
    block_m, block_n, warps = tiles_for(q.dtype, rows)
    tiles = triton.cdiv(rows, block_m)
    S = splits or split_count(N * HKV * tiles, L, block_n, min_split_keys(rows, tiles, q.element_size()))
    acc = torch.empty(S, 1, HQ, T, D, dtype=torch.float32, device=q.device)
    m = torch.empty(S, 1, HQ, T, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    out = torch.empty(1, T, HQ * D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    _split_kv_kernel[(N * HKV * tiles, S)](
        q, k, v, last, acc, m, l, cu_seqlens, T, T, G, rows, HKV, D, HQ * T,
        0, q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), 0, last.stride(1),
        1.4426950408889634 / D ** 0.5, S, DP=max(16, triton.next_power_of_2(D)), BLOCK_M=block_m, BLOCK_N=block_n,
        PREC=prec, VARLEN=True, num_warps=warps)
    # the partials are [SPLITS, 1, Hq, T] over the packed axis: the dense merge, one batch row
    _combine_kernel[(HQ * T,)](acc, m, l, gate, out, T, HQ, HQ * T, D, gate.stride(0), gate.stride(1),
                               gate.stride(2), out.stride(0), out.stride(1), S, BLOCK_S=triton.next_power_of_2(S),
                               DP=triton.next_power_of_2(D), num_warps=4)
    return out
