"""LensView: the logit lens per denoising step (``clover_lab.lens.logit_lens``). One frame per
forward the engine reads logits from (a preview step; an AR token): a heatmap of layers x
positions, coloured by each layer's top-1 probability and labelled with its top-1 token, so one
sees at which layer, and stepping through the frames at which step, each token is decided.

    LensView(engine)                       # live, while generations run
    LensView.from_lens(lens, tokenizer)    # a finished lens, no model
    LensView().replay(trace, engine)       # a saved trace, read with the model that made it
"""
from __future__ import annotations

import html

import numpy as np

from clover_lab.hooks import points
from clover_lab.lens.logit import LensStep, _Reader
from clover_lab.widgets.base import View
from clover_lab.widgets.pieces import figure_html, token_piece, visible


class LensView(View):
    title = "Logit lens per denoising step"
    needs_model = True  # the lens is the model's final norm and LM head over each layer's output
    replay_needs = (points.every_layer(points.OUTPUT), points.FINAL_NORM_OUTPUT)

    def __init__(self, engine=None, *, k: int = 5, fps: float = 10.0, tokenizer=None):
        self.k = k
        self.tokenizer = tokenizer
        self._reader = None
        self._pieces: dict[int, str] = {}
        super().__init__(engine, fps=fps)

    @classmethod
    def from_lens(cls, lens, tokenizer=None, **kw) -> "LensView":
        """A view of a finished ``LogitLens`` (needs no model)."""
        view = cls(tokenizer=tokenizer, k=lens.k, **kw)
        for s in lens.steps:
            view._push_step(s)
        view.flush()
        return view

    def hook_methods(self):
        return {points.every_layer(points.OUTPUT): "_on_output", points.FINAL_NORM_OUTPUT: "_on_head",
                points.DENOISE_STEP: "_on_step"}

    def _on_attach(self, engine):
        self._reader = _Reader(engine.model, self.k, engine.mask_token_id)
        if self.tokenizer is None:
            self.tokenizer = engine.tokenizer

    # ---------------------------------------------------------------- events
    def _on_output(self, ev):
        self._reader.on_output(ev)

    def _on_head(self, ev):
        self._reader.on_head(ev)
        self._push_step(self._reader.steps.pop())

    def _on_step(self, ev):
        if self.frames:  # the positions this step unmasked
            part = self.frames[-1][-1]
            if (part["block"], part["step"]) == (ev.block, ev.step):
                part["unmasked"] = [part["positions"][ev.masked.index(p)] for p in ev.unmask]
                self.throttle.request()

    def _push_step(self, s: LensStep) -> None:
        part = dict(block=s.block, step=s.step, mode=s.mode, positions=list(s.positions), ids=s.ids.numpy(),
                    probs=s.probs.numpy(), unmasked=list(s.unmasked))
        label = f"block {s.block} · step {s.step}" if s.mode == "preview" else f"token {s.block} (AR)"
        self._push(part, None, label)

    # ---------------------------------------------------------------- state and drawing
    def _empty(self):
        return {"last": None}

    def _apply_part(self, state, part):
        state["last"] = part

    def _build(self):
        import ipywidgets as W
        import plotly.graph_objects as go

        from clover_lab.widgets.figure import Figure

        self.fig = Figure(go.Heatmap(z=[[0.0]], colorscale="Viridis", zmin=0, zmax=1,
                                              texttemplate="%{text}", textfont=dict(size=9)))
        self.fig.update_layout(height=320, width=900, margin=dict(l=60, r=10, t=40, b=60),
                               xaxis_title="position (✓ unmasked at this step)", yaxis_title="layer")
        self.caption = W.HTML()
        return W.VBox([self.fig, self.caption])

    def _piece(self, token: int) -> str:
        return visible(token_piece(self.tokenizer, int(token), self._pieces), 8)

    def _render(self, state, frame):
        part = state["last"]
        if part is None:
            self.caption.value = "<span style='color:#888'>no lens frame yet</span>"
            return
        ids, probs = part["ids"], part["probs"]  # [L, N, k]
        L, N, k = ids.shape
        text = [[self._piece(ids[i, j, 0]) for j in range(N)] for i in range(L)]
        hover = [["<br>".join(f"{html.escape(self._piece(ids[i, j, r]))} {probs[i, j, r]:.2f}" for r in range(k))
                  for j in range(N)] for i in range(L)]
        x = [f"{p}{' ✓' if p in part['unmasked'] else ''}" for p in part["positions"]]
        with self.fig.batch_update():
            hm = self.fig.data[0]
            hm.z, hm.text, hm.customdata = probs[:, :, 0], text, np.array(hover, dtype=object)
            hm.x, hm.y = x, list(range(L))
            hm.hovertemplate = "layer %{y}, position %{x}<br>%{customdata}<extra></extra>"
            self.fig.layout.title = f"top-1 per layer · block {part['block']} · step {part['step']}"
        self.caption.value = f"{N} positions read · colour: the layer's top-1 probability"

    def _html_parts(self, state, frame):
        self._render(state, frame)
        return [figure_html(self.fig), self.caption.value]
