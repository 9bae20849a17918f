"""MemoryView: the GDN layers' compressed memory.

Fed by ``layers.*.gdn.preview`` (the history weight p_tH of every block token and value head:
how much the token's output leans on the recurrent state rather than on the block) and
``layers.*.gdn.state`` (the state S after each commit). Shows p_tH as a (layer, head) x block
position heatmap for the shown denoising step, the Frobenius norm of each head's state as the
committed prefix grows, and the state matrix [d_k, d_v] of a chosen layer and head.
"""
from __future__ import annotations

import numpy as np
import torch

from clover_lab.hooks import points
from clover_lab.widgets.base import View
from clover_lab.widgets.pieces import LEGEND_BELOW, figure_html, series_colour, to_numpy
from clover_lab.widgets.throttle import weak_callback


class MemoryView(View):
    """History weights, state norms and state matrices of the GDN layers; live and replayable.

    State matrices are kept per commit (float16) up to ``max_state_bytes``; past that only their
    norms and the newest matrix are kept."""

    title = "Memory: GDN history weights and state"

    def __init__(self, engine=None, *, fps: float = 10.0, max_state_bytes: int = 64 * 2**20):
        self._dims = ((), 1, 1, 1)  # GDN layers, value heads, d_k, d_v
        self.max_state_bytes = max_state_bytes
        self._state_bytes = 0
        self._norm_traces = None
        super().__init__(engine, fps=fps)

    def hook_methods(self):
        return {points.every_layer(points.GDN_PREVIEW): "_on_preview", points.every_layer(points.GDN_STATE): "_on_state"}

    def _on_attach(self, engine):
        c = engine.model.config
        dims = (tuple(c.gdn_layers()), c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        if dims != self._dims:
            self._dims = dims
            self._new_run()
            layers = list(dims[0]) or [0]
            self.layer_dd.options = layers
            self.layer_dd.value = layers[0]
            self.head_dd.options = list(range(dims[1]))
            self.head_dd.value = 0

    def _new_run(self):
        super()._new_run()
        self._state_bytes = 0

    # ---------------------------------------------------------------- widgets
    def _build(self):
        import ipywidgets as W
        import plotly.graph_objects as go

        from clover_lab.widgets.figure import Figure

        self.layer_dd = W.Dropdown(options=[0], value=0, description="GDN layer", layout=W.Layout(width="200px"))
        self.head_dd = W.Dropdown(options=[0], value=0, description="head", layout=W.Layout(width="160px"))
        for w in (self.layer_dd, self.head_dd):
            w.observe(weak_callback(self, "redraw"), names="value")
        self.fig_hist = Figure(go.Heatmap(z=[[0]], zmin=0, zmax=1, colorscale="Cividis",
                                                   colorbar=dict(thickness=10, title=dict(text="p_tH", side="right"))))
        self.fig_hist.update_layout(title="history weight p_tH", height=400, width=540,
                                    margin=dict(l=70, r=10, t=40, b=40), xaxis_title="block position",
                                    yaxis_title="GDN layer (L) · head (h)")
        self.fig_norm = Figure()
        self.fig_norm.update_layout(title="state norm ||S|| per head", height=400, width=430,
                                    margin=dict(l=50, r=10, t=40, b=40), xaxis_title="committed length",
                                    yaxis_title="Frobenius norm", legend=LEGEND_BELOW)
        self.fig_state = Figure(go.Heatmap(z=[[0]], colorscale="RdBu", zmid=0, colorbar=dict(thickness=10)))
        self.fig_state.update_layout(title="state matrix", height=360, width=420, margin=dict(l=50, r=10, t=40, b=40),
                                     xaxis_title="d_v", yaxis_title="d_k")
        self.mean_html = W.HTML()
        return W.VBox([W.HBox([self.fig_hist, self.fig_norm]),
                       W.HBox([W.VBox([W.HBox([self.layer_dd, self.head_dd]), self.fig_state]), self.mean_html])])

    # ---------------------------------------------------------------- events
    @staticmethod
    def _key_label(ev):
        """Events of one forward share a frame; a preview's label leaves out a fused commit."""
        w = ev.where
        if w.phase != "prefill" and w.step is not None:
            return w, f"block {w.block} · step {w.step}"
        return w, w.label()

    def _on_preview(self, ev) -> None:
        w = ev.where
        key, label = self._key_label(ev)
        hw = to_numpy(ev.history_weights[0])  # [m, H_v]
        self._push(dict(kind="preview", layer=ev.layer, block=w.block, step=w.step, hw=hw,
                        positions=to_numpy(ev.positions).astype(np.int64)), key, label)

    def _on_state(self, ev) -> None:
        key, label = self._key_label(ev)
        S = ev.state[0].detach()  # [H_v, d_k, d_v]
        norms = to_numpy(S.float().flatten(1).norm(dim=1))
        matrix = S.to("cpu", dtype=torch.float16).numpy()
        keep = self._state_bytes + matrix.nbytes <= self.max_state_bytes
        if keep:
            self._state_bytes += matrix.nbytes
        self._latest_matrix = (ev.layer, ev.length, matrix)
        self._push(dict(kind="state", layer=ev.layer, length=int(ev.length), norms=norms,
                        matrix=matrix if keep else None, phase=ev.where.phase), key, label)

    # ---------------------------------------------------------------- state
    def _empty(self):
        return {"hist": {}, "norms": [], "matrix": {}, "mean_hist": []}

    def _apply_part(self, s, part):
        if part["kind"] == "preview":
            s["hist"][part["layer"]] = (part["block"], part["step"], part["positions"], part["hw"])
            s["mean_hist"].append((part["block"], part["step"], part["layer"], float(part["hw"].mean())))
        else:
            s["norms"].append((part["length"], part["layer"], part["norms"]))
            if part["matrix"] is not None:
                s["matrix"][part["layer"]] = (part["length"], part["matrix"])

    # ---------------------------------------------------------------- reading
    def history_weights(self, state=None) -> dict[int, np.ndarray]:
        """GDN layer -> p_tH [m, H_v] of the newest preview shown."""
        s = state or self._live
        return {layer: v[3] for layer, v in s["hist"].items()}

    def state_norms(self, layer: int, state=None) -> tuple[list[int], np.ndarray]:
        """(committed lengths, norms [n, H_v]) of one GDN layer."""
        s = state or self._live
        rows = [(n, v) for n, l, v in s["norms"] if l == layer]
        return [n for n, _ in rows], (np.stack([v for _, v in rows]) if rows else np.zeros((0, self._dims[1])))

    # ---------------------------------------------------------------- drawing
    def _render(self, s, frame):
        layers, H = self._dims[0], self._dims[1]
        rows, z, block_step = [], [], None
        width = max((v[3].shape[0] for v in s["hist"].values()), default=1)
        for layer in layers:
            v = s["hist"].get(layer)
            for h in range(H):
                rows.append(f"L{layer} h{h}")
                if v is None:
                    z.append([None] * width)
                else:
                    col = v[3][:, h].tolist()
                    z.append(col + [None] * (width - len(col)))
                    block_step = (v[0], v[1])
        with self.fig_hist.batch_update():
            self.fig_hist.data[0].z = z or [[0]]
            self.fig_hist.data[0].y = rows
            self.fig_hist.data[0].x = list(range(width))
            self.fig_hist.layout.title.text = ("history weight p_tH" + (f" · block {block_step[0]} step {block_step[1]}"
                                                                        if block_step else " (no preview yet)"))
        self._render_norms(s)
        layer, head = self.layer_dd.value, self.head_dd.value
        mat = s["matrix"].get(layer)
        if mat is None and getattr(self, "_latest_matrix", None) is not None and self._latest_matrix[0] == layer \
                and self._follow:
            mat = self._latest_matrix[1:]
        with self.fig_state.batch_update():
            if mat is not None and head < mat[1].shape[0]:
                self.fig_state.data[0].z = mat[1][head].astype(np.float32).tolist()
                self.fig_state.layout.title.text = f"state S, layer {layer} head {head} (length {mat[0]})"
            else:
                self.fig_state.data[0].z = [[0]]
                self.fig_state.layout.title.text = f"state S, layer {layer} head {head} (no commit yet)"
        if s["mean_hist"]:
            last = {}
            for b, st, l, m in s["mean_hist"]:
                last[l] = (b, st, m)
            items = "".join(f"<li>layer {l}: {m:.3f} (block {b}, step {st})</li>" for l, (b, st, m) in sorted(last.items()))
            self.mean_html.value = (f"<div style='font-size:11px;margin-left:12px'><b>mean history weight</b> "
                                    f"(newest preview per layer)<ul>{items}</ul></div>")
        else:
            self.mean_html.value = ""

    def _render_norms(self, s):
        import plotly.graph_objects as go

        layers, H = self._dims[0], self._dims[1]
        per_head = len(layers) * H <= 16
        series = []
        for layer in layers:
            lengths, norms = self.state_norms(layer, s)
            if per_head:
                for h in range(H):
                    series.append((f"L{layer} h{h}", lengths, norms[:, h].tolist() if len(lengths) else []))
            elif layer == self.layer_dd.value:
                for h in range(H):
                    series.append((f"L{layer} h{h}", lengths, norms[:, h].tolist() if len(lengths) else []))
            else:
                series.append((f"L{layer} mean", lengths, norms.mean(1).tolist() if len(lengths) else []))
        names = [n for n, _, _ in series]
        with self.fig_norm.batch_update():
            if self._norm_traces != names:
                self.fig_norm.data = []
                self.fig_norm.add_traces([go.Scatter(name=n, mode="lines+markers", marker=dict(size=4),
                                                     line=dict(color=series_colour(i)))
                                          for i, n in enumerate(names)])
                self._norm_traces = names
            for trace, (_, x, y) in zip(self.fig_norm.data, series):
                trace.x, trace.y = x, y

    def _html_parts(self, s, frame):
        self._render(s, frame)
        return ["<div style='display:flex;flex-wrap:wrap;gap:8px'>", figure_html(self.fig_hist),
                figure_html(self.fig_norm), figure_html(self.fig_state), "</div>", self.mean_html.value]
