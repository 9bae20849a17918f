"""The notebooks in notebooks/ run top to bottom headless (nbclient: no front end) on the embedded
default model, or on $CLOVER_LAB_MODEL when set: notebook 01 always (its dashboard with no page to
draw it), the others where the browser test cannot run them in JupyterLab (browser_runs.py), so
that the slow tier runs each notebook once; CLOVER_LAB_HEADLESS_NOTEBOOKS=1 runs them all here."""
import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from browser_runs import EVERY_NOTEBOOK_HEADLESS, why_no_browser, why_no_model  # noqa: E402

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
NO_MODEL = why_no_model()
needs_model = pytest.mark.skipif(NO_MODEL is not None, reason=NO_MODEL or "")
ALWAYS_HEADLESS = {"01_quickstart"}
IN_THE_BROWSER = not EVERY_NOTEBOOK_HEADLESS and why_no_browser() is None  # test_browser.py runs the others


def test_notebooks_exist_with_a_kernelspec():
    names = [p.name for p in NOTEBOOKS]
    for want in ("01_quickstart", "02_denoising", "03_expert_routing", "04_gdn_memory", "05_speed",
                 "06_patching_and_lens", "07_routing_lens_and_coreset", "08_steering_and_features",
                 "09_why_this_token"):
        assert f"{want}.ipynb" in names
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        assert nb.metadata["kernelspec"]["name"] == "python3", path.name
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"{path.name} is stored with outputs"
        assert "MODEL_DIR = None" in nb.cells[1].source, f"{path.name}: the model is set in its first code cell"
        assert "widgets" not in nb.metadata, f"{path.name} is stored with widget state"
        # views stay on screen after "Run All": a notebook detaches its views, it never closes them
        assert not any(".close()" in c.source for c in nb.cells if c.cell_type == "code"), f"{path.name} closes a view"


@needs_model
@pytest.mark.slow  # a notebook kernel
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    if path.stem not in ALWAYS_HEADLESS and IN_THE_BROWSER:
        pytest.skip("run in JupyterLab by tests/test_browser.py (CLOVER_LAB_HEADLESS_NOTEBOOKS=1 runs it here too)")
    # the notebooks' shorter versions (every cell, smaller sweeps), unless set already (=0: the full ones)
    monkeypatch.setenv("CLOVER_LAB_NOTEBOOK_QUICK", os.environ.get("CLOVER_LAB_NOTEBOOK_QUICK", "1"))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError naming the cell on the first error
    took = time.perf_counter() - start
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert took < 180, f"{path.name} took {took:.0f} s; notebooks should run in tens of seconds"
