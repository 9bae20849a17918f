"""The default Dashboard on the fast path (issue 24): its views only observe (ExpertView the
routers, MemoryView the GDN states and history weights, DenoiseView and SpeedView the engine's
steps), so a generation on an engine with compiled steps stays compiled in every layer, and
SpeedView shows which path its forwards took."""
import html

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from clover_lab.widgets import Dashboard  # noqa: E402
from clover_lab.widgets.dashboard import VIEWS  # noqa: E402


@pytest.mark.slow  # compiles a preview and a fused commit + preview step (~40 s on 2 busy cores)
def test_the_default_dashboard_keeps_the_compiled_steps(view_engine):
    plain = view_engine.generate("w5 w17 w33", max_new_tokens=16, threshold=0.3)  # eager: no compile_steps
    assert plain.stats.path.startswith("eager:")
    view_engine.compile_steps = True
    dash = Dashboard(view_engine, max_new_tokens=16, fps=1000)
    try:
        assert set(dash.views) == set(VIEWS)  # the default views, every one
        dash.chat.value = False
        res = dash.generate("w5 w17 w33", wait=True, threshold=0.3)
        c = view_engine.model.config
        recorded = {f"layers.{i}.moe.route" for i in range(c.num_hidden_layers)}
        recorded |= {f"layers.{i}.gdn.{p}" for i in c.gdn_layers() for p in ("state", "preview")}
        assert set(view_engine.model.hooks.attached()) - {"denoise.step", "block.commit"} == recorded
        assert res.token_ids == plain.token_ids
        assert res.stats.path == ("compiled (observers read after each step: layers.0.gdn.preview, "
                                  f"layers.0.gdn.state, layers.0.moe.route and {len(recorded) - 3} more points)")
        assert view_engine.fast_path.graphs.compile_failed is None
        speed = dash["speed"]
        assert speed.summary()[-1]["path"] == res.stats.path
        assert html.escape(res.stats.path) in speed.table.value
        # the views saw what the eager forward shows: routes and GDN states of the decode too
        memory = dash["memory"]
        lengths, norms = memory.state_norms(c.gdn_layers()[0])
        assert max(lengths) > len(res.prompt_ids) and norms.shape == (len(lengths), c.linear_num_value_heads)
        assert memory.history_weights() and dash["experts"].usage("all").sum() > 0
    finally:
        dash.close()
        view_engine.compile_steps = False
