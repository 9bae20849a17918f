"""FeatureView: a sparse autoencoder's features as a block denoises (``clover_lab.features.timeline``).
One frame per preview (block, step), so the slider replays the denoising:

- the chosen feature over the shown block, steps x positions, filled in up to the shown step, with
  a marker at the step that unmasked each position (once it has);
- the features most active at the shown step (summed over the block's positions) x positions,
  with the positions still masked at that step marked;
- the chosen features' mean activation against the step that unmasked the position (offset
  step - unmasking step; 0 is the step that unmasks it), over the whole generation.

    tl = features.timeline(engine, sae, prompt, max_new_tokens=64)
    FeatureView(tl, features=[597, 789])      # the dropdown picks among these (default: the top 10)
"""
from __future__ import annotations

import html

import numpy as np

from clover_lab.errors import InputError
from clover_lab.features.timeline import FeatureTimeline
from clover_lab.widgets.base import View
from clover_lab.widgets.pieces import LEGEND_BELOW, figure_html, finite_rows, series_colour, token_piece, visible
from clover_lab.widgets.throttle import weak_callback


class FeatureView(View):
    title = "Features per denoising step"

    def __init__(self, timeline: FeatureTimeline | None = None, *, features: list[int] | None = None, top: int = 8,
                 fps: float = 15.0):
        self.timeline = None
        self.top_n = top
        self.choices: list[int] = []
        self._pieces: dict[int, str] = {}
        super().__init__(None, fps=fps)
        if timeline is not None:
            self.show_timeline(timeline, features)

    def hook_methods(self):
        return {}  # fed a finished timeline, not hooks

    # ---------------------------------------------------------------- widgets
    def _build(self):
        import ipywidgets as W
        import plotly.graph_objects as go

        from clover_lab.widgets.figure import Figure

        self.feature_dd = W.Dropdown(options=[("(none)", -1)], value=-1, description="feature",
                                     layout=W.Layout(width="260px"))
        self.feature_dd.observe(weak_callback(self, "redraw"), names="value")
        self.fig_feature = Figure([go.Heatmap(z=[[0.0]], colorscale="Viridis", zmin=0,
                                              colorbar=dict(thickness=10, title=dict(text="activation", side="right"))),
                                   go.Scatter(x=[], y=[], mode="markers", name="the step that unmasked the position",
                                              marker=dict(symbol="circle-open", size=13, color="#e4572e",
                                                          line=dict(width=2)))])
        self.fig_feature.update_layout(height=380, width=940, margin=dict(l=60, r=10, t=40, b=120),
                                       xaxis_title="block position: final token", yaxis_title="denoising step",
                                       yaxis=dict(autorange="reversed", dtick=1), legend=LEGEND_BELOW,
                                       showlegend=True)  # the circles' entry, though the heatmap has none
        self.fig_top = Figure(go.Heatmap(z=[[0.0]], colorscale="Magma", zmin=0,
                                         colorbar=dict(thickness=10, title=dict(text="activation", side="right"))))
        self.fig_top.update_layout(height=360, width=560, margin=dict(l=90, r=10, t=40, b=60),
                                   xaxis_title="block position (· still masked at this step)", yaxis_title="feature",
                                   yaxis=dict(autorange="reversed"))
        self.fig_rel = Figure()
        self.fig_rel.update_layout(height=360, width=380, margin=dict(l=50, r=10, t=40, b=60),
                                   title="against the unmasking step",
                                   xaxis_title="step - the step that unmasked it", yaxis_title="mean activation",
                                   legend=LEGEND_BELOW)
        self.caption = W.HTML()
        return W.VBox([self.feature_dd, self.fig_feature, W.HBox([self.fig_top, self.fig_rel]), self.caption])

    # ---------------------------------------------------------------- data
    def show_timeline(self, timeline: FeatureTimeline, features: list[int] | None = None) -> "FeatureView":
        """Show ``timeline``, one frame per preview; the dropdown offers ``features`` (default the
        generation's ``top`` most active)."""
        if not isinstance(timeline, FeatureTimeline):
            raise InputError(f"FeatureView shows a FeatureTimeline (features.timeline), got {type(timeline).__name__}")
        choices = [int(f) for f in features] if features else [f for f, _ in timeline.top(n=self.top_n)]
        for f in choices:
            timeline.feature_index(f)
        with self._lock:
            self.timeline = timeline
            self.choices = choices
            self.frames.clear()
            self.frame_labels.clear()
            self._live = self._empty()
            self.feature_dd.options = [(f"feature {f}", f) for f in choices] or [("(none)", -1)]
            self.feature_dd.value = choices[0] if choices else -1
            for i, frame in enumerate(timeline.frames):
                self._push(dict(frame=i), None, f"block {frame.block} · step {frame.step}")
        self.flush()
        return self

    def _empty(self):
        return {"frame": None}

    def _apply_part(self, state, part):
        state["frame"] = part["frame"]

    def _piece(self, token) -> str:
        if token is None:
            return "—"
        tok = self.timeline.tokenizer if self.timeline is not None else None
        return visible(token_piece(tok, int(token), self._pieces), 8)

    # ---------------------------------------------------------------- drawing
    def _render(self, state, frame):
        tl, i = self.timeline, state["frame"]
        if tl is None or i is None or self.feature_dd.value < 0:
            self.caption.value = "<span style='color:#888'>no timeline yet</span>"
            return
        shown = tl.frames[i]
        feature = int(self.feature_dd.value)
        block = shown.block
        frames = tl.frames_of(block)
        upto = [f for f in frames if f.step <= shown.step]
        n = tl.positions(block)
        tokens, unmasked_at = tl.tokens(block), tl.unmask_steps(block)
        x = [f"{p}: {self._piece(t)}" for p, t in enumerate(tokens)]
        act = tl.activation(feature, block).numpy()  # [steps, positions]
        z = np.full((len(frames), n), np.nan)
        z[:len(upto)] = act[:len(upto)]
        done = [(p, s) for p, s in enumerate(unmasked_at) if s is not None and s <= shown.step]
        with self.fig_feature.batch_update():
            hm = self.fig_feature.data[0]
            hm.z, hm.x, hm.y = finite_rows(z), x, list(range(len(frames)))
            hm.zmax = max(float(np.nanmax(act)) if act.size else 0.0, 1e-6)
            hm.hovertemplate = "position %{x}<br>step %{y}<br>activation %{z:.3g}<extra></extra>"
            marks = self.fig_feature.data[1]
            marks.x, marks.y = [x[p] for p, _ in done], [s for _, s in done]
            self.fig_feature.layout.title = (f"feature {feature} over block {block}, steps 0..{shown.step} "
                                             f"(the block took {len(frames)})")
        dense = tl.dense(block, shown.step).numpy()  # [positions, d_sae]
        order = np.argsort(-dense.sum(0))[:self.top_n]
        order = [int(f) for f in order if dense[:, f].sum() > 0]
        masked = set(shown.masked)
        with self.fig_top.batch_update():
            hm = self.fig_top.data[0]
            hm.z = finite_rows(dense[:, order].T) if order else [[None]]
            hm.x = [f"{p}{' ·' if p in masked else ''}" for p in range(n)]
            hm.y = [f"f{f}" for f in order] or [""]
            hm.hovertemplate = "%{y} at position %{x}<br>activation %{z:.3g}<extra></extra>"
            self.fig_top.layout.title = f"most active features at block {block}, step {shown.step}"
        self._draw_relative(feature)
        self.caption.value = (f"{html.escape(tl.point)} · block {block}, step {shown.step}: {len(masked)} of {n} "
                              f"positions masked during this preview, {len(shown.unmasked)} unmasked by it · "
                              f"circles: the step that unmasked each position")

    def _draw_relative(self, feature: int) -> None:
        import plotly.graph_objects as go

        tl = self.timeline
        shown = [feature] + [f for f in self.choices if f != feature][:2]
        traces = []
        for j, f in enumerate(shown):
            rel = tl.relative(f)
            traces.append(go.Scatter(x=list(rel), y=[m for m, _ in rel.values()], mode="lines+markers",
                                     name=f"feature {f}" + (" (shown)" if f == feature else ""),
                                     line=dict(color=series_colour(j), width=3 if f == feature else 1.5)))
        with self.fig_rel.batch_update():
            self.fig_rel.data = []
            for t in traces:
                self.fig_rel.add_trace(t)
            self.fig_rel.layout.shapes = [dict(type="line", x0=0, x1=0, yref="paper", y0=0, y1=1,
                                               line=dict(color="#999", dash="dot"))]

    def _html_parts(self, state, frame):
        self._render(state, frame)
        return [figure_html(self.fig_feature), figure_html(self.fig_top), figure_html(self.fig_rel),
                self.caption.value]
