"""ExpertView counts forwards as the engine does and names the tokens a person picks: its header
said 29 forwards where the run's stats said 26 (it counted the prefill and both halves of every
fused commit+preview), and its token picker listed the prompt as "0: (prompt)" ... instead of the
prompt's tokens."""
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from clover_lab.hooks.events import Where  # noqa: E402
from clover_lab.widgets import ExpertView  # noqa: E402
from clover_lab.widgets.pieces import token_piece, visible  # noqa: E402

PROMPT = [5, 17, 99, 3, 42, 8, 8, 123]


@pytest.mark.parametrize("mode, kwargs", [("diffusion", dict(threshold=0.5)), ("ar", {}), ("speculative", {})])
def test_forwards_are_the_engines(view_engine, mode, kwargs):
    view = ExpertView(view_engine, fps=1000)
    try:
        result = view_engine.generate(PROMPT, mode=mode, max_new_tokens=24, **kwargs)
        view.flush()
    finally:
        view.detach()
    assert view.state["forwards"] == result.stats.forwards
    assert f"{result.stats.forwards} forwards after the prefill" in view.stats_html.value


def test_the_picker_names_each_runs_prompt_tokens_by_their_text(view_engine):
    tokenizer = view_engine.tokenizer
    view = ExpertView(view_engine, fps=1000)

    def names():
        view.flush()
        return dict((pos, label) for label, pos in view.token_dd.options)

    def named(prompt):
        return [f"{p}: {visible(token_piece(tokenizer, t, {}), 18)}" for p, t in enumerate(prompt)]

    try:
        view_engine.generate(PROMPT, max_new_tokens=8)
        assert [names()[p] for p in range(len(PROMPT))] == named(PROMPT)
        view_engine.generate(PROMPT[:5], max_new_tokens=8)  # the next run: its own prompt, nobody told the view
        assert [names()[p] for p in range(5)] == named(PROMPT[:5])
        other = [7, 8, 9, 10, 11, 12]
        view.row = 1  # a batch: the row the view watches
        view_engine.generate([PROMPT[:6], other], max_new_tokens=8)
        assert [names()[p] for p in range(6)] == named(other)
    finally:
        view.detach()
    assert view_engine.prompt_of(Where(run=10**6)) is None  # no such run going on


def test_the_picker_renames_a_block_once_its_commit_names_it(view_engine):
    # notebook 03's pickers listed the last block as "N: (response)": its routes were drawn before
    # its commit named its tokens, and the picker kept the first labels (it compared positions only)
    import copy

    view = ExpertView(view_engine, fps=1000)
    try:
        result = view_engine.generate(PROMPT, max_new_tokens=16)
        view.flush()
    finally:
        view.detach()
    full = view.state
    early = copy.deepcopy(full)
    for pos in range(len(PROMPT), len(PROMPT) + len(result.token_ids)):
        early["names"].pop(pos, None)
    view._render(early, None)
    assert any("(response)" in label for label, _ in view.token_dd.options)
    view._render(full, None)
    assert not any("(response)" in label for label, _ in view.token_dd.options), view.token_dd.options
