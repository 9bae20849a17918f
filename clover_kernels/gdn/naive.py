"""Readable references of the Gated DeltaNet ops: commit (causal, token by token) and preview
(Clover's block operator), written as the spec states them. Every faster path, the production
torch path in ``torch.py`` and the Triton kernels, is tested against these.

Shapes: B batch, T tokens, C = conv_dim = 2 * Hk * dk + Hv * dv channels, K conv taps,
Hk key heads, Hv value heads (each key head serves Hv // Hk consecutive value heads),
S the recurrent state [B, Hv, dk, dv], always fp32.
"""
import math

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(mixed: torch.Tensor, ring: torch.Tensor, weight: torch.Tensor):
    """Depthwise causal conv over ``[ring ; mixed]``, before the activation.

    mixed [B, T, C], ring [B, C, K-1] (the last K-1 pre-conv rows), weight [C, K].
    Returns (out [B, T, C] in mixed's dtype, new ring [B, C, K-1]). The K taps are summed
    directly in fp32: a depthwise conv1d call costs far more than this on the CPU.
    """
    C, K = weight.shape
    T = mixed.shape[1]
    x = torch.cat([ring.to(mixed.dtype), mixed.transpose(1, 2)], dim=-1)  # [B, C, K-1+T]
    xf, w = x.float(), weight.float()
    out = xf[..., 0:T] * w[:, 0:1]
    for j in range(1, K):
        out = out + xf[..., j:j + T] * w[:, j:j + 1]  # tap j reads row t + j of [ring ; mixed]
    return out.transpose(1, 2).to(mixed.dtype), x[..., x.shape[-1] - (K - 1):]


def right_taps(mixed: torch.Tensor, right_weight: torch.Tensor) -> torch.Tensor:
    """Preview's anti-causal branch: ``sum_{d=1..K-1} r[d-1] * mixed[t+d]``, zero past the block end.

    mixed [B, m, C], right_weight [C, K-1]; returns [B, m, C].
    """
    m = mixed.shape[1]
    Km1 = right_weight.shape[1]
    x = F.pad(mixed.float(), (0, 0, 0, Km1))  # [B, m + K-1, C]: zeros past the end of the block
    r = right_weight.float().t()  # [K-1, C]
    out = torch.zeros_like(x[:, :m])
    for d in range(1, Km1 + 1):
        out = out + x[:, d:d + m] * r[d - 1]
    return out.to(mixed.dtype)


def split_heads(conv_out: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int):
    """SiLU-activated conv output [B, T, C] -> q, k [B, T, Hv, dk] (fp32, L2-normalised,
    key heads repeated to value heads) and v [B, T, Hv, dv] (fp32)."""
    B, T, _ = conv_out.shape
    key_dim = num_k_heads * head_k_dim
    q, k, v = conv_out.float().split([key_dim, key_dim, conv_out.shape[-1] - 2 * key_dim], dim=-1)
    v = v.reshape(B, T, -1, head_v_dim)
    rep = v.shape[2] // num_k_heads
    q = l2norm(q.reshape(B, T, num_k_heads, head_k_dim)).repeat_interleave(rep, dim=2)
    k = l2norm(k.reshape(B, T, num_k_heads, head_k_dim)).repeat_interleave(rep, dim=2)
    return q, k, v


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """Token-by-token gated delta rule (fp32). q, k [B, T, H, dk] (normalised, q not yet
    scaled), v [B, T, H, dv], g (log decay) and beta [B, T, H], state [B, H, dk, dv].
    Returns (o [B, T, H, dv], final state)."""
    scale = q.shape[-1] ** -0.5
    S = state.float().clone()
    out = []
    for t in range(q.shape[1]):
        S = S * g[:, t, :, None, None].float().exp()
        kt = k[:, t].float()
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)
        delta = (v[:, t].float() - pred) * beta[:, t, :, None].float()
        S = S + kt[..., None] * delta[..., None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t].float() * scale, S))
    return torch.stack(out, dim=1), S


def into(out: torch.Tensor | None, o: torch.Tensor, name: str) -> torch.Tensor:
    """``o``, or written into ``out`` (a slice of a bigger output: the fused step's commit and
    preview rows share one buffer), which must have o's shape and dtype."""
    if out is None:
        return o
    check_out(name, out, tuple(o.shape), o.dtype)
    return out.copy_(o)


def check_out(name: str, out: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if tuple(out.shape) != shape or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"{name}: out must be {list(shape)} {dtype} with a unit last stride, got "
                         f"{list(out.shape)} {out.dtype} strides {out.stride()}")


def gdn_commit(mixed, ring, conv_weight, g, beta, state, num_k_heads, head_k_dim, head_v_dim,
               delta_rule=recurrent_gated_delta_rule, out=None):
    """Causal GDN token mixing of T committed rows, by default one token at a time.

    mixed [B, T, C] (in_proj_qkv output), ring [B, C, K-1], conv_weight [C, K],
    g, beta [B, T, Hv], state [B, Hv, dk, dv] fp32.
    Returns (o [B, T, Hv, dv] in mixed's dtype, new ring, new state fp32).
    ``delta_rule`` has the contract of ``recurrent_gated_delta_rule``: ``torch.py`` passes the
    chunked form, so that conv, split and casts are written once. ``out``: o is written there
    (``into``) and returned.
    """
    conv, new_ring = causal_conv(mixed, ring, conv_weight)
    q, k, v = split_heads(F.silu(conv), num_k_heads, head_k_dim, head_v_dim)
    o, new_state = delta_rule(q, k, v, g, beta, state)
    return into(out, o.to(mixed.dtype), "gdn_commit"), new_ring.to(ring.dtype), new_state


def gdn_preview(
    mixed, ring, conv_weight, right_weight, state, block_scale, history_bias, history_log_n,
    num_k_heads, head_k_dim, head_v_dim, return_history: bool = False, out=None,
):
    """Clover's preview operator over a block of m rows; reads ring and state, writes nothing.

    Conv with right taps, SiLU, split + L2-normalise, then per value head a softmax over
    [the m block tokens (both directions) ; the history slot] whose history value is the
    causal read of the frozen state, h_t = (q_t / sqrt(dk)) @ S0, and whose logit
    history_bias + history_log_n * ln(m) calibrates the memory against the block length.

    Returns (o [B, m, Hv, dv] in mixed's dtype, p_hist [B, m, Hv] fp32, h [B, m, Hv, dv] fp32 or None);
    ``out``: o is written there (``into``) and returned.
    """
    m = mixed.shape[1]
    conv, _ = causal_conv(mixed, ring, conv_weight)
    conv = conv + right_taps(mixed, right_weight)
    q, k, v = split_heads(F.silu(conv), num_k_heads, head_k_dim, head_v_dim)
    h = torch.einsum("bthk,bhkv->bthv", q * head_k_dim ** -0.5, state.float())
    scores = torch.einsum("bthk,bjhk->bhtj", q, k) * block_scale.float().exp()[:, None, None]
    hist_logit = history_bias.float() + history_log_n.float() * math.log(m)  # [Hv]
    hist_logit = hist_logit[None, :, None, None].expand(scores.shape[0], -1, m, 1)
    p = torch.softmax(torch.cat([scores, hist_logit], dim=-1), dim=-1)  # [B, Hv, m, m+1]
    p_block, p_hist = p[..., :m], p[..., m]
    o = torch.einsum("bhtj,bjhv->bthv", p_block, v) + p_hist.transpose(1, 2)[..., None] * h
    return (into(out, o.to(mixed.dtype), "gdn_preview"), p_hist.transpose(1, 2).contiguous(),
            (h if return_history else None))
