"""A hook point is declared once (clover_lab/hooks/points.py): its name pattern, event class and
saved fields serve the model's point list, capture, traces, replay and the layout test. A point
declared here, in the test, is captured, saved, checked on load and replayed with nothing else
changed but its fire site (issue 24)."""
import json
from dataclasses import dataclass, replace

import pytest
import torch
from test_layout import point_name_pattern

import clover_lab
from clover_lab import Engine
from clover_lab.hooks import points as P
from clover_lab.hooks.events import Event, _RowsOfOneMode

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPT = [5, 17, 33, 100, 2, 9, 77, 301]
GEN = dict(max_new_tokens=8, threshold=0.3, temperature=0.0)


@dataclass
class ProbeEvent(_RowsOfOneMode, Event):
    """Test-only: the RMS of each row of a layer's output."""

    layer: int
    mode: str
    positions: torch.Tensor  # [T] (or [B, T])
    rms: torch.Tensor  # [B, T]

    def _narrow(self, i, n, where):
        positions = self.positions[i] if self.positions.dim() == 2 else self.positions
        return replace(self, where=where, positions=positions, rms=self.rms[i:i + 1])


@pytest.fixture
def probe(monkeypatch, new_gen_model):
    """Declares ``layers.{i}.probe.rms`` for this test only, and an engine built after it with the
    point's fire site: a permanent hook on each layer's output that fires the probe when it has hooks."""
    monkeypatch.setattr(P, "DECLARED", dict(P.DECLARED))
    kind = P.declare("layers.{i}.probe.rms", ProbeEvent, layer_types=("linear_attention", "full_attention"),
                     fields=dict(layer=P.value(int), mode=P.value(str, choices=P.MODES),
                                 positions=P.tensor(P.INT, (1, 2)), rms=P.tensor(P.FLOAT, 2, clone=True)))
    model = new_gen_model()
    hooks = model.hooks

    def fire_site(ev):
        name = P.layer_point(ev.layer, kind)
        if hooks.active(name):
            rms = ev.value.float().pow(2).mean(-1).sqrt()
            hooks.fire(name, ProbeEvent(ev.layer, ev.mode, ev.positions, rms, where=ev.where))

    handle = hooks.add(P.every_layer(P.OUTPUT), fire_site)
    yield kind, Engine(model)
    handle.remove()


def test_a_declared_point_is_captured_saved_and_replayed(probe, tmp_path):
    kind, engine = probe
    names = engine.model.hooks.points
    assert P.layer_point(0, kind) in names and P.layer_point(1, kind) in names
    assert names.index(P.layer_point(0, kind)) < names.index("layers.1.input")  # a point of each layer, in order
    assert point_name_pattern().match("layers.3.probe.rms") and point_name_pattern().match("probe.rms")
    assert P.is_model_point("layers.0.probe.rms") and not P.is_residual("layers.0.probe.rms")

    with engine.capture(P.every_layer(kind)) as cap:
        out = engine.generate(PROMPT, **GEN)
    recs = cap[P.every_layer(kind)]
    n_layers = engine.model.config.num_hidden_layers
    assert len(recs) >= n_layers and {r["layer"] for r in recs} == set(range(n_layers))
    assert all(set(r.data) == {"layer", "mode", "positions", "rms"} for r in recs)
    assert {r["mode"] for r in recs} == {"commit", "preview"} and {r.phase for r in recs} == {"prefill", "decode"}

    cap.save(tmp_path / "t")
    trace = clover_lab.load_trace(tmp_path / "t")
    assert trace.diff(trace) is None and len(trace) == len(recs)
    assert all(torch.equal(a["rms"], b["rms"]) for a, b in zip(recs, trace.records))

    # the declared fields are checked on load
    doc = json.loads((tmp_path / "t" / "trace.json").read_text())
    doc["records"][0]["data"]["mode"] = "sideways"
    (tmp_path / "t" / "trace.json").write_text(json.dumps(doc))
    with pytest.raises(clover_lab.TraceError, match="field 'mode' = 'sideways'"):
        clover_lab.load_trace(tmp_path / "t")
    assert out.token_ids == engine.generate(PROMPT, **GEN).token_ids  # the engine is as usable as before


def test_a_batched_record_of_a_declared_point_is_rebuilt_as_its_event(probe, tmp_path):
    """Replay narrows a batch's record to one row through the declared event class."""
    pytest.importorskip("ipywidgets")
    from clover_lab.widgets.base import View

    kind, engine = probe

    class ProbeView(View):
        title = "probe"

        def hook_methods(self):
            return {P.every_layer(kind): "_on_probe"}

        def _build(self):
            import ipywidgets as W
            return W.HTML()

        def _empty(self):
            return {"rms": []}

        def _apply_part(self, state, part):
            state["rms"].append(part)

        def _render(self, state, frame):
            pass

        def _on_probe(self, ev):
            assert ev.rms.shape[0] == 1  # a record of this row alone, or the row cut from a batch's
            self._push((ev.layer, ev.mode, ev.rms.tolist()))

    with engine.capture(P.every_layer(kind)) as cap:
        engine.generate([PROMPT, [7, 7, 300, 4]], **GEN)
    cap.save(tmp_path / "b")
    trace = clover_lab.load_trace(tmp_path / "b")
    assert any(r.rows is not None and len(r.rows) == 2 for r in trace.records)  # rows to cut
    view = ProbeView(fps=1000)
    view.row = 1
    try:
        assert view.replay(trace) is view and view.frames
        live = [(r["layer"], r["mode"], P.rebuild(r.point, r.data, r.where).for_row(1).rms.tolist())
                for r in cap.records if r.rows is not None and 1 in r.rows]
        assert [part for frame in view.frames for part in frame] == live
    finally:
        view.close()


def test_a_point_is_declared_once():
    with pytest.raises(clover_lab.CloverError, match="declared twice"):
        P.declare("layers.{i}.moe.route", ProbeEvent, {}, layer_types=("full_attention",))
    with pytest.raises(clover_lab.CloverError, match="names the layer types"):
        P.declare("layers.{i}.nowhere", ProbeEvent, {})
    assert "layers.{i}.nowhere" not in P.DECLARED and "nowhere" not in P.DECLARED
    with pytest.raises(clover_lab.CloverError, match=r"recorded fields \['depth'\] are not among its fields"):
        P.declare("layers.{i}.probe.depth", ProbeEvent, dict(rms=P.tensor(P.FLOAT, 2)),
                  layer_types=("full_attention",), recorded=("rms", "depth"))
    assert "probe.depth" not in P.DECLARED


def test_the_static_step_serves_the_observers_of_points_declared_recorded(gen_model, monkeypatch):
    """Which points a static step records for observers, and which fields, is their declaration's
    ``recorded`` (engine/observed.py reads nothing else): declared without it, a route observer
    takes the eager forward; declared with it, the static step and the eager tokens."""
    from clover_lab.hooks.registry import observer

    assert {k for k, p in P.DECLARED.items() if p.recorded} == {P.MOE_ROUTE, P.GDN_STATE, P.GDN_PREVIEW}
    engine = Engine(gen_model)
    engine.step_graphs = True
    seen = []
    hooks = {"layers.1.moe.route": observer(lambda ev: seen.append(ev.expert_ids.tolist()))}
    with engine.hooks(hooks):
        static = engine.generate(PROMPT, **GEN)
    monkeypatch.setitem(P.DECLARED, P.MOE_ROUTE, replace(P.DECLARED[P.MOE_ROUTE], recorded=()))
    with engine.hooks(hooks):
        eager = engine.generate(PROMPT, **GEN)
    assert static.stats.path == "static (observers read after each step: layers.1.moe.route)"
    assert eager.stats.path == "eager: a hook on layers.1.moe.route"
    assert static.token_ids == eager.token_ids and seen[:len(seen) // 2] == seen[len(seen) // 2:]


def test_a_trace_saved_before_the_declarations_still_loads(tmp_path):
    """tests/data/trace_before_declarations: saved by main at 7be12bb (before points.py declared
    the points), clover-tiny seed 3, block_size 4, a batch [[1, 2, 3], [5]], 6 new tokens,
    threshold 0.5, points denoise.step, block.commit, layers.0.*, layers.3.*, final_norm.output."""
    from pathlib import Path

    from clover_lab.lens.routing import routing_lens

    trace = clover_lab.load_trace(Path(__file__).parent / "data" / "trace_before_declarations")
    kinds = {P.parse(r.point)[1] for r in trace.records}
    assert kinds == {"denoise.step", "block.commit", "final_norm.output", "input", "gdn.state", "gdn.preview",
                     "gdn.output", "attn.output", "moe.route", "moe.output", "output"}
    assert all(P.declaration(r.point) is not None for r in trace.records)
    batched = [r for r in trace.records if r.rows is not None and len(r.rows) == 2]
    assert batched and all(isinstance(P.rebuild(r.point, r.data, r.where).for_row(1), P.declaration(r.point).event)
                           for r in batched)
    assert routing_lens(trace, row=1).rows
    trace.save(tmp_path / "again")
    assert trace.diff(clover_lab.load_trace(tmp_path / "again")) is None
