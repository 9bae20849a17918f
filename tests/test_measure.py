"""The specimen's targets (clover_lab.train.measure): repeated lines, distinctness, tokens per forward."""
import pytest

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
    monkeypatch.setattr(card, "SWEEP_THRESHOLDS", (0.5,))
    monkeypatch.setattr(card, "SAMPLE_PROMPTS", ["w3"])
    figures = card.remeasure_generation(run, model, "bash make.sh")
    written = json.loads((model / "card.json").read_text())
    assert written["heldout"] == shipped["heldout"] and written["expert_usage"] == shipped["expert_usage"]
    assert written["targets"]["settings"]["repetition_penalty"] == 1.3
    assert written["targets"]["written"]["prompts"] == 2 and written["speed_cpu"] == figures["speed_cpu"]
    readme = (model / "README.md").read_text()
    t = written["targets"]["heldout"]
    assert "repetition_penalty=1.3" in readme and "bash make.sh" in readme
    assert (f"| heldout (12 prompts) | {t['tokens_per_forward']:.2f} | {t['max_line_repeats']} | {t['looping']} |"
            in readme)
