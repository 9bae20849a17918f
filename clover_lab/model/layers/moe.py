"""The sparse MoE block: the router (softmax, coreset mask, top-k, renormalise: the one routing
rule, which route events re-run), the routed experts and the sigmoid-gated shared expert.

What a route hook hands back (``expert_ids`` / ``weights`` assigned, or edited in place) is
checked before the experts run: integer ids in [0, E) of shape [T, k], floating weights of the
same shape within +-1e6 (finite); anything else is a HookError naming the point. Only a changed event is
checked (tensor identity and version counters), so observing hooks add no host read.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from clover_kernels import dense, ops
from clover_kernels.moe.naive import allowed_experts, select
from clover_kernels.moe.torch import calibrate
from clover_lab.config import CloverConfig
from clover_lab.hooks import points
from clover_lab.hooks.events import RouteEvent, edit_count
from clover_lab.hooks.registry import HookError, HookRegistry
from clover_lab.model.context import ForwardContext
from clover_lab.model.layers.linear import FusedProjections, Linear, SwiGLU

# route weights are mixture weights (the router's are in [0, 1] and sum to 1); a hook's beyond this
# would push the residual stream past float32's range in the next norm's mean square, which
# silently turns it into zeros rather than NaN
MAX_ROUTE_WEIGHT = 1e6


class Router(nn.Module):
    """Router probabilities (softmax over every expert, fp32) and the routing rule: the top-k
    among the allowed experts, their probabilities renormalised to sum to 1."""

    packed: dense.PackedWeight | None = None  # the weight in oneDNN's layout (CloverModel.pack_weights)

    def __init__(self, config: CloverConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.top_k = config.num_experts_per_tok

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> router probabilities [..., E] in fp32."""
        return torch.softmax(self.logits(x), dim=-1, dtype=torch.float32)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return dense.linear(x, self.weight, packed=self.packed)

    def route(self, logits: torch.Tensor, within: torch.Tensor | None = None, record: torch.Tensor | None = None):
        """logits [T, E] -> (probs [T, E] fp32, expert ids [T, k], weights [T, k] fp32): softmax and
        ``select`` in one kernel on a GPU (``clover_kernels.ops.route``); ``within``: a coreset's expert
        ids to route among, ``record``: a coreset buffer to record these rows' coreset into."""
        return ops.route(logits, self.top_k, within=within, record=record)

    def select(self, probs: torch.Tensor, allowed: torch.Tensor | None = None):
        """probs [T, E], allowed [E] or [T, E] bool (None: every expert) -> (expert ids [T, k], weights [T, k]
        fp32): the top k among the allowed, renormalised (``clover_kernels.moe.naive.select``)."""
        return select(probs, self.top_k, allowed)


class Experts(nn.Module):
    """The routed experts as fused tensors: gate_up_proj [E, 2I, H], down_proj [E, H, I].

    ``store``: where the weights live when they are not on the compute device (an offload store,
    ``clover_lab.placement``); it stages the experts a forward routes to and calls :meth:`compute`
    on them. FP8 weights: ``layers/fp8.py``."""

    # (gate_up, down): one PackedWeight per expert each (CloverModel.pack_weights), or None
    packed: tuple[list[dense.PackedWeight], list[dense.PackedWeight]] | None = None
    store = None

    def __init__(self, config: CloverConfig):
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def expert_tensors(self) -> dict[str, torch.Tensor]:
        """Every per-expert tensor, by name, each indexed by expert along dim 0."""
        return {"gate_up_proj": self.gate_up_proj, "down_proj": self.down_proj}

    def compute(self, x, expert_ids, weights, tensors: dict[str, torch.Tensor], packed=None,
                slots: bool = False) -> torch.Tensor:
        """The routed experts' output [T, H] over ``tensors`` (this module's own, or a staged subset
        with ``expert_ids`` renumbered into it); ``slots``: each (token, slot) pair's [T, k, H] fp32."""
        return ops.moe_experts(x, expert_ids, weights, tensors["gate_up_proj"], tensors["down_proj"], packed,
                               slots=slots)

    def leaves_slots(self, x, weights) -> bool:
        """Whether the experts run here through the Triton kernels, whose per-slot outputs
        ``moe_combine`` sums in its own pass (one launch fewer). The torch path sums here, in its
        own order (by expert), which a sum over slots would change in the last bit."""
        return self.store is None and ops.moe_experts.runs_kernel(x, weights, self.gate_up_proj, self.down_proj)

    def forward(self, x, expert_ids, weights, coreset: torch.Tensor | None = None, slots: bool = False) -> torch.Tensor:
        """x [T, H], expert_ids and weights [T, k] -> [T, H], or with ``slots`` (where
        ``leaves_slots``) the per-slot outputs [T, k, H] fp32; ``coreset``: this layer's recorded
        coreset of the current block, if any (an offload store keeps those experts staged for the block)."""
        if self.store is not None:  # a batch's per-row coresets [B, size]: the store holds their union
            held = coreset if coreset is None or coreset.dim() == 1 else coreset.reshape(-1).unique()
            return self.store.run(self, x, expert_ids, weights, held)
        extra = {"slots": True} if slots else {}  # only where leaves_slots (FP8Experts.compute has no slots)
        return self.compute(x, expert_ids, weights, self.expert_tensors(), self.packed, **extra)


def calibrate_experts(layers, tokens: int, k: int) -> None:
    """Which form a compiled CPU step of ``tokens`` tokens gives its experts, the traced
    contraction or the grouped GEMMs (``clover_kernels.moe.torch.calibrate``: measured once per
    process and number of tokens, on every MoE layer's weights). Not for FP8 or offloaded experts."""
    experts = [layer.mlp.experts for layer in layers]
    if all(type(e) is Experts and e.store is None and e.gate_up_proj.device.type == "cpu" for e in experts):
        calibrate(tokens, k, [(e.gate_up_proj.detach(), e.down_proj.detach()) for e in experts])


class SparseMoE(nn.Module):
    """Softmax router, renormalised top-k, routed experts plus a sigmoid-gated shared expert
    (none when ``config.num_shared_experts`` is 0)."""

    def __init__(self, config: CloverConfig, layer: int, hooks: HookRegistry):
        super().__init__()
        self.layer = layer
        self.hooks = hooks
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.gate = Router(config)
        self.experts = Experts(config)
        if config.num_shared_experts:
            self.shared_expert = SwiGLU(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.route_point = points.layer_point(layer, points.MOE_ROUTE)
        # one GEMM for the router logits and the shared expert's gate and up (its one-column gate scalar
        # stays apart: a GEMV there, and columns of a GEMM differ from it in the last bit on the CPU)
        shared = ("shared_expert.gate_proj", "shared_expert.up_proj") if config.num_shared_experts else ()
        self.projections = FusedProjections("gate", *shared)

    def route(self, logits: torch.Tensor, mode: str, ctx: ForwardContext, lo: int, hi: int, batch: int,
              dtype: torch.dtype):
        """Top-k routing of rows [lo, hi) of every batch row (router logits [batch * (hi - lo), E]); a
        preview with a coreset records it (the block's first preview) or routes within it.
        Returns (expert_ids [T, k], weights [T, k] in ``dtype``)."""
        coreset = ctx.coreset
        within = record = None
        if mode == "preview" and coreset is not None:
            if coreset.size < self.top_k:  # fewer allowed experts than picks would route outside the coreset
                raise ValueError(f"coreset size {coreset.size} is below num_experts_per_tok={self.top_k}")
            # a batch's coreset is [batch, size]: each row's block its own, its tokens routed among it
            within = coreset.experts.get(self.layer)
            if within is None:  # the block's first preview: routed fully, it records the coreset in place
                size = min(coreset.size, self.num_experts)
                record = coreset.buffer(self.layer, (size,) if batch == 1 else (batch, size), logits.device)
        probs, ids, weights = self.gate.route(logits, within, record)
        if record is not None:
            coreset.experts[self.layer] = record
        weights = weights.to(dtype)
        if ctx.router_stats is not None:
            ctx.router_stats.append((probs, ids))
        if ctx.hooks and self.hooks.active(self.route_point):
            event = RouteEvent(self.layer, mode, ctx.flat_positions(lo, hi, batch), probs, ids, weights,
                               self._allowed(within, probs),
                               select=self.gate.select, where=ctx.where)
            before = (edit_count(ids), edit_count(weights))
            self.hooks.fire(self.route_point, event)
            if (event.expert_ids is not ids or event.weights is not weights
                    or (edit_count(ids), edit_count(weights)) != before or None in before):
                ids, weights = checked_route(event, self.route_point, probs.shape[0], self.num_experts)
            weights = weights.to(dtype)
        elif self.route_point in ctx.observed:  # a static step: its observers read this after it
            ctx.record(self.route_point, mode, lo, hi, True, positions=ctx.flat_positions(lo, hi, batch),
                       router_probs=probs, expert_ids=ids, weights=weights, selectable=self._allowed(within, probs))
        return ids, weights

    def _allowed(self, within: torch.Tensor | None, probs: torch.Tensor) -> torch.Tensor | None:
        """The mask a coreset's routing applied (what route events carry), built only for them."""
        return None if within is None else allowed_experts(within, self.num_experts, probs.shape[0])

    def forward(self, x: torch.Tensor, ctx: ForwardContext, residual: torch.Tensor | None = None,
                next_norm=None):
        """The block's output for its input x [B, T, H]; given the ``residual`` stream, that stream
        with the output added (one kernel on a GPU with the shared expert's gate); given the next
        layer's input norm too, (the stream, that norm of it) from the same kernel."""
        B, T, H = x.shape
        logits, *shared = self.projections(self, x)  # [B, T, E] (and [B, T, Is] twice with a shared expert)
        ids, weights = [], []
        # commit and preview rows route by one rule unless a coreset, router statistics or a route hook
        # (or a static step's route observers) tells the parts apart: then one routing launch covers both
        one_rule = (ctx.coreset is None and ctx.router_stats is None and self.route_point not in ctx.observed
                    and not (ctx.hooks and self.hooks.active(self.route_point)))
        parts = (("commit", 0, T),) if one_rule else (("commit", 0, ctx.c), ("preview", ctx.c, ctx.c + ctx.m))
        for mode, lo, hi in parts:
            if hi > lo:
                i, w = self.route(logits[:, lo:hi].reshape(-1, self.num_experts), mode, ctx, lo, hi, B, x.dtype)
                ids.append(i.view(B, hi - lo, -1))
                weights.append(w.view(B, hi - lo, -1))
        ids = torch.cat(ids, dim=1).reshape(B * T, -1) if len(ids) > 1 else ids[0].reshape(B * T, -1)
        weights = torch.cat(weights, dim=1).reshape(B * T, -1) if len(weights) > 1 else weights[0].reshape(B * T, -1)
        flat = x.reshape(B * T, H)
        coreset = None if ctx.coreset is None else ctx.coreset.experts.get(self.layer)
        gate = self.shared_expert_gate
        fused_gate = self.shared_expert is None or (isinstance(gate, Linear)
                                                    and not (gate._forward_hooks or gate._forward_pre_hooks))
        # moe_combine sums the Triton kernels' per-slot outputs [B, T, k, H] (it tells them by their
        # extra dim, against the residual or x)
        slots = (fused_gate and (residual is not None or self.shared_expert is not None)
                 and self.experts.leaves_slots(flat, weights))
        out = self.experts(flat, ids, weights, coreset, slots=slots)
        out = out.view(B, T, *out.shape[1:])
        norm = {} if next_norm is None else dict(norm_weight=next_norm.weight, eps=next_norm.eps)
        if self.shared_expert is None:
            return ops.moe_combine(residual, out, **norm)
        shared = self.shared_expert.down(*shared)
        if fused_gate:
            return ops.moe_combine(residual, out, x, gate.weight, shared, gate.packed, **norm)
        # a wrapped gate (a peft adapter, a module hook) runs its own forward
        return ops.moe_combine(residual, out + torch.sigmoid(gate(x)) * shared, **norm)


def checked_route(event: RouteEvent, point: str, rows: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A route hook's changed decision, validated (reads the device: only after a change):
    expert ids [rows, k] in [0, num_experts), weights [rows, k] finite floats."""
    ids, weights = event.expert_ids, event.weights

    def bad(what: str):
        raise HookError(point, ValueError(what))

    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        bad(f"expert_ids must be an integer tensor [{rows}, k], got {type(ids).__name__} "
            f"{getattr(ids, 'dtype', ids)!r}")
    if ids.dim() != 2 or ids.shape[0] != rows or ids.shape[1] < 1:
        bad(f"expert_ids must have shape [{rows}, k], got {list(ids.shape)}")
    if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
        bad(f"weights must be a floating tensor of expert_ids' shape {list(ids.shape)}, got "
            f"{type(weights).__name__} {getattr(weights, 'dtype', weights)!r}")
    if weights.shape != ids.shape:
        bad(f"weights must have expert_ids' shape {list(ids.shape)}, got {list(weights.shape)}")
    ids = ids.to(event.router_probs.device, torch.long)
    weights = weights.to(event.router_probs.device)
    in_range = (weights.abs() <= MAX_ROUTE_WEIGHT).all()  # False for NaN too
    lo_hi_finite = torch.stack([ids.min(), ids.max(), in_range.long()]).tolist()
    if lo_hi_finite[0] < 0 or lo_hi_finite[1] >= num_experts:
        bad(f"expert_ids must be in [0, {num_experts}), got values from {lo_hi_finite[0]} to {lo_hi_finite[1]}")
    if not lo_hi_finite[2]:
        bad(f"weights hold NaN or inf, or lie beyond +-{MAX_ROUTE_WEIGHT:g}")
    return ids.contiguous(), weights.contiguous()
