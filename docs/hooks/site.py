"""The documentation site's build hook (mkdocs.yml: ``hooks``): what the site takes from the
repository as it is, rather than from copies under docs/.

- The pictures in assets/ (*.png: the screenshots the pages and the README show) and the notebooks in
  notebooks/ become site files at ``assets/NAME`` and ``notebooks/NAME``, so a page links them and
  mkdocs-jupyter renders each notebook with the outputs it holds (never executed here).
- With ``CLOVER_LAB_EXECUTED_NOTEBOOKS=DIR`` the notebook pages are the executed copies in DIR
  (``python notebooks/execute.py --browser --out DIR``: Run All in JupyterLab, each view's output
  replaced by its picture) instead of the repository's notebooks, which are kept without outputs.
  A copy whose cells are not the repository notebook's (an edit since it was executed), or a
  notebook with no copy, stops the build, naming it: a page never shows another version's outputs.
- A line ``{{ bench_table("FILE") }}`` (or ``{{ bench_table("FILE", "PART") }}`` or more files side by side),
  indented as far as the line is (a table inside a list item) becomes the table
  bench/result_tables.py renders from bench/results/FILE, and ``{{ bench_results_index() }}`` every results
  file's rows: a benchmark figure has one source, its JSON. A file or table that does not exist
  stops the build, naming the page.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "bench" / "result_tables.py")
tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tables)

# folder of the repository -> the files of it the site serves (under the same folder name)
FROM_REPOSITORY = {"assets": "*.png", "notebooks": "*.ipynb"}
MARKER = re.compile(r'^( *)\{\{ *(bench_table|bench_results_index)\((.*?)\) *\}\}$', re.MULTILINE)
ARGUMENT = re.compile(r'\s*"([^"]*)"\s*(?:,|$)')


EXECUTED = "CLOVER_LAB_EXECUTED_NOTEBOOKS"
STAGED: list[Path] = []  # this build's folders of executed copies, removed when it ends


def on_shutdown():
    while STAGED:
        shutil.rmtree(STAGED.pop(), ignore_errors=True)


def cell_sources(path: Path) -> list[tuple[str, str]]:
    """A notebook's cells as (type, source): what an executed copy must share with its source."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"]) for c in cells]


def executed_copy(source: Path, folder: Path) -> Path:
    """``source``'s executed copy in ``folder``; a missing or stale copy raises PluginError naming it."""
    copy = folder / source.name
    again = f"run `python notebooks/execute.py --browser --out {folder}` again"
    if not copy.is_file():
        raise PluginError(f"{EXECUTED}={folder}: no executed copy of notebooks/{source.name}; {again}")
    want, got = cell_sources(source), cell_sources(copy)
    if want != got:
        at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        raise PluginError(f"{copy} is not notebooks/{source.name} as it is now (cell {at} differs; "
                          f"{len(got)} cells against {len(want)}): {again}")
    return copy


@event_priority(100)  # before mkdocs-jupyter's on_files, which claims the notebooks among the files
def on_files(files, config):
    executed = os.environ.get(EXECUTED)
    if executed:  # the same pages, read from the executed copies: staged as notebooks/NAME under a folder of
        # their own (mkdocs-jupyter's wrapper of a File finds its source by src_dir and src_uri alone)
        staged = Path(tempfile.mkdtemp(prefix="clover-lab-site-"))
        STAGED.append(staged)
        (staged / "notebooks").mkdir()
        for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
            shutil.copyfile(executed_copy(path, Path(executed).resolve()), staged / "notebooks" / path.name)
    for folder, pattern in FROM_REPOSITORY.items():
        for path in sorted((ROOT / folder).glob(pattern)):
            src = staged if folder == "notebooks" and executed else ROOT
            files.append(File(f"{folder}/{path.name}", src_dir=str(src), dest_dir=config["site_dir"],
                              use_directory_urls=config["use_directory_urls"]))
    return files


def arguments(text: str) -> list[str]:
    args, at = [], 0
    while at < len(text):
        m = ARGUMENT.match(text, at)
        if not m:
            raise ValueError(f"arguments must be quoted strings, got {text!r}")
        args.append(m.group(1))
        at = m.end()
    return args


def on_page_markdown(markdown, page, config, files):
    def replace(m):
        try:
            args = arguments(m.group(3))
            text = tables.index() if m.group(2) == "bench_results_index" else tables.render(*args)
            return "\n".join(m.group(1) + line if line else line for line in text.splitlines())  # inside a list item too
        except (ValueError, TypeError, tables.TableError) as e:
            raise PluginError(f"{page.file.src_path}: {m.group(0)}: {e}") from e
    return MARKER.sub(replace, markdown)
