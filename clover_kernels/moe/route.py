"""The router's softmax, top-k and renormalisation in one Triton program per token, and a
coreset's recording in one more launch. Reference: ``moe/naive.py: route`` (the routing rule of
``clover_lab.model.layers.moe.Router``).

``_route_kernel``, program t: the token's E router logits -> fp32 probabilities (softmax over
every expert); the disallowed experts (a coreset: a mask, or the coreset's expert ids read in
chunks and compared in registers, no mask built) set to -1, so they are never picked while k are
allowed; k rounds of arg-max (the first index among equals, in descending order as
``torch.topk``); the k picked probabilities renormalised to sum to 1.

``_coreset_kernel``, program g (a batch row's block): the probabilities summed over the group's
rows (the block's expert mass), each expert's rank among them (more mass, or as much and a lower
id, ranks first: ``torch.topk``'s descending order) and the S first written as the coreset,
into the buffer the routing previews then read.
"""
import torch
import triton
import triton.language as tl

from .naive import check_groups


@triton.jit
def _route_kernel(logit_ptr, allowed_ptr, within_ptr, prob_ptr, id_ptr, w_ptr, E, s_lt, s_at, s_wg, S, R, TOPK,
                  EB: tl.constexpr, KB: tl.constexpr, SC: tl.constexpr, MASKED: tl.constexpr,
                  WITHIN: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EB)
    em = e < E
    z = tl.load(logit_ptr + t * s_lt + e, mask=em, other=float("-inf")).to(tl.float32)
    z = tl.exp(z - tl.max(z, axis=0))
    p = z / tl.sum(z, axis=0)
    tl.store(prob_ptr + t * E + e, p, mask=em)
    choice = tl.where(em, p, -2.0)  # past E: below any allowed or disallowed expert
    if MASKED:
        ok = tl.load(allowed_ptr + t * s_at + e, mask=em, other=0) != 0
        choice = tl.where(ok | ~em, choice, -1.0)
    if WITHIN:  # the coreset's ids of this row's group, SC at a time: [EB, SC] compares
        ok = tl.zeros([EB], dtype=tl.int32)
        for s0 in range(0, S, SC):
            s = s0 + tl.arange(0, SC)
            ids = tl.load(within_ptr + (t // R) * s_wg + s, mask=s < S, other=-1)
            ok = tl.maximum(ok, tl.max((e[:, None] == ids[None, :]).to(tl.int32), axis=1))
        choice = tl.where((ok != 0) | ~em, choice, -1.0)
    slot = tl.arange(0, KB)
    top = tl.zeros([KB], dtype=tl.float32)
    ids = tl.zeros([KB], dtype=tl.int64)
    for j in range(TOPK):
        best = tl.max(choice, axis=0)
        pick = tl.min(tl.where(choice == best, e, EB), axis=0)  # the first index among equals
        top = tl.where(slot == j, best, top)
        ids = tl.where(slot == j, pick.to(tl.int64), ids)
        choice = tl.where(e == pick, -3.0, choice)
    km = slot < TOPK
    tl.store(id_ptr + t * TOPK + slot, ids, mask=km)
    tl.store(w_ptr + t * TOPK + slot, top / tl.sum(tl.where(km, top, 0.0), axis=0), mask=km)


@triton.jit
def _coreset_kernel(prob_ptr, out_ptr, R, E, S, s_og, EB: tl.constexpr, RC: tl.constexpr, CB: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EB)
    em = e < E
    r = tl.arange(0, RC)
    mass = tl.zeros([EB], dtype=tl.float32)
    for r0 in range(0, R, RC):  # the group's rows, RC at a time
        rows = r0 + r
        p = tl.load(prob_ptr + (g * R + rows)[:, None] * E + e[None, :], mask=(rows < R)[:, None] & em[None, :],
                    other=0.0)
        mass += tl.sum(p, axis=0)
    rank = tl.zeros([EB], dtype=tl.int32)
    for c0 in range(0, EB, CB):  # the experts that rank before each, CB candidates at a time
        c = c0 + tl.arange(0, CB)
        mc = tl.sum(tl.where(e[:, None] == c[None, :], mass[:, None], 0.0), axis=0)  # [CB]: their mass
        before = (mc[None, :] > mass[:, None]) | ((mc[None, :] == mass[:, None]) & (c[None, :] < e[:, None]))
        rank += tl.sum((before & (c < E)[None, :]).to(tl.int32), axis=1)
    tl.store(out_ptr + g * s_og + rank, e.to(tl.int64), mask=em & (rank < S))


def route(logits: torch.Tensor, top_k: int, allowed: torch.Tensor | None = None, within: torch.Tensor | None = None,
          record: torch.Tensor | None = None):
    """logits [T, E] -> (probs [T, E] fp32, expert ids [T, k] int64, weights [T, k] fp32), as
    ``naive.route``; ``allowed``: [E] or [T, E] bool (None: every expert); ``within``: a coreset's
    ids [S] or [G, S] instead; ``record``: an int64 coreset buffer [S] or [G, S] to write."""
    T, E = logits.shape
    if within is not None:
        if allowed is not None:
            raise ValueError("route: pass allowed or within, not both")
        check_groups("route: within", within, T, E)
        within = within if within.stride(-1) == 1 else within.contiguous()
    if record is not None:
        check_groups("route: record", record, T, E)
        if record.dtype != torch.int64 or record.stride(-1) != 1:
            raise ValueError(f"route: record must be a contiguous int64 buffer, got {record.dtype}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    probs = torch.empty(T, E, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    if T == 0:
        return probs, ids, weights
    masked = allowed is not None
    if masked:
        allowed = allowed if allowed.stride(-1) == 1 else allowed.contiguous()
        s_at = allowed.stride(0) if allowed.dim() == 2 else 0
    groups = 1 if within is None or within.dim() == 1 else within.shape[0]
    EB = triton.next_power_of_2(E)
    _route_kernel[(T,)](logits, allowed if masked else logits, logits if within is None else within, probs, ids,
                        weights, E, logits.stride(0), s_at if masked else 0,
                        within.stride(0) if groups > 1 else 0, 0 if within is None else within.shape[-1],
                        T // groups, top_k, EB=EB, KB=triton.next_power_of_2(max(top_k, 2)), SC=16,
                        MASKED=masked, WITHIN=within is not None, num_warps=4)
    if record is not None:
        G = 1 if record.dim() == 1 else record.shape[0]
        _coreset_kernel[(G,)](probs, record, T // G, E, record.shape[-1], record.stride(0) if G > 1 else 0,
                              EB=EB, RC=16, CB=16, num_warps=4)
    return probs, ids, weights
