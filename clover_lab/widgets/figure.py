"""The views' plotly figure: a ``FigureWidget`` whose browser code is parsed once per page.

plotly's ``FigureWidget`` is an anywidget whose ES module is plotly.js itself (~5 MB). anywidget
imports every widget's module from a Blob URL of its own, so each figure parses plotly.js again,
and anywidget (0.11) gives a model 2 seconds to load and initialize before it drops it ("Failed
to initialize model"): a view of three figures created in one cell, on a busy machine, drew the
last figure and left the others as empty axes (measured in Chromium: 1 of 3, 1 of 9 drawn; with
the timeout patched out in the page, 3 of 3). :class:`Figure` names plotly's bundle, sent once per
kernel by one :class:`PlotlySource` widget (each figure carried all 5 MB in its own state before), and
ships a small module that initializes at once (no timeout), imports the bundle once per page (every
figure awaits the same import), replays the edits the kernel sent meanwhile into plotly's copy of
the figure, and hands over to plotly's own ``initialize`` / ``render``: same widget, same messages.
"""
from __future__ import annotations

import functools
import hashlib
import sys
from pathlib import Path

import ipywidgets
import plotly
import traitlets


def _figure_widget_class():
    """plotly's ``FigureWidget``, imported without the ~1.5 s (4.6 s on a busy machine) that its
    import chain spends on nothing a figure uses: plotly.basewidget imports plotly.io._renderers,
    which imports nbformat for its version, whose validator imports jsonschema, whose format
    checkers import ``rfc3987_syntax``, which builds a Lark grammar on import. Blocking that one
    module while the chain is imported makes jsonschema leave out its "iri" / "iri-reference"
    format checks (it imports the module optionally); nothing in a notebook validates those.
    Only when jsonschema is not imported yet: an already loaded one is left as it is."""
    block = "jsonschema" not in sys.modules and "rfc3987_syntax" not in sys.modules
    if block:
        sys.modules["rfc3987_syntax"] = None  # an ImportError for whoever imports it meanwhile
    try:
        from plotly.graph_objs import FigureWidget
    finally:
        if block and sys.modules.get("rfc3987_syntax", 0) is None:
            del sys.modules["rfc3987_syntax"]  # imported later, it loads as usual
    return FigureWidget

_LOADER = """
const KEY = "__clover_plotly_widget_%s";
const MESSAGES = ["_py2js_addTraces", "_py2js_deleteTraces", "_py2js_moveTraces", "_py2js_restyle",
                  "_py2js_relayout", "_py2js_update", "_py2js_animate", "_py2js_removeLayoutProps",
                  "_py2js_removeTraceProps"];
function plotlyModule(model) {
  // one import per page, whichever figure asks first; the others await the same promise. The
  // bundle's text is held once per kernel by one PlotlySource widget that every figure names
  if (!globalThis[KEY]) {
    globalThis[KEY] = (async () => {
      const ref = model.get("_plotly_source");  // "IPY_MODEL_<id>", or the model where a manager resolved it
      const source = typeof ref === "string" ? await model.widget_manager.get_model(ref.slice("IPY_MODEL_".length)) : ref;
      const url = URL.createObjectURL(new Blob([source.get("bundle")], {type: "text/javascript"}));
      try { return await import(url); } finally { URL.revokeObjectURL(url); }
    })();
  }
  return globalThis[KEY];
}
export default () => {
  let figure, ready;
  return {
    // returns at once: anywidget drops a model whose initialize takes over 2 s, and parsing
    // plotly.js can take longer on a busy machine
    initialize(ctx) {
      const model = ctx.model;
      model.send({event: "in_page"});  // this page holds the figure (what View.drawn() waits for first)
      const early = [];  // the kernel's edits that arrive before plotly listens, in order
      const keep = [];
      for (const name of MESSAGES) {
        const cb = () => { const v = model.get(name); if (v !== null && v !== undefined && !figure) early.push([name, v]); };
        model.on("change:" + name, cb);
        keep.push([name, cb]);
      }
      ready = plotlyModule(model).then(async (mod) => {
        figure = mod.default();
        await figure.initialize(ctx);
        for (const [name, cb] of keep) model.off("change:" + name, cb);
        for (const [name, v] of early) {  // replayed into plotly's copy of the figure, locally
          model.set(name, v);
          model.set(name, null);
        }
      });
    },
    async render(ctx) {
      await ready;
      const cleanup = await figure.render(ctx);
      ctx.model.send({event: "drawn"});  // its first frame is on the page
      return cleanup;
    },
  };
};
"""


@functools.lru_cache(maxsize=1)
def _bundle() -> tuple[str, str]:
    """plotly's widget bundle and a key naming its version (one import per version per page)."""
    text = (Path(plotly.__file__).parent / "package_data" / "widgetbundle.js").read_text(encoding="utf-8")
    digest = hashlib.sha1(text.encode("utf-8")).hexdigest()[:12]
    return text, f"{plotly.__version__.replace('.', '_')}_{digest}"


class PlotlySource(ipywidgets.Widget):
    """plotly's widget bundle (~5 MB of text), sent to the page once per kernel: every Figure names
    this one widget. Each figure carried the bundle in its own state: a dashboard's nine figures
    sent 45 MB through the kernel's socket, and the page parsed every message of it before it drew."""

    bundle = traitlets.Unicode().tag(sync=True)

    _shared: "PlotlySource | None" = None

    @classmethod
    def shared(cls) -> "PlotlySource":
        """The kernel's one source, made again if it was closed (``Widget.close_all()``)."""
        if cls._shared is None or cls._shared.comm is None:
            cls._shared = cls(bundle=_bundle()[0])
        return cls._shared


class Figure(_figure_widget_class()):
    """``go.FigureWidget`` with plotly.js imported once per page (see the module's docstring). The
    page says when it holds the figure (``in_page``) and when it has drawn it (``drawn``)."""

    _esm = _LOADER % _bundle()[1]
    _plotly_source = traitlets.Instance(PlotlySource).tag(sync=True, **ipywidgets.widget_serialization)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._in_page = False  # plotly's figures take only _-names beside their properties
        self._drawn = False
        self.on_msg(self._from_page)

    @property
    def in_page(self) -> bool:
        """A page created this figure's model."""
        return self._in_page

    @property
    def drawn(self) -> bool:
        """A page drew this figure."""
        return self._drawn

    def _from_page(self, _widget, content, _buffers) -> None:
        event = content.get("event") if isinstance(content, dict) else None
        if event == "in_page":
            self._in_page = True
        elif event == "drawn":
            self._in_page = self._drawn = True

    @traitlets.default("_plotly_source")
    def _shared_source(self):
        return PlotlySource.shared()


def figures_in(widget) -> list[Figure]:
    """Every :class:`Figure` in ``widget``'s tree of children."""
    found, seen, todo = [], set(), [widget]
    while todo:
        w = todo.pop()
        if id(w) in seen:
            continue
        seen.add(id(w))
        if isinstance(w, Figure):
            found.append(w)
        todo.extend(getattr(w, "children", ()) or ())
    return found


async def figures_drawn(widget, timeout: float = 15.0, page: float = 5.0) -> bool:
    """Wait until a page has drawn every figure in ``widget``'s tree: True once it has; False when
    no page took the figures within ``page`` seconds (a headless run: nbclient draws nothing) or they
    were not all drawn within ``timeout``. The page's messages reach the kernel only while the
    cell awaits (an ``await`` in the cell: ipykernel then dispatches them; a blocking wait would
    hold them until the cell ends). A page parses plotly.js once, when its first view appears
    (seconds on a busy machine): a short run started meanwhile ends before it is seen. A page that
    holds the figures but never draws them (a front end that renders only the cells in view) costs
    ``timeout`` seconds, not a hang."""
    import asyncio

    figures = figures_in(widget)
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not all(f.drawn for f in figures):
        waited = loop.time() - start
        if waited > timeout or (waited > page and not any(f.in_page for f in figures)):
            return False
        await asyncio.sleep(0.05)
    return True
