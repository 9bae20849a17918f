"""Dense ``x @ W^T (+ b)`` for CPU inference, through oneDNN where that is the faster kernel.

torch's CPU ``F.linear`` sends fp32 to the BLAS it was built with (MKL), and bf16 to oneDNN.
On AVX-512 CPUs oneDNN's fp32 GEMM is the faster of the two by a wide margin; measured on
the project's 2-core AMD EPYC at 2 threads (``bench/compare_transformers.py`` shows the
effect end to end):

    fp32 [M, K] x [K, N]       MKL (F.linear)   oneDNN
    256 x 512 x 1536           186 GFLOP/s      496 GFLOP/s
    32 x 512 x 512 (expert)    164              274
    8 x 512 x 512               99              126
    1 x 512 x 512               35               29   <- a single row stays with F.linear

Both are fp32 GEMMs (relative error ~1e-6 against float64). ``linear`` takes oneDNN for fp32
inputs of at least ``MIN_ROWS`` rows when nothing needs a gradient and nothing is being traced
(``torch.compile`` lowers ``F.linear`` itself); everything else is ``F.linear``.
"""
import platform

import torch
import torch.nn.functional as F

MIN_ROWS = 4

_ONEDNN = (torch.backends.mkldnn.is_available() and platform.machine().lower() in ("x86_64", "amd64")
           and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.numel() >= MIN_ROWS * x.shape[-1] > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and not torch.compiler.is_compiling())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN's fp32 GEMM on the CPU when it pays."""
    if uses_onednn(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
