"""The Clover model in PyTorch: the reference path every kernel is tested against.

Three modes per forward (spec section 3): **commit** (causal, exactly Qwen3.5-MoE; advances the
cache), **preview** (one denoising pass over the current block; reads the cache, writes nothing)
and both fused in one forward over ``[block to commit ; block to preview]``.

Shapes: B batch, T = c + m rows of a forward (c committed rows first, then m preview rows),
n the committed length before the forward, H hidden size, V vocabulary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import clover_kernels as ops
from clover_kernels.gdn.torch import gdn_commit_blocks

from .cache import AttentionCache, CloverCache, GDNCache
from .config import CloverConfig
from .hooks import ENGINE_POINTS, GDNPreviewEvent, GDNStateEvent, HookRegistry, RouteEvent


# --------------------------------------------------------------------------- one forward's plan
@dataclass
class Coreset:
    """Per-block expert coreset (spec 3.3): the first preview of a block records, per MoE layer,
    the ``size`` experts with the largest router probability summed over the block's tokens;
    later previews of the block route only among them. Commit always routes over all experts.

    ``experts`` holds the recorded layers of the current block. Once recorded, a layer's tensor
    is reused (written in place) by later blocks, so that a CUDA graph can read it."""

    size: int
    experts: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [size] expert ids
    _buffers: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def reset(self) -> None:
        self.experts.clear()

    def record(self, layer: int, ids: torch.Tensor) -> None:
        buf = self._buffers.get(layer)
        if buf is None or buf.shape != ids.shape or buf.device != ids.device:
            buf = self._buffers[layer] = ids.clone()
        else:
            buf.copy_(ids)
        self.experts[layer] = buf


@dataclass
class Pass:
    """What one forward does: commit rows [0, c), preview rows [c, c + m), at committed length n.

    Training layout (``block_size`` set, no cache): rows [0, c) are a clean sequence from position
    0, run causally; rows [c, 2c) a noisy copy, each block of ``block_size`` rows previewed against
    the clean prefix before it, exactly as the engine previews it against its cache.
    """

    cache: CloverCache | None
    n: int
    c: int
    m: int
    coreset: Coreset | None = None
    device: torch.device | str = "cpu"
    block_size: int | None = None
    router_stats: list | None = None  # training: (router probs [T, E], expert ids [T, k]) per MoE layer part
    rope: tuple | None = None  # (cos, sin) [c + m, rotary_dim] at ``positions``, shared by every attention layer
    pending: list = field(default_factory=list)  # (destination, source) cache writes, applied on success
    # static-shape step (CUDA-graph fast path): the committed length as a 0-d device tensor; attention
    # then runs over the cache's whole preallocated buffer with a mask instead of slicing it at ``n``
    n_dev: torch.Tensor | None = None
    hooks: bool = True  # False: hook points are not even looked up (static steps, which refuse hooks)

    def __post_init__(self):
        if self.n_dev is not None:
            self.positions = self.n_dev + torch.arange(self.c + self.m, device=self.device)
        elif self.block_size:
            clean = torch.arange(self.c, device=self.device)
            self.positions = torch.cat([clean, clean])  # each noisy token sits at its clean position
        else:
            self.positions = torch.arange(self.n, self.n + self.c + self.m, device=self.device)  # [c + m]


@dataclass
class StepOutput:
    commit_logits: torch.Tensor | None  # [B, c or 1, V]
    preview_logits: torch.Tensor | None  # [B, m or len(positions), V]


# --------------------------------------------------------------------------- building blocks
class Linear(nn.Linear):
    """``nn.Linear`` whose CPU inference GEMM is ``clover_kernels.linear`` (oneDNN's fp32 GEMM where
    it beats the default BLAS); same parameters, same state-dict names, same results to fp32 rounding.
    ``packed``: the weight kept in oneDNN's layout (``CloverModel.pack_weights``), or None."""

    packed: ops.PackedWeight | None = None

    def forward(self, x):
        return ops.linear(x, self.weight, self.bias, packed=self.packed)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm ``x / rms(x) * (1 + w)``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """GDN output norm ``w * x / rms(x) * silu(z)`` (weight not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        return ops.gated_rms_norm(x, z, self.weight, self.eps)


class Rotary(nn.Module):
    """Plain RoPE on the first ``rotary_dim`` dims (text positions: mRoPE reduces to this)."""

    def __init__(self, config: CloverConfig):
        super().__init__()
        dim = config.rotary_dim
        # kept out of the module's buffers on purpose: model.to(bf16) must never round it
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, rotary_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; rotates the first cos.shape[-1] dims, passes the rest through."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


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

    def forward(self, x: torch.Tensor, p: Pass) -> torch.Tensor:
        B, T, _ = x.shape
        D = self.head_dim
        q, gate = self.q_proj(x).view(B, T, self.num_heads, 2 * D).chunk(2, dim=-1)
        gate = gate.reshape(B, T, -1)
        q = self.q_norm(q).transpose(1, 2)  # [B, Hq, T, D]
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, D)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, D).transpose(1, 2)
        cos, sin = p.rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if p.block_size:
            o = self._attend_blocks(q, k, v, p.c, p.block_size)
            return self.o_proj(o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate))

        cache: AttentionCache = p.cache.layers[self.layer]
        if p.n_dev is not None:
            o = self._attend_static(q, k, v, cache, p)
            return self.o_proj(o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate))
        n, c, m = p.n, p.c, p.m
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
        o = o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate)
        return self.o_proj(o)

    @staticmethod
    def _attend_static(q, k, v, cache: AttentionCache, p: Pass) -> torch.Tensor:
        """Static shapes for CUDA graphs: every row's K,V is written at its position (rows past the
        committed length are scratch until a commit publishes them), then one attention over the
        whole buffer. Commit rows see the prefix causally; block rows see the prefix and the block."""
        pos = p.positions  # [c + m] = n + arange
        cache.k.index_copy_(2, pos, k)
        cache.v.index_copy_(2, pos, v)
        last = pos[:p.c] if not p.m else torch.cat([pos[:p.c], pos[-1:].expand(p.m)])
        allowed = torch.arange(cache.k.shape[2], device=q.device)[None, :] <= last[:, None]  # [T, max_len]
        return F.scaled_dot_product_attention(q, cache.k, cache.v, attn_mask=allowed, enable_gqa=True)

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


class GatedDeltaNet(nn.Module):
    """GDN token mixer: the chunked gated delta rule in commit, Clover's preview operator in preview."""

    def __init__(self, config: CloverConfig, layer: int, hooks: HookRegistry):
        super().__init__()
        self.layer = layer
        self.hooks = hooks
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        H, C, K = config.hidden_size, config.conv_dim, config.linear_conv_kernel_dim
        Hv = self.num_v_heads
        self.in_proj_qkv = Linear(H, C, bias=False)
        self.in_proj_z = Linear(H, Hv * self.head_v_dim, bias=False)
        self.in_proj_b = Linear(H, Hv, bias=False)
        self.in_proj_a = Linear(H, Hv, bias=False)
        self.conv1d = nn.Conv1d(C, C, K, groups=C, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(Hv))
        self.A_log = nn.Parameter(torch.zeros(Hv))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(Hv * self.head_v_dim, H, bias=False)
        # Clover's preview operator (spec 3.2); defaults make an untrained but well-defined preview
        self.conv1d_right = nn.Conv1d(C, C, K - 1, groups=C, bias=False)
        self.block_scale = nn.Parameter(torch.empty(Hv))
        self.history_bias = nn.Parameter(torch.empty(Hv))
        self.history_log_n = nn.Parameter(torch.empty(Hv))
        self.reset_preview_parameters()
        self.state_point = f"layers.{layer}.gdn.state"
        self.preview_point = f"layers.{layer}.gdn.preview"

    @torch.no_grad()
    def reset_preview_parameters(self) -> None:
        self.conv1d_right.weight.zero_()
        self.block_scale.fill_(math.log(math.sqrt(self.head_k_dim)))
        self.history_bias.zero_()
        self.history_log_n.fill_(1.0)

    def forward(self, x: torch.Tensor, p: Pass) -> torch.Tensor:
        B, T, _ = x.shape
        c, m = p.c, p.m
        mixed = self.in_proj_qkv(x)  # [B, T, C]
        z = self.in_proj_z(x).view(B, T, self.num_v_heads, self.head_v_dim)
        if p.block_size:
            o = self._mix_blocks(x, mixed, p.c, p.block_size)
            o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
            return self.out_proj(o.reshape(B, T, -1))
        cache: GDNCache = p.cache.layers[self.layer]
        ring, state = cache.ring, cache.state
        conv_w = self.conv1d.weight[:, 0]
        outs = []
        if c:
            g, beta = self._gates(x[:, :c])
            o, ring, state = ops.gdn_commit(mixed[:, :c], ring, conv_w, g, beta, state,
                                            self.num_k_heads, self.head_k_dim, self.head_v_dim)
            if p.hooks and self.hooks.active(self.state_point):
                event = GDNStateEvent(self.layer, state, ring, p.n + c)
                self.hooks.fire(self.state_point, event)
                if event.state.shape != state.shape:
                    raise ValueError(f"{self.state_point}: a hook set a state of shape {tuple(event.state.shape)}, "
                                     f"expected {tuple(state.shape)}")
                state = event.state.float()
            p.pending += [(cache.ring, ring), (cache.state, state)]
            outs.append(o)
        if m:
            want_history = p.hooks and self.hooks.active(self.preview_point)
            o, p_hist, h = ops.gdn_preview(
                mixed[:, c:], ring, conv_w, self.conv1d_right.weight[:, 0], state, self.block_scale,
                self.history_bias, self.history_log_n, self.num_k_heads, self.head_k_dim, self.head_v_dim,
                return_history=want_history)
            if want_history:
                self.hooks.fire(self.preview_point,
                                GDNPreviewEvent(self.layer, p.positions[c:], p_hist, h))
            outs.append(o)
        o = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]  # [B, T, Hv, dv]
        o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.reshape(B, T, -1))


    def _gates(self, x):
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        return g, beta

    def _mix_blocks(self, x, mixed, L: int, bs: int) -> torch.Tensor:
        """Training layout: the clean rows in commit mode, every noisy block previewed against the
        clean state and ring at its boundary, with the same preview op as inference."""
        B = x.shape[0]
        nb = L // bs
        g, beta = self._gates(x[:, :L])
        conv_w = self.conv1d.weight[:, 0]
        o_clean, rings, states = gdn_commit_blocks(mixed[:, :L], conv_w, g, beta, self.num_k_heads,
                                                   self.head_k_dim, self.head_v_dim, bs)
        noisy = mixed[:, L:].reshape(B * nb, bs, -1)
        o_noisy, _, _ = ops.gdn_preview(
            noisy, rings.reshape(B * nb, *rings.shape[2:]), conv_w, self.conv1d_right.weight[:, 0],
            states.reshape(B * nb, *states.shape[2:]), self.block_scale, self.history_bias, self.history_log_n,
            self.num_k_heads, self.head_k_dim, self.head_v_dim)
        return torch.cat([o_clean, o_noisy.reshape(B, L, *o_noisy.shape[2:])], dim=1)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, config: CloverConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    packed: ops.PackedWeight | None = None


class Experts(nn.Module):
    """The routed experts as fused tensors: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, config: CloverConfig):
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    # (gate_up, down): one PackedWeight per expert each (CloverModel.pack_weights), or None
    packed: tuple[list[ops.PackedWeight], list[ops.PackedWeight]] | None = None


class SparseMoE(nn.Module):
    """Softmax router, renormalised top-k, routed experts plus a sigmoid-gated shared expert."""

    def __init__(self, config: CloverConfig, layer: int, hooks: HookRegistry):
        super().__init__()
        self.layer = layer
        self.hooks = hooks
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_expert = SwiGLU(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)
        self.route_point = f"layers.{layer}.moe.route"

    def route(self, logits: torch.Tensor, mode: str, p: Pass, lo: int, hi: int, batch: int):
        """Top-k routing of rows [lo, hi) of every batch row (logits [batch * (hi - lo), E]);
        returns (expert_ids [T, k], weights [T, k])."""
        coreset = p.coreset
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
        selectable = None
        if mode == "preview" and coreset is not None:
            chosen = coreset.experts.get(self.layer)
            if chosen is None:  # first preview of the block: route fully, remember the coreset
                coreset.record(self.layer, probs.sum(0).topk(min(coreset.size, self.num_experts)).indices)
            else:
                selectable = torch.zeros(self.num_experts, dtype=torch.bool, device=probs.device)
                selectable[chosen] = True
        choice = probs if selectable is None else probs.masked_fill(~selectable, -1.0)
        top, ids = choice.topk(self.top_k, dim=-1)
        if p.router_stats is not None:
            p.router_stats.append((probs, ids))
        weights = (top / top.sum(-1, keepdim=True)).to(logits.dtype)
        if p.hooks and self.hooks.active(self.route_point):
            positions = p.positions[lo:hi].repeat(batch)
            event = RouteEvent(self.layer, mode, positions, probs, ids, weights, selectable)
            self.hooks.fire(self.route_point, event)
            ids, weights = event.expert_ids, event.weights.to(logits.dtype)
        return ids, weights

    def forward(self, x: torch.Tensor, p: Pass) -> torch.Tensor:
        B, T, H = x.shape
        logits = ops.linear(x, self.gate.weight, packed=self.gate.packed)  # [B, T, E]
        parts = [("commit", 0, p.c), ("preview", p.c, p.c + p.m)]
        ids, weights = [], []
        for mode, lo, hi in parts:
            if hi > lo:
                i, w = self.route(logits[:, lo:hi].reshape(-1, self.num_experts), mode, p, lo, hi, B)
                ids.append(i.view(B, hi - lo, -1))
                weights.append(w.view(B, hi - lo, -1))
        ids = torch.cat(ids, dim=1).reshape(B * T, -1) if len(ids) > 1 else ids[0].reshape(B * T, -1)
        weights = torch.cat(weights, dim=1).reshape(B * T, -1) if len(weights) > 1 else weights[0].reshape(B * T, -1)
        flat = x.reshape(B * T, H)
        experts = self.experts
        routed = ops.moe_experts(flat, ids, weights, experts.gate_up_proj, experts.down_proj, experts.packed)
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (routed + shared).view(B, T, H)


class DecoderLayer(nn.Module):
    def __init__(self, config: CloverConfig, layer: int, hooks: HookRegistry):
        super().__init__()
        self.layer_type = config.layer_types[layer]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, layer, hooks)
        else:
            self.self_attn = GatedAttention(config, layer)
        self.mlp = SparseMoE(config, layer, hooks)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, p: Pass) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, p)
        else:
            h = self.self_attn(h, p)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), p)


class TextModel(nn.Module):
    def __init__(self, config: CloverConfig, hooks: HookRegistry):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, hooks) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)


def hook_points(config: CloverConfig) -> list[str]:
    points = list(ENGINE_POINTS)
    for i, kind in enumerate(config.layer_types):
        points.append(f"layers.{i}.moe.route")
        if kind == "linear_attention":
            points += [f"layers.{i}.gdn.preview", f"layers.{i}.gdn.state"]
    return points


# --------------------------------------------------------------------------- the language model
class CloverModel(nn.Module):
    """Clover: Qwen3.5-MoE's causal path plus the block preview operator. Untied LM head."""

    def __init__(self, config: CloverConfig):
        super().__init__()
        self.config = config
        self.hooks = HookRegistry(hook_points(config))
        self.model = TextModel(config, self.hooks)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def random(cls, config: CloverConfig | str, device=None, dtype=torch.float32, seed: int = 0) -> "CloverModel":
        """Random weights, materialised directly on ``device`` (built on ``meta`` first, so a
        full-size preset never exists twice in memory)."""
        if isinstance(config, str):
            config = CloverConfig.preset(config)
        with torch.device("meta"):
            model = cls(config)
        model = model.to(dtype).to_empty(device=device or "cpu")  # allocated once, in the target dtype
        model.init_weights(seed)
        return model.eval()

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        device = self.device
        gen = torch.Generator(device=device).manual_seed(seed)  # drawn where the weights live
        std = self.config.initializer_range

        def normal_(t: torch.Tensor, s: float = std):
            t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32, device=device).mul_(s))

        for name, param in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("linear_attn.norm.weight"):
                param.fill_(1.0)
            elif "norm" in name:
                param.zero_()  # zero-centred norms
            elif leaf == "dt_bias":
                param.fill_(1.0)
            elif leaf == "A_log":
                param.copy_(torch.empty(param.shape, device=device).uniform_(1.0, 16.0, generator=gen).log())
            elif leaf in ("block_scale", "history_bias", "history_log_n") or "conv1d_right" in name:
                continue
            elif "conv1d" in name:
                normal_(param, 1.0 / math.sqrt(param.shape[-1]))
            else:
                normal_(param)
        for module in self.modules():
            if isinstance(module, GatedDeltaNet):
                module.reset_preview_parameters()

    @classmethod
    def from_pretrained(cls, path, device=None, dtype=None, progress: bool | None = None) -> "CloverModel":
        from .loading import load_model

        return load_model(path, device=device, dtype=dtype, progress=progress)

    def save_pretrained(self, path, max_shard_bytes: int | None = None) -> None:
        from .loading import save_model

        save_model(self, path, max_shard_bytes=max_shard_bytes)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def pack_weights(self, enabled: bool = True) -> int:
        """CPU inference: keep every GEMM weight (projections, router, each expert, LM head) also in
        oneDNN's blocked layout, so products stop reordering it on every call: prefill and block
        previews get faster (``bench/compare_transformers.py``), at the price of a second copy of
        the weights in memory. A weight changed in place or replaced is repacked on its next use;
        writes through ``.data`` are not seen (call ``pack_weights()`` again). Returns the bytes
        packed; ``pack_weights(False)`` drops the copies."""
        if enabled and not ops.can_pack(self.lm_head.weight):
            raise ValueError(f"pack_weights: packed weights are for fp32/bf16 models on an x86 CPU with oneDNN; "
                             f"this model is {str(self.dtype).removeprefix('torch.')} on {self.device}")

        def pack(weight) -> ops.PackedWeight:
            packed = ops.PackedWeight()
            packed.get(weight)
            return packed

        for module in self.modules():
            if isinstance(module, (Linear, Router)):
                module.packed = pack(module.weight) if enabled else None
            elif isinstance(module, Experts):
                module.packed = ([pack(w) for w in module.gate_up_proj],
                                 [pack(w) for w in module.down_proj]) if enabled else None
        return sum(p.nbytes for p in self._packs())

    def _packs(self):
        for module in self.modules():
            if isinstance(module, (Linear, Router)) and module.packed is not None:
                yield module.packed
            elif isinstance(module, Experts) and module.packed is not None:
                yield from (p for group in module.packed for p in group)

    @property
    def packed_weights(self) -> bool:
        """Whether ``pack_weights`` is on."""
        return self.lm_head.packed is not None

    def new_cache(self, max_len: int, batch_size: int = 1) -> CloverCache:
        return CloverCache.allocate(self.config, max_len, batch_size, device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------------ the forward
    def _check_ids(self, ids: torch.Tensor, name: str, cache: CloverCache) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name}: expected integer token ids of shape [B, T], got {tuple(ids.shape)} {ids.dtype}")
        if ids.shape[0] != cache.batch_size:
            raise ValueError(f"{name}: batch size {ids.shape[0]} does not match the cache's {cache.batch_size}")
        # range-checked where that costs no device-to-host sync: ids already on an accelerator
        # come from the engine itself
        if ids.device.type == "cpu" and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"{name}: token ids must be in [0, {self.config.vocab_size})")
        return ids.to(self.device, torch.long)

    @torch.no_grad()
    def forward(self, cache: CloverCache, commit_ids=None, preview_ids=None, *, commit_logits: str | None = "last",
                preview_positions=None, coreset: Coreset | None = None) -> StepOutput:
        """One forward over ``[commit_ids ; preview_ids]`` (either may be None).

        ``commit_logits``: "last", "all" or None. ``preview_positions``: block positions whose
        logits are wanted (default: all). The cache advances by the committed rows only if
        the whole forward succeeds; a preview never changes it.
        """
        parts = []
        if commit_ids is not None:
            commit_ids = self._check_ids(commit_ids, "commit_ids", cache)
            parts.append(commit_ids)
        if preview_ids is not None:
            preview_ids = self._check_ids(preview_ids, "preview_ids", cache)
            parts.append(preview_ids)
        if not parts:
            raise ValueError("forward needs commit_ids, preview_ids or both")
        c = 0 if commit_ids is None else commit_ids.shape[1]
        m = 0 if preview_ids is None else preview_ids.shape[1]
        if c + m == 0:
            raise ValueError("forward: no tokens given")
        cache.check_room(c)
        if cache.length + c + m > self.config.max_position_embeddings:
            raise ValueError(f"positions up to {cache.length + c + m} exceed the context length "
                             f"{self.config.max_position_embeddings}")
        p = Pass(cache, cache.length, c, m, coreset, self.device)
        x = self._layers(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0], p)
        # the pass succeeded: publish the commit
        for dst, src in p.pending:
            dst.copy_(src)
        cache.length += c

        out_commit = out_preview = None
        if c and commit_logits is not None:
            rows = x[:, c - 1:c] if commit_logits == "last" else x[:, :c]
            out_commit = self.lm_head(self.model.norm(rows))
        if m:
            rows = x[:, c:]
            if preview_positions is not None:
                rows = rows[:, torch.as_tensor(preview_positions, device=x.device, dtype=torch.long)]
            out_preview = self.lm_head(self.model.norm(rows))
        return StepOutput(out_commit, out_preview)

    @torch.no_grad()
    def static_step(self, cache: CloverCache, ids: torch.Tensor, n: torch.Tensor, c: int, m: int,
                    commit_logits: bool = False, coreset: Coreset | None = None
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``forward`` with static shapes and no host synchronisation, the body of a CUDA graph
        (``clover_lab.graphs``): ids [B, c + m] on the model's device, ``n`` the committed length as a
        0-d device tensor. Writes the cache (K,V rows at n.., GDN ring and state when c > 0) but
        leaves ``cache.length`` to the caller. Refused while a hook is attached inside the model:
        a graph replays kernels and would never call it.
        Returns (logits of the last commit row or None, logits of every block row or None)."""
        self.check_static_step(cache, ids, c, m)
        return self._static_body(cache, ids, n, c, m, commit_logits, coreset)

    def check_static_step(self, cache: CloverCache, ids: torch.Tensor, c: int, m: int) -> None:
        """What a static step refuses, checked outside any traced or captured code."""
        if self.hooks.model_hooks_attached():
            raise RuntimeError("static_step: hooks are attached to model points; use forward()")
        if cache.batch_size != ids.shape[0] or ids.shape[1] != c + m:
            raise ValueError(f"static_step: ids {tuple(ids.shape)} do not match batch {cache.batch_size}, "
                             f"c + m = {c + m}")

    def _static_body(self, cache, ids, n, c, m, commit_logits, coreset):
        """What ``torch.compile`` traces for a static step (``clover_lab.graphs``): no hook lookups,
        so that attaching an engine hook does not invalidate the compiled code."""
        p = Pass(cache, -1, c, m, coreset, self.device, n_dev=n, hooks=False)
        x = self._layers(ids, p)
        for dst, src in p.pending:
            dst.copy_(src)
        out_commit = self.lm_head(self.model.norm(x[:, c - 1:c])) if c and commit_logits else None
        out_preview = self.lm_head(self.model.norm(x[:, c:])) if m else None
        return out_commit, out_preview

    def _layers(self, ids: torch.Tensor, p: Pass) -> torch.Tensor:
        """Embedding and every decoder layer over the rows of ``p``; RoPE's cos/sin once per forward."""
        x = self.model.embed_tokens(ids)
        p.rope = self.model.rotary.cos_sin(p.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, p)
        return x

    def block_forward(self, clean_ids: torch.Tensor, noisy_ids: torch.Tensor, block_size: int | None = None,
                      router_stats: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Training forward (with gradients): the clean sequence causally and its noisy copy, each
        block previewed against the clean prefix before it, in one forward. Returns the logits
        (hidden states through the final norm and LM head) of the clean and the noisy rows [B, L, V]."""
        bs = block_size or self.config.block_size
        if clean_ids.shape != noisy_ids.shape or clean_ids.dim() != 2:
            raise ValueError(f"block_forward: clean and noisy ids must both be [B, L]; got "
                             f"{tuple(clean_ids.shape)} and {tuple(noisy_ids.shape)}")
        L = clean_ids.shape[1]
        if L % bs:
            raise ValueError(f"block_forward: length {L} is not a multiple of the block size {bs}")
        p = Pass(None, 0, L, L, None, self.device, block_size=bs, router_stats=router_stats)
        x = self._layers(torch.cat([clean_ids, noisy_ids], dim=1), p)
        logits = self.lm_head(self.model.norm(x))
        return logits[:, :L], logits[:, L:]

    # ------------------------------------------------------------------ the three modes
    def commit(self, cache: CloverCache, ids, logits: str | None = "last") -> torch.Tensor | None:
        return self.forward(cache, commit_ids=ids, commit_logits=logits).commit_logits

    def preview(self, cache: CloverCache, block_ids, positions=None, coreset: Coreset | None = None) -> torch.Tensor:
        return self.forward(cache, preview_ids=block_ids, preview_positions=positions, coreset=coreset).preview_logits

    def commit_and_preview(self, cache: CloverCache, commit_ids, block_ids, positions=None,
                           coreset: Coreset | None = None, commit_logits: str | None = None) -> StepOutput:
        return self.forward(cache, commit_ids, block_ids, commit_logits=commit_logits,
                            preview_positions=positions, coreset=coreset)

    def prefill(self, cache: CloverCache, ids, chunk_size: int = 1024, logits: str | None = "last"):
        """Commit a long prompt in chunks (bounded activation memory)."""
        ids = self._check_ids(ids, "ids", cache)
        cache.check_room(ids.shape[1])
        out = []
        for start in range(0, ids.shape[1], chunk_size):
            piece = ids[:, start:start + chunk_size]
            last = start + chunk_size >= ids.shape[1]
            r = self.commit(cache, piece, logits=logits if (last or logits == "all") else None)
            if r is not None:
                out.append(r)
        if not out:
            return None
        return torch.cat(out, dim=1) if logits == "all" else out[-1]

    # ------------------------------------------------------------------ convenience
    def logits(self, input_ids) -> torch.Tensor:
        """Causal next-token logits of whole sequences [B, T] -> [B, T, V]; no cache needed."""
        ids = torch.as_tensor(input_ids)
        ids = ids[None] if ids.dim() == 1 else ids
        cache = self.new_cache(ids.shape[1], ids.shape[0])
        return self.commit(cache, ids, logits="all")

    def denoise_logits(self, prefix_ids, block_ids) -> torch.Tensor:
        """The prefix committed, then one preview of the block: logits [B, m, V] at every block position."""
        prefix = torch.as_tensor(prefix_ids)
        prefix = prefix[None] if prefix.dim() == 1 else prefix
        cache = self.new_cache(max(prefix.shape[1], 1), prefix.shape[0])
        if prefix.shape[1]:
            self.commit(cache, prefix, logits=None)
        return self.preview(cache, block_ids)
