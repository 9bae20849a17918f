"""Execute every notebook in notebooks/ with nbclient and save it WITH its outputs, for the docs.

    python notebooks/execute.py                      # every notebook, written back in place
    python notebooks/execute.py --out site_nb 04 06  # notebooks 04 and 06, written to site_nb/
    python notebooks/execute.py --pictures docs/images/notebooks   # also the widgets' pictures
    python notebooks/execute.py --browser --out build/notebooks     # Run All in JupyterLab: the site's pages

Each notebook runs top to bottom in a fresh python3 kernel started in notebooks/ (as a reader's
would), with the same seeds every time (a first cell, removed again before saving, seeds python's
``random``, numpy and torch and fixes the kernel's hash seed), on the embedded default model (or
$CLOVER_LAB_MODEL). What would differ between two runs of the same code is taken out of the saved
file: execution timestamps (cells' ``execution`` metadata), the kernel's widget model ids (a
widget's output keeps its text form; its picture comes from ``--pictures``), and the execution
counts start at 1 with no gap. Timings a cell prints (tokens/s, ms) are measurements: they move
from machine to machine, and stay as printed.

Nothing is half-written: a notebook whose execution fails is not saved (the error names its cell),
and each file is replaced atomically (clover_lab/writes.py).

``--pictures DIR`` runs the browser tier's test (tests/test_browser.py: JupyterLab in Debian's
chromium at about 1000 px of notebook width) with CLOVER_LAB_SHOTS_DIR=DIR: one folder per notebook
holding every view and figure it drew, the pictures the docs show beside the executed notebooks.

``--browser --out DIR`` executes them the way a reader does instead: the browser tier opens each in
JupyterLab in Chromium, Run All (full size: CLOVER_LAB_NOTEBOOK_QUICK=0), and saves what the page holds
into DIR (CLOVER_LAB_EXECUTED_DIR), every view and plotly figure replaced by its picture as drawn
there (a static page has no kernel to draw a widget from): the documentation site's notebook pages
(``CLOVER_LAB_EXECUTED_NOTEBOOKS=DIR mkdocs build``; docs/hooks/site.py refuses a copy whose cells
are not the repository's).

Notebooks are committed WITHOUT outputs (tests/test_notebooks.py checks it): outputs would be
rewritten by every run (timings), go stale with every edit of the code, and collide in every merge;
write the executed copies for the docs with ``--out``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SEED = 0
SEED_CELL = (f"import random as _r, numpy as _np, torch as _t\n"
             f"_r.seed({SEED}); _np.random.seed({SEED}); _t.manual_seed({SEED})\n"
             "del _r, _np, _t")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def notebooks(names: list[str]) -> list[Path]:
    """The notebooks named (by a prefix of their file name: ``04``, ``06_patching``), or all of them."""
    every = sorted(HERE.glob("*.ipynb"))
    if not names:
        return every
    chosen = []
    for name in names:
        hits = [p for p in every if p.name.startswith(name)]
        if len(hits) != 1:
            raise SystemExit(f"notebook {name!r}: {len(hits)} notebooks in {HERE} start with it "
                             f"({', '.join(p.name for p in hits) or 'none'}); expected one")
        chosen += hits
    return chosen


def execute(path: Path, timeout: int = 600):
    """``path`` executed top to bottom in a fresh kernel, seeded, its volatile metadata stripped."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(SEED_CELL))
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=False,
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=dict(os.environ, PYTHONHASHSEED=str(SEED)))  # raises CellExecutionError naming the cell
    nb.cells.pop(0)
    return strip_volatile(nb)


def strip_volatile(nb):
    """What differs between two executions of the same code, taken out (in place; returns ``nb``)."""
    nb.metadata.pop("widgets", None)
    count = 0
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        count += 1
        cell.execution_count = count
        for output in cell.outputs:
            if "execution_count" in output:
                output["execution_count"] = count
            data = output.get("data")
            if data and WIDGET_VIEW in data:  # a random model id, meaningless without the widget state
                del data[WIDGET_VIEW]
    return nb


PLOTLY = "application/vnd.plotly.v1+json"


def drawn_only_in_a_page(output) -> bool:
    """An output a static page cannot draw from the file: a widget (its state is not saved) or a
    plotly figure's JSON (drawn by JupyterLab's plotly renderer)."""
    data = output.get("data") or {}
    return WIDGET_VIEW in data or PLOTLY in data


def with_pictures(nb, pictures: dict):
    """``nb`` (in place; returned) with every output :func:`drawn_only_in_a_page` replaced by its picture
    as the page drew it: ``pictures[(cell index, output index)]`` is its PNG. The output keeps its
    text form beside the picture; one without a picture raises ValueError naming its cell."""
    import base64

    for i, cell in enumerate(nb.cells):
        for j, output in enumerate(cell.get("outputs", [])):
            if not drawn_only_in_a_page(output):
                continue
            if (i, j) not in pictures:
                raise ValueError(f"cell {i}, output {j}: a view or figure with no picture of it")
            text = output["data"].get("text/plain", "a view: run the notebook to use it")
            output["data"] = {"image/png": base64.b64encode(pictures[i, j]).decode("ascii"), "text/plain": text}
            output["metadata"] = {}
    return nb


def save(nb, target: Path) -> None:
    import nbformat

    from clover_lab.writes import write_text

    write_text(target, nbformat.writes(nb) + "\n")


def in_the_browser(folder: Path, names: list[str]) -> int:
    """Every notebook (or those named) Run All in JupyterLab by the browser tier, full size
    (CLOVER_LAB_NOTEBOOK_QUICK=0), saved into ``folder`` with its outputs and each view's picture."""
    env = dict(os.environ, CLOVER_LAB_EXECUTED_DIR=str(folder.resolve()), CLOVER_LAB_NOTEBOOK_QUICK="0",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    # notebook 01 is the dashboard's test; the others are parametrized by their name
    pick = ["-k", " or ".join("dashboard_in_jupyterlab" if p.stem == "01_quickstart" else p.stem
                              for p in notebooks(names))] if names else []
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "slow", "-p", "no:cacheprovider",
                            str(ROOT / "tests" / "test_browser.py"), *pick], cwd=ROOT, env=env)


def pictures(folder: Path) -> int:
    """The browser tier's screenshots of every notebook's views, into ``folder`` (one folder per notebook)."""
    env = dict(os.environ, CLOVER_LAB_SHOTS_DIR=str(folder.resolve()), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "slow", str(ROOT / "tests" / "test_browser.py")],
                           cwd=ROOT, env=env)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="notebooks to run, by the start of their name (default: all)")
    ap.add_argument("--out", type=Path, help="write the executed notebooks here (default: over the sources)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds a cell may take (default 600)")
    ap.add_argument("--pictures", type=Path, help="also photograph every view in Chromium, into this folder")
    ap.add_argument("--browser", action="store_true",
                    help="Run All in JupyterLab in Chromium instead (the browser tier), views saved as their pictures; "
                         "needs --out")
    args = ap.parse_args(argv)
    chosen = notebooks(args.names)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.browser:
        if not args.out:
            ap.error("--browser writes the executed notebooks to --out DIR (the sources stay without outputs)")
        return in_the_browser(args.out, args.names)
    total = time.perf_counter()
    for path in chosen:
        start = time.perf_counter()
        nb = execute(path, args.timeout)
        target = (args.out / path.name) if args.out else path
        save(nb, target)
        print(f"{path.name}: {time.perf_counter() - start:5.1f} s -> {target}", flush=True)
    print(f"{len(chosen)} notebooks in {time.perf_counter() - total:.0f} s")
    if args.pictures:
        return pictures(args.pictures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
