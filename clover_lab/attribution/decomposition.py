"""Direct logit attribution at (block, step, position): the logit of a decided token split into
what each part of the model wrote into the residual stream, read through the LM head with the
final norm's scale frozen (TransformerLens' ``decompose_resid`` / ``logit_attrs``).

The stream the final norm reads is a sum: the embedding, then per layer the token mixer's output
and the MoE block's output. The mixer's output is its out projection of per-head outputs (gated
attention's heads, GDN's value heads), so it splits per head; the MoE's output is the routed
experts' outputs times their gate weights, plus the gated shared expert. With the norm's
``1 / rms(x)`` held at its value on the real stream, the logit is linear in those parts, and they
sum to it (to float32 rounding).

    from clover_lab import attribution
    a = attribution.logit_attribution(engine, prompt, block=0, step=2, position=17)
    a.logit, a.top(5)     # [("layers.3.moe.experts.5", 1.9), ("embed", 1.2), ...]
    over = attribution.attribution_over_steps(engine, prompt, block=0, position=17)

Coordinates are those events carry: ``step`` the denoising step of a preview (the row at
``position`` is read); ``step=None`` a causal decision (AR's token, a speculative check), read
at the row before ``position``, in block ``block`` (AR: token i is block i).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from clover_kernels.moe.naive import moe_experts
from clover_lab.attribution.rows import Decision, Row, RowRecorder
from clover_lab.errors import InputError
from clover_lab.hooks import points as P
from clover_lab.hooks.registry import StopGeneration
from clover_lab.model.layers.moe import Experts

EMBED = "embed"


def component_names(model) -> list[str]:
    """Every component a logit can be split into, in the order of the forward (hook-point
    vocabulary): ``embed``; per layer ``layers.i.attn.heads.h`` / ``layers.i.gdn.heads.h``, then
    ``layers.i.moe.experts.e`` and ``layers.i.moe.shared_expert``."""
    c = model.config
    names = [EMBED]
    for i, t in enumerate(c.layer_types):
        mixer, heads = (("gdn", c.linear_num_value_heads) if t == "linear_attention"
                        else ("attn", c.num_attention_heads))
        names += [f"layers.{i}.{mixer}.heads.{h}" for h in range(heads)]
        names += [f"layers.{i}.moe.experts.{e}" for e in range(c.num_experts)]
        if c.num_shared_experts:
            names.append(f"layers.{i}.moe.shared_expert")
    return names


@dataclass
class LogitAttribution:
    """The logit of ``token`` at ``position`` of the forward at (``block``, ``step``) and its parts.

    ``contributions``: component name -> its share of the logit (only the experts routed at this
    row appear); ``vectors`` [parts, H] what each wrote into the stream, in ``contributions``'
    order; ``scale`` the frozen ``(1 + w) / rms`` of the final norm there [H]; ``mode`` the
    forward part read ("preview" or "commit") and ``row`` its position."""

    block: int | None
    step: int | None
    position: int
    token: int
    logit: float
    contributions: dict[str, float]
    mode: str = "preview"
    row: int = 0
    vectors: torch.Tensor | None = field(default=None, repr=False)
    scale: torch.Tensor | None = field(default=None, repr=False)

    def total(self) -> float:
        return math.fsum(self.contributions.values())

    def top(self, n: int = 10) -> list[tuple[str, float]]:
        """The ``n`` largest parts by size, signed."""
        return sorted(self.contributions.items(), key=lambda kv: -abs(kv[1]))[:n]

    def largest(self) -> str:
        return self.top(1)[0][0]

    def by_layer(self) -> dict[str, float]:
        """The parts summed per sub-block: ``embed``, ``layers.i.attn`` / ``.gdn``, ``layers.i.moe``."""
        out: dict[str, float] = {}
        for name, v in self.contributions.items():
            key = name if name == EMBED else ".".join(name.split(".")[:3])
            out[key] = out.get(key, 0.0) + v
        return out

    def vector(self, name: str) -> torch.Tensor:
        return self.vectors[list(self.contributions).index(name)]

    def to_dict(self) -> dict:
        return dict(block=self.block, step=self.step, position=self.position, token=self.token, logit=self.logit,
                    mode=self.mode, row=self.row, contributions=dict(self.contributions))


# --------------------------------------------------------------------------- the split
@torch.no_grad()
def split_row(model, row: Row, token: int, block: int | None = None) -> LogitAttribution:
    """The attribution of ``token``'s logit at a recorded row (every layer's parts present);
    ``block`` the decision's block (a causal decision's row lies in the forward before it)."""
    layers = model.model.layers
    missing = [i for i in range(len(layers)) if i not in row.layers or any(
        getattr(row.layers[i], f) is None for f in ("input", "heads", "mixer", "moe", "expert_ids"))]
    if missing or row.output is None:
        raise InputError(f"attribution: the row at position {row.position} of {row.part} was not recorded whole "
                         f"(layers {missing} incomplete); was the generation stopped inside that forward?")
    final = row.output.float()
    norm = model.model.norm
    scale = (1.0 + norm.weight.float()) * torch.rsqrt(final.pow(2).mean() + norm.eps)  # [H] frozen
    unembed = model.lm_head.weight[token].float()
    direction = unembed * scale  # [H]: a part's vector . direction is its share of the logit
    logit = float(model.lm_head(model.model.norm(row.output[None]))[0, token].float())
    if model.lm_head.bias is not None:
        raise InputError("attribution: an LM head with a bias has a constant part; Clover's has none")
    names, vectors = [EMBED], [row.layers[0].input.float()]
    for i, layer in enumerate(layers):
        lr = row.layers[i]
        if layer.layer_type == "linear_attention":
            mixer, proj, heads = "gdn", layer.linear_attn.out_proj, layer.linear_attn.num_v_heads
        else:
            mixer, proj, heads = "attn", layer.self_attn.o_proj, layer.self_attn.num_heads
        W = proj.weight.float()  # [H, heads * D]
        D = W.shape[1] // heads
        per_head = (W.view(W.shape[0], heads, D) * lr.heads.float().view(1, heads, D)).sum(-1).T  # [heads, H]
        names += [f"layers.{i}.{mixer}.heads.{h}" for h in range(heads)]
        vectors += list(per_head)
        if proj.bias is not None:
            names.append(f"layers.{i}.{mixer}.bias")
            vectors.append(proj.bias.float())
        moe = layer.mlp
        if type(moe.experts) is not Experts or moe.experts.store is not None:
            raise InputError(f"attribution: layer {i}'s experts are {type(moe.experts).__name__}"
                             f"{' (offloaded)' if moe.experts.store is not None else ''}; the per-expert split "
                             f"reads plain expert weights (load without keep_fp8 or offload)")
        h = layer.post_attention_layernorm(lr.input[None] + lr.mixer[None])  # [1, H] the MoE's input
        slots = moe_experts(h, lr.expert_ids[None], lr.weights[None].to(h.dtype), moe.experts.gate_up_proj,
                            moe.experts.down_proj, slots=True)[0]  # [k, H]
        ids = lr.expert_ids.tolist()
        names += [f"layers.{i}.moe.experts.{e}" for e in ids]
        vectors += list(slots.float())
        if moe.shared_expert is not None:
            hf = h.float()
            shared = torch.sigmoid(F.linear(hf, moe.shared_expert_gate.weight.float())) * moe.shared_expert(h).float()
            names.append(f"layers.{i}.moe.shared_expert")
            vectors.append(shared[0])
    V = torch.stack(vectors)  # [parts, H]
    values = (V @ direction).tolist()
    mode, row_block, step = row.part
    return LogitAttribution(row_block if mode == "preview" else block, step, row.position + (mode == "commit"), token, logit, dict(zip(names, values)),
                            mode, row.position, V, scale)


# --------------------------------------------------------------------------- the public calls
def _coordinate(name: str, value, none: bool) -> int | None:
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InputError(f"logit_attribution {name}={value!r}: expected an int >= 0"
                         + (" or None" if none else ""))
    return int(value)


def _wanted(block, step, position):
    """Which rows to keep: the preview row itself, or for a causal decision the row before it."""
    if step is not None:
        return lambda part, p: part == ("preview", block, step) and p == position
    return lambda part, p: part[0] == "commit" and p == position - 1


def _token(engine, token, rec: RowRecorder, d_position: int, what: str) -> int:
    if token is not None:
        t = _coordinate("token", token, False)
        if t >= engine.model.config.vocab_size:
            raise InputError(f"logit_attribution token={t}: outside the vocabulary [0, "
                             f"{engine.model.config.vocab_size})")
        return t
    committed = rec.committed()
    if d_position not in committed:
        raise InputError(f"logit_attribution: no token was committed at position {d_position} ({what}); name the "
                         f"token to explain with token=")
    return committed[d_position][1]


def _not_found(rec: RowRecorder, block, step, position) -> InputError:
    seen = sorted({(b, s) for (m, b, s), _p in rec.order if m == "preview"}, key=lambda k: (k[0], k[1]))
    made = sorted(rec.committed())
    shown = ", ".join(f"({b}, {s})" for b, s in seen[:10]) + (" ..." if len(seen) > 10 else "")
    span = f"{made[0]}..{made[-1]}" if made else "none"
    if step is None:
        return InputError(f"logit_attribution: no committed row at position {position - 1} decides position "
                          f"{position} in block {block}; generated positions: {span}")
    return InputError(f"logit_attribution: the run has no preview row at position {position} at block {block}, "
                      f"step {step} (a preview reads a block's positions; previews run at (block, step): "
                      f"{shown or 'none'}; generated positions: {span})")


def logit_attribution(engine, prompt, block: int | None, step: int | None, position: int, token: int | None = None,
                      **generate) -> LogitAttribution:
    """Generate ``prompt`` (``**generate``: mode, max_new_tokens ... as ``engine.generate``) and
    split the logit of ``token`` (default: the token committed at ``position``) at (``block``,
    ``step``, ``position``) into its parts. ``step=None``: a causal decision (AR, speculative),
    read at the committed row before ``position``; ``block`` the block that commits it."""
    block = _coordinate("block", block, step is None)
    step = _coordinate("step", step, True)
    position = _coordinate("position", position, False)
    rec = RowRecorder(engine.model, _wanted(block, step, position))
    rec.run(engine, prompt, **generate)
    row = rec.find(block, step, position)
    if step is None and row is not None:
        owner = rec.committed().get(position, (None,))[0]
        if owner != block:
            raise InputError(f"logit_attribution: position {position} was committed by block {owner}, not block "
                             f"{block}")
    if row is None:
        raise _not_found(rec, block, step, position)
    return split_row(engine.model, row, _token(engine, token, rec, position, f"block {block}, step {step}"), block)


def attribution_over_steps(engine, prompt, block: int, position: int, token: int | None = None,
                           **generate) -> list[LogitAttribution]:
    """How the evidence for the token at ``position`` builds over the steps of ``block``: its
    attribution at every preview of the block that read the position (while it was masked), then,
    in AR mode or a speculative check, the causal decision. One generation."""
    block = _coordinate("block", block, False)
    position = _coordinate("position", position, False)

    def wanted(part, p):
        return (part[0] == "preview" and part[1] == block and p == position) or (part[0] == "commit"
                                                                                 and p == position - 1)

    rec = RowRecorder(engine.model, wanted)
    rec.run(engine, prompt, **generate)
    t = _token(engine, token, rec, position, f"block {block}")
    start = {b: st for b, st, _tokens in rec.commits}.get(block)
    masked = {s for b, s, _canvas, still, _chosen in rec.steps  # the steps that read it still masked
              if b == block and start is not None and position - start in still}
    steps = sorted(s for (m, b, s), p in rec.order if m == "preview" and b == block and p == position and s in masked)
    out = [split_row(engine.model, rec.rows[(("preview", block, s), position)], t) for s in steps]
    causal = rec.find(block, None, position)
    if causal is not None and rec.committed().get(position, (None,))[0] == block and (
            not steps or engine_mode(generate) != "diffusion"):
        out.append(split_row(engine.model, causal, t, block))
    if not out:
        raise _not_found(rec, block, 0, position)
    return out


def engine_mode(generate: dict) -> str:
    return generate.get("mode", "diffusion")


def decision_attributions(engine, prompt, limit: int | None = None, **generate
                          ) -> tuple[list[Decision], list[LogitAttribution]]:
    """One generation, every decision it made (``limit``: the first that many) and the
    attribution of each decided token's logit where it was decided."""
    rec = RowRecorder(engine.model, None)
    rec.run(engine, prompt, **generate)
    decisions = rec.decisions()[:limit]
    out = []
    for d in decisions:
        row = rec.find(d.block, d.step, d.position)
        if row is None:
            raise _not_found(rec, d.block, d.step, d.position)
        out.append(split_row(engine.model, row, d.token, d.block))
    return decisions, out


# --------------------------------------------------------------------------- ablation
def ablated_logit(engine, prompt, attribution: LogitAttribution, name: str, **generate) -> float:
    """Rerun the generation with part ``name`` removed at its source, at the attributed row of
    the attributed forward only (its vector subtracted where it enters the stream: the layer-0
    input for ``embed``, the mixer's output for a head, the MoE's output for an expert); returns
    the logit of the same token there. Downstream layers see the change, so the logit moves by
    the part's direct share plus what later layers make of its absence."""
    if name not in attribution.contributions:
        raise InputError(f"ablated_logit: {name!r} is not a part of this attribution; parts: "
                         f"{', '.join(list(attribution.contributions)[:6])} ...")
    vector = attribution.vector(name)
    if name == EMBED:
        point = P.layer_point(0, P.INPUT)
    else:
        i, sub = int(name.split(".")[1]), name.split(".")[2]
        point = P.layer_point(i, P.MOE_OUTPUT if sub == "moe" else (P.GDN_OUTPUT if sub == "gdn" else P.ATTN_OUTPUT))
    out: list[float] = []

    def at_row(ev):
        if ev.mode != attribution.mode or (ev.mode == "preview" and (ev.block, ev.step) != (attribution.block,
                                                                                               attribution.step)):
            return None
        positions = ev.positions.reshape(-1).tolist()
        return positions.index(attribution.row) if attribution.row in positions else None

    state = {"done": False}

    def remove(ev):
        i = at_row(ev)
        if i is None or state["done"]:
            return
        new = ev.value.clone()
        new[0, i] -= vector.to(new.dtype)
        ev.value = new

    def read(ev):
        i = at_row(ev)
        if i is None or state["done"] or ev.layer != engine.model.config.num_hidden_layers - 1:
            return
        state["done"] = True  # the first forward holding the row: later commits of it are not ours
        out.append(float(engine.model.lm_head(engine.model.model.norm(ev.value[:, i]))[0, attribution.token]))
        raise StopGeneration  # read: the rest of the run changes nothing

    with torch.no_grad(), engine.hooks({point: remove, P.every_layer(P.OUTPUT): read}):
        engine.generate(prompt, **generate)
    if not out:
        raise InputError(f"ablated_logit: the rerun never reached the attributed row (position {attribution.row}, "
                         f"{attribution.mode} of block {attribution.block}, step {attribution.step})")
    return out[0]
