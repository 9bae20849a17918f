"""Issue 29 (inputs and errors): every argument of the newer surfaces is what it says, or a
CloverError naming it, raised before work starts; the engine stays usable after each.

One section per class: corpora, lenses and patching (batches, sites, steps), FP8 checkpoints,
placement, training arguments, traces, shards, obscure errors, and the first harness's remainder.
"""
import json
import warnings
from pathlib import Path

import pytest
import torch

import clover_lab
from clover_lab import CloverError, Engine, GenerationError
from clover_lab.errors import CorpusError, CorpusNotFoundError, InputError

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]


# --------------------------------------------------------------------------- 1. corpora
@pytest.mark.parametrize("data,match", [
    ("nosuch.py", "bare string"), ("some text", "bare string"), (".", "bare string"), ("/", "bare string"),
    (Path("/"), "filesystem root"), (["nosuch.py"], r"reads as a path.*Path\('nosuch.py'\)"),
    (["docs/"], "reads as a path"), ([], "empty"), (None, "NoneType"), (5, "int 5"), ([""], "empty text"),
    ([[]], "non-empty list of token ids"), (torch.tensor([1.0]), "integers"), ([[1, 2], [3, 99999]], "vocabulary"),
    (torch.zeros(0, dtype=torch.long), "empty"),
])
def test_a_corpus_is_what_it_says(tiny_engine, data, match):
    from clover_lab.lens.routing_stats import route_stats

    with pytest.raises(CorpusError, match=match):
        route_stats(tiny_engine, data, seq_len=32)


def test_empty_unmatched_binary_and_missing_corpora_are_named(tiny_text_engine, tmp_path):
    from clover_lab.lens.routing_stats import route_stats

    (tmp_path / "empty").mkdir()
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(b"\x89PNG")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.txt").write_bytes(b"\x00\xff\xfe\x00")
    (tmp_path / "blank.txt").write_text("")
    for data, match in [(tmp_path / "empty", "no text files"), (tmp_path / "images", "no text files"),
                        (tmp_path / "bin", "no file in the folder .* is readable"),
                        (tmp_path / "bin" / "a.txt", "not readable UTF-8"), (tmp_path / "blank.txt", "no tokens"),
                        ([tmp_path / "nowhere"], "nowhere.*does not exist")]:
        with pytest.raises(CorpusError, match=match):
            route_stats(tiny_text_engine, data, seq_len=32)
    with pytest.raises(CorpusNotFoundError):  # still a FileNotFoundError
        route_stats(tiny_text_engine, tmp_path / "nowhere")
    # a folder's binary file is skipped with a warning; hidden folders are not read
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("w1 w2 w3")
    (tmp_path / "mixed" / "b.txt").write_bytes(b"\x00\x01")
    (tmp_path / "mixed" / ".venv").mkdir()
    (tmp_path / "mixed" / ".venv" / "c.txt").write_text("w4 " * 50)
    with pytest.warns(UserWarning, match="1 of 2 files"):
        stats = route_stats(tiny_text_engine, tmp_path / "mixed", seq_len=32)
    assert stats.tokens == 3
    # texts and paths side by side, each what it says
    both = route_stats(tiny_text_engine, [tmp_path / "mixed" / "a.txt", "w5 w6"], seq_len=32)
    assert both.tokens == 5


def test_cli_routes_checks_the_corpus_and_out_before_loading(gen_text_model_dir, tmp_path, capsys):
    from clover_lab.cli.main import main

    for argv, match in [(["--data", str(tmp_path / "nowhere")], "nowhere"),
                        (["--data", str(gen_text_model_dir), "--out", str(tmp_path / "no" / "r.npz")],
                         "does not exist")]:
        argv = ["routes", "--model", str(tmp_path / "not-loaded"), *argv]
        if "--out" not in argv:
            argv += ["--out", str(tmp_path / "r.npz")]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert match in err and len(err.strip().splitlines()) == 1 and "not-loaded" not in err


# --------------------------------------------------------------------------- 2. lenses and patching
KW = dict(max_new_tokens=32, threshold=0.3)
OTHER = [7, 8, 9, 200, 300]


def test_the_routing_lens_of_a_batch_is_read_per_row(tiny_engine):
    from clover_lab import lens

    for r, prompt in enumerate([PROMPT, OTHER]):
        alone = lens.routing_lens(tiny_engine, prompt, **KW)
        row = lens.routing_lens(tiny_engine, [PROMPT, OTHER], row=r, **KW)
        assert [(x["layer"], x["block"], x["step"]) for x in row.rows] == \
               [(x["layer"], x["block"], x["step"]) for x in alone.rows]
        for a, b in zip(alone.by_layer(), row.by_layer()):
            assert b["step_flip_rate"] == pytest.approx(a["step_flip_rate"], abs=0.05)
            assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-3)
    with pytest.raises(InputError, match=r"batch of 2 prompts.*row=0 .. 1"):
        lens.routing_lens(tiny_engine, [PROMPT, OTHER], **KW)
    with pytest.raises(InputError, match="one generation"):
        lens.routing_lens(tiny_engine, PROMPT, row=0, **KW)
    with tiny_engine.capture("layers.*.moe.route") as cap:  # a recording of a batch, read per row
        tiny_engine.generate([PROMPT, OTHER], **KW)
    with pytest.raises(InputError, match=r"batch of rows 0..1.*row=0 .. 1"):
        lens.routing_lens(cap)
    assert lens.routing_lens(cap, row=1).by_layer() == lens.routing_lens(tiny_engine, [PROMPT, OTHER], row=1,
                                                                          **KW).by_layer()


@pytest.mark.parametrize("call,match", [
    (lambda e, lens, pt: lens.logit_lens(e, PROMPT, k=0, **KW), "k=0"),
    (lambda e, lens, pt: lens.logit_lens(e, PROMPT, k=-3, **KW), "k=-3"),
    (lambda e, lens, pt: lens.logit_lens(e, [PROMPT, OTHER], **KW), "batch of 2"),
    (lambda e, lens, pt: lens.coreset_sweep(e, [PROMPT], sizes=[2], mode="ar", max_new_tokens=4), "mode='ar'"),
    (lambda e, lens, pt: lens.coreset_sweep(e, [PROMPT], sizes=4, **KW), "sizes=4"),
    (lambda e, lens, pt: lens.coreset_sweep(e, [PROMPT], sizes=["4"], **KW), "ints"),
    (lambda e, lens, pt: lens.coreset_sweep(e, [PROMPT], sizes=[2.5], **KW), "ints"),
    (lambda e, lens, pt: pt.Site("layers.0.output", 0, 0, positions=5), r"positions=5.*\(5,\)"),
    (lambda e, lens, pt: pt.Site("layers.0.output", 0, 0, positions=[]), "one or more"),
    (lambda e, lens, pt: pt.Site("layers.0.output", -1, 0), "block=-1"),
    (lambda e, lens, pt: pt.Site("layers.0.output", None, 2), "without a block"),
    (lambda e, lens, pt: pt.Site("layers.x.output", 0, 0), "layers.x.output"),
    (lambda e, lens, pt: pt.record(e, [PROMPT, OTHER], **KW), "batch"),
    (lambda e, lens, pt: pt.measure(e, PROMPT, pt.probability(11, 512), 0, 0, **KW), r"\[512\].*vocabulary"),
    (lambda e, lens, pt: pt.logit_diff(11, 3, -1), "token=-1"),
])
def test_lens_and_patching_arguments_are_named(tiny_engine, call, match):
    from clover_lab import lens, patching

    with pytest.raises(InputError, match=match):
        call(tiny_engine, lens, patching)
    assert len(tiny_engine.generate(PROMPT, max_new_tokens=4).token_ids) == 4


def test_coreset_sweep_takes_one_prompt_as_one(tiny_engine):
    from clover_lab import lens

    rows = lens.coreset_sweep(tiny_engine, PROMPT, sizes=[2], max_new_tokens=8, threshold=0.3)
    assert [r["prompts"] for r in rows] == [1, 1]


def test_patch_sites_must_exist_in_the_source(tiny_engine):
    from clover_lab import patching

    a = patching.record(tiny_engine, PROMPT, points="layers.*[0-9].output", **KW)
    site = patching.Site("layers.1.output", 0, 0, positions=(len(PROMPT) + 2,))
    assert patching.patch(tiny_engine, PROMPT[::-1], a, [site], **KW).applied  # same length: patched
    with pytest.raises(InputError, match="10 tokens and this prompt has 5"):
        patching.patch(tiny_engine, OTHER, a, "all", **KW)
    with pytest.raises(InputError, match="batch"):
        patching.patch(tiny_engine, [PROMPT, PROMPT], a, "all", **KW)
    for bad, match in [(patching.Site("layers.1.output", 99, 0), "no layers.1.output at block 99, step 0"),
                       (patching.Site("layers.1.output", 0, 99), "at block 0, step 99"),
                       (patching.Site("layers.1.output", 0, 0, positions=(5000,)), r"positions \[5000\]"),
                       (patching.Site("layers.1.input", 0, 0), "did not record layers.1.input")]:
        with pytest.raises(InputError, match=match):
            patching.patch(tiny_engine, PROMPT, a, [bad], **KW)
    with pytest.raises(InputError, match="list of Site"):
        patching.patch(tiny_engine, PROMPT, a, site, **KW)


def test_sweeps_refuse_forwards_steps_and_positions_that_do_not_exist(tiny_engine):
    from clover_lab import patching

    metric = patching.probability(len(PROMPT) + 1, 7)
    corrupt = PROMPT[:3] + [200] + PROMPT[4:]
    for kwargs, match in [(dict(block=0, step=99), "metric's block 0, step 99: the clean run has no such forward"),
                          (dict(block=0, step=0, patch_at=(7, 0)), "patch_at block 7"),
                          (dict(block=0, step=0, positions=[]), "positions is empty"),
                          (dict(block=0, step=0, positions=[9999]), r"positions \[9999\]")]:
        with pytest.raises(InputError, match=match):
            patching.sweep_layers_positions(tiny_engine, PROMPT, corrupt, metric, **kwargs, **KW)
    for kwargs, match in [(dict(steps=[]), "steps is empty"), (dict(steps=[0, 99]), "step 99"),
                          (dict(steps=5), "steps=5")]:
        with pytest.raises(InputError, match=match):
            patching.sweep_steps_layers(tiny_engine, PROMPT, corrupt, metric, block=0, **kwargs, **KW)
    with pytest.raises(InputError, match="outside the vocabulary"):
        patching.sweep_steps_layers(tiny_engine, PROMPT, corrupt, patching.logit_diff(11, 0, 10**6), block=0, **KW)


# --------------------------------------------------------------------------- 3. FP8 checkpoints
@pytest.fixture
def fp8_dir(gen_model_dir, tmp_path):
    from clover_lab.checkpoint.quantize import quantize_checkpoint

    return quantize_checkpoint(gen_model_dir, tmp_path / "fp8", block=(16, 16))


def _rewrite(path, fn):
    from safetensors.torch import load_file, save_file

    save_file(fn(load_file(path / "model.safetensors")), path / "model.safetensors")


FP8_WEIGHT = "model.layers.1.mlp.experts.2.down_proj.weight"
FP8_SCALE = FP8_WEIGHT + "_scale_inv"


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_fp8_scales_must_be_finite_and_positive(fp8_dir, value, keep):
    def damage(t):
        t[FP8_SCALE][0, 0] = value
        return t

    _rewrite(fp8_dir, damage)
    with pytest.raises(clover_lab.CheckpointError, match=rf"scale tensor '{FP8_SCALE}' holds 1 entries that are "
                                                         r"not finite and positive"):
        clover_lab.CloverModel.from_pretrained(fp8_dir, keep_fp8=keep)


def test_nan_in_kept_fp8_weights_is_found_at_load(fp8_dir):
    def damage(t):
        raw = t[FP8_WEIGHT].view(torch.uint8).clone()
        raw[0, 0] = 0x7F  # float8_e4m3fn's NaN
        t[FP8_WEIGHT] = raw.view(torch.float8_e4m3fn)
        return t

    _rewrite(fp8_dir, damage)
    for keep in (True, False):
        with pytest.raises(clover_lab.CheckpointError, match=rf"tensor '{FP8_WEIGHT}' holds NaN"):
            clover_lab.CloverModel.from_pretrained(fp8_dir, keep_fp8=keep)
    clover_lab.CloverModel.from_pretrained(fp8_dir, keep_fp8=True, check_finite=False)  # asked not to look


@pytest.mark.parametrize("kwargs,match", [
    (dict(block=(0, 0)), r"block=0"), (dict(block=(16,)), "two block sizes"), (dict(block=16), "two block sizes"),
    (dict(block=(16, -4)), "block=-4"), (dict(max_shard_bytes=0), "max_shard_bytes=0"),
])
def test_quantize_checkpoint_arguments(gen_model_dir, tmp_path, kwargs, match):
    from clover_lab.checkpoint.quantize import quantize_checkpoint

    with pytest.raises(InputError, match=match):
        quantize_checkpoint(gen_model_dir, tmp_path / "q", **kwargs)
    assert not (tmp_path / "q").exists()  # refused before anything is written


# --------------------------------------------------------------------------- 4. booleans, placement, shards
@pytest.mark.parametrize("kwargs,match", [
    (dict(keep_fp8="false"), "keep_fp8='false'"), (dict(check_finite=1), "check_finite=1"),
    (dict(progress="no"), "progress='no'"), (dict(pin_memory=None), "pin_memory=None"),
    (dict(coreset_size=1), r"load\(coreset_size=1\): .*num_experts_per_tok"),
    (dict(coreset_size="4"), r"load\(coreset_size='4'\): expected an int"),
    (dict(max_memory={"cpu": "1GiB"}), "without a device_map it would be ignored"),
    (dict(device_map={"": "cpu"}, max_memory={"cpu": "1GiB"}), "it would be ignored"),
    (dict(device_map={"": -1}), r'"" -> -1 is not a device'),
    (dict(device_map={"": "meta"}), "'meta' holds shapes but no weights"),
    (dict(device_map={"": "cuda:x"}), "'cuda:x' is not a device"),
    (dict(device_map="everywhere"), "expected 'auto' or a dict"),
    (dict(device_map="auto", max_memory=5), "max_memory: expected a dict"),
])
def test_load_arguments_are_named_before_anything_is_read(gen_model_dir, kwargs, match):
    with pytest.raises(CloverError, match=match):
        clover_lab.load(gen_model_dir, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch without CUDA")
def test_a_gpu_placement_without_cuda_is_one_line(gen_model_dir, capsys):
    for kwargs in (dict(device_map={"": 0}), dict(device_map="auto", max_memory={0: "1GiB", "cpu": "4GiB"}),
                   dict(device_map={"": "cuda:0"})):
        with pytest.raises(clover_lab.CheckpointError, match="no CUDA device is available"):
            clover_lab.load(gen_model_dir, **kwargs)
    from clover_lab.cli.main import main

    assert main(["generate", "--model", str(gen_model_dir), "--prompt-ids", "1,2", "--device-map", "auto",
                 "--max-memory", "0=1GiB", "--no-live"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no CUDA device is available" in err and len(err.splitlines()) == 1


def test_max_memory_none_with_auto_plans_on_what_is_free(gen_model_dir):
    engine = clover_lab.load(gen_model_dir, device_map="auto", max_memory=None)
    assert len(engine.generate(PROMPT, max_new_tokens=4).token_ids) == 4


@pytest.mark.parametrize("value", [0, -1, 2.5, "1GB", True])
def test_max_shard_bytes_must_be_a_positive_int(tiny_model, tmp_path, value):
    with pytest.raises(InputError, match="max_shard_bytes"):
        tiny_model.save_pretrained(tmp_path / "m", max_shard_bytes=value)
    assert not (tmp_path / "m").exists()
    tiny_model.save_pretrained(tmp_path / "m", max_shard_bytes=200_000)  # a real limit: several shards
    assert len(list((tmp_path / "m").glob("model-*.safetensors"))) > 1


# --------------------------------------------------------------------------- 5. the first harness's remainder
def test_diffusion_settings_in_an_ar_request_are_said_and_stats_true(tiny_engine):
    from clover_lab.engine.requests import IgnoredSettingWarning

    with pytest.warns(IgnoredSettingWarning, match="coreset_size, threshold|threshold, .*coreset_size"):
        r = tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=4, threshold=0.5, coreset_size=4)
    assert r.stats.coreset_size is None and r.stats.mode == "ar"
    with pytest.warns(IgnoredSettingWarning, match="threshold"):
        tiny_engine.generate([PROMPT, OTHER], mode="ar", max_new_tokens=4, threshold=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # settings AR reads, or diffusion with its own: not a word
        tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=4, temperature=0)
        assert tiny_engine.generate(PROMPT, max_new_tokens=4, coreset_size=4).stats.coreset_size == 4


def test_thinking_is_for_chat_messages_and_a_boolean(tiny_text_engine):
    for prompt in ("w1 w2", [1, 2, 3]):
        with pytest.raises(GenerationError, match="thinking=True applies to chat messages"):
            tiny_text_engine.generate(prompt, thinking=True, max_new_tokens=4)
    with pytest.raises(InputError, match="thinking='false'"):
        tiny_text_engine.generate([{"role": "user", "content": "w1"}], thinking="false", max_new_tokens=4)
    on = tiny_text_engine.encode([{"role": "user", "content": "w1"}], thinking=True)
    off = tiny_text_engine.encode([{"role": "user", "content": "w1"}], thinking=False)
    assert on != off


def test_reentrant_generation_past_the_limit_is_one_hook_error(tiny_engine):
    def again(ev):
        tiny_engine.generate(PROMPT, max_new_tokens=4)

    with tiny_engine.hooks({"denoise.step": again}):
        with pytest.raises(clover_lab.HookError) as info:
            tiny_engine.generate(PROMPT, max_new_tokens=4)
    message = str(info.value)
    assert message.count("HookError") == 0 and message.count("hook on") == 1 and "4 levels deep" in message


# --------------------------------------------------------------------------- 6. obscure errors named
def test_a_batch_rows_no_progress_limit_names_the_row(tiny_engine):
    def veto(ev):
        ev.unmask = []

    with tiny_engine.hooks({"denoise.step": veto}):
        with pytest.raises(clover_lab.HookError, match=r"row 0, block 0: hooks kept positions masked"):
            tiny_engine.generate([PROMPT, OTHER], max_new_tokens=4)


@pytest.mark.parametrize("prompt,match", [
    (["w1 w2", None], "prompt 1 of the batch is NoneType"), ([[1, 2], 5], "prompt 1 of the batch is int"),
    ([1, 2, None], "item 2 is NoneType"), ([1, "a"], "prompt 0 of the batch is int"),
])
def test_a_list_that_is_neither_a_prompt_nor_a_batch_names_its_item(tiny_text_engine, prompt, match):
    with pytest.raises(GenerationError, match=match):
        tiny_text_engine.generate(prompt, max_new_tokens=4)


def test_malformed_point_names_are_named(tiny_engine):
    from clover_lab.hooks import points as P

    for name in ("layers.x.output", "layers.3", "layers..output"):
        with pytest.raises(InputError, match="expected layers"):
            P.parse(name)
        with pytest.raises(KeyError, match=f"unknown hook point '{name}'"):  # a KeyError still
            tiny_engine.capture(name)
    with pytest.raises(CloverError, match="named by a string"):
        tiny_engine.capture([3])


def test_a_bad_default_coreset_is_blamed_on_what_set_it(gen_model_dir, tmp_path):
    import shutil

    with pytest.raises(GenerationError, match=r"load\(coreset_size=1\)") as info:
        clover_lab.load(gen_model_dir, coreset_size=1)
    assert "generation_config.json" not in str(info.value)
    shutil.copytree(gen_model_dir, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"coreset_size": 1}))
    with pytest.raises(clover_lab.CheckpointError, match="generation_config.json: coreset_size=1"):
        clover_lab.load(tmp_path / "m")


# --------------------------------------------------------------------------- 7. training arguments
@pytest.mark.parametrize("option,match", [
    (["--stop-at", "0"], "--stop-at=0: expected a positive integer"),
    (["--stop-at", "-2"], "--stop-at=-2"),
    (["--minutes", "-1"], "--minutes=-1.0: expected a positive number"),
    (["--minutes", "0"], "--minutes=0.0"), (["--minutes", "nan"], "--minutes=nan"),
])
def test_adapt_stops_are_checked_before_anything_runs(gen_text_model_dir, tmp_path, capsys, option, match):
    from clover_lab.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["adapt", "--init", str(gen_text_model_dir), "--data", str(gen_text_model_dir), "--out",
              str(tmp_path / "o"), *option])
    assert info.value.code == 2 and match in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_adapt_api_refuses_the_same_stops(gen_text_model_dir, tmp_path):
    from clover_lab.train.adapt import AdaptSettings, adapt
    from clover_lab.train.objective import TrainSettings

    for kwargs, match in [(dict(stop_at=0), "stop_at=0"), (dict(minutes=-1), "minutes=-1")]:
        with pytest.raises(InputError, match=match):
            adapt(tmp_path / "o", [str(gen_text_model_dir)], AdaptSettings(init=str(gen_text_model_dir)),
                  TrainSettings(), **kwargs)
    assert not (tmp_path / "o").exists()


def test_a_tokenizer_past_the_models_vocabulary_is_refused_before_training(gen_text_model_dir, gen_tokenizer,
                                                                           tmp_path, capsys):
    from clover_lab.cli.main import main

    big = gen_tokenizer.__class__.from_pretrained(str(gen_text_model_dir))
    big.add_tokens([f"extra{i}" for i in range(20)])
    big.save_pretrained(str(tmp_path / "tok"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.py").write_text("w1 w2 w3\n" * 50)
    assert main(["adapt", "--init", str(gen_text_model_dir), "--tokenizer", str(tmp_path / "tok"), "--data",
                 str(tmp_path / "data"), "--out", str(tmp_path / "o"), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "has 532 tokens, but the init's embedding has 512 rows" in err and not (tmp_path / "o").exists()


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
