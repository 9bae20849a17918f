"""What one generation leaves behind for attribution: at chosen rows of chosen forwards, every
layer's input, the token mixer's per-head output (the out projection's input), the mixer's and
the MoE block's outputs, the routing decision, and the last layer's output; plus the engine's
decisions (``denoise.step``) and commits (``block.commit``).

A row is named by its forward part, ``(mode, block, step)`` as events carry it (a preview of
block b at step s: ``("preview", b, s)``; the commit rows of block b: ``("commit", b, None)``; the
prompt's prefill ``("commit", None, None)``), and its absolute position.

The per-head split has no hook point: it is the out projection's input, read by a forward
pre-hook on ``o_proj`` / ``out_proj`` (removed with the engine hooks, also on an exception),
aligned with the residual events that fire around it (a forward's commit rows come first, its
preview rows last).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from clover_lab.errors import InputError
from clover_lab.hooks import points as P
from clover_lab.patching.patch import one_prompt

Part = tuple  # (mode, block, step)


@dataclass
class LayerRow:
    """One layer at one row: ``input`` [H] the stream entering it, ``heads`` [heads * D] the
    mixer's per-head output before the out projection, ``mixer`` [H] and ``moe`` [H] what the
    two sub-blocks add, ``expert_ids`` / ``weights`` [k] the routing."""

    input: torch.Tensor | None = None
    heads: torch.Tensor | None = None
    mixer: torch.Tensor | None = None
    moe: torch.Tensor | None = None
    expert_ids: torch.Tensor | None = None
    weights: torch.Tensor | None = None


@dataclass
class Row:
    part: Part
    position: int
    layers: dict[int, LayerRow] = field(default_factory=dict)
    output: torch.Tensor | None = None  # [H] the last layer's output (before the final norm)

    def layer(self, i: int) -> LayerRow:
        return self.layers.setdefault(i, LayerRow())


@dataclass
class Decision:
    """A token the engine placed: at ``position``, in ``block``, at denoising ``step`` (None: a
    causal decision, AR or a speculative check, read at the row before it)."""

    block: int | None
    step: int | None
    position: int
    token: int


class RowRecorder:
    """Hooks recording the rows ``wanted(part, position)`` says (every row when None)."""

    def __init__(self, model, wanted: Callable[[Part, int], bool] | None = None):
        self.model = model
        self.wanted = wanted
        self.last_layer = model.config.num_hidden_layers - 1
        self.rows: dict[tuple, Row] = {}  # (part, position) -> Row, the latest forward's
        self.order: list[tuple] = []  # (part, position) in the order first recorded
        self.steps: list = []  # (block, step, canvas [m], masked, {block position: token unmasked})
        self.commits: list = []  # (block, start, tokens)
        self._heads: dict[int, torch.Tensor] = {}  # layer -> the out projection's input [T, heads * D]

    # ---------------------------------------------------------------- which rows
    def _take(self, ev) -> list[tuple[int, int]]:
        """(index in the event's rows, position) of the rows of this part to keep."""
        part = (ev.mode, ev.block, ev.step)
        positions = ev.positions.reshape(-1).tolist()
        return [(i, p) for i, p in enumerate(positions) if self.wanted is None or self.wanted(part, p)]

    def _row(self, ev, p: int, fresh: bool = False) -> Row:
        key = ((ev.mode, ev.block, ev.step), p)
        if fresh or key not in self.rows:  # a row committed again (a speculative re-check) is the latest one
            if key not in self.rows:
                self.order.append(key)
            self.rows[key] = Row(key[0], p)
        return self.rows[key]

    # ---------------------------------------------------------------- the hooks
    def on_input(self, ev) -> None:
        for i, p in self._take(ev):
            self._row(ev, p, fresh=ev.layer == 0).layer(ev.layer).input = ev.value[0, i].detach().clone()

    def out_projection_input(self, layer: int):
        def pre_hook(module, args):
            self._heads[layer] = args[0].detach()
        return pre_hook

    def on_mixer(self, ev) -> None:
        take = self._take(ev)
        if not take:
            return
        heads = self._heads.get(ev.layer)
        if heads is None:
            raise InputError(f"attribution: layer {ev.layer}'s out projection was not called as a module in this "
                             f"forward (a compiled or fused step?), so its per-head input could not be read")
        T = ev.value.shape[1]
        lo = 0 if ev.mode == "commit" else heads.shape[1] - T  # a forward's preview rows come last
        for i, p in take:
            row = self._row(ev, p).layer(ev.layer)
            row.mixer = ev.value[0, i].detach().clone()
            row.heads = heads[0, lo + i].clone()

    def on_route(self, ev) -> None:
        for i, p in self._take(ev):
            row = self._row(ev, p).layer(ev.layer)
            row.expert_ids, row.weights = ev.expert_ids[i].clone(), ev.weights[i].detach().clone()

    def on_moe(self, ev) -> None:
        for i, p in self._take(ev):
            self._row(ev, p).layer(ev.layer).moe = ev.value[0, i].detach().clone()

    def on_output(self, ev) -> None:
        if ev.layer != self.last_layer:
            return
        for i, p in self._take(ev):
            self._row(ev, p).output = ev.value[0, i].detach().clone()

    def on_step(self, ev) -> None:
        cand = ev.candidates.tolist()
        chosen = {p: ev.tokens.get(p, cand[ev.masked.index(p)]) for p in ev.unmask}
        self.steps.append((ev.block, ev.step, ev.canvas.tolist(), list(ev.masked), chosen))

    def on_commit(self, ev) -> None:
        self.commits.append((ev.block, ev.start, list(ev.tokens)))

    def hooks(self) -> dict:
        return {P.every_layer(P.INPUT): self.on_input, P.every_layer(P.ATTN_OUTPUT): self.on_mixer,
                P.every_layer(P.GDN_OUTPUT): self.on_mixer, P.every_layer(P.MOE_ROUTE): self.on_route,
                P.every_layer(P.MOE_OUTPUT): self.on_moe, P.every_layer(P.OUTPUT): self.on_output,
                P.DENOISE_STEP: self.on_step, P.BLOCK_COMMIT: self.on_commit}

    def run(self, engine, prompt, **generate):
        """Generate ``prompt`` with the recorder on; returns the generation's result."""
        one_prompt(prompt, "attribution")
        handles = []
        try:
            for i, layer in enumerate(self.model.model.layers):
                mixer = layer.linear_attn if layer.layer_type == "linear_attention" else layer.self_attn
                proj = mixer.out_proj if layer.layer_type == "linear_attention" else mixer.o_proj
                handles.append(proj.register_forward_pre_hook(self.out_projection_input(i)))
            with torch.no_grad(), engine.hooks(self.hooks()):
                return engine.generate(prompt, **generate)
        finally:
            for h in handles:
                h.remove()
            self._heads.clear()

    # ---------------------------------------------------------------- what the run decided
    def committed(self) -> dict[int, tuple[int, int]]:
        """position -> (block, token) of every committed generated token."""
        out = {}
        for block, start, tokens in self.commits:
            for j, t in enumerate(tokens):
                out[start + j] = (block, t)
        return out

    def decisions(self) -> list[Decision]:
        """Every token the engine placed, where it was decided: a diffusion unmask at its (block,
        step), a causal token (AR, a speculative check) at its block with no step."""
        starts = {block: start for block, start, _tokens in self.commits}
        out = []
        for block, step, _canvas, _masked, chosen in self.steps:  # block positions -> absolute ones
            if block in starts:
                out += [Decision(block, step, starts[block] + p, t) for p, t in sorted(chosen.items())]
        unmasked = {d.position for d in out}
        for p, (block, t) in sorted(self.committed().items()):
            if p not in unmasked:
                out.append(Decision(block, None, p, t))
        return out

    def find(self, block: int | None, step: int | None, position: int) -> Row | None:
        """The recorded row deciding ``position`` at (block, step): the preview row itself, or for a
        causal decision (step None) the committed row before it (its latest commit)."""
        if step is not None:
            return self.rows.get((("preview", block, step), position))
        found = None
        for key in self.order:
            (mode, _b, _s), p = key
            if mode == "commit" and p == position - 1:
                found = self.rows[key]
        return found
