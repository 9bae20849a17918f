"""The attention's q/k norms and RoPE in one Triton launch (reference: ``naive.qk_norm_rope``).

Program (row, head) [grid: B*T x (Hq + Hkv)]: one head's D values of one token, read through
the projection's strides (no copy of the per-head views): zero-centred RMSNorm in fp32, rounded
to the activations' dtype as the reference rounds it; then the rotation of the first R dims,
each dim's partner (i +- R/2) loaded and normalised alongside; cos and sin of ``position *
inv_freq`` computed in the program (no cos/sin tables). Written as [B, heads, T, D], contiguous;
with a cache (the static step), each k head row also into the K cache at the row's position, and the
program of a k head copies v's head row into the V cache there (no scatter launches).
"""
import torch
import triton
import triton.language as tl

from ..norm.rms import _num_warps
from .naive import check_cache


@triton.jit
def _norm_rope_head(src, w_ptr, dst, pos, freq_ptr, D, eps, R: tl.constexpr, BD: tl.constexpr):
    """One head row at ``src`` -> normed and rotated at ``dst`` (both unit stride); returned too."""
    d = tl.arange(0, BD)
    m = d < D
    dt = dst.dtype.element_ty
    x = tl.load(src + d, mask=m, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    y = (x * inv_rms * (1.0 + w)).to(dt).to(tl.float32)
    half: tl.constexpr = R // 2
    rot = d < R
    partner = tl.where(d < half, d + half, d - half)
    xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    yp = (xp * inv_rms * (1.0 + wp)).to(dt).to(tl.float32)
    yp = tl.where(d < half, -yp, yp)
    freq = pos * tl.load(freq_ptr + d % half, mask=rot, other=0.0)
    cos = tl.cos(freq).to(dt).to(tl.float32)
    sin = tl.sin(freq).to(dt).to(tl.float32)
    rotated = ((y * cos).to(dt).to(tl.float32) + (yp * sin).to(dt).to(tl.float32))
    out = tl.where(rot, rotated, y).to(dt)
    tl.store(dst + d, out, mask=m)
    return out


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, pos_ptr, freq_ptr, qo_ptr, ko_ptr, v_ptr, kc_ptr, vc_ptr,
                         T, HQ, HK, D, s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_pb, s_pt, s_vb, s_vt, s_vh,
                         s_cb, s_ch, s_cl, eps, R: tl.constexpr, BD: tl.constexpr, CACHE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b, t = row // T, row % T
    p = tl.load(pos_ptr + b * s_pb + t * s_pt)
    pos = p.to(tl.float32)
    if h < HQ:
        _norm_rope_head(q_ptr + b * s_qb + t * s_qt + h * s_qh, qw_ptr, qo_ptr + ((b * HQ + h) * T + t) * D,
                        pos, freq_ptr, D, eps, R, BD)
    else:
        hk = h - HQ
        k = _norm_rope_head(k_ptr + b * s_kb + t * s_kt + hk * s_kh, kw_ptr, ko_ptr + ((b * HK + hk) * T + t) * D,
                            pos, freq_ptr, D, eps, R, BD)
        if CACHE:  # the row's K and V at its position of the caches [B, Hkv, L, D]
            d = tl.arange(0, BD)
            at = b * s_cb + hk * s_ch + p.to(tl.int64) * s_cl + d
            tl.store(kc_ptr + at, k.to(kc_ptr.dtype.element_ty), mask=d < D)
            v = tl.load(v_ptr + b * s_vb + t * s_vt + hk * s_vh + d, mask=d < D, other=0.0)
            tl.store(vc_ptr + at, v.to(vc_ptr.dtype.element_ty), mask=d < D)


def qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps=1e-6, cache=None):
    """Same contract as ``naive.qk_norm_rope``."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must be [B, T, heads, D] "
                         f"with one B, T and D")
    B, T, HQ, D = q.shape
    HK = k.shape[2]
    R = 2 * inv_freq.numel()
    if q_weight.shape != (D,) or k_weight.shape != (D,) or R > D or R < 2:
        raise ValueError(f"qk_norm_rope: weights {tuple(q_weight.shape)}, {tuple(k_weight.shape)} and rotary dims {R}"
                         f" for head_dim {D}: expected weights [D] and 2 <= rotary dims <= D")
    if tuple(positions.shape) not in ((T,), (B, T)):
        raise ValueError(f"qk_norm_rope: positions {tuple(positions.shape)}, expected [{T}] or [{B}, {T}]")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    q_out = torch.empty(B, HQ, T, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(B, HK, T, D, dtype=q.dtype, device=q.device)
    if cache is not None:
        k_cache, v_cache, v = check_cache(cache, k_out, positions)
        v = v if v.stride(-1) == 1 else v.contiguous()
        if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
            raise ValueError("qk_norm_rope: the K and V caches must share one layout with a unit last stride")
        cache_args = (v, k_cache, v_cache, *v.stride()[:3], *k_cache.stride()[:3])
    else:
        cache_args = (q, q, q, 0, 0, 0, 0, 0, 0)
    if B * T:
        s_pb, s_pt = (0, positions.stride(0)) if positions.dim() == 1 else positions.stride()
        block = triton.next_power_of_2(D)
        _qk_norm_rope_kernel[(B * T, HQ + HK)](
            q, k, q_weight.contiguous(), k_weight.contiguous(), positions, inv_freq.float().contiguous(), q_out, k_out,
            cache_args[0], cache_args[1], cache_args[2], T, HQ, HK, D, *q.stride()[:3], *k.stride()[:3], s_pb, s_pt,
            *cache_args[3:], float(eps), R=R, BD=block, CACHE=cache is not None,
            # one warp spills (a row and its partners) on sm_90 at D = 256, two with the cache write in fp32
            num_warps=max(2 if cache is None else 4, _num_warps(block)))
    return q_out, k_out
