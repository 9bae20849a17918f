"""The program bodies of the fused MoE kernels, as Triton device functions: ``fused.py``'s
kernels call them without scales, ``fp8/moe.py``'s with ``SCALED`` (fp8 weight tiles upcast in
registers, each K step's partial sum times its block scales, as in ``fp8/gemm.py``). One body per
projection, as vLLM's fused_moe_kernel does with its fp8 flag: SCALED is a constexpr, so each
kernel compiles only its own branch (bench/kernel_report.py shows the registers of the kernels
written out separately).

Program (i, j) owns row block i of ``align_blocks``'s table (its pair ids, P for padding) and
output columns [j*BN, +BN); a block with no expert (-1, past the real ones) exits at once.
Scales (SCALED): QN x QK weight blocks, rows of ``s_row`` at n // QN, a column per K step.
"""
import triton
import triton.language as tl


@triton.jit
def block_tile(pair_ptr, P, N, BM: tl.constexpr, BN: tl.constexpr):
    """This program's rows of the row-block table with their pair ids and row mask, and its
    output columns of N with their mask."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    pair = tl.load(pair_ptr + rows)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    return rows, pair, pair < P, n, n < N


@triton.jit
def gate_up_block(x_ptr, gu_ptr, gs_ptr, pair_ptr, blk_e_ptr, act_ptr, P, H, I, NI, TOPK,
                  s_xt, s_ge, s_gn, s_gh, s_se, s_sn, s_sk, s_at,
                  QN: tl.constexpr, QK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, PREC: tl.constexpr, SCALED: tl.constexpr):
    """silu(x @ gate^T) * (x @ up^T) of the block's tokens into its scratch rows [BM, BN] of act.
    gs_ptr: with SCALED, [E, 2 NI, ceil(H/QK)] scales, gate's row blocks then up's."""
    e = tl.load(blk_e_ptr + tl.program_id(0)).to(tl.int64)
    if e < 0:
        return
    rows, pair, rm, n, nm = block_tile(pair_ptr, P, I, BM, BN)
    tok = (pair // TOPK).to(tl.int64)
    dt = x_ptr.dtype.element_ty
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    w_base = gu_ptr + e * s_ge
    if SCALED:
        sg_row = gs_ptr + e * s_se + (n // QN) * s_sn  # gate's scale rows; up's are NI rows further
        su_row = sg_row + NI * s_sn
    for k0 in range(0, H, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < H
        a = tl.load(x_ptr + tok[:, None] * s_xt + kk[None, :], mask=rm[:, None] & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & nm[None, :]
        wg = tl.load(w_base + n[None, :] * s_gn + kk[:, None] * s_gh, mask=wmask, other=0.0)  # [BK, BN]
        wu = tl.load(w_base + (n + I)[None, :] * s_gn + kk[:, None] * s_gh, mask=wmask, other=0.0)
        if SCALED:
            sg = tl.load(sg_row + (k0 // QK) * s_sk, mask=nm, other=0.0)
            su = tl.load(su_row + (k0 // QK) * s_sk, mask=nm, other=0.0)
            acc_g += tl.dot(a, wg.to(dt), input_precision=PREC) * sg[None, :]
            acc_u += tl.dot(a, wu.to(dt), input_precision=PREC) * su[None, :]
        else:
            acc_g = tl.dot(a, wg.to(dt), acc_g, input_precision=PREC)
            acc_u = tl.dot(a, wu.to(dt), acc_u, input_precision=PREC)
    # the reference rounds the projections to x's dtype before the activation
    gate = acc_g.to(dt).to(tl.float32)
    up = acc_u.to(dt).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * up
    tl.store(act_ptr + rows[:, None].to(tl.int64) * s_at + n[None, :], act.to(act_ptr.dtype.element_ty),
             mask=rm[:, None] & nm[None, :])


@triton.jit
def down_block(act_ptr, dn_ptr, ds_ptr, pair_ptr, blk_e_ptr, wt_ptr, y_ptr, P, H, I,
               s_at, s_de, s_dh, s_di, s_se, s_sn, s_sk, s_yp,
               QN: tl.constexpr, QK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, PREC: tl.constexpr, SCALED: tl.constexpr):
    """The block's scratch rows @ down^T times each pair's routing weight, fp32, into y's pair
    rows [BM, BN]. ds_ptr: with SCALED, [E, ceil(H/QN), ceil(I/QK)] scales."""
    e = tl.load(blk_e_ptr + tl.program_id(0)).to(tl.int64)
    if e < 0:
        return
    rows, pair, rm, n, nm = block_tile(pair_ptr, P, H, BM, BN)
    dt = act_ptr.dtype.element_ty
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    w_base = dn_ptr + e * s_de
    if SCALED:
        s_row = ds_ptr + e * s_se + (n // QN) * s_sn
    for k0 in range(0, I, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < I
        a = tl.load(act_ptr + rows[:, None].to(tl.int64) * s_at + kk[None, :],
                    mask=rm[:, None] & kmask[None, :], other=0.0)
        wd = tl.load(w_base + n[None, :] * s_dh + kk[:, None] * s_di,
                     mask=kmask[:, None] & nm[None, :], other=0.0)  # [BK, BN]
        if SCALED:
            sd = tl.load(s_row + (k0 // QK) * s_sk, mask=nm, other=0.0)
            acc += tl.dot(a, wd.to(dt), input_precision=PREC) * sd[None, :]
        else:
            acc = tl.dot(a, wd.to(dt), acc, input_precision=PREC)
    wt = tl.load(wt_ptr + pair, mask=rm, other=0.0).to(dt).to(tl.float32)
    y = acc.to(dt).to(tl.float32) * wt[:, None]
    tl.store(y_ptr + pair[:, None].to(tl.int64) * s_yp + n[None, :], y, mask=rm[:, None] & nm[None, :])
