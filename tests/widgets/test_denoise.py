"""DenoiseView's hover candidates are the ones each step decided with: a top-k of the
distribution after the row's penalties (with repetition_penalty the raw logits' best token is
often not the one chosen); replayed from a saved trace: test_widgets_replay.py."""
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from clover_lab.widgets import DenoiseView  # noqa: E402

PROMPT = [5, 17, 99, 3, 42, 8, 8, 123]
PENALISED = dict(max_new_tokens=32, threshold=0.5, repetition_penalty=1.8, temperature=0.0)


def tops_by_step(view):
    """(block, step, position) -> the hover's ranked candidates, read from the view's frames."""
    out = {}
    for i in range(len(view.frames)):
        for b, blk in view.state_at(i)["blocks"].items():
            for p, cell in enumerate(blk["cells"]):
                if cell["top"] is not None:
                    step, top = cell["top"]
                    out[(b, step, p)] = top
    return out


def test_hover_candidates_are_the_steps_decided_candidates(view_engine):
    steps = []
    view = DenoiseView(view_engine, fps=1000)
    try:
        with view_engine.hooks({"denoise.step": lambda ev: steps.append(
                (ev.block, ev.step, list(ev.masked), ev.candidates.tolist()))}):
            view_engine.generate(PROMPT, **PENALISED)
        view.flush()
    finally:
        view.detach()
    tops = tops_by_step(view)
    checked = 0
    for block, step, masked, cands in steps:
        for p, cand in zip(masked, cands):
            top = tops[(block, step, p)]
            assert top[0][0] == cand, (block, step, p)  # greedy: the best token of what it decided from
            assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
            checked += 1
    assert checked > 32


def test_the_step_colours_span_the_steps_the_blocks_took(view_engine):
    # the scale ran 0-15 (the block size) while blocks finished in 3-5 steps: every cell was one of
    # the scale's first few colours. Now its last colour is the most steps a block took, and a
    # block of one step says "1 step"
    import re

    from clover_lab.widgets.denoise import _css, step_colour

    view = DenoiseView(view_engine, fps=1000)
    try:
        result = view_engine.generate(PROMPT, max_new_tokens=32, threshold=0.3)
        view.flush()
    finally:
        view.detach()
    most = max(result.stats.steps_per_block)
    assert 2 <= most < view_engine.block_size  # the case the scale was wrong for
    legend = view.legend.value
    assert f"{most - 1} · dashed" in legend, legend
    grid = view.grid.value
    latest = _css(step_colour(most - 1, most))[0]  # the scale's last colour: some cell took the last step
    assert latest in grid
    assert _css(step_colour(most - 1, view_engine.block_size))[0] not in grid  # not the old 0-15 scale
    heads = re.findall(r"block \d+ · (\d+) (steps?) · ", grid)
    assert heads and all((n == "1") == (word == "step") for n, word in heads), heads
