"""ExpertView: which experts the router picks, layer by layer.

Fed by ``layers.*.moe.route`` (one frame per forward) and ``block.commit`` (to name the response
tokens). Shows a layer x expert heatmap of usage (top-k counts or router probability mass) for
previews, commits or the prompt prefill; the top-k experts and weights of a selected token in
every layer; load statistics per layer (normalised entropy, max/mean load, distinct experts per
forward); and the co-activation of expert pairs in a chosen layer.

Two routings of the same run: *used* (``routing="actual"``), the experts each forward computed
with, after the coreset and after every hook's ``ban`` / ``force`` (the view's hooks are observers:
they read after the hooks that intervene, whatever the order of attaching); and the *router's
proposal* (``routing="without coreset"``), the router's own top-k over all experts before any
restriction.
"""
from __future__ import annotations

import html

import numpy as np

from clover_lab.hooks import points
from clover_lab.widgets.base import View
from clover_lab.widgets.pieces import figure_html, to_numpy, token_piece, visible
from clover_lab.widgets.throttle import weak_callback

PHASES = ("preview", "commit", "prefill")
# routing -> what the controls and tables call it
# routing -> (its button's label, short enough to fit; what it means, on hover)
ROUTINGS = {"actual": ("used", "the experts the forwards computed with: after the coreset, bans and forcing"),
            "without coreset": ("router's proposal", "the router's own top-k over all experts, before any restriction")}


class ExpertView(View):
    """Expert usage, per-token routing, load and co-activation; live and replayable per forward."""

    title = "Experts: MoE routing"

    def __init__(self, engine=None, *, fps: float = 10.0, phase: str = "preview", metric: str = "counts"):
        if phase not in PHASES + ("all",):
            raise ValueError(f"phase={phase!r}: expected one of {', '.join(PHASES + ('all',))}")
        if metric not in ("counts", "router mass"):
            raise ValueError(f"metric={metric!r}: expected 'counts' or 'router mass'")
        self._dims = (1, 1, 1)  # layers, experts, top-k
        self._phase, self._metric = phase, metric
        self._pieces: dict[int, str] = {}
        self._prompt: list[int] | None = None  # the run's prompt ids (Engine.prompt_of), to name its tokens
        super().__init__(engine, fps=fps)

    @classmethod
    def from_stats(cls, stats, **kwargs) -> "ExpertView":
        """A view of routing statistics over a corpus: a ``RouteStats`` or the ``.npz`` that
        ``clover_lab.lens.routing_stats`` / ``clover-lab routes`` saved. Usage, router mass, load and
        co-activation show the whole corpus in one frame (no per-token routing)."""
        from clover_lab.lens.routing_stats import RouteStats

        if not isinstance(stats, RouteStats):
            stats = RouteStats.load(stats)
        view = cls(phase=stats.mode, **kwargs)
        view._dims = (stats.num_layers, stats.num_experts, stats.top_k)
        view._new_run()
        view._setup_controls()
        view._push(dict(kind="corpus", phase=stats.mode, counts=stats.counts.astype(float), mass=stats.mass,
                        coactivation=stats.coactivation.astype(float), tokens=stats.tokens),
                   None, f"corpus: {stats.tokens} tokens ({stats.mode})")
        view.flush()
        return view

    def hook_methods(self):
        return {points.every_layer(points.MOE_ROUTE): "_on_route", points.BLOCK_COMMIT: "_on_commit"}

    def _new_run(self):
        super()._new_run()
        self._prompt = None

    def _on_attach(self, engine):
        c = engine.model.config
        dims = (c.num_hidden_layers, c.num_experts, c.num_experts_per_tok)
        if dims != self._dims:
            self._dims = dims
            self._new_run()
            self._setup_controls()

    # ---------------------------------------------------------------- widgets
    def _build(self):
        import ipywidgets as W
        import plotly.graph_objects as go

        from clover_lab.widgets.figure import Figure

        self.phase_dd = W.Dropdown(options=list(PHASES) + ["all"], value=self._phase, description="forwards",
                                   layout=W.Layout(width="200px"))
        self.metric_dd = W.Dropdown(options=["counts", "router mass"], value=self._metric, description="metric",
                                    layout=W.Layout(width="220px"))
        self.routing_tb = W.ToggleButtons(options=[(label, key) for key, (label, _) in ROUTINGS.items()],
                                          tooltips=[why for _, why in ROUTINGS.values()], value="actual",
                                          style={"button_width": "140px"})
        self.token_dd = W.Dropdown(options=[("(none yet)", -1)], value=-1, description="token",
                                   layout=W.Layout(width="300px"))
        self.layer_dd = W.Dropdown(options=[0], value=0, description="co-act layer", layout=W.Layout(width="200px"))
        for w in (self.phase_dd, self.metric_dd, self.routing_tb, self.layer_dd):
            w.observe(weak_callback(self, "redraw"), names="value")
        self._token_pinned = False  # the user picked a token: keep it across redraws
        self.token_dd.observe(weak_callback(self, "_on_token"), names="value")
        self.fig_usage = Figure(go.Heatmap(z=[[0]], colorscale="Viridis", colorbar=dict(thickness=10)))
        # right margins hold each colorbar's tick labels (a count of 150 was cut to "15")
        self.fig_usage.update_layout(title="expert usage", height=300, width=500, margin=dict(l=60, r=50, t=40, b=40),
                                     xaxis_title="expert", yaxis_title="layer")
        self.fig_token = Figure(go.Heatmap(z=[[0]], colorscale="Blues", zmin=0, zmax=1,
                                                    colorbar=dict(thickness=10)))
        self.fig_token.update_layout(title="top-k of the selected token", height=300, width=440,
                                     margin=dict(l=60, r=40, t=40, b=40), xaxis_title="expert", yaxis_title="layer")
        self.fig_coact = Figure(go.Heatmap(z=[[0]], colorscale="Magma", colorbar=dict(thickness=10)))
        self.fig_coact.update_layout(title="co-activation", height=320, width=400, margin=dict(l=50, r=60, t=40, b=40),
                                     xaxis_title="expert", yaxis_title="expert")
        self.stats_html = W.HTML(layout=W.Layout(width="520px"))
        return W.VBox([
            # the toggle's label beside it (a ToggleButtons' own description wrapped above its buttons in a row)
            W.HBox([self.phase_dd, self.metric_dd, W.Label("routing", layout=W.Layout(margin="0 4px 0 16px")),
                    self.routing_tb], layout=W.Layout(align_items="center")),
            # each row fits ~960 px (a figure squeezed by its row lost its colorbar's labels); narrower, it wraps
            W.HBox([self.fig_usage, W.VBox([self.token_dd, self.fig_token])], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([W.VBox([self.layer_dd, self.fig_coact]), self.stats_html], layout=W.Layout(flex_flow="row wrap")),
        ])

    def _on_token(self, change) -> None:
        if not self._drawing:
            self._token_pinned = True
            self.redraw()

    def _setup_controls(self):
        L = self._dims[0]
        self.layer_dd.options = list(range(L))

    # ---------------------------------------------------------------- events
    def _on_route(self, ev) -> None:
        w = ev.where
        phase = "prefill" if w.phase == "prefill" else ev.mode
        ids = to_numpy(ev.expert_ids).astype(np.int64)
        # the router's proposal: its top-k over all experts, before the coreset, bans or forcing
        k = self._dims[2] if self._dims != (1, 1, 1) else ids.shape[-1]  # a forced route may use another k
        full = to_numpy(ev.router_probs.topk(k, dim=-1).indices).astype(np.int64)
        part = dict(kind="route", layer=ev.layer, phase=phase, ids=ids, weights=to_numpy(ev.weights),
                    mass=to_numpy(ev.router_probs.sum(0)), full=full, positions=to_numpy(ev.positions).astype(np.int64))
        positions = part["positions"]
        if phase == "prefill" and self._prompt is None:
            self._prompt = self.prompt_of(w)  # the row this view watches (its event narrowed to it)
        prompt = self._prompt
        if phase == "prefill" and prompt is not None and positions.size and int(positions.max()) < len(prompt):
            part["names"] = {int(p): prompt[int(p)] for p in positions.tolist()}  # the prompt's tokens, by text
        key, label = w, w.label()
        # one forward per frame (a fused commit+preview routes its commit rows and its preview rows in
        # one forward, two events under one key); the prefill is not counted, as the engine's stats
        part["forward"] = phase != "prefill" and (key != self._frame_key or not self.frames)
        self._push(part, key, label)

    def _on_commit(self, ev) -> None:
        self._push(dict(kind="tokens", start=ev.start, tokens=list(ev.tokens)), self._frame_key)

    # ---------------------------------------------------------------- state
    def _empty(self):
        L, E, _ = self._dims
        z = lambda: {p: np.zeros((L, E)) for p in PHASES}  # noqa: E731
        return {"counts": z(), "mass": z(), "full": z(), "tokens_routed": {p: np.zeros(L) for p in PHASES},
                "distinct": [], "routes": {}, "names": {}, "first_response": None, "forwards": 0}

    def _apply_part(self, s, part):
        if part["kind"] == "corpus":  # routing statistics of a corpus (from_stats)
            for key in ("counts", "full"):
                s[key][part["phase"]] += part["counts"]
            s["mass"][part["phase"]] += part["mass"]
            s["tokens_routed"][part["phase"]] += part["tokens"]
            return
        if part["kind"] == "tokens":
            for i, t in enumerate(part["tokens"]):
                s["names"][part["start"] + i] = t
            if s["first_response"] is None:
                s["first_response"] = part["start"]
            return
        L, E, _ = self._dims
        layer, phase, ids = part["layer"], part["phase"], part["ids"]
        if layer >= L or ids.size and ids.max() >= E:  # dims unknown (view made without an engine)
            return
        s["counts"][phase][layer] += np.bincount(ids.reshape(-1), minlength=E)[:E]
        s["mass"][phase][layer] += part["mass"][:E]
        full = part["full"] if part["full"] is not None else ids
        s["full"][phase][layer] += np.bincount(full.reshape(-1), minlength=E)[:E]
        s["tokens_routed"][phase][layer] += ids.shape[0]
        s["distinct"].append((phase, layer, len(np.unique(ids)), len(np.unique(full))))
        s["names"].update(part.get("names") or {})
        if phase != "preview":  # the routing of a committed token (prompt or response)
            for pos, i, w in zip(part["positions"].tolist(), ids, part["weights"]):
                s["routes"].setdefault(pos, {})[layer] = (i, w)
        if part.get("forward", layer == 0 and phase != "prefill"):  # parts kept before the flag: by layer 0
            s["forwards"] += 1

    # ---------------------------------------------------------------- reading
    def usage(self, phase: str = "preview", metric: str = "counts", routing: str = "actual", state=None) -> np.ndarray:
        """[layers, experts]: top-k counts or router mass summed over tokens of ``phase``
        ("preview", "commit", "prefill" or "all"). ``routing="actual"`` counts the experts the
        forwards used (after the coreset and the hooks' bans and forcing); ``"without coreset"``
        the router's proposal, its top-k over all experts."""
        if routing not in ROUTINGS:
            raise ValueError(f"routing={routing!r}: expected one of {', '.join(map(repr, ROUTINGS))}")
        s = state or self._live
        key = "mass" if metric == "router mass" else ("full" if routing == "without coreset" else "counts")
        phases = PHASES if phase == "all" else (phase,)
        return sum(s[key][p] for p in phases)

    def load_stats(self, phase: str = "preview", state=None) -> list[dict]:
        """Per layer: normalised entropy of the expert load (1 = even), max/mean load, distinct
        experts per forward with the actual routing and without the coreset."""
        s = state or self._live
        L, E, _ = self._dims
        phases = PHASES if phase == "all" else (phase,)
        rows = []
        for layer in range(L):
            row = {"layer": layer}
            for routing, key in (("actual", "counts"), ("without coreset", "full")):
                c = sum(s[key][p][layer] for p in phases)
                total = c.sum()
                if total > 0:
                    q = c / total
                    ent = float(-(q[q > 0] * np.log(q[q > 0])).sum() / np.log(E)) if E > 1 else 1.0
                    row[f"entropy ({routing})"] = ent
                    row[f"max/mean ({routing})"] = float(c.max() / c.mean())
                else:
                    row[f"entropy ({routing})"] = row[f"max/mean ({routing})"] = float("nan")
            d = [(a, f) for ph, l, a, f in s["distinct"] if l == layer and ph in phases]
            row["distinct/forward (actual)"] = float(np.mean([a for a, _ in d])) if d else float("nan")
            row["distinct/forward (without coreset)"] = float(np.mean([f for _, f in d])) if d else float("nan")
            rows.append(row)
        return rows

    def coactivation(self, layer: int, phase: str = "preview", routing: str = "actual", frame: int | None = None):
        """[E, E]: how often experts i and j are in the same token's top-k (diagonal: counts)."""
        E = self._dims[1]
        phases = PHASES if phase == "all" else (phase,)
        m = np.zeros((E, E))
        frames = self.frames if frame is None or frame < 0 else self.frames[:frame + 1]
        for parts in frames:
            for part in parts:
                if part["kind"] == "corpus" and part["phase"] in phases:
                    m += part["coactivation"][layer]
                elif part["kind"] == "route" and part["layer"] == layer and part["phase"] in phases:
                    ids = part["full"] if routing == "without coreset" and part["full"] is not None else part["ids"]
                    onehot = np.zeros((ids.shape[0], E))
                    np.put_along_axis(onehot, ids, 1.0, axis=1)
                    m += onehot.T @ onehot
        return m

    def token_routing(self, position: int, state=None) -> np.ndarray:
        """[layers, experts]: the weights the committed token at ``position`` gave its top-k."""
        s = state or self._live
        L, E, _ = self._dims
        z = np.zeros((L, E))
        for layer, (ids, w) in s["routes"].get(position, {}).items():
            z[layer, ids] = w
        return z

    # ---------------------------------------------------------------- drawing
    def _token_name(self, s, pos: int) -> str:
        tok = s["names"].get(pos)
        first = s["first_response"]
        if tok is None:
            where = "prompt" if first is None or pos < first else "response"
            return f"{pos}: ({where})"
        tokenizer = self.token_source()
        return f"{pos}: {visible(token_piece(tokenizer, tok, self._pieces), 18)}"

    def _token_options(self, s):
        positions = sorted(s["routes"])
        first = s["first_response"]
        if first is not None:  # the response first: that is what one looks at
            positions = [p for p in positions if p >= first] + [p for p in positions if p < first]
        return [(self._token_name(s, p), p) for p in positions] or [("(none yet)", -1)]

    def _render(self, s, frame):
        phase, metric, routing = self.phase_dd.value, self.metric_dd.value, self.routing_tb.value
        L, E, _ = self._dims
        z = self.usage(phase, metric, routing, s)
        opts = self._token_options(s)
        # labels too: a block's routes can be drawn before its commit names its tokens ("(response)"),
        # and the names that come after must replace those labels
        if [tuple(o) for o in self.token_dd.options] != [tuple(o) for o in opts]:
            keep = self.token_dd.value
            self.token_dd.options = opts
            values = [o[1] for o in opts]
            self.token_dd.value = keep if self._token_pinned and keep in values else values[0]
        pos = self.token_dd.value
        layer = self.layer_dd.value if self.layer_dd.value is not None else 0
        coact = self.coactivation(layer, phase, routing, frame if not self._follow else None)
        with self.fig_usage.batch_update():
            self.fig_usage.data[0].z = z.tolist()
            self.fig_usage.data[0].x = list(range(E))
            self.fig_usage.data[0].y = list(range(L))
            self.fig_usage.layout.title.text = f"expert usage: {metric}, {phase} ({ROUTINGS[routing][0]})"
        with self.fig_token.batch_update():
            self.fig_token.data[0].z = self.token_routing(pos, s).tolist() if pos >= 0 else [[0] * E] * L
            self.fig_token.data[0].x = list(range(E))
            self.fig_token.data[0].y = list(range(L))
            self.fig_token.layout.title.text = ("top-k weights of token " + html.escape(self._token_name(s, pos))
                                                if pos >= 0 else "top-k of the selected token")
        with self.fig_coact.batch_update():
            self.fig_coact.data[0].z = coact.tolist()
            self.fig_coact.data[0].x = list(range(E))
            self.fig_coact.data[0].y = list(range(E))
            self.fig_coact.layout.title.text = f"co-activation, layer {layer}"
        self.stats_html.value = self.stats_table(phase, s)

    def stats_table(self, phase: str, s) -> str:
        rows = self.load_stats(phase, s)
        if not rows:
            return ""
        cols = list(rows[0])
        short = lambda c: c.replace("(actual)", "(used)").replace("(without coreset)", "(proposal)")  # noqa: E731
        head = "".join(f"<th style='padding:2px 6px'>{html.escape(short(c))}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td style='padding:2px 6px;text-align:right'>"
                                        f"{r[c] if c == 'layer' else format(r[c], '.2f')}</td>" for c in cols) + "</tr>"
                       for r in rows)
        routed = int(sum(s["tokens_routed"][p].max() for p in (PHASES if phase == "all" else (phase,))))
        return (f"<div style='font-size:11px'><b>load per layer</b> ({phase}, {routed} token routings per layer, "
                f"{s['forwards']} forwards after the prefill)<table style='border-collapse:collapse;font-size:11px'>"
                f"<tr>{head}</tr>{body}</table></div>")

    def _html_parts(self, s, frame):
        self._render(s, frame)
        return ["<div style='display:flex;flex-wrap:wrap;gap:8px'>", figure_html(self.fig_usage),
                figure_html(self.fig_token), figure_html(self.fig_coact), "</div>", self.stats_table(self.phase_dd.value, s)]
