"""Traces saved and read back without a model, and where two runs part (issue 17)."""
import json
import os

import pytest
import torch
from injected_faults import FULL, Writes, leftovers

import clover_lab
from clover_lab import CloverError, TraceError
from clover_lab.errors import InputError, OutputError
from clover_lab.hooks import points as P
from clover_lab.hooks.records import Record
from clover_lab.hooks.trace import Trace, load_trace

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]
KW = dict(max_new_tokens=32, threshold=0.3)
POINTS = ["denoise.step", "block.commit", "layers.*.moe.route", "layers.*.gdn.*", P.every_layer("output"),
          "final_norm.output"]


def record(engine, hooks=None, **kw):
    with engine.capture(POINTS) as cap, engine.hooks(hooks or {}):
        engine.generate(PROMPT, **{**KW, **kw})
    return cap


def test_save_and_load_round_trip(tiny_engine, tmp_path):
    cap = record(tiny_engine)
    cap.save(tmp_path / "a", meta={"prompt": PROMPT})
    trace = clover_lab.load_trace(tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["tensors.safetensors", "trace.json"]
    assert trace.points == cap.points and len(trace) == len(cap) and trace.meta["prompt"] == PROMPT
    assert trace.config == tiny_engine.model.config
    for a, b in zip(cap.records, trace.records):
        assert (a.point, a.run, a.phase, a.block, a.step, a.where) == (b.point, b.run, b.phase, b.block, b.step, b.where)
        assert a.data.keys() == b.data.keys()
        for k, v in a.data.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, b[k]) and b[k].device.type == "cpu"
            else:
                assert v == b[k]
    assert trace.by_step("denoise.step").keys() == cap.by_step("denoise.step").keys()
    assert trace.diff(trace) is None and trace.diff(clover_lab.load_trace(tmp_path / "a")) is None
    # saving again over it replaces it whole
    trace.save(tmp_path / "a", meta={"again": True})
    meta = clover_lab.load_trace(tmp_path / "a").meta
    assert meta["prompt"] == PROMPT and meta["again"] is True


def test_diff_names_the_first_place_two_runs_part(tiny_engine, tmp_path):
    a = record(tiny_engine)
    same = record(tiny_engine)
    a.save(tmp_path / "a")
    same.save(tmp_path / "same")
    ta, tsame = clover_lab.load_trace(tmp_path / "a"), clover_lab.load_trace(tmp_path / "same")
    assert ta.diff(tsame) is None  # two identical runs (the run counter differs, not the coordinates)

    def nudge(ev):
        if ev.block == 1 and ev.step == 0 and ev.mode == "preview":
            ev.value = ev.value + 0.5

    b = record(tiny_engine, {"layers.2.moe.output": nudge})
    b.save(tmp_path / "b")
    d = ta.diff(clover_lab.load_trace(tmp_path / "b"))
    # layer 2's output is the first recorded value the nudge reaches
    assert (d.block, d.step, d.point, d.layer, d.field) == (1, 0, "layers.2.output", 2, "value")
    assert d.max_abs_diff > 0.1 and "block 1, step 0, layers.2.output" in str(d)
    assert "field 'value' differs" in str(d) and "value values" not in str(d)  # notebook 06 read "value values differ"
    assert repr(ta) == f"Trace({len(ta.records)} records of {len(ta.points)} points, run {ta.runs[0]})"  # not "runs [94]"
    assert ta.diff(clover_lab.load_trace(tmp_path / "b"), atol=10.0, rtol=10.0) is not None  # tokens part later


def test_bad_traces_are_named(tmp_path, tiny_engine):
    with pytest.raises(FileNotFoundError, match="trace.json"):
        clover_lab.load_trace(tmp_path / "nothing")
    cap = record(tiny_engine, max_new_tokens=4)
    cap.save(tmp_path / "t")
    doc = json.loads((tmp_path / "t" / "trace.json").read_text())
    doc["version"] = 99
    (tmp_path / "t" / "trace.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="version 99"):
        clover_lab.load_trace(tmp_path / "t")
    (tmp_path / "t" / "trace.json").write_text("{not json")
    with pytest.raises(ValueError, match="trace.json: not valid JSON"):
        clover_lab.load_trace(tmp_path / "t")
    # a field a trace cannot hold: the error names it and nothing is written
    cap.records[0].data["odd"] = object()
    with pytest.raises(TypeError, match="odd"):
        cap.save(tmp_path / "u")
    assert not (tmp_path / "u").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".u")]


OTHER = [7, 8, 9, 200, 300]


# --------------------------------------------------------------------------- 8. traces
@pytest.fixture
def saved_trace(tiny_engine, tmp_path):
    points = ["denoise.step", "block.commit", "layers.0.moe.route", "layers.1.output"]
    with tiny_engine.capture(points) as cap:
        tiny_engine.generate(PROMPT, **KW)
    cap.save(tmp_path / "t")
    return tmp_path / "t"


def _edit(path, fn):
    doc = json.loads((path / "trace.json").read_text())
    fn(doc)
    (path / "trace.json").write_text(json.dumps(doc))


def _first(doc, point):
    return next(r for r in doc["records"] if r["point"] == point)


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.update(records={}), "'records' must be a list"),
    (lambda d: d["records"].append(5), "record .*: expected an object"),
    (lambda d: d["records"][0].pop("run"), "field 'run' is missing"),
    (lambda d: d["records"][0].update(block="zero"), "field 'block' = 'zero'"),
    (lambda d: d["records"][0].update(phase="later"), "field 'phase'"),
    (lambda d: d["records"][0].update(point="layers.9.nowhere"), "a point listed in 'points'"),
    (lambda d: d["records"][0].update(where=[1, 2]), "field 'where'"),
    (lambda d: _first(d, "layers.0.moe.route")["data"].pop("expert_ids"), "field 'expert_ids' is missing"),
    (lambda d: _first(d, "layers.0.moe.route")["data"].update(expert_ids=[[1, 2]]), "'expert_ids' must be a tensor"),
    (lambda d: _first(d, "layers.0.moe.route")["data"].update(expert_ids={"tensor": "nope"}), "'nope' is missing"),
    (lambda d: _first(d, "layers.0.moe.route")["data"].update(
        weights=_first(d, "layers.0.moe.route")["data"]["router_probs"]), "route fields disagree in shape"),
    (lambda d: _first(d, "layers.0.moe.route")["data"].update(mode="sideways"), "field 'mode' = 'sideways'"),
    (lambda d: _first(d, "layers.0.moe.route")["data"].update(positions={"dict": 3}), "field 'positions' cannot be"),
    (lambda d: _first(d, "layers.1.output")["data"].update(
        value=_first(d, "layers.0.moe.route")["data"]["router_probs"]), "'value' must be a floating tensor of 3"),
    (lambda d: _first(d, "denoise.step")["data"].update(
        canvas=_first(d, "denoise.step")["data"]["confidences"]), "'canvas' must be an integer tensor"),
    (lambda d: _first(d, "block.commit")["data"].update(steps="3"), "'steps' must be int"),
])
def test_an_edited_trace_is_named_at_load(saved_trace, edit, match):
    _edit(saved_trace, edit)
    with pytest.raises(clover_lab.TraceError, match=match) as info:
        clover_lab.load_trace(saved_trace)
    assert "trace.json" in str(info.value)


def test_route_records_are_checked_against_the_recorded_model(saved_trace, tiny_engine):
    from safetensors.torch import load_file, save_file

    doc = json.loads((saved_trace / "trace.json").read_text())
    name = _first(doc, "layers.0.moe.route")["data"]["expert_ids"]["tensor"]
    tensors = load_file(saved_trace / "tensors.safetensors")
    tensors[name] = tensors[name] + 100  # ids past the model's experts
    save_file(tensors, saved_trace / "tensors.safetensors")
    assert "config" in doc["meta"]  # a capture saves the recorded model's config
    with pytest.raises(clover_lab.TraceError, match=r"expert_ids outside \[0, 8\)"):
        clover_lab.load_trace(saved_trace)


def test_a_damaged_tensor_file_is_named(saved_trace):
    f = saved_trace / "tensors.safetensors"
    f.write_bytes(f.read_bytes()[:200])  # truncated
    with pytest.raises(clover_lab.TraceError, match="tensors.safetensors: cannot be read as safetensors"):
        clover_lab.load_trace(saved_trace)


def test_view_row_past_a_batched_traces_rows_is_an_error(tiny_engine, tmp_path):
    pytest.importorskip("ipywidgets")
    from clover_lab.widgets import DenoiseView

    with tiny_engine.capture(["denoise.step", "block.commit"]) as cap:
        tiny_engine.generate([PROMPT, OTHER], **KW)
    cap.save(tmp_path / "b")
    view = DenoiseView(fps=1000)
    view.row = 5
    with pytest.raises(InputError, match=r"row=5: the trace is of a batch of rows 0..1"):
        view.replay(clover_lab.load_trace(tmp_path / "b"))
    view.row = 1
    view.replay(clover_lab.load_trace(tmp_path / "b"))
    assert view.frames
    view.close()


def test_records_of_a_batch_or_of_another_type_are_refused_where_one_run_is_read(tiny_engine):
    from clover_lab import patching

    with tiny_engine.capture("layers.*[0-9].output") as cap:
        tiny_engine.generate([PROMPT, OTHER], **KW)
    with pytest.raises(InputError, match="batched generation"):
        patching.Source(cap.records)
    with pytest.raises(clover_lab.TraceError, match="Record objects"):
        clover_lab.Trace([{"point": "denoise.step"}], ["denoise.step"])
    with pytest.raises(InputError, match="pack_weights enabled='no'"):
        tiny_engine.model.pack_weights("no")
    from clover_lab.lens.routing_stats import route_stats

    with pytest.raises(InputError, match="progress='yes'"):
        route_stats(tiny_engine, [[1, 2, 3]], progress="yes")



# --------------------------------------------------------------------------- traces
def small_trace(value: float) -> Trace:
    records = [Record("layers.0.output", 0, "decode", 0, s, dict(layer=0, mode="preview", positions=torch.arange(4),
                                                                  value=torch.full((1, 4, 8), value + s)))
               for s in range(3)]
    return Trace(records, ["layers.0.output"], {"prompt": "p"})


def test_a_trace_is_never_saved_over_other_files(tmp_path, monkeypatch):
    """``save('.')`` used to empty the working directory: a directory holding anything but a
    trace is refused, and left as it was."""
    (tmp_path / "notebook.ipynb").write_text("{}")
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputError, match=r"\. holds files that are not a trace's \(data, notebook\.ipynb\)"):
        small_trace(1.0).save(".")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notebook.ipynb"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="is a file"):
        small_trace(1.0).save("file")
    small_trace(1.0).save("run")  # a new directory, and then a trace replaced by another
    small_trace(2.0).save("run")
    assert float(load_trace("run")["layers.0.output"][0]["value"][0, 0, 0]) == 2.0
    assert isinstance(OutputError("x"), CloverError) and isinstance(OutputError("x"), ValueError)


@pytest.mark.parametrize("fail_at", [1, 2], ids=["tensors", "json"])
@pytest.mark.parametrize("error", [FULL, KeyboardInterrupt()], ids=["disk-full", "interrupt"])
def test_a_failed_trace_save_leaves_the_previous_trace(tmp_path, monkeypatch, fail_at, error):
    small_trace(1.0).save(tmp_path / "t")
    with monkeypatch.context() as m:
        Writes(m, fail_at=fail_at, error=error)
        with pytest.raises(type(error)):
            small_trace(2.0).save(tmp_path / "t")
    assert float(load_trace(tmp_path / "t")["layers.0.output"][0]["value"][0, 0, 0]) == 1.0
    assert not leftovers(tmp_path)
    with monkeypatch.context() as m:  # a first save that fails leaves no directory that loads
        Writes(m, fail_at=fail_at, error=error)
        with pytest.raises(type(error)):
            small_trace(2.0).save(tmp_path / "new")
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "new")


def test_an_unfinished_trace_is_refused(tmp_path, monkeypatch):
    small_trace(1.0).save(tmp_path / "t")
    real, calls = os.replace, []

    def crash(src, dst):
        calls.append(dst)
        if len(calls) == 3:  # the marker, the tensors, then the crash before trace.json
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        small_trace(2.0).save(tmp_path / "t")
    monkeypatch.undo()
    with pytest.raises(TraceError, match=r"an unfinished save: it stopped while putting tensors\.safetensors, "
                                              r"trace\.json in place"):
        load_trace(tmp_path / "t")


# --------------------------------------------------------------------------- what a save and a diff are given
@pytest.mark.parametrize("meta, said", [({"x": {1, 2}}, r"meta\['x'\] is set"), ({"x": [object()]}, r"meta\['x'\]\[0\] is object"),
                                        ({"x": {3: "a"}}, r"meta\['x'\] has the key 3, not a string"),
                                        ([1, 2], "meta must be a dict")])
def test_save_meta_json_cannot_hold_is_named_and_nothing_written(tiny_engine, tmp_path, meta, said):
    """save(meta=...) with a value JSON cannot hold was json's TypeError from deep inside."""
    with tiny_engine.capture(["denoise.step"]) as cap:
        tiny_engine.generate([1, 2, 3], max_new_tokens=4)
    for target in (cap, load_trace_of(cap, tmp_path / "ok")):
        with pytest.raises(InputError, match=said):
            target.save(tmp_path / "t", meta=meta)
        assert not (tmp_path / "t").exists()


def load_trace_of(cap, path):
    cap.save(path)
    return load_trace(path)


def test_a_capture_on_the_meta_device_is_refused_at_save(tiny_engine, tmp_path):
    """capture(to="meta") then save was NotImplementedError ("Cannot copy out of meta tensor")."""
    with tiny_engine.capture(["denoise.step", "layers.*.output"], to="meta") as cap:
        tiny_engine.generate([1, 2, 3], max_new_tokens=4)
    with pytest.raises(InputError, match="on the meta device .* keeps shapes, not values.*capture with to='cpu'"):
        cap.save(tmp_path / "t")
    assert not (tmp_path / "t").exists()
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="capture: to='cuda' cannot be used here"):
            tiny_engine.capture(["denoise.step"], to="cuda")


@pytest.mark.parametrize("other", [None, "trace", 3, [1, 2]])
def test_diff_with_what_is_no_run_is_named(tiny_engine, tmp_path, other):
    """Trace.diff(None) was AttributeError: 'NoneType' object has no attribute 'records'."""
    with tiny_engine.capture(["denoise.step"]) as cap:
        tiny_engine.generate([1, 2, 3], max_new_tokens=4)
    trace = load_trace_of(cap, tmp_path / "t")
    with pytest.raises(InputError, match=f"Trace.diff: other must be a Trace or a Capture .*got {type(other).__name__}"):
        trace.diff(other)
    assert trace.diff(cap) is None  # a capture is a run's records too
