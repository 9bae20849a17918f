"""Readable reference of block-scaled FP8 weights.

A weight W [N, K] is stored as ``float8_e4m3fn`` values Q and one fp32 scale per block of
``block = (bn, bk)`` rows and columns (``weight_scale_inv`` [ceil(N/bn), ceil(K/bk)], the name
Qwen's and DeepSeek's FP8 releases use): W[n, k] = Q[n, k] * scale[n // bn, k // bk]. Blocks at
the edges may be partial. Quantizing takes each block's absolute maximum to 448, e4m3's largest
finite value.

The routed experts fuse gate and up rows: ``gate_up`` [E, 2I, H] has scales [E, 2 * ceil(I/bn),
ceil(H/bk)], gate's row blocks first, then up's; when bn divides I that is exactly the blocks of
the fused matrix.
"""
import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def scale_shape(shape, block) -> tuple[int, ...]:
    """Shape of the scales of a weight of ``shape`` [..., N, K] with blocks ``(bn, bk)``."""
    *lead, n, k = shape
    bn, bk = block
    return (*lead, -(-n // bn), -(-k // bk))


def expand_scale(scale: torch.Tensor, block, n: int, k: int) -> torch.Tensor:
    """Scales [..., ceil(n/bn), ceil(k/bk)] -> one per element [..., n, k] (fp32)."""
    bn, bk = block
    return scale.float().repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block, dtype=torch.float32) -> torch.Tensor:
    """Q [..., N, K] (fp8) and its scales -> the weight [..., N, K] in ``dtype``."""
    n, k = q.shape[-2:]
    if tuple(scale.shape) != scale_shape(q.shape, block):
        raise ValueError(f"dequantize: scales {tuple(scale.shape)} do not fit a weight {tuple(q.shape)} "
                         f"in blocks {tuple(block)} (expected {scale_shape(q.shape, block)})")
    return (q.float() * expand_scale(scale, block, n, k)).to(dtype)


def quantize(w: torch.Tensor, block, scale_dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., N, K] -> (Q fp8 [..., N, K], scales [..., ceil(N/bn), ceil(K/bk)] in ``scale_dtype``):
    each block's absolute maximum maps to 448 (scales are rounded to their dtype first, so Q is
    exact for the scale stored); an all-zero block gets scale 1."""
    *lead, n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    blocks = padded.reshape(*lead, nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    q = (w.float() / expand_scale(scale, block, n, k)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block, bias=None) -> torch.Tensor:
    """x [..., K] @ dequantize(weight)^T (+ bias) in fp32, returned in x's dtype."""
    y = x.float() @ dequantize(weight, scale, block).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def expert_gate_up(gate_up: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """One expert's fused gate_up [2I, H] (fp8) and its scales [2 ceil(I/bn), ceil(H/bk)] -> fp32."""
    i = gate_up.shape[0] // 2
    ni = -(-i // block[0])
    return torch.cat([dequantize(gate_up[:i], scale[:ni], block), dequantize(gate_up[i:], scale[ni:], block)])


def moe_experts(x, expert_ids, weights, gate_up, down, gate_up_scale, down_scale, block) -> torch.Tensor:
    """The routed experts (``moe/naive.py``) over FP8 weights: sum_k weights[t, k] *
    down_e(silu(gate_e(x_t)) * up_e(x_t)), every weight dequantized, accumulated in fp32."""
    I = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for slot in range(expert_ids.shape[1]):
            e = int(expert_ids[t, slot])
            h = expert_gate_up(gate_up[e], gate_up_scale[e], block) @ x[t].float()  # [2I]
            act = F.silu(h[:I]) * h[I:]
            out[t] += weights[t, slot].float() * (dequantize(down[e], down_scale[e], block) @ act)
    return out.to(x.dtype)
