"""Training of small Clover models: the objective uses the inference operators, runs resume."""
import json

import pytest
import torch
from injected_faults import at_call, same_weights

from clover_lab import CloverModel
from clover_lab import train as training


def test_training_forward_is_the_engine_math(tiny_model):
    """The training forward equals committing the clean prefix and previewing each noisy block."""
    bs, L = 16, 48
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 500, (2, L), generator=g)
    noisy, _ = training.mask_blocks(clean, bs, 511, g, 0.3)
    with torch.no_grad():
        clean_logits, noisy_logits = tiny_model.training_forward(clean, noisy, bs)
    assert torch.allclose(clean_logits, tiny_model.logits(clean), atol=1e-5)
    for row in range(2):
        for b in range(L // bs):
            cache = tiny_model.new_cache(L)
            if b:
                tiny_model.commit(cache, clean[row:row + 1, :b * bs], logits=None)
            want = tiny_model.preview(cache, noisy[row:row + 1, b * bs:(b + 1) * bs])
            assert torch.allclose(noisy_logits[row:row + 1, b * bs:(b + 1) * bs], want, atol=1e-4)


def test_training_forward_trains_every_parameter(tiny_model):
    for p in tiny_model.parameters():
        p.requires_grad_(True)
    clean = torch.randint(0, 500, (1, 32))
    noisy, masked = training.mask_blocks(clean, 16, 511, torch.Generator().manual_seed(1), 0.5)
    _, logits = tiny_model.training_forward(clean, noisy, 16)
    logits[masked].logsumexp(-1).sum().backward()
    no_grad = [n for n, p in tiny_model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    # the clean stream's LM head rows are used, but only through the noisy logits here
    assert not [n for n in no_grad if "linear_attn" in n or "self_attn" in n or "experts" in n], no_grad


def test_mask_blocks_masks_every_block_at_least_once():
    clean = torch.arange(64).reshape(1, 64)
    noisy, masked = training.mask_blocks(clean, 16, 999, torch.Generator().manual_seed(0), 0.05)
    assert masked.reshape(1, 4, 16).any(-1).all()
    assert torch.equal(noisy[masked], torch.full((int(masked.sum()),), 999))
    assert torch.equal(noisy[~masked], clean[~masked])


def test_stdlib_corpus_has_no_tests_and_a_stable_split():
    train_files, held = training.split_corpus()
    assert len(train_files) > 200 and 0 < len(held) < len(train_files) / 5
    assert not any("test" in f.parts[-2:-1] or f.name.startswith("test_") for f in train_files + held)
    assert not set(train_files) & set(held)
    assert training.split_corpus()[1] == held


def test_tiny_run_learns_and_resumes(tmp_path, monkeypatch):
    files = training.stdlib_files()
    small = [f for f in files if f.name in ("bisect.py", "heapq.py", "colorsys.py", "keyword.py", "abc.py")]
    assert len(small) >= 4
    monkeypatch.setattr(training.loop, "split_corpus", lambda root=None: (small[:-1], small[-1:]))
    settings = training.TrainSettings(seq_len=64, batch_size=4, lr=3e-3, warmup_steps=5, max_steps=40)
    overrides = dict(hidden_size=64, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=64, shared_expert_intermediate_size=64, head_dim=32,
                     linear_key_head_dim=16, linear_value_head_dim=16)
    run = tmp_path / "run"
    training.train(run, minutes=10, vocab_size=400, block_size=16, settings=settings, overrides=overrides,
                   log_every=5, checkpoint_every=20)
    log = [json.loads(line) for line in (run / "loss_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 40
    assert log[-1]["mask_ce"] < log[0]["mask_ce"] - 0.5
    state = torch.load(run / "train_state.pt", weights_only=False)
    assert state["step"] == 40
    # resuming continues from the checkpoint (max_steps already reached: no further step)
    training.train(run, minutes=10, vocab_size=400, block_size=16, overrides=overrides)
    assert torch.load(run / "train_state.pt", weights_only=False)["step"] == 40
    # a finished run can be extended with a fresh schedule
    training.train(run, minutes=10, vocab_size=400, block_size=16, overrides=overrides, extend_steps=5,
                   extend_lr=1e-3)
    state = torch.load(run / "train_state.pt", weights_only=False)
    assert state["step"] == 45 and state["settings"]["schedule_start"] == 40
    assert training.lr_at(40, training.TrainSettings(**state["settings"])) < 1e-3 / 4  # warming up again
    # ... and continued on a mix with its own greedy continuations (self-distillation)
    from clover_lab.train.distill import make_corpus

    corpus = make_corpus(CloverModel.from_pretrained(run / "checkpoint"), torch.load(run / "data.pt")["train"],
                         6, seq_len=64, prompt_lens=(16, 32), min_distinct=0.0, progress=False)
    torch.save(corpus, run / "distill.pt")
    training.train(run, minutes=10, vocab_size=400, block_size=16, overrides=overrides, extend_steps=5,
                   extend_lr=1e-3, extend_overrides={"distill_data": str(run / "distill.pt"), "distill_share": 0.5})
    state = torch.load(run / "train_state.pt", weights_only=False)
    assert state["step"] == 50 and state["settings"]["distill_data"] == str(run / "distill.pt")
    model_dir = training.export(run, tmp_path / "model")
    from clover_lab.checkpoint.loading import load_tokenizer

    model, tok = CloverModel.from_pretrained(model_dir), load_tokenizer(model_dir)
    assert model.config.mask_token_id == tok.mask_token_id and tok.decode(tok("def f(x):")["input_ids"]) == "def f(x):"
    figures = training.evaluate(model, torch.load(run / "data.pt")["heldout"], windows=4, seq_len=64)
    assert 0 <= figures["mask_acc@0.5"] <= 1 and figures["ar_perplexity"] > 1


def test_a_run_starts_from_an_init_model_and_resumes_from_its_own_checkpoint(gen_text_model_dir, tmp_path,
                                                                             monkeypatch):
    files = [f for f in training.stdlib_files() if f.name in ("bisect.py", "heapq.py", "colorsys.py")]
    monkeypatch.setattr(training.loop, "split_corpus", lambda root=None: (files[:-1], files[-1:]))
    (gen_text_model_dir / "card.json").write_text('{"training_steps": 7}')
    run = tmp_path / "run"
    settings = training.TrainSettings(seq_len=64, batch_size=2, warmup_steps=2, max_steps=10)
    training.train(run, minutes=0, settings=settings, init=gen_text_model_dir)  # the run made, nothing trained
    init = CloverModel.from_pretrained(gen_text_model_dir, dtype=torch.float32).state_dict()
    start = CloverModel.from_pretrained(run / "checkpoint", dtype=torch.float32).state_dict()
    assert all(torch.equal(init[k], start[k]) for k in init)
    state = torch.load(run / "train_state.pt", weights_only=False)
    assert state["step"] == 0 and state["settings"]["init"] == str(gen_text_model_dir)
    assert json.loads((run / "init_card.json").read_text()) == {"training_steps": 7}
    from clover_lab.checkpoint.loading import load_tokenizer

    assert load_tokenizer(run / "tokenizer").get_vocab() == load_tokenizer(gen_text_model_dir).get_vocab()
    # the run continues from its own checkpoint (init is for a new run only) with a fresh schedule
    training.train(run, minutes=10, init=tmp_path / "elsewhere", extend_steps=3, extend_lr=1e-3)
    assert torch.load(run / "train_state.pt", weights_only=False)["step"] == 3
    after = CloverModel.from_pretrained(run / "checkpoint", dtype=torch.float32).state_dict()
    assert not all(torch.equal(init[k], after[k]) for k in init)


def test_init_names_what_the_directory_lacks(gen_model_dir, tmp_path, capsys):
    from clover_lab.train.loop import main

    with pytest.raises(SystemExit) as info:
        main(["--out", str(tmp_path / "run"), "--init", str(gen_model_dir)])
    assert info.value.code == 2 and "no tokenizer.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "run"), "--init", str(gen_model_dir), "--set", "hidden_size=64"])
    assert "no --set with it" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_generation_defaults_of_an_export_are_checked_up_front(tmp_path, capsys):
    from clover_lab.train.loop import _generation_defaults, main

    class Usage:
        def error(self, message):
            raise SystemExit(message)

    assert _generation_defaults(Usage(), ["repetition_penalty=1.3", "frequency_penalty=0.2"]) == {
        "repetition_penalty": 1.3, "frequency_penalty": 0.2}
    for option, match in [("repetition_penalty=0", "repetition_penalty=0"), ("warmth=2", "warmth"),
                          ("repetition_penalty", "expected SETTING=VALUE")]:
        with pytest.raises(SystemExit) as info:
            main(["--out", str(tmp_path / "run"), "--export", str(tmp_path / "m"), "--generation", option])
        assert info.value.code == 2 and match in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "run"), "--generation", "repetition_penalty=1.3"])
    assert "give --export" in capsys.readouterr().err and not (tmp_path / "run").exists()



# --------------------------------------------------------------------------- clover-lab train's loop
SMALL_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                    shared_expert_intermediate_size=64, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16)


def _train(run, monkeypatch):
    from clover_lab import train as training

    small = [f for f in training.stdlib_files() if f.name in ("bisect.py", "heapq.py", "colorsys.py", "keyword.py")]
    monkeypatch.setattr(training.loop, "split_corpus", lambda root=None: (small[:-1], small[-1:]))
    settings = training.TrainSettings(seq_len=32, batch_size=2, lr=3e-3, warmup_steps=2, max_steps=4)
    training.train(run, minutes=10, vocab_size=300, block_size=16, settings=settings, overrides=SMALL_CONFIG,
                   log_every=1, checkpoint_every=2)


@pytest.mark.parametrize("action, saved", [("SIGINT", 3), ("raise", 2)])
def test_a_training_run_stopped_inside_a_step_resumes_as_if_never_stopped(tmp_path, monkeypatch, action, saved):
    """The same for ``clover-lab train`` (train/loop.py), whose checkpoint is the weights and
    the state put in place together."""
    _train(tmp_path / "whole", monkeypatch)
    run = tmp_path / "stopped"
    with monkeypatch.context() as m:
        m.setattr(torch.optim.AdamW, "step", at_call(3, action)(torch.optim.AdamW.step))
        if action == "raise":
            with pytest.raises(KeyboardInterrupt):
                _train(run, m)
        else:
            _train(run, m)
    assert torch.load(run / "train_state.pt", weights_only=False)["step"] == saved
    _train(run, monkeypatch)
    logs = [[{k: v for k, v in json.loads(line).items() if k != "time"}
             for line in (d / "loss_log.jsonl").read_text().splitlines()] for d in (tmp_path / "whole", run)]
    assert logs[0] == logs[1] and [r["step"] for r in logs[0]] == [1, 2, 3, 4]
    assert same_weights(*(CloverModel.from_pretrained(d / "checkpoint") for d in (tmp_path / "whole", run)))


@pytest.mark.parametrize("damage, said", [
    (lambda run: (run / "train_state.pt").write_bytes((run / "train_state.pt").read_bytes()[:100]),
     r"train_state.pt: the run.s state \(the step it resumes from\) cannot be read"),
    (lambda run: (run / "data.pt").write_bytes(b"PK\x03\x04 cut"), "data.pt: the run's encoded corpus cannot be read"),
    (lambda run: (run / "checkpoint" / "model.safetensors").unlink(), "checkpoint: no model.safetensors")])
def test_a_train_resume_from_a_damaged_file_names_it(gen_text_model_dir, tmp_path, monkeypatch, damage, said):
    """The same for clover-lab train's run directory: the file named, and what to do."""
    from clover_lab.errors import CheckpointError

    files = [f for f in training.stdlib_files() if f.name in ("bisect.py", "heapq.py", "colorsys.py")]
    monkeypatch.setattr(training.loop, "split_corpus", lambda root=None: (files[:-1], files[-1:]))
    run = tmp_path / "run"
    settings = training.TrainSettings(seq_len=64, batch_size=2, warmup_steps=2, max_steps=10)
    training.train(run, minutes=0, settings=settings, init=gen_text_model_dir)
    damage(run)
    with pytest.raises(CheckpointError, match=said) as e:
        training.train(run, minutes=0, settings=settings)
    assert "delete" in str(e.value) and "rerun" in str(e.value) or "start the run again from step 0" in str(e.value)
