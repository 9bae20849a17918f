"""clover_kernels: the production kernel core of clover_lab (torch + Triton only).

Per op, one folder: ``naive.py`` the readable reference (loops, the spec's formulas),
``torch.py`` the production torch path where it differs (chunked, grouped, oneDNN), and the
Triton kernels (``commit.py``, ``preview.py``, ``fused.py``, ``rms.py``; shared device
functions in ``common.py``). The functions here dispatch between the torch path and the
kernels; see ``dispatch.py``.
"""
import torch

from .dense import PackedWeight, can_pack, linear
from .dispatch import backend_for, forced_backend, kernel_table
from .fp8 import torch as _fp8
from .gates import naive as _gates
from .gdn import torch as _gdn
from .moe import naive as _moe_naive
from .moe import torch as _moe
from .norm import naive as _norm
from .rope import naive as _rope

__all__ = ["linear", "PackedWeight", "can_pack", "rms_norm", "add_rms_norm", "gated_rms_norm", "qk_norm_rope",
           "gdn_gates", "gdn_commit", "gdn_preview", "sigmoid_gate", "silu_mul", "moe_combine", "moe_experts", "route",
           "linear_fp8", "moe_experts_fp8", "backend_for", "forced_backend"]


def _dispatch(name, reference, *tensors):
    if backend_for(name, *tensors) == "triton":
        return kernel_table()[name]
    return reference


def rms_norm(x, weight, eps=1e-6):
    return _dispatch("rms_norm", _norm.rms_norm, x, weight)(x, weight, eps)


def add_rms_norm(x, delta, weight, eps=1e-6):
    """(x + delta, rms_norm(x + delta)): a residual add and the norm after it, one kernel on a GPU."""
    return _dispatch("add_rms_norm", _norm.add_rms_norm, x, delta, weight)(x, delta, weight, eps)


def gated_rms_norm(x, gate, weight, eps=1e-6):
    return _dispatch("gated_rms_norm", _norm.gated_rms_norm, x, gate, weight)(x, gate, weight, eps)


def qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps=1e-6):
    """The attention's q/k norms and RoPE: q [B, T, Hq, D], k [B, T, Hkv, D] -> [B, heads, T, D] each."""
    fn = _dispatch("qk_norm_rope", _rope.qk_norm_rope, q, k, q_weight, k_weight)
    return fn(q, k, q_weight, k_weight, positions, inv_freq, eps)


def gdn_gates(b, a, A_log, dt_bias):
    """in_proj_b / in_proj_a's outputs -> (log decay g fp32, beta), one kernel on a GPU."""
    return _dispatch("gdn_gates", _gates.gdn_gates, b, a, A_log, dt_bias)(b, a, A_log, dt_bias)


def sigmoid_gate(out, gate):
    """``out * sigmoid(gate)`` (the attention output gate)."""
    return _dispatch("sigmoid_gate", _gates.sigmoid_gate, out, gate)(out, gate)


def silu_mul(gate, up):
    """``silu(gate) * up`` (the SwiGLU activation)."""
    return _dispatch("silu_mul", _gates.silu_mul, gate, up)(gate, up)


def moe_combine(residual, routed, x=None, gate_weight=None, shared=None, gate_packed=None, norm_weight=None,
                eps=1e-6):
    """``residual + routed (+ sigmoid(x @ gate_weight^T) * shared)``: a MoE block's output into the
    residual stream, the shared expert's gate included (and, given ``norm_weight``, the next
    norm of it: a pair), one kernel on a GPU."""
    fn = _dispatch("moe_combine", _gates.moe_combine, routed, residual, x, gate_weight, shared,  # residual may be None
                   norm_weight)
    return fn(residual, routed, x, gate_weight, shared, gate_packed, norm_weight, eps)


def gdn_commit(mixed, ring, conv_weight, g, beta, state, num_k_heads, head_k_dim, head_v_dim):
    fn = _dispatch("gdn_commit", _gdn.gdn_commit, mixed, ring, conv_weight, g, beta, state)
    return fn(mixed, ring, conv_weight, g, beta, state, num_k_heads, head_k_dim, head_v_dim)


def gdn_preview(mixed, ring, conv_weight, right_weight, state, block_scale, history_bias, history_log_n,
                num_k_heads, head_k_dim, head_v_dim, return_history=False):
    fn = _dispatch("gdn_preview", _gdn.gdn_preview, mixed, ring, conv_weight, right_weight, state, block_scale,
                   history_bias, history_log_n)
    return fn(mixed, ring, conv_weight, right_weight, state, block_scale, history_bias, history_log_n,
              num_k_heads, head_k_dim, head_v_dim, return_history)


def moe_experts(x, expert_ids, weights, gate_up, down, packed=None):
    """``packed``: the CPU path's kept oneDNN weights (see ``PackedWeight``); kernels ignore it."""
    if backend_for("moe_experts", x, weights, gate_up, down) == "triton":
        return kernel_table()["moe_experts"](x, expert_ids, weights, gate_up, down)
    return _moe.moe_experts(x, expert_ids, weights, gate_up, down, packed)


def route(logits, top_k, allowed=None):
    """The router's rule over logits [T, E]: (probs fp32 [T, E], expert ids [T, k], weights fp32 [T, k]);
    ``allowed`` [E] or [T, E] bool restricts the picks (a coreset). One kernel on a GPU."""
    return _dispatch("route", _moe_naive.route, logits)(logits, top_k, allowed)


def _fp32_on_gpu(x: torch.Tensor) -> bool:
    """The FP8 kernels are built for bf16 / fp16 activations: fp32 tiles spill on sm_90
    (tests/kernels/test_compile_sm90.py), so fp32 activations on a GPU run the torch path."""
    return x.dtype == torch.float32 and x.is_cuda


def linear_fp8(x, weight, scale, block, bias=None):
    """``x @ W^T (+ bias)`` with W block-scaled FP8 (weight fp8 [N, K], scale [ceil(N/bn), ceil(K/bk)])."""
    fn = _fp8.linear if _fp32_on_gpu(x) else _dispatch("linear_fp8", _fp8.linear, x, bias)
    return fn(x, weight, scale, block, bias)


def moe_experts_fp8(x, expert_ids, weights, gate_up, down, gate_up_scale, down_scale, block):
    """``moe_experts`` over block-scaled FP8 expert weights (scales as in ``fp8/naive.py``)."""
    fn = _fp8.moe_experts if _fp32_on_gpu(x) else _dispatch("moe_experts_fp8", _fp8.moe_experts, x, weights)
    return fn(x, expert_ids, weights, gate_up, down, gate_up_scale, down_scale, block)
