"""Gated attention (the full-attention layers): committed rows causally against the cache, block
rows in both directions, the static layout for graphs and the training layout."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from clover_kernels import ops
from clover_lab.config import CloverConfig
from clover_lab.model.cache import AttentionCache
from clover_lab.model.context import ForwardContext
from clover_lab.model.layers.linear import FusedProjections, Linear
from clover_lab.model.layers.norm import RMSNorm


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate per head, q/k norms and partial RoPE."""

    def __init__(self, config: CloverConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        H, D, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = Linear(H, self.num_heads * D * 2, bias=bias)  # query and gate, interleaved per head
        self.k_proj = Linear(H, self.num_kv_heads * D, bias=bias)
        self.v_proj = Linear(H, self.num_kv_heads * D, bias=bias)
        self.o_proj = Linear(self.num_heads * D, H, bias=bias)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.k_norm = RMSNorm(D, config.rms_norm_eps)
        self.qkv_proj = FusedProjections("q_proj", "k_proj", "v_proj")  # one GEMM (bias-free checkpoints)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        B, T, _ = x.shape
        D = self.head_dim
        q, k, v = self.qkv_proj(self, x)
        q, gate = q.reshape(B, T, self.num_heads, 2 * D).chunk(2, dim=-1)  # per-head views [B, T, Hq, D]
        v = v.reshape(B, T, self.num_kv_heads, D)
        cache: AttentionCache | None = None if ctx.is_training else ctx.cache.layers[self.layer]
        # q/k norms and RoPE in one kernel on a GPU -> [B, Hq, T, D], [B, Hkv, T, D]; a static step's
        # K,V written into the cache at every row's position by the same kernel (rows past the committed
        # length are scratch until a commit publishes them)
        q, k = ops.qk_norm_rope(q, k.reshape(B, T, self.num_kv_heads, D), self.q_norm.weight, self.k_norm.weight,
                                ctx.positions, ctx.rope.inv_freq_on(q.device), self.q_norm.eps,
                                cache=(cache.k, cache.v, v) if ctx.is_static else None)
        v = v.transpose(1, 2)
        if ctx.is_training:
            o = self._attend_blocks(q, k, v, ctx.c, ctx.block_size)
            return self.o_proj(self._gated(o, gate))
        if ctx.is_static:
            return self.o_proj(self._attend_static(q, gate, cache, ctx))
        if ctx.is_packed:
            return self.o_proj(self._gated(self._attend_packed(q, k, v, cache, ctx), gate))
        if ctx.is_ragged:
            return self.o_proj(self._gated(self._attend_ragged(q, k, v, cache, ctx), gate))
        n, c, m = ctx.n, ctx.c, ctx.m
        outs = []
        if c:
            # rows past the committed length are invisible until the pass succeeds: safe to write now
            cache.k[:, :, n:n + c] = k[:, :, :c]
            cache.v[:, :, n:n + c] = v[:, :, :c]
            keys, values = cache.k[:, :, :n + c], cache.v[:, :, :n + c]
            if n == 0:
                o = F.scaled_dot_product_attention(q[:, :, :c], keys, values, is_causal=True, enable_gqa=True)
            else:
                allowed = torch.ones(c, n + c, dtype=torch.bool, device=x.device).tril(diagonal=n)
                o = F.scaled_dot_product_attention(q[:, :, :c], keys, values, attn_mask=allowed, enable_gqa=True)
            outs.append(o)
        if m:
            # the block sees the whole committed prefix and the whole block; its K,V are not cached
            keys = torch.cat([cache.k[:, :, :n + c], k[:, :, c:]], dim=2)
            values = torch.cat([cache.v[:, :, :n + c], v[:, :, c:]], dim=2)
            outs.append(F.scaled_dot_product_attention(q[:, :, c:], keys, values, enable_gqa=True))
        o = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
        return self.o_proj(self._gated(o, gate))

    @staticmethod
    def _gated(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The output gate: o [B, Hq, T, D] times sigmoid(gate [B, T, Hq, D]) -> [B, T, Hq * D]."""
        B, _, T, _ = o.shape
        return ops.sigmoid_gate(o.transpose(1, 2), gate).reshape(B, T, -1)

    @staticmethod
    def _attend_static(q, gate, cache: AttentionCache, ctx: ForwardContext) -> torch.Tensor:
        """Static shapes for CUDA graphs: every row's K,V already written at its position
        (positions [B, c + m], each batch row from its own length: ``qk_norm_rope``), the gated
        attention of each row up to the last key it sees (``clover_kernels.ops.cache_attention``: on a
        GPU it reads only those keys, the bound read on the device; the torch path masks the keys
        it is given: the first ``ctx.keys`` rows of the buffer off a CUDA graph, else all of them).
        Commit rows see the prefix causally; block rows see the prefix and the block.
        Returns [B, c + m, Hq * D]."""
        k, v = (cache.k, cache.v) if ctx.keys is None else (cache.k[:, :, :ctx.keys], cache.v[:, :, :ctx.keys])
        return ops.cache_attention(q, k, v, ctx.positions, gate, ctx.m)  # the block's rows see it whole

    @staticmethod
    def _attend_ragged(q, k, v, cache: AttentionCache, ctx: ForwardContext) -> torch.Tensor:
        """A batch whose rows stand at different lengths (positions [B, c + m]): each row's
        committed K,V go at its own positions, and a mask hides, per row, the keys past its
        length. Commit rows see their prefix causally; block rows their prefix and the block."""
        c, m = ctx.c, ctx.m
        pos = ctx.positions  # [B, c + m]
        keys_len = min(ctx.n + c, cache.k.shape[2])  # the longest row's prefix after the commit (a padding row's: its length)
        if c:
            rows = torch.arange(pos.shape[0], device=pos.device)[:, None]
            cache.k[rows, :, pos[:, :c]] = k[:, :, :c].transpose(1, 2)  # [B, c, H_kv, D] at per-row positions
            cache.v[rows, :, pos[:, :c]] = v[:, :, :c].transpose(1, 2)
        key_pos = torch.arange(keys_len, device=pos.device)
        outs = []
        if c:
            allowed = key_pos[None, None, :] <= pos[:, :c, None]  # [B, c, keys]
            outs.append(F.scaled_dot_product_attention(q[:, :, :c], cache.k[:, :, :keys_len], cache.v[:, :, :keys_len],
                                                       attn_mask=allowed[:, None], enable_gqa=True))
        if m:
            # [B, 1, keys]: the row's committed prefix, up to its block's first position (a row
            # packed beside committing ones without a commit of its own previews after its length)
            prefix = key_pos[None, None, :] < pos[:, c:c + 1, None]
            allowed = torch.cat([prefix.expand(-1, m, -1), prefix.new_ones(pos.shape[0], m, m)], dim=2)
            keys = torch.cat([cache.k[:, :, :keys_len], k[:, :, c:]], dim=2)
            values = torch.cat([cache.v[:, :, :keys_len], v[:, :, c:]], dim=2)
            outs.append(F.scaled_dot_product_attention(q[:, :, c:], keys, values, attn_mask=allowed[:, None],
                                                       enable_gqa=True))
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]

    @staticmethod
    def _attend_packed(q, k, v, cache: AttentionCache, ctx: ForwardContext) -> torch.Tensor:
        """A packed forward (q [1, Hq, N, D], k, v [1, Hkv, N, D]): each group of segments of one
        shape as a batch of its cache rows, as :meth:`_attend_ragged` attends a ragged batch (its
        commit rows written at each row's own positions, seen causally; its block rows see the
        row's prefix and the block). Returns [1, Hq, N, D]."""
        o = q.new_empty(q.shape)
        for g in ctx.groups:
            c, m, pos, rows = g.c, g.m, g.positions, g.rows
            qg, kg, vg = (t[0][:, g.tokens].transpose(0, 1) for t in (q, k, v))  # [G, H, c + m, D]
            if c:
                cache.k[rows[:, None], :, pos[:, :c]] = kg[:, :, :c].transpose(1, 2)
                cache.v[rows[:, None], :, pos[:, :c]] = vg[:, :, :c].transpose(1, 2)
            keys_len = max(g.lengths) + c
            keys, values = cache.k[rows, :, :keys_len], cache.v[rows, :, :keys_len]
            key_pos = torch.arange(keys_len, device=pos.device)
            outs = []
            if c:
                allowed = key_pos[None, None, :] <= pos[:, :c, None]  # [G, c, keys]
                outs.append(F.scaled_dot_product_attention(qg[:, :, :c], keys, values, attn_mask=allowed[:, None],
                                                           enable_gqa=True))
            if m:
                prefix = key_pos[None, None, :] < pos[:, c:c + 1, None]  # the row's prefix after its commit
                allowed = torch.cat([prefix.expand(-1, m, -1), prefix.new_ones(len(g.lengths), m, m)], dim=2)
                outs.append(F.scaled_dot_product_attention(
                    qg[:, :, c:], torch.cat([keys, kg[:, :, c:]], dim=2), torch.cat([values, vg[:, :, c:]], dim=2),
                    attn_mask=allowed[:, None], enable_gqa=True))
            og = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]  # [G, Hq, c + m, D]
            o[0][:, g.tokens] = og.transpose(0, 1)
        return o

    @staticmethod
    def _attend_blocks(q, k, v, L: int, bs: int) -> torch.Tensor:
        """Training layout: clean rows attend causally; noisy block b attends to the clean rows
        before it and to its own block, both directions (spec 3.1)."""
        clean = F.scaled_dot_product_attention(q[:, :, :L], k[:, :, :L], v[:, :, :L], is_causal=True,
                                               enable_gqa=True)
        block_of = torch.arange(L, device=q.device) // bs
        sees_clean = torch.arange(L, device=q.device)[None, :] < (block_of[:, None] * bs)
        sees_block = block_of[:, None] == block_of[None, :]
        allowed = torch.cat([sees_clean, sees_block], dim=1)  # [L noisy queries, L clean + L noisy keys]
        noisy = F.scaled_dot_product_attention(q[:, :, L:], k, v, attn_mask=allowed, enable_gqa=True)
        return torch.cat([clean, noisy], dim=2)
