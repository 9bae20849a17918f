"""assets/make_specimen_v2.sh: the commands each round runs, with its settings (a stand-in PY records them)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "assets" / "make_specimen_v2.sh"

# records each call's arguments; `-c` (the script's "is this round's stage begun?" check) answers no
FAKE_PY = """#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$CALLS"
[ "$1" != "-c" ]
"""


def rounds(tmp_path, **env) -> list[str]:
    run, calls, py = tmp_path / "run", tmp_path / "calls.txt", tmp_path / "py"
    run.mkdir()
    (run / "train_state.pt").touch()
    (run / "distill1.pt").touch()  # round 1's corpus exists: the stage is trained next
    py.write_text(FAKE_PY)
    py.chmod(0o755)
    full = {**os.environ, "RUN": str(run), "ROUNDS": "1", "PY": str(py), "CALLS": str(calls), **env}
    subprocess.run(["bash", str(SCRIPT)], env=full, check=True, capture_output=True, text=True)
    return calls.read_text().splitlines()


@pytest.mark.slow  # bash runs the script
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_rounds_settings_reach_its_commands(tmp_path):
    train, export, measure = [c for c in rounds(tmp_path, LR="1e-3", CONFIDENCE="1.0", SHARE="0.5") if c[:2] != "-c"]
    assert "--extend-steps 300 --lr 1e-3" in train and "--confidence-weight 1.0" in train
    assert "--distill-share 0.5" in train and train.endswith(str(tmp_path / "run" / "distill1.pt") + " --distill-share 0.5")
    assert export.endswith("--generation repetition_penalty=1.3 --generation frequency_penalty=0.5")  # the defaults
    assert measure.endswith("--out " + str(tmp_path / "run" / "round-1" / "measure.json"))


@pytest.mark.slow  # bash runs the script
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_no_generation_defaults_and_a_sweep(tmp_path):
    calls = [c for c in rounds(tmp_path, GENERATION="", SWEEP="repetition_penalty=1.0,1.2 frequency_penalty=0,0.5")
             if c[:2] != "-c"]
    export, sweep, measure = calls[1:]
    assert "--generation" not in export and export.endswith("--export " + str(tmp_path / "run" / "round-1"))
    assert "--sweep repetition_penalty=1.0,1.2 --sweep frequency_penalty=0,0.5" in sweep
    assert sweep.endswith("round-1/sweep.json") and measure.endswith("round-1/measure.json")


@pytest.mark.slow  # bash runs the script
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_steps_per_round_and_the_export_of_the_last_round(tmp_path):
    calls = [c for c in rounds(tmp_path, ROUNDS="3", STEPS="250 500", GENERATION="repetition_penalty=1.3",
                               EXPORT=str(tmp_path / "model")) if c[:2] != "-c"]
    trains = [c for c in calls if "--extend-steps" in c]
    assert [c.split("--extend-steps ")[1].split()[0] for c in trains] == ["250", "500", "500"]  # the last repeats
    assert [c.split("--seed ")[1].split()[0] for c in calls if "train.distill" in c] == ["2", "3"]  # round 1's exists
    export, card = calls[-2:]
    assert export.endswith(f"--export {tmp_path / 'model'} --generation repetition_penalty=1.3")
    assert "--extend-steps" not in export and "--distill" not in export  # the run's last step, nothing trained
    assert card == (f"-m clover_lab.train.card --run {tmp_path / 'run'} --model {tmp_path / 'model'} "
                    f"--baseline {tmp_path / 'run' / 'init_card.json'} --threads 2")


@pytest.mark.slow  # bash runs the script
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_without_export_the_rounds_are_all(tmp_path):
    assert not [c for c in rounds(tmp_path) if "train.card" in c or "clover-stdlib" in c]


def test_the_default_model_script_continues_with_specimen_v2():
    text = (SCRIPT.parent / "make_default_model.sh").read_text()
    v2 = text[text.index("bash assets/make_specimen_v2.sh") - 400:]
    for setting in ('ROUNDS=3', 'SEQUENCES=2048', 'STEPS="250 500 500"', 'LR=6e-4', 'CONFIDENCE=1.0', 'SHARE=0.75',
                    'GENERATION="repetition_penalty=1.3"', 'EXPORT=assets/clover-stdlib', 'THREADS=1'):
        assert setting in v2, setting
    assert text.rstrip().endswith("bash assets/make_specimen_v2.sh")  # v3 (make_specimen_v3.sh) is not shipped


V3 = SCRIPT.parent / "make_specimen_v3.sh"


@pytest.mark.slow  # bash runs the script
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_specimen_v3_trains_on_function_heads_then_on_its_own_bodies_for_them(tmp_path):
    run, calls, py = tmp_path / "run", tmp_path / "calls.txt", tmp_path / "py"
    run.mkdir()
    (run / "train_state.pt").touch()
    py.write_text(FAKE_PY)
    py.chmod(0o755)
    env = {**os.environ, "RUN": str(run), "PY": str(py), "CALLS": str(calls), "EXPORT": str(tmp_path / "model"),
           "STEPS_A": "7", "FUNCTIONS_A": "0.4", "STEPS_B": "9", "DISTILL_B": "0.5", "FUNCTIONS_B": "0.25"}
    subprocess.run(["bash", str(V3)], env=env, check=True, capture_output=True, text=True)
    a, distill, b, export, measure, export2, card = [c for c in calls.read_text().splitlines() if c[:2] != "-c"]
    assert "--extend-steps 7" in a and a.endswith("--functions-share 0.4") and "--distill" not in a
    heads = str(run / "distill-heads.pt")
    assert f"-m clover_lab.train.distill --run {run} --out {heads} --functions" in distill
    assert "--extend-steps 9" in b and f"--distill {heads} --distill-share 0.5 --functions-share 0.25" in b
    assert export.endswith(f"--export {run / 'v3'} --generation repetition_penalty=1.3")
    assert measure.endswith(f"--out {run / 'v3' / 'measure.json'}")
    assert export2.endswith(f"--export {tmp_path / 'model'} --generation repetition_penalty=1.3")
    assert card.endswith(f"--baseline {run / 'init_card.json'} --threads 2")
