"""SpeedView: how fast a generation goes, and why.

Fed by ``block.commit``, which carries the row's forwards as the engine counts them (a forward
is one model pass after the prefill: a preview, a fused commit+preview, a commit alone; in AR
mode one token's commit; in speculative mode a draft preview or the causal check of a draft),
so its tokens per forward are the engine's; and by ``denoise.step`` for the time of each
preview step (the first step of every block after the first is fused with the commit of the
block before). Shows tokens/s and tokens per forward over time, steps per block, the time per
preview and per fused commit+preview step, and, across runs, block diffusion against AR on the
same prompt. Unlike the other views it keeps every run it saw (``clear()`` forgets them); a run's
``GenerationStats`` can be added with :meth:`add_result` (``compare`` does it), which brings the
engine's own preview/commit times.
"""
from __future__ import annotations

import html

from clover_lab.engine.requests import settings_for_mode
from clover_lab.hooks import points
from clover_lab.widgets.base import View
from clover_lab.widgets.pieces import LEGEND_BELOW, figure_html, series_colour
from clover_lab.widgets.throttle import weak_callback


FORWARD_NOTE = ("forwards: model passes after the prefill, as the engine counts them: block diffusion a "
                "preview each, a block's first one fused with the commit of the block before, a last block's "
                "commit alone; AR one per token; speculative a draft preview each and one causal check per "
                "draft. tokens/forward = new tokens / forwards; tokens/s = new tokens / seconds after the prefill.")


class SpeedView(View):
    """Throughput over time and across runs; live and replayable per event."""

    title = "Speed: tokens/s, tokens per forward, steps per block"

    def __init__(self, engine=None, *, fps: float = 10.0, max_runs: int = 8):
        self.max_runs = max_runs
        self._trace_runs = None
        self._compare_key = None  # what the comparison and the table show (redrawn when it changes)
        self._synthetic = 0
        super().__init__(engine, fps=fps)

    def hook_methods(self):
        return {points.DENOISE_STEP: "_on_step", points.BLOCK_COMMIT: "_on_commit"}

    def _new_run(self):  # keep earlier runs: they are what the comparison shows
        self._frame_key = object()
        self._follow = True

    def clear(self, *_) -> None:
        with self._lock:
            self.frames.clear()
            self.frame_labels.clear()
            self._live = self._empty()
            self._follow = True
            self._draw()

    # ---------------------------------------------------------------- widgets
    def _build(self):
        import ipywidgets as W
        from plotly.subplots import make_subplots

        from clover_lab.widgets.figure import Figure

        self.fig_rate = Figure(make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                                                      subplot_titles=("tokens/s (since the start)", "tokens per forward")))
        self.fig_rate.update_layout(height=430, width=540, margin=dict(l=50, r=10, t=40, b=40),
                                    legend=dict(LEGEND_BELOW, y=-0.18))
        self.fig_rate.update_xaxes(title_text="seconds", row=2, col=1)
        self.fig_blocks = Figure()
        self.fig_blocks.update_layout(title="steps per block", height=430, width=420, barmode="group",
                                      margin=dict(l=40, r=10, t=40, b=40), xaxis_title="block",
                                      legend=LEGEND_BELOW)
        self.fig_compare = Figure(make_subplots(rows=1, cols=3, horizontal_spacing=0.12,
                                                         subplot_titles=("tokens/s", "tokens per forward",
                                                                         "seconds per phase")))
        self.fig_compare.update_layout(height=360, width=960, barmode="stack", showlegend=True,
                                       margin=dict(l=40, r=10, t=50, b=40), legend=dict(LEGEND_BELOW, y=-0.45))
        self.table = W.HTML()
        self.clear_button = W.Button(description="forget runs", layout=W.Layout(width="110px"))
        self.clear_button.on_click(weak_callback(self, "clear"))
        return W.VBox([W.HBox([self.fig_rate, self.fig_blocks]), self.fig_compare, self.table, self.clear_button])

    # ---------------------------------------------------------------- events
    def _on_step(self, ev) -> None:
        self._push(dict(kind="step", run=self.run, block=ev.block, step=ev.step, time=ev.time),
                   None, f"run {self.run} · block {ev.block} · step {ev.step} · {ev.time:.2f}s")

    def _on_commit(self, ev) -> None:
        self._push(dict(kind="commit", run=self.run, block=ev.block, tokens=len(ev.tokens), steps=ev.steps,
                        time=ev.time, forwards=getattr(ev, "forwards", None), drafted=getattr(ev, "drafted", None)),
                   None, f"run {self.run} · block {ev.block} committed · {ev.time:.2f}s")

    def add_result(self, result, label: str | None = None) -> None:
        """Attach a GenerationResult's stats to the run it came from (the newest one without
        stats), or add it as a run of its own."""
        st = result.stats
        with self._lock:
            runs = self._live["runs"]
            target = None
            for rid in reversed(list(runs)):
                r = runs[rid]
                if r["stats"] is None and (r["mode"] == st.mode or r["mode"] is None):
                    target = rid
                    break
            if target is None:
                self._synthetic -= 1
                target = self._synthetic
            self._push(dict(kind="result", run=target, stats=st.to_dict(), label=label), None,
                       f"run {target} · stats")
            self.flush()

    def compare(self, engine, prompt, *, max_new_tokens: int = 64, modes=("diffusion", "ar"), **sampler) -> dict:
        """Run ``prompt`` once per mode with this view attached; returns {mode: GenerationResult}."""
        was = self._attachment
        if was is None or was.engine is not engine:
            self.attach(engine)
        out = {}
        try:
            for mode in modes:
                res = engine.generate(prompt, mode=mode, max_new_tokens=max_new_tokens,
                                      **settings_for_mode(mode, sampler))
                self.add_result(res)
                out[mode] = res
        finally:
            if was is None:
                self.detach()
        return out

    # ---------------------------------------------------------------- state
    def _empty(self):
        return {"runs": {}}

    @staticmethod
    def _new(rid):
        return {"id": rid, "mode": None, "label": None, "t": [], "rate": [], "tpf": [], "committed": 0, "forwards": 0,
                "steps": 0, "steps_per_block": {}, "last": 0.0, "last_step": 0.0, "fused": [], "preview": [],
                "commit": [], "stats": None}

    def _apply_part(self, s, part):
        runs = s["runs"]
        rid = part["run"]
        r = runs.get(rid)
        if r is None:
            r = runs[rid] = self._new(rid)
            while len(runs) > self.max_runs:
                del runs[next(iter(runs))]
        kind = part["kind"]
        if kind == "result":
            r["stats"] = part["stats"]
            r["mode"] = part["stats"]["mode"]
            r["label"] = part["label"]
            return
        t = part["time"]
        if kind == "step":
            if r["mode"] is None:
                r["mode"] = "diffusion"  # until a commit says its block was a speculative draft
            r["steps"] += 1
            dt = t - r["last_step"]  # from the step before: a fused step's interval holds its commit
            if r["steps"] > 1:  # the first step's interval includes the prefill
                (r["fused"] if part["step"] == 0 and part["block"] > 0 else r["preview"]).append(dt)
            r["last_step"] = t
        else:
            self._commit(r, part, t)
        r["last"] = t
        if t > 0:  # a point per event; tokens and forwards move at commits, where the engine counts them
            r["t"].append(t)
            r["rate"].append(r["committed"] / t)
            r["tpf"].append(r["committed"] / r["forwards"] if r["forwards"] else None)

    @staticmethod
    def _commit(r, part, t):
        if part.get("drafted") is not None:
            r["mode"] = "speculative"
        elif r["mode"] is None:  # a block-diffusion run fires its steps before any commit
            r["mode"] = "ar"
        if r["mode"] == "ar" and r["committed"]:  # the first token's interval includes the prefill
            r["commit"].append(t - r["last"])
        r["committed"] += part["tokens"]
        # the engine's count; a trace saved before commits carried it: one forward per AR token,
        # one per preview step otherwise (speculative drafts' checks then go uncounted)
        r["forwards"] = part["forwards"] if part.get("forwards") is not None else (
            r["forwards"] + 1 if r["mode"] == "ar" else r["steps"])
        r["steps_per_block"][part["block"]] = part["steps"]

    # ---------------------------------------------------------------- reading
    def summary(self, state=None) -> list[dict]:
        """One row per run: mode, tokens, forwards, tokens/s, tokens per forward, steps per block,
        seconds per preview step and per fused commit+preview step (live estimates), and the
        engine's own figures when the result was added, the path its forwards took among them
        (the fast path or the eager forward, and why: SpeedView never times the eager path unsaid)."""
        rows = []
        for r in (state or self._live)["runs"].values():
            st = r["stats"] or {}
            spb = list(r["steps_per_block"].values())
            mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
            rows.append({
                "run": r["label"] or f"run {r['id']} · {r['mode'] or '?'}"
                       + (f" · coreset {st['coreset_size']}" if st.get("coreset_size") else ""),
                "mode": r["mode"],
                "tokens": st.get("new_tokens", r["committed"]),
                "forwards": st.get("forwards", r["forwards"]),
                "tokens/s": st.get("tokens_per_second", r["rate"][-1] if r["rate"] else None),
                "tokens/forward": st.get("tokens_per_forward",
                                         r["committed"] / r["forwards"] if r["forwards"] else None),
                "steps/block": st.get("mean_steps_per_block") or mean(spb),
                "s/preview step": mean(r["preview"]),
                "s/fused step": mean(r["fused"]),
                # without the engine's stats (add_result), the intervals between the events: previews
                # (fused ones with their commit) for block diffusion, commits for AR
                "prefill s": st.get("prefill_seconds"),
                "preview s": st.get("preview_seconds", sum(r["preview"]) + sum(r["fused"])
                                    if r["mode"] in ("diffusion", "speculative") else (0.0 if r["mode"] == "ar" else None)),
                "commit s": st.get("commit_seconds", sum(r["commit"]) if r["mode"] == "ar" else None),
                "path": st.get("path"),  # which forward ran (engine/runner.py): "compiled", "eager: a hook on ..."
            })
        return rows

    # ---------------------------------------------------------------- drawing
    def _render(self, s, frame):
        import plotly.graph_objects as go

        runs = list(s["runs"].values())
        rows = self.summary(s)
        names = [row["run"] for row in rows]
        ids = [r["id"] for r in runs]
        colour = {rid: series_colour(i) for i, rid in enumerate(ids)}
        with self.fig_rate.batch_update():
            drawn = self._trace_runs or []
            if drawn != ids[:len(drawn)]:  # a run dropped (max_runs, clear): drawn again from scratch
                self.fig_rate.data, drawn = [], []
            for r in runs[len(drawn):]:  # a new run adds its two lines; the others stay as drawn
                self.fig_rate.add_trace(go.Scatter(mode="lines", line=dict(color=colour[r["id"]]),
                                                   legendgroup=str(r["id"])), row=1, col=1)
                self.fig_rate.add_trace(go.Scatter(mode="lines", line=dict(color=colour[r["id"]]),
                                                   legendgroup=str(r["id"]), showlegend=False), row=2, col=1)
            self._trace_runs = list(ids)
            for i, (r, name) in enumerate(zip(runs, names)):
                for trace, y in ((self.fig_rate.data[2 * i], r["rate"]), (self.fig_rate.data[2 * i + 1], r["tpf"])):
                    trace.name, trace.x, trace.y = name, r["t"], y  # unchanged values are not sent
        with self.fig_blocks.batch_update():
            bars = [(r, name) for r, name in zip(runs, names) if r["mode"] != "ar" and r["steps_per_block"]]
            if len(self.fig_blocks.data) != len(bars):
                self.fig_blocks.data = []
                self.fig_blocks.add_traces([go.Bar(name=name) for _, name in bars])
            for trace, (r, name) in zip(self.fig_blocks.data, bars):
                trace.name = name
                trace.marker.color = colour[r["id"]]
                trace.x = list(r["steps_per_block"])
                trace.y = list(r["steps_per_block"].values())
        # the comparison's bars are named by run ("run 7"), what ran in the hover and the table: a
        # label with its mode and policy was cut off under the bars
        short = [f"run {r['id']}" if r["id"] >= 0 else f"result {-r['id']}" for r in runs]
        # the comparison and the table move at commits and results, not at every step: a live run's bars
        # are as of its last commit (the figures above follow every step)
        key = [(r["id"], r["label"], r["stats"] is not None, r["committed"]) for r in runs]
        if key == self._compare_key:
            return
        self._compare_key = key
        cols = [colour[i] for i in ids]
        bars = [("tokens/s", cols, None, 1), ("tokens/forward", cols, None, 2), ("prefill s", None, "#bbbbbb", 3),
                ("preview s", None, "#4c78a8", 3), ("commit s", None, "#f58518", 3)]
        with self.fig_compare.batch_update():
            if len(self.fig_compare.data) != len(bars):  # built once; later draws change values only
                self.fig_compare.data = []
                for key, _, c, col in bars:
                    hover = "%{customdata}<br>%{y:.3g}<extra>" + key + "</extra>"
                    bar = go.Bar(name=key, marker_color=c, showlegend=col == 3, hovertemplate=hover)
                    self.fig_compare.add_trace(bar, row=1, col=col)
            for trace, (key, per_run, _, _) in zip(self.fig_compare.data, bars):
                trace.x, trace.y, trace.customdata = short, [row[key] for row in rows], names
                if per_run is not None:
                    trace.marker.color = per_run
        self.table.value = self.table_html(rows)

    @staticmethod
    def table_html(rows) -> str:
        if not rows:
            return "<i style='color:#888'>no runs yet</i>"
        cols = [c for c in rows[0] if c != "mode"]

        def fmt(column, v):
            if v is None:
                return "–"
            if column == "path":  # the path's name in the cell, why it was taken on hover
                return f"<span title='{html.escape(str(v), quote=True)}'>{html.escape(str(v).split(':')[0])}</span>"
            return f"{v:.3g}" if isinstance(v, float) else html.escape(str(v))

        head = "".join(f"<th style='padding:2px 6px'>{html.escape(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td style='padding:2px 6px;text-align:right;white-space:nowrap'>"
                                         f"{fmt(c, r[c])}</td>" for c in cols) + "</tr>" for r in rows)
        return (f"<table style='border-collapse:collapse;font-size:11px'><tr>{head}</tr>{body}</table>"
                f"<div style='font-size:11px;color:#666;max-width:900px'>{FORWARD_NOTE}</div>")

    def _html_parts(self, s, frame):
        self._render(s, frame)
        return ["<div style='display:flex;flex-wrap:wrap;gap:8px'>", figure_html(self.fig_rate),
                figure_html(self.fig_blocks), "</div>", figure_html(self.fig_compare), self.table_html(self.summary(s))]
