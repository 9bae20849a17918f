"""Fused MoE experts, from a decode step (one token) to a prefill chunk (8k tokens), top-k <= 8.
Reference: ``moe/naive.py: moe_experts``.

Layout (the scheme of SGLang/vLLM's fused_moe, written for this project's shapes):

1. ``align_blocks`` (one Triton program, ``align.py``; no host synchronisation): the T*k (token, slot) pairs
   are sorted by expert and each expert's group is padded to a multiple of BM rows (``block_m``:
   chosen from the pairs per expert, see ``TILES``); the
   result is a table of row blocks, each owned by one expert, holding pair ids (sentinel =
   P for padding). The number of blocks is bounded on the host without looking at the data
   (``cdiv(P + min(E, P) * (BM - 1), BM)``); blocks past the real ones carry expert -1 and
   exit at once, so the launch needs no sync and is CUDA-graph friendly.
2. ``_gate_up_kernel`` [grid: blocks x I tiles]: gathers the tokens of a block, computes
   gate and up tiles against only that expert's rows of gate_up, and stores
   silu(gate) * up into a padded scratch [blocks * BM, I].
3. ``_down_kernel`` [grid: blocks x H tiles]: down projection of the scratch rows, times
   the pair's routing weight, stored per pair [P, H] (fp32).
4. the sum over the k slots of each token (deterministic, no atomics): in ``moe_combine``'s
   pass when the layer asks for the slots (``slots=True``), else one torch reduction here.

Experts hit by no token own no block, so their weights are never read.
"""
import torch
import triton
import triton.language as tl

from . import align
from .common import down_block, gate_up_block

BLOCK_M = 16  # rows per expert block at decode and block steps: tl.dot's minimum (a block spreads over many experts)

# Tiles by workload: an expert's weights are read once per row block, so a prefill chunk (8k tokens
# x top-8 over 256 experts: 256 pairs per expert) re-read them 16 times at 16 rows. BM follows the
# mean pairs per expert, T*k / E: a function of the shapes alone (no host sync, static in a graph).
# Per BM, (BN, BK, num_warps) of the gate/up kernel, then of the down kernel: each compiles for
# sm_90 without spills in bf16 and fp16, and in fp32 with TILES_FP32 (bench/compile_check.py; fp8: fp8/moe.py).
TILES = {16: ((None, 128, 4), (128, 128, 4)), 32: ((None, 128, 4), (128, 128, 4)),
         64: ((64, 64, 8), (128, 64, 8)), 128: ((64, 32, 8), (128, 32, 8))}
# fp32 activations (ieee dots hold more registers) spill those at 32 rows (255 registers, 220 B) and
# at 128 (12 B): half the K step, half the N tile there
TILES_FP32 = {**TILES, 32: ((None, 64, 4), (128, 64, 4)), 128: ((32, 32, 8), (64, 32, 8))}
BLOCK_MS = tuple(sorted(TILES))


def block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per expert block for ``num_pairs`` (token, slot) pairs over ``num_experts``: the
    largest power of two <= the mean pairs per expert, within 16 (decode, blocks) .. 128 (prefill)."""
    mean = num_pairs // max(1, num_experts)
    return min(BLOCK_MS[-1], max(BLOCK_MS[0], 1 << max(0, mean.bit_length() - 1)))


@triton.jit
def _gate_up_kernel(x_ptr, gu_ptr, pair_ptr, blk_e_ptr, act_ptr, P, H, I, TOPK,
                    s_xt, s_ge, s_gn, s_gh, s_at,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    # moe/common.py's body without block scales: their pointer, strides and block sizes go unread
    gate_up_block(x_ptr, gu_ptr, gu_ptr, pair_ptr, blk_e_ptr, act_ptr, P, H, I, 0, TOPK,
                  s_xt, s_ge, s_gn, s_gh, 0, 0, 0, s_at, 1, 1, BM, BN, BK, PREC, SCALED=False)


@triton.jit
def _down_kernel(act_ptr, dn_ptr, pair_ptr, blk_e_ptr, wt_ptr, y_ptr, P, H, I,
                 s_at, s_de, s_dh, s_di, s_yp,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    # as _gate_up_kernel: no block scales
    down_block(act_ptr, dn_ptr, dn_ptr, pair_ptr, blk_e_ptr, wt_ptr, y_ptr, P, H, I,
               s_at, s_de, s_dh, s_di, 0, 0, 0, s_yp, 1, 1, BM, BN, BK, PREC, SCALED=False)


def max_blocks(num_pairs: int, num_experts: int, block_m: int = BLOCK_M) -> int:
    """Upper bound on sum_e ceil(count_e / BM) for num_pairs pairs over num_experts experts."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


def align_blocks(expert_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """(pair_of_row [nb * BM] int32 with sentinel P, expert_of_block [nb] int32 with -1 for unused):
    one Triton launch (``align.py``; reference ``naive.align_blocks``)."""
    P = expert_ids.numel()
    return align.align_blocks(expert_ids, num_experts, block_m, max_blocks(P, num_experts, block_m))


def launch_buffers(x, expert_ids, num_experts: int, inter: int, bm: int):
    """What both MoE launchers (this file's, ``fp8/moe.py``'s) set up for row blocks of ``bm``: x
    with unit column stride, the row-block table, the gate/up scratch [nb * bm, I] in x's dtype,
    the per-pair output [T*k, H] fp32 and the dots' precision."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    pair_of_row, expert_of_block = align_blocks(expert_ids, num_experts, bm)
    act = torch.empty(expert_of_block.numel() * bm, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(expert_ids.numel(), x.shape[1], dtype=torch.float32, device=x.device)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    return x, pair_of_row, expert_of_block, act, y, prec


def _tile(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def moe_experts(x, expert_ids, weights, gate_up, down, slots: bool = False):
    """Same contract as ``moe.naive.moe_experts``: [T, H] in x's dtype; ``slots``: the down
    kernel's per-pair output [T, k, H] fp32 as it is (``moe_combine`` sums it in its pass)."""
    if x.dim() != 2:
        raise ValueError(f"moe_experts: x must be [T, H], got {tuple(x.shape)}")
    T, H = x.shape
    if expert_ids.dim() != 2 or expert_ids.shape[0] != T:
        raise ValueError(f"moe_experts: expert_ids must be [{T}, k], got {tuple(expert_ids.shape)}")
    topk = expert_ids.shape[1]
    if tuple(weights.shape) != (T, topk):
        raise ValueError(f"moe_experts: weights must be [{T}, {topk}], got {tuple(weights.shape)}")
    if gate_up.dim() != 3 or gate_up.shape[2] != H or gate_up.shape[1] % 2:
        raise ValueError(f"moe_experts: gate_up must be [E, 2I, {H}], got {tuple(gate_up.shape)}")
    E, two_i, _ = gate_up.shape
    I = two_i // 2
    if tuple(down.shape) != (E, H, I):
        raise ValueError(f"moe_experts: down must be [{E}, {H}, {I}], got {tuple(down.shape)}")
    if T == 0 or topk == 0:
        return x.new_zeros(T, topk, H, dtype=torch.float32) if slots else x.new_zeros(T, H)
    P = T * topk
    bm = block_m(P, E)
    x, pair_of_row, expert_of_block, act, y, prec = launch_buffers(x, expert_ids, E, I, bm)
    nb = expert_of_block.numel()
    (bn1, bk1, warps1), (bn2, bk2, warps2) = (TILES_FP32 if x.dtype == torch.float32 else TILES)[bm]
    # few expert blocks (decode, a small block): narrower I tiles give more programs to stream weights
    BN1 = _tile(I, bn1 or (32 if nb * triton.cdiv(I, 64) < 128 else 64))
    BK1 = _tile(H, bk1)
    _gate_up_kernel[(nb, triton.cdiv(I, BN1))](
        x, gate_up, pair_of_row, expert_of_block, act, P, H, I, topk,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), act.stride(0),
        BM=bm, BN=BN1, BK=BK1, PREC=prec, num_warps=warps1,
    )
    BN2, BK2 = _tile(H, bn2), _tile(I, bk2)
    _down_kernel[(nb, triton.cdiv(H, BN2))](
        act, down, pair_of_row, expert_of_block, weights.reshape(-1).contiguous(), y, P, H, I,
        act.stride(0), down.stride(0), down.stride(1), down.stride(2), y.stride(0),
        BM=bm, BN=BN2, BK=BK2, PREC=prec, num_warps=warps2,
    )
    return y.view(T, topk, H) if slots else y.view(T, topk, H).sum(1).to(x.dtype)
