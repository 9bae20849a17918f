"""The MoE's row-block table in one Triton program: a counting sort of a step's (token, slot)
pairs by expert. Reference: ``moe/naive.py: align_blocks`` (the same table from torch ops, which
issue ~30 kernels where this is one launch, with no host synchronisation).

One program (a step's pairs and the E = 256 experts fit one): pass 1 counts each expert's pairs
over chunks of the flat ids ([CP, E] one-hot sums); each expert's block start is the exclusive
cumulative sum of its ceil(count / BM) blocks; the whole table is filled with the sentinel P;
pass 2 stores each pair id at its expert's block start * BM + its rank among that expert's pairs
(the pairs before it in earlier chunks, from a running count, plus those before it in its chunk):
the order of a stable sort. Then block b's expert is the number of experts whose blocks end at
or before b (-1 past the real blocks).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _align_kernel(ids_ptr, pair_ptr, blk_e_ptr, P, E, NB,
                  BM: tl.constexpr, EB: tl.constexpr, CP: tl.constexpr, CB: tl.constexpr, FB: tl.constexpr):
    experts = tl.arange(0, EB)
    lane = tl.arange(0, CP)
    counts = tl.zeros([EB], dtype=tl.int32)
    for p0 in range(0, P, CP):  # pass 1: pairs per expert
        p = p0 + lane
        e = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    blocks = (counts + BM - 1) // BM
    block_end = tl.cumsum(blocks, axis=0)  # [EB]
    block_start = block_end - blocks
    for r0 in range(0, NB * BM, FB):  # the whole table: padding until a pair is stored
        r = r0 + tl.arange(0, FB)
        tl.store(pair_ptr + r, tl.full([FB], 0, tl.int32) + P, mask=r < NB * BM)
    tl.debug_barrier()
    seen = tl.zeros([EB], dtype=tl.int32)  # pairs of each expert in the chunks before this one
    earlier = lane[None, :] < lane[:, None]  # [CP, CP]: column j is before row i
    for p0 in range(0, P, CP):  # pass 2: each pair at its block start * BM + its rank
        p = p0 + lane
        e = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
        hot = (e[:, None] == experts[None, :]).to(tl.int32)  # [CP, EB]
        before = tl.sum(hot * seen[None, :], axis=1)
        start = tl.sum(hot * block_start[None, :], axis=1)
        within = tl.sum(((e[:, None] == e[None, :]) & earlier).to(tl.int32), axis=1)
        tl.store(pair_ptr + start * BM + before + within, p.to(tl.int32), mask=p < P)
        seen += tl.sum(hot, axis=0)
    for b0 in range(0, NB, CB):  # block b's expert: experts whose blocks end at or before b
        b = b0 + tl.arange(0, CB)
        owner = tl.sum(((block_end[None, :] <= b[:, None]) & (experts[None, :] < E)).to(tl.int32), axis=1)
        tl.store(blk_e_ptr + b, tl.where(owner < E, owner, -1), mask=b < NB)


def align_blocks(expert_ids: torch.Tensor, num_experts: int, block_m: int, num_blocks: int):
    """(pair_of_row [num_blocks * block_m] int32, sentinel P; expert_of_block [num_blocks] int32, -1
    for unused), as ``naive.align_blocks``; ``num_blocks`` from ``fused.max_blocks``."""
    flat = expert_ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    P = flat.numel()
    pair_of_row = torch.empty(num_blocks * block_m, dtype=torch.int32, device=flat.device)
    expert_of_block = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    EB = triton.next_power_of_2(num_experts)
    CP = max(16, min(64, 8192 // EB, triton.next_power_of_2(P)))  # [CP, EB] one-hot tiles of at most 8k
    _align_kernel[(1,)](flat, pair_of_row, expert_of_block, P, num_experts, num_blocks,
                        BM=block_m, EB=EB, CP=CP, CB=max(16, min(1024, 8192 // EB)), FB=1024, num_warps=4)
    return pair_of_row, expert_of_block
