"""Traces saved and read back without a model, and where two runs part (issue 17)."""
import json

import pytest
import torch

import clover_lab
from clover_lab.hooks import points as P

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
