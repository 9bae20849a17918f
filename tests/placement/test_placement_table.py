"""The README's table of GPU sets for the 35B model is bench/placement_table.py's output: every
row the README shows is a row the script computes from the preset's config today."""
import importlib.util
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_readme_table_is_what_the_script_computes(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("placement_table", REPO / "bench" / "placement_table.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--out", str(tmp_path)])
    computed = {line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 x") or
                line.startswith("| 2 x") or line.startswith("| 4 x")}
    readme = [line for line in (REPO / "README.md").read_text().splitlines()
              if line.startswith(("| 1 x", "| 2 x", "| 4 x")) and "clover-lab generate" in line]
    assert len(readme) >= 8
    stale = [line for line in readme if line not in computed]
    assert not stale, "README rows the script no longer computes (rerun bench/placement_table.py):\n" + "\n".join(stale)
    (written,) = tmp_path.iterdir()  # its JSON (bench/result_file.py), named by the day, nothing else
    assert re.fullmatch(r"placement-35b-\d{4}-\d{2}-\d{2}\.json", written.name)
    doc = json.loads(written.read_text())
    assert doc["context"] == 32768 and len(doc["rows"]) == len(computed)
