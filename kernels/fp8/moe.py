"""Fused MoE experts over block-scaled FP8 weights: ``moe/fused.py``'s scheme (pairs sorted into
per-expert row blocks by ``align_blocks``; a gate/up kernel, a down kernel, one reduction over
the k slots) with each weight tile read as fp8, upcast in registers, and the block scales
applied to the fp32 partial sums (as in ``gemm.py``). Reference: ``fp8/naive.py: moe_experts``.

Scales: gate_up [E, 2 NI, ceil(H/bk)] with NI = ceil(I/bn), gate's row blocks then up's; down
[E, ceil(H/bn), ceil(I/bk)]. Experts hit by no token are never read, scales included.
"""
import torch
import triton
import triton.language as tl

from ..moe.fused import BLOCK_M, _tile, align_blocks


@triton.jit
def _gate_up_fp8_kernel(x_ptr, gu_ptr, gs_ptr, pair_ptr, blk_e_ptr, act_ptr, P, H, I, NI, TOPK,
                        s_xt, s_ge, s_gn, s_gh, s_se, s_sn, s_sk, s_at,
                        QN: tl.constexpr, QK: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(blk_e_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    rows = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(pair_ptr + rows)
    rm = pair < P
    tok = (pair // TOPK).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    nm = n < I
    dt = x_ptr.dtype.element_ty
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    w_base = gu_ptr + e * s_ge
    sg_row = gs_ptr + e * s_se + (n // QN) * s_sn  # gate's scale rows; up's are NI rows further
    su_row = sg_row + NI * s_sn
    for k0 in range(0, H, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < H
        a = tl.load(x_ptr + tok[:, None] * s_xt + kk[None, :], mask=rm[:, None] & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & nm[None, :]
        wg = tl.load(w_base + n[None, :] * s_gn + kk[:, None] * s_gh, mask=wmask, other=0.0)  # [BK, BN] fp8
        wu = tl.load(w_base + (n + I)[None, :] * s_gn + kk[:, None] * s_gh, mask=wmask, other=0.0)
        sg = tl.load(sg_row + (k0 // QK) * s_sk, mask=nm, other=0.0)
        su = tl.load(su_row + (k0 // QK) * s_sk, mask=nm, other=0.0)
        acc_g += tl.dot(a, wg.to(dt), input_precision=PREC) * sg[None, :]
        acc_u += tl.dot(a, wu.to(dt), input_precision=PREC) * su[None, :]
    # as moe/fused.py: the projections rounded to x's dtype before the activation
    gate = acc_g.to(dt).to(tl.float32)
    up = acc_u.to(dt).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * up
    tl.store(act_ptr + rows[:, None].to(tl.int64) * s_at + n[None, :], act.to(act_ptr.dtype.element_ty),
             mask=rm[:, None] & nm[None, :])


@triton.jit
def _down_fp8_kernel(act_ptr, dn_ptr, ds_ptr, pair_ptr, blk_e_ptr, wt_ptr, y_ptr, P, H, I,
                     s_at, s_de, s_dh, s_di, s_se, s_sn, s_sk, s_yp,
                     QN: tl.constexpr, QK: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(blk_e_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    rows = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(pair_ptr + rows)
    rm = pair < P
    n = pid_n * BN + tl.arange(0, BN)
    nm = n < H
    dt = act_ptr.dtype.element_ty
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    w_base = dn_ptr + e * s_de
    s_row = ds_ptr + e * s_se + (n // QN) * s_sn
    for k0 in range(0, I, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < I
        a = tl.load(act_ptr + rows[:, None].to(tl.int64) * s_at + kk[None, :],
                    mask=rm[:, None] & kmask[None, :], other=0.0)
        wd = tl.load(w_base + n[None, :] * s_dh + kk[:, None] * s_di,
                     mask=kmask[:, None] & nm[None, :], other=0.0)  # [BK, BN] fp8
        sd = tl.load(s_row + (k0 // QK) * s_sk, mask=nm, other=0.0)
        acc += tl.dot(a, wd.to(dt), input_precision=PREC) * sd[None, :]
    wt = tl.load(wt_ptr + pair, mask=rm, other=0.0).to(dt).to(tl.float32)
    y = acc.to(dt).to(tl.float32) * wt[:, None]
    tl.store(y_ptr + pair[:, None].to(tl.int64) * s_yp + n[None, :], y, mask=rm[:, None] & nm[None, :])


def _bk(n: int, bk_quant: int, cap: int) -> int:
    """A K step: a power of two <= cap that divides the quantization block's columns."""
    bk = min(_tile(n, cap), bk_quant)
    while bk_quant % bk:
        bk //= 2
    return bk


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
    x = x if x.stride(-1) == 1 else x.contiguous()
    P = T * topk
    pair_of_row, expert_of_block = align_blocks(expert_ids, E)
    nb = expert_of_block.numel()
    act = torch.empty(nb * BLOCK_M, I, dtype=x.dtype, device=x.device)
    y = torch.empty(P, H, dtype=torch.float32, device=x.device)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    # K steps of 64 for gate/up (two fp8 tiles and two accumulators: 128 spills on sm_90), 128 for down
    BN1, BK1 = _tile(I, 32), _bk(H, bk, 64)  # BN 64 spills on sm_90 (tests/kernels/test_compile_sm90.py)
    _gate_up_fp8_kernel[(nb, triton.cdiv(I, BN1))](
        x, gate_up, gate_up_scale, pair_of_row, expert_of_block, act, P, H, I, NI, topk,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2),
        gate_up_scale.stride(0), gate_up_scale.stride(1), gate_up_scale.stride(2), act.stride(0),
        QN=bn, QK=bk, BM=BLOCK_M, BN=BN1, BK=BK1, PREC=prec, num_warps=4,
    )
    BN2, BK2 = _tile(H, 128), _bk(I, bk, 128)
    _down_fp8_kernel[(nb, triton.cdiv(H, BN2))](
        act, down, down_scale, pair_of_row, expert_of_block, weights.reshape(-1).contiguous(), y, P, H, I,
        act.stride(0), down.stride(0), down.stride(1), down.stride(2),
        down_scale.stride(0), down_scale.stride(1), down_scale.stride(2), y.stride(0),
        QN=bn, QK=bk, BM=BLOCK_M, BN=BN2, BK=BK2, PREC=prec, num_warps=4,
    )
    return y.view(T, topk, H).sum(1).to(x.dtype)
