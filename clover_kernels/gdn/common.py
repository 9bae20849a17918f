"""What the GDN kernels share: the conv tile and row L2-norm (Triton device functions), the
dot precision by dtype and the argument checks of the commit and preview launchers."""
import torch
import triton
import triton.language as tl


@triton.jit
def conv_tile(mixed_ptr, ring_ptr, cw_ptr, rw_ptr, b, t, tm, c, cm, T,
              s_mb, s_mt, s_rb, s_rc, s_ri,
              K: tl.constexpr, RIGHT: tl.constexpr):
    """silu(conv) of rows t (mask tm) and channels c (mask cm), fp32 [len(t), len(c)].

    Causal taps: sum_j w[c, j] * X[t + j - (K-1)] over X = [ring ; mixed]; with RIGHT also
    the right taps sum_d r[c, d-1] * mixed[t + d] (zero past row T). Intermediate roundings
    to mixed's dtype follow the reference."""
    dt = mixed_ptr.dtype.element_ty
    acc = tl.zeros([t.shape[0], c.shape[0]], dtype=tl.float32)
    # runtime loops, not static_range: unrolled, every tap's [rows, channels] loads were hoisted
    # and live at once, which made the preview kernel spill on sm_90 (test_compile_sm90.py)
    for j in range(K):
        s = t + (j - (K - 1))  # source row in mixed; < 0 reads the ring at column s + K - 1
        wj = tl.load(cw_ptr + c * K + j, mask=cm, other=0.0).to(tl.float32)
        m_mixed = (tm & (s >= 0))[:, None] & cm[None, :]
        m_ring = (tm & (s < 0))[:, None] & cm[None, :]
        xm = tl.load(mixed_ptr + b * s_mb + s[:, None] * s_mt + c[None, :], mask=m_mixed, other=0.0)
        xr = tl.load(ring_ptr + b * s_rb + c[None, :] * s_rc + (s + (K - 1))[:, None] * s_ri,
                     mask=m_ring, other=0.0)
        x = xm.to(tl.float32) + xr.to(dt).to(tl.float32)
        acc += x * wj[None, :]
    acc = acc.to(dt).to(tl.float32)
    if RIGHT:
        racc = tl.zeros([t.shape[0], c.shape[0]], dtype=tl.float32)
        for d in range(1, K):
            s = t + d
            msk = (tm & (s < T))[:, None] & cm[None, :]
            x = tl.load(mixed_ptr + b * s_mb + s[:, None] * s_mt + c[None, :], mask=msk, other=0.0)
            rd = tl.load(rw_ptr + c * (K - 1) + (d - 1), mask=cm, other=0.0).to(tl.float32)
            racc += x.to(tl.float32) * rd[None, :]
        acc = (acc + racc.to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return acc * tl.sigmoid(acc)


@triton.jit
def segment(cu_ptr, n):
    """Varlen segment n of a packed token axis: its first token and its length, from the
    cu_seqlens offsets (cu_seqlens[n] and cu_seqlens[n + 1] - cu_seqlens[n])."""
    bos = tl.load(cu_ptr + n).to(tl.int64)
    return bos, tl.load(cu_ptr + n + 1).to(tl.int64) - bos


@triton.jit
def l2norm_rows(x):
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def check_gdn_shapes(op, mixed, ring, conv_weight, state, num_k_heads, head_k_dim, head_v_dim):
    """Validates the shared GDN arguments; returns (B, T, C, K, Hv)."""
    if mixed.dim() != 3:
        raise ValueError(f"{op}: mixed must be [B, T, C], got shape {tuple(mixed.shape)}")
    B, T, C = mixed.shape
    key_dim = num_k_heads * head_k_dim
    if (C - 2 * key_dim) <= 0 or (C - 2 * key_dim) % head_v_dim:
        raise ValueError(f"{op}: conv_dim {C} != 2 * {num_k_heads} * {head_k_dim} + Hv * {head_v_dim}")
    Hv = (C - 2 * key_dim) // head_v_dim
    if Hv % num_k_heads:
        raise ValueError(f"{op}: value heads {Hv} not a multiple of key heads {num_k_heads}")
    if conv_weight.dim() != 2 or conv_weight.shape[0] != C:
        raise ValueError(f"{op}: conv_weight must be [{C}, K], got {tuple(conv_weight.shape)}")
    K = conv_weight.shape[1]
    if K < 2:
        raise ValueError(f"{op}: conv kernel size {K} < 2 is not supported")
    if tuple(ring.shape) != (B, C, K - 1):
        raise ValueError(f"{op}: ring must be [{B}, {C}, {K - 1}], got {tuple(ring.shape)}")
    if tuple(state.shape) != (B, Hv, head_k_dim, head_v_dim):
        raise ValueError(f"{op}: state must be [{B}, {Hv}, {head_k_dim}, {head_v_dim}], got {tuple(state.shape)}")
    return B, T, C, K, Hv


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
