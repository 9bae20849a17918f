"""The specimen's targets (clover_lab.train.measure): repeated lines, distinctness, tokens per forward."""
import pytest
import torch

from clover_lab.train import measure


def test_line_repeats_counts_stripped_non_blank_lines():
    assert measure.line_repeats("") == 0
    assert measure.line_repeats("a = 1\n\n\n\nb = 2\n") == 1
    assert measure.line_repeats("x = None\n    x = None\n  x = None  \ny\n") == 3


def test_distinctness_of_identical_and_different_completions():
    same = measure.distinctness(["def f():\n    pass", "def f():\n    pass"])
    assert same == {"distinct_first_lines": 0.5, "mean_distance": 0.0}
    apart = measure.distinctness(["abc\nx", "xyz\ny", "\n\nqrs"])
    assert apart["distinct_first_lines"] == 1.0 and apart["mean_distance"] == pytest.approx(1.0, abs=0.35)


def test_measure_set_sums_tokens_over_forwards_and_counts_loops(tiny_text_engine):
    prompts = ["w1 w2 w3", "w7 w8", [3, 4, 5, 6]]
    figures = measure.measure_set(tiny_text_engine, prompts, new_tokens=12, threshold=0.5)
    runs = [tiny_text_engine.generate(p, max_new_tokens=12, threshold=0.5) for p in prompts]
    assert figures["tokens_per_forward"] == pytest.approx(
        sum(len(r.token_ids) for r in runs) / sum(r.stats["forwards"] for r in runs))
    assert [s["completion"] for s in figures["samples"]] == [r.text for r in runs]
    assert figures["max_line_repeats"] == max(measure.line_repeats(r.text) for r in runs)
    assert figures["looping"] == sum(measure.line_repeats(r.text) > measure.LOOP_REPEATS for r in runs)
    assert figures["samples"][2]["prompt"] == tiny_text_engine.tokenizer.decode([3, 4, 5, 6])


def test_sweep_items_are_every_combination():
    assert measure._sweep([]) == [{}]
    assert measure._sweep(["repetition_penalty=1.0,1.2", "presence_penalty=0"]) == [
        {"repetition_penalty": 1.0, "presence_penalty": 0}, {"repetition_penalty": 1.2, "presence_penalty": 0}]
    with pytest.raises(SystemExit, match="NAME=V1,V2"):
        measure._sweep(["repetition_penalty"])


def test_card_remeasures_generation_figures_and_keeps_the_models(gen_text_model_dir, tmp_path, monkeypatch):
    import json
    import shutil
    from pathlib import Path

    import torch

    from clover_lab.train import card

    model = tmp_path / "model"
    shutil.copytree(gen_text_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.3}))
    shipped = json.loads((Path(card.__file__).parents[2] / "assets/clover-stdlib/card.json").read_text())
    (model / "card.json").write_text(json.dumps(shipped))
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"heldout": torch.randint(0, 500, (400,), dtype=torch.int32)}, run / "data.pt")
    monkeypatch.setattr(measure, "WRITTEN_PROMPTS", ["w1 w2", "w5"])
    monkeypatch.setattr(measure, "HELDOUT_WINDOWS", 3)
    monkeypatch.setattr(card, "SWEEP_THRESHOLDS", (0.5,))
    monkeypatch.setattr(card, "SAMPLE_PROMPTS", ["w3"])
    figures = card.remeasure_generation(run, model, "bash make.sh")
    written = json.loads((model / "card.json").read_text())
    assert written["heldout"] == shipped["heldout"] and written["expert_usage"] == shipped["expert_usage"]
    assert written["targets"]["settings"]["repetition_penalty"] == 1.3
    assert written["targets"]["written"]["prompts"] == 2 and written["speed_cpu"] == figures["speed_cpu"]
    # perplexity does not depend on the generation defaults: the card's figure is kept, and shown
    assert written["targets"]["ar_perplexity"] == shipped["targets"]["ar_perplexity"]
    readme = (model / "README.md").read_text()
    assert f"perplexity there (16 held-out windows of 256 tokens): {shipped['targets']['ar_perplexity']:.1f}" in readme
    t = written["targets"]["heldout"]
    assert "repetition_penalty=1.3" in readme and "bash make.sh" in readme
    assert (f"| heldout (3 prompts) | {t['tokens_per_forward']:.2f} | "
            f"{t['max_line_repeats']} | {t['looping']} |"
            in readme)


def test_heldout_tokens_from_a_run_or_from_the_models_tokenizer(gen_text_model_dir, tmp_path, monkeypatch):
    import torch

    from clover_lab.checkpoint.loading import load_tokenizer
    from clover_lab.errors import CheckpointError
    from clover_lab.train import stdlib_corpus as corpus

    run = tmp_path / "run"
    run.mkdir()
    held = torch.arange(7, dtype=torch.int32)
    torch.save({"heldout": held}, run / "data.pt")
    assert torch.equal(measure.heldout_tokens(gen_text_model_dir, run), held)
    module = tmp_path / "held.py"
    module.write_text("w1 w2 w3\n")
    monkeypatch.setattr(corpus, "split_corpus", lambda: ([], [module]))
    expected = corpus.encode_files(load_tokenizer(gen_text_model_dir), [module])
    assert len(expected) > 1 and torch.equal(measure.heldout_tokens(gen_text_model_dir), expected)
    with pytest.raises(CheckpointError, match="no tokenizer files"):
        measure.heldout_tokens(tmp_path)
    with pytest.raises(CheckpointError, match="not a training run"):
        measure.heldout_tokens(gen_text_model_dir, tmp_path / "nowhere")


def _measured(tpf: float, looping: int, settings: dict, perplexity=None) -> dict:
    s = {"tokens_per_forward": tpf, "looping": looping, "max_line_repeats": 2 + looping, "distinct_first_lines": 0.75,
         "mean_distance": 0.8, "prompts": 12, "samples": [{"prompt": "p", "completion": "c"}]}
    out = {"settings": {"threshold": 0.9, "repetition_penalty": 1.0, "frequency_penalty": 0.0, **settings},
           "written": s, "heldout": {**s, "tokens_per_forward": tpf - 0.5}}
    return out if perplexity is None else {**out, "ar_perplexity": perplexity}


def test_round_rows_read_each_rounds_measure_and_sweep(tmp_path):
    import json

    from clover_lab.train import rounds

    for n, tpf in ((1, 1.43), (2, 2.57)):
        (tmp_path / f"round-{n}").mkdir()
        (tmp_path / f"round-{n}" / "measure.json").write_text(json.dumps(_measured(tpf, n - 1, {}, 60.0 + n)))
    (tmp_path / "round-2" / "sweep.json").write_text(json.dumps(
        [_measured(2.42, 0, {"repetition_penalty": 1.3}, 61.0),
         _measured(2.25, 0, {"repetition_penalty": 1.3, "frequency_penalty": 0.5})]))
    (tmp_path / "round-4").mkdir()  # a gap ends the rounds: round 3 was never measured
    (tmp_path / "round-4" / "measure.json").write_text(json.dumps(_measured(9.0, 0, {})))
    rows = rounds.round_rows(tmp_path)
    assert [(r["round"], r["settings"]) for r in rows] == [
        (1, "no penalties"), (2, "no penalties"), (2, "repetition_penalty 1.3"),
        (2, "repetition_penalty 1.3, frequency_penalty 0.5")]
    assert rows[1]["written"]["tokens_per_forward"] == 2.57 and rows[1]["heldout"]["looping"] == 1
    assert "samples" not in rows[0]["written"] and rows[3]["ar_perplexity"] is None
    table = rounds.render_rounds(rows)
    assert "| 2 | no penalties | 2.57 | 1/12 | 3 | 0.75 | 2.07 | 1/12 | 3 | 0.75 | 62.0 |" in table
    assert "| 2 | repetition_penalty 1.3, frequency_penalty 0.5 | 2.25 | 0/12 | 2 | 0.75 | 1.75 | 0/12 | 2 | 0.75 |  |" in table
    assert rounds.render_rounds([]) == ""


def test_card_of_a_run_started_from_a_model_says_v2_and_sets_v1_beside_it():
    import json
    from pathlib import Path

    from clover_lab.config import CloverConfig
    from clover_lab.train import card

    v1 = json.loads((Path(card.__file__).parents[2] / "assets/clover-stdlib/card.json").read_text())
    for key in ("init", "rounds", "baseline", "stages", "functions_share", "split_newlines", "distill_parts"):
        v1.pop(key, None)
    v1["targets"] = _measured(1.61, 0, {"repetition_penalty": 1.3, "frequency_penalty": 0.5})
    v2 = {**v1, "init": "assets/clover-stdlib", "training_steps": 1250, "baseline": v1,
          "distillation": {"from_step": 750, "share": 0.75, "confidence_weight": 1.0},
          "targets": _measured(2.54, 0, {"repetition_penalty": 1.3}, 60.1),
          "rounds": [{"round": n, "settings": "no penalties", "written": v1["targets"]["written"],
                      "heldout": v1["targets"]["heldout"], "ar_perplexity": None} for n in (1, 2, 3)]}
    config = CloverConfig(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
    readme = card.render(v2, config, "bash make.sh")
    assert readme.startswith("# clover-stdlib: the embedded default model of clover_lab (specimen v2)")
    steps = v1["training_steps"]
    assert f"{steps} + 1250 = {steps + 1250} training steps (v1 + v2)" in readme
    assert "adds 1250 steps in 3 rounds of self-distillation" in readme and "75% of every batch" in readme
    assert "| figure | v1 | v2 |" in readme
    assert "| heldout prompts, tokens per forward (its own defaults) | 1.11 | 2.04 |" in readme
    assert "Next-token perplexity there (16 held-out windows of 256 tokens): 60.1." in readme
    assert "measured by `python -m clover_lab.train.measure --model assets/clover-stdlib`)" in readme
    assert readme.count("| 3 | no penalties |") == 1
    v1_readme = card.render(v1, config, "bash make.sh")  # a card of a run from scratch reads as before
    assert "(specimen v2)" not in v1_readme and f"- {steps} training steps over" in v1_readme
    assert "## The rounds" not in v1_readme
    # v3 continues v2 (whose card kept no stages) on function heads, then on its own bodies for them
    v2_targets = {**v2["targets"], "prompt_gain": {"own": 3.45, "other": 3.50, "gain": 0.05, "functions": 64}}
    v2_targets["written"] = {**v2_targets["written"], "argument_use": 0.4, "argument_prompts": 10}
    v2 = {**v2, "targets": v2_targets}
    v3_targets = {**v2_targets, "prompt_gain": {"own": 3.0, "other": 3.2, "gain": 0.2, "functions": 64}}
    v3_targets["written"] = {**v2_targets["written"], "argument_use": 0.7}
    v3 = {**v2, "training_steps": 1800, "functions_share": 0.2, "rounds": [], "targets": v3_targets,
          "distillation": {"from_step": 1200, "share": 0.6, "confidence_weight": 1.0},
          "baseline": {k: v2[k] for k in ("training_steps", "heldout", "speed_cpu", "speed_cpu_thresholds", "targets")}}
    v3["stages"] = card.stages(v2, v3)
    assert [(s["version"], s["kind"], s["steps"]) for s in v3["stages"]] == [
        (1, "scratch", steps), (2, "distillation", 1250), (3, "functions", 1800)]
    readme = card.render(v3, config, "bash make.sh")
    assert readme.startswith("# clover-stdlib: the embedded default model of clover_lab (specimen v3)")
    assert f"{steps} + 1250 + 1800 = {steps + 3050} training steps (v1 + v2 + v3)" in readme
    assert "Specimen v2: it starts from v1" in readme and "in 3 rounds of self-distillation" in readme
    assert "Specimen v3: it starts from v2" in readme and "adds 1800 steps (`assets/make_specimen_v3.sh`)" in readme
    assert "20% of every batch were rows that start at a function's head" in " ".join(readme.split())
    assert "60% were its own greedy bodies" in readme
    assert "| figure | v2 | v3 |" in readme
    assert "| written prompts, completions that use an argument (its own defaults) | 0.40 | 0.70 |" in readme
    assert "| prompt gain, nats per body token | 0.050 | 0.200 |" in readme
    assert "| written (12 prompts) | 2.54 | 2 | 0 | 0.75 | 0.80 | 0.70 of 10 |" in readme
    assert "| heldout (12 prompts) | 2.04 | 2 | 0 | 0.75 | 0.80 | - |" in readme
    assert "worth 0.200 nats a token" in readme
    assert "newline+indent tokens" not in readme and "get no text" not in readme  # neither was measured nor trained
    # its last stage also wrote newline+indent tokens apart, and the measure gave heads a trailing newline
    v3["split_newlines"] = 0.1
    v3["targets"] = {**v3_targets, "functions": {**v3_targets["written"], "prompts": 12, "empty_after_newline": 0.25}}
    v3["stages"] = card.stages(v2, v3)
    assert v3["stages"][-1]["split_newlines"] == 0.1
    readme = " ".join(card.render(v3, config, "bash make.sh").split())
    assert "10% of the newline+indent tokens were written as the newline and the indent apart" in readme
    assert "with a newline after them (as typed with Enter at the end): 25% get no text" in readme
    # v4 continues v3's training run: its stage is the steps since v3's export, on its own bodies and
    # its own continuations of training windows, merged
    v4 = {**v3, "training_steps": 3000, "functions_share": 0.15, "split_newlines": 0.03,
          "distillation": {"from_step": 2400, "share": 0.75, "confidence_weight": 2.0},
          "distill_parts": [{"prefixes": "function heads, bodies that use their arguments", "rows": 1536},
                            {"prefixes": "windows", "rows": 1536}],
          "baseline": {**v3["baseline"], "card": "runs/specimen3/v3/card.json"}}
    v4["stages"] = card.stages(v3, v4, continues=True)
    assert [(s["version"], s["steps"], s.get("continues", False)) for s in v4["stages"]] == [
        (1, steps, False), (2, 1250, False), (3, 1800, False), (4, 1200, True)]
    readme = " ".join(card.render(v4, config, "bash assets/make_specimen_v4.sh").split())
    assert f"{steps} + 1250 + 1800 + 1200 = {steps + 4250} training steps (v1 + v2 + v3 + v4)" in readme
    assert ("Specimen v4: it continues v3's training run (the same optimizer state, tokenizer and held-out split) "
            "for 1200 more steps (`assets/make_specimen_v4.sh`)") in readme
    assert "75% were its own greedy continuations of 1,536 training windows" in readme
    assert "and its 1,536 greedy bodies for such heads" in readme and "confidence term at weight 2.0" in readme
    assert "--baseline RUN/v3/card.json --continues`)" in readme and "(`runs/specimen3`, v4's)" in readme
    assert "Specimen v3: it starts from v2" in readme and "| figure | v3 | v4 |" in readme
    # a set measured on other prompts than the baseline's is not set beside it, unless measured again
    v4["targets"] = {**v4["targets"], "heldout": {**v4["targets"]["heldout"], "prompts": 48}}
    readme = " ".join(card.render(v4, config, "bash assets/make_specimen_v4.sh").split())
    assert "| heldout prompts, tokens per forward" not in readme and "| written prompts, tokens per forward" in readme
    v4["baseline"]["targets"] = {**v4["baseline"]["targets"], "heldout": {
        **v4["baseline"]["targets"]["heldout"], "prompts": 48, "remeasured": "its 48 windows, measured later"}}
    readme = " ".join(card.render(v4, config, "bash assets/make_specimen_v4.sh").split())
    assert "| heldout prompts, tokens per forward" in readme and "Its heldout prompts: its 48 windows" in readme


def test_distill_parts_reads_what_the_runs_corpus_continued(tmp_path):
    from clover_lab.train import card
    from clover_lab.train.distill import merge_corpora

    def corpus(rows, prefixes):
        return {"sequences": torch.zeros(rows, 8, dtype=torch.long), "prompt_lens": torch.zeros(rows),
                "dropped": 0, "settings": {"seq_len": 8, "prefixes": prefixes}}

    bodies, windows = corpus(3, "function heads, bodies that use their arguments"), corpus(2, "windows")
    torch.save(bodies, tmp_path / "heads.pt")
    torch.save(merge_corpora([bodies, windows]), tmp_path / "mix.pt")
    assert card.distill_parts(str(tmp_path / "heads.pt")) == [
        {"prefixes": "function heads, bodies that use their arguments", "rows": 3}]
    assert [p["rows"] for p in card.distill_parts(str(tmp_path / "mix.pt"))] == [3, 2]
    assert card.distill_parts(str(tmp_path / "gone.pt")) is None and card.distill_parts(None) is None


def test_empty_after_newline_gives_each_head_a_newline_and_counts_the_blank_completions():
    from types import SimpleNamespace

    from clover_lab.checkpoint.loading import default_model_dir, load_tokenizer

    tok = load_tokenizer(default_model_dir())  # the specimen's byte-level BPE: "\n" is a token of its own
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    heads = [tok("def f(x):")["input_ids"], tok("def g(y):")["input_ids"], tok("def h(z):")["input_ids"]]
    seen = []

    def generate(prompts, **settings):
        seen.append((prompts, settings))
        return [SimpleNamespace(text=t) for t in ("", "\n  \n", "    return x")]

    engine = SimpleNamespace(tokenizer=tok, generate=generate)
    assert measure.empty_after_newline(engine, heads, threshold=0.8) == pytest.approx(2 / 3)
    prompts, settings = seen[0]
    assert prompts == [h + newline for h in heads] and settings["threshold"] == 0.8


def test_empty_after_newline_is_none_without_a_newline_token(tiny_text_engine):
    assert measure.empty_after_newline(tiny_text_engine, [[3, 4]]) is None


def test_card_continues_needs_the_earlier_card(tmp_path, capsys):
    from clover_lab.train import card

    with pytest.raises(SystemExit) as e:
        card.main(["--run", str(tmp_path), "--model", str(tmp_path), "--continues"])
    assert e.value.code == 2 and "--continues: give --baseline" in capsys.readouterr().err
