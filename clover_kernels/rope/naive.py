"""Torch references of rotary position embeddings (RoPE on the first ``rotary_dim`` dims of each
head, the rest passed through) and of the attention's q/k norms followed by it (the ground truth
for ``fused.py``). ``inv_freq`` [rotary_dim / 2] fp32: ``theta ** (-2i / rotary_dim)``."""
import torch

from ..norm.naive import rms_norm


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """positions [T] -> cos, sin [T, rotary_dim]; per-row positions [B, T] -> [B, 1, T, rotary_dim]
    (broadcast over the heads); computed in fp32, returned in ``dtype``."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., T, rotary_dim]
    if positions.dim() == 2:
        emb = emb[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; rotates the first cos.shape[-1] dims, passes the rest through."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 positions: torch.Tensor, inv_freq: torch.Tensor, eps: float = 1e-6, cache=None):
    """q [B, T, Hq, D], k [B, T, Hkv, D] (any strides: per-head views of a projection) -> their
    zero-centred RMSNorms (weights [D]) rotated at ``positions`` ([T], or [B, T] per row):
    q [B, Hq, T, D], k [B, Hkv, T, D] in q's dtype. ``cache``: (k_cache, v_cache [B, Hkv, L, D], v
    [B, T, Hkv, D]): k and v are also written into the caches at each row's position (the static
    step's cache write; positions [B, T])."""
    cos, sin = cos_sin(positions, inv_freq, q.dtype)
    q = rms_norm(q, q_weight, eps).transpose(1, 2)
    k = apply_rotary(rms_norm(k, k_weight, eps).transpose(1, 2), cos, sin)
    if cache is not None:
        k_cache, v_cache, v = check_cache(cache, k, positions)
        # an index_put, not a scatter_: inductor writes it into the buffer in place, where a
        # scatter_ into a step's input copied the whole buffer out and back (10 ms against 1.7 at
        # 16 rows of a 1,024-row cache, compiled on one CPU thread)
        rows = torch.arange(k.shape[0], device=positions.device)[:, None]
        k_cache[rows, :, positions] = k.transpose(1, 2)  # [B, T, Hkv, D] at each row's positions
        v_cache[rows, :, positions] = v
    return apply_rotary(q, cos, sin), k


def check_cache(cache, k: torch.Tensor, positions: torch.Tensor):
    """(k_cache, v_cache, v) as ``qk_norm_rope`` takes them, checked against k [B, Hkv, T, D]."""
    k_cache, v_cache, v = cache
    B, H, T, D = k.shape
    if (k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[:2] != (B, H) or k_cache.shape[3] != D
            or tuple(v.shape) != (B, T, H, D) or tuple(positions.shape) != (B, T)):
        raise ValueError(f"qk_norm_rope: cache {tuple(k_cache.shape)}, {tuple(v_cache.shape)}, v {tuple(v.shape)}, "
                         f"positions {tuple(positions.shape)}: expected caches [{B}, {H}, L, {D}], v [{B}, {T}, {H}, "
                         f"{D}] and positions [{B}, {T}]")
    return k_cache, v_cache, v
