"""Linear layers and routed experts whose weights stay in block-scaled FP8 (float8_e4m3fn values,
one fp32 scale per block, ``weight_scale_inv``): what an FP8 checkpoint becomes on a GPU. The
products run through ``clover_kernels.ops.linear_fp8`` / ``moe_experts_fp8`` (the Triton kernels on
CUDA, a dequantizing torch path elsewhere). Built by the loader (``clover_lab/fp8``), never trained."""
from __future__ import annotations

import torch
import torch.nn as nn

from clover_kernels import ops
from clover_kernels.fp8.naive import FP8, scale_shape
from clover_lab.config import CloverConfig
from clover_lab.model.layers.linear import Linear
from clover_lab.model.layers.moe import Experts


class FP8Linear(Linear):
    """A Linear with weight [out, in] in FP8 and ``weight_scale_inv`` [ceil(out/bn), ceil(in/bk)]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int]):
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.block = in_features, out_features, tuple(block)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.register_parameter("bias", nn.Parameter(torch.empty(out_features)) if bias else None)
        self.register_buffer("weight_scale_inv", torch.empty(scale_shape((out_features, in_features), block)))

    @classmethod
    def like(cls, linear: nn.Linear, block) -> "FP8Linear":
        return cls(linear.in_features, linear.out_features, linear.bias is not None, block)

    def forward(self, x):
        return ops.linear_fp8(x, self.weight, self.weight_scale_inv, self.block, self.bias)


class FP8Experts(Experts):
    """Routed experts in FP8: gate_up_proj [E, 2I, H] with ``gate_up_proj_scale_inv``
    [E, 2 ceil(I/bn), ceil(H/bk)] (gate's row blocks, then up's), down_proj [E, H, I] with
    ``down_proj_scale_inv`` [E, ceil(H/bn), ceil(I/bk)]."""

    def __init__(self, config: CloverConfig, block: tuple[int, int]):
        nn.Module.__init__(self)
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.block = tuple(block)
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H, dtype=FP8), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, I, dtype=FP8), requires_grad=False)
        gate = scale_shape((E, I, H), block)
        self.register_buffer("gate_up_proj_scale_inv", torch.empty(E, 2 * gate[1], gate[2]))
        self.register_buffer("down_proj_scale_inv", torch.empty(scale_shape((E, H, I), block)))

    def expert_tensors(self) -> dict[str, torch.Tensor]:
        return {"gate_up_proj": self.gate_up_proj, "down_proj": self.down_proj,
                "gate_up_proj_scale_inv": self.gate_up_proj_scale_inv, "down_proj_scale_inv": self.down_proj_scale_inv}

    def leaves_slots(self, x, weights) -> bool:
        return False  # the FP8 kernels sum the slots themselves

    def compute(self, x, expert_ids, weights, tensors, packed=None):
        return ops.moe_experts_fp8(x, expert_ids, weights, tensors["gate_up_proj"], tensors["down_proj"],
                                   tensors["gate_up_proj_scale_inv"], tensors["down_proj_scale_inv"], self.block)


def is_fp8(module: nn.Module) -> bool:
    return isinstance(module, (FP8Linear, FP8Experts))
