"""ProbeView: a probe map (``attribution.probe_map``) as two heatmaps over layer x step, the
held-out balanced accuracy of the probes and of their shuffled-label control, each as its gain
over chance (a constant guess's, 1 / the labels present): 0 = no better than guessing."""
from __future__ import annotations

import html

import numpy as np

from clover_lab.widgets.base import View
from clover_lab.widgets.pieces import figure_html, finite_rows


class ProbeView(View):
    title = "Linear probes over (layer, step)"

    def __init__(self, probe_map=None, *, fps: float = 15.0):
        super().__init__(None, fps=fps)
        if probe_map is not None:
            self.show(probe_map)

    def hook_methods(self):
        return {}  # fed a finished probe map

    def _build(self):
        import ipywidgets as W
        import plotly.graph_objects as go

        from clover_lab.widgets.figure import Figure

        self.figs = []
        for _ in ("probe", "control"):
            fig = Figure(go.Heatmap(z=[[0.0]], colorscale="RdBu", zmid=0, zmin=-0.5, zmax=0.5,
                                    colorbar=dict(title="over chance")))
            fig.update_layout(height=300, width=760, margin=dict(l=60, r=10, t=40, b=50))
            self.figs.append(fig)
        self.caption = W.HTML()
        return W.VBox([*self.figs, self.caption])

    def show(self, probe_map) -> "ProbeView":
        d = probe_map.to_dict() if hasattr(probe_map, "to_dict") else dict(probe_map)
        with self._lock:
            self.frames.clear()
            self.frame_labels.clear()
            self._live = self._empty()
            self._push(d, None, d.get("label", ""))
        self.flush()
        return self

    def _empty(self):
        return {"map": None}

    def _apply_part(self, state, part):
        state["map"] = part

    def _render(self, state, frame):
        d = state["map"]
        if d is None:
            self.caption.value = "<span style='color:#888'>no probe map yet</span>"
            return
        chance = np.asarray(d["chance"], dtype=float)[None]
        for fig, key, what in zip(self.figs, ("accuracy", "control"), ("probes", "control (shuffled labels)")):
            z = np.asarray(d[key], dtype=float) - chance
            with fig.batch_update():
                hm = fig.data[0]
                hm.z = finite_rows(z)
                hm.x = [str(s) for s in d["steps"]]
                hm.y = [str(i) for i in d["layers"]]
                fig.layout.xaxis.title = "denoising step"
                fig.layout.yaxis.title = "layer"
                fig.layout.title = f"{what}: balanced accuracy over chance, held out · {d.get('label', '')}"
        acc, ctl = np.asarray(d["accuracy"], dtype=float), np.asarray(d["control"], dtype=float)
        gain, cgain = acc - chance, ctl - chance
        if np.isfinite(gain).any():
            r, c = np.unravel_index(np.nanargmax(gain), gain.shape)
            best = (f"best: layer {d['layers'][r]}, step {d['steps'][c]}: {acc[r, c]:.0%} held out against "
                    f"{chance[0, c]:.0%} chance; the control's largest gain over chance {np.nanmax(cgain):+.0%}")
        else:
            best = "no step had enough rows of both labels to probe"
        self.caption.value = html.escape(best) + "<br>blank: a step with too few held-out rows, or one label only"

    def _html_parts(self, state, frame):
        self._render(state, frame)
        return [figure_html(f) for f in self.figs] + [self.caption.value]
