"""The torch path of the static step's attention: gated attention of a step's rows over the
cache buffer, each row up to the last key it sees (one SDPA over the whole buffer, masked)."""
import torch
import torch.nn.functional as F

from ..varlen import check_segments, spans


def visible_keys(last: torch.Tensor, length: int) -> torch.Tensor:
    """[B, T, length] bool: key j is visible to row t of batch row b when j <= last[b, t]."""
    return torch.arange(length, device=last.device)[None, None, :] <= last[:, :, None]


def block_last(last: torch.Tensor, block_rows: int) -> torch.Tensor:
    """last [B, T] with its final ``block_rows`` rows (a block, which sees itself whole) all set to
    the final row's."""
    T = last.shape[1]
    if not 0 <= block_rows <= T:
        raise ValueError(f"cache_attention: block_rows {block_rows} must lie in [0, {T}]")
    if not block_rows:
        return last
    return torch.cat([last[:, :T - block_rows], last[:, -1:].expand(-1, block_rows)], dim=1)


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, last: torch.Tensor,
                    gate: torch.Tensor, block_rows: int = 0) -> torch.Tensor:
    """q [B, Hq, T, D]; k, v [B, Hkv, L, D]: the cache buffer, the step's own rows already written
    at their positions; last [B, T] int: row t of batch row b sees keys [0, last[b, t]] (a commit
    row its prefix and itself); the final ``block_rows`` rows (a block previewed: the prefix and the
    whole block) see keys up to the final row's (``block_last``: the caller passes the positions);
    gate [B, T, Hq * D] or its per-head view [B, T, Hq, D].

    Returns [B, T, Hq * D]: per query head h, softmax(q k^T / sqrt(D)) v over the visible keys of
    kv head h // (Hq / Hkv), times sigmoid(gate) (the gated attention output; clover-architecture.md section 2)."""
    B, _, T, _ = q.shape
    mask = visible_keys(block_last(last, block_rows), k.shape[2])[:, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))


def cache_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, last: torch.Tensor,
                           gate: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int | None = None) -> torch.Tensor:
    """``cache_attention`` of N rows' segments packed on one token axis (``varlen.py``): segment n
    (tokens [cu_seqlens[n], cu_seqlens[n + 1])) attends over cache row n, each token up to its own
    last key. q [1, Hq, T, D], k, v [N, Hkv, L, D], last [1, T] (a previewed block's rows carry the
    block's last position: ``block_last`` per segment), gate [1, T, Hq * D] or [1, T, Hq, D].
    Returns [1, T, Hq * D]. ``max_seqlen``: taken for the kernel's signature."""
    check_segments("cache_attention_varlen", q.transpose(1, 2), cu_seqlens, None, k=k, v=v)
    T = q.shape[2]
    gate = gate.reshape(1, T, -1)
    out = q.new_empty(1, T, gate.shape[-1])
    for n, (b, e) in enumerate(spans(cu_seqlens)):
        if b < e:
            out[:, b:e] = cache_attention(q[:, :, b:e], k[n:n + 1], v[n:n + 1], last[:, b:e], gate[:, b:e])
    return out
