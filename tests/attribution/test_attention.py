"""Attention patterns of the gated-attention layers and the GDN preview's history weights per
(block, step) (issue 51)."""
import pytest
import torch

from clover_lab import attribution
from clover_lab.errors import InputError

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]
KW = dict(max_new_tokens=24, threshold=0.5)


def test_patterns_give_back_what_the_forward_attended_with(tiny_engine):
    pats = attribution.attention_patterns(tiny_engine, PROMPT, **KW)
    assert {k[0] for k in pats} == {3}  # clover-tiny's one gated-attention layer
    assert {k[1] for k in pats} == {0, 1} and len(pats) >= 4  # both blocks, several steps each
    for (layer, block, step), p in pats.items():
        H, m, K = p.weights.shape
        assert H == 4 and m == len(p.queries) and K == len(p.keys) == p.queries[-1] + 1
        assert torch.allclose(p.weights.sum(-1), torch.ones(H, m), atol=1e-5)
        # weights x values through the output gate == the out projection's input the forward had
        assert torch.allclose(p.heads_out, p.recorded, atol=1e-5, rtol=1e-4)
    one = attribution.attention_patterns(tiny_engine, PROMPT, block=1, step=0, **KW)
    assert list(one) == [(3, 1, 0)] and torch.equal(one[(3, 1, 0)].weights, pats[(3, 1, 0)].weights)
    with pytest.raises(InputError, match="not gated-attention layers"):
        attribution.attention_patterns(tiny_engine, PROMPT, layers=[0], **KW)
    with pytest.raises(InputError, match="no preview"):
        attribution.attention_patterns(tiny_engine, PROMPT, mode="ar", max_new_tokens=2)


def test_history_weights_and_the_view(tiny_engine):
    pytest.importorskip("ipywidgets")
    hist = attribution.history_weights(tiny_engine, PROMPT, **KW)
    assert {k[0] for k in hist} == {0, 1, 2}  # the GDN layers
    positions, w = hist[(0, 0, 0)]
    assert positions == list(range(10, 26)) and w.shape == (16, 4)
    assert float(w.min()) >= 0 and float(w.max()) <= 1
    from clover_lab.widgets import AttentionView

    pats = attribution.attention_patterns(tiny_engine, PROMPT, block=0, **KW)
    view = AttentionView(pats, hist)
    assert len(view.frames) == len(pats) and view.frame_labels[0] == "block 0 · step 0"
    view.show_frame(1)
    assert "block 0, step 1" in view.caption.value
    z = view.hist.data[0].z
    assert len(z) == 3 * 4 and len(z[0]) == 16  # 3 GDN layers x 4 value heads, 16 block rows
    view.close()
