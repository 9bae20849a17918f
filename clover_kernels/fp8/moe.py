"""Fused MoE experts over block-scaled FP8 weights: ``moe/fused.py``'s scheme (pairs sorted into
per-expert row blocks by ``align_blocks``; a gate/up kernel, a down kernel, one reduction over
the k slots) with each weight tile read as fp8, upcast in registers, and the block scales
applied to the fp32 partial sums (as in ``gemm.py``). Reference: ``fp8/naive.py: moe_experts``.

Scales: gate_up [E, 2 NI, ceil(H/bk)] with NI = ceil(I/bn), gate's row blocks then up's; down
[E, ceil(H/bn), ceil(I/bk)]. Experts hit by no token are never read, scales included.
"""
import triton
import triton.language as tl

from ..moe.common import down_block, gate_up_block
from ..moe.fused import _tile, block_m, launch_buffers
from .gemm import k_step


@triton.jit
def _gate_up_fp8_kernel(x_ptr, gu_ptr, gs_ptr, pair_ptr, blk_e_ptr, act_ptr, P, H, I, NI, TOPK,
                        s_xt, s_ge, s_gn, s_gh, s_se, s_sn, s_sk, s_at,
                        QN: tl.constexpr, QK: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    gate_up_block(x_ptr, gu_ptr, gs_ptr, pair_ptr, blk_e_ptr, act_ptr, P, H, I, NI, TOPK,
                  s_xt, s_ge, s_gn, s_gh, s_se, s_sn, s_sk, s_at, QN, QK, BM, BN, BK, PREC, SCALED=True)


@triton.jit
def _down_fp8_kernel(act_ptr, dn_ptr, ds_ptr, pair_ptr, blk_e_ptr, wt_ptr, y_ptr, P, H, I,
                     s_at, s_de, s_dh, s_di, s_se, s_sn, s_sk, s_yp,
                     QN: tl.constexpr, QK: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    down_block(act_ptr, dn_ptr, ds_ptr, pair_ptr, blk_e_ptr, wt_ptr, y_ptr, P, H, I,
               s_at, s_de, s_dh, s_di, s_se, s_sn, s_sk, s_yp, QN, QK, BM, BN, BK, PREC, SCALED=True)


# Per row-block height (``moe.fused.block_m``), (BN, BK cap, num_warps) of the gate/up kernel, then
# of the down kernel; K steps of 64 for gate/up at 16 and 32 rows (two fp8 tiles and two accumulators:
# 128 spills on sm_90, as does BN 64 with 4 warps), 128 for down; taller blocks take 8 warps and shorter
# K steps (compiled for sm_90 without spills, bf16 and fp16, every height).
TILES = {16: ((32, 64, 4), (128, 128, 4)), 32: ((32, 64, 4), (128, 128, 4)),
         64: ((64, 64, 8), (128, 64, 8)), 128: ((64, 32, 8), (128, 32, 8))}


def _bk(n: int, bk_quant: int, cap: int) -> int:
    """A K step over n columns: ``gemm.k_step`` (a power of two dividing the quantization block's
    columns), no wider than n needs."""
    return k_step(bk_quant, _tile(n, cap))


def moe_experts(x, expert_ids, weights, gate_up, down, gate_up_scale, down_scale, block):
    """Same contract as ``fp8.naive.moe_experts``: [T, H] in x's dtype."""
    T, H = x.shape
    E, two_i, _ = gate_up.shape
    I = two_i // 2
    bn, bk = block
    NI, NH, KH, KI = triton.cdiv(I, bn), triton.cdiv(H, bn), triton.cdiv(H, bk), triton.cdiv(I, bk)
    if tuple(gate_up_scale.shape) != (E, 2 * NI, KH) or tuple(down_scale.shape) != (E, NH, KI):
        raise ValueError(f"fp8 moe_experts: scales {tuple(gate_up_scale.shape)}, {tuple(down_scale.shape)} do not "
                         f"fit gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)} in blocks {tuple(block)}")
    if bk % 16:
        raise ValueError(f"fp8 moe_experts: the quantization block's columns ({bk}) must be a multiple of 16")
    topk = expert_ids.shape[1]
    if T == 0 or topk == 0:
        return x.new_zeros(T, H)
    P = T * topk
    bm = block_m(P, E)
    x, pair_of_row, expert_of_block, act, y, prec = launch_buffers(x, expert_ids, E, I, bm)
    nb = expert_of_block.numel()
    (bn1, bk1, warps1), (bn2, bk2, warps2) = TILES[bm]
    BN1, BK1 = _tile(I, bn1), _bk(H, bk, bk1)
    _gate_up_fp8_kernel[(nb, triton.cdiv(I, BN1))](
        x, gate_up, gate_up_scale, pair_of_row, expert_of_block, act, P, H, I, NI, topk,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2),
        gate_up_scale.stride(0), gate_up_scale.stride(1), gate_up_scale.stride(2), act.stride(0),
        QN=bn, QK=bk, BM=bm, BN=BN1, BK=BK1, PREC=prec, num_warps=warps1,
    )
    BN2, BK2 = _tile(H, bn2), _bk(I, bk, bk2)
    _down_fp8_kernel[(nb, triton.cdiv(H, BN2))](
        act, down, down_scale, pair_of_row, expert_of_block, weights.reshape(-1).contiguous(), y, P, H, I,
        act.stride(0), down.stride(0), down.stride(1), down.stride(2),
        down_scale.stride(0), down_scale.stride(1), down_scale.stride(2), y.stride(0),
        QN=bn, QK=bk, BM=bm, BN=BN2, BK=BK2, PREC=prec, num_warps=warps2,
    )
    return y.view(T, topk, H).sum(1).to(x.dtype)
