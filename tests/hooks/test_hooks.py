"""Hooks over generations (spec section 5): engine events, interventions, errors, capture, cost."""
import threading

import pytest
import torch

import clover_lab
from clover_lab import (
    CloverError,
    CommitEvent,
    Engine,
    HookError,
    StepEvent,
    StopGeneration,
)
from clover_lab.engine.requests import settings_for_mode
from clover_lab.errors import InputError

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]
KW = dict(max_new_tokens=40, threshold=0.3)


# --------------------------------------------------------------------------- engine events
def test_step_and_commit_events_payloads_order_and_counts(tiny_engine):
    seen = []

    def on_step(ev: StepEvent):
        assert isinstance(ev, StepEvent)
        m = ev.canvas.shape[0]
        assert ev.canvas.dtype == torch.long and ev.masked == sorted(ev.masked)
        assert ev.candidates.shape == (len(ev.masked),) and ev.confidences.shape == (len(ev.masked),)
        assert set(ev.unmask) <= set(ev.masked) and ev.unmask
        mask = tiny_engine.mask_token_id
        assert [p for p in range(m) if int(ev.canvas[p]) == mask] == ev.masked  # canvas before this step
        if ev.step == 0:
            assert ev.masked == list(range(m))
        assert ev.candidate(ev.masked[0]) == int(ev.candidates[0])
        seen.append(("step", ev.block, ev.step, ev.time, list(ev.unmask)))

    def on_commit(ev: CommitEvent):
        seen.append(("commit", ev.block, list(ev.tokens), ev.steps, ev.start, ev.time))

    with tiny_engine.hooks({"denoise.step": on_step, "block.commit": on_commit}):
        r = tiny_engine.generate(PROMPT, **KW)
    steps = [e for e in seen if e[0] == "step"]
    commits = [e for e in seen if e[0] == "commit"]
    assert len(steps) == r.stats.preview_forwards and len(commits) == r.stats.blocks == 3
    # order: the steps of block b, then its commit, then the steps of block b + 1
    expected = []
    for b, n in enumerate(r.stats.steps_per_block):
        expected += [("step", b, s) for s in range(n)] + [("commit", b)]
    assert [e[:3] if e[0] == "step" else e[:2] for e in seen] == expected
    assert [t for e in commits for t in e[2]] == r.token_ids
    assert [e[3] for e in commits] == r.stats.steps_per_block
    assert [e[4] for e in commits] == [len(PROMPT), len(PROMPT) + 16, len(PROMPT) + 32]
    times = [e[3] if e[0] == "step" else e[5] for e in seen]
    assert times == sorted(times)
    # hooks that only observe change nothing
    assert tiny_engine.generate(PROMPT, **KW).token_ids == r.token_ids


def test_step_hook_veto_add_and_set_token(tiny_engine):
    base = tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=0.05)
    assert max(base.stats.steps_per_block) < 16

    with tiny_engine.hooks({"denoise.step": lambda ev: ev.veto(ev.unmask[1:])}):
        one = tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=0.05)
    assert one.stats.steps_per_block == [16, 16]

    with tiny_engine.hooks({"denoise.step": lambda ev: ev.add(ev.masked)}):
        fast = tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=0.99)
    assert fast.stats.steps_per_block == [1, 1] and fast.stats.tokens_per_forward == pytest.approx(32 / 3)

    def sevens(ev):
        if ev.block == 1:
            for p in list(ev.unmask):
                ev.set_token(p, 7)

    with tiny_engine.hooks({"denoise.step": sevens}):
        r = tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=0.3)
    same = tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=0.3)
    assert r.token_ids[16:] == [7] * 16 and r.token_ids[:16] == same.token_ids[:16]


def test_step_hook_may_veto_everything_for_a_while(tiny_engine):
    calls = []

    def stubborn(ev):
        calls.append(ev.step)
        if ev.step < 3:
            ev.unmask = []

    with tiny_engine.hooks({"denoise.step": stubborn}):
        r = tiny_engine.generate(PROMPT, max_new_tokens=16, threshold=0.3)
    assert len(r.token_ids) == 16 and calls[:3] == [0, 1, 2] and r.stats.steps_per_block[0] > 3

    with tiny_engine.hooks({"denoise.step": lambda ev: setattr(ev, "unmask", [])}):
        with pytest.raises(HookError, match="past the step limit"):
            tiny_engine.generate(PROMPT, max_new_tokens=16, threshold=0.3, max_steps_per_block=2)


def test_step_hook_bad_changes_are_hook_errors(tiny_engine):
    def bad_position(ev):
        if ev.step == 1:
            ev.unmask.append(next(p for p in range(16) if p not in ev.masked))

    with tiny_engine.hooks({"denoise.step": bad_position}):
        with pytest.raises(HookError, match="denoise.step.*not masked"):
            tiny_engine.generate(PROMPT, max_new_tokens=16, threshold=0.9)
    with tiny_engine.hooks({"denoise.step": lambda ev: ev.set_token(ev.masked[0], 10_000)}):
        with pytest.raises(HookError, match="vocabulary"):
            tiny_engine.generate(PROMPT, max_new_tokens=16)


@pytest.mark.parametrize("how", ["event.stop", "raise"])
def test_step_hook_stops_the_run(tiny_engine, how):
    base = tiny_engine.generate(PROMPT, **KW)

    def stopper(ev):
        if ev.block == 1 and ev.step == 1:
            if how == "raise":
                raise StopGeneration
            ev.stop()

    with tiny_engine.capture(["denoise.step", "block.commit"]) as cap:
        with tiny_engine.hooks({"denoise.step": stopper}):
            r = tiny_engine.generate(PROMPT, **KW)
    assert r.stats.stop_reason == "hook" and r.token_ids[:16] == base.token_ids[:16]
    assert 16 <= len(r.token_ids) < 32
    assert r.token_ids[16:] == base.token_ids[16:len(r.token_ids)]  # the block's resolved prefix is kept
    assert max(rec.block for rec in cap["denoise.step"]) == 1
    assert tiny_engine.generate(PROMPT, **KW).token_ids == base.token_ids


def test_commit_and_model_hooks_stop_the_run(tiny_engine):
    base = tiny_engine.generate(PROMPT, **KW)

    def stop_after_first(ev):
        raise StopGeneration

    with tiny_engine.hooks({"block.commit": stop_after_first}):
        r = tiny_engine.generate(PROMPT, **KW)
    assert r.token_ids == base.token_ids[:16] and r.stats.stop_reason == "hook" and r.stats.cache_complete

    def stop_in_fused_forward(ev):
        if ev.mode == "commit" and ev.positions.numel() == 16:
            raise StopGeneration

    with tiny_engine.hooks({"layers.0.moe.route": stop_in_fused_forward}):
        r = tiny_engine.generate(PROMPT, **KW)
    # the finished first block is returned, but its commit never happened
    assert r.token_ids == base.token_ids[:16] and not r.stats.cache_complete and r.stats.stop_reason == "hook"
    with tiny_engine.hooks({"block.commit": lambda ev: ev.stop()}):
        ar = tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=5)
    assert len(ar.token_ids) == 1 and ar.stats.stop_reason == "hook"


# --------------------------------------------------------------------------- a raising hook
@pytest.mark.parametrize("point,when", [
    ("denoise.step", lambda ev: ev.block == 1),
    ("block.commit", lambda ev: ev.block == 1),
    ("layers.1.moe.route", lambda ev: ev.mode == "preview" and int(ev.positions[0]) >= len(PROMPT) + 16),
    ("layers.0.gdn.state", lambda ev: ev.length > len(PROMPT)),
    ("layers.2.gdn.preview", lambda ev: int(ev.positions[0]) >= len(PROMPT) + 16),
])
def test_raising_hook_names_the_point_and_leaves_the_engine_usable(gen_model, point, when):
    engine = Engine(gen_model)
    fresh = Engine(gen_model).generate(PROMPT, **KW)

    def boom(ev):
        if when(ev):
            raise ZeroDivisionError("boom")

    handle = engine.add_hook(point, boom)
    try:
        with pytest.raises(HookError, match=point.replace(".", r"\.")) as info:
            engine.generate(PROMPT, **KW)
    finally:
        handle.remove()
    assert info.value.point == point and isinstance(info.value.__cause__, ZeroDivisionError)
    assert not gen_model.hooks.attached()
    again = engine.generate(PROMPT, **KW)
    assert again.token_ids == fresh.token_ids and again.stats.steps_per_block == fresh.stats.steps_per_block


def test_scoped_hooks_are_removed_on_exceptions(tiny_engine):
    with pytest.raises(HookError):
        with tiny_engine.hooks({"denoise.step": lambda ev: 1 / 0, "layers.*.moe.route": lambda ev: None}):
            assert tiny_engine.model.hooks.active("layers.3.moe.route")
            tiny_engine.generate(PROMPT, **KW)
    assert not tiny_engine.model.hooks.attached()
    handle = tiny_engine.add_hook("block.commit", lambda ev: None)
    assert tiny_engine.model.hooks.attached() == {"block.commit": 1}
    handle.remove()
    assert not tiny_engine.model.hooks.attached()
    with pytest.raises(KeyError, match="denoise.stepp"):
        tiny_engine.add_hook("denoise.stepp", lambda ev: None)


# --------------------------------------------------------------------------- model interventions
def test_banned_expert_never_appears_in_later_route_events(tiny_engine):
    used = set()
    with tiny_engine.hooks({"layers.*.moe.route": lambda ev: used.update(ev.expert_ids.unique().tolist())}):
        base = tiny_engine.generate(PROMPT, **KW)
    assert 0 in used
    after = []
    with tiny_engine.hooks({"layers.*.moe.route": [lambda ev: ev.ban([0]), lambda ev: after.append(ev.expert_ids)]}):
        banned = tiny_engine.generate(PROMPT, **KW)
    assert after and all(0 not in ids.unique().tolist() for ids in after)
    assert banned.token_ids != base.token_ids
    forced = set()
    with tiny_engine.hooks({"layers.*.moe.route": [lambda ev: ev.force([1, 2]),
                                                  lambda ev: forced.update(ev.expert_ids.unique().tolist())]}):
        tiny_engine.generate(PROMPT, **KW)
    assert forced == {1, 2}


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_editing_gdn_state_changes_the_output(tiny_engine, mode):
    base = tiny_engine.generate(PROMPT, mode=mode, **settings_for_mode(mode, KW))

    def wipe(ev):
        ev.state.zero_()

    with tiny_engine.hooks({"layers.*.gdn.state": wipe}):
        wiped = tiny_engine.generate(PROMPT, mode=mode, **settings_for_mode(mode, KW))
    assert wiped.token_ids != base.token_ids

    def scale(ev):
        ev.state = ev.state * 10.0  # assigning a new tensor works too

    with tiny_engine.hooks({"layers.*.gdn.state": scale}):
        scaled = tiny_engine.generate(PROMPT, mode=mode, **settings_for_mode(mode, KW))
    assert scaled.token_ids != base.token_ids


def test_erasing_every_gdn_state_leaves_every_preview_reading_nothing(tiny_engine):
    # notebook 04: erasing every GDN layer changed fewer tokens than erasing layer 0 alone; the erase
    # is what it says: after it, every preview of every GDN layer reads a zero memory (h_t = 0),
    # and an erase of one layer leaves the others reading theirs
    gdn = tiny_engine.model.config.gdn_layers()

    def run(erased):
        reads = {layer: [] for layer in gdn}

        def erase(ev):
            if ev.layer in erased:
                ev.state = torch.zeros_like(ev.state)

        def read(ev):
            reads[ev.layer].append(float(ev.history_reads.abs().max()))

        with tiny_engine.hooks({"layers.*.gdn.state": erase, "layers.*.gdn.preview": read}):
            tiny_engine.generate(PROMPT, **KW)
        return reads

    every = run(set(gdn))
    assert all(r and max(r) == 0.0 for r in every.values()), every
    one = run({gdn[0]})
    assert max(one[gdn[0]]) == 0.0 and all(max(one[layer]) > 0 for layer in gdn[1:]), one


# --------------------------------------------------------------------------- capture
def test_capture_records_points_tagged_by_block_and_step(tiny_engine):
    points = ["layers.*.moe.route", "layers.*.gdn.preview", "denoise.step", "block.commit"]
    with tiny_engine.capture(points) as cap:
        r = tiny_engine.generate(PROMPT, **KW)
    assert not tiny_engine.model.hooks.attached()
    cfg = tiny_engine.model.config
    n_gdn, n_layers = len(cfg.gdn_layers()), cfg.num_hidden_layers
    assert "layers.0.moe.route" in cap.points and "layers.3.gdn.preview" not in cap.points
    steps = cap.by_step("denoise.step")
    assert len(steps) == r.stats.preview_forwards
    assert sorted(k for k in steps) == [(b, s) for b, n in enumerate(r.stats.steps_per_block) for s in range(n)]
    previews = [rec for rec in cap["layers.*.moe.route"] if rec["mode"] == "preview"]
    assert len(previews) == n_layers * r.stats.preview_forwards
    assert {(rec.block, rec.step) for rec in previews} == set(steps)
    assert len(cap["layers.*.gdn.preview"]) == n_gdn * r.stats.preview_forwards
    hist = cap["layers.0.gdn.preview"][0]["history_weights"]
    assert hist.shape == (1, 16, cfg.linear_num_value_heads) and ((hist > 0) & (hist < 1)).all()
    commits = [rec for rec in cap["layers.*.moe.route"] if rec["mode"] == "commit"]
    assert {rec.block for rec in commits} == {None, 0, 1, 2}
    assert {rec.phase for rec in commits if rec.block is None} == {"prefill"}
    assert [rec["tokens"] for rec in cap["block.commit"]] == [r.token_ids[:16], r.token_ids[16:32], r.token_ids[32:]]
    first = cap["denoise.step"][0]
    assert first.block == 0 and first.step == 0 and first["canvas"].device == tiny_engine.model.device
    with pytest.raises(KeyError):
        cap["layers.*.gdn.state"]


def test_capture_to_cpu_across_runs_and_ar(tiny_engine):
    with tiny_engine.capture(["layers.0.gdn.state", "block.commit"], to="cpu") as cap:
        tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=4)
        tiny_engine.generate(PROMPT, max_new_tokens=8, threshold=0.3)
    states = cap["layers.0.gdn.state"]
    assert all(rec["state"].device.type == "cpu" for rec in states)
    runs = sorted({rec.run for rec in cap.records})
    assert len(runs) == 2
    ar = [rec for rec in cap["block.commit"] if rec.run == runs[0]]
    assert [rec.block for rec in ar] == [0, 1, 2, 3] and all(rec["steps"] == 1 for rec in ar)
    assert [rec["length"] for rec in states if rec.run == runs[0]] == [10, 11, 12, 13, 14]
    # a captured state is a copy: later commits do not change it
    assert not torch.equal(states[0]["state"], states[1]["state"])


# --------------------------------------------------------------------------- cost when idle
def test_no_events_are_built_without_hooks(tiny_engine, monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("an event was built with no hook attached")

    for where in ("engine.diffusion.StepEvent", "engine.row.CommitEvent", "model.layers.moe.RouteEvent",
                  "model.layers.gdn.GDNPreviewEvent", "model.layers.gdn.GDNStateEvent"):
        monkeypatch.setattr(f"clover_lab.{where}", forbidden)
    tiny_engine.generate(PROMPT, **KW)
    tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=4)


def test_observing_hooks_add_no_host_syncs(tiny_engine, monkeypatch):
    """Count the tensor -> host reads of a generation with and without observing hooks, by caller."""
    import sys

    count = {}

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *a, **k):
            caller = sys._getframe(1).f_code.co_filename
            count[caller] = count.get(caller, 0) + 1
            return original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapper)

    for name in ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"):
        counting(name)

    def run(mode, packed=True):
        count.clear()
        tiny_engine.loop.packed = packed
        try:
            r = tiny_engine.generate(PROMPT, mode=mode, **settings_for_mode(mode, KW))
        finally:
            tiny_engine.loop.packed = True
        return dict(count), r

    for mode in ("diffusion", "ar"):
        # hooks inside the model take the per-group forwards (a packed step fires no model event):
        # compared on that path without them
        plain, r = run(mode, packed=False)
        with tiny_engine.hooks({"*": lambda ev: None}):
            observed, r2 = run(mode)
        assert r2.token_ids == r.token_ids
        assert observed == plain
        # the engine's own reads: one per denoising step (the unmask decision) or per AR token
        engine_reads = sum(n for f, n in plain.items() if f.endswith(("engine/diffusion.py", "engine/ar.py", "sampling.py")))
        assert engine_reads == (r.stats.preview_forwards if mode == "diffusion" else r.stats.new_tokens)
        packed, r3 = run(mode)  # the packed step reads as often, all rows' decisions at once
        assert r3.token_ids == r.token_ids
        assert sum(n for f, n in packed.items() if "/engine/" in f) == engine_reads, packed


def test_model_events_carry_their_block_and_step(tiny_engine):
    """Route, preview and state events say where the generation stood, without asking the engine:
    prefill routes carry no block, a preview's rows its block and step, a commit's rows the block
    they commit (at no step); ``run`` counts generations."""
    seen = []

    def keep(ev):
        seen.append((type(ev).__name__, getattr(ev, "mode", None), ev.where.run, ev.phase, ev.block, ev.step))

    with tiny_engine.hooks({"layers.*.moe.route": keep, "layers.*.gdn.*": keep, "denoise.step": keep,
                            "block.commit": keep}):
        tiny_engine.generate(PROMPT, **KW)
    runs = {s[2] for s in seen}
    assert len(runs) == 1 and runs.pop() >= 1
    prefill = [s for s in seen if s[3] == "prefill"]
    assert prefill and all(s[4] is None and s[5] is None for s in prefill)
    steps = {(s[4], s[5]) for s in seen if s[0] == "StepEvent"}
    previews = {(s[4], s[5]) for s in seen if s[0] == "GDNPreviewEvent" or s[1] == "preview"}
    assert previews == steps  # every preview's events sit at a denoising step of the engine
    commits = {s[4] for s in seen if s[0] == "CommitEvent"}
    committed = {s[4] for s in seen if s[3] == "decode" and (s[0] == "GDNStateEvent" or s[1] == "commit")}
    assert committed == commits and all(s[5] is None for s in seen if s[0] == "GDNStateEvent")


KW_20 = dict(max_new_tokens=20, threshold=0.3)


# --------------------------------------------------------------------------- 9. hook outputs assigned directly
def _set(name, value):
    return lambda ev: setattr(ev, name, value(ev) if callable(value) else value)


def test_hooks_writing_nan_are_hook_errors(tiny_engine):
    cases = {
        "layers.0.gdn.state": lambda ev: ev.state.fill_(float("nan")),  # in place
        "layers.1.gdn.state": lambda ev: setattr(ev, "state", ev.state * float("inf")),  # assigned
        "layers.2.moe.route": lambda ev: ev.weights.fill_(float("nan")),
        "layers.3.moe.route": lambda ev: setattr(ev, "weights", ev.weights / 0.0),
    }
    for point, hook in cases.items():
        with tiny_engine.hooks({point: hook}):
            with pytest.raises(HookError, match=point.replace(".", r"\.") + ".*NaN or inf") as info:
                tiny_engine.generate(PROMPT, **KW_20)
        assert info.value.point == point


# --------------------------------------------------------------------------- 3. StopGeneration in the prefill
@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_stop_generation_during_the_prefill_ends_the_run_cleanly(tiny_engine, mode):
    base = tiny_engine.generate(PROMPT, mode=mode, **settings_for_mode(mode, KW_20))

    def stop_in_prefill(ev):
        if ev.phase == "prefill":
            raise StopGeneration

    with tiny_engine.hooks({"layers.0.moe.route": stop_in_prefill}):
        r = tiny_engine.generate(PROMPT, mode=mode, **settings_for_mode(mode, KW_20))
        updates = list(tiny_engine.stream(PROMPT, mode=mode, **settings_for_mode(mode, KW_20)))
    assert r.token_ids == [] and r.stop_reason == "hook" and not r.stats.cache_complete
    assert [u.kind for u in updates] == ["done"] and updates[0].result.token_ids == []
    assert tiny_engine.generate(PROMPT, mode=mode, **settings_for_mode(mode, KW_20)).token_ids == base.token_ids


# --------------------------------------------------------------------------- 5. hooks and captures per thread
def test_scoped_hooks_and_captures_stay_in_their_thread(tiny_engine):
    base = tiny_engine.generate(PROMPT, **KW_20)
    with tiny_engine.hooks({"layers.*.moe.route": lambda ev: ev.ban([0, 1])}):
        banned = tiny_engine.generate(PROMPT, **KW_20)
    assert banned.token_ids != base.token_ids
    both_submitted = threading.Barrier(2, timeout=60)  # then their rows share the engine's steps
    results, errors = {}, []

    def rerouting():
        torch.set_num_threads(1)  # as the main thread: the same sums in the same order
        try:
            with tiny_engine.capture(["denoise.step", "layers.0.moe.route"]) as cap:
                with tiny_engine.hooks({"layers.*.moe.route": lambda ev: ev.ban([0, 1])}):
                    handle = tiny_engine.submit(clover_lab.Request(PROMPT, **KW_20), emit=False)
                    both_submitted.wait()
                    results["a"] = tiny_engine.wait(handle)
            results["a_runs"] = {rec.run for rec in cap.records}
            results["a_steps"] = len(cap["denoise.step"])
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def plain():
        torch.set_num_threads(1)
        try:
            seen = []
            with tiny_engine.hooks({"denoise.step": lambda ev: seen.append(ev.run)}):
                handle = tiny_engine.submit(clover_lab.Request(PROMPT, **KW_20), emit=False)
                both_submitted.wait()
                results["b"] = tiny_engine.wait(handle)
            results["b_runs"] = set(seen)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=rerouting), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert results["a"].token_ids == banned.token_ids  # its scoped hooks applied to its generation
    assert results["b"].token_ids == base.token_ids  # and never to the other thread's
    assert len(results["a_runs"]) == 1 and results["a_steps"] == results["a"].stats.preview_forwards
    assert len(results["b_runs"]) == 1 and results["b_runs"] != results["a_runs"]

    seen = []  # a permanent hook reaches every thread
    handle = tiny_engine.add_hook("block.commit", lambda ev: seen.append(threading.get_ident()))
    try:
        t = threading.Thread(target=lambda: tiny_engine.generate(PROMPT, **KW_20))
        t.start()
        t.join(60)
        tiny_engine.generate(PROMPT, **KW_20)
    finally:
        handle.remove()
    assert len(set(seen)) == 2


def test_a_generation_keeps_the_hooks_of_where_it_started(tiny_engine):
    """A stream started inside a scope keeps its hooks until the scope closes; one started
    outside is not reached by a scope opened later."""
    calls = []
    outside = tiny_engine.stream(PROMPT, **KW_20)
    with tiny_engine.hooks({"denoise.step": lambda ev: calls.append(ev.where.run)}):
        inside = tiny_engine.stream(PROMPT, **KW_20)
        list(outside)
        result = list(inside)[-1].result
    assert calls and set(calls) == {calls[0]} and len(calls) == result.stats.preview_forwards


@pytest.mark.parametrize("point,hook,match", [
    ("layers.0.moe.route", _set("expert_ids", -1), "expert_ids must be an integer tensor"),
    ("layers.0.moe.route", _set("expert_ids", 99), "expert_ids must be an integer tensor"),
    ("layers.0.moe.route", _set("expert_ids", lambda ev: ev.expert_ids + 99), r"expert_ids must be in \[0, 8\)"),
    ("layers.0.moe.route", lambda ev: ev.expert_ids.fill_(-1), r"expert_ids must be in \[0, 8\)"),
    ("layers.0.moe.route", _set("expert_ids", lambda ev: ev.expert_ids[:, :1]), "weights must have expert_ids' shape"),
    ("layers.0.moe.route", _set("weights", lambda ev: ev.weights[:1]), "weights must have expert_ids' shape"),
    ("layers.0.moe.route", _set("weights", lambda ev: ev.weights.long()), "weights must be a floating tensor"),
    ("layers.0.moe.route", lambda ev: ev.force([1, 2], weights=[0.5, 0.25, 0.25]), "force: weights must have shape"),
    ("layers.0.moe.route", lambda ev: ev.force([1, 99]), r"force: expected expert ids .* in \[0, 8\)"),
    ("layers.0.moe.route", lambda ev: ev.force([1.5, 2]), "force: expected integer expert ids"),
    ("layers.0.moe.route", lambda ev: ev.ban("x"), "ban: expected expert ids"),
    ("layers.0.moe.route", lambda ev: ev.force([1, 2], weights=[1e38, 1e38]), r"beyond \+-1e\+06"),
    ("layers.0.gdn.state", _set("state", None), "state must be a floating tensor"),
    ("layers.0.gdn.state", _set("state", lambda ev: ev.state[:, :1]), "a hook set a state of shape"),
    ("layers.0.gdn.state", _set("ring", lambda ev: ev.ring.long()), "ring must be a floating tensor"),
])
def test_hook_outputs_are_checked_where_the_layer_reads_them(tiny_engine, point, hook, match):
    with tiny_engine.hooks({point: hook}):
        with pytest.raises(HookError, match=match) as info:
            tiny_engine.generate(PROMPT, **KW_20)
    assert info.value.point == point


def test_valid_assigned_hook_outputs_still_work(tiny_engine):
    base = tiny_engine.generate(PROMPT, **KW_20)
    with tiny_engine.hooks({"layers.*.moe.route": [_set("expert_ids", lambda ev: ev.expert_ids.clone()),
                                                  _set("weights", lambda ev: ev.weights.clone())],
                            "layers.*.gdn.state": _set("state", lambda ev: ev.state.clone())}):
        same = tiny_engine.generate(PROMPT, **KW_20)
    assert same.token_ids == base.token_ids
    with tiny_engine.hooks({"layers.*.moe.route": lambda ev: ev.force([1, 2, 3], weights=[0.5, 0.25, 0.25])}):
        assert len(tiny_engine.generate(PROMPT, **KW_20).token_ids) == KW_20["max_new_tokens"]


# --------------------------------------------------------------------------- 10. the mask token in results
def test_a_step_hook_cannot_place_the_mask_token(tiny_engine):
    mask = tiny_engine.mask_token_id
    with tiny_engine.hooks({"denoise.step": lambda ev: ev.set_token(ev.masked[0], mask)}):
        with pytest.raises(HookError, match=f"mask token {mask}"):
            tiny_engine.generate(PROMPT, **KW_20)


def test_editing_event_candidates_cannot_split_canvas_and_result(tiny_engine):
    """The event's candidates are a copy: editing them changes neither the device canvas nor the
    returned tokens, so the two cannot disagree (set_token is the way to change a token)."""
    base = tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=0.9)
    assert max(base.stats.steps_per_block) > 1  # later steps preview a canvas the edit would have changed
    with tiny_engine.hooks({"denoise.step": lambda ev: ev.candidates.fill_(7)}):
        r = tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=0.9)
    assert r.token_ids == base.token_ids and r.stats.steps_per_block == base.stats.steps_per_block


def test_unbounded_reentrant_generate_is_refused_briefly(tiny_engine):
    depth = []

    def again(ev):
        depth.append(1)
        tiny_engine.generate(PROMPT, max_new_tokens=4)

    with tiny_engine.hooks({"denoise.step": again}):
        with pytest.raises(HookError, match="nested generations") as info:
            tiny_engine.generate(PROMPT, max_new_tokens=4)
    assert len(str(info.value)) < 2000 and len(depth) == 4
    assert len(tiny_engine.generate(PROMPT, max_new_tokens=4).token_ids) == 4


def test_reentrant_generation_past_the_limit_is_one_hook_error(tiny_engine):
    def again(ev):
        tiny_engine.generate(PROMPT, max_new_tokens=4)

    with tiny_engine.hooks({"denoise.step": again}):
        with pytest.raises(clover_lab.HookError) as info:
            tiny_engine.generate(PROMPT, max_new_tokens=4)
    message = str(info.value)
    assert message.count("HookError") == 0 and message.count("hook on") == 1 and "4 levels deep" in message


def test_malformed_point_names_are_named(tiny_engine):
    from clover_lab.hooks import points as P

    for name in ("layers.x.output", "layers.3", "layers..output"):
        with pytest.raises(InputError, match="expected layers"):
            P.parse(name)
        with pytest.raises(KeyError, match=f"unknown hook point '{name}'"):  # a KeyError still
            tiny_engine.capture(name)
    with pytest.raises(CloverError, match="named by a string"):
        tiny_engine.capture([3])


def test_a_hooks_block_closing_on_a_request_still_running_says_so(tiny_engine):
    """Hooks scoped by a `with` block stopped applying to a request still running once the block
    exited, without a word."""
    from clover_lab.engine.engine import HooksClosedWarning

    seen = []
    with pytest.warns(HooksClosedWarning, match=r"request\(s\) \d+, submitted inside it and still running"):
        with tiny_engine.hooks({"block.commit": lambda ev: seen.append(ev.block)}):
            handle = tiny_engine.submit(clover_lab.Request(PROMPT, max_new_tokens=8))
    tiny_engine.wait(handle)
    assert seen == []  # the hooks did not apply after the block: what the warning said
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", HooksClosedWarning)  # waited for inside the block: nothing to say
        with tiny_engine.hooks({"block.commit": lambda ev: seen.append(ev.block)}):
            tiny_engine.wait(tiny_engine.submit(clover_lab.Request(PROMPT, max_new_tokens=8)))
    assert seen == [0]
