"""FeatureView (issue 42): one frame per preview of the timeline; at each frame the chosen feature is
drawn up to the shown step only, circles mark the positions unmasked by then at their step, the
most active features are the step's, and the export holds all three figures."""
import math

import pytest
import torch

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from clover_lab import features  # noqa: E402
from clover_lab.features import TopKAutoencoder  # noqa: E402
from clover_lab.widgets import FeatureView  # noqa: E402

KW = dict(max_new_tokens=32, threshold=0.3, max_tokens_per_step=4)


def _exact(d_in=64) -> TopKAutoencoder:
    sae = TopKAutoencoder(d_in, 2 * d_in, 8, hook_name="layers.2.output")
    with torch.no_grad():
        sae.W_enc.copy_(torch.cat([torch.eye(d_in), -torch.eye(d_in)], 1))
        sae.W_dec.copy_(torch.cat([torch.eye(d_in), -torch.eye(d_in)], 0))
    return sae


def test_the_view_replays_a_block_denoising(view_engine, tmp_path):
    tl = features.timeline(view_engine, _exact(), [5, 17, 33, 100, 2, 9], **KW)
    top = [f for f, _ in tl.top(n=3)]
    view = FeatureView(tl, features=top)
    try:
        assert len(view.frames) == len(tl.frames)
        assert view.frame_labels[0] == "block 0 · step 0" and list(view.feature_dd.options)[0] == (f"feature {top[0]}", top[0])
        i = next(j for j, f in enumerate(tl.frames) if f.block == 1 and f.step == 1)
        view.show_frame(i)
        z = view.fig_feature.data[0].z
        assert all(v is not None for v in z[0]) and all(v is None for row in z[2:] for v in row)  # drawn up to step 1
        want = tl.activation(top[0], 1)[1].tolist()
        assert [float(v) for v in z[1]] == pytest.approx(want)
        unmasked = tl.unmask_steps(1)
        marks = list(zip(view.fig_feature.data[1].x, view.fig_feature.data[1].y))
        assert sorted(int(x.split(":")[0]) for x, _ in marks) == [p for p, s in enumerate(unmasked) if s <= 1]
        assert all(s <= 1 for _, s in marks)
        assert "block 1, step 1" in view.fig_top.layout.title.text
        masked_labels = [x for x in view.fig_top.data[0].x if x.endswith("·")]
        assert len(masked_labels) == len(tl.frames[i].masked)
        view.feature_dd.value = top[1]  # the dropdown redraws
        assert view.fig_feature.layout.title.text.startswith(f"feature {top[1]} over block 1")
        assert len(view.fig_rel.data) == 3 and "(shown)" in view.fig_rel.data[0].name
        assert not any(isinstance(v, float) and math.isnan(v) for row in view.fig_feature.data[0].z for v in row)
        out = view.export_html(tmp_path / "features.html", frame=None)
        text = out.read_text()
        assert text.count("plotly-graph-div") >= 3 and "against the unmasking step" in text
    finally:
        view.close()
    with pytest.raises(TypeError, match="FeatureTimeline"):
        FeatureView("not a timeline")
