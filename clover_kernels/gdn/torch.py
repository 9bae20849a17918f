"""The production torch path of the Gated DeltaNet ops (CPU, and CUDA where no kernel runs):
the commit through the chunked gated delta rule (few, large products), the training forward's
per-block states, and the preview (its readable form is already its fastest torch form).
Tested against ``naive.py``; the Triton kernels are tested against this.

Shapes as in ``naive.py``.
"""
import torch
import torch.nn.functional as F

from ..varlen import check_segments, spans
from . import naive
from .naive import causal_conv, gdn_preview, recurrent_gated_delta_rule, split_heads

__all__ = ["chunk_gated_delta_rule", "gdn_commit", "gdn_preview", "gdn_commit_blocks", "gdn_commit_varlen",
           "gdn_preview_varlen"]


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size: int = 64, return_chunk_states: bool = False):
    """Chunked (WY / UT-transform) gated delta rule, same contract as the recurrent form;
    with ``return_chunk_states`` also the state before each chunk [B, N, H, dk, dv].

    Within a chunk with cumulative log decay G, the corrected values solve
    (I + A) v_new = beta*v - (beta*k*exp(G)) S with A_ij = beta_i <k_i, k_j> exp(G_i - G_j), j < i;
    then o = (q*exp(G)) S + tril((q k^T) * exp(G_i - G_j)) v_new and
    S' = exp(G_last) S + (k*exp(G_last - G))^T v_new.

    Written as few, large products (measured on 2 CPU cores, T = 256, 8 heads: 3.3 -> 2.6 ms):
    one product gives both beta*k k^T and q k^T; one unit-triangular solve gives (I + A)^-1 applied to
    [beta*v | beta*k*exp(G)] (no explicit inverse); per chunk, one product applies S to the rows
    [(I + A)^-1 beta*k*exp(G) ; q*exp(G)] and one applies v_new to [intra-chunk scores ; (k*exp(G_last - G))^T].
    """
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    Cs = chunk_size
    pad = (-T) % Cs
    N = (T + pad) // Cs

    def chunks(x):  # [B, T, H, ...] -> [N, B, H, Cs, ...] fp32, padded with no-op tokens (k = v = beta = g = 0)
        x = x.float()
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, 0, 0, pad))
        x = x.reshape(B, N, Cs, H, *x.shape[3:]).movedim(3, 2).movedim(1, 0)
        return x.contiguous()

    q, k, v = chunks(q) * dk ** -0.5, chunks(k), chunks(v)  # [N, B, H, Cs, d]
    g, beta = chunks(g), chunks(beta)  # [N, B, H, Cs]

    G = g.cumsum(-1)
    causal = torch.ones(Cs, Cs, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [N, B, H, Cs, Cs]
    k_beta = k * beta[..., None]
    scores = (torch.cat([k_beta, q], dim=-2) @ k.transpose(-1, -2)).unflatten(-2, (2, Cs)) * decay[..., None, :, :]
    A, intra = scores[..., 0, :, :].tril(-1), scores[..., 1, :, :]  # [.., Cs, Cs] each
    eG = G.exp()[..., None]
    rhs = torch.cat([v * beta[..., None], k_beta * eG], dim=-1)  # [.., Cs, dv + dk]
    uw = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # (I + A)^-1 rhs
    u, w = uw[..., :dv], uw[..., dv:]
    reads_state = torch.cat([w, q * eG], dim=-2)  # [.., 2Cs, dk]: rows applied to S
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    reads_v_new = torch.cat([intra, k_to_end.transpose(-1, -2)], dim=-2)  # [.., Cs + dk, Cs]
    chunk_decay = G[..., -1].exp()[..., None, None]  # [N, B, H, 1, 1]

    S = state.float().clone()
    out = torch.empty(N, B, H, Cs, dv, dtype=torch.float32, device=q.device)
    before = []
    for i in range(N):
        before.append(S)
        from_state = reads_state[i] @ S  # [B, H, 2Cs, dv]
        v_new = u[i] - from_state[..., :Cs, :]
        from_v_new = reads_v_new[i] @ v_new  # [B, H, Cs + dk, dv]
        out[i] = from_state[..., Cs:, :] + from_v_new[..., :Cs, :]
        S = S * chunk_decay[i] + from_v_new[..., Cs:, :]
    out = out.movedim(0, 2).reshape(B, H, N * Cs, dv)[:, :, :T].transpose(1, 2)
    if return_chunk_states:
        return out, S, torch.stack(before, dim=1)
    return out, S


def gdn_commit(mixed, ring, conv_weight, g, beta, state, num_k_heads, head_k_dim, head_v_dim, out=None):
    """Causal GDN token mixing of T committed rows: ``naive.gdn_commit`` (same contract) with the
    chunked delta rule, or the recurrent one for a single row (one step needs no chunking)."""
    rule = recurrent_gated_delta_rule if mixed.shape[1] == 1 else chunk_gated_delta_rule
    return naive.gdn_commit(mixed, ring, conv_weight, g, beta, state, num_k_heads, head_k_dim, head_v_dim,
                            delta_rule=rule, out=out)


def gdn_commit_blocks(mixed, conv_weight, g, beta, num_k_heads, head_k_dim, head_v_dim, block_size):
    """Training: the causal GDN over a whole clean sequence from an empty state, plus the
    committed-prefix state at every block boundary, i.e. what the cache would hold when block b
    is previewed. T must be a multiple of block_size.

    Returns (o [B, T, Hv, dv], rings [B, nb, C, K-1], states [B, nb, Hv, dk, dv] fp32).
    """
    B, T, C = mixed.shape
    K = conv_weight.shape[1]
    nb = T // block_size
    ring0 = mixed.new_zeros(B, C, K - 1)
    conv, _ = causal_conv(mixed, ring0, conv_weight)
    q, k, v = split_heads(F.silu(conv), num_k_heads, head_k_dim, head_v_dim)
    state0 = torch.zeros(B, v.shape[2], head_k_dim, head_v_dim, dtype=torch.float32, device=mixed.device)
    o, _, states = chunk_gated_delta_rule(q, k, v, g, beta, state0, chunk_size=block_size, return_chunk_states=True)
    # the ring before block b: pre-conv rows [b*bs - (K-1), b*bs), zeros before the sequence start
    padded = torch.cat([mixed.new_zeros(B, K - 1, C), mixed], dim=1)  # [B, K-1+T, C]
    starts = torch.arange(nb, device=mixed.device) * block_size
    idx = starts[:, None] + torch.arange(K - 1, device=mixed.device)[None]  # [nb, K-1]
    rings = padded[:, idx].permute(0, 1, 3, 2)  # [B, nb, C, K-1]
    return o.to(mixed.dtype), rings, states


def gdn_commit_varlen(mixed, ring, conv_weight, g, beta, state, num_k_heads, head_k_dim, head_v_dim, cu_seqlens,
                      max_seqlen=None, out=None):
    """The commit of N rows' segments packed on one token axis (``varlen.py``): each segment
    committed alone by ``gdn_commit`` over its own ring and state. mixed [1, T, C], g, beta
    [1, T, Hv], ring [N, C, K-1], state [N, Hv, dk, dv], cu_seqlens [N + 1]; returns (o [1, T, Hv, dv],
    new ring [N, C, K-1], new state [N, Hv, dk, dv] fp32). ``max_seqlen``: taken for the kernel's
    signature (the reference reads the segments on the host)."""
    check_segments("gdn_commit_varlen", mixed, cu_seqlens, None, ring=ring, state=state)
    Hv = state.shape[1]
    o = mixed.new_empty(1, mixed.shape[1], Hv, head_v_dim) if out is None else out
    rings, states = [], []
    for n, (b, e) in enumerate(spans(cu_seqlens)):
        if b == e:  # an empty segment commits nothing
            rings.append(ring[n:n + 1].clone())
            states.append(state[n:n + 1].float().clone())
            continue
        _, r, st = gdn_commit(mixed[:, b:e], ring[n:n + 1], conv_weight, g[:, b:e], beta[:, b:e], state[n:n + 1],
                              num_k_heads, head_k_dim, head_v_dim, out=o[:, b:e])
        rings.append(r)
        states.append(st)
    return o, torch.cat(rings), torch.cat(states)


def gdn_preview_varlen(mixed, ring, conv_weight, right_weight, state, block_scale, history_bias, history_log_n,
                       num_k_heads, head_k_dim, head_v_dim, cu_seqlens, max_seqlen=None, return_history=False,
                       out=None):
    """The previews of N rows' blocks packed on one token axis (``varlen.py``): each block previewed
    alone by ``gdn_preview`` over its row's ring and state (its history logit at its own length).
    mixed [1, T, C], ring [N, C, K-1], state [N, Hv, dk, dv], cu_seqlens [N + 1], every block at least
    one row; returns (o [1, T, Hv, dv], p_hist [1, T, Hv] fp32, h [1, T, Hv, dv] fp32 or None)."""
    check_segments("gdn_preview_varlen", mixed, cu_seqlens, None, ring=ring, state=state)
    T, Hv = mixed.shape[1], state.shape[1]
    o = mixed.new_empty(1, T, Hv, head_v_dim) if out is None else out
    p_hist = torch.empty(1, T, Hv, dtype=torch.float32, device=mixed.device)
    h = torch.empty(1, T, Hv, head_v_dim, dtype=torch.float32, device=mixed.device) if return_history else None
    for n, (b, e) in enumerate(spans(cu_seqlens)):
        if b == e:
            raise ValueError(f"gdn_preview_varlen: segment {n} is empty (a preview needs a block of at least one row)")
        _, p, hn = gdn_preview(mixed[:, b:e], ring[n:n + 1], conv_weight, right_weight, state[n:n + 1], block_scale,
                               history_bias, history_log_n, num_k_heads, head_k_dim, head_v_dim, return_history,
                               out=o[:, b:e])
        p_hist[:, b:e] = p
        if return_history:
            h[:, b:e] = hn
    return o, p_hist, h
