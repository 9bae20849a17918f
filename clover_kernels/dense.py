"""Dense ``x @ W^T (+ b)`` for CPU inference, through oneDNN where that is the faster kernel.

torch's CPU ``F.linear`` sends fp32 to the BLAS it was built with (MKL), and bf16 to oneDNN.
On AVX-512 CPUs oneDNN's fp32 GEMM is the faster of the two by a wide margin; measured on
the project's 2-core AMD EPYC at 2 threads (``bench/compare_transformers.py`` shows the
effect end to end):

    fp32 [M, K] x [K, N]       MKL (F.linear)   oneDNN   oneDNN, packed weight
    256 x 512 x 1536           186 GFLOP/s      496      ~510
    32 x 512 x 512 (expert)    164              274      ~340
    8 x 512 x 512               99              126      ~200
    1 x 512 x 512               35               29       ~30  <- a single row stays with F.linear
    bf16: 32 x 512 x 512       340 (oneDNN)     340      ~525

Both are fp32 GEMMs (relative error ~1e-6 against float64). ``linear`` takes oneDNN for fp32
inputs of at least ``MIN_ROWS`` rows when nothing needs a gradient and nothing is being traced
(``torch.compile`` lowers ``F.linear`` itself); everything else is ``F.linear``.

Each call reorders the weight into oneDNN's blocked layout, which costs as much as the product
itself at an expert's few dozen rows. A ``PackedWeight`` keeps that layout between calls (opt-in,
``CloverModel.pack_weights``: a second copy of the weights), for fp32 and bf16.
"""
import platform

import torch
import torch.nn.functional as F

MIN_ROWS = 4

_ONEDNN = (torch.backends.mkldnn.is_available() and platform.machine().lower() in ("x86_64", "amd64")
           and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
# oneDNN packs bf16 only on CPUs with avx512bw/vl/dq or avx_ne_convert (an AVX2-only CPU refuses)
_BF16 = _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()
PACKED_DTYPES = (torch.float32, torch.bfloat16) if _BF16 else (torch.float32,)


def _inference_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A CPU product worth a oneDNN call: at least MIN_ROWS rows, no gradient, not traced."""
    return (_ONEDNN and x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == weight.dtype
            and x.numel() >= MIN_ROWS * x.shape[-1] > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and not torch.compiler.is_compiling())


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and _inference_gemm(x, weight)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``PackedWeight`` applies to this weight: fp32 (or bf16, where the CPU has oneDNN's
    bf16 GEMM), on an x86 CPU with oneDNN."""
    return _ONEDNN and weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES


class PackedWeight:
    """One weight [N, K] kept in oneDNN's blocked layout for CPU inference, packed on first use.

    It is a copy: the weight's size again in memory. It follows the weight it is used with: a new
    weight (another tensor, device, dtype or shape) or an in-place change (the version counter:
    ``w.mul_(0)``, ``w[3] = 0`` under ``no_grad``) repacks it on the next call. Writes through
    ``w.data``, and to weights made under ``inference_mode`` (which have no version counter), are
    not seen: call ``clear()`` after them."""

    __slots__ = ("_weight", "_version", "_packed")

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self._weight, self._version, self._packed = None, None, None

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return can_pack(weight) and weight.dim() == 2 and _inference_gemm(x, weight)

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        # the weight packed last is held, so no other tensor can take its address while we compare
        held, version = self._weight, _version(weight)
        if (held is None or weight.data_ptr() != held.data_ptr() or version != self._version
                or weight.shape != held.shape or weight.dtype != held.dtype or weight.stride() != held.stride()):
            self.clear()  # the old copy goes before the new one is made
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            self._weight, self._version = weight, version
        return self._packed

    @property
    def nbytes(self) -> int:
        return 0 if self._packed is None else self._packed.numel() * self._packed.element_size()


def _version(weight: torch.Tensor) -> int:
    return -1 if weight.is_inference() else weight._version


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN's GEMM on the CPU when it pays; with ``packed``,
    on the weight's kept oneDNN layout (fp32 and bf16)."""
    if packed is not None and packed.applies(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, packed.get(weight), bias, "none", [], "")
    if uses_onednn(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
