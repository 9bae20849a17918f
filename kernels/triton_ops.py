"""The Triton implementations, by op name, for ``dispatch.py``.

``OPS[name]`` has exactly the signature and return contract of the torch reference of the
same name. Importing this module never fails: where triton (or one kernel module) cannot be
imported, its ops are simply absent and ``MISSING`` says why.
"""
import importlib

OPS: dict = {}
MISSING: dict = {}  # op name -> reason it has no Triton implementation here

_SOURCES = {
    "rms_norm": ("clover_kernels.norm.rms", "rms_norm"),
    "add_rms_norm": ("clover_kernels.norm.rms", "add_rms_norm"),
    "gated_rms_norm": ("clover_kernels.norm.rms", "gated_rms_norm"),
    "qk_norm_rope": ("clover_kernels.rope.fused", "qk_norm_rope"),
    "gdn_gates": ("clover_kernels.gates.fused", "gdn_gates"),
    "sigmoid_gate": ("clover_kernels.gates.fused", "sigmoid_gate"),
    "silu_mul": ("clover_kernels.gates.fused", "silu_mul"),
    "moe_combine": ("clover_kernels.gates.fused", "moe_combine"),
    "gdn_commit": ("clover_kernels.gdn.commit", "gdn_commit"),
    "gdn_preview": ("clover_kernels.gdn.preview", "gdn_preview"),
    "moe_experts": ("clover_kernels.moe.fused", "moe_experts"),
    "route": ("clover_kernels.moe.route", "route"),
    "linear_fp8": ("clover_kernels.fp8.gemm", "linear"),
    "moe_experts_fp8": ("clover_kernels.fp8.moe", "moe_experts"),
}


def _load():
    for name, (module, attr) in _SOURCES.items():
        try:
            OPS[name] = getattr(importlib.import_module(module), attr)
        except Exception as exc:  # triton missing or broken: the op falls back to its reference
            MISSING[name] = f"{module}: {type(exc).__name__}: {exc}"


_load()
