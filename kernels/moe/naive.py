"""Readable reference of the routed experts: the definition, token by token and slot by slot.

Every faster path (``torch.py``: grouped GEMMs, the CPU per-expert loop, the traced contraction;
``fused.py``: the Triton kernels) is tested against it.
"""
import torch
import torch.nn.functional as F


def moe_experts(
    x: torch.Tensor,  # [T, H]
    expert_ids: torch.Tensor,  # [T, k] int
    weights: torch.Tensor,  # [T, k]
    gate_up: torch.Tensor,  # [E, 2I, H]: gate rows first, then up rows
    down: torch.Tensor,  # [E, H, I]
) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = expert_ids[t, k];
    accumulated in fp32 (float64 stays float64), returned as [T, H] in x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    I = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for t in range(x.shape[0]):
        for slot in range(expert_ids.shape[1]):
            e = int(expert_ids[t, slot])
            h = gate_up[e].to(acc) @ x[t].to(acc)  # [2I]
            out[t] += weights[t, slot].to(acc) * (down[e].to(acc) @ (F.silu(h[:I]) * h[I:]))
    return out.to(x.dtype)


def align_blocks(expert_ids: torch.Tensor, num_experts: int, block_m: int):
    """The fused kernels' row-block table from torch ops (the reference of ``align.py``'s one
    launch): (pair_of_row [nb * BM] int32 with sentinel P, expert_of_block [nb] int32 with -1 for
    unused). The pairs sorted by expert (stable), each expert's group padded to a multiple of BM;
    nb bounded without reading the data, ``cdiv(P + min(E, P) * (BM - 1), BM)``."""
    flat = expert_ids.reshape(-1).to(torch.int64)
    P = flat.numel()
    dev = flat.device
    nb = -(-(P + min(num_experts, P) * (block_m - 1)) // block_m)
    order = torch.argsort(flat, stable=True)  # pair ids sorted by expert
    # scatter_add, not bincount: bincount on CUDA reads the max id back to the host (a sync)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    starts = counts.cumsum(0) - counts  # first sorted position of each expert
    blocks = (counts + block_m - 1) // block_m
    block_ends = blocks.cumsum(0)
    block_starts = block_ends - blocks
    bid = torch.arange(nb, device=dev)
    blk_e = torch.searchsorted(block_ends, bid, right=True)  # == E past the last real block
    valid_blk = blk_e < num_experts
    e = blk_e.clamp(max=num_experts - 1)
    row_in_e = (bid - block_starts[e])[:, None] * block_m + torch.arange(block_m, device=dev)  # [nb, BM]
    valid_row = valid_blk[:, None] & (row_in_e < counts[e][:, None])
    sorted_pos = (starts[e][:, None] + row_in_e).clamp(max=P - 1)
    pair_of_row = torch.where(valid_row, order[sorted_pos], P).to(torch.int32).reshape(-1)
    expert_of_block = torch.where(valid_blk, blk_e, -1).to(torch.int32)
    return pair_of_row, expert_of_block


def route(logits: torch.Tensor, top_k: int, allowed: torch.Tensor | None = None):
    """The routing rule: logits [T, E] -> (probs [T, E], softmax over every expert in fp32; expert
    ids [T, k] and weights [T, k] fp32 as ``select``)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return (probs, *select(probs, top_k, allowed))


def select(probs: torch.Tensor, top_k: int, allowed: torch.Tensor | None = None):
    """probs [T, E] -> (the top k among the allowed experts ([E] or [T, E] bool, None: all) [T, k],
    their probabilities renormalised to sum to 1 [T, k]). Probabilities are >= 0, so a disallowed
    expert (-1) is never among the top k while k experts are allowed."""
    choice = probs if allowed is None else probs.masked_fill(~allowed, -1.0)
    top, ids = choice.topk(top_k, dim=-1)
    return ids, top / top.sum(-1, keepdim=True)
