"""A patching map names its positions by their tokens (notebook 06 showed bare numbers where a
reader needs to know which token a column is), each label kept apart from an equal one."""
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from clover_lab.widgets import PatchingView  # noqa: E402


def _sweep():
    return dict(values=[[0.5, 1.0, 0.0]], rows=[0], cols=[0, 1, 2], row_name="layer", col_name="position",
                clean=1.0, corrupt=0.0, metric="logit diff", title="t")


def test_columns_show_their_labels_and_stay_apart():
    view = PatchingView(_sweep(), col_labels=["'import'", "'\\n'", "'\\n'"])
    try:
        assert list(view.fig.data[0].x) == ["0 'import'", "1 '\\n'", "2 '\\n'"]  # two newlines, two columns
    finally:
        view.close()
    plain = PatchingView(_sweep())
    try:
        assert list(plain.fig.data[0].x) == ["0", "1", "2"]
    finally:
        plain.close()


def test_a_label_per_column_or_an_error():
    with pytest.raises(ValueError, match="2 labels for the sweep's 3 columns"):
        PatchingView(_sweep(), col_labels=["a", "b"])
