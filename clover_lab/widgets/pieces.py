"""What views are drawn with: static HTML of figures and pages, token pieces, host arrays."""
from __future__ import annotations

import html
from pathlib import Path
from typing import Iterable

from clover_lab.writes import model_inputs, refuse_inputs, write_text


def require_notebook():
    """Import ipywidgets and plotly, or say which extra provides them."""
    try:
        import ipywidgets  # noqa: F401
        import plotly  # noqa: F401
    except ImportError as e:  # pragma: no cover - the extra is installed in dev
        raise ImportError(f"clover_lab.widgets needs the notebook extra: pip install 'clover-lab[notebook]' ({e})") from e


# distinct colours for up to 24 series (plotly's 10-colour cycle repeats across 12 heads), one
# series one colour in every subplot of a view
SERIES_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
                  "#7f7f7f", "#bcbd22", "#393b79", "#ad494a", "#637939", "#7b4173", "#e7969c", "#3182bd",
                  "#31a354", "#fd8d3c", "#756bb1", "#636363", "#843c39", "#8ca252", "#ce6dbd", "#6baed6")
# a legend under the plot, wrapped horizontally: it never widens the figure past its width or clips
LEGEND_BELOW = dict(orientation="h", x=0, xanchor="left", y=-0.22, yanchor="top", font=dict(size=9))


def finite_rows(z) -> list[list[float | None]]:
    """A 2-D array as lists with None where a value is NaN or infinite: a widget's state is JSON,
    which has no NaN (ipywidgets would write "Out of range float values" to stderr); plotly leaves
    a None cell blank."""
    import numpy as np

    z = np.asarray(z, dtype=float)
    return [[float(v) if np.isfinite(v) else None for v in row] for row in z]


def series_colour(i: int) -> str:
    return SERIES_COLOURS[i % len(SERIES_COLOURS)]


def figure_html(fig) -> str:
    """A figure (FigureWidget or Figure) as a div + script, without plotly.js (see :func:`page`)."""
    import plotly.graph_objects as go

    return go.Figure(fig).to_html(full_html=False, include_plotlyjs=False, include_mathjax=False,
                                  config={"displaylogo": False})


def section(title: str, parts: Iterable[str]) -> str:
    return f"<section class='clover-view'><h2>{html.escape(title)}</h2>\n" + "\n".join(parts) + "</section>"


def page(title: str, sections: Iterable[str]) -> str:
    """A self-contained HTML page: plotly.js inline once, no external script or stylesheet."""
    from plotly.offline import get_plotlyjs

    return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title>"
            "<style>body{font-family:system-ui,sans-serif;margin:16px;} h2{font-size:16px;margin:12px 0 4px;}"
            "section{border-top:1px solid #ddd;padding-top:6px;}</style>"
            f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>\n"
            + "\n".join(sections) + "\n</body></html>")


def view_inputs(views) -> list:
    """The checkpoint directories of the models ``views`` watch: inputs an export never overwrites."""
    return [i for v in views if getattr(v, "engine", None) is not None for i in model_inputs(v.engine.model)]


def export_html(views, path, title: str = "clover_lab") -> Path:
    """Several views in one self-contained HTML file (plotly.js embedded once); never over the
    models' own files."""
    views = list(views)
    refuse_inputs(path, view_inputs(views), "export_html")
    return write_text(path, page(title, [v.to_html(full_html=False) for v in views]))


def token_piece(tokenizer, token: int, cache: dict) -> str:
    """One token as text, with whitespace made visible."""
    s = cache.get(token)
    if s is None:
        if tokenizer is None:
            s = str(token)
        else:
            try:
                s = tokenizer.decode([token], skip_special_tokens=False)
            except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode
                s = f"<{token}>"
        cache[token] = s
    return s


def visible(s: str, limit: int = 14) -> str:
    s = s.replace("\n", "↵").replace("\t", "⇥").replace(" ", "␣")
    return s if len(s) <= limit else s[:limit - 1] + "…"


def to_numpy(t):
    """A device tensor on the host as numpy (one transfer; views only, never the engine)."""
    return t.detach().float().cpu().numpy() if t.is_floating_point() else t.detach().cpu().numpy()


class Table:
    """Rows of a notebook's result shown as a table: HTML in a notebook, aligned text elsewhere
    (a print, a test). ``rows``: dicts with the same keys, the columns in their order; a float is
    shown with ``digits`` significant digits, None as a dash.

        Table([{"layer": 0, "flip rate": 0.12}, {"layer": 1, "flip rate": 0.3}])
    """

    def __init__(self, rows, digits: int = 3, title: str = ""):
        self.rows = [dict(r) for r in rows]
        if not self.rows:
            raise ValueError("Table: no rows to show")
        self.columns = list(self.rows[0])
        for i, r in enumerate(self.rows):
            if list(r) != self.columns:
                raise ValueError(f"Table: row {i} has the columns {list(r)}, expected {self.columns} (row 0's)")
        self.digits, self.title = digits, title

    def cell(self, v) -> str:
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:.{self.digits}g}"
        if isinstance(v, (list, tuple)):
            return " ".join(self.cell(x) for x in v)
        return str(v)

    def _repr_html_(self) -> str:
        head = "".join(f"<th style='padding:2px 8px;text-align:right'>{html.escape(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td style='padding:2px 8px;text-align:right;white-space:nowrap'>"
                                         f"{html.escape(self.cell(r[c]))}</td>" for c in self.columns) + "</tr>"
                       for r in self.rows)
        title = f"<caption style='text-align:left'>{html.escape(self.title)}</caption>" if self.title else ""
        return f"<table style='border-collapse:collapse;font-size:12px'>{title}<tr>{head}</tr>{body}</table>"

    def __repr__(self) -> str:
        cells = [self.columns] + [[self.cell(r[c]) for c in self.columns] for r in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.columns))]
        lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
        return "\n".join(([self.title] if self.title else []) + lines)
