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


# records each call's arguments; `-c` (the script's question: the run's schedule) answers $STATE; a
# distillation makes its --out file
FAKE_PY_V3 = """#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$CALLS"
if [ "$1" = "-c" ]; then echo "$STATE"; fi
if [ "$2" = "clover_lab.train.distill" ]; then  # the corpus file is made
    while [ $# -gt 0 ]; do if [ "$1" = "--out" ]; then touch "$2"; fi; shift; done
fi
"""


def v3_run(tmp_path, **env) -> subprocess.CompletedProcess:
    run, calls, py = tmp_path / "run", tmp_path / "calls.txt", tmp_path / "py"
    run.mkdir(exist_ok=True)
    (run / "train_state.pt").touch()
    py.write_text(FAKE_PY_V3)
    py.chmod(0o755)
    full = {**os.environ, "RUN": str(run), "PY": str(py), "CALLS": str(calls), "STATE": "0 0 0", **env}
    return subprocess.run(["bash", str(V3)], env=full, capture_output=True, text=True)


def v3_calls(tmp_path, **env) -> list[str]:
    proc = v3_run(tmp_path, **env)
    assert proc.returncode == 0, proc.stderr
    return [call for call in (tmp_path / "calls.txt").read_text().splitlines() if call[:2] != "-c"]


@pytest.mark.slow  # bash runs the script
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_specimen_v3_trains_on_function_heads_then_rounds_of_its_own_bodies(tmp_path):
    run = tmp_path / "run"
    a, d1, r1, r2, d3, r3, export, measure, export2, card = v3_calls(
        tmp_path, EXPORT=str(tmp_path / "model"), STEPS_A="7", FUNCTIONS_A="0.4",
        ROUNDS="9 0.5 0.25 0 1\n11 0.6 0.1 0.2 1\n5 0.7 0.05 0.03 2")
    assert "--extend-steps 7" in a and a.endswith("--functions-share 0.4") and "--distill" not in a
    for n, distill in ((1, d1), (2, d3)):  # a corpus is made once, from the model as it is then
        assert f"-m clover_lab.train.distill --run {run} --out {run / f'distill-heads-{n}.pt'} --functions" in distill
        assert f"--seed {n} " in distill
    heads1, heads2 = run / "distill-heads-1.pt", run / "distill-heads-2.pt"
    assert "--extend-steps 9" in r1 and r1.endswith(
        f"--distill {heads1} --distill-share 0.5 --functions-share 0.25 --split-newlines 0")
    assert "--extend-steps 11" in r2 and r2.endswith(
        f"--distill {heads1} --distill-share 0.6 --functions-share 0.1 --split-newlines 0.2")  # round 1's corpus
    assert "--extend-steps 5" in r3 and r3.endswith(f"--distill {heads2} --distill-share 0.7 --functions-share 0.05 "
                                                    "--split-newlines 0.03")
    assert export.endswith(f"--export {run / 'v3'} --generation repetition_penalty=1.3")
    assert measure.endswith(f"--out {run / 'v3' / 'measure.json'}")
    assert export2.endswith(f"--export {tmp_path / 'model'} --generation repetition_penalty=1.3")
    assert card.endswith(f"--baseline {run / 'init_card.json'} --command bash assets/make_specimen_v3.sh --threads 2")
    assert (run / "rounds-done.txt").read_text().split("\n")[:5] == ["init 0", "A 0", "1 0", "2 0", "3 0"]


@pytest.mark.slow  # bash runs the script
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_specimen_v3_resumes_the_stage_whose_schedule_began_and_skips_the_done(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "rounds-done.txt").write_text("init 0\nA 0\n1 1200\n")
    (run / "distill-heads-2.pt").touch()  # round 2's corpus, made when it began
    # the run's schedule began at step 1800, after round 1's: round 2 is under way; it ends at 2600
    calls = v3_calls(tmp_path, STATE="1800 2600 2600", ROUNDS="600 0.6 0.2 0 1\n800 0.75 0.1 0 2\n5 0.8 0 0 2")
    resume, r3 = calls[:2]
    assert resume.endswith("--threads 2") and "--extend-steps" not in resume  # round 2 resumed, corpus 2 kept
    assert not any("train.distill" in c for c in calls) and "--extend-steps 5" in r3
    assert (run / "rounds-done.txt").read_text().splitlines()[3:] == ["2 1800", "3 1800"]


@pytest.mark.slow  # bash runs the script
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_specimen_v3_stops_when_a_stages_schedule_did_not_finish(tmp_path):
    run = tmp_path / "run"
    proc = v3_run(tmp_path, STATE="0 300 1200", MINUTES="5")
    assert proc.returncode == 1 and "stage A stopped at step 300 of 1200 (MINUTES=5): run again to resume" in proc.stderr
    assert (run / "rounds-done.txt").read_text() == "init 0\n"


V4 = SCRIPT.parent / "make_specimen_v4.sh"


def v4_run(tmp_path, **env) -> subprocess.CompletedProcess:
    run, calls, py = tmp_path / "run", tmp_path / "calls.txt", tmp_path / "py"
    py.write_text(FAKE_PY_V3)
    py.chmod(0o755)
    full = {**os.environ, "RUN": str(run), "PY": str(py), "CALLS": str(calls), "STATE": "0 0 0", **env}
    return subprocess.run(["bash", str(V4)], env=full, capture_output=True, text=True)


def v4_calls(tmp_path) -> list[str]:
    return [call for call in (tmp_path / "calls.txt").read_text().splitlines() if call[:2] != "-c"]


@pytest.mark.slow  # bash runs the script
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_specimen_v4_continues_v3s_run_on_its_bodies_and_its_window_continuations(tmp_path):
    run = tmp_path / "run"
    (run / "v3").mkdir(parents=True)
    (run / "train_state.pt").touch()
    (run / "v3" / "measure.json").touch()  # v3 finished: its rounds are done, its corpus 4 made
    (run / "v3" / "card.json").touch()
    (run / "distill-heads-4.pt").touch()
    (run / "rounds-done.txt").write_text("init 0\nA 0\n1 0\n2 0\n3 0\n4 0\n5 0\n")
    proc = v4_run(tmp_path, EXPORT=str(tmp_path / "model"))
    assert proc.returncode == 0, proc.stderr
    (windows5, merge45, r6, heads6, windows6, merge66, r7, r8, heads8, windows8, merge88, r9, export, measure, export2,
     card) = v4_calls(tmp_path)
    assert windows5.startswith(f"-m clover_lab.train.distill --run {run} --out {run / 'distill-windows-5.pt'} "
                               "--sequences 1536 --seed 5") and "--functions" not in windows5  # v3's continuations
    mix45, mix66 = run / "distill-mix-4-5.pt", run / "distill-mix-6-6.pt"
    assert merge45 == (f"-m clover_lab.train.distill --merge {run / 'distill-heads-4.pt'} "
                       f"{run / 'distill-windows-5.pt'} --out {mix45}")
    assert "--extend-steps 600" in r6 and r6.endswith(
        f"--confidence-weight 1.0 --distill {mix45} --distill-share 0.85 --functions-share 0.05 --split-newlines 0.03")
    assert "--seed 6" in windows6 and "--functions" in heads6 and "--seed 6" in heads6  # round 6's model's corpora
    assert merge66.endswith(f"--out {mix66}") and f"--distill {mix66} --distill-share 0.75" in r7
    assert "--confidence-weight 1.0" in r7 and r8.endswith(  # round 8: round 7's corpora, a surer model
        f"--confidence-weight 2.0 --distill {mix66} --distill-share 0.75 --functions-share 0.15 --split-newlines 0.03")
    assert "--seed 8" in heads8 and "--functions" in heads8 and "--seed 8" in windows8  # round 8's model's
    assert r9.endswith(f"--confidence-weight 1.5 --distill {run / 'distill-mix-8-8.pt'} --distill-share 0.75 "
                       "--functions-share 0.15 --split-newlines 0.03") and merge88.endswith("distill-mix-8-8.pt")
    assert export.endswith(f"--export {run / 'v4'} --generation repetition_penalty=1.5")  # v4's: no loops there
    assert measure.endswith(f"--out {run / 'v4' / 'measure.json'}")
    assert export2.endswith(f"--export {tmp_path / 'model'} --generation repetition_penalty=1.5")
    assert card.endswith(f"--baseline {run / 'v3' / 'card.json'} --continues --command bash assets/make_specimen_v4.sh "
                         "--threads 2")
    assert (run / "rounds-done.txt").read_text().splitlines()[7:] == ["6 0", "7 0", "8 0", "9 0"]


@pytest.mark.slow  # bash runs the script
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_specimen_v4_runs_v3_first_and_needs_v3s_card_to_export(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_state.pt").touch()  # as the fake's --init made it
    proc = v4_run(tmp_path, EXPORT=str(tmp_path / "model"))
    # v3's recipe ran to its export in RUN/v3 with its card there; the fake made no card, so v4 stops
    assert proc.returncode == 1 and f"no card of v3 at {run / 'v3' / 'card.json'}" in proc.stderr
    calls = v4_calls(tmp_path)
    assert f"--export {run / 'v3'} --generation repetition_penalty=1.3" in calls[-2]  # v3's own defaults
    assert calls[-1].endswith(f"--baseline {run / 'init_card.json'} --command bash assets/make_specimen_v3.sh "
                              "--threads 2") and f"--model {run / 'v3'}" in calls[-1]
    assert (run / "rounds-done.txt").read_text().splitlines() == ["init 0", "A 0", "1 0", "2 0", "3 0", "4 0", "5 0"]
