"""A real browser: JupyterLab started headless, notebooks/01_quickstart.ipynb opened and run in
Debian's chromium (driven by the Python playwright package, no browser download), the dashboard's
plotly figures and token grid checked in the DOM after generation, the Generate button pressed,
and the dashboard photographed (dashboard.png); then notebooks/06_patching_and_lens.ipynb, its
patching heatmaps and logit lens checked and photographed (patching.png, logit_lens.png).

The screenshots go to the test's tmp_path, so that a test run leaves the work tree clean; with
CLOVER_LAB_SCREENSHOTS=1 they go to assets/ instead, where the README shows them:

    CLOVER_LAB_SCREENSHOTS=1 python -m pytest -q tests/test_browser.py
"""
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from clover_lab.loading import default_model_dir

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run"]
ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "01_quickstart.ipynb"
PATCHING_NOTEBOOK = ROOT / "notebooks" / "06_patching_and_lens.ipynb"

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason=f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium); "
                              ".ci/run does so when it can"),
    pytest.mark.skipif(not (os.environ.get("CLOVER_LAB_MODEL") or default_model_dir()),
                       reason="no model: the embedded default (assets/clover-stdlib) is missing and "
                              "CLOVER_LAB_MODEL is not set"),
]

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
pytest.importorskip("jupyterlab")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on a free loopback port, serving a copy of the notebook (so that the
    browser's autosave never writes into notebooks/), with its settings in tmp_path."""
    root = tmp_path / "lab"
    root.mkdir()
    for notebook in (NOTEBOOK, PATCHING_NOTEBOOK):
        shutil.copy(notebook, root / notebook.name)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"))
    # no "get notified about Jupyter news?" toast over the screenshot
    news = tmp_path / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text('{"fetchNews": "false"}')
    port = _free_port()
    log = open(tmp_path / "lab.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.token=", "--ServerApp.password=",
         f"--port={port}", "--ServerApp.ip=127.0.0.1", f"--ServerApp.root_dir={root}",
         "--LabApp.expose_app_in_browser=True"] + (["--allow-root"] if os.geteuid() == 0 else []),
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture
def page():
    """A page of headless chromium, tall enough to hold a notebook's views; closed after the test."""
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            yield browser.new_page(viewport={"width": 1500, "height": 3400})
        finally:
            browser.close()


@pytest.fixture
def shots(tmp_path) -> Path:
    """Where the screenshots go: assets/ (the README's) only when CLOVER_LAB_SCREENSHOTS=1, else tmp_path."""
    folder = ROOT / "assets" if os.environ.get("CLOVER_LAB_SCREENSHOTS") == "1" else tmp_path / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def photograph(page, view, path: Path, min_bytes: int) -> None:
    """Screenshot ``view`` (a locator) to ``path`` once plotly is done; a near-empty image fails."""
    view.scroll_into_view_if_needed()
    page.wait_for_timeout(500)  # let plotly finish its last redraw
    view.screenshot(path=str(path))
    assert path.stat().st_size > min_bytes, f"{path}: {path.stat().st_size} bytes, a blank view?"


KERNEL_IDLE = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle';
}"""

ALL_RUN = """() => {
  const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(e => e.textContent);
  return prompts.length > 0 && prompts.every(t => /\\[\\d+\\]/.test(t));
}"""


def run_all(page, lab, notebook: Path) -> None:
    """Open ``notebook`` in JupyterLab, Run All, wait for every cell, and fail on any traceback."""
    page.goto(f"{lab}/lab/tree/{notebook.name}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    page.wait_for_function(KERNEL_IDLE, timeout=90_000)
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_function(ALL_RUN, timeout=240_000, polling=500)
    tracebacks = [t for t in page.locator(".jp-RenderedText[data-mime-type='application/vnd.jupyter.error']")
                  .all_inner_texts()]
    assert not tracebacks, tracebacks[0][-2000:]


def test_patching_and_lens_in_jupyterlab(lab, page, shots):
    run_all(page, lab, PATCHING_NOTEBOOK)
    # after Run All every view is still on screen with its figure (detaching closes nothing)
    page.wait_for_function("() => document.querySelectorAll('.clover-patchingview .js-plotly-plot').length >= 2"
                           " && document.querySelectorAll('.clover-lensview .js-plotly-plot').length >= 1"
                           " && document.querySelectorAll('.clover-denoiseview .clover-grid').length >= 1",
                           timeout=120_000)
    for selector, name in ((".clover-patchingview", "patching.png"), (".clover-lensview", "logit_lens.png")):
        view = page.locator(selector).first
        assert view.locator(".js-plotly-plot .main-svg").count() >= 1
        photograph(page, view, shots / name, 10_000)


def test_dashboard_in_jupyterlab(lab, page, shots):
    run_all(page, lab, NOTEBOOK)

    dash = page.locator(".clover-dashboard").first
    dash.wait_for(timeout=60_000)
    status = dash.locator(".clover-status")
    page.wait_for_function("() => document.querySelector('.clover-dashboard .clover-status')"
                           ".textContent.includes('done')", timeout=120_000)
    # the token grid: one box per block, a cell per position, hover titles with candidates
    grid = dash.locator(".clover-grid")
    assert grid.count() >= 1
    assert dash.locator(".clover-grid .cl-block").count() >= 1
    assert dash.locator(".clover-grid .cl-tok").count() >= 16
    assert "candidates" in (dash.locator(".clover-grid .cl-tok").first.get_attribute("title") or "")
    # plotly figures rendered (FigureWidget via anywidget): speed x3, experts x3, memory x3
    page.wait_for_function("() => document.querySelectorAll('.clover-dashboard .js-plotly-plot').length >= 9",
                           timeout=60_000)
    assert dash.locator(".js-plotly-plot .main-svg").count() >= 9

    # Generate from the browser: a second run lands in the speed view's table
    dash.locator(".clover-generate button, button.clover-generate").first.click()
    page.wait_for_function(
        "() => document.querySelectorAll('.clover-dashboard .clover-speedview table tr').length >= 3",
        timeout=120_000)
    page.wait_for_function("() => document.querySelector('.clover-dashboard .clover-status')"
                           ".textContent.includes('done')", timeout=120_000)
    assert "done" in status.inner_text()

    photograph(page, dash, shots / "dashboard.png", 20_000)
