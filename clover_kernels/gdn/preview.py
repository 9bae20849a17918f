"""Triton kernel of Clover's GDN preview operator (reference: ``gdn/naive.py: gdn_preview``).

One launch per layer, grid [dv tiles, B * Hv]; each program owns a value head (and a tile
of its value dims) for the whole block of m <= 64 rows:

    conv with causal + right taps (from the frozen ring and the block) -> SiLU
    -> q, k of the head's key head (L2-normalised in registers), v tile
    -> history read h = (q / sqrt(dk)) @ S0[:, tile]
    -> block logits s = exp(block_scale) q k^T (both directions), history logit
       history_bias + history_log_n * ln(m), softmax over [block ; history] in fp32
    -> o = p_block v + p_hist h.

``gdn_preview_varlen``: rows' blocks of different lengths packed on one token axis (``varlen.py``),
the same kernel with ``VARLEN``: a program's batch row is a block (its ring's and state's row), read
at its offset of the packed axis, its history logit at its own length.

Nothing is written but o, p_hist (by the programs of the first dv tile) and, when asked, h.
The q/k conv is recomputed per dv tile: with dv <= 64 there is one tile, and it costs a few
K-tap loads of data that sits in L2 otherwise.
"""
import math

import torch
import triton
import triton.language as tl

from ..varlen import check_segments
from .common import check_gdn_shapes, conv_tile, dot_precision, l2norm_rows, last_dim_contiguous, segment
from .naive import check_out

MAX_BLOCK = 64  # the block fits one tile of rows; longer blocks run the reference


@triton.jit
def _preview_kernel(mixed_ptr, ring_ptr, cw_ptr, rw_ptr, s0_ptr, bs_ptr, hb_ptr, hln_ptr,
                    o_ptr, p_ptr, h_ptr, cu_ptr, m, log_m,
                    s_mb, s_mt, s_rb, s_rc, s_ri, s_ob, s_ot, s_oh, s_pb, s_pt, s_hb, s_ht, s_hh,
                    HV, REP, KEY_DIM, scale,
                    K: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, BM: tl.constexpr, RETURN_H: tl.constexpr, PREC: tl.constexpr,
                    VARLEN: tl.constexpr):
    pid_v = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // HV  # varlen: the block (its ring's and state's row); the token axis' batch strides 0
    h = pid_bh % HV
    if VARLEN:  # block b's rows of the packed axis, its history logit at its own length
        bos, m = segment(cu_ptr, b)
        log_m = tl.log(tl.maximum(m, 1).to(tl.float32))
        mixed_ptr += bos * s_mt
        o_ptr += bos * s_ot
        p_ptr += bos * s_pt
        h_ptr += bos * s_ht
    hk = h // REP
    t = tl.arange(0, BM)
    tm = t < m
    kr = tl.arange(0, BK)
    km = kr < DK
    vr = pid_v * BV + tl.arange(0, BV)
    vm = vr < DV

    q = conv_tile(mixed_ptr, ring_ptr, cw_ptr, rw_ptr, b, t, tm, hk * DK + kr, km, m,
                   s_mb, s_mt, s_rb, s_rc, s_ri, K, True)
    k = conv_tile(mixed_ptr, ring_ptr, cw_ptr, rw_ptr, b, t, tm, KEY_DIM + hk * DK + kr, km, m,
                   s_mb, s_mt, s_rb, s_rc, s_ri, K, True)
    v = conv_tile(mixed_ptr, ring_ptr, cw_ptr, rw_ptr, b, t, tm, 2 * KEY_DIM + h * DV + vr, vm, m,
                   s_mb, s_mt, s_rb, s_rc, s_ri, K, True)
    q = l2norm_rows(tl.where(tm[:, None], q, 0.0))
    k = l2norm_rows(tl.where(tm[:, None], k, 0.0))
    v = tl.where(tm[:, None], v, 0.0)

    S0 = tl.load(s0_ptr + pid_bh * DK * DV + kr[:, None] * DV + vr[None, :],
                 mask=km[:, None] & vm[None, :], other=0.0)
    hist = tl.dot(q * scale, S0, input_precision=PREC)  # [BM, BV]

    s = tl.dot(q, tl.trans(k), input_precision=PREC) * tl.exp(tl.load(bs_ptr + h).to(tl.float32))
    s = tl.where(tm[None, :], s, float("-inf"))
    s_hist = tl.load(hb_ptr + h).to(tl.float32) + tl.load(hln_ptr + h).to(tl.float32) * log_m
    mx = tl.maximum(tl.max(s, axis=1), s_hist)
    p = tl.exp(s - mx[:, None])
    p_h = tl.exp(s_hist - mx)
    inv_den = 1.0 / (tl.sum(p, axis=1) + p_h)
    o = (tl.dot(p, v, input_precision=PREC) + p_h[:, None] * hist) * inv_den[:, None]
    out_mask = tm[:, None] & vm[None, :]
    tl.store(o_ptr + b * s_ob + t[:, None] * s_ot + h * s_oh + vr[None, :], o.to(o_ptr.dtype.element_ty),
             mask=out_mask)
    if pid_v == 0:
        tl.store(p_ptr + b * s_pb + t * s_pt + h, p_h * inv_den, mask=tm)
    if RETURN_H:
        tl.store(h_ptr + b * s_hb + t[:, None] * s_ht + h * s_hh + vr[None, :], hist, mask=out_mask)


def gdn_preview(mixed, ring, conv_weight, right_weight, state, block_scale, history_bias, history_log_n,
                num_k_heads, head_k_dim, head_v_dim, return_history: bool = False, out=None):
    """Same contract as ``gdn.naive.gdn_preview``: (o [B, m, Hv, dv] in mixed's dtype,
    p_hist [B, m, Hv] fp32, h [B, m, Hv, dv] fp32 or None). Reads ring and state only; ``out``:
    the kernel writes o there (through its strides) and returns it."""
    B, m, C, K, Hv = check_gdn_shapes("gdn_preview", mixed, ring, conv_weight, state,
                                      num_k_heads, head_k_dim, head_v_dim)
    if m < 1:
        raise ValueError(f"gdn_preview: empty block (m={m})")
    if m > MAX_BLOCK:  # blocks longer than one tile of rows: the reference (correct, not fast)
        from .naive import gdn_preview as reference
        return reference(mixed, ring, conv_weight, right_weight, state, block_scale, history_bias,
                         history_log_n, num_k_heads, head_k_dim, head_v_dim, return_history, out)
    return _preview(mixed, ring, conv_weight, right_weight, state, block_scale, history_bias, history_log_n,
                    num_k_heads, head_k_dim, head_v_dim, return_history, out, None, m)


def gdn_preview_varlen(mixed, ring, conv_weight, right_weight, state, block_scale, history_bias, history_log_n,
                       num_k_heads, head_k_dim, head_v_dim, cu_seqlens, max_seqlen: int | None = None,
                       return_history: bool = False, out=None):
    """The previews of N rows' blocks packed on one token axis (``cu_seqlens``, ``varlen.py``):
    block n is rows [cu_seqlens[n], cu_seqlens[n + 1]) of mixed [1, T, C], previewed over ring[n]
    and state[n] (ring [N, C, K-1], state [N, Hv, dk, dv]), its history logit at its own length.
    Returns (o [1, T, Hv, dv], p_hist [1, T, Hv] fp32, h [1, T, Hv, dv] fp32 or None), each block's
    exactly what ``gdn_preview`` gives it alone (reference: ``gdn.torch.gdn_preview_varlen``).

    Every block holds 1 to MAX_BLOCK rows. ``max_seqlen``: the longest block's length, which sizes
    the row tile; None reads it from cu_seqlens (one host transfer; cu_seqlens is then checked).
    Given, nothing is read on the host: the blocks must then be as ``max_seqlen`` promises."""
    N, longest = check_segments("gdn_preview_varlen", mixed, cu_seqlens, max_seqlen, ring=ring, state=state)
    if max_seqlen is None and bool((cu_seqlens[1:] == cu_seqlens[:-1]).any()):
        raise ValueError(f"gdn_preview_varlen: cu_seqlens {cu_seqlens.tolist()} holds an empty block "
                         f"(a preview needs at least one row)")
    if not 1 <= longest <= MAX_BLOCK:
        raise ValueError(f"gdn_preview_varlen: the longest block has {longest} rows, expected 1 to {MAX_BLOCK}")
    check_gdn_shapes("gdn_preview_varlen", mixed.expand(N, -1, -1), ring, conv_weight, state,
                     num_k_heads, head_k_dim, head_v_dim)
    return _preview(mixed, ring, conv_weight, right_weight, state, block_scale, history_bias, history_log_n,
                    num_k_heads, head_k_dim, head_v_dim, return_history, out, cu_seqlens, longest)


def _preview(mixed, ring, conv_weight, right_weight, state, block_scale, history_bias, history_log_n,
             num_k_heads, dk, dv, return_history, out, cu_seqlens, longest):
    """The launch of a preview: dense (``cu_seqlens`` None: B blocks of m = ``longest`` rows) or
    varlen (N rows' blocks on one token axis, ``longest`` the longest)."""
    B, T, C = mixed.shape
    K = conv_weight.shape[1]
    varlen = cu_seqlens is not None
    name = "gdn_preview_varlen" if varlen else "gdn_preview"
    rows, Hv = state.shape[0], state.shape[1]
    if tuple(right_weight.shape) != (C, K - 1):
        raise ValueError(f"{name}: right_weight must be [{C}, {K - 1}], got {tuple(right_weight.shape)}")
    for arg, t in (("block_scale", block_scale), ("history_bias", history_bias), ("history_log_n", history_log_n)):
        if tuple(t.shape) != (Hv,):
            raise ValueError(f"{name}: {arg} must be [{Hv}], got {tuple(t.shape)}")
    mixed = last_dim_contiguous(mixed)
    s0 = state.to(torch.float32).contiguous()
    if out is not None:
        check_out(name, out, (B, T, Hv, dv), mixed.dtype)
    o = torch.empty(B, T, Hv, dv, dtype=mixed.dtype, device=mixed.device) if out is None else out
    p_hist = torch.empty(B, T, Hv, dtype=torch.float32, device=mixed.device)
    h = torch.empty(B, T, Hv, dv, dtype=torch.float32, device=mixed.device) if return_history else o
    batch = 0 if varlen else 1  # varlen: the token axis is not per row (its batch strides 0)
    BK = max(16, triton.next_power_of_2(dk))
    BV = min(max(16, triton.next_power_of_2(dv)), 64)
    BM = max(16, triton.next_power_of_2(longest))
    grid = (triton.cdiv(dv, BV), rows * Hv)
    _preview_kernel[grid](
        mixed, ring, conv_weight.contiguous(), right_weight.contiguous(), s0,
        block_scale.contiguous(), history_bias.contiguous(), history_log_n.contiguous(),
        o, p_hist, h, cu_seqlens if varlen else s0, T, math.log(max(T, 1)),
        mixed.stride(0) * batch, mixed.stride(1), ring.stride(0), ring.stride(1), ring.stride(2),
        o.stride(0) * batch, o.stride(1), o.stride(2), p_hist.stride(0) * batch, p_hist.stride(1),
        h.stride(0) * batch, h.stride(1), h.stride(2),
        Hv, Hv // num_k_heads, num_k_heads * dk, dk ** -0.5,
        K=K, DK=dk, DV=dv, BK=BK, BV=BV, BM=BM, RETURN_H=return_history, PREC=dot_precision(mixed.dtype),
        VARLEN=varlen, num_warps=8 if BK * BM >= 4096 else 4,  # 32 rows at dk=128 on 4 warps: fp32 spills on sm_90
    )
    return o, p_hist, (h if return_history else None)
