"""AttentionView: what the token mixers read at each denoising step, one frame per (block, step).

Top: one gated-attention layer's pattern, every head stacked (rows: head x block position, columns:
the key positions, the committed prefix then the block; a dotted line where the block starts).
Bottom: every GDN layer's history weight per value head at each block position (how much that
head's preview output comes from the committed prefix's compressed state rather than the block).

    pats = attribution.attention_patterns(engine, prompt, block=0, **kw)
    hist = attribution.history_weights(engine, prompt, **kw)
    AttentionView(pats, hist, layer=3, labels=token_texts)   # labels: one per position
"""
from __future__ import annotations

import html

import numpy as np

from clover_lab.widgets.base import View
from clover_lab.widgets.pieces import figure_html, finite_rows


class AttentionView(View):
    title = "Attention patterns and GDN history weights"

    def __init__(self, patterns=None, history=None, *, layer: int | None = None, labels=None, fps: float = 15.0):
        self.layer = layer
        self.labels = None if labels is None else [str(x) for x in labels]
        super().__init__(None, fps=fps)
        if patterns is not None:
            self.show(patterns, history or {})

    def hook_methods(self):
        return {}  # fed finished patterns, not hooks

    def _build(self):
        import ipywidgets as W
        import plotly.graph_objects as go

        from clover_lab.widgets.figure import Figure

        self.fig = Figure(go.Heatmap(z=[[0.0]], colorscale="Blues", zmin=0, zmax=1, colorbar=dict(title="weight")))
        self.fig.update_layout(height=420, width=900, margin=dict(l=90, r=10, t=40, b=60))
        self.hist = Figure(go.Heatmap(z=[[0.0]], colorscale="Oranges", zmin=0, zmax=1,
                                      colorbar=dict(title="history")))
        self.hist.update_layout(height=260, width=900, margin=dict(l=90, r=10, t=40, b=60))
        self.caption = W.HTML()
        return W.VBox([self.fig, self.hist, self.caption])

    def _name(self, p: int) -> str:
        return f"{p} {self.labels[p]}" if self.labels is not None and p < len(self.labels) else str(p)

    def show(self, patterns: dict, history: dict) -> "AttentionView":
        """``patterns`` {(layer, block, step): AttentionPattern}, ``history`` {(layer, block, step):
        (positions, weights [m, H_v])}: one frame per (block, step)."""
        layers = sorted({k[0] for k in patterns})
        if not layers:
            raise ValueError("AttentionView: no attention patterns given")
        if self.layer is None:
            self.layer = layers[-1]
        if self.layer not in layers:
            raise ValueError(f"AttentionView layer={self.layer}: the patterns hold layers {layers}")
        with self._lock:
            self.frames.clear()
            self.frame_labels.clear()
            self._live = self._empty()
            for (layer, block, step), p in sorted((k, v) for k, v in patterns.items() if k[0] == self.layer):
                gdn = {k[0]: v for k, v in history.items() if (k[1], k[2]) == (block, step)}
                self._push(dict(pattern=p, history=gdn), None, f"block {block} · step {step}")
        self.flush()
        return self

    def _empty(self):
        return {"pattern": None, "history": {}}

    def _apply_part(self, state, part):
        state.update(part)

    def _render(self, state, frame):
        p = state["pattern"]
        if p is None:
            self.caption.value = "<span style='color:#888'>no patterns yet</span>"
            return
        H, m, K = p.weights.shape
        z = p.weights.reshape(H * m, K).numpy()
        rows = [f"h{h} · {self._name(q)}" for h in range(H) for q in p.queries]
        with self.fig.batch_update():
            hm = self.fig.data[0]
            hm.z = finite_rows(z)
            hm.x = [self._name(k) for k in p.keys]
            hm.y = rows
            self.fig.layout.yaxis.autorange = "reversed"
            self.fig.layout.title = f"layer {p.layer} (gated attention) · block {p.block}, step {p.step}"
            self.fig.layout.xaxis.title = "key position (committed prefix, then the block)"
            start = p.keys.index(p.queries[0]) - 0.5
            self.fig.layout.shapes = [dict(type="line", x0=start, x1=start, y0=0, y1=1, yref="paper", xref="x",
                                           line=dict(dash="dot", color="#444", width=1))]
        hist = state["history"]
        if hist:
            layers = sorted(hist)
            positions = hist[layers[0]][0]
            hz = np.concatenate([hist[i][1].numpy().T for i in layers])  # [layers * H_v, m]
            with self.hist.batch_update():
                h = self.hist.data[0]
                h.z = finite_rows(hz)
                h.x = [self._name(q) for q in positions]
                h.y = [f"layer {i} · v{j}" for i in layers for j in range(hist[i][1].shape[1])]
                self.hist.layout.yaxis.autorange = "reversed"
                self.hist.layout.title = "GDN history weight per value head (1: all from the committed prefix)"
        share = p.prefix_share().mean().item()
        self.caption.value = html.escape(
            f"block {p.block}, step {p.step}: {m} block rows read {K} keys; on average "
            f"{share:.0%} of layer {p.layer}'s attention goes to the committed prefix"
            + ("; positions are labelled with their final tokens (still masked at this step where not yet "
               "unmasked)" if self.labels is not None else ""))

    def _html_parts(self, state, frame):
        self._render(state, frame)
        return [figure_html(self.fig), figure_html(self.hist), self.caption.value]
