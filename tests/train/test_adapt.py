"""``clover-lab adapt``: an AR checkpoint gets a mask token and a trained preview; runs resume;
two gloo processes under torchrun (FSDP2) give the loss and weights of one process."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from injected_faults import FULL, Writes, at_call, leftovers
from safetensors.torch import load_file

import clover_lab
from clover_lab import CloverConfig, CloverModel
from clover_lab.checkpoint import names
from clover_lab.cli.main import main as cli_main
from clover_lab.errors import InputError
from clover_lab.train import adapt, lora, mask_token, shard, train_tokenizer
from clover_lab.train.stdlib_corpus import stdlib_files

SMALL = ("bisect.py", "heapq.py", "colorsys.py", "keyword.py", "abc.py", "fnmatch.py")
COMMON = ["--steps", "2", "--seq-len", "32", "--batch-size", "4", "--log-every", "1", "--seed", "3"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A few small stdlib modules as the --data directory."""
    d = tmp_path_factory.mktemp("adapt-data")
    for f in stdlib_files():
        if f.name in SMALL and not (d / f.name).exists():
            shutil.copy(f, d / f.name)
    assert len(list(d.iterdir())) >= 5
    return d


@pytest.fixture(scope="module")
def clover_init(tmp_path_factory, data):
    """clover-tiny with random weights (fp32) and a byte-level BPE tokenizer that has <|mask|>."""
    d = tmp_path_factory.mktemp("clover-init")
    tok = train_tokenizer(sorted(data.iterdir()), 300, d)
    config = CloverConfig.preset("clover-tiny", mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_id)
    CloverModel.random(config, seed=5).save_pretrained(d)
    return d


def ar_tokenizer(files, vocab_size: int):
    """A byte-level BPE tokenizer as an AR model ships it: an end-of-text token, no mask token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator((f.read_text() for f in files), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def weights(directory) -> dict:
    """The saved tensors by parameter name, in the parameters' shapes (the file has the release's names)."""
    stored = load_file(str(Path(directory) / "model.safetensors"))
    out = {names.canonical_name(n): t for n, t in stored.items()}
    return {n: t[:, None] if n.endswith("conv1d_right.weight") else t for n, t in out.items()}


def losses(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "training" / "loss_log.jsonl").read_text().splitlines()]


def run(*argv) -> None:
    assert cli_main(["adapt", *map(str, argv)]) == 0


def assert_same_run(a, b, init=None):
    """The same losses, gradient norms (Adam would hide a wrongly scaled gradient from the
    weights) and weights, at fp32 tolerance. Adam divides each update by the gradient's own
    size, so where a gradient is near its eps, summation order shows: 3e-6 on weights of 0.07
    after two steps at lr 3e-4 (in_proj_a), hence rtol 1e-4 on the weights."""
    la, lb = losses(a), losses(b)
    assert [r["step"] for r in la] == [r["step"] for r in lb] == [1, 2]
    for ra, rb in zip(la, lb):
        for key in ("loss", "mask_ce", "ar_ce", "balance", "confidence", "mask_acc", "grad_norm"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-6), (key, ra["step"])
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-4, atol=1e-5, msg=name)
    if init is not None:  # the runs did train
        w0 = weights(init)
        assert sum(not torch.equal(w0[n], wa[n]) for n in w0) > len(w0) // 4  # lora: 26 of 84


# --------------------------------------------------------------------------- one process
@pytest.fixture(scope="module")
def one_process(tmp_path_factory, clover_init, data):
    """Single-process runs the distributed ones are compared with: `all` for two steps, `all`
    stopped after one step (checkpointed), `lora` for two steps."""
    root = tmp_path_factory.mktemp("adapt-one")
    base = ["--init", clover_init, "--data", data, *COMMON]
    run(*base, "--out", root / "all", "--train", "all")
    run(*base, "--out", root / "part", "--train", "all", "--stop-at", "1")
    run(*base, "--out", root / "lora", "--train", "lora", "--lora-rank", "4")
    return root, base


def test_resume_equals_an_uninterrupted_run(one_process, tmp_path, clover_init, capsys):
    root, base = one_process
    part = tmp_path / "part"
    shutil.copytree(root / "part", part)
    state = torch.load(part / "training" / "state.pt", weights_only=False)
    assert state["step"] == 1 and [p.name for p in (part / "training").glob("checkpoint-*")] == ["checkpoint-0000001"]
    run(*base, "--out", part, "--train", "all")
    assert_same_run(root / "all", part, clover_init)
    # a rerun of a finished run changes nothing; another setting is refused, naming it
    run(*base, "--out", part, "--train", "all")
    assert len(losses(part)) == 2
    assert cli_main(["adapt", *map(str, base), "--out", str(part), "--train", "lora"]) == 2
    other = [str(a) for a in base]
    other[other.index("--data") + 1] = str(Path(other[other.index("--data") + 1]) / "heapq.py")
    assert cli_main(["adapt", *other, "--out", str(part), "--train", "all"]) == 2
    err = capsys.readouterr().err
    assert "--train: 'all' in the run, 'lora' given" in err and "heapq.py" in err


@pytest.mark.slow  # a child process
def test_terminated_run_checkpoints_and_exports(tmp_path, clover_init, data):
    """SIGTERM (kill, a scheduler's stop) ends a single-process run like Ctrl-C: checkpointed at
    the step it reached, exported, exit code 0; rerunning resumes there."""
    import signal
    import time

    out = tmp_path / "out"
    argv = ["adapt", "--init", clover_init, "--data", data, "--out", out, "--train", "preview",
            "--steps", "100000", "--seq-len", "32", "--batch-size", "2",
            "--log-every", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "clover_lab.cli.main", *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log = out / "training" / "loss_log.jsonl"
    deadline = time.monotonic() + 300
    while not (log.exists() and log.read_text().count("\n") >= 2) and proc.poll() is None:
        assert time.monotonic() < deadline, "no step logged in 300 s"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-2000:]
    step = torch.load(out / "training" / "state.pt", weights_only=False)["step"]
    assert 2 <= step < 100000 and (out / "model.safetensors").is_file()
    assert "interrupted: saving a checkpoint" in output


@pytest.mark.slow  # torchrun, two ranks
def test_two_processes_equal_one(one_process, tmp_path, clover_init):
    """torchrun, 2 gloo processes, FSDP2: the same losses and weights as one process after two
    steps (`all` and `lora`), and a one-process checkpoint resumed on two processes (with
    activation checkpointing)."""
    root, base = one_process
    shutil.copytree(root / "part", tmp_path / "part")
    runs = [[*base, "--out", tmp_path / "all", "--train", "all"],
            [*base, "--out", tmp_path / "part", "--train", "all", "--activation-checkpointing"],
            [*base, "--out", tmp_path / "lora", "--train", "lora", "--lora-rank", "4"]]
    worker = Path(__file__).with_name("adapt_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(worker), json.dumps([[str(a) for a in r] for r in runs])],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_same_run(root / "all", tmp_path / "all", clover_init)
    assert_same_run(root / "all", tmp_path / "part")
    assert_same_run(root / "lora", tmp_path / "lora", clover_init)


def test_activation_checkpointing_changes_no_gradient(tiny_model):
    from clover_lab.train.objective import TrainSettings, block_diffusion_loss

    clean = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    grads = []
    for recompute in (False, True):
        model = CloverModel(tiny_model.config)
        model.load_state_dict(tiny_model.state_dict())
        model.train()
        shard.shard_model(model, shard.Shard(), recompute)
        loss, _ = block_diffusion_loss(model, clean, TrainSettings(seq_len=32, batch_size=2),
                                       torch.Generator().manual_seed(1))
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7, msg=n)


def test_batch_must_split_over_the_processes():
    with pytest.raises(ValueError, match="--batch-size"):
        shard.Shard(rank=1, world=3).rows(8)
    assert shard.Shard(rank=1, world=2).rows(8) == slice(4, 8)


# --------------------------------------------------------------------------- an AR checkpoint
def test_ar_checkpoint_gets_a_mask_token_and_a_trained_preview(tmp_path, reference, data):
    """A transformers-saved Qwen3.5-MoE checkpoint and a tokenizer without a mask token, adapted
    with --train preview: a loadable Clover directory whose causal path is the init's bit for bit."""
    _, ref_dir = reference
    init = tmp_path / "qwen"
    shutil.copytree(ref_dir, init)
    tok = ar_tokenizer(sorted(data.iterdir()), 300)
    tok.save_pretrained(str(init))
    out = tmp_path / "clover"
    run("--init", init, "--data", data, "--out", out, "--train", "preview", "--block-size", "16", *COMMON)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "clover_moe" and config["block_size"] == 16
    assert config["mask_token_id"] == len(tok)  # added after the tokenizer's last token
    assert json.loads((out / "generation_config.json").read_text())["threshold"] == 0.9
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "untrained preview" warning: the preview weights are there
        engine = clover_lab.load(out)
    assert engine.tokenizer.mask_token == "<|mask|>" and engine.tokenizer.mask_token_id == len(tok)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = CloverModel.from_pretrained(init)
    after, w0, w1 = engine.model, dict(before.named_parameters()), weights(out)
    changed = {n for n in w1 if not torch.equal(w0[n].detach(), w1[n])}
    assert changed and all(adapt.is_preview(n) or n == adapt.EMBEDDING for n in changed)
    assert all(n in changed for n in w1 if n.endswith(("history_bias", "conv1d_right.weight")))
    assert torch.equal(w0[adapt.EMBEDDING][:len(tok)], w1[adapt.EMBEDDING][:len(tok)])  # only the mask row moved
    ids = torch.randint(0, len(tok), (1, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(before.logits(ids), after.logits(ids))


def test_mask_token_grows_a_full_vocabulary(data):
    tok = ar_tokenizer(sorted(data.iterdir()), 200)
    model = CloverModel.random(CloverConfig.preset("clover-tiny", vocab_size=len(tok), mask_token_id=None))
    emb = model.model.embed_tokens.weight.detach().clone()
    mask_id, how = mask_token.ensure_mask_token(tok, model)
    assert (how, mask_id, model.config.vocab_size, model.config.mask_token_id) == ("added", len(emb), len(emb) + 1,
                                                                                   len(emb))
    assert model.model.embed_tokens.weight.shape[0] == model.lm_head.weight.shape[0] == len(emb) + 1
    torch.testing.assert_close(model.model.embed_tokens.weight[-1], emb.mean(0))
    assert model.logits(torch.tensor([[3, mask_id, 5]])).shape == (1, 3, len(emb) + 1)


def test_mask_token_conflict_is_refused(data):
    tok = train_tokenizer(sorted(data.iterdir()), 260, Path(data.parent / "tok-conflict"))
    model = CloverModel.random(CloverConfig.preset("clover-tiny", mask_token_id=7))
    with pytest.raises(ValueError, match="mask_token_id 7"):
        mask_token.ensure_mask_token(tok, model)


# --------------------------------------------------------------------------- LoRA
def test_lora_merged_into_the_weights_is_the_adapted_model(tiny_model):
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    plain = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    names = lora.add_lora(tiny_model, lora.DEFAULT_TARGETS, rank=4, alpha=8)
    assert names and all(".lora_" in n for n in names)
    with torch.no_grad():
        for n, p in tiny_model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05)  # peft starts B at zero: the adapted model would equal the plain one
        adapted = tiny_model.training_forward(ids, ids)[1]
    merged = lora.merged_state_dict(tiny_model.state_dict(), lora.lora_scaling(4, 8))
    assert merged.keys() == plain.keys()
    fresh, unadapted = CloverModel(tiny_model.config), CloverModel(tiny_model.config)
    fresh.load_state_dict(merged)
    unadapted.load_state_dict(plain)
    with torch.no_grad():
        torch.testing.assert_close(fresh.training_forward(ids, ids)[1], adapted, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(adapted, unadapted.training_forward(ids, ids)[1], atol=1e-3)


def test_lora_targets_are_checked(tiny_model):
    with pytest.raises(ValueError, match="experts"):
        lora.add_lora(tiny_model, ["experts"], rank=4, alpha=8)


def test_bad_arguments_exit_2_naming_them(capsys, clover_init, tmp_path):
    base = ["adapt", "--init", str(clover_init), "--out", str(tmp_path / "o")]
    assert cli_main([*base, "--data", str(tmp_path / "nowhere")]) == 2
    assert "nowhere is neither a file nor a directory" in capsys.readouterr().err
    assert cli_main(["adapt", "--init", str(tmp_path), "--data", "x", "--out", str(tmp_path / "o2")]) == 2
    assert "config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main([*base, "--data", "x", "--steps", "0"])
    assert "--steps must be >= 1" in capsys.readouterr().err


# --------------------------------------------------------------------------- the memory plan
def test_memory_plan_counts_the_models_parameters():
    from clover_lab.train import memory_plan as plan

    config = CloverConfig.preset("clover-tiny")
    counts = plan.parameter_counts(config)
    assert counts["total"] == sum(p.numel() for p in CloverModel(config).parameters())
    big = plan.memory_plan(CloverConfig.preset("clover-35b-a3b"), ranks=8)
    n = big["parameters"]["total"]
    assert 34e9 < n < 36e9  # "35B parameters in total" (spec section 1)
    assert big["bytes"]["sharded"] == {"weights": n * 2 / 8, "gradients": n * 2 / 8, "AdamW moments": n * 4 / 8}
    preview = plan.memory_plan(CloverConfig.preset("clover-35b-a3b"), ranks=8,
                               trained=plan.preview_parameters(CloverConfig.preset("clover-35b-a3b")))
    assert preview["per_rank_gib"] < big["per_rank_gib"] / 2


def test_self_distillation_stage_from_an_adapted_model(one_process, tmp_path, data):
    """The optional stage: a corpus of the adapted model's own continuations (distill --model
    --tokens), mixed into a second adaptation that starts from the first one's output."""
    from clover_lab.train import distill

    root, _ = one_process
    corpus = tmp_path / "distill.pt"
    distill.main(["--model", str(root / "all"), "--tokens", str(root / "all" / "training" / "data.pt"),
                  "--out", str(corpus), "--sequences", "4", "--seq-len", "160", "--batch-size", "4"])
    assert torch.load(corpus)["sequences"].shape == (4, 160)
    out = tmp_path / "stage2"
    run("--init", root / "all", "--data", data, "--out", out, "--train", "all", "--distill", corpus,
        "--distill-share", "0.5", *COMMON)
    state = torch.load(out / "training" / "state.pt", weights_only=False)
    assert state["settings"]["distill_data"] == str(corpus) and state["step"] == 2
    assert clover_lab.load(out).model.config.mask_token_id == clover_lab.load(root / "all").model.config.mask_token_id


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



STEPS = ["--steps", "4", "--seq-len", "32", "--batch-size", "2", "--log-every", "1", "--checkpoint-every", "2",
         "--seed", "3", "--train", "all"]


def adapt_code(*argv) -> int:
    return cli_main(["adapt", *map(str, argv)])


# --------------------------------------------------------------------------- training stops
def log_of(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "training" / "loss_log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "time"} for r in rows]


def trained_state(out) -> int:
    return torch.load(out / "training" / "state.pt", weights_only=False)["step"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, clover_init, data):
    out = tmp_path_factory.mktemp("uninterrupted") / "out"
    assert adapt_code("--init", clover_init, "--data", data, "--out", out, *STEPS) == 0
    return out



class _LogJson:
    """adapt's json module with a boundary at the log line of one step."""

    def __init__(self, step: int, wrap):
        self._step, self._wrapped = step, wrap(json.dumps)

    def dumps(self, obj, *a, **k):
        if isinstance(obj, dict) and obj.get("step") == self._step:
            return self._wrapped(obj, *a, **k)
        return json.dumps(obj, *a, **k)

    def __getattr__(self, name):
        return getattr(json, name)


def _patch(monkeypatch, boundary: str, wrap):
    import clover_lab.train.adapt as adapt_module

    if boundary == "optimizer step 3":
        monkeypatch.setattr(torch.optim.AdamW, "step", wrap(torch.optim.AdamW.step))
    elif boundary == "log line 3":
        monkeypatch.setattr(adapt_module, "json", _LogJson(3, wrap))
    elif boundary == "checkpoint 2 (DCP)":
        monkeypatch.setattr(adapt_module, "save_checkpoint", wrap(adapt_module.save_checkpoint))
    elif boundary == "checkpoint 4 (state)":
        real = torch.save
        wrapped = wrap(real)
        monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (wrapped if "state" in str(f) else real)(obj, f,
                                                                                                             *a, **k))
    else:
        raise AssertionError(boundary)


# (boundary, action, n-th call) -> the step the run stopped at with a checkpoint (or None: kept its last)
STOPS = [("optimizer step 3", "SIGINT", 3, 3), ("optimizer step 3", "SIGTERM", 3, 3),
         ("optimizer step 3", "raise", 3, 2),
         ("log line 3", "SIGINT", 1, 3), ("log line 3", "raise", 1, 2),
         ("checkpoint 2 (DCP)", "SIGTERM", 1, 2), ("checkpoint 2 (DCP)", "raise", 1, None),
         ("checkpoint 2 (DCP)", "disk-full", 2, 2), ("checkpoint 4 (state)", "raise", 2, 2),
         ("checkpoint 4 (state)", "disk-full", 2, 2)]


def load_file_dict(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_adapt_refuses_to_write_over_its_init(tmp_path, clover_init, capsys):
    init = tmp_path / "init"
    shutil.copytree(clover_init, init)
    before = {p.name: p.read_bytes() for p in init.iterdir()}
    assert adapt_code("--init", init, "--data", "stdlib", "--out", init, *STEPS) == 2
    assert "--out (equal to --init): the output" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in init.iterdir()} == before


def test_adapt_finds_an_unwritable_out_before_the_run(tmp_path, clover_init, data, capsys):
    (tmp_path / "a-file").write_text("x")
    for out in (tmp_path / "a-file" / "out", tmp_path / "a-file"):
        assert adapt_code("--init", clover_init, "--data", data, "--out", out, *STEPS) == 2
        err = capsys.readouterr().err
        assert f"--out {out}: {tmp_path / 'a-file'} is a file, not a directory" in err, err
        assert "mask token" not in err  # nothing was loaded or trained


def test_a_refused_adapt_run_leaves_nothing_to_resume(tmp_path, clover_init, data, capsys):
    """A first run refused after its data was encoded (too few tokens for --seq-len) removes
    what it made, so the corrected command (other --data) starts instead of being refused as
    the resume of a run that never was."""
    out = tmp_path / "out"
    assert adapt_code("--init", clover_init, "--data", data, "--out", out, *STEPS[:2], "--seq-len", "1000000") == 2
    assert "fewer than one --seq-len" in capsys.readouterr().err
    assert not out.exists()
    files = sorted(map(str, data.iterdir()))
    assert adapt_code("--init", clover_init, "--data", *files, "--out", out, *STEPS) == 0
    assert json.loads((out / "training" / "loss_log.jsonl").read_text().splitlines()[-1])["step"] == 4


@pytest.mark.parametrize("error", [FULL, KeyboardInterrupt()], ids=["disk-full", "interrupt"])
def test_a_failed_adapt_export_leaves_the_previous_export(tmp_path, monkeypatch, clover_init, data, uninterrupted,
                                                          error):
    """At every write of the export (rerunning a finished run exports it again): the previous
    export stays whole and loadable."""
    out = tmp_path / "out"
    shutil.copytree(uninterrupted, out)
    argv = ("--init", clover_init, "--data", data, "--out", out, *STEPS)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with monkeypatch.context() as m:
        counted = Writes(m)
        assert adapt_code(*argv) == 0
    assert counted.calls >= 4  # config, weights, generation_config.json, the marker
    for k in range(1, counted.calls + 1):
        with monkeypatch.context() as m:
            Writes(m, fail_at=k, error=error)
            assert adapt_code(*argv) == (2 if isinstance(error, OSError) else 130), k
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before and not leftovers(out), k
    assert CloverModel.from_pretrained(out) is not None


@pytest.mark.parametrize("boundary, action, n, saved", STOPS, ids=[f"{b}-{a}" for b, a, _, _ in STOPS])
def test_an_adapt_run_stopped_at_any_boundary_resumes_as_if_never_stopped(
        tmp_path, monkeypatch, capsys, clover_init, data, uninterrupted, boundary, action, n, saved):
    """Ctrl-C and SIGTERM are acted on only after the step in progress, its log line and its
    checkpoint: the run stops with a checkpoint of that whole, logged step. A KeyboardInterrupt
    raised inside a step (or a full disk in a checkpoint) saves nothing of it: the previous
    checkpoint stays whole. Either way the rerun resumes to the uninterrupted run's log and
    weights, exactly."""
    out = tmp_path / "out"
    argv = ("--init", clover_init, "--data", data, "--out", out, *STEPS)
    with monkeypatch.context() as m:
        _patch(m, boundary, at_call(n, action))
        code = adapt_code(*argv)
    err = capsys.readouterr().err
    assert code == {"SIGINT": 0, "SIGTERM": 0, "raise": 130, "disk-full": 2}[action], err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are restored
    state = out / "training" / "state.pt"
    assert (trained_state(out) if state.exists() else None) == saved
    logged = [r["step"] for r in log_of(out)]
    if action in ("SIGINT", "SIGTERM"):  # stopped after a whole step: checkpointed, logged and exported
        assert "interrupted: saving a checkpoint to resume from" in err and logged == list(range(1, saved + 1))
        assert (out / "model.safetensors").is_file()
    if action == "raise":
        assert "nothing of it was saved; the run resumes from" in err
    assert not leftovers(out) and not list((out / "training").glob(".checkpoint-*"))
    assert adapt_code(*argv) == 0
    assert log_of(out) == log_of(uninterrupted)
    want, got = (load_file_dict(d / "model.safetensors") for d in (uninterrupted, out))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


# --------------------------------------------------------------------------- a resume's files, verified
@pytest.fixture(scope="module")
def stopped_at_2(tmp_path_factory, clover_init, data):
    """A run stopped (checkpointed) at step 2 of 4."""
    out = tmp_path_factory.mktemp("stopped") / "out"
    assert adapt_code("--init", clover_init, "--data", data, "--out", out, *STEPS, "--stop-at", 2) == 0
    assert (out / "training" / "checkpoint-0000002" / ".metadata").is_file()
    return out


def _truncate(path):
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])


DAMAGE = [("state.pt", lambda t: _truncate(t / "state.pt"), "state.pt: the run's state .* cannot be read: it is damaged "
           "or cut short", "delete .*state.pt to start the run again from step 0"),
          ("state.pt-not-ours", lambda t: torch.save({"step": "two"}, t / "state.pt"), "state.pt: the run's state .* "
           "lacks step, adapt, settings, generator", "delete .*state.pt"),
          ("data.pt", lambda t: _truncate(t / "data.pt"), "data.pt: the run's encoded --data cannot be read",
           "delete .*data.pt and rerun: --data is encoded again"),
          ("checkpoint-missing", lambda t: shutil.rmtree(t / "checkpoint-0000002"),
           "checkpoint-0000002: the checkpoint of step 2, which .*state.pt says the run resumes from, is missing",
           "delete .*state.pt"),
          ("shard", lambda t: [_truncate(f) for f in (t / "checkpoint-0000002").glob("*.distcp")],
           "checkpoint-0000002: the checkpoint of step 2 cannot be read: a shard is damaged", "delete .*state.pt")]


@pytest.mark.parametrize("what, damage, said, fix", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_a_resume_from_a_damaged_file_names_it_and_says_what_to_do(tmp_path, capsys, clover_init, data, stopped_at_2,
                                                                   uninterrupted, what, damage, said, fix):
    """Resuming adapt from a cut-short state.pt, data.pt or shard, or without its checkpoint folder, was a
    raw traceback. Now one line naming the file and what to do; doing it finishes the run as an
    uninterrupted one (the same weights)."""
    import re

    out = tmp_path / "out"
    shutil.copytree(stopped_at_2, out)
    damage(out / "training")
    capsys.readouterr()
    assert adapt_code("--init", clover_init, "--data", data, "--out", out, *STEPS) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(said, err) and re.search(fix, err), err
    remove = re.search(r"delete (\S+?\.pt)", err).group(1)
    Path(remove).unlink()
    assert adapt_code("--init", clover_init, "--data", data, "--out", out, *STEPS) == 0
    want, got = (load_file_dict(d / "model.safetensors") for d in (uninterrupted, out))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


FULL_DISK = [("checkpoint", "save_checkpoint", "checkpoint-0000002: cannot write the checkpoint "
              "of step 2"),
             ("state", "torch.save:state", "state.pt: cannot write the run's state at step 2"),
             ("data", "torch.save:data", "data.pt: cannot write the encoded --data")]


@pytest.mark.parametrize("what, target, said", FULL_DISK, ids=[f[0] for f in FULL_DISK])
def test_a_full_disk_is_one_line_and_the_run_resumes(tmp_path, monkeypatch, capsys, clover_init, data, uninterrupted,
                                                     what, target, said):
    """A full disk reached adapt as DCP's CheckpointException (a BaseException) or torch.save's
    RuntimeError: a traceback, though the data was safe. Now one line naming the file and what is safe."""
    from torch.distributed.checkpoint.api import CheckpointException

    out = tmp_path / "out"
    with monkeypatch.context() as m:
        if what == "checkpoint":
            def full(*a, **k):
                raise CheckpointException("failed", {0: (OSError(errno.ENOSPC, "No space left on device"), None)})
            m.setattr(sys.modules["clover_lab.train.adapt"], "save_checkpoint", full)
        else:
            real, name = torch.save, target.split(":")[1]

            def save(obj, f, *a, **k):
                if name in str(f):
                    raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing "
                                       "file data/0: file write failed")
                return real(obj, f, *a, **k)
            m.setattr(torch, "save", save)
        assert adapt_code("--init", clover_init, "--data", data, "--out", out, *STEPS) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # past tqdm's bar
    assert len(err) == 1 and err[0].startswith("clover-lab adapt: error: ") and said in err[0], err
    assert "free some space and rerun" in err[0] and "No space left on device" in err[0] or "write failed" in err[0]
    assert not leftovers(out) if out.exists() else True
    assert adapt_code("--init", clover_init, "--data", data, "--out", out, *STEPS) == 0
    want, got = (load_file_dict(d / "model.safetensors") for d in (uninterrupted, out))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
