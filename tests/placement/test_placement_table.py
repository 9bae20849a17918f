"""The documentation's table of GPU sets for the 35B model (docs/guides/real-model.md, rendered from
the newest bench/results/placement-35b-*.json by bench/result_tables.py) is bench/placement_table.py's
output: every row the page shows is a row the script computes from the preset's config today."""
import importlib.util
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documented_table_is_what_the_script_computes(capsys, tmp_path):
    script, tables = load("placement_table"), load("result_tables")
    script.main(["--out", str(tmp_path)])
    computed = {line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 1 x", "| 2 x", "| 4 x"))}
    page = (REPO / "docs" / "guides" / "real-model.md").read_text()
    shown = re.findall(r'^\{\{ bench_table\("(placement-35b-[^"]+)"\) \}\}$', page, re.MULTILINE)
    assert shown == [tables.latest("placement-35b-")], "the page shows the newest placement results file"
    rows = [line for line in tables.render(shown[0]).splitlines() if line.startswith(("| 1 x", "| 2 x", "| 4 x"))]
    assert len(rows) >= 8 and all("clover-lab generate" in line for line in rows)
    stale = [line for line in rows if line not in computed]
    assert not stale, "rows the script no longer computes (rerun bench/placement_table.py):\n" + "\n".join(stale)
    (written,) = tmp_path.iterdir()  # its JSON (bench/result_file.py), named by the day, nothing else
    assert re.fullmatch(r"placement-35b-\d{4}-\d{2}-\d{2}\.json", written.name)
    doc = json.loads(written.read_text())
    assert doc["context"] == 32768 and len(doc["rows"]) == len(computed)
