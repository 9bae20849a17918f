"""bench/bench_policies.py's figure: every policy is named in its legend, in the table's order (labels
written beside the points overlapped where policies land close together)."""
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture
def bench_policies(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports result_file beside it, as when run
    spec = importlib.util.spec_from_file_location("bench_policies", BENCH / "bench_policies.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_figure_names_every_policy_in_its_legend(bench_policies, tmp_path):
    result = sorted((BENCH / "results").glob("policies-default-model-cpu-*.json"))[-1]
    rows = json.loads(result.read_text())["rows"]
    fig = bench_policies.plot(rows, str(tmp_path / "policies.png"))
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [r["policy"] for r in rows]
    assert not ax.texts  # no label drawn beside a point
    points = [line.get_xydata()[0].tolist() for line in ax.get_lines()]
    assert points == [[r["tokens_per_forward"], 1 - r["edit_distance"]] for r in rows]
    assert (tmp_path / "policies.png").stat().st_size > 10_000
