"""Views replayed from a saved trace with no model, and exported with every frame (issue 17)."""
import re

import numpy as np
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

import clover_lab  # noqa: E402
from clover_lab.hooks.events import Where  # noqa: E402
from clover_lab.widgets import DenoiseView, ExpertView, LensView, MemoryView, SpeedView  # noqa: E402
from test_denoise import PENALISED, tops_by_step  # noqa: E402

PROMPT = [5, 17, 99, 3, 42, 8, 8, 123]
GEN = dict(max_new_tokens=40, threshold=0.3, temperature=0.0)


def same(a, b, skip=()) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(k in skip or same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def record_live(live, path, prompt, **gen):
    """Run ``prompt`` with the view ``live`` attached to its engine and everything it listens to
    captured; flush and detach the view, save the capture to ``path``."""
    engine = live.engine
    try:
        with engine.capture(list(live.hook_methods())) as cap:
            engine.generate(prompt, **gen)
        live.flush()
        cap.save(path)
    finally:
        live.detach()


@pytest.mark.parametrize("cls", [DenoiseView, ExpertView, MemoryView, SpeedView])
def test_a_saved_trace_replays_as_the_live_run(view_engine, tmp_path, cls):
    live = cls(view_engine, fps=1000)
    record_live(live, tmp_path / "run", PROMPT, coreset_size=3, **GEN)
    trace = clover_lab.load_trace(tmp_path / "run")
    replayed = cls(fps=1000).replay(trace)  # no view_engine, no model
    assert replayed.engine is None and len(replayed.frames) == len(live.frames) > 0
    assert replayed.frame_labels == live.frame_labels
    assert all(same(a, b) for a, b in zip(live.frames, replayed.frames))
    if cls is DenoiseView:
        assert replayed.tokens() == live.tokens()
    if cls is ExpertView:  # the prompt's tokens named by their text in the picker, from the trace's prompts
        assert replayed.token_dd.options == live.token_dd.options
        assert [label for label, pos in replayed.token_dd.options if pos < len(PROMPT)][0] != "0: (prompt)"
    with pytest.raises(ValueError, match="nothing to replay"):
        cls(fps=1000).replay(clover_lab.Trace([], ["layers.0.output"]))
    live.close()
    replayed.close()


@pytest.mark.parametrize("cls", [DenoiseView, ExpertView, MemoryView])
def test_a_batched_trace_replays_one_row(view_engine, tmp_path, cls):
    """A view following row 1 of a batch, live and replayed from the batch's trace, shows the same."""
    live = cls(view_engine, fps=1000)
    live.row = 1
    record_live(live, tmp_path / "batch", [PROMPT, [7, 7, 300], [9]], coreset_size=3, **GEN)
    replayed = cls(fps=1000)
    replayed.row = 1
    replayed.replay(clover_lab.load_trace(tmp_path / "batch"))
    assert len(replayed.frames) == len(live.frames) > 0 and replayed.frame_labels == live.frame_labels
    assert all(same(a, b) for a, b in zip(live.frames, replayed.frames))
    if cls is ExpertView:  # row 1's prompt, not row 0's
        trace = clover_lab.load_trace(tmp_path / "batch")
        assert trace.prompt_of(Where(trace.runs[0], rows=(1,))) == [7, 7, 300]
        assert replayed.token_dd.options == live.token_dd.options
    live.close()
    replayed.close()


def test_the_logit_lens_replays_a_trace_with_the_model_that_made_it(view_engine, tmp_path):
    live = LensView(view_engine, fps=1000)
    record_live(live, tmp_path / "run", PROMPT, **GEN)
    trace = clover_lab.load_trace(tmp_path / "run")
    with pytest.raises(ValueError, match="LensView.replay needs the model that made the trace"):
        LensView(fps=1000).replay(trace)
    replayed = LensView(fps=1000).replay(trace, view_engine)
    assert len(replayed.frames) == len(live.frames) > 0 and replayed.frame_labels == live.frame_labels
    assert all(same(a, b, skip=()) for a, b in zip(live.frames, replayed.frames))
    live.close()
    replayed.close()


def test_export_html_writes_every_frame_with_a_slider(view_engine, tmp_path):
    view = DenoiseView(view_engine, fps=1000)
    try:
        r = view_engine.generate(PROMPT, **GEN)
    finally:
        view.detach()
    text = view.export_html(tmp_path / "d.html").read_text()
    n = len(view.frames)
    assert n == r.stats.preview_forwards + r.stats.blocks
    assert text.count("class='clover-frame'") == n and "clover-frame-slider" in text
    assert f"max='{n - 1}'" in text
    assert not re.search(r"<script[^>]*\bsrc\s*=", text, re.I)  # nothing loads from the network
    one = view.export_html(tmp_path / "one.html", frame=0).read_text()
    assert "clover-frame-slider" not in one
    view.close()


def test_patching_view_shows_a_sweep_row_by_row(view_engine, tmp_path):
    from clover_lab import patching
    from clover_lab.widgets import PatchingView

    clean, corrupt = [5, 17, 99, 3, 42, 8, 8, 123], [5, 17, 99, 7, 42, 8, 8, 123]
    metric = patching.logit_diff(len(clean) + 2, 10, 11)
    sweep = patching.sweep_layers_positions(view_engine, clean, corrupt, metric, block=0, step=0,
                                            positions=[9, 10, 11], max_new_tokens=16, threshold=0.3)
    view = PatchingView(sweep)
    want = sweep.normalized().numpy()
    np.testing.assert_allclose(view.matrix(), want)
    assert len(view.frames) == 4  # a frame per layer
    assert np.isnan(view.matrix(view.state_at(0))[1:]).all()
    text = view.export_html(tmp_path / "p.html").read_text()
    assert text.count("class='clover-frame'") == 4 and "plotly-graph-div" in text
    view.close()


def test_lens_view_live_and_from_a_lens(view_engine):
    from clover_lab import lens
    from clover_lab.widgets import LensView

    view = LensView(view_engine, k=3, fps=1000)
    try:
        lz = lens.logit_lens(view_engine, PROMPT, k=3, **GEN)
    finally:
        view.detach()
    assert len(view.frames) == len(lz.steps) == lz.result.stats.preview_forwards
    for frame, s in zip(view.frames, lz.steps):
        part = frame[-1]
        assert part["positions"] == s.positions and part["unmasked"] == s.unmasked
        np.testing.assert_array_equal(part["ids"], s.ids.numpy())
    offline = LensView.from_lens(lz, view_engine.tokenizer, fps=1000)
    assert offline.engine is None and len(offline.frames) == len(view.frames)
    assert list(offline.fig.data[0].y) == list(range(view_engine.model.config.num_hidden_layers))
    view.close()
    offline.close()


@pytest.mark.parametrize("points", [["denoise.step"], ["final_norm.output", "denoise.step"]])
def test_the_logit_lens_names_what_a_trace_lacks(view_engine, points):
    """A trace without layer outputs replayed into a LensView drew nothing, or was a KeyError from inside."""
    with view_engine.capture(points) as cap:
        view_engine.generate(PROMPT, max_new_tokens=8)
    view = LensView(fps=1000)
    with pytest.raises(clover_lab.InputError, match=r"LensView.replay needs records of layers.\*.output"):
        view.replay(cap, view_engine)
    view.close()


def test_the_logit_lens_refuses_a_trace_of_another_model(view_engine, tmp_path):
    """Replayed with another model's engine, a LensView was a RuntimeError from inside the final norm."""
    other = clover_lab.Engine(clover_lab.CloverModel.random("clover-stdlib", seed=1))
    with view_engine.capture(list(LensView.hook_methods(LensView()))) as cap:
        view_engine.generate(PROMPT, max_new_tokens=8)
    cap.save(tmp_path / "t")
    for trace, said in [(clover_lab.load_trace(tmp_path / "t"), "recorded on another model .*hidden_size 64 vs 256"),
                        (clover_lab.Trace(cap.records, cap.points), "not of the engine's model")]:  # no config: shapes
        view = LensView(fps=1000)
        with pytest.raises(clover_lab.InputError, match=said):
            view.replay(trace, other)
        view.close()


def test_a_replayed_trace_shows_the_hover_candidates_the_live_view_showed(view_engine, tmp_path):
    """The hover candidates a step decided with (after penalties) are kept by the trace."""
    live = DenoiseView(view_engine, fps=1000)
    record_live(live, tmp_path / "run", PROMPT, **PENALISED)
    replayed = DenoiseView(fps=1000).replay(clover_lab.load_trace(tmp_path / "run"))
    want = tops_by_step(live)
    assert want and tops_by_step(replayed) == want
