"""A patching map's blank cells are explained on the plot (notebook 06's steps x layers map was
blank from step 2: the metric's position was unmasked by then, and a preview has logits only at
masked positions)."""
import numpy as np
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from clover_lab.widgets import PatchingView  # noqa: E402
from clover_lab.widgets.patching import BLANK_NOTE  # noqa: E402


def _sweep(values):
    return dict(values=values, rows=list(range(len(values))), cols=[0, 1], row_name="step", col_name="layer",
                clean=1.0, corrupt=0.0, metric="logit diff", title="t")


def test_blank_cells_are_said_on_the_plot():
    view = PatchingView(_sweep([[0.5, 1.0], [float("nan"), float("nan")]]), normalized=False)
    try:
        notes = [a.text for a in view.fig.layout.annotations]
        assert notes == [BLANK_NOTE] and "already unmasked" in BLANK_NOTE
        assert "2 blank cells" in view.caption.value
        assert list(view.fig.data[0].z[1]) == [None, None]  # JSON-safe blanks, no NaN sent to the browser
        view.show_sweep(_sweep([[0.5, 1.0], [0.25, 0.0]]))
        assert not view.fig.layout.annotations and "blank" not in view.caption.value
        assert np.isfinite(view.matrix()).all()
    finally:
        view.close()


def test_a_restored_share_has_a_sequential_scale_and_one_blank_note():
    # notebook 06: a 0-1 share drawn on a diverging red-blue scale, and the blank cells explained
    # twice (on the plot and again in the caption)
    view = PatchingView(_sweep([[0.5, 1.0], [float("nan"), 0.25]]))
    try:
        hm = view.fig.data[0]
        import plotly.graph_objects as go

        assert hm.colorscale == go.Heatmap(colorscale="Viridis").colorscale and hm.zmin == 0.0 and hm.zmax == 1.0 and hm.zmid is None
        assert view.caption.value.count("unmasked") == 0 and "1 blank cells (why: under the plot)" in view.caption.value
        view.show_sweep(_sweep([[1.5, -0.5], [0.0, 1.0]]))  # overshoots: the scale widens to show them
        assert (view.fig.data[0].zmin, view.fig.data[0].zmax) == (-0.5, 1.5)
        signed = PatchingView(_sweep([[0.5, -1.0], [0.0, 2.0]]), normalized=False)
        assert signed.fig.data[0].zmid == 0
        signed.close()
    finally:
        view.close()
