"""Triton RMSNorm kernels: zero-centred ``x / rms(x) * (1 + w)`` (alone, or after the residual
add before it: both the sum and the normed rows written by one launch) and the GDN output norm
``w * x / rms(x) * silu(gate)``. One program per row (hidden sizes here are <= 8k, so a row
fits one block); fp32 accumulation, output in x's dtype. References: ``norm/naive.py``."""
import torch
import triton
import triton.language as tl


@triton.jit
def zero_centred_rms(x, w_ptr, cols, mask, N, eps):
    """A row x (fp32, zeros past ``mask``) -> ``x / rms(x) * (1 + w)`` in fp32: the zero-centred
    RMSNorm every kernel here that norms the residual stream computes."""
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    return x * inv_rms * (1.0 + w)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = zero_centred_rms(x, w_ptr, cols, mask, N, eps)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, N, stride_x, stride_d, stride_s, stride_o, eps,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
    total = (x + d).to(sum_ptr.dtype.element_ty)  # the residual stream, rounded as the add rounds it
    tl.store(sum_ptr + row * stride_s + cols, total, mask=mask)
    y = zero_centred_rms(total.to(tl.float32), w_ptr, cols, mask, N, eps)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, N, G, stride_x, stride_g0, stride_g1, stride_o, eps,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    # gate row r: head r % G of row r // G (the per-head slices of a projection, read in place)
    gate = tl.load(gate_ptr + (row // G) * stride_g0 + (row % G) * stride_g1 + cols, mask=mask, other=0.0)
    gate = gate.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    y = w * (x * inv_rms) * (gate * tl.sigmoid(gate))
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """[..., n] -> [rows, n] with unit stride in the last dim (a view when possible)."""
    if t.shape[-1] != n:
        raise ValueError(f"{name}: last dim {t.shape[-1]}, expected {n}")
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _num_warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Same contract as ``norm.naive.rms_norm``."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)}, expected ({n},)")
    x2 = _rows(x, n, "rms_norm: x")
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), out, n, x2.stride(0), out.stride(0), float(eps),
            BLOCK=block, num_warps=_num_warps(block),
        )
    return out.reshape(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """Same contract as ``norm.naive.add_rms_norm``."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"add_rms_norm: weight shape {tuple(weight.shape)}, expected ({n},)")
    if delta.shape != x.shape:
        raise ValueError(f"add_rms_norm: delta shape {tuple(delta.shape)}, expected x's {tuple(x.shape)}")
    x2, d2 = _rows(x, n, "add_rms_norm: x"), _rows(delta, n, "add_rms_norm: delta")
    total = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    out = torch.empty_like(total)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2, d2, weight.contiguous(), total, out, n, x2.stride(0), d2.stride(0), total.stride(0), out.stride(0),
            float(eps), BLOCK=block, num_warps=_num_warps(block),
        )
    return total.reshape(x.shape), out.reshape(x.shape)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Same contract as ``norm.naive.gated_rms_norm``."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"gated_rms_norm: weight shape {tuple(weight.shape)}, expected ({n},)")
    if gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: gate shape {tuple(gate.shape)}, expected x's {tuple(x.shape)}")
    x2 = _rows(x, n, "gated_rms_norm: x")
    g3 = gate.reshape(-1, gate.shape[-2] if gate.dim() > 1 else 1, n)  # [rows / G, G, n]: a view of head slices
    g3 = g3 if g3.stride(-1) == 1 else g3.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(n)
        _gated_rms_norm_kernel[(x2.shape[0],)](
            x2, g3, weight.contiguous(), out, n, g3.shape[1], x2.stride(0), g3.stride(0), g3.stride(1), out.stride(0),
            float(eps),
            BLOCK=block, num_warps=_num_warps(block),
        )
    return out.reshape(x.shape)
