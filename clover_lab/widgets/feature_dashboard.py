"""FeatureDashboardView: one feature's dashboard (``clover_lab.features.dashboard``) drawn: its
density and where it fires most, the histogram of its activations, its mean activation and
density per denoising step, the tokens its decoder row raises and lowers most, and its top
activating contexts with their block, step, position, masked or not, and the step that unmasked
the position.

    dash = features.dashboard(acts, sae, 117, engine=engine)
    FeatureDashboardView(dash)                   # or FeatureDashboardView([dash1, dash2]): a dropdown
"""
from __future__ import annotations

import html

from clover_lab.errors import InputError
from clover_lab.features.profile import FeatureDashboard
from clover_lab.widgets.base import View
from clover_lab.widgets.pieces import figure_html, visible
from clover_lab.widgets.throttle import weak_callback


class FeatureDashboardView(View):
    title = "Feature dashboard"

    def __init__(self, dashboards: FeatureDashboard | list[FeatureDashboard] | None = None, *, fps: float = 15.0):
        self.dashboards: list[FeatureDashboard] = []
        super().__init__(None, fps=fps)
        if dashboards is not None:
            self.show_dashboards(dashboards)

    def hook_methods(self):
        return {}  # fed finished dashboards, not hooks

    # ---------------------------------------------------------------- widgets
    def _build(self):
        import ipywidgets as W
        import plotly.graph_objects as go

        from clover_lab.widgets.figure import Figure

        self.feature_dd = W.Dropdown(options=[("(none)", -1)], value=-1, description="feature",
                                     layout=W.Layout(width="260px"))
        self.feature_dd.observe(weak_callback(self, "_redraw_now"), names="value")
        self.head = W.HTML()
        self.fig_hist = Figure(go.Bar(x=[], y=[], marker_color="#1f77b4", name="rows"))
        self.fig_hist.update_layout(height=300, width=460, margin=dict(l=60, r=10, t=40, b=50), showlegend=False,
                                    title="activations where it fires", xaxis_title="activation",
                                    yaxis_title="preview rows", bargap=0.05)
        self.fig_step = Figure([go.Scatter(x=[], y=[], mode="lines+markers", name="mean activation",
                                           line=dict(color="#d62728")),
                                go.Scatter(x=[], y=[], mode="lines+markers", name="density", yaxis="y2",
                                           line=dict(color="#7f7f7f", dash="dot"))])
        self.fig_step.update_layout(height=300, width=460, margin=dict(l=60, r=60, t=40, b=50),
                                    title="per denoising step", xaxis_title="denoising step",
                                    yaxis=dict(title="mean activation", rangemode="tozero"),
                                    yaxis2=dict(title="density", overlaying="y", side="right", rangemode="tozero",
                                                tickformat=".0%"),
                                    legend=dict(orientation="h", x=0, y=-0.3, font=dict(size=9)))
        self.fig_logits = Figure([go.Bar(x=[], y=[], orientation="h", marker_color="#2ca02c", name="raises"),
                                  go.Bar(x=[], y=[], orientation="h", marker_color="#d62728", name="lowers")])
        self.fig_logits.update_layout(height=360, width=920, margin=dict(l=120, r=10, t=40, b=50),
                                      title="logit effect: decoder row x unembedding (final norm's gain folded in)",
                                      xaxis_title="logit per unit of activation", showlegend=False,
                                      grid=dict(rows=1, columns=2))
        self.contexts = W.HTML()
        return W.VBox([self.feature_dd, self.head, W.HBox([self.fig_hist, self.fig_step]), self.fig_logits,
                       self.contexts])

    def _redraw_now(self, _change=None):
        if self.dashboards:
            self._render(self._live, 0)

    # ---------------------------------------------------------------- data
    def show_dashboards(self, dashboards) -> "FeatureDashboardView":
        """Show one dashboard, or several behind the dropdown."""
        dashboards = [dashboards] if isinstance(dashboards, FeatureDashboard) else list(dashboards)
        bad = [type(d).__name__ for d in dashboards if not isinstance(d, FeatureDashboard)]
        if bad or not dashboards:
            raise InputError(f"FeatureDashboardView shows FeatureDashboards (features.dashboard), got "
                             f"{', '.join(bad) or 'none'}")
        with self._lock:
            self.dashboards = dashboards
            self.frames.clear()
            self.frame_labels.clear()
            self._live = self._empty()
            self.feature_dd.options = [(f"feature {d.feature}", i) for i, d in enumerate(dashboards)]
            self.feature_dd.value = 0
            self._push(dict(shown=True), None, "dashboard")
        self.flush()
        return self

    def _empty(self):
        return {"shown": False}

    def _apply_part(self, state, part):
        state["shown"] = part["shown"]

    # ---------------------------------------------------------------- drawing
    def _render(self, state, frame):
        if not self.dashboards or self.feature_dd.value is None or self.feature_dd.value < 0:
            self.head.value = "<span style='color:#888'>no dashboard yet</span>"
            return
        d = self.dashboards[int(self.feature_dd.value)]
        self.head.value = f"<div style='margin:4px 0'>{html.escape(d.summary())}</div>"
        counts, edges = d.histogram
        with self.fig_hist.batch_update():
            bar = self.fig_hist.data[0]
            bar.x = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
            bar.y = counts
            bar.hovertemplate = "activation about %{x:.3g}<br>%{y} rows<extra></extra>"
        steps = sorted(d.by_step)
        with self.fig_step.batch_update():
            self.fig_step.data[0].x, self.fig_step.data[0].y = steps, [d.by_step[s][0] for s in steps]
            self.fig_step.data[1].x, self.fig_step.data[1].y = steps, [d.by_step[s][1] for s in steps]
        with self.fig_logits.batch_update():
            up, down = self.fig_logits.data
            up.x, up.y = [v for _, _, v in d.logit_top][::-1], [self._token_label(t, p) for t, p, _ in d.logit_top][::-1]
            down.x, down.y = ([v for _, _, v in d.logit_bottom][::-1],
                              [self._token_label(t, p) for t, p, _ in d.logit_bottom][::-1])
            up.xaxis, up.yaxis, down.xaxis, down.yaxis = "x", "y", "x2", "y2"
            self.fig_logits.layout.xaxis2 = dict(title="logit per unit of activation", anchor="y2")
            self.fig_logits.layout.yaxis2 = dict(anchor="x2")
            self.fig_logits.layout.annotations = [] if d.logit_top else [dict(
                text="no logit effect: build the dashboard with engine=", x=0.5, y=0.5, xref="paper", yref="paper",
                showarrow=False)]
        self.contexts.value = self._table(d)

    @staticmethod
    def _token_label(token: int, piece: str) -> str:
        return f"{visible(piece, 12)} ({token})"

    def _table(self, d: FeatureDashboard) -> str:
        head = ("<tr><th>activation</th><th>block</th><th>step</th><th>position</th><th>at that step</th>"
                "<th>unmasked at step</th><th style='text-align:left'>context (the position's final token "
                "highlighted)</th></tr>")
        rows = []
        for c in d.top:
            state = "masked" if c.masked else "unmasked"
            unmask = "—" if c.unmask_step < 0 else str(c.unmask_step)
            text = (f"<span style='color:#666'>{html.escape(c.before[-80:])}</span>"
                    f"<b style='background:#fdd49e'>{html.escape(c.piece) or '∅'}</b>"
                    f"<span style='color:#666'>{html.escape(c.after[:80])}</span>")
            rows.append(f"<tr><td>{c.activation:.3g}</td><td>{c.block}</td><td>{c.step}</td><td>{c.position}</td>"
                        f"<td>{state}</td><td>{unmask}</td><td style='text-align:left;white-space:pre-wrap;"
                        f"font-family:monospace'>{text}</td></tr>")
        if not rows:
            rows.append("<tr><td colspan='7'>the feature never fires on these rows</td></tr>")
        return ("<table style='border-collapse:collapse;font-size:12px' border='1' cellpadding='3'>"
                f"<caption style='text-align:left'>top activating contexts (one per generated position, at its "
                f"strongest step)</caption>{head}{''.join(rows)}</table>")

    def _html_parts(self, state, frame):
        self._render(state, frame)
        return [self.head.value, figure_html(self.fig_hist), figure_html(self.fig_step), figure_html(self.fig_logits),
                self.contexts.value]
