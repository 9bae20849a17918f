"""The documentation site's build hook (mkdocs.yml: ``hooks``): what the site takes from the
repository as it is, rather than from copies under docs/.

- The pictures in assets/ (*.png: the screenshots the pages and the README show) and the notebooks in
  notebooks/ become site files at ``assets/NAME`` and ``notebooks/NAME``, so a page links them and
  mkdocs-jupyter renders each notebook with the outputs it was saved with (never executed here).
- A line ``{{ bench_table("FILE") }}`` (or ``{{ bench_table("FILE", "PART") }}`` or more files side by side),
  indented as far as the line is (a table inside a list item) becomes the table
  bench/result_tables.py renders from bench/results/FILE, and ``{{ bench_results_index() }}`` every results
  file's rows: a benchmark figure has one source, its JSON. A file or table that does not exist
  stops the build, naming the page.
"""
from __future__ import annotations

import importlib.util
import re
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


@event_priority(100)  # before mkdocs-jupyter's on_files, which claims the notebooks among the files
def on_files(files, config):
    for folder, pattern in FROM_REPOSITORY.items():
        for path in sorted((ROOT / folder).glob(pattern)):
            files.append(File(f"{folder}/{path.name}", src_dir=str(ROOT), dest_dir=config["site_dir"],
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
