"""The router's softmax, top-k and renormalisation in one Triton program per token. Reference:
``moe/naive.py: route`` (the routing rule of ``clover_lab.layers.moe.Router``).

Program t: the token's E router logits -> fp32 probabilities (softmax over every expert); the
disallowed experts (a coreset) set to -1, so they are never picked while k are allowed; k rounds
of arg-max (the first index among equals, in descending order as ``torch.topk``); the k picked
probabilities renormalised to sum to 1.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(logit_ptr, allowed_ptr, prob_ptr, id_ptr, w_ptr, E, s_lt, s_at, TOPK,
                  EB: tl.constexpr, KB: tl.constexpr, MASKED: tl.constexpr):
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


def route(logits: torch.Tensor, top_k: int, allowed: torch.Tensor | None = None):
    """logits [T, E] -> (probs [T, E] fp32, expert ids [T, k] int64, weights [T, k] fp32), as
    ``naive.route``; ``allowed``: [E] or [T, E] bool (None: every expert)."""
    T, E = logits.shape
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
    _route_kernel[(T,)](logits, allowed if masked else logits, probs, ids, weights, E, logits.stride(0),
                        s_at if masked else 0, top_k, EB=triton.next_power_of_2(E),
                        KB=triton.next_power_of_2(max(top_k, 2)), MASKED=masked, num_warps=4)
    return probs, ids, weights
