"""The documentation site builds strictly (mkdocs.yml: warnings are errors, internal links and
anchors checked, every page in the navigation), into a temporary folder, by the one command the
site's about page gives; and its benchmark tables come from bench/results (bench/result_tables.py)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_tables", REPO / "bench" / "result_tables.py")
tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tables)


def test_a_table_is_rendered_from_its_results_file():
    text = tables.render("coreset-default-cpu-20261203-030554.json")
    assert text.splitlines()[0] == "| coreset | tokens equal to no coreset | tokens per forward | ms per step |"
    assert "| none | 1.000 | 2.08 | 12.0 |" in text and "| 8 | 0.664 | 1.98 | 14.7 |" in text
    lengths = tables.render("serve-default-model-cpu-20261203-072555.json", "lengths")
    assert "| differing | 16, 32, 64, 80 | 116.9 (rounds 118.2, 116.9, 112.1) | 204-205 | 7.49 | 64 | 6.30 |" in lengths


@pytest.mark.parametrize("name,part,said", [
    ("nope-20261203.json", None, "no such results file"),
    ("../README.md", None, "name a results file"),
    ("memory-cpu-2026-11-30.json", None, "no renderer for it"),
    ("serve-default-model-cpu-20261203-072555.json", "nope", "no table part 'nope'"),
    ("coreset-default-cpu-20261203-030554.json", "coreset-default-cpu-20261130-171247.json", "sets no other results file"),
    ("sae-default-model-cpu-20261203-024652.json", "serve-default-model-cpu-20261203-072555.json", "sets no other"),
])
def test_a_table_that_does_not_exist_is_named(name, part, said):
    with pytest.raises(tables.TableError, match=said):
        tables.render(name, *[part] if part else [])


def test_side_by_side_results_are_columns():
    text = tables.render("sae-default-model-cpu-20261203-024652.json", "sae-default-model-cpu-20261202-065219.json")
    assert text.splitlines()[0] == "| figure | 2026-12-03 | 2026-12-02 |"
    assert "| **0.099** of 15,952 (masked rows 0.132, unmasked 0.098) | **0.074** of 16,160" in text
    assert "2.376 (**+0.077**)" in text  # the loss change at full precision (0.07747), not the rounded 0.0775


def test_every_results_file_is_listed():
    index = tables.index()
    for path in (REPO / "bench" / "results").glob("*.json"):
        assert f"`bench/results/{path.name}`" in index


@pytest.mark.slow  # a subprocess that renders every page, the notebooks and the API reference
def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="the docs extra is not installed: pip install -e '.[docs]'")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    if sys.prefix != sys.base_prefix:  # a venv over the system's packages: nbconvert's templates lie there
        env["JUPYTER_PATH"] = os.pathsep.join(filter(None, [env.get("JUPYTER_PATH"),
                                                          str(Path(sys.base_prefix) / "share" / "jupyter")]))
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "WARNING" not in out.stderr, out.stderr[-4000:]
    site = tmp_path / "site"
    pages = [p for p in site.rglob("index.html") if p.parent != site / "search"]
    assert len(pages) >= 10
    for notebook in (REPO / "notebooks").glob("*.ipynb"):  # each notebook a page
        assert (site / "notebooks" / notebook.stem / "index.html").is_file(), notebook.name
    assert (site / "assets" / "dashboard.png").is_file()
    engine_api = (site / "api" / "engine" / "index.html").read_text()
    assert "clover_lab.engine.engine.Engine" in engine_api and "clover_lab.engine.requests.Request" in engine_api
    batch = (site / "guides" / "generation" / "index.html").read_text()
    assert "{{ bench_table" not in batch and "<td>272.8</td>" in batch  # the eager batch table, from its JSON


def _site_hook():
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    spec = importlib.util.spec_from_file_location("site_hook", REPO / "docs" / "hooks" / "site.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def test_a_notebook_page_is_its_executed_copy_only_while_the_copy_is_current(tmp_path, monkeypatch):
    """CLOVER_LAB_EXECUTED_NOTEBOOKS=DIR: each notebook page is DIR's executed copy (outputs and
    pictures), and a copy whose cells are not the repository's, or a missing one, stops the build."""
    import json

    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import Files

    hook = _site_hook()
    config = MkDocsConfig()
    config.load_dict({"site_dir": str(tmp_path / "site"), "docs_dir": str(REPO / "docs")})
    for source in sorted((REPO / "notebooks").glob("*.ipynb")):
        nb = json.loads(source.read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["ran\n"]}]
        (tmp_path / source.name).write_text(json.dumps(nb))
    monkeypatch.setenv(hook.EXECUTED, str(tmp_path))
    files = hook.on_files(Files([]), config)
    pages = {f.src_uri: Path(f.abs_src_path) for f in files if f.src_uri.startswith("notebooks/")}
    assert len(pages) == len(list((REPO / "notebooks").glob("*.ipynb")))
    for uri, page in pages.items():  # what the page is rendered from: the executed copy's content
        assert page.read_text() == (tmp_path / Path(uri).name).read_text(), uri

    stale = json.loads((tmp_path / "04_gdn_memory.ipynb").read_text())
    stale["cells"][3]["source"] = "an older version of the cell"
    (tmp_path / "04_gdn_memory.ipynb").write_text(json.dumps(stale))
    with pytest.raises(PluginError, match=r"04_gdn_memory.ipynb is not notebooks/04_gdn_memory.ipynb as it is now \(cell 3"):
        hook.on_files(Files([]), config)
    (tmp_path / "04_gdn_memory.ipynb").unlink()
    with pytest.raises(PluginError, match="no executed copy of notebooks/04_gdn_memory.ipynb"):
        hook.on_files(Files([]), config)

    monkeypatch.delenv(hook.EXECUTED)  # without it: the repository's notebooks
    files = hook.on_files(Files([]), config)
    assert all(Path(f.abs_src_path).parent == REPO / "notebooks" for f in files if f.src_uri.startswith("notebooks/"))
    staged = [p.parent.parent for p in pages.values()]
    hook.on_shutdown()  # a build's end removes its staged copies
    assert not any(p.exists() for p in staged)
