"""Residual-stream hook points (issue 17): layers.{i}.input / attn.output / gdn.output /
moe.output / output and final_norm.output, split by mode, replaceable, recorded by capture()."""
import pytest
import torch

from clover_lab import HookError
from clover_lab.hooks import points as P
from clover_lab.hooks.events import ResidualEvent

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]


def test_every_layer_has_its_residual_points(tiny_engine):
    cfg = tiny_engine.model.config
    names = tiny_engine.model.hooks.points
    for i, t in enumerate(cfg.layer_types):
        for kind in ("input", "moe.output", "output"):
            assert f"layers.{i}.{kind}" in names
        mixer = "gdn.output" if t == "linear_attention" else "attn.output"
        other = "attn.output" if t == "linear_attention" else "gdn.output"
        assert f"layers.{i}.{mixer}" in names and f"layers.{i}.{other}" not in names
    assert names[-1] == "final_norm.output"


def test_residual_values_compose_the_stream(tiny_model):
    """input + mixer output + moe output == output, and the last output through the final norm is
    what final_norm.output carries; commit and preview rows of a fused forward come apart."""
    model = tiny_model
    seen = {}

    def keep(ev: ResidualEvent):
        seen[(ev.point, ev.mode)] = (ev.value.clone(), ev.positions.clone())

    cache = model.new_cache(64)
    model.commit(cache, torch.tensor([PROMPT]))
    with model.hooks.scoped({"layers.*.input": keep, "layers.*output": keep, "final_norm.output": keep}):
        out = model.commit_and_preview(cache, [1, 2, 3], torch.tensor([[7] * 5]), commit_logits="last")
    mixer = P.mixer_output(model.config.layer_types[1])
    for mode, n in (("commit", 3), ("preview", 5)):
        x, pos = seen[("layers.1.input", mode)]
        assert x.shape == (1, n, model.config.hidden_size)
        lo = 10 if mode == "commit" else 13
        assert pos.tolist() == list(range(lo, lo + n))
        total = x + seen[(f"layers.1.{mixer}", mode)][0] + seen[("layers.1.moe.output", mode)][0]
        torch.testing.assert_close(total, seen[("layers.1.output", mode)][0])
        torch.testing.assert_close(seen[("layers.1.output", mode)][0], seen[("layers.2.input", mode)][0])
    last = seen[(f"layers.{model.config.num_hidden_layers - 1}.output", "preview")][0]
    normed, pos = seen[("final_norm.output", "preview")]
    torch.testing.assert_close(normed, model.model.norm(last))
    torch.testing.assert_close(model.lm_head(normed), out.preview_logits)
    normed_c, pos_c = seen[("final_norm.output", "commit")]
    assert normed_c.shape[1] == 1 and pos_c.tolist() == [12]  # the commit's last row only


def test_replacing_a_value_changes_the_forward_and_is_checked(tiny_model):
    model = tiny_model
    ids = torch.tensor([PROMPT])
    base = model.logits(ids)

    def zero(ev):
        ev.value = torch.zeros_like(ev.value)

    with model.hooks.scoped({"layers.3.output": zero}):
        zeroed = model.logits(ids)
    # the final norm of zeros is zero: the logits are the LM head of zeros
    assert torch.count_nonzero(zeroed) == 0 and torch.count_nonzero(base) > 0

    def same(ev):
        ev.value = ev.value.clone()

    with model.hooks.scoped({"layers.*.input": same, "layers.*output": same, "final_norm.output": same}):
        torch.testing.assert_close(model.logits(ids), base, rtol=0, atol=0)

    def in_place(ev):
        ev.value.mul_(0)

    with model.hooks.scoped({"final_norm.output": in_place}):
        assert torch.count_nonzero(model.logits(ids)) == 0

    for bad, what in ((lambda v: v[:, :1], "shape"), (lambda v: v.double(), "dtype"), (lambda v: v.tolist(), "tensor")):
        def hook(ev, bad=bad):
            ev.value = bad(ev.value)

        with model.hooks.scoped({"layers.0.moe.output": hook}):
            with pytest.raises(HookError, match="layers.0.moe.output") as err:
                model.logits(ids)
        assert what in str(err.value)


def test_residual_events_carry_block_and_step_and_capture_records_them(tiny_engine):
    assert P.every_layer("output") == "layers.*[0-9].output"
    with tiny_engine.capture([P.every_layer("output"), "final_norm.output", "denoise.step"]) as cap:
        r = tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=0.3)
    steps = set(cap.by_step("denoise.step"))
    n_layers = tiny_engine.model.config.num_hidden_layers
    preview = [rec for rec in cap[P.every_layer("output")] if rec["mode"] == "preview"]
    assert len(preview) == n_layers * r.stats.preview_forwards
    assert {(rec.block, rec.step) for rec in preview} == steps
    commits = {rec.block for rec in cap["layers.0.output"] if rec["mode"] == "commit"}
    assert commits == {None, 0, 1}
    heads = [rec for rec in cap["final_norm.output"] if rec["mode"] == "preview"]
    assert len(heads) == r.stats.preview_forwards
    # each step's head rows are the still-masked positions of the block
    for rec, step in zip(heads, cap["denoise.step"]):
        assert rec["positions"].tolist() == [len(PROMPT) + 16 * step.block + p for p in step["masked"]]
    # a recorded value is a copy: a hook editing the stream in place later does not change it
    with tiny_engine.capture("layers.0.output") as cap2:
        with tiny_engine.hooks({"layers.0.output": lambda ev: ev.value.zero_()}):
            tiny_engine.generate(PROMPT, max_new_tokens=4, threshold=0.3)
    assert all(torch.count_nonzero(rec["value"]) > 0 for rec in cap2.records)


def test_no_residual_events_are_built_without_hooks(tiny_engine, monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("a residual event was built with no hook attached")

    monkeypatch.setattr("clover_lab.model.layers.residual.ResidualEvent", forbidden)
    monkeypatch.setattr("clover_lab.model.decoder.fire_residual", forbidden)
    monkeypatch.setattr("clover_lab.model.decoder.fire_head_rows", forbidden)
    tiny_engine.generate(PROMPT, max_new_tokens=16, threshold=0.3)
    tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=4)
    # another point attached does not wake these
    with tiny_engine.hooks({"layers.*.moe.route": lambda ev: None}):
        tiny_engine.generate(PROMPT, max_new_tokens=8, threshold=0.3)
