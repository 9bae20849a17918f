"""The views' plotly figure (clover_lab/widgets/figure.py): plotly.js shipped once per kernel
(one PlotlySource widget) behind a small loader module, so that several figures made at once all draw in the browser
(tests/test_browser.py checks the drawing itself)."""
from pathlib import Path

import pytest

pytest.importorskip("ipywidgets")
plotly = pytest.importorskip("plotly")

import plotly.graph_objects as go  # noqa: E402

from clover_lab.widgets import ExpertView, LensView, MemoryView, PatchingView, SpeedView  # noqa: E402
from clover_lab.widgets.figure import Figure, PlotlySource  # noqa: E402


def test_figure_ships_plotlys_bundle_behind_a_loader():
    fig, other = Figure(go.Heatmap(z=[[1, 2], [3, 4]])), Figure()
    bundle = (Path(plotly.__file__).parent / "package_data" / "widgetbundle.js").read_text(encoding="utf-8")
    state = fig.get_state()
    # the bundle is sent once per kernel, by one widget every figure names: each figure carried all
    # 5 MB in its own state (a dashboard's nine figures: 45 MB for the page to parse before drawing)
    source = PlotlySource.shared()
    assert state["_plotly_source"] == other.get_state()["_plotly_source"] == f"IPY_MODEL_{source.model_id}"
    assert source.get_state()["bundle"] == bundle
    assert sum(len(str(v)) for v in state.values()) < 50_000
    source.close()  # closed (Widget.close_all() does it): the next figure gets a new one
    assert Figure().get_state()["_plotly_source"] == f"IPY_MODEL_{PlotlySource.shared().model_id}" != state["_plotly_source"]
    esm = state["_esm"]
    assert len(esm) < 5_000 and bundle not in esm  # the module itself is small: no 5 MB parse per figure
    assert "globalThis[KEY]" in esm and plotly.__version__.replace(".", "_") in esm
    # initialize does not wait for plotly.js (anywidget drops a model slower than 2 s); render does
    init = esm[esm.index("initialize(ctx)"):esm.index("async render")]
    assert "await" not in init.split("ready =")[0]
    assert "await ready" in esm[esm.index("async render"):]
    # every edit message plotly's model listens to is kept until it listens
    for name in ("_py2js_addTraces", "_py2js_deleteTraces", "_py2js_restyle", "_py2js_relayout", "_py2js_update"):
        assert name in esm and fig.has_trait(name)


def test_figure_is_a_figure_widget():
    fig = Figure()
    fig.add_trace(go.Scatter(x=[0, 1], y=[1, 2]))
    with fig.batch_update():
        fig.data[0].y = [3, 4]
    assert isinstance(fig, go.FigureWidget) and list(fig.data[0].y) == [3, 4]
    assert go.Figure(fig).to_dict()["data"][0]["y"] == [3, 4]


@pytest.mark.parametrize("cls", [SpeedView, ExpertView, MemoryView, LensView, PatchingView], ids=lambda c: c.__name__)
def test_every_view_draws_with_the_figure(cls):
    view = cls()
    try:
        figures = [v for v in vars(view).values() if isinstance(v, go.FigureWidget)]
        assert figures and all(isinstance(f, Figure) for f in figures)
    finally:
        view.close()


def test_a_run_can_wait_for_its_view_to_be_drawn():
    """``await view.drawn()``: True once the page says it drew every figure of the view; False at
    once after ``page`` seconds when no page took the figures (headless), or after ``timeout`` when
    one took them but did not draw them all."""
    import asyncio

    from clover_lab.widgets.figure import figures_in

    view = ExpertView()
    figures = figures_in(view.widget)
    assert len(figures) == 3 and all(isinstance(f, Figure) for f in figures)
    esm = figures[0].get_state()["_esm"]
    assert 'model.send({event: "in_page"})' in esm[esm.index("initialize(ctx)"):esm.index("async render")]
    assert 'send({event: "drawn"})' in esm[esm.index("async render"):]

    async def page_says(events, after=0.05):
        await asyncio.sleep(after)
        for fig, event in events:
            fig._from_page(fig, {"event": event}, [])

    async def waits(events, **kw):
        loop = asyncio.get_running_loop()
        start = loop.time()
        told = asyncio.ensure_future(page_says(events))
        got = await view.drawn(**kw)
        await told
        return got, loop.time() - start

    assert asyncio.run(waits([], timeout=5, page=0.2))[0] is False  # no page: given up after `page`
    got, took = asyncio.run(waits([(figures[0], "in_page"), (figures[1], "drawn")], timeout=0.5, page=0.2))
    assert got is False and took >= 0.5  # a page holds them: waited for the timeout, one figure undrawn
    got, took = asyncio.run(waits([(f, "drawn") for f in figures], timeout=5, page=0.2))
    assert got is True and took < 2
