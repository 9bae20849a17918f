"""Steering schedules as data (issue 42): spans, steers and schedules are checked when made, list
themselves, and round-trip through save/load; a bad file is named, a failed save leaves the old one."""
import json

import pytest
import torch

from clover_lab.errors import InputError, OutputError
from clover_lab.steering import Schedule, ScheduleError, Span, Steer
from injected_faults import FULL, Writes, leftovers

H = 16


def _vec(seed=0):
    return torch.randn(H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("given, inside, outside, text", [
    (None, [0, 5, 99], [None], "all"),
    ("all", [0, 7], [], "all"),
    ("0:2", [0, 1], [2, 3], "0-1"),
    ("3:", [3, 40], [0, 2], "3 on"),
    (":1", [0], [1], "0"),
    (slice(2, 4), [2, 3], [1, 4], "2-3"),
    ([3, 2], [2, 3], [1, 4], "2, 3"),
    (range(1, 3), [1, 2], [0, 3], "1, 2"),
    (4, [4], [3, 5], "4"),
])
def test_spans(given, inside, outside, text):
    span = Span.parse(given, "steps")
    assert all(i in span for i in inside) and not any(i in span for i in outside)
    assert str(span) == text
    assert Span.parse(span.to_json(), "steps") == span  # its JSON form reads back as itself


@pytest.mark.parametrize("bad, match", [
    ("", "expected 'a:b'"), ("a:b", "bounds"), ("2:1", "empty"), ("1:2:3", "expected 'a:b'"), ([], "empty"),
    ([-1], "not an index"), (True, "expected an int"), (slice(0, 4, 2), "no step"), (1.5, "expected an int"),
])
def test_bad_spans_are_named(bad, match):
    with pytest.raises(InputError, match=match):
        Span.parse(bad, "steps")


def test_a_steer_is_checked_when_made():
    v = _vec()
    s = Steer(v, 2, layers=1)
    assert s.layers == (1,) and s.coefficient == 2.0 and s.parts == ("preview",) and s.positions == "all"
    assert torch.equal(s.vector, 2 * v) and s.direction is not v  # a copy: the caller's tensor may change
    for kwargs, match in [
        (dict(direction=torch.zeros(2, H)), "1-D float"), (dict(direction=torch.arange(H)), "1-D float"),
        (dict(direction=torch.full((H,), float("nan"))), "NaN"), (dict(coefficient=float("inf")), "finite"),
        (dict(coefficient=True), "finite"), (dict(layers=[]), "layers"), (dict(layers=[-1]), "not an index"),
        (dict(layers="2"), "layers"), (dict(kind="moe.route"), "not a residual point"),
        (dict(positions="some"), "positions"), (dict(positions=5), r"\(5,\)"), (dict(positions=[]), "positions"),
        (dict(parts=["decode"]), "parts"), (dict(steps="x"), "steps"), (dict(blocks=[-2]), "not an index"),
    ]:
        args = dict(direction=v, coefficient=1.0, layers=[0]) | kwargs
        with pytest.raises(InputError, match=match):
            Steer(**args)


def test_where_a_steer_adds():
    s = Steer(_vec(), 1.0, layers=0, blocks="1:", steps=[0, 1], parts=("preview", "commit"))
    assert s.at("preview", 1, 0) and s.at("preview", 3, 1)
    assert not s.at("preview", 0, 0) and not s.at("preview", 1, 2)
    assert s.at("commit", 2, None) and not s.at("commit", 0, None)  # commit rows: blocks only
    assert not s.at("prompt", None, None)
    assert Steer(_vec(), 1.0, layers=0, parts="prompt").at("prompt", None, None)
    assert not Steer(_vec(), 1.0, layers=0, parts="prompt", blocks=[1]).at("prompt", None, None)  # no block


def _plan():
    return Schedule([Steer(_vec(1), 4.0, layers=[2], steps="0:2", name="early"),
                     Steer(_vec(2), -1.5, layers=[1, 3], kind="moe.output", blocks=[2, 3], steps="3:",
                           positions="masked", name="late"),
                     Steer(_vec(3), 0.5, layers=0, positions=(0, 4, 9), parts=("prompt", "commit", "preview"))],
                    name="plan")


def test_a_schedule_lists_itself():
    plan = _plan()
    rows = plan.table()
    assert [r["direction"] for r in rows] == ["early", "late", "direction"]
    assert rows[1] == dict(direction="late", norm=round(float(_vec(2).norm()), 4), coefficient=-1.5, layers="1, 3",
                           point="moe.output", parts="preview", blocks="2, 3", steps="3 on", positions="masked")
    text = str(plan)
    assert text.startswith("Schedule 'plan': 3 steers") and "0, 4, 9" in text and "prompt + commit + preview" in text
    assert plan.layers == (0, 1, 2, 3) and len(plan) == 3 and plan[0].name == "early"
    assert len(plan + Steer(_vec(), 1.0, layers=0)) == 4 and plan.scaled(2)[1].coefficient == -3.0


def test_schedules_round_trip_through_save_and_load(tmp_path):
    plan = _plan()
    plan.save(tmp_path / "plan")
    assert sorted(p.name for p in (tmp_path / "plan").iterdir()) == ["directions.safetensors", "schedule.json"]
    back = Schedule.load(tmp_path / "plan")
    assert back == plan and back is not plan
    assert all(torch.equal(a.direction, b.direction) for a, b in zip(back, plan))
    assert back != plan.scaled(2)
    plan.scaled(3).save(tmp_path / "plan")  # over a schedule: replaced
    assert Schedule.load(tmp_path / "plan") == plan.scaled(3)
    Schedule([], name="empty").save(tmp_path / "empty")
    assert len(Schedule.load(tmp_path / "empty")) == 0


def test_bad_schedule_files_are_named(tmp_path):
    with pytest.raises(ScheduleError, match="no schedule.json"):
        Schedule.load(tmp_path / "nothing")
    d = tmp_path / "plan"
    _plan().save(d)
    doc = json.loads((d / "schedule.json").read_text())
    for change, match in [(dict(format="clover_lab.trace"), "not a steering schedule"), (dict(version=9), "version 9"),
                          ({"steers": [dict(doc["steers"][0], hidden=3)]}, "16 values, the schedule says 3"),
                          ({"steers": [{k: v for k, v in doc["steers"][0].items() if k != "layers"}]}, "no field 'layers'"),
                          ({"steers": [dict(doc["steers"][0], steps="x:y")]}, r"steers\[0\].*steps"),
                          ({"steers": [dict(doc["steers"][0], parts=3)]}, r"steers\[0\]"),  # a number, not a list
                          ({"steers": 5}, "'steers' must be a list")]:
        (d / "schedule.json").write_text(json.dumps(doc | change))
        with pytest.raises(ScheduleError, match=match):
            Schedule.load(d)
    (d / "schedule.json").write_text("{not json")
    with pytest.raises(ScheduleError, match="not JSON"):
        Schedule.load(d)
    (d / "schedule.json").write_text(json.dumps(doc | {"steers": doc["steers"] * 4}))
    with pytest.raises(ScheduleError, match="no tensor 'steer.3'"):
        Schedule.load(d)
    (d / "directions.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(ScheduleError, match="cannot read the directions"):
        Schedule.load(d)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="notes.txt"):
        _plan().save(other)
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
    with pytest.raises(InputError, match="Steer objects"):
        Schedule(["not a steer"])


@pytest.mark.parametrize("fail_at", [1, 2, 3])
@pytest.mark.parametrize("error", [FULL, KeyboardInterrupt()])
def test_a_failed_save_leaves_the_old_schedule(tmp_path, monkeypatch, fail_at, error):
    old = _plan()
    old.save(tmp_path / "plan")
    Writes(monkeypatch, fail_at=fail_at, error=error)  # the directions, schedule.json, the set's marker
    with pytest.raises(type(error), match=str(tmp_path / "plan") if error is FULL else None):  # named
        old.scaled(5).save(tmp_path / "plan")
    assert Schedule.load(tmp_path / "plan") == old
    assert not leftovers(tmp_path)
