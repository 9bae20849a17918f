"""SpeedView's live figures are the engine's: the forwards, tokens and tokens per forward it shows
while a run goes equal the run's own GenerationStats in every mode (block diffusion, AR,
speculative, a look-ahead policy), with no result handed to it."""
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from clover_lab.engine.policies import LookAheadPolicy  # noqa: E402
from clover_lab.widgets import SpeedView  # noqa: E402

PROMPT = [5, 17, 99, 3, 42, 8, 8, 123]


@pytest.mark.parametrize("mode, kwargs", [
    ("diffusion", dict(threshold=0.3)),
    ("diffusion", dict(threshold=0.9, repetition_penalty=1.3)),
    ("ar", {}),
    ("speculative", {}),
    ("diffusion", dict(threshold=0.3, policy=LookAheadPolicy(start=0.5, threshold=0.5))),
], ids=["diffusion", "diffusion-penalised", "ar", "speculative", "look-ahead"])
def test_the_live_figures_are_the_engines_stats(view_engine, mode, kwargs):
    view = SpeedView(view_engine, fps=1000)
    try:
        result = view_engine.generate(PROMPT, mode=mode, max_new_tokens=40, **kwargs)
        view.flush()
    finally:
        view.detach()
    st = result.stats
    (row,) = view.summary()
    assert row["mode"] == mode
    assert row["tokens"] == st.new_tokens > 0
    assert row["forwards"] == st.forwards > 0
    assert row["tokens/forward"] == pytest.approx(st.tokens_per_forward)


def test_the_table_says_what_a_forward_is(view_engine):
    view = SpeedView(view_engine, fps=1000)
    try:
        view_engine.generate(PROMPT, mode="speculative", max_new_tokens=16)
        view.flush()
    finally:
        view.detach()
    page = view.table_html(view.summary())
    assert "forwards: model passes after the prefill" in page and "causal check" in page


def test_the_path_column_names_the_path_and_says_why_on_hover():
    rows = [{"run": "run 1 · diffusion", "mode": "diffusion", "path": "eager: on a CPU the fast path takes "
             "engine.compile_steps = True (or step_graphs = True)"}]
    page = SpeedView.table_html(rows)
    assert ">eager</span>" in page and "title='eager: on a CPU the fast path takes engine.compile_steps" in page
