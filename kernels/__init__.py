"""clover_kernels: the production kernel core of clover_lab (torch + Triton only).

Per op, one folder: ``naive.py`` the readable reference (loops, the spec's formulas),
``torch.py`` the production torch path where it differs (chunked, grouped, oneDNN), and the
Triton kernels (``commit.py``, ``preview.py``, ``fused.py``, ``rms.py``, ``split_kv.py``; shared device
functions in ``common.py``). Every op is one row of the table in ``ops.py`` (name, torch
reference, Triton implementation); calling it dispatches between the two (``dispatch.py``).
"""
from .dense import PackedWeight, can_pack, linear
from .dispatch import backend_for, forced_backend, kernel_table
from .ops import OPS

rms_norm = OPS["rms_norm"]
add_rms_norm = OPS["add_rms_norm"]
gated_rms_norm = OPS["gated_rms_norm"]
qk_norm_rope = OPS["qk_norm_rope"]
gdn_gates = OPS["gdn_gates"]
sigmoid_gate = OPS["sigmoid_gate"]
silu_mul = OPS["silu_mul"]
moe_combine = OPS["moe_combine"]
gdn_commit = OPS["gdn_commit"]
gdn_preview = OPS["gdn_preview"]
moe_experts = OPS["moe_experts"]
route = OPS["route"]
linear_fp8 = OPS["linear_fp8"]
moe_experts_fp8 = OPS["moe_experts_fp8"]
cache_attention = OPS["cache_attention"]

__all__ = ["linear", "PackedWeight", "can_pack", "backend_for", "forced_backend", "kernel_table", *OPS]
