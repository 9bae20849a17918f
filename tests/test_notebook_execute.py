"""notebooks/execute.py saves an executed notebook without what differs between two executions of
the same code (timestamps, widget model ids, execution-count gaps), and picks notebooks by name."""
import importlib.util
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("execute_notebooks", ROOT / "notebooks" / "execute.py")
execute = importlib.util.module_from_spec(spec)
spec.loader.exec_module(execute)


def test_volatile_metadata_is_stripped():
    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    view = nbformat.v4.new_output("display_data", data={
        "text/plain": "VBox(...)", "application/vnd.jupyter.widget-view+json": {"model_id": "4f1c", "version_major": 2}})
    nb.cells = [nbformat.v4.new_markdown_cell("# t"),
                nbformat.v4.new_code_cell("x", execution_count=7, outputs=[view]),
                nbformat.v4.new_code_cell("y", execution_count=9, outputs=[nbformat.v4.new_output(
                    "execute_result", data={"text/plain": "1"}, execution_count=9)])]
    for cell in nb.cells:
        cell.metadata["execution"] = {"iopub.execute_input": "2026-12-03T17:00:00.000Z"}
    out = execute.strip_volatile(nb)
    assert "widgets" not in out.metadata
    assert all("execution" not in c.metadata for c in out.cells)
    assert [c.execution_count for c in out.cells[1:]] == [1, 2] and out.cells[2].outputs[0]["execution_count"] == 2
    assert out.cells[1].outputs[0]["data"] == {"text/plain": "VBox(...)"}  # the random model id is gone
    nbformat.validate(out)


def test_notebooks_are_picked_by_the_start_of_their_name():
    assert [p.name for p in execute.notebooks(["04"])] == ["04_gdn_memory.ipynb"]
    assert len(execute.notebooks([])) == len(list((ROOT / "notebooks").glob("*.ipynb")))
    with pytest.raises(SystemExit, match="notebook 'zz'.*none"):
        execute.notebooks(["zz"])
    with pytest.raises(SystemExit, match="notebook '0'"):  # every notebook starts with 0: not one
        execute.notebooks(["0"])


def test_a_view_or_plotly_figure_becomes_its_picture():
    import base64

    view = nbformat.v4.new_output("display_data", data={
        "text/plain": "VBox(...)", "application/vnd.jupyter.widget-view+json": {"model_id": "4f1c", "version_major": 2}})
    figure = nbformat.v4.new_output("display_data", data={"application/vnd.plotly.v1+json": {"data": []},
                                                          "text/html": "<div></div>"})
    text = nbformat.v4.new_output("stream", name="stdout", text="12 tokens\n")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), nbformat.v4.new_code_cell("v", outputs=[text, view, figure])]
    out = execute.with_pictures(nb, {(1, 1): b"\x89PNG view", (1, 2): b"\x89PNG figure"})
    got = out.cells[1].outputs
    assert got[0] == text  # text stays as printed
    assert base64.b64decode(got[1]["data"]["image/png"]) == b"\x89PNG view" and got[1]["data"]["text/plain"] == "VBox(...)"
    assert set(got[2]["data"]) == {"image/png", "text/plain"}  # no plotly JSON or HTML left that a static page cannot draw
    nbformat.validate(out)
    nb.cells[1].outputs.append(nbformat.v4.new_output("display_data", data={
        "application/vnd.jupyter.widget-view+json": {"model_id": "77", "version_major": 2}}))
    with pytest.raises(ValueError, match="cell 1, output 3: a view or figure with no picture"):
        execute.with_pictures(nb, {})
