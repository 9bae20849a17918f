"""bench/result_file.py: the one way the benchmark scripts name and write their JSON (whole or not
at all, through clover_lab.writes.atomic_path), and the scripts that use it."""
import importlib.util
import json
import re
from pathlib import Path

import pytest

from clover_lab import CloverError, OutputError

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
spec = importlib.util.spec_from_file_location("result_file", BENCH / "result_file.py")
result_file = importlib.util.module_from_spec(spec)
spec.loader.exec_module(result_file)

PAYLOAD = {"settings": {"model": "default", "threads": 1}, "rows": [{"mode": "diffusion", "ratio": 1.25}],
           "nan": float("nan"), "none": None}


def test_names_hold_the_stem_and_the_utc_time_or_day(tmp_path):
    assert re.fullmatch(r"coreset-default-cpu-\d{8}-\d{6}\.json",
                        result_file.result_path(tmp_path, "coreset-default-cpu").name)
    assert re.fullmatch(r"placement-35b-\d{4}-\d{2}-\d{2}\.json",
                        result_file.result_path(tmp_path, "placement-35b", result_file.DATE).name)
    assert result_file.result_path(tmp_path, "memory-cpu-2026-11-30-small", None) == tmp_path / "memory-cpu-2026-11-30-small.json"
    assert result_file.slug("NVIDIA H200") == "nvidia-h200"
    assert result_file.slug("cpu (x86_64)") == "cpu-x86-64"
    assert result_file.RESULTS == BENCH / "results"


def test_run_fields_say_what_ran_where():
    import torch

    fields = result_file.run_fields("bench_batch", "cpu")
    assert list(fields) == ["benchmark", "date", "device", "device_name", "torch", "threads"]
    assert fields["benchmark"] == "bench_batch" and fields["device"] == "cpu" and fields["device_name"]
    assert fields["torch"] == torch.__version__ and fields["threads"] == torch.get_num_threads()


def test_a_result_round_trips_and_its_folder_is_made(tmp_path, capsys):
    path = result_file.write_result(tmp_path / "new" / "folder", "hooks-default-model-cpu", PAYLOAD, indent=2)
    assert path.parent == tmp_path / "new" / "folder" and path.name.startswith("hooks-default-model-cpu-")
    assert capsys.readouterr().out == f"wrote {path}\n"
    text = path.read_text()
    assert text.endswith("}\n") and text.startswith('{\n  "settings"')
    back = json.loads(text)
    assert back["rows"] == PAYLOAD["rows"] and back["none"] is None and back["nan"] != back["nan"]
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary left beside it


def test_a_payload_that_is_not_json_raises_and_leaves_the_old_file_as_it_was(tmp_path):
    path = result_file.write_json(tmp_path / "roofline.json", PAYLOAD)
    before = path.read_bytes()
    bad = {"rows": [{"mode": "ar", "seconds": 1.0}] * 50, "when": object()}  # fails after half is written
    with pytest.raises(OutputError, match=r"roofline\.json: the result is not JSON \(Object of type object") as e:
        result_file.write_json(path, bad)
    assert isinstance(e.value, CloverError)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["roofline.json"]
    with pytest.raises(OutputError, match="not JSON"):  # nor a new name: nothing at all
        result_file.write_json(tmp_path / "fresh.json", bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["roofline.json"]


def test_an_interrupt_in_the_middle_of_a_write_leaves_the_old_file(tmp_path):
    path = result_file.write_json(tmp_path / "kernels.json", PAYLOAD)
    before = path.read_bytes()

    def interrupted(obj):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        result_file.write_json(path, {"rows": list(range(1000)), "cut": object()}, default=interrupted)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels.json"]


def test_a_folder_that_cannot_be_made_is_a_clear_error(tmp_path):
    (tmp_path / "a-file").write_text("mine\n")
    with pytest.raises(OutputError, match=r"a-file/x\.json: cannot write the result"):
        result_file.write_json(tmp_path / "a-file" / "x.json", PAYLOAD)
    assert (tmp_path / "a-file").read_text() == "mine\n"


# what writes JSON itself: compile_check.py runs under other Triton installs with only clover_kernels
# needed, gpu_check_summary.py is stdlib-only and rewrites its summary after every step of a GPU run
OWN_WRITERS = {"result_file.py", "compile_check.py", "gpu_check_summary.py"}


def test_every_benchmark_writes_its_json_through_the_helper():
    scripts = sorted(p for p in BENCH.glob("*.py") if p.name not in OWN_WRITERS)
    assert len(scripts) >= 18
    by_hand = [p.name for p in scripts if re.search(r"write_text\(json\.dumps|json\.dump\(", p.read_text())]
    assert not by_hand, f"bench scripts that write JSON by hand, not through result_file: {by_hand}"
