"""Whether the slow tier's browser test (test_browser.py) can run the notebooks on this machine:
Debian's chromium, the playwright package, JupyterLab and a model. Where it can, it runs every
notebook in JupyterLab (errors, stderr, views drawn and live), and test_notebooks.py runs only
notebook 01 headless (nbclient: no front end at all), so that CI runs each notebook once; where it
cannot, test_notebooks.py runs every notebook headless instead."""
import importlib.util
import os
from pathlib import Path

from clover_lab.checkpoint.loading import default_model_dir

CHROMIUM = "/usr/bin/chromium"
# CLOVER_LAB_HEADLESS_NOTEBOOKS=1: every notebook headless too, whatever the browser test does
EVERY_NOTEBOOK_HEADLESS = os.environ.get("CLOVER_LAB_HEADLESS_NOTEBOOKS") == "1"


def why_no_model() -> str | None:
    if os.environ.get("CLOVER_LAB_MODEL") or default_model_dir() is not None:
        return None
    return "no model: the embedded default (assets/clover-stdlib) is missing and CLOVER_LAB_MODEL is not set"


def why_no_browser() -> str | None:
    """Why test_browser.py skips here, or None when it runs the notebooks."""
    if not Path(CHROMIUM).exists():
        return (f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium); "
                ".ci/run does so when it can")
    for package, extra in (("playwright", "the playwright package is not installed"),
                           ("jupyterlab", "JupyterLab is not installed")):
        if importlib.util.find_spec(package) is None:
            return extra
    return why_no_model()
