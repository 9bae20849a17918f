"""The production torch path of the routed experts (tested against ``naive.py``).

On CUDA the tokens are sorted by expert and fed to ``grouped_mm`` against the whole fused
[E, ...] weight tensors with one (possibly empty) group per expert, so experts no token picked
are never read and there is no Python loop over experts. On the CPU the same ``grouped_mm``
once the pairs outnumber the experts, else one GEMM per expert hit (oneDNN). Under
torch.compile a step's experts are one traced contraction or the grouped GEMMs as an opaque op,
whichever this machine runs faster at the step's number of pairs (``calibrate``).
"""
import time

import torch
import torch.nn.functional as F

from ..dense import linear


def group_by_expert(expert_ids: torch.Tensor, num_experts: int):
    """(order, offsets): ``order`` sorts the flattened (token, slot) pairs by expert;
    ``offsets[e]`` is the end of expert e's group (int32, cumulative)."""
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts.cumsum(0).to(torch.int32)


def moe_experts(
    x: torch.Tensor,  # [T, H]
    expert_ids: torch.Tensor,  # [T, k] int
    weights: torch.Tensor,  # [T, k]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    packed=None,  # CPU: (gate_up, down) lists of E ``PackedWeight``s, each expert's kept oneDNN layout
    slots: bool = False,
) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = expert_ids[t, k]; returns [T, H].
    ``slots``: the terms of that sum unsummed, [T, k, H] fp32 (``naive.moe_experts``)."""
    T, H = x.shape
    k = expert_ids.shape[1]
    E, two_i, _ = gate_up.shape
    if T == 0:
        return x.new_zeros(T, k, H, dtype=torch.float32) if slots else x.new_zeros(T, H)
    if x.device.type == "cpu":
        if torch.compiler.is_compiling():
            if not slots and not traced_is_faster(T * k, E, two_i, H, str(x.dtype)):  # the grouped GEMMs, opaque
                return _moe_experts_grouped(x, expert_ids, weights, gate_up, down)
            return _moe_experts_traced(x, expert_ids, weights, gate_up, down, slots)
        return _moe_experts_cpu(x, expert_ids, weights, gate_up, down, packed, slots)
    order, offsets = group_by_expert(expert_ids, E)
    token_of = order // k  # [T*k] token index of each sorted pair
    xs = x[token_of]  # [T*k, H]
    h = F.grouped_mm(xs, gate_up.transpose(1, 2), offs=offsets)  # [T*k, 2I]
    gate, up = h.split(two_i // 2, dim=-1)
    act = F.silu(gate) * up
    y = F.grouped_mm(act, down.transpose(1, 2), offs=offsets)  # [T*k, H]
    if slots:
        return _unsorted(y.float() * weights.reshape(-1)[order, None].float(), order, T, k)
    w = weights.reshape(-1)[order].to(y.dtype)
    out = torch.zeros(T, H, dtype=y.dtype, device=x.device)
    out.index_add_(0, token_of, y * w[:, None])
    return out.to(x.dtype)


def _unsorted(y: torch.Tensor, order: torch.Tensor, T: int, k: int) -> torch.Tensor:
    """Per-pair rows sorted by expert [T*k, H] -> in (token, slot) order [T, k, H]."""
    return y.new_empty(y.shape).index_copy_(0, order, y).view(T, k, -1)


def _moe_experts_traced(x, expert_ids, weights, gate_up, down, slots: bool = False):
    """CPU path under torch.compile (decode and block steps): every (token, slot) pair's expert
    rows gathered and contracted in one expression. Inductor fuses gather and contraction into
    one loop nest that reads only the rows of the experts hit, with no host synchronisation
    (the eager path's loop over the experts hit needs one). Run eagerly it would copy the
    gathered weights: that path is only taken while tracing."""
    T, H = x.shape
    k = expert_ids.shape[1]
    I = gate_up.shape[1] // 2
    flat = expert_ids.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)  # [T*k, H]
    h = (gate_up[flat] * xs[:, None, :]).sum(-1)  # [T*k, 2I]
    act = F.silu(h[:, :I]) * h[:, I:]
    y = (down[flat] * act[:, None, :]).sum(-1).float() * weights.reshape(-1, 1).float()  # [T*k, H]
    return y.view(T, k, H) if slots else y.view(T, k, H).sum(1).to(x.dtype)


# Under torch.compile the traced contraction reads an expert's weights once per (token, slot)
# pair, in one loop nest; the grouped GEMMs read them once per expert, in a GEMM call per expert.
# Where one overtakes the other depends on the machine. Measured compiled (16 experts, top 2,
# H = I = 256, the experts alone), traced against grouped:
#   AVX-512 EPYC, 1 thread:  2 pairs per expert 1.13 ms / 1.34, 4: 2.30 / 1.61, 8: 4.46 / 2.30
#   AVX2 EPYC, 2 threads:    2: 0.81 / 4.47, 4: 2.42 / 6.80, 8: 3.97 / 6.73, 16: 4.61 / 5.82, 32: 8.77 / 8.60
# The contraction wins up to 2 pairs per expert on both. Past that a compiled step measures both
# once per number of pairs (``calibrate``: StepGraphs calls it before it compiles a step) and
# traces the faster; unmeasured, the grouped GEMMs.
TRACED_PAIRS_PER_EXPERT = 2
_TRACED_FASTER: dict[tuple, bool] = {}  # (pairs, E, 2I, H, dtype, threads) -> measured by calibrate


def _choice_key(pairs: int, E: int, two_i: int, H: int, dtype: str) -> tuple:
    return pairs, E, two_i, H, dtype, torch.get_num_threads()


@torch._dynamo.assume_constant_result
def traced_is_faster(pairs: int, E: int, two_i: int, H: int, dtype: str) -> bool:
    """Whether a compiled step traces its experts' contraction (else it calls the grouped GEMMs).
    Read once as a constant when a step is traced, with no guard: a compiled step keeps the form
    it was traced with, and a later measurement does not recompile it."""
    measured = _TRACED_FASTER.get(_choice_key(pairs, E, two_i, H, dtype))
    return pairs <= TRACED_PAIRS_PER_EXPERT * E if measured is None else measured


def calibrate(T: int, k: int, experts: list[tuple[torch.Tensor, torch.Tensor]], repeats: int = 3) -> bool:
    """Whether the traced contraction is the faster compiled form of T tokens' experts, over
    ``experts``: every MoE layer's (gate_up, down), run one after the other as a step does (a
    model's experts outgrow the CPU's caches; one layer's alone would not). Up to
    ``TRACED_PAIRS_PER_EXPERT`` pairs per expert it is; past that both are timed (random rows and
    routing, the best of a few runs each), once per number of pairs, shape, dtype and thread
    count, and the answer recorded for :func:`traced_is_faster`. A measurement costs a
    compilation of the contraction (~3 s on 2 CPU cores); one that fails leaves the grouped op."""
    gate_up = experts[0][0]
    E, two_i, H = gate_up.shape
    if T * k <= TRACED_PAIRS_PER_EXPERT * E:
        return True
    key = _choice_key(T * k, E, two_i, H, str(gate_up.dtype))
    if key not in _TRACED_FASTER:
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, H, generator=g).to(gate_up.dtype)
        weights, ids = torch.softmax(torch.randn(T, E, generator=g), -1).topk(min(k, E), dim=-1)
        weights = weights.to(gate_up.dtype)
        traced = torch.compile(_moe_experts_traced, dynamic=False)

        def every_layer(form):
            return lambda: [form(x, ids, weights, up, down) for up, down in experts]

        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=64):
            try:
                t_traced = _best_seconds(every_layer(traced), repeats)
            except Exception:  # noqa: BLE001 - the contraction does not compile here: the grouped op
                t_traced = float("inf")
            t_grouped = _best_seconds(every_layer(_moe_experts_cpu), repeats)
        _TRACED_FASTER[key] = t_traced < t_grouped
    return _TRACED_FASTER[key]


def _best_seconds(run, repeats: int) -> float:
    run()  # compiles, warms the caches
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best


@torch.library.custom_op("clover_kernels::moe_experts_grouped", mutates_args=())
def _moe_experts_grouped(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor) -> torch.Tensor:
    """The CPU path's grouped GEMMs as one op a compiled step calls without tracing into it
    (torch's ``grouped_mm`` has a meta function for bf16 only, and below as many pairs as experts
    the loop over the experts hit reads their count from the host: both stay outside the graph)."""
    return _moe_experts_cpu(x, expert_ids, weights, gate_up, down)


@_moe_experts_grouped.register_fake
def _(x, expert_ids, weights, gate_up, down):
    return x.new_empty(x.shape)


def _moe_experts_cpu(x, expert_ids, weights, gate_up, down, packed=None, slots: bool = False):
    """CPU path: the (token, slot) pairs sorted by expert; while fewer pairs than experts (decode:
    most experts idle), one GEMM per expert *hit* and per projection on its contiguous rows (CPU
    grouped_mm issues a matmul for every expert, empty groups included); from as many pairs as
    experts on (a block, a batch), one ``grouped_mm`` per projection, which runs the groups in one
    call (1.3-2x faster than the loop at 16-512 tokens of the embedded model, one thread). The
    activation, the routing weights and the scatter back run once over all pairs, in fp32."""
    T, H = x.shape
    k = expert_ids.shape[1]
    E, two_i, _ = gate_up.shape
    I = two_i // 2
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // k
    if T * k >= E:
        offsets = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
        h = F.grouped_mm(x[token_of], gate_up.transpose(1, 2), offs=offsets)  # [T*k, 2I]
        y = F.grouped_mm(F.silu(h[:, :I]).mul_(h[:, I:]), down.transpose(1, 2), offs=offsets).float()  # [T*k, H]
    else:
        hit, counts = torch.unique_consecutive(flat[order], return_counts=True)
        groups = list(zip(hit.tolist(), torch.cumsum(counts, 0).tolist(), counts.tolist()))  # (expert, end, rows)
        packed_gate_up, packed_down = packed if packed is not None else (None, None)
        h = _per_expert(x[token_of], gate_up, groups, packed_gate_up)  # [T*k, 2I]
        y = _per_expert(F.silu(h[:, :I]).mul_(h[:, I:]), down, groups, packed_down).float()  # [T*k, H]
    y = y.mul_(weights.reshape(-1)[order, None].float())
    if slots:
        return _unsorted(y, order, T, k)
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    return out.index_add_(0, token_of, y).to(x.dtype)


def _per_expert(rows: torch.Tensor, weight: torch.Tensor, groups, packed=None) -> torch.Tensor:
    """Rows grouped by expert [N, K] times their expert's weight [E, O, K]^T -> [N, O]."""
    return torch.cat([linear(rows[end - n:end], weight[e], packed=packed and packed[e]) for e, end, n in groups])
