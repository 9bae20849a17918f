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
    slots: bool = False,
) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = expert_ids[t, k];
    accumulated in fp32 (float64 stays float64), returned as [T, H] in x's dtype. ``slots``:
    the terms of the sum, unsummed: [T, k, H] in the accumulation dtype (fp32)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    I = gate_up.shape[1] // 2
    T, k = expert_ids.shape
    out = torch.zeros(T, k, x.shape[1], dtype=acc, device=x.device)
    for t in range(T):
        for slot in range(k):
            e = int(expert_ids[t, slot])
            h = gate_up[e].to(acc) @ x[t].to(acc)  # [2I]
            out[t, slot] = weights[t, slot].to(acc) * (down[e].to(acc) @ (F.silu(h[:I]) * h[I:]))
    if slots:
        return out
    total = torch.zeros(T, x.shape[1], dtype=acc, device=x.device)
    for slot in range(k):  # slot by slot, in order
        total += out[:, slot]
    return total.to(x.dtype)


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


def route(logits: torch.Tensor, top_k: int, allowed: torch.Tensor | None = None, within: torch.Tensor | None = None,
          record: torch.Tensor | None = None):
    """The routing rule: logits [T, E] -> (probs [T, E], softmax over every expert in fp32; expert
    ids [T, k] and weights [T, k] fp32 as ``select``). ``within``: a coreset's expert ids in place
    of ``allowed`` (``allowed_experts``); ``record``: a coreset buffer, written with the coreset of
    these rows (``record_coreset``)."""
    T, E = logits.shape
    if within is not None:
        if allowed is not None:
            raise ValueError("route: pass allowed or within, not both")
        check_groups("route: within", within, T, E)
        allowed = allowed_experts(within, E, T)
    if record is not None:
        check_groups("route: record", record, T, E)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if record is not None:
        record_coreset(probs, record)
    return (probs, *select(probs, top_k, allowed))


def check_groups(name: str, ids: torch.Tensor, rows: int, num_experts: int) -> None:
    """``ids``: [S] or [G, S] integer expert ids, G dividing the rows, S <= E."""
    if (ids.dim() not in (1, 2) or ids.dtype not in (torch.int64, torch.int32) or ids.shape[-1] > num_experts
            or (ids.dim() == 2 and (ids.shape[0] == 0 or rows % ids.shape[0]))):
        raise ValueError(f"{name}: expected integer expert ids [S] or [G, S] with S <= {num_experts} and G "
                         f"dividing the {rows} rows, got {tuple(ids.shape)} {ids.dtype}")


def allowed_experts(within: torch.Tensor, num_experts: int, rows: int) -> torch.Tensor:
    """A coreset's expert ids -> the mask ``select`` takes: [S] -> [E] (every row routes among
    them); [G, S] -> [rows, E], group g's rows // G consecutive rows among row g's (a batch's
    rows, each with its own coreset)."""
    if within.dim() == 1:
        allowed = torch.zeros(num_experts, dtype=torch.bool, device=within.device)
        allowed[within] = True
        return allowed
    allowed = torch.zeros(within.shape[0], num_experts, dtype=torch.bool, device=within.device)
    return allowed.scatter_(1, within, True).repeat_interleave(rows // within.shape[0], dim=0)


def record_coreset(probs: torch.Tensor, record: torch.Tensor) -> None:
    """The coreset of rows probs [T, E] (spec 3.3) into ``record`` [S] or [G, S]: the S experts with
    the largest probability summed over the rows (over each of G groups of T // G consecutive
    rows), in descending order."""
    groups = 1 if record.dim() == 1 else record.shape[0]
    mass = probs.view(groups, -1, probs.shape[-1]).sum(1)  # [G, E]
    record.copy_(mass.topk(record.shape[-1], dim=-1).indices.view(record.shape))


def select(probs: torch.Tensor, top_k: int, allowed: torch.Tensor | None = None):
    """probs [T, E] -> (the top k among the allowed experts ([E] or [T, E] bool, None: all) [T, k],
    their probabilities renormalised to sum to 1 [T, k]). Probabilities are >= 0, so a disallowed
    expert (-1) is never among the top k while k experts are allowed."""
    choice = probs if allowed is None else probs.masked_fill(~allowed, -1.0)
    top, ids = choice.topk(top_k, dim=-1)
    return ids, top / top.sum(-1, keepdim=True)
