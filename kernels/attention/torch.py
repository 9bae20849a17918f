"""The torch path of the static step's attention: gated attention of a step's rows over the
cache buffer, each row up to the last key it sees (one SDPA over the whole buffer, masked)."""
import torch
import torch.nn.functional as F


def visible_keys(last: torch.Tensor, length: int) -> torch.Tensor:
    """[B, T, length] bool: key j is visible to row t of batch row b when j <= last[b, t]."""
    return torch.arange(length, device=last.device)[None, None, :] <= last[:, :, None]


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, last: torch.Tensor,
                    gate: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, T, D]; k, v [B, Hkv, L, D]: the cache buffer, the step's own rows already written
    at their positions; last [B, T] int: row t of batch row b sees keys [0, last[b, t]] (a commit
    row its prefix and itself, a block row the prefix and the whole block); gate [B, T, Hq * D].

    Returns [B, T, Hq * D]: per query head h, softmax(q k^T / sqrt(D)) v over the visible keys of
    kv head h // (Hq / Hkv), times sigmoid(gate) (the gated attention output; clover-architecture.md section 2)."""
    B, _, T, _ = q.shape
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible_keys(last, k.shape[2])[:, None], enable_gqa=True)
    return o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate)
