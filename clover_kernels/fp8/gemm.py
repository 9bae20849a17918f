"""Block-scaled FP8 linear: y = x @ W^T with W stored as fp8 Q and per-block scales (``naive.py``).
Reference: ``fp8/naive.py: linear``.

Weight-only FP8 (W8A16): activations stay in their dtype (bf16 on the GPU), so nothing is lost
to activation quantization, and every weight byte is read once, as one byte. Each program owns a
[BM, BN] output tile; per K step it loads x [BM, BK] and Q [BK, BN], upcasts Q in registers
(exact: every e4m3 value is a bf16/fp16 value), multiplies on the tensor cores into an fp32
partial sum and adds it times the block's scales (one per output column). BK is a power of two
(``tl.arange``'s rule) dividing the quantization block's bk (``k_step``), so a K step never
straddles two scale columns, whatever the block width (96 and 192 take K steps of 32 and 64).
Rows are the tokens of a step: 1 (decode) to a prefill chunk; small M takes BM = 16, tl.dot's minimum.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K,
                       s_xm, s_wn, s_wk, s_sn, s_sk, s_ym,
                       QN: tl.constexpr, QK: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mm = rm < M
    nm = rn < N
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    s_row = s_ptr + (rn // QN).to(tl.int64) * s_sn  # [BN] each column's row of scales
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * s_xm + kk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        q = tl.load(w_ptr + rn[None, :].to(tl.int64) * s_wn + kk[:, None] * s_wk,
                    mask=km[:, None] & nm[None, :], other=0.0)  # [BK, BN] fp8
        part = tl.dot(a, q.to(dt), input_precision=PREC)
        scale = tl.load(s_row + (k0 // QK) * s_sk, mask=nm, other=0.0)
        acc += part * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * s_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mm[:, None] & nm[None, :])


def tiles(M: int, N: int, bk_quant: int) -> tuple[int, int, int, int]:
    """(BM, BN, BK, num_warps) for M rows and N outputs: 16 rows for decode and small blocks;
    narrower N tiles when there are few programs, so more SMs stream the weight. K steps of 64
    (compiled for sm_90 with bf16: at most 245 registers, no spills; BK = 128 spills at BM = 64
    with 4 warps, so 64-row tiles take 8)."""
    BM = 16 if M <= 16 else (32 if M <= 32 else 64)
    BN = 64 if triton.cdiv(M, BM) * triton.cdiv(N, 64) >= 128 else 32
    return BM, BN, k_step(bk_quant, 64), 8 if BM == 64 else 4


def k_step(bk_quant: int, cap: int) -> int:
    """A K step for quantization blocks of ``bk_quant`` columns: the largest power of two that
    divides it (its lowest set bit), at most ``cap`` (a power of two: what compiles without
    spills). 128 -> 64 under a cap of 64; 96 -> 32; 192 -> 64; 48 -> 16."""
    return min(cap, bk_quant & -bk_quant)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block, bias=None) -> torch.Tensor:
    """Same contract as ``fp8.naive.linear``: x [..., K], weight [N, K] fp8, scale
    [ceil(N/bn), ceil(K/bk)] -> [..., N] in x's dtype."""
    N, K = weight.shape
    bn, bk = block
    if x.shape[-1] != K:
        raise ValueError(f"fp8 linear: x has {x.shape[-1]} features, the weight {K}")
    if tuple(scale.shape) != (triton.cdiv(N, bn), triton.cdiv(K, bk)):
        raise ValueError(f"fp8 linear: scales {tuple(scale.shape)} do not fit a weight [{N}, {K}] in blocks {block}")
    if bk % 16:
        raise ValueError(f"fp8 linear: the quantization block's columns ({bk}) must be a multiple of 16")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.view(*lead, N)
    BM, BN, BK, warps = tiles(M, N, bk)
    _fp8_linear_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        x2, weight, scale, bias if bias is not None else scale, y, M, N, K,
        x2.stride(0), weight.stride(0), weight.stride(1), scale.stride(0), scale.stride(1), y.stride(0),
        QN=bn, QK=bk, HAS_BIAS=bias is not None, BM=BM, BN=BN, BK=BK,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps,
    )
    return y.view(*lead, N)
