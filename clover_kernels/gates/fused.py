"""Triton kernels of the gating ops between the GEMMs (references: ``gates/naive.py``), each one
launch where the torch path takes two to six:

- ``_gdn_gates_kernel`` [grid: row tiles]: g and beta of BR rows x Hv heads;
- ``_gated_pair_kernel`` [grid: rows x heads]: ``out * sigmoid(gate)`` (the attention output
  gate) or ``silu(gate) * up`` (SwiGLU), reading both inputs through their strides as [B, T, G, D]
  (the per-head views of a fused projection's output: no copies), writing a contiguous [B, T, G * D];
- ``_moe_combine_kernel`` [grid: rows]: ``(residual +) routed (+ sigmoid(x . w) * shared)``, the
  shared expert's one-column gate a dot product in the program, no GEMV launch; the routed
  experts' k per-slot outputs summed in the program (SLOTS: no reduction launch); optionally the
  next layer's input norm of the result too (the residual add fused with the norm after it).

fp32 arithmetic, each result rounded to the activations' dtype where the reference rounds it.
"""
import torch
import triton
import triton.language as tl

from ..norm.rms import _num_warps, _rows, zero_centred_rms

SIGMOID_GATE, SILU_MUL = 0, 1


@triton.jit
def _gdn_gates_kernel(b_ptr, a_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, R, HV, s_b, s_a,
                      BR: tl.constexpr, BH: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    h = tl.arange(0, BH)
    m = (r < R)[:, None] & (h < HV)[None, :]
    r64 = r.to(tl.int64)[:, None]
    b = tl.load(b_ptr + r64 * s_b + h[None, :], mask=m, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + r64 * s_a + h[None, :], mask=m, other=0.0).to(tl.float32)
    alog = tl.load(alog_ptr + h, mask=h < HV, other=0.0).to(tl.float32)
    dtb = tl.load(dtb_ptr + h, mask=h < HV, other=0.0).to(tl.float32)
    x = a + dtb[None, :]
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold 20
    g = -tl.exp(alog)[None, :] * softplus
    tl.store(g_ptr + r64 * HV + h[None, :], g, mask=m)
    tl.store(beta_ptr + r64 * HV + h[None, :], tl.sigmoid(b).to(beta_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gated_pair_kernel(x_ptr, y_ptr, out_ptr, T, G, D, s_xb, s_xt, s_xg, s_yb, s_yt, s_yg,
                       OP: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1).to(tl.int64)
    b, t = row // T, row % T
    d = tl.arange(0, BD)
    m = d < D
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + b * s_xb + t * s_xt + grp * s_xg + d, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + b * s_yb + t * s_yt + grp * s_yg + d, mask=m, other=0.0).to(tl.float32)
    if OP == 0:  # out * sigmoid(gate): x the attention output, y the gate
        z = x * tl.sigmoid(y).to(dt).to(tl.float32)
    else:  # silu(gate) * up: x the gate, y the up projection
        z = (x * tl.sigmoid(x)).to(dt).to(tl.float32) * y
    tl.store(out_ptr + (row * G + grp) * D + d, z.to(dt), mask=m)


@triton.jit
def _moe_combine_kernel(res_ptr, routed_ptr, x_ptr, w_ptr, shared_ptr, out_ptr, nw_ptr, normed_ptr, N, K,
                        s_r, s_o, s_ok, s_x, s_w, s_s, s_out, eps, HAS_RESIDUAL: tl.constexpr, HAS_SHARED: tl.constexpr,
                        HAS_NORM: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    dt = out_ptr.dtype.element_ty
    if SLOTS:  # the k slots' fp32 outputs, summed in slot order, rounded as the reference rounds the sum
        out = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(K):
            out += tl.load(routed_ptr + row * s_o + j * s_ok + cols, mask=m, other=0.0)
        out = out.to(dt).to(tl.float32)
    else:
        out = tl.load(routed_ptr + row * s_o + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_SHARED:
        x = tl.load(x_ptr + row * s_x + cols, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols * s_w, mask=m, other=0.0).to(tl.float32)
        gate = tl.sigmoid(tl.sum(x * w, axis=0).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        shared = tl.load(shared_ptr + row * s_s + cols, mask=m, other=0.0).to(tl.float32)
        out = out + (gate * shared).to(dt).to(tl.float32)
    if HAS_RESIDUAL:
        out = tl.load(res_ptr + row * s_r + cols, mask=m, other=0.0).to(tl.float32) + out.to(dt).to(tl.float32)
    out = out.to(dt)
    tl.store(out_ptr + row * s_out + cols, out, mask=m)
    if HAS_NORM:  # the next layer's input norm of the stream (rms_norm's arithmetic)
        tl.store(normed_ptr + row * s_out + cols, zero_centred_rms(out.to(tl.float32), nw_ptr, cols, m, N, eps).to(dt),
                 mask=m)


def gdn_gates(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Same contract as ``naive.gdn_gates``; g and beta come out contiguous."""
    hv = b.shape[-1]
    if a.shape != b.shape or A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(f"gdn_gates: b {tuple(b.shape)}, a {tuple(a.shape)}, A_log {tuple(A_log.shape)}, "
                         f"dt_bias {tuple(dt_bias.shape)}: expected b and a [..., Hv], A_log and dt_bias [Hv]")
    b2, a2 = _rows(b, hv, "gdn_gates: b"), _rows(a, hv, "gdn_gates: a")
    g = torch.empty(b2.shape, dtype=torch.float32, device=b.device)
    beta = torch.empty(b2.shape, dtype=b.dtype, device=b.device)
    R = b2.shape[0]
    if R:
        BR = 16
        _gdn_gates_kernel[(triton.cdiv(R, BR),)](b2, a2, A_log.contiguous(), dt_bias.contiguous(), g, beta, R, hv,
                                                 b2.stride(0), a2.stride(0), BR=BR, BH=triton.next_power_of_2(hv),
                                                 num_warps=1)
    return g.view(b.shape), beta.view(b.shape)


def _heads(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``t`` as [B, T, G, D] with a unit last stride (a view when it can be)."""
    t = t.reshape(shape) if t.shape != shape else t
    return t if t.stride(-1) == 1 else t.contiguous()


def _gated_pair(op: int, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if x.shape != y.shape:
        raise ValueError(f"{name}: shapes {tuple(x.shape)} and {tuple(y.shape)} differ")
    if x.dim() < 2:
        x, y = x.reshape(1, 1, -1), y.reshape(1, 1, -1)
    shape4 = (-1, *x.shape[-3:]) if x.dim() >= 4 else (-1, *x.shape[-2:-1], 1, x.shape[-1])
    x4, y4 = _heads(x, shape4), _heads(y, shape4)
    B, T, G, D = x4.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        block = triton.next_power_of_2(D)
        _gated_pair_kernel[(B * T, G)](x4, y4, out, T, G, D, *x4.stride()[:3], *y4.stride()[:3],
                                       OP=op, BD=block, num_warps=_num_warps(block))
    return out


def sigmoid_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Same contract as ``naive.sigmoid_gate``; [..., G, D] views (per-head slices) read in place."""
    return _gated_pair(SIGMOID_GATE, "sigmoid_gate", out, gate)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Same contract as ``naive.silu_mul``."""
    return _gated_pair(SILU_MUL, "silu_mul", gate, up)


def moe_combine(residual, routed, x=None, gate_weight=None, shared=None, norm_weight=None, eps=1e-6):
    """Same contract as ``naive.moe_combine`` (its ``gate_packed``, the CPU's, not taken)."""
    n = routed.shape[-1]
    like = residual if residual is not None else x
    slots = like is not None and routed.dim() == like.dim() + 1  # [..., k, H]: the experts' per-slot outputs
    shape = routed.shape[:-2] + routed.shape[-1:] if slots else routed.shape
    if ((residual is not None and residual.shape != shape)
            or (shared is not None and (shared.shape != shape or x is None or x.shape != shape
                                        or gate_weight is None or gate_weight.numel() != n))):
        raise ValueError(f"moe_combine: residual {None if residual is None else tuple(residual.shape)}, routed "
                         f"{tuple(routed.shape)}, x {None if x is None else tuple(x.shape)}, gate_weight "
                         f"{None if gate_weight is None else tuple(gate_weight.shape)}, shared "
                         f"{None if shared is None else tuple(shared.shape)}: expected one shape [..., H] "
                         f"and a [1, H] gate weight with a shared expert")
    if slots:
        k = routed.shape[-2]
        o2 = routed.reshape(-1, k, n)
        o2 = o2 if o2.stride(-1) == 1 else o2.contiguous()
    else:
        k, o2 = 1, _rows(routed, n, "moe_combine: routed")
    has_res, has_shared = residual is not None, shared is not None
    r2 = _rows(residual, n, "moe_combine: residual") if has_res else o2
    x2 = _rows(x, n, "moe_combine: x") if has_shared else o2
    s2 = _rows(shared, n, "moe_combine: shared") if has_shared else o2
    w = gate_weight.reshape(-1) if has_shared else o2
    if norm_weight is not None and norm_weight.shape != (n,):
        raise ValueError(f"moe_combine: norm_weight {tuple(norm_weight.shape)}, expected ({n},)")
    out = torch.empty(o2.shape[0], n, dtype=like.dtype if slots else routed.dtype, device=routed.device)
    has_norm = norm_weight is not None
    normed = torch.empty_like(out) if has_norm else out
    if o2.shape[0]:
        block = triton.next_power_of_2(n)
        _moe_combine_kernel[(o2.shape[0],)](r2, o2, x2, w, s2, out, norm_weight.contiguous() if has_norm else out,
                                            normed, n, k, r2.stride(0), o2.stride(0), o2.stride(1) if slots else 0,
                                            x2.stride(0), w.stride(0) if has_shared else 0, s2.stride(0),
                                            out.stride(0), float(eps), HAS_RESIDUAL=has_res, HAS_SHARED=has_shared,
                                            HAS_NORM=has_norm, SLOTS=slots, BLOCK=block, num_warps=_num_warps(block))
    out = out.view(shape)
    return (out, normed.view(shape)) if has_norm else out
