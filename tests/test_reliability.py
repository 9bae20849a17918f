"""Issue 16: every bad input, fault and thread race ends in a clear error or a correct result.

One section per class of the issue: non-finite values, the coreset's size, StopGeneration in the
prefill, the no-progress guard, hooks and captures per thread, public setters, config.json
fields, hook outputs assigned directly, the mask token in results, checkpoints and re-entrance.
(The command line's errors are in test_cli.py, the property-based tests in test_properties.py.)
"""
import json
import math
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

import clover_lab
from clover_lab import (
    CheckpointError,
    CloverError,
    CloverModel,
    Coreset,
    Engine,
    GenerationError,
    HookError,
    SettingsError,
    StopGeneration,
)

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]
KW = dict(max_new_tokens=20, threshold=0.3)


@pytest.fixture
def own_engine(new_gen_model):
    """An Engine over its own copy of the generation model, free to be damaged by the test."""
    model = new_gen_model()
    yield Engine(model)
    assert not model.hooks.attached()


# --------------------------------------------------------------------------- 1. non-finite values
def _nan_checkpoint(model, tmp_path, name="model.layers.1.mlp.shared_expert.down_proj.weight"):
    with torch.no_grad():
        model.get_parameter(name)[0, 0] = float("nan")
    model.save_pretrained(tmp_path)
    return tmp_path


def test_nan_weights_are_refused_at_load_and_named_at_generation(new_gen_model, tmp_path):
    path = _nan_checkpoint(new_gen_model(), tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*'model\.layers\.1\.mlp\.shared_expert\.down_proj"
                                              r"\.weight' holds NaN or inf"):
        clover_lab.load(path)
    engine = clover_lab.load(path, check_finite=False)  # loads when asked, and then fails clearly, never [0]
    for mode, where in (("diffusion", "block 0, step 0"), ("ar", r"token 0 \(AR\)")):
        with pytest.raises(GenerationError, match=f"{where}: the logits are not finite.*"
                                                  r"layers\.1\.mlp\.shared_expert\.down_proj\.weight"):
            engine.generate(PROMPT, mode=mode, max_new_tokens=8)
    with torch.no_grad():  # the engine stays usable once the weight is repaired
        engine.model.get_parameter("model.layers.1.mlp.shared_expert.down_proj.weight").nan_to_num_(0.0)
    assert len(engine.generate(PROMPT, max_new_tokens=8).token_ids) == 8


def test_an_overflow_in_the_preview_names_the_first_layer(own_engine):
    """Finite weights and cache, non-finite preview logits: the preview is run again without hooks
    and the first layer whose output is not finite is named."""
    gdn = own_engine.model.model.layers[0].linear_attn
    with torch.no_grad():
        gdn.block_scale.fill_(1e30)  # preview-only: the commit path never reads it
    with pytest.raises(GenerationError, match=r"block 0, step 0: .*layer 0 is the first"):
        own_engine.generate(PROMPT, max_new_tokens=8)
    assert len(own_engine.generate(PROMPT, mode="ar", max_new_tokens=4).token_ids) == 4  # commits are fine


def test_sampling_with_nan_logits_is_a_generation_error_not_a_multinomial_error(own_engine):
    with torch.no_grad():
        own_engine.model.lm_head.weight[3, 0] = float("inf")
    with pytest.raises(GenerationError, match="not finite.*lm_head.weight"):
        own_engine.generate(PROMPT, max_new_tokens=8, temperature=0.8, seed=1)


def test_penalties_are_bounded_so_logits_stay_finite(tiny_engine):
    for name, value in (("presence_penalty", 1e39), ("frequency_penalty", -1e5), ("repetition_penalty", 1e-30),
                        ("repetition_penalty", 1e39), ("temperature", 1e-300), ("seed", 2**70)):
        with pytest.raises(SettingsError, match=name):
            tiny_engine.generate(PROMPT, **{name: value})
    r = tiny_engine.generate(PROMPT, max_new_tokens=20, presence_penalty=1e4, frequency_penalty=-1e4,
                             repetition_penalty=1e4)
    assert len(r.token_ids) == 20 and tiny_engine.mask_token_id not in r.token_ids


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
                tiny_engine.generate(PROMPT, **KW)
        assert info.value.point == point


# --------------------------------------------------------------------------- 2. coreset size
def test_coreset_size_must_leave_top_k_and_restrict_something(tiny_engine):
    k, E = tiny_engine.model.config.num_experts_per_tok, tiny_engine.model.config.num_experts
    with pytest.raises(GenerationError, match=f"coreset_size=1: .*num_experts_per_tok={k}"):
        tiny_engine.generate(PROMPT, coreset_size=1)
    with pytest.raises(GenerationError, match=f"coreset_size={E}: the model has {E} experts"):
        tiny_engine.generate(PROMPT, coreset_size=E)
    cap_points = ["layers.*.moe.route"]
    with tiny_engine.capture(cap_points) as cap:  # the smallest valid coreset routes correctly
        r = tiny_engine.generate(PROMPT, max_new_tokens=16, threshold=0.9, coreset_size=k)
    assert r.stats.coreset_size == k
    for rec in cap["layers.*.moe.route"]:
        assert (rec["weights"] >= 0).all() and torch.allclose(rec["weights"].sum(-1), torch.ones(1))
    cache = tiny_engine.model.new_cache(64)
    tiny_engine.model.commit(cache, PROMPT)
    with pytest.raises(ValueError, match="coreset size 1 is below num_experts_per_tok"):  # the model itself too
        tiny_engine.model.preview(cache, [511] * 4, coreset=Coreset(1))


# --------------------------------------------------------------------------- 3. StopGeneration in the prefill
@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_stop_generation_during_the_prefill_ends_the_run_cleanly(tiny_engine, mode):
    base = tiny_engine.generate(PROMPT, mode=mode, **KW)

    def stop_in_prefill(ev):
        if ev.phase == "prefill":
            raise StopGeneration

    with tiny_engine.hooks({"layers.0.moe.route": stop_in_prefill}):
        r = tiny_engine.generate(PROMPT, mode=mode, **KW)
        updates = list(tiny_engine.stream(PROMPT, mode=mode, **KW))
    assert r.token_ids == [] and r.stop_reason == "hook" and not r.stats.cache_complete
    assert [u.kind for u in updates] == ["done"] and updates[0].result.token_ids == []
    assert tiny_engine.generate(PROMPT, mode=mode, **KW).token_ids == base.token_ids


# --------------------------------------------------------------------------- 4. the no-progress guard
def test_no_progress_guard_is_bounded_by_the_real_block(tiny_engine):
    steps = []

    def veto_all(ev):
        steps.append(ev.step)
        ev.unmask = []

    tiny_engine.block_size = 100_000  # the block is only max_new_tokens = 16 long
    try:
        with tiny_engine.hooks({"denoise.step": veto_all}):
            with pytest.raises(HookError, match="16 steps past the step limit"):
                tiny_engine.generate(PROMPT, max_new_tokens=16, threshold=0.3)
    finally:
        tiny_engine.block_size = 16
    assert len(steps) <= 2 * 16 + 1


# --------------------------------------------------------------------------- 5. hooks and captures per thread
def test_scoped_hooks_and_captures_stay_in_their_thread(tiny_engine):
    base = tiny_engine.generate(PROMPT, **KW)
    with tiny_engine.hooks({"layers.*.moe.route": lambda ev: ev.ban([0, 1])}):
        banned = tiny_engine.generate(PROMPT, **KW)
    assert banned.token_ids != base.token_ids
    both_running = threading.Barrier(2, timeout=60)
    results, errors = {}, []

    def meet_once(flag: list):
        def hook(ev):
            if not flag:
                flag.append(True)
                both_running.wait()  # the other thread is inside its generation too
        return hook

    def rerouting():
        torch.set_num_threads(1)  # as the main thread: the same sums in the same order
        try:
            with tiny_engine.capture(["denoise.step", "layers.0.moe.route"]) as cap:
                with tiny_engine.hooks({"layers.*.moe.route": [lambda ev: ev.ban([0, 1]), meet_once([])]}):
                    results["a"] = tiny_engine.generate(PROMPT, **KW)
            results["a_runs"] = {rec.run for rec in cap.records}
            results["a_steps"] = len(cap["denoise.step"])
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def plain():
        torch.set_num_threads(1)
        try:
            with tiny_engine.hooks({"denoise.step": meet_once([])}):
                results["b"] = tiny_engine.generate(PROMPT, **KW)
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

    seen = []  # a permanent hook reaches every thread
    handle = tiny_engine.add_hook("block.commit", lambda ev: seen.append(threading.get_ident()))
    try:
        t = threading.Thread(target=lambda: tiny_engine.generate(PROMPT, **KW))
        t.start()
        t.join(60)
        tiny_engine.generate(PROMPT, **KW)
    finally:
        handle.remove()
    assert len(set(seen)) == 2


def test_a_generation_keeps_the_hooks_of_where_it_started(tiny_engine):
    """A stream started inside a scope keeps its hooks until the scope closes; one started
    outside is not reached by a scope opened later."""
    calls = []
    outside = tiny_engine.stream(PROMPT, **KW)
    with tiny_engine.hooks({"denoise.step": lambda ev: calls.append(ev.where.run)}):
        inside = tiny_engine.stream(PROMPT, **KW)
        list(outside)
        result = list(inside)[-1].result
    assert calls and set(calls) == {calls[0]} and len(calls) == result.stats.preview_forwards


# --------------------------------------------------------------------------- 6. public setters
@pytest.mark.parametrize("name,value", [
    ("prefill_chunk_size", -1), ("prefill_chunk_size", 0), ("prefill_chunk_size", 2.5), ("prefill_chunk_size", True),
    ("max_new_tokens", 0), ("max_new_tokens", "64"), ("block_size", -3), ("mask_token_id", 512),
    ("eos_token_ids", [99_999]), ("eos_token_ids", "510"), ("settings", "fast"), ("step_graphs", "yes"),
    ("compile_steps", 1), ("tokenizer", "gpt2"),
])
def test_public_setters_are_validated(tiny_engine, name, value):
    before = getattr(tiny_engine, name)
    with pytest.raises(ValueError, match=name):
        setattr(tiny_engine, name, value)
    assert getattr(tiny_engine, name) == before


def test_prefill_chunk_size_commits_the_whole_prompt(tiny_engine):
    base = tiny_engine.generate(PROMPT, **KW)
    tiny_engine.prefill_chunk_size = 3
    try:
        r = tiny_engine.generate(PROMPT, **KW)
    finally:
        tiny_engine.prefill_chunk_size = 1024
    assert r.token_ids == base.token_ids and r.stats.prefill_forwards == math.ceil(len(PROMPT) / 3)


def test_confusing_arguments_get_clear_errors(tiny_engine):
    with pytest.raises(GenerationError, match="stop: expected a string or a list of strings, got int 123"):
        tiny_engine.generate(PROMPT, stop=123)
    with pytest.raises(SettingsError, match="seed"):
        tiny_engine.generate(PROMPT, seed=2**70)
    with pytest.raises(SettingsError, match="settings: expected a SamplerSettings, got str 'fast'"):
        tiny_engine.generate(PROMPT, settings="fast")
    with pytest.raises(CheckpointError, match="meta"):
        clover_lab.load("/nonexistent", device="meta")
    with torch.device("meta"):
        on_meta = CloverModel(clover_lab.CloverConfig.preset("clover-tiny"))
    with pytest.raises(ValueError, match="meta device"):
        Engine(on_meta)


def test_lower_level_arguments_are_checked(tiny_engine, gen_model_dir, tmp_path):
    with pytest.raises(ValueError, match="capture: to='bogus' is not a device"):
        tiny_engine.capture("denoise.step", to="bogus")
    with pytest.raises(ValueError, match="cache max_len must be a positive integer"):
        tiny_engine.model.new_cache(-1)
    with pytest.raises(ValueError, match="Coreset size must be a positive integer"):
        Coreset("a")
    with tiny_engine.hooks({"denoise.step": lambda ev: ev.candidate(99)}):
        with pytest.raises(HookError, match="block position 99 is not masked"):
            tiny_engine.generate(PROMPT, **KW)
    import numpy as np  # numpy scalars are numbers like any other

    r = tiny_engine.generate(PROMPT, max_new_tokens=np.int64(8), threshold=np.float32(0.3), top_k=np.int64(5))
    assert len(r.token_ids) == 8
    shutil.copytree(gen_model_dir, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"coreset_size": 1}))
    with pytest.raises(CheckpointError, match="generation_config.json: coreset_size=1"):
        clover_lab.load(tmp_path / "m")


# --------------------------------------------------------------------------- 8. config.json
@pytest.fixture
def model_copy(gen_model_dir, tmp_path):
    dest = tmp_path / "model"
    shutil.copytree(gen_model_dir, dest)
    return dest


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            cfg.pop(key)
        elif key in ("rope_theta", "partial_rotary_factor"):
            cfg["rope_parameters"][key] = value
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


_DROP = object()


@pytest.mark.parametrize("changes,match", [
    (dict(hidden_size=_DROP), "missing required field.*'hidden_size'"),
    (dict(num_experts=_DROP, moe_intermediate_size=_DROP), "'num_experts', 'moe_intermediate_size'"),
    (dict(rms_norm_eps="abc"), "'rms_norm_eps': must be a positive finite number"),
    (dict(rms_norm_eps=-1e-6), "'rms_norm_eps': must be a positive"),
    (dict(rope_theta=0), "'rope_theta': must be a positive"),
    (dict(eos_token_id=100_000), "'eos_token_id': must be below vocab_size=512"),
    (dict(eos_token_id=[510, -1]), "'eos_token_id': must be a token id"),
    (dict(attention_bias="no"), "'attention_bias': must be true or false"),
])
def test_bad_config_fields_are_named_at_load(model_copy, changes, match):
    _edit_config(model_copy, **changes)
    with pytest.raises(CheckpointError, match=r"config\.json.*" + match):
        clover_lab.load(model_copy)


# --------------------------------------------------------------------------- 9. hook outputs assigned directly
def _set(name, value):
    return lambda ev: setattr(ev, name, value(ev) if callable(value) else value)


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
            tiny_engine.generate(PROMPT, **KW)
    assert info.value.point == point


def test_valid_assigned_hook_outputs_still_work(tiny_engine):
    base = tiny_engine.generate(PROMPT, **KW)
    with tiny_engine.hooks({"layers.*.moe.route": [_set("expert_ids", lambda ev: ev.expert_ids.clone()),
                                                  _set("weights", lambda ev: ev.weights.clone())],
                            "layers.*.gdn.state": _set("state", lambda ev: ev.state.clone())}):
        same = tiny_engine.generate(PROMPT, **KW)
    assert same.token_ids == base.token_ids
    with tiny_engine.hooks({"layers.*.moe.route": lambda ev: ev.force([1, 2, 3], weights=[0.5, 0.25, 0.25])}):
        assert len(tiny_engine.generate(PROMPT, **KW).token_ids) == KW["max_new_tokens"]


# --------------------------------------------------------------------------- 10. the mask token in results
def test_a_step_hook_cannot_place_the_mask_token(tiny_engine):
    mask = tiny_engine.mask_token_id
    with tiny_engine.hooks({"denoise.step": lambda ev: ev.set_token(ev.masked[0], mask)}):
        with pytest.raises(HookError, match=f"mask token {mask}"):
            tiny_engine.generate(PROMPT, **KW)


def test_editing_event_candidates_cannot_split_canvas_and_result(tiny_engine):
    """The event's candidates are a copy: editing them changes neither the device canvas nor the
    returned tokens, so the two cannot disagree (set_token is the way to change a token)."""
    base = tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=0.9)
    assert max(base.stats.steps_per_block) > 1  # later steps preview a canvas the edit would have changed
    with tiny_engine.hooks({"denoise.step": lambda ev: ev.candidates.fill_(7)}):
        r = tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=0.9)
    assert r.token_ids == base.token_ids and r.stats.steps_per_block == base.stats.steps_per_block


# --------------------------------------------------------------------------- smaller
def _rewrite_weights(path, change):
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_two_stored_tensors_for_one_parameter_are_an_error(model_copy):
    def both_norms(t):
        t["model.language_model.norm.weight"] = t["model.norm.weight"] + 1.0

    _rewrite_weights(model_copy, both_norms)
    with pytest.raises(CheckpointError, match=r"'model.language_model.norm.weight' \(model.safetensors\) and "
                                              r"'model.norm.weight' .* are both the parameter 'model.norm.weight'"):
        clover_lab.load(model_copy)


def test_fused_and_per_expert_copies_are_an_error(model_copy):
    def add_expert(t):
        I, H = 32, 64
        t["model.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(I, H)

    _rewrite_weights(model_copy, add_expert)
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.experts is stored both as fused tensors and "
                                              "per expert"):
        clover_lab.load(model_copy)


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


def test_every_error_here_is_a_clover_error():
    for cls in (CheckpointError, GenerationError, HookError, SettingsError, clover_lab.ConfigError,
                clover_lab.CacheFullError):
        assert issubclass(cls, CloverError)
    assert issubclass(SettingsError, ValueError) and issubclass(SettingsError, TypeError)


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_a_residual_stream_past_the_norms_range_is_named_not_token_0(own_engine, mode):
    """Finite weights so large that a norm's mean square overflows: its output, and so the logits,
    are zero (equal for every token). That is a GenerationError, not a response of token 0."""
    with torch.no_grad():
        own_engine.model.model.embed_tokens.weight.mul_(1e22)  # finite in float32; squared, not
    with pytest.raises(GenerationError, match=r"(block 0, step 0|token 0 \(AR\)): the logits are equal for every "
                                              r"token.*float32's range"):
        own_engine.generate(PROMPT, mode=mode, max_new_tokens=8)
    with pytest.raises(GenerationError, match=r"row 0, .*logits are equal"):
        own_engine.generate([PROMPT, PROMPT[:3]], mode=mode, max_new_tokens=8)
    with torch.no_grad():  # repaired, the engine goes on
        own_engine.model.model.embed_tokens.weight.div_(1e22)
    assert len(own_engine.generate(PROMPT, mode=mode, max_new_tokens=8).token_ids) == 8
