"""PatchingView: a patching sweep as a heatmap (``clover_lab.patching``): rows x columns of the
metric with one site patched per cell, normalised so that 1 means "restores the clean run" and 0
"changes nothing". One frame per row of the sweep, so a replay shows it fill in.

    sweep = patching.sweep_layers_positions(engine, clean, corrupt, metric, block=0, step=0)
    PatchingView(sweep, col_labels=patching_tokens)   # positions shown as their tokens

``col_labels``: one label per column (a position's token text, say), drawn on the axis and in the
hover instead of the bare column number.
"""
from __future__ import annotations

import html

import numpy as np

from clover_lab.widgets.base import View
from clover_lab.widgets.pieces import figure_html, finite_rows

BLANK_NOTE = ("blank: no reading (the metric's position was already unmasked at that step, or the run<br>"
              "did not take it: a preview has logits only where the block is still masked)")


class PatchingView(View):
    title = "Activation patching"

    def __init__(self, sweep=None, *, normalized: bool = True, col_labels=None, fps: float = 15.0):
        self.normalized = normalized
        self.col_labels = None if col_labels is None else [str(label) for label in col_labels]
        self._axes = None
        super().__init__(None, fps=fps)
        if sweep is not None:
            self.show_sweep(sweep)

    def hook_methods(self):
        return {}  # fed a finished sweep, not hooks

    def _build(self):
        import ipywidgets as W
        import plotly.graph_objects as go

        from clover_lab.widgets.figure import Figure

        self.fig = Figure(go.Heatmap(z=[[0.0]], colorscale="RdBu", zmid=0))
        self.fig.update_layout(height=400, width=640, margin=dict(l=60, r=10, t=40, b=100))  # room for the blank note
        self.caption = W.HTML()
        return W.VBox([self.fig, self.caption])

    def show_sweep(self, sweep) -> "PatchingView":
        """Show ``sweep`` (a ``patching.Sweep`` or its ``to_dict()``), one frame per row."""
        d = sweep.to_dict() if hasattr(sweep, "to_dict") else dict(sweep)
        if self.col_labels is not None and len(self.col_labels) != len(d["cols"]):
            raise ValueError(f"col_labels: {len(self.col_labels)} labels for the sweep's {len(d['cols'])} columns "
                             f"({d['col_name']}s)")
        with self._lock:
            self.frames.clear()
            self.frame_labels.clear()
            self._live = self._empty()
            self._axes = d
            values = np.asarray(d["values"], dtype=float)
            if self.normalized:
                clean = np.asarray(d.get("clean_rows") or [d["clean"]] * len(values), dtype=float)[:, None]
                corrupt = np.asarray(d.get("corrupt_rows") or [d["corrupt"]] * len(values), dtype=float)[:, None]
                with np.errstate(divide="ignore", invalid="ignore"):  # NaN where clean == corrupt
                    values = (values - corrupt) / (clean - corrupt)
            for i, row in enumerate(values):
                self._push(dict(row=i, values=row), None, f"{d['row_name']} {d['rows'][i]}")
        self.flush()
        return self

    def _empty(self):
        return {"rows": {}}

    def _apply_part(self, state, part):
        state["rows"][part["row"]] = part["values"]

    def matrix(self, state=None) -> np.ndarray:
        """The heatmap's values (NaN where a row is not filled yet)."""
        state = self._live if state is None else state
        d = self._axes
        if d is None:
            return np.zeros((0, 0))
        z = np.full((len(d["rows"]), len(d["cols"])), np.nan)
        for i, row in state["rows"].items():
            z[i] = row
        return z

    def _render(self, state, frame):
        d = self._axes
        if d is None:
            self.caption.value = "<span style='color:#888'>no sweep yet</span>"
            return
        z = self.matrix(state)
        with self.fig.batch_update():
            hm = self.fig.data[0]
            hm.z = finite_rows(z)
            # a label per column; plotly merges equal category names, so a label keeps its column's number
            hm.x = ([f"{c} {label}" for c, label in zip(d["cols"], self.col_labels)] if self.col_labels
                    else [str(c) for c in d["cols"]])
            hm.y = [str(r) for r in d["rows"]]
            if self.normalized:  # a share, 0 (changes nothing) to 1 (restores the clean run): a sequential
                # scale over at least [0, 1], wider where a patch overshoots either end
                finite = z[np.isfinite(z)]
                hm.colorscale, hm.zmid = "Viridis", None
                hm.zmin = min(0.0, float(finite.min())) if finite.size else 0.0
                hm.zmax = max(1.0, float(finite.max())) if finite.size else 1.0
            else:  # a signed metric: diverging around 0
                hm.colorscale, hm.zmin, hm.zmax, hm.zmid = "RdBu", None, None, 0
            self.fig.layout.xaxis.title = d["col_name"]
            self.fig.layout.yaxis.title = d["row_name"]
            self.fig.layout.title = ("restored share of " if self.normalized else "") + d["metric"]
        blank = int(np.isnan(z).sum())
        # the blank cells said on the plot itself, under its axis: why there is no value there
        self.fig.layout.annotations = [dict(text=BLANK_NOTE, showarrow=False, xref="paper", yref="paper", x=0, y=-0.2,
                                            xanchor="left", yanchor="top", font=dict(size=10, color="#666"))
                                       ] if blank else []
        self.caption.value = (f"{html.escape(d.get('title', ''))}<br>clean {d['clean']:.3f} · corrupted "
                              f"{d['corrupt']:.3f}" + (" · 1 = clean, 0 = corrupted" if self.normalized else "")
                              + (f"<br>{blank} blank cells (why: under the plot)" if blank else ""))

    def _html_parts(self, state, frame):
        self._render(state, frame)
        return [figure_html(self.fig), self.caption.value]
