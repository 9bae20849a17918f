"""What the token mixers read at each (block, step): the attention pattern of every gated-attention
layer (per head, each block row over the committed prefix and the block), and how much each GDN
value head of a preview leans on the compressed history (its history weight, spec 3.2).

The attention weights are not a tensor any forward keeps (the kernels never form them): they
are recomputed here from the layer's input rows as the run recorded them (``layers.{i}.input``
of every committed row and of the previewed block), through the layer's own projections, q/k
norms and RoPE. The check that this is what the model attended with: the weights times the
values, through the output gate, give back the out projection's input the forward had
(``AttentionPattern.check``, tested).

    pats = attribution.attention_patterns(engine, prompt, block=0, **generate)
    p = pats[(3, 0, 2)]              # layer 3, block 0, step 2
    p.weights[head, i, j]            # block row p.queries[i] reading key position p.keys[j]
    hist = attribution.history_weights(engine, prompt, **generate)   # (layer, block, step) -> [m, H_v]
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from clover_kernels import ops
from clover_lab.attribution.rows import RowRecorder
from clover_lab.errors import InputError
from clover_lab.hooks import points as P
from clover_lab.patching.patch import one_prompt


@dataclass
class AttentionPattern:
    """One gated-attention layer at one preview (``layer``, ``block``, ``step``): ``weights``
    [heads, queries, keys] (each row sums to 1), ``queries`` the block's positions, ``keys`` the
    positions read (the committed prefix, then the block); ``gates`` [heads, queries] the mean
    of each head's sigmoid output gate (how much of what it read it lets through)."""

    layer: int
    block: int
    step: int
    queries: list[int]
    keys: list[int]
    weights: torch.Tensor
    gates: torch.Tensor
    heads_out: torch.Tensor = field(repr=False, default=None)  # [queries, heads * D] gated output, recomputed

    def prefix_share(self) -> torch.Tensor:
        """[heads, queries]: the weight each block row puts on the committed prefix (the rest is
        on the block itself)."""
        n = sum(1 for k in self.keys if k < self.queries[0])
        return self.weights[:, :, :n].sum(-1)

    def to_dict(self) -> dict:
        return dict(layer=self.layer, block=self.block, step=self.step, queries=self.queries, keys=self.keys,
                    weights=self.weights.tolist(), gates=self.gates.tolist())


def _committed_inputs(rec: RowRecorder, layer: int) -> dict[int, torch.Tensor]:
    """position -> layer ``layer``'s input at that committed row (its latest commit)."""
    out = {}
    for key in rec.order:
        (mode, _b, _s), p = key
        row = rec.rows[key]
        if mode == "commit" and layer in row.layers and row.layers[layer].input is not None:
            out[p] = row.layers[layer].input
    return out


@torch.no_grad()
def _pattern(model, layer: int, prefix: dict[int, torch.Tensor], block_rows: list, part) -> AttentionPattern:
    attn = model.model.layers[layer].self_attn
    norm = model.model.layers[layer].input_layernorm
    queries = [r.position for r in block_rows]
    n = queries[0]
    missing = [p for p in range(n) if p not in prefix]
    if missing:
        raise InputError(f"attention pattern at layer {layer}, block {part[1]}, step {part[2]}: the run recorded no "
                         f"committed input at positions {missing[:5]}")
    x = torch.stack([prefix[p] for p in range(n)] + [r.layers[layer].input for r in block_rows])[None]  # [1, T, H]
    T, D, Hq, Hkv = x.shape[1], attn.head_dim, attn.num_heads, attn.num_kv_heads
    h = norm(x)
    q, gate = attn.q_proj(h).reshape(1, T, Hq, 2 * D).chunk(2, dim=-1)
    k = attn.k_proj(h).reshape(1, T, Hkv, D)
    v = attn.v_proj(h).reshape(1, T, Hkv, D).transpose(1, 2)  # [1, Hkv, T, D]
    positions = torch.arange(T, device=x.device)
    q, k = ops.qk_norm_rope(q, k, attn.q_norm.weight, attn.k_norm.weight, positions,
                            model.model.rotary.inv_freq_on(x.device), attn.q_norm.eps)
    group = Hq // Hkv
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [1, Hq, T, D]
    scores = (q[:, :, n:].float() @ k.float().transpose(-1, -2)) / math.sqrt(D)  # block rows see everything
    weights = scores.softmax(-1)[0]  # [Hq, m, T]
    o = (weights @ v[0].float())  # [Hq, m, D]
    g = torch.sigmoid(gate[0, n:].float()).transpose(0, 1)  # [Hq, m, D]
    heads_out = (o * g).transpose(0, 1).reshape(len(queries), Hq * D)
    return AttentionPattern(layer, part[1], part[2], queries, list(range(T)), weights, g.mean(-1), heads_out)


def attention_patterns(engine, prompt, block: int | None = None, step: int | None = None, layers=None,
                       **generate) -> dict[tuple[int, int, int], AttentionPattern]:
    """Generate ``prompt`` (diffusion or speculative: the modes with previews) and return the
    attention pattern of every gated-attention layer (or ``layers``) at every preview, or those of
    ``block`` (and ``step``): ``{(layer, block, step): AttentionPattern}``."""
    one_prompt(prompt, "attention_patterns")
    attn_layers = [i for i, t in enumerate(engine.model.config.layer_types) if t == "full_attention"]
    chosen = attn_layers if layers is None else list(layers)
    bad = [i for i in chosen if i not in attn_layers]
    if bad:
        raise InputError(f"attention_patterns layers={bad}: not gated-attention layers; those are {attn_layers}")

    def wanted(part, p):
        return part[0] == "commit" or ((block is None or part[1] == block) and (step is None or part[2] == step))

    rec = RowRecorder(engine.model, wanted)
    rec.run(engine, prompt, **generate)
    parts: dict[tuple, list] = {}
    for key in rec.order:
        if key[0][0] == "preview":
            parts.setdefault(key[0], []).append(rec.rows[key])
    if not parts:
        raise InputError(f"attention_patterns: the run has no preview at block {block}, step {step} "
                         f"(mode={generate.get('mode', 'diffusion')!r}; AR runs have no previews)")
    out = {}
    for layer in chosen:
        prefix = _committed_inputs(rec, layer)
        for part, rows in parts.items():
            rows = sorted(rows, key=lambda r: r.position)
            pattern = _pattern(engine.model, layer, prefix, rows, part)
            pattern.recorded = torch.stack([r.layers[layer].heads for r in rows]).float()  # what the forward had
            out[(layer, part[1], part[2])] = pattern
    return out


def history_weights(engine, prompt, **generate) -> dict[tuple[int, int, int], tuple[list[int], torch.Tensor]]:
    """Generate ``prompt`` and return, per GDN layer and preview, how much each block row's value
    heads lean on the compressed history (the committed prefix's state) rather than the block:
    ``{(layer, block, step): (positions, weights [m, H_v])}`` (spec 3.2's p_tH, in [0, 1])."""
    one_prompt(prompt, "history_weights")
    out = {}

    def keep(ev):
        out[(ev.layer, ev.block, ev.step)] = (ev.positions.reshape(-1).tolist(), ev.history_weights[0].float().cpu())

    with torch.no_grad(), engine.hooks({P.every_layer(P.GDN_PREVIEW): keep}):
        engine.generate(prompt, **generate)
    return out
