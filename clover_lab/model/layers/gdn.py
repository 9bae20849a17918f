"""Gated DeltaNet: the chunked gated delta rule in commit, Clover's preview operator in preview
(spec 3.2), and both over the training layout.

A state hook may edit the state (and ring) in place or assign new tensors; what it leaves is
checked before the cache keeps it (same shape, finite floats): a HookError naming the point
otherwise. Only a changed event is checked, so observing hooks add no host read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from clover_kernels import ops
from clover_kernels.gdn.torch import gdn_commit_blocks
from clover_lab.config import CloverConfig
from clover_lab.hooks import points
from clover_lab.hooks.events import GDNPreviewEvent, GDNStateEvent, edit_count
from clover_lab.hooks.registry import HookError, HookRegistry
from clover_lab.model.cache import GDNCache
from clover_lab.model.context import ForwardContext
from clover_lab.model.layers.linear import FusedProjections, Linear
from clover_lab.model.layers.norm import GatedRMSNorm


@dataclass
class DraftRows:
    """A GDN layer's part of a draft commit: the ring and state before it [B, ...] and the
    commit rows' pre-convolution q,k,v [B, c, C] and gates g, beta [B, c, Hv]."""
    ring: torch.Tensor
    state: torch.Tensor
    mixed: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    def rows(self, index: torch.Tensor) -> "DraftRows":
        return DraftRows(*(t.index_select(0, index.to(t.device)) for t in
                           (self.ring, self.state, self.mixed, self.g, self.beta)))


class GatedDeltaNet(nn.Module):
    """GDN token mixer: the chunked gated delta rule in commit, Clover's preview operator in preview."""

    def __init__(self, config: CloverConfig, layer: int, hooks: HookRegistry):
        super().__init__()
        self.layer = layer
        self.hooks = hooks
        self.config = config  # its preview_reading says how the preview weights are read (preview_weights)
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
        self.in_proj = FusedProjections("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # one GEMM
        # Clover's preview operator (spec 3.2); defaults make an untrained but well-defined preview
        self.conv1d_right = nn.Conv1d(C, C, K - 1, groups=C, bias=False)
        self.block_scale = nn.Parameter(torch.empty(Hv))
        self.history_bias = nn.Parameter(torch.empty(Hv))
        self.history_log_n = nn.Parameter(torch.empty(Hv))
        self.reset_preview_parameters()
        self.state_point = points.layer_point(layer, points.GDN_STATE)
        self.preview_point = points.layer_point(layer, points.GDN_PREVIEW)

    @torch.no_grad()
    def reset_preview_parameters(self) -> None:
        self.conv1d_right.weight.zero_()
        self.block_scale.fill_(math.log(math.sqrt(self.head_k_dim)))
        self.history_bias.zero_()
        self.history_log_n.fill_(1.0)

    def preview_weights(self, m: int):
        """(right taps [C, K-1], block_scale, history_bias, history_log_n) in the spec's reading
        (spec 3.2, what the preview op computes with) for a block of ``m`` rows, from the stored
        weights read as ``config.preview_reading`` says (spec 3.2.1; nothing to do by default)."""
        right = self.conv1d_right.weight[:, 0]
        scale, bias, coef = self.block_scale, self.history_bias, self.history_log_n
        if not self.config.preview_reading:
            return right, scale, bias, coef
        if self.config.reading("right_taps") == "farthest_first":
            right = right.flip(-1)
        if self.config.reading("logit_scale") == "multiplier":
            scale = scale.float().log()  # exp(ln s) = s (s > 0: the loader checks)
        if self.config.reading("history_c") == "m":
            bias = bias.float() + coef.float() * (m - math.log(m))  # b + c ln(m) + c (m - ln(m)) = b + c m
        return right, scale, bias, coef

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        B, T, _ = x.shape
        c, m = ctx.c, ctx.m
        mixed, z, b, a = self.in_proj(self, x)  # [B, T, C], [B, T, Hv * dv], [B, T, Hv] twice
        z = z.reshape(B, T, self.num_v_heads, self.head_v_dim)  # per-head views of in_proj's product (no copy)
        if ctx.is_training:
            o = self._mix_blocks(mixed, b, a, ctx.c, ctx.block_size)
            o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
            return self.out_proj(o.reshape(B, T, -1))
        cache: GDNCache = ctx.cache.layers[self.layer]
        if ctx.is_packed:
            return self.out_proj(self.norm(self._mix_packed(mixed, b, a, cache, ctx), z).reshape(B, T, -1))
        ring, state = cache.ring, cache.state
        conv_w = self.conv1d.weight[:, 0]
        # a fused commit+preview writes both parts' rows into one output (no concatenation)
        o = mixed.new_empty(B, T, self.num_v_heads, self.head_v_dim) if c and m else None
        if c:
            g, beta = self._gates(b[:, :c], a[:, :c])
            if ctx.drafts is not None:  # a draft commit: what keeping only a prefix of it needs
                ctx.drafts[self.layer] = DraftRows(ring.clone(), state.clone(), mixed[:, :c], g, beta)
            o_c, ring_c, state_c = ops.gdn_commit(mixed[:, :c], ring, conv_w, g, beta, state, self.num_k_heads,
                                                  self.head_k_dim, self.head_v_dim, out=None if o is None else o[:, :c])
            if ctx.commit_rows is not None:  # rows packed beside committing ones keep their ring and state
                keep = ctx.commit_rows
                ring_c = torch.where(keep[:, None, None], ring_c, ring)
                state_c = torch.where(keep[:, None, None, None], state_c, state)
            ring, state = ring_c, state_c
            if ctx.hooks and self.hooks.active(self.state_point):
                rows = ctx.cache.row_lengths if ctx.is_ragged else None  # host lengths: no sync
                event = GDNStateEvent(self.layer, state, ring, ctx.n + c,
                                      None if rows is None else [n + c for n in rows], where=ctx.where)
                before = (edit_count(state), edit_count(ring))
                self.hooks.fire(self.state_point, event)
                if (event.state is not state or event.ring is not ring
                        or (edit_count(state), edit_count(ring)) != before or None in before):
                    ring, state = checked_state(event, self.state_point, ring, state)
            elif self.state_point in ctx.observed:  # a static step: its observers read this after it
                ctx.record(self.state_point, "commit", 0, c, False, state=state, ring=ring)
            ctx.pending += [(cache.ring, ring), (cache.state, state)]
            o = o_c if o is None else o
        if m:
            observed = self.preview_point in ctx.observed  # a static step: its observers read after it
            want_history = observed or (ctx.hooks and self.hooks.active(self.preview_point))
            right, scale, bias, coef = self.preview_weights(m)
            o_p, p_hist, h = ops.gdn_preview(mixed[:, c:], ring, conv_w, right, state, scale, bias, coef,
                                             self.num_k_heads, self.head_k_dim, self.head_v_dim,
                                             return_history=want_history, out=None if o is None else o[:, c:])
            if observed:
                ctx.record(self.preview_point, "preview", c, c + m, False, history_weights=p_hist, history_reads=h)
            elif want_history:
                self.hooks.fire(self.preview_point,
                                GDNPreviewEvent(self.layer, ctx.positions[..., c:], p_hist, h, where=ctx.where))
            o = o_p if o is None else o  # [B, T, Hv, dv]
        return self.out_proj(self.norm(o, z).reshape(B, T, -1))


    def _mix_packed(self, mixed, b, a, cache: GDNCache, ctx: ForwardContext) -> torch.Tensor:
        """A packed forward ([1, N, ...]): each group of segments of one shape as a batch of its cache
        rows: the commit rows by the delta rule from each row's ring and state (kept for the cache
        when the forward succeeds), the block rows by the preview operator from the state after
        them. Returns [1, N, Hv, dv]."""
        conv_w = self.conv1d.weight[:, 0]
        o = mixed.new_zeros(1, mixed.shape[1], self.num_v_heads, self.head_v_dim)
        for grp in ctx.groups:
            c, m, rows, tokens = grp.c, grp.m, grp.rows, grp.tokens
            ring, state = cache.ring[rows], cache.state[rows]
            x = mixed[0, tokens]  # [G, c + m, C]
            if c:
                g, beta = self._gates(b[0, tokens[:, :c]], a[0, tokens[:, :c]])
                if grp.draft and ctx.drafts is not None:  # per cache row: what keeping a prefix of its draft needs
                    for i, r in enumerate(grp.members):
                        ctx.drafts.setdefault(r, {})[self.layer] = DraftRows(
                            ring[i:i + 1], state[i:i + 1], x[i:i + 1, :c], g[i:i + 1], beta[i:i + 1])
                o_c, ring, state = ops.gdn_commit(x[:, :c], ring, conv_w, g, beta, state, self.num_k_heads,
                                                  self.head_k_dim, self.head_v_dim)
                o[0, tokens[:, :c]] = o_c.to(o.dtype)
                ctx.pending += [(cache.ring, rows, ring), (cache.state, rows, state)]
            if m:
                right, scale, bias, coef = self.preview_weights(m)
                o_p, _, _ = ops.gdn_preview(x[:, c:], ring, conv_w, right, state, scale, bias, coef,
                                            self.num_k_heads, self.head_k_dim, self.head_v_dim)
                o[0, tokens[:, c:]] = o_p.to(o.dtype)
        return o

    def kept_state(self, rows: "DraftRows", a: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ring, state) after only the first ``a`` rows of a draft commit: the delta rule over
        those rows from the state the commit started from (the block's chunk state), on the
        forward's own projections and gates; no projection, attention or MoE is recomputed."""
        if a == 0:
            return rows.ring, rows.state
        _, ring, state = ops.gdn_commit(rows.mixed[:, :a], rows.ring, self.conv1d.weight[:, 0], rows.g[:, :a],
                                        rows.beta[:, :a], rows.state, self.num_k_heads, self.head_k_dim,
                                        self.head_v_dim)
        return ring, state

    def _gates(self, b, a):
        """in_proj_b and in_proj_a's outputs -> (log decay g fp32, beta): one kernel on a GPU."""
        return ops.gdn_gates(b, a, self.A_log, self.dt_bias)

    def _mix_blocks(self, mixed, b, a, L: int, bs: int) -> torch.Tensor:
        """Training layout: the clean rows in commit mode, every noisy block previewed against the
        clean state and ring at its boundary, with the same preview op as inference."""
        B = mixed.shape[0]
        nb = L // bs
        g, beta = self._gates(b[:, :L], a[:, :L])
        conv_w = self.conv1d.weight[:, 0]
        o_clean, rings, states = gdn_commit_blocks(mixed[:, :L], conv_w, g, beta, self.num_k_heads,
                                                   self.head_k_dim, self.head_v_dim, bs)
        noisy = mixed[:, L:].reshape(B * nb, bs, -1)
        right, scale, bias, coef = self.preview_weights(bs)
        o_noisy, _, _ = ops.gdn_preview(
            noisy, rings.reshape(B * nb, *rings.shape[2:]), conv_w, right,
            states.reshape(B * nb, *states.shape[2:]), scale, bias, coef,
            self.num_k_heads, self.head_k_dim, self.head_v_dim)
        return torch.cat([o_clean, o_noisy.reshape(B, L, *o_noisy.shape[2:])], dim=1)


def checked_state(event: GDNStateEvent, point: str, ring: torch.Tensor, state: torch.Tensor):
    """(ring, state) as a state hook left them, validated (reads the device: only after a change)."""
    out = []
    for name, want in (("ring", ring), ("state", state)):
        got = getattr(event, name)
        if not isinstance(got, torch.Tensor) or not got.is_floating_point():
            raise HookError(point, ValueError(f"{name} must be a floating tensor of shape {list(want.shape)}, got "
                                              f"{type(got).__name__} {getattr(got, 'dtype', got)!r}"))
        if got.shape != want.shape:
            raise HookError(point, ValueError(f"a hook set a {name} of shape {list(got.shape)}, "
                                              f"expected {list(want.shape)}"))
        out.append(got.to(want.device, want.dtype))
    finite = torch.stack([t.isfinite().all() for t in out]).tolist()
    for name, ok in zip(("ring", "state"), finite):
        if not ok:
            raise HookError(point, ValueError(f"a hook left NaN or inf in the {name}"))
    return out[0], out[1]
