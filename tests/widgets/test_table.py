"""Table: a notebook's results as a table (HTML in a notebook, aligned text in a print), not dicts."""
import pytest


def test_a_table_shows_rows_as_html_and_as_aligned_text():
    # the notebooks' results as tables, not printed dicts (issue 55)
    from clover_lab.widgets.pieces import Table

    t = Table([{"layer": 0, "share": 0.93871, "experts": [3, 7], "first": None},
               {"layer": 12, "share": 1.0, "experts": [1, 2], "first": 4}], digits=2, title="t")
    assert repr(t).splitlines() == ["t", "layer  share  experts  first", "    0   0.94      3 7      –",
                                    "   12      1      1 2      4"]
    html = t._repr_html_()
    assert html.count("<tr>") == 3 and "<caption" in html and "0.94" in html
    with pytest.raises(ValueError, match="row 1 has the columns"):
        Table([{"a": 1}, {"b": 2}])
    with pytest.raises(ValueError, match="no rows"):
        Table([])
