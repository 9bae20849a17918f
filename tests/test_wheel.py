"""The wheel (a non-editable ``pip install .``) carries the embedded default model, so that
``clover_lab.load()`` works from the installed package: built from a copy of the sources (nothing
is written into the checkout), installed into a fresh target directory and run from outside the
repository, with the checkout and the editable install out of sight."""
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "assets" / "clover-stdlib"
pytestmark = [pytest.mark.slow,  # builds a wheel and installs it in a fresh venv
              pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="no embedded model in assets/")]


def run(*cmd, **kw):
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)
    assert out.returncode == 0, f"{cmd}: {out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("clover_lab", "clover_kernels"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(MODEL, src / "assets" / MODEL.name)
    out = tmp_path_factory.mktemp("wheels")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", out, src)
    return next(out.glob("clover_lab-*.whl"))


def test_the_wheel_carries_the_default_model(wheel):
    with zipfile.ZipFile(wheel) as z:
        sizes = {info.filename: info.file_size for info in z.infolist()}
    for f in MODEL.iterdir():
        assert sizes.get(f"clover_lab/assets/{MODEL.name}/{f.name}") == f.stat().st_size, f.name
    assert "clover_kernels/fp8/gemm.py" in sizes and "clover_lab/placement/plan.py" in sizes


def test_load_works_from_the_installed_wheel_outside_the_repository(wheel, tmp_path):
    site = tmp_path / "site"
    run(sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", site, wheel)
    code = ("import clover_lab, clover_lab.checkpoint.loading as L; "
            "assert clover_lab.__file__.startswith(%r), clover_lab.__file__; "
            "e = clover_lab.load(); print(L.default_model_dir()); "
            "print(len(e.generate('def f(x):', max_new_tokens=8).token_ids))") % str(site)
    # -S: no site-packages processing, so the checkout's editable install (a .pth finder) is not
    # seen; the dependencies come from this environment's site-packages, after the wheel's files
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])}
    out = run(sys.executable, "-S", "-c", code, cwd=tmp_path, env=env).split()
    assert out[0] == str(site / "clover_lab" / "assets" / MODEL.name) and out[1] == "8"
