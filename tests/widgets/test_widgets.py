"""The notebook views (clover_lab.widgets): each view receives what the hooks emit, redraws are
throttled with the final frame always drawn, frames replay, exports are self-contained, and
nothing stays attached to the engine."""
import gc
import re
import threading
import time

import numpy as np
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from clover_lab.widgets import Dashboard, DenoiseView, ExpertView, MemoryView, SpeedView, Throttle  # noqa: E402
from clover_lab.widgets.pieces import export_html  # noqa: E402

PROMPT = [5, 17, 99, 3, 42, 8, 8, 123]
GEN = dict(max_new_tokens=40, threshold=0.3, temperature=0.0)


# --------------------------------------------------------------------------- what each view receives
def test_denoise_view_matches_the_step_and_commit_events(view_engine):
    view = DenoiseView(view_engine, fps=1000)
    try:
        with view_engine.capture(["denoise.step", "block.commit"]) as cap:
            result = view_engine.generate(PROMPT, **GEN)
        view.flush()
        steps = [p for f in view.frames for p in f if p["kind"] == "step"]
        commits = [p for f in view.frames for p in f if p["kind"] == "commit"]
        assert len(steps) == len(cap["denoise.step"]) and len(commits) == len(cap["block.commit"])
        for part, rec in zip(steps, cap["denoise.step"]):
            assert (part["block"], part["step"]) == (rec.block, rec.step)
            assert part["unmask"] == rec["unmask"] and part["masked"] == rec["masked"]
            assert part["cands"] == rec["candidates"].tolist()
        assert view.tokens() == result.token_ids
        assert list(view.steps_per_block().values()) == result.stats.steps_per_block
        # every position of a block is unmasked exactly at one step below the block's step count
        for b, n in view.steps_per_block().items():
            assert all(s is not None and 0 <= s < n for s in view.unmask_steps(b))
        grid = view.grid.value
        assert "clover-grid" in grid and grid.count("cl-block") >= len(result.stats.steps_per_block)
        assert "candidates:" in grid and "best per step:" in grid  # hover titles list the candidates
        # the hover's top candidates are a true top-k of one step's distribution, best first
        first = steps[0]
        assert first["top"] is not None and len(first["top"]) == len(first["masked"])
        for row in first["top"]:
            assert [q for _, q in row] == sorted((q for _, q in row), reverse=True) and sum(q for _, q in row) <= 1 + 1e-6
    finally:
        view.close()


def test_expert_view_counts_every_routing(view_engine):
    view = ExpertView(view_engine, fps=1000)
    try:
        with view_engine.capture("layers.*.moe.route", to="cpu") as cap:
            result = view_engine.generate(PROMPT, coreset_size=3, **GEN)
        view.flush()
        L, E = view_engine.model.config.num_hidden_layers, view_engine.model.config.num_experts
        k = view_engine.model.config.num_experts_per_tok
        want = {p: np.zeros((L, E)) for p in ("prefill", "commit", "preview")}
        full = np.zeros((L, E))
        for r in cap.records:
            phase = "prefill" if r.phase == "prefill" else r["mode"]
            want[phase][r["layer"]] += np.bincount(r["expert_ids"].reshape(-1).numpy(), minlength=E)
            if phase == "preview":
                full[r["layer"]] += np.bincount(r["router_probs"].topk(k, -1).indices.reshape(-1).numpy(), minlength=E)
        for phase, z in want.items():
            np.testing.assert_array_equal(view.usage(phase), z)
        np.testing.assert_array_equal(view.usage("preview", routing="without coreset"), full)
        assert not np.array_equal(full, want["preview"])  # the coreset changed routing
        stats = view.load_stats("preview")
        assert len(stats) == L
        assert all(r["distinct/forward (actual)"] <= 3 for r in stats)  # coreset of 3
        assert len(view.frames) == result.stats.forwards + result.stats.prefill_forwards  # one frame per forward
        co = view.coactivation(0, "preview")
        np.testing.assert_array_equal(np.diag(co), want["preview"][0])
        pos = max(view.state["routes"])
        assert np.count_nonzero(view.token_routing(pos)) == L * k
    finally:
        view.close()


def test_memory_view_receives_history_weights_and_states(view_engine):
    view = MemoryView(view_engine, fps=1000)
    try:
        with view_engine.capture(["layers.*.gdn.preview", "layers.*.gdn.state"], to="cpu") as cap:
            view_engine.generate(PROMPT, **GEN)
        view.flush()
        gdn = view_engine.model.config.gdn_layers()
        for layer in gdn:
            previews = [p for f in view.frames for p in f if p["kind"] == "preview" and p["layer"] == layer]
            assert len(previews) == len(cap[f"layers.{layer}.gdn.preview"])
            lengths, norms = view.state_norms(layer)
            states = cap[f"layers.{layer}.gdn.state"]
            assert lengths == [r["length"] for r in states]
            np.testing.assert_allclose(norms[-1], states[-1]["state"][0].flatten(1).norm(dim=1).numpy(), rtol=1e-5)
            np.testing.assert_allclose(view.history_weights()[layer],
                                       cap[f"layers.{layer}.gdn.preview"][-1]["history_weights"][0].numpy())
        assert len(view.fig_hist.data[0].y) == len(gdn) * view_engine.model.config.linear_num_value_heads
    finally:
        view.close()


def test_speed_view_runs_and_compare(view_engine):
    view = SpeedView(view_engine, fps=1000)
    try:
        runs = view.compare(view_engine, PROMPT, max_new_tokens=24, threshold=0.3)
        rows = view.summary()
        assert [r["mode"] for r in rows] == ["diffusion", "ar"]
        d = runs["diffusion"].stats
        assert rows[0]["tokens"] == d.new_tokens and rows[0]["forwards"] == d.forwards
        assert rows[1]["tokens/forward"] == pytest.approx(runs["ar"].stats.tokens_per_forward)
        run = list(view.state["runs"].values())[0]
        assert list(run["steps_per_block"].values()) == d.steps_per_block
        assert len(run["t"]) == sum(d.steps_per_block) + d.blocks  # one point per step and per commit
        assert view.attached  # compare() leaves an attachment it did not make in place
    finally:
        view.close()


# --------------------------------------------------------------------------- throttling
def test_throttle_coalesces_and_draws_the_last_request():
    now = [0.0]
    drawn = []
    t = Throttle(lambda: drawn.append(now[0]), fps=10, clock=lambda: now[0], trailing=False)
    for i in range(100):  # 100 requests over 1 s
        now[0] = i * 0.01
        t.request()
    assert t.requests == 100
    assert 9 <= t.draws <= 11  # ~10 per second
    assert all(b - a >= 0.1 - 1e-9 for a, b in zip(drawn, drawn[1:]))
    assert t.pending
    t.flush()
    assert not t.pending and drawn[-1] == now[0]


def test_throttle_timer_draws_the_final_frame_without_a_flush():
    drawn = []
    t = Throttle(lambda: drawn.append(time.monotonic()), fps=20)
    for _ in range(50):
        t.request()
    assert len(drawn) == 1 and t.pending
    time.sleep(0.3)
    assert len(drawn) == 2 and not t.pending


def test_views_throttle_live_and_show_the_final_frame(view_engine):
    view = DenoiseView(view_engine, fps=4)
    draws_during = []
    try:
        with view_engine.hooks({"block.commit": lambda ev: draws_during.append(view.throttle.draws)}):
            result = view_engine.generate(PROMPT, **GEN)
        # synchronous run, view made before it in the same "cell": drawn while it ran, through the hooks
        assert draws_during and draws_during[-1] >= 1
        assert view.throttle.draws < view.throttle.requests
        time.sleep(0.6)  # the trailing timer draws the last state: nobody called flush()
        assert not view.throttle.pending
        assert view.grid.value.count("cl-block cl-open") == 0  # every block shown committed
        text = view_engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        assert re.sub(r"\s+", " ", text).strip()[:20] in re.sub(r"\s+", " ", view.text.value)
        assert view.slider.max == len(view.frames) - 1 == view.slider.value
    finally:
        view.close()


# --------------------------------------------------------------------------- replay
def test_replay_slider_shows_earlier_frames_and_follows_again(view_engine):
    view = DenoiseView(view_engine, fps=1000)
    try:
        result = view_engine.generate(PROMPT, max_new_tokens=40, threshold=0.99)
        view.flush()
        assert result.stats.steps_per_block[0] > 3
        n = len(view.frames)
        view.show_frame(2)
        assert view.slider.value == 2 and not view._follow
        early = view.state_at(2)
        assert view.grid.value == view.grid_html(early)
        assert 3 <= sum(c["tok"] is not None for c in early["blocks"][0]["cells"]) < len(early["blocks"][0]["cells"])
        assert "frame 3/" in view.frame_label.value
        view.slider.value = n - 1  # the user drags back to the end
        assert view._follow and view.grid.value == view.grid_html(view.state)
        assert view.state_at(n - 1)["committed"] == view.state["committed"]
        with pytest.raises(IndexError):
            view.show_frame(n)
        # a new generation starts a new recording
        view_engine.generate(PROMPT, max_new_tokens=8)
        view.flush()
        assert view.tokens() == view.state["committed"] and len(view.tokens()) == 8
    finally:
        view.close()


def test_other_views_replay(view_engine):
    views = [ExpertView(view_engine, fps=1000), MemoryView(view_engine, fps=1000), SpeedView(view_engine, fps=1000)]
    try:
        view_engine.generate(PROMPT, **GEN)
        for v in views:
            v.flush()
            v.show_frame(1)
            assert v.slider.value == 1 and not v.errors
            v.show_frame(-1)
            assert v._follow
        e = views[0]
        assert e.usage("all", state=e.state_at(0)).sum() < e.usage("all").sum()
    finally:
        for v in views:
            v.close()


# --------------------------------------------------------------------------- export
def test_export_html_is_self_contained(view_engine, tmp_path):
    views = [DenoiseView(view_engine), ExpertView(view_engine), MemoryView(view_engine), SpeedView(view_engine)]
    try:
        view_engine.generate(PROMPT, **GEN)
        for v in views:
            path = v.export_html(tmp_path / f"{type(v).__name__}.html")
            text = path.read_text()
            assert not re.search(r"<script[^>]*\bsrc\s*=\s*[\"']?https?:", text, re.I)
            assert not re.search(r"<link[^>]*href\s*=\s*[\"']?https?:", text, re.I)
            assert "plotly.js v" in text or "Plotly" in text
        assert "clover-grid" in (tmp_path / "DenoiseView.html").read_text()
        assert (tmp_path / "ExpertView.html").read_text().count("plotly-graph-div") >= 3
        both = export_html(views, tmp_path / "all.html").read_text()
        assert both.count("<section") == 4 and both.count("Plotly=") <= 1
    finally:
        for v in views:
            v.close()


# --------------------------------------------------------------------------- attach / detach
def test_views_follow_one_row_of_a_batch(view_engine):
    """A view shows request row ``view.row`` of a batched generation: what it shows equals a view
    of that prompt generated alone."""
    prompts = [PROMPT, [7, 7, 300], [9]]

    def views():
        return [cls(view_engine, fps=1000) for cls in (DenoiseView, ExpertView, MemoryView)]

    in_batch = views()
    for view in in_batch:
        view.row = 1
    batch = view_engine.generate(prompts, **GEN)
    for view in in_batch:
        view.close()
    alone = views()
    single = view_engine.generate(prompts[1], **GEN)
    for view in alone:
        view.close()
    (d1, e1, m1), (d2, e2, m2) = in_batch, alone
    assert d1.tokens() == batch[1].token_ids == single.token_ids == d2.tokens()
    assert d1.steps_per_block() == d2.steps_per_block()
    for phase in ("prefill", "commit", "preview"):
        np.testing.assert_array_equal(e1.usage(phase), e2.usage(phase))
    for layer, weights in m2.history_weights().items():
        np.testing.assert_allclose(m1.history_weights()[layer], weights, rtol=1e-4, atol=1e-6)
        lengths, norms = m1.state_norms(layer)
        assert lengths == m2.state_norms(layer)[0]
        np.testing.assert_allclose(norms, m2.state_norms(layer)[1], rtol=1e-4)


def test_nothing_stays_attached(view_engine):
    hooks = view_engine.model.hooks
    view = DenoiseView(view_engine)
    assert set(hooks.attached()) == {"denoise.step", "block.commit"}
    view.close()
    assert hooks.attached() == {}

    view = ExpertView()
    with view.attach(view_engine) as v:
        assert v is view and view.attached and hooks.attached()
        view_engine.generate(PROMPT, max_new_tokens=8)
    assert hooks.attached() == {} and not view.attached and len(view.frames) > 0

    with pytest.raises(RuntimeError, match="boom"):
        with MemoryView().attach(view_engine):
            raise RuntimeError("boom")
    assert hooks.attached() == {}

    views = [DenoiseView(view_engine), ExpertView(view_engine), MemoryView(view_engine), SpeedView(view_engine)]
    assert hooks.attached()
    views[0].attach(view_engine)  # re-attaching replaces, never doubles
    assert hooks.attached()["denoise.step"] == 2  # denoise + speed
    del views, v, view
    gc.collect()  # a view dropped without close() takes its hooks with it
    assert hooks.attached() == {}

    dash = Dashboard(view_engine)
    assert hooks.attached()
    dash.close()
    assert hooks.attached() == {}


# --------------------------------------------------------------------------- dashboard
def test_dashboard_generates_in_the_background_and_stops(view_engine):
    dash = Dashboard(view_engine, max_new_tokens=16, fps=1000)
    try:
        dash.chat.value = False
        res = dash.generate("w1 w2 w3", wait=True, threshold=0.3)
        assert res is not None and res.stats.new_tokens == 16
        assert dash["denoise"].tokens() == res.token_ids
        assert "done" in dash.status.value and dash.stop_button.disabled
        assert dash["speed"].summary()[-1]["forwards"] == res.stats.forwards

        # Stop while it runs: hold the run in its first step until stop() was pressed
        started, release = threading.Event(), threading.Event()

        def slow(ev):
            started.set()
            release.wait(5)

        # a permanent hook: the dashboard generates in its own thread, which scoped hooks of this
        # thread do not reach
        handle = view_engine.add_hook("denoise.step", slow)
        try:
            dash.max_new_tokens.value = 200
            dash.generate("w1 w2 w3")
            assert started.wait(10) and dash.running
            with pytest.raises(RuntimeError, match="running"):
                dash.generate()
            dash.stop()
            release.set()
            res = dash.wait(20)
        finally:
            handle.remove()
        assert res.stop_reason == "cancelled" and res.stats.new_tokens < 200
        assert not dash.running and not dash.generate_button.disabled
        assert set(view_engine.model.hooks.attached()) >= {"denoise.step"}  # the views, not the stop hook
        assert view_engine.model.hooks.attached()["denoise.step"] == 2
    finally:
        dash.close()
    assert view_engine.model.hooks.attached() == {}


def test_dashboard_settings_reach_the_engine(view_engine):
    dash = Dashboard(view_engine, max_new_tokens=12, views=("denoise",))
    try:
        dash.chat.value = False
        dash.mode.value = "ar"
        dash.coreset.value = 0
        res = dash.generate("w1 w2", wait=True)
        assert res.stats.mode == "ar" and res.stats.new_tokens == 12
        assert dash.settings()["coreset_size"] is None
        with pytest.raises(ValueError, match="unknown views"):
            Dashboard(view_engine, views=("nope",))
    finally:
        dash.close()
