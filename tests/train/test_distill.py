"""Self-distillation corpus: the model's own greedy continuations, and training that mixes them in."""
import copy
import re

import pytest
import torch

from clover_lab import Engine
from clover_lab import train as training
from clover_lab.train.distill import distinct_ngrams, greedy_continuations, make_corpus


def test_greedy_continuations_are_the_engines_ar_greedy(tiny_model):
    prompts = torch.randint(3, 500, (2, 20), generator=torch.Generator().manual_seed(0))
    batch = greedy_continuations(tiny_model, prompts, 12, repetition_penalty=1.0)
    engine = Engine(tiny_model)
    for row, prompt in zip(batch, prompts):
        # eos/mask/pad are never chosen by the corpus writer; the tiny model's eos is None here
        r = engine.generate(prompt.tolist(), mode="ar", max_new_tokens=12)
        assert r.token_ids == row.tolist()


def test_repetition_penalty_matches_a_full_recompute(tiny_model):
    """Cached batched decoding with the penalty equals recomputing each step from the whole sequence."""
    # a head that can only pick tokens 7-10, so that 16 greedy tokens must repeat
    looping = copy.deepcopy(tiny_model)
    w = torch.randn(looping.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        looping.lm_head.weight.zero_()
        looping.lm_head.weight[7:11] = torch.stack([10 * w, 9 * w, -10 * w, -9 * w])
    prompts = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    penalty, window = 5.0, 6
    out = greedy_continuations(looping, prompts, 16, repetition_penalty=penalty, window=window)
    for prompt, row in zip(prompts, out):
        seq = prompt.tolist()
        for i in range(16):
            logits = looping.logits(torch.tensor([seq]))[0, -1].float()
            for t in set(seq[len(prompt):][-window:]):
                logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
            seq.append(int(logits.argmax()))
        assert seq[len(prompt):] == row.tolist()
    assert not torch.equal(out, greedy_continuations(looping, prompts, 16, repetition_penalty=1.0))
    with pytest.raises(ValueError, match="repetition_penalty"):
        greedy_continuations(tiny_model, prompts, 4, repetition_penalty=0)
    with pytest.raises(ValueError, match="prompts"):
        greedy_continuations(tiny_model, prompts[:, :0], 4)


def test_distinct_ngrams():
    assert distinct_ngrams(torch.arange(10)) == 1.0
    assert distinct_ngrams(torch.tensor([1, 2] * 10)) == pytest.approx(2 / 17)


def test_corpus_rows_are_real_prefix_then_continuation(tiny_model):
    tokens = torch.randint(3, 500, (2000,), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    corpus = make_corpus(tiny_model, tokens, 5, seq_len=64, prompt_lens=(16, 32), batch_size=3,
                         min_distinct=0.0, progress=False)
    seqs, plens = corpus["sequences"], corpus["prompt_lens"]
    assert seqs.shape == (5, 64) and seqs.dtype == torch.int32 and set(plens.tolist()) <= {16, 32}
    for row, P in zip(seqs, plens.tolist()):
        prefix = row[:P]
        hits = [s for s in range(len(tokens) - P + 1) if torch.equal(tokens[s:s + P], prefix)]
        assert hits, "the prefix is a window of the corpus"
        assert row[P:].tolist() == greedy_continuations(tiny_model, prefix[None].long(), 64 - P)[0].tolist()
    with pytest.raises(ValueError, match="multiples of the block size"):
        make_corpus(tiny_model, tokens, 2, seq_len=64, prompt_lens=(10,), progress=False)
    with pytest.raises(RuntimeError, match="loop"):  # nothing can pass a distinct-4-gram share above 1
        make_corpus(tiny_model, tokens, 2, seq_len=64, prompt_lens=(16,), min_distinct=1.01, progress=False)


def test_a_corpus_of_function_heads_keeps_the_bodies_that_use_their_arguments(tiny_model, monkeypatch):
    """With functions, each prefix ends where a head ends; with a tokenizer to read the heads, a body
    that names none of its head's arguments is dropped, as a loop is."""
    from clover_lab.train import distill

    g = torch.Generator().manual_seed(5)
    functions = [(torch.randint(3, 500, (int(n),), generator=g, dtype=torch.int32), int(h))
                 for n, h in ((30, 5), (20, 9), (12, 3))]
    heads = {tuple(ids[:h].tolist()) for ids, h in functions}

    class Words:  # decodes ids as words; here a body "uses its head's arguments" when its first id is odd
        def decode(self, ids):
            return " ".join(map(str, ids))

    judged = []

    def odd(head, body):
        judged.append(head)
        return int(body.split()[0]) % 2 == 1

    monkeypatch.setattr(distill, "uses_arguments", odd)
    tiny_model.config.eos_token_id = 2  # ends the functions before a head (clover-tiny has no EOS of its own)
    kw = dict(seq_len=48, prompt_lens=(16,), batch_size=6, min_distinct=0.0, progress=False, functions=functions)
    corpus = make_corpus(tiny_model, torch.zeros(0, dtype=torch.int32), 6, tokenizer=Words(), **kw)
    for row in corpus["sequences"].tolist():
        assert any(tuple(row[16 - len(h):16]) == h for h in heads)  # the prefix ends at a whole head
        assert row[16] % 2 == 1
    assert {tuple(map(int, h.split())) for h in judged} <= heads  # the filter read each prompt's head
    assert corpus["dropped"] > 0
    assert corpus["settings"]["prefixes"] == "function heads, bodies that use their arguments"
    assert make_corpus(tiny_model, torch.zeros(0, dtype=torch.int32), 2, **kw)["settings"]["prefixes"] == \
        "function heads"


def test_corpus_batches_are_whole(tiny_model, monkeypatch):
    """Every generation batch has batch_size rows, the last one too (its surplus dropped): a cache-path
    step costs about as much for a few rows as for a whole batch."""
    from clover_lab.train import distill

    shapes = []

    def recorded(model, prompts, new_tokens, repetition_penalty):
        shapes.append(tuple(prompts.shape))
        return greedy_continuations(model, prompts, new_tokens, repetition_penalty)

    monkeypatch.setattr(distill, "greedy_continuations", recorded)
    tokens = torch.randint(3, 500, (2000,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    corpus = make_corpus(tiny_model, tokens, 5, seq_len=48, prompt_lens=(16,), batch_size=4, min_distinct=0.0,
                         progress=False)
    assert len(corpus["sequences"]) == len(corpus["prompt_lens"]) == 5
    assert shapes == [(4, 16), (4, 16)]


def test_a_stopped_corpus_resumes_from_its_partial_file(tiny_model, tmp_path):
    """A distillation stopped after a batch resumes from the partial file to the rows an uninterrupted
    one makes; another model's or other settings' partial file is refused, naming what differs."""
    from clover_lab.errors import CheckpointError
    from clover_lab.train.distill import partial_path

    tokens = torch.randint(3, 500, (2000,), generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    kw = dict(seq_len=48, prompt_lens=(16, 32), batch_size=2, min_distinct=0.0, progress=False)
    whole = make_corpus(tiny_model, tokens, 5, **kw)
    partial = partial_path(tmp_path / "distill1.pt")
    assert partial == tmp_path / "distill1.partial.pt"
    make_corpus(tiny_model, tokens, 2, partial=partial, **kw)  # "stopped" after its first batch
    assert len(torch.load(partial)["sequences"]) == 2
    resumed = make_corpus(tiny_model, tokens, 5, partial=partial, **kw)
    assert torch.equal(resumed["sequences"], whole["sequences"])
    assert torch.equal(resumed["prompt_lens"], whole["prompt_lens"]) and resumed["settings"] == whole["settings"]
    with pytest.raises(CheckpointError, match="repetition_penalty"):
        make_corpus(tiny_model, tokens, 8, partial=partial, **{**kw, "repetition_penalty": 1.5})
    other = copy.deepcopy(tiny_model)
    with torch.no_grad():
        other.lm_head.weight.mul_(2)
    with pytest.raises(CheckpointError, match="model"):
        make_corpus(other, tokens, 8, partial=partial, **kw)


def test_the_command_runs_a_small_model_on_one_thread_and_resumes(tiny_model, tmp_path):
    """python -m clover_lab.train.distill: one thread for a small CPU model (unless --threads), and
    its partial file removed once the corpus is written."""
    from clover_lab.train import distill

    tiny_model.save_pretrained(tmp_path / "model")
    tokens = torch.randint(3, 500, (3000,), generator=torch.Generator().manual_seed(6), dtype=torch.int32)
    torch.save({"train": tokens}, tmp_path / "data.pt")
    before = torch.get_num_threads()
    args = ["--model", str(tmp_path / "model"), "--tokens", str(tmp_path / "data.pt"), "--sequences", "2",
            "--seq-len", "144", "--batch-size", "2"]
    try:
        torch.set_num_threads(2)
        distill.main([*args, "--out", str(tmp_path / "d.pt")])
        assert torch.get_num_threads() == 1
        assert len(torch.load(tmp_path / "d.pt")["sequences"]) == 2 and not (tmp_path / "d.partial.pt").exists()
        distill.main([*args, "--out", str(tmp_path / "e.pt"), "--threads", "2"])
        assert torch.get_num_threads() == 2
        with pytest.raises(SystemExit):
            distill.main([*args, "--out", str(tmp_path / "f.pt"), "--threads", "0"])
    finally:
        torch.set_num_threads(before)


def test_training_batch_mixes_the_corpus():
    tokens = torch.arange(1000, dtype=torch.int32)
    distilled = torch.full((7, 64), -1, dtype=torch.int32)
    s = training.TrainSettings(seq_len=32, batch_size=8, distill_share=0.25)
    batch = training.training_batch(tokens, distilled, s, torch.Generator().manual_seed(0))
    assert batch.shape == (8, 32) and batch.dtype == torch.long
    assert (batch == -1).all(1).sum() == 2 and (batch >= 0).all(1).sum() == 6
    # without a corpus: the same draws as before self-distillation existed
    plain = training.training_batch(tokens, None, s, torch.Generator().manual_seed(0))
    starts = torch.randint(0, 1000 - 32, (8,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(plain[:, 0], starts.long())


def test_corpora_merge_in_order_and_refuse_rows_of_other_lengths(tiny_model, tmp_path, capsys):
    """--merge: the rows of both corpora in the order given, each part's settings kept; rows of
    another length, a missing part and --out naming a part are refused, and nothing is written."""
    from clover_lab.train import distill

    tokens = torch.randint(3, 500, (2000,), generator=torch.Generator().manual_seed(7), dtype=torch.int32)
    kw = dict(prompt_lens=(16,), batch_size=2, min_distinct=0.0, progress=False)
    a, b = make_corpus(tiny_model, tokens, 2, seq_len=48, **kw), make_corpus(tiny_model, tokens, 3, seq_len=48,
                                                                             seed=1, **kw)
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    distill.main(["--merge", str(tmp_path / "b.pt"), str(tmp_path / "a.pt"), "--out", str(tmp_path / "ab.pt")])
    merged = torch.load(tmp_path / "ab.pt")
    assert torch.equal(merged["sequences"], torch.cat([b["sequences"], a["sequences"]]))
    assert merged["prompt_lens"].tolist() == b["prompt_lens"].tolist() + a["prompt_lens"].tolist()
    assert [(p["rows"], p["seed"], p["file"]) for p in merged["settings"]["parts"]] == [
        (3, 1, str(tmp_path / "b.pt")), (2, 0, str(tmp_path / "a.pt"))]
    assert merged["dropped"] == a["dropped"] + b["dropped"] and "5 sequences of 48 tokens" in capsys.readouterr().out
    torch.save(make_corpus(tiny_model, tokens, 2, seq_len=64, **kw), tmp_path / "long.pt")
    for argv, match in ((["--merge", "a.pt", "long.pt", "--out", "x.pt"], "long.pt: rows of 64 tokens"),
                        (["--merge", "a.pt", "none.pt", "--out", "x.pt"], "no such corpus: .*none.pt"),
                        (["--merge", "a.pt", "b.pt", "--out", "a.pt"], "--out"),
                        (["--merge", "a.pt", "b.pt"], "needs --out")):
        with pytest.raises(SystemExit):
            distill.main([x if x.startswith("--") else str(tmp_path / x) for x in argv])
        assert re.search(match, capsys.readouterr().err), argv
    assert not (tmp_path / "x.pt").exists() and torch.equal(torch.load(tmp_path / "a.pt")["sequences"], a["sequences"])
