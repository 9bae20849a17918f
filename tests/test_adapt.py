"""``clover-lab adapt``: an AR checkpoint gets a mask token and a trained preview; runs resume;
two gloo processes under torchrun (FSDP2) give the loss and weights of one process."""
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import clover_lab
from clover_lab import CloverConfig, CloverModel
from clover_lab.checkpoint import names
from clover_lab.cli.main import main as cli_main
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
