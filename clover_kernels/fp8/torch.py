"""The torch path of block-scaled FP8 weights (tested against ``naive.py``): dequantize what a call
uses into the activations' dtype, then the ordinary op. It serves CPU tensors kept in FP8 and
CUDA without Triton; the Triton kernels (``gemm.py``, ``moe.py``) never materialise a dequantized
weight. The expert path reads which experts are hit (one host synchronisation)."""
import torch

from ..dense import linear as dense_linear
from ..moe import torch as moe_torch
from . import naive


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block, bias=None) -> torch.Tensor:
    w = naive.dequantize(weight, scale, block, dtype=x.dtype)
    return dense_linear(x, w, None if bias is None else bias.to(x.dtype))


def moe_experts(x, expert_ids, weights, gate_up, down, gate_up_scale, down_scale, block) -> torch.Tensor:
    """Only the experts hit are dequantized ([U, ...] in x's dtype); ids are renumbered into them."""
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    hit, local = torch.unique(expert_ids, return_inverse=True)
    I = gate_up.shape[1] // 2
    ni = -(-I // block[0])
    gu, gs = gate_up[hit], gate_up_scale[hit]
    gu = torch.cat([naive.dequantize(gu[:, :I], gs[:, :ni], block, x.dtype),
                    naive.dequantize(gu[:, I:], gs[:, ni:], block, x.dtype)], dim=1)
    dn = naive.dequantize(down[hit], down_scale[hit], block, x.dtype)
    return moe_torch.moe_experts(x, local.view(expert_ids.shape), weights, gu, dn)
