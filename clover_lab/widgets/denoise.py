"""DenoiseView: every block's canvas as a grid of tokens, step by step.

Fed by ``denoise.step`` (one frame per denoising step) and ``block.commit`` (one frame per
committed block; in AR mode every token is a block of one; in speculative mode the drafted
positions the causal check accepted are outlined green, those it rejected struck through in
red). A cell is coloured by the step at
which its position was unmasked (or by its confidence); masked cells are dashed and show, faded,
the candidate of the latest step; hovering a cell lists the top candidates of the latest step's
distribution there and the best candidate of each step. Blocks are boxed and labelled. The text so far sits beside the grid.
"""
from __future__ import annotations

import html

from clover_lab.hooks import points
from clover_lab.widgets.base import View
from clover_lab.widgets.pieces import token_piece, visible
from clover_lab.widgets.throttle import weak_callback

# viridis anchors: step 0 dark purple ... late steps yellow
_VIRIDIS = [(68, 1, 84), (72, 40, 120), (62, 73, 137), (49, 104, 142), (38, 130, 142), (31, 158, 137),
            (53, 183, 121), (110, 206, 88), (181, 222, 43), (253, 231, 37)]

_CSS = """<style>
.clover-grid{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px;line-height:1.2}
.clover-grid .cl-block{border:1px solid #888;border-radius:4px;padding:2px 4px 4px;margin:0 0 4px 0}
.clover-grid .cl-block.cl-open{border:2px dashed #c60}
.clover-grid .cl-bhead{font-size:10px;color:#555;margin-bottom:2px}
.clover-grid .cl-cells{display:flex;flex-wrap:wrap;gap:2px}
.clover-grid .cl-tok{display:inline-block;min-width:14px;padding:1px 3px;border-radius:3px;white-space:pre;
  border:1px solid transparent;cursor:default}
.clover-grid .cl-mask{background:#f1f1f1;color:#999;border:1px dashed #aaa;font-style:italic}
.clover-grid .cl-now{box-shadow:0 0 0 2px #e0f}
.clover-grid .cl-drop{background:#fff;color:#bbb;text-decoration:line-through;border:1px dotted #ccc}
.clover-grid .cl-set{outline:2px solid #d00}
.clover-grid .cl-acc{outline:2px solid #1a1}
.clover-grid .cl-rej{background:#fff;color:#c33;text-decoration:line-through;border:1px dotted #c33}
.clover-legend{font-size:10px;color:#555;margin:2px 0 6px}
.clover-legend span{display:inline-block;width:16px;height:10px;margin-right:1px;vertical-align:middle}
/* JupyterLab breaks a widget's preformatted text anywhere ("in th|e module"): at spaces only here */
.clover-text{white-space:pre-wrap;word-break:normal!important;overflow-wrap:normal!important;word-wrap:normal!important;
  font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;margin:0;max-height:520px;overflow:auto;
  background:#fafafa;border:1px solid #ddd;padding:4px}
.clover-text .cl-prov{color:#15c}
</style>"""


def step_colour(step: int, span: int) -> tuple[int, int, int]:
    t = 0.0 if span <= 1 else min(max(step / (span - 1), 0.0), 1.0)
    x = t * (len(_VIRIDIS) - 1)
    i = min(int(x), len(_VIRIDIS) - 2)
    f = x - i
    a, b = _VIRIDIS[i], _VIRIDIS[i + 1]
    return tuple(round(a[j] + (b[j] - a[j]) * f) for j in range(3))


def confidence_colour(conf: float) -> tuple[int, int, int]:
    """Red (0) through yellow to green (1)."""
    c = min(max(conf, 0.0), 1.0)
    if c < 0.5:
        return 215, round(48 + 2 * c * (200 - 48)), 39
    return round(215 - 2 * (c - 0.5) * (215 - 26)), round(200 - 2 * (c - 0.5) * (200 - 150)), round(39 + 2 * (c - 0.5) * 20)


def _css(rgb) -> tuple[str, str]:
    r, g, b = rgb
    fg = "#000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#fff"
    return f"rgb({r},{g},{b})", fg


class DenoiseView(View):
    """Block canvases as token grids, live while a generation runs, replayable per step.

    ``DenoiseView(engine)`` listens until ``close()``; ``with view.attach(engine): ...`` only inside
    the block. ``colour`` is "step" (when a position was unmasked) or "confidence".
    """

    title = "Denoising: block canvases"

    def __init__(self, engine=None, *, fps: float = 15.0, colour: str = "step", max_blocks: int = 64,
                 candidates: int = 4):
        if colour not in ("step", "confidence"):
            raise ValueError(f"colour={colour!r}: expected 'step' or 'confidence'")
        self.colour = colour
        self.max_blocks = max_blocks
        self.n_candidates = candidates
        self._pieces: dict[int, str] = {}
        super().__init__(engine, fps=fps)

    def hook_methods(self):
        return {points.DENOISE_STEP: "_on_step", points.BLOCK_COMMIT: "_on_commit"}

    # ---------------------------------------------------------------- widgets
    def _build(self):
        import ipywidgets as W

        self.colour_toggle = W.ToggleButtons(options=["step", "confidence"], value=self.colour,
                                             description="colour by", style={"button_width": "100px"})
        self.colour_toggle.observe(weak_callback(self, "_on_colour"), names="value")
        self.legend = W.HTML()
        self.grid = W.HTML(layout=W.Layout(width="62%"))
        self.grid.add_class("clover-grid-widget")
        self.text = W.HTML(layout=W.Layout(width="37%", margin="0 0 0 8px"))
        return W.VBox([W.HBox([self.colour_toggle, self.legend], layout=W.Layout(align_items="center")),
                       W.HBox([self.grid, self.text])])

    def _on_colour(self, change):
        self.colour = change["new"]
        self.redraw()

    # ---------------------------------------------------------------- events
    def _on_step(self, ev) -> None:
        masked = list(ev.masked)
        part = dict(kind="step", block=ev.block, step=ev.step, m=int(ev.canvas.shape[-1]), masked=masked,
                    cands=[int(x) for x in ev.candidates.reshape(-1).tolist()],
                    confs=[float(x) for x in ev.confidences.reshape(-1).tolist()],
                    top=self._top(ev),
                    unmask=[int(p) for p in ev.unmask], tokens=dict(ev.tokens), time=ev.time)
        self._push(part, None, f"block {ev.block} · step {ev.step} · {len(part['unmask'])} unmasked · {ev.time:.2f}s")

    def _top(self, ev) -> list[list[tuple[int, float]]] | None:
        """This step's top candidates per masked position: a true top-k of the distribution the step
        decided from (after penalties), live or as a trace kept it (TOP_CANDIDATES of them)."""
        if getattr(ev, "logits", None) is not None:
            ids, probs = ev.top_candidates(self.n_candidates)
        elif getattr(ev, "top_ids", None) is not None:  # a replayed record
            ids, probs = ev.top_ids[:, :self.n_candidates], ev.top_probs[:, :self.n_candidates]
        else:  # a trace saved before steps kept their candidates
            return None
        return [list(zip(i, p)) for i, p in zip(ids.tolist(), probs.tolist())]

    def _on_commit(self, ev) -> None:
        part = dict(kind="commit", block=ev.block, tokens=list(ev.tokens), steps=ev.steps, start=ev.start, time=ev.time,
                    drafted=getattr(ev, "drafted", None), accepted=getattr(ev, "accepted", None))
        checked = "" if part["accepted"] is None else f" · {part['accepted']} of {part['drafted']} drafted accepted"
        self._push(part, None, f"block {ev.block} committed · {len(ev.tokens)} tokens · {ev.steps} steps{checked} · "
                               f"{ev.time:.2f}s")

    # ---------------------------------------------------------------- state
    def _empty(self):
        return {"blocks": {}, "committed": [], "current": None, "now": (None, ()), "time": 0.0,
                "steps_seen": 0}

    @staticmethod
    def _cell():
        return {"tok": None, "step": None, "conf": None, "cands": {}, "set": False, "last": None, "top": None}

    def _apply_part(self, state, part):
        b = part["block"]
        if part["kind"] == "step":
            blk = state["blocks"].get(b)
            if blk is None:
                blk = state["blocks"][b] = {"m": part["m"], "cells": [self._cell() for _ in range(part["m"])],
                                            "steps": 0, "committed": False, "length": None, "start": None}
            index = {p: i for i, p in enumerate(part["masked"])}
            for p, i in index.items():
                cell = blk["cells"][p]
                tok, conf = part["cands"][i], part["confs"][i]
                best = cell["cands"].get(tok)
                if best is None or conf > best[0]:
                    cell["cands"][tok] = (conf, part["step"])
                cell["last"] = tok
                if part.get("top") is not None:
                    cell["top"] = (part["step"], part["top"][i])
            for p in part["unmask"]:
                cell = blk["cells"][p]
                i = index.get(p)
                cell["tok"] = part["tokens"].get(p, part["cands"][i] if i is not None else None)
                cell["set"] = p in part["tokens"]
                cell["step"] = part["step"]
                cell["conf"] = part["confs"][i] if i is not None else None
            blk["steps"] = part["step"] + 1
            state["current"] = b
            state["now"] = (b, tuple(part["unmask"]))
            state["steps_seen"] += 1
        else:
            tokens = part["tokens"]
            blk = state["blocks"].get(b)
            if blk is None:  # AR (a block of one, no steps) or a view attached mid-block
                blk = state["blocks"][b] = {"m": len(tokens), "cells": [self._cell() for _ in tokens],
                                            "steps": part["steps"], "committed": False, "length": None,
                                            "start": None}
                for i, t in enumerate(tokens):
                    blk["cells"][i].update(tok=t, step=0)
            for i, t in enumerate(tokens):  # the committed tokens are the truth
                if i < len(blk["cells"]):
                    blk["cells"][i]["tok"] = t
            blk.update(committed=True, length=len(tokens), steps=part["steps"], start=part["start"],
                       drafted=part.get("drafted"), accepted=part.get("accepted"))
            state["committed"].extend(tokens)
            state["current"] = b
            state["now"] = (b, ()) if state["steps_seen"] else (b, tuple(range(len(tokens))))
        state["time"] = part["time"]

    # ---------------------------------------------------------------- drawing
    def _piece(self, tok: int) -> str:
        tokenizer = self.token_source()
        return token_piece(tokenizer, tok, self._pieces)

    @staticmethod
    def _span(state) -> int:
        """How many step colours the scale runs through: the most steps a block shown took (at
        least 2), not the block size: a model that finishes its blocks in 3-5 steps of 16 would
        colour every cell with the first quarter of the scale."""
        return max([2] + [blk["steps"] for blk in state["blocks"].values()])

    def _cell_html(self, b: int, p: int, cell: dict, blk: dict, now: set, span: int) -> str:
        cls = ["cl-tok"]
        style = ""
        dropped = blk["committed"] and blk["length"] is not None and p >= blk["length"]
        where = f"block {b}, position {p}" + (f" (sequence {blk['start'] + p})" if blk["start"] is not None else "")
        lines = [where]
        accepted = blk.get("accepted") if blk["committed"] else None  # speculative: the causal check's verdict
        if accepted is not None and accepted < p <= blk["drafted"] and cell["tok"] is not None:
            cls.append("cl-rej")
            shown = visible(self._piece(cell["tok"]))
            lines.append(f"{self._piece(cell['tok'])!r}: drafted at step {cell['step']}, rejected by the causal check")
        elif cell["tok"] is None or dropped:
            cls.append("cl-drop" if dropped else "cl-mask")
            shown = visible(self._piece(cell["last"]), 10) if cell["last"] is not None and not dropped else "·"
            lines.append("dropped (after EOS / stop)" if dropped else "masked")
        else:
            shown = visible(self._piece(cell["tok"]))
            if self.colour == "confidence" and cell["conf"] is not None:
                bg, fg = _css(confidence_colour(cell["conf"]))
            else:
                bg, fg = _css(step_colour(cell["step"] or 0, span))
            style = f" style='background:{bg};color:{fg}'"
            conf = "" if cell["conf"] is None else f", confidence {cell['conf']:.3f}"
            lines.append(f"{self._piece(cell['tok'])!r}: unmasked at step {cell['step']}{conf}"
                         + (" (token set by a hook)" if cell["set"] else ""))
            if cell["set"]:
                cls.append("cl-set")
            if accepted is not None and 1 <= p <= accepted:
                cls.append("cl-acc")
                lines.append("drafted, accepted by the causal check")
        if p in now:
            cls.append("cl-now")
        if cell["top"] is not None:
            at, top = cell["top"]
            lines.append("candidates: " + " | ".join(f"{self._piece(t)!r} {q:.2f}" for t, q in top) + f" (step {at})")
        if cell["cands"]:
            top = sorted(cell["cands"].items(), key=lambda kv: -kv[1][0])[:self.n_candidates]
            lines.append("best per step: " + " | ".join(f"{self._piece(t)!r} {c:.2f} @step {s}" for t, (c, s) in top))
        title = html.escape("\n".join(lines), quote=True).replace("\n", "&#10;")
        return f"<span class='{' '.join(cls)}' title='{title}'{style}>{html.escape(shown)}</span>"

    def grid_html(self, state) -> str:
        blocks = state["blocks"]
        order = sorted(blocks)[-self.max_blocks:]
        out = [_CSS, "<div class='clover-grid'>"]
        if len(blocks) > len(order):
            out.append(f"<div class='cl-bhead'>{len(blocks) - len(order)} earlier blocks not shown</div>")
        now_b, now_p = state["now"]
        span = self._span(state)
        ar_run = [b for b in order if blocks[b]["m"] == 1 and blocks[b]["committed"]] if not state["steps_seen"] else []
        if ar_run:  # AR: one token per block, shown as one flowing box
            cells = "".join(self._cell_html(b, 0, blocks[b]["cells"][0], blocks[b], {0} if b == now_b else set(), span)
                            for b in ar_run)
            out.append(f"<div class='cl-block'><div class='cl-bhead'>AR: {len(ar_run)} tokens, one per forward</div>"
                       f"<div class='cl-cells'>{cells}</div></div>")
            order = [b for b in order if b not in set(ar_run)]
        for b in order:
            blk = blocks[b]
            now = set(now_p) if b == now_b else set()
            cells = "".join(self._cell_html(b, p, c, blk, now, span) for p, c in enumerate(blk["cells"]))
            masked = sum(c["tok"] is None for c in blk["cells"])
            what = "committed" if blk["committed"] else f"denoising, {masked} masked"
            cls = "cl-block" if blk["committed"] else "cl-block cl-open"
            out.append(f"<div class='{cls}' data-block='{b}'><div class='cl-bhead'>block {b} · {blk['steps']} step{'' if blk['steps'] == 1 else 's'} · "
                       f"{what}</div><div class='cl-cells'>{cells}</div></div>")
        if not blocks:
            out.append("<div class='cl-bhead'>waiting for a generation…</div>")
        out.append("</div>")
        return "".join(out)

    def text_html(self, state) -> str:
        tok = self.token_source()
        committed = state["committed"]
        if tok is not None:
            done = tok.decode(committed, skip_special_tokens=True)
        else:
            done = " ".join(map(str, committed))
        prov = ""
        cur = state["current"]
        blk = state["blocks"].get(cur)
        if blk is not None and not blk["committed"]:
            prov = "".join("▒" if c["tok"] is None else self._piece(c["tok"]) for c in blk["cells"])
        return (f"<div class='cl-bhead' style='font-size:10px;color:#555'>response so far ({len(committed)} tokens "
                f"committed{', provisional block in blue' if prov else ''})</div>"
                f"<pre class='clover-text'>{html.escape(done)}<span class='cl-prov'>{html.escape(prov)}</span></pre>")

    def legend_html(self, state) -> str:
        if self.colour == "confidence":
            stops = "".join(f"<span style='background:{_css(confidence_colour(c / 10))[0]}'></span>" for c in range(11))
            return f"<div class='clover-legend'>confidence 0 {stops} 1 · dashed: masked</div>"
        span = self._span(state)
        n = min(span, 12)
        stops = "".join(f"<span style='background:{_css(step_colour(round(i * (span - 1) / max(n - 1, 1)), span))[0]}'>"
                        "</span>" for i in range(n))
        return (f"<div class='clover-legend'>unmasked at step 0 {stops} {span - 1} · dashed: masked · "
                "pink ring: unmasked in this frame</div>")

    def _render(self, state, frame):
        self.legend.value = _CSS + self.legend_html(state)
        self.grid.value = self.grid_html(state)
        self.text.value = _CSS + self.text_html(state)

    def _html_parts(self, state, frame):
        return [_CSS, self.legend_html(state),
                "<div style='display:flex;gap:12px'><div style='flex:3'>" + self.grid_html(state) + "</div>"
                "<div style='flex:2'>" + self.text_html(state) + "</div></div>"]

    # ---------------------------------------------------------------- reading
    def tokens(self, state=None) -> list[int]:
        """The response tokens committed so far."""
        return list((state or self._live)["committed"])

    def steps_per_block(self, state=None) -> dict[int, int]:
        return {b: blk["steps"] for b, blk in (state or self._live)["blocks"].items()}

    def unmask_steps(self, block: int, state=None) -> list[int | None]:
        """The step at which each position of ``block`` was unmasked (None: still masked)."""
        return [c["step"] for c in (state or self._live)["blocks"][block]["cells"]]


__all__ = ["DenoiseView"]
