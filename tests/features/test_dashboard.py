"""A feature's dashboard over a corpus (issue 51), on the tiny model's generations: its density,
histogram, per-step profile and top contexts are those of the feature's activations on the
collected rows (each context at the coordinates of its row, one per generated position), and its
logit effect is the decoder row times the unembedding with the final norm's gain folded in."""
import pytest
import torch

from clover_lab import features
from clover_lab.errors import InputError
from clover_lab.features import TopKAutoencoder

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPTS = [[5, 17, 33, 100, 2, 9], [400, 3, 250, 7]]
KW = dict(max_new_tokens=16, threshold=0.3, max_tokens_per_step=4)


def _sae(d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    sae = TopKAutoencoder(d, 128, 6, hook_name="layers.2.output")
    with torch.no_grad():
        sae.W_enc.copy_(torch.randn(d, 128, generator=g) / d ** 0.5)
        sae.W_dec.copy_(torch.randn(128, d, generator=g) / d ** 0.5)
    return sae.requires_grad_(False)


@pytest.fixture(scope="module")
def corpus(gen_model, gen_tokenizer):
    from clover_lab import Engine

    engine = Engine(gen_model, gen_tokenizer)
    return engine, features.collect(engine, PROMPTS, layer=2, **KW)


def test_the_dashboard_reads_the_features_activations_over_the_corpus(corpus):
    engine, acts = corpus
    sae = _sae()
    a = sae.encode(acts.values)
    f = int(a.gt(0).sum(0).argmax())
    d = features.dashboard(acts, sae, f, engine=engine, top=5, bins=10, window=4)
    col = a[:, f]
    assert d.rows == len(acts) and d.fires == int(col.gt(0).sum()) and 0 < d.fires < len(acts)
    assert d.density == pytest.approx(d.fires / len(acts))
    assert d.density_masked == pytest.approx(float(col[acts.masked].gt(0).float().mean()))
    assert d.density_unmasked == pytest.approx(float(col[~acts.masked].gt(0).float().mean()))
    assert sum(d.histogram[0]) == d.fires and len(d.histogram[1]) == 11
    assert d.max_activation == pytest.approx(float(col.max()))
    for s, (mean, dens, n) in d.by_step.items():
        sel = acts.step == s
        assert n == int(sel.sum()) and mean == pytest.approx(float(col[sel].mean()))
    # top contexts: the strongest rows, one per generated position, at their own coordinates
    assert d.top[0].activation == pytest.approx(float(col.max()))
    assert [c.activation for c in d.top] == sorted((c.activation for c in d.top), reverse=True)
    assert len({(c.prompt, c.block, c.position) for c in d.top}) == len(d.top) == 5
    for c in d.top:
        row = ((acts.prompt == c.prompt) & (acts.block == c.block) & (acts.step == c.step)
               & (acts.position == c.position)).nonzero()[0, 0]
        assert float(col[row]) == pytest.approx(c.activation)
        assert (c.masked, c.unmask_step, c.token) == (bool(acts.masked[row]), int(acts.unmask_step[row]),
                                                      int(acts.token[row]))
        same_position = ((acts.prompt == c.prompt) & (acts.block == c.block) & (acts.position == c.position))
        assert c.activation == pytest.approx(float(col[same_position].max()))  # its strongest step
        if c.token >= 0:
            assert c.piece == engine.tokenizer.decode([c.token])
            assert c.before.split()[-1:] == engine.tokenizer.decode(
                (acts.results[c.prompt].prompt_ids + acts.results[c.prompt].token_ids)[:len(
                    acts.results[c.prompt].prompt_ids) + c.block * 16 + c.position]).split()[-1:]
    # logit effect: decoder row x (1 + final norm weight) x unembedding, the mask token left out
    m = engine.model
    with torch.no_grad():
        effect = m.lm_head.weight.float() @ (sae.W_dec[f] * (1 + m.model.norm.weight.float()))
    effect[engine.mask_token_id] = float("-inf")
    want = effect.topk(10)
    assert [t for t, _, _ in d.logit_top] == want.indices.tolist()
    assert [v for _, _, v in d.logit_top] == pytest.approx(want.values.tolist(), rel=1e-5)
    assert d.logit_bottom[0][2] == pytest.approx(float(effect[effect > float("-inf")].min()), rel=1e-5)
    assert engine.mask_token_id not in [t for t, _, _ in d.logit_bottom]
    assert "fires on" in d.summary()


def test_a_dashboard_refuses_what_it_cannot_read(corpus):
    engine, acts = corpus
    sae = _sae()
    for call, match in [(lambda: features.dashboard("acts", sae, 1), "expected Activations"),
                        (lambda: features.dashboard(acts, "sae", 1), "expected a sparse autoencoder"),
                        (lambda: features.dashboard(acts, sae, 128), "features 0..127"),
                        (lambda: features.dashboard(acts, sae, 1, top=0), "top=0"),
                        (lambda: features.dashboard(acts, _sae(32), 1), "32")]:
        with pytest.raises(InputError, match=match):
            call()


@pytest.mark.slow  # about 4 s: the widgets, plotly and an export with plotly.js inline
def test_the_view_draws_the_dashboard(corpus, tmp_path, gen_one_thread):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    from clover_lab.widgets import FeatureDashboardView

    engine, acts = corpus
    sae = _sae()
    fires = sae.encode(acts.values).gt(0).sum(0)
    picks = fires.topk(2).indices.tolist()
    dashes = [features.dashboard(acts, sae, f, engine=engine, top=4) for f in picks]
    view = FeatureDashboardView(dashes)
    try:
        assert list(view.feature_dd.options) == [(f"feature {picks[0]}", 0), (f"feature {picks[1]}", 1)]
        assert f"feature {picks[0]}" in view.head.value
        assert list(view.fig_hist.data[0].y) == dashes[0].histogram[0]
        steps = sorted(dashes[0].by_step)
        assert list(view.fig_step.data[0].x) == steps
        assert list(view.fig_step.data[1].y) == pytest.approx([dashes[0].by_step[s][1] for s in steps])
        assert list(view.fig_logits.data[0].x)[::-1] == pytest.approx([v for _, _, v in dashes[0].logit_top])
        assert view.contexts.value.count("<tr>") == 1 + len(dashes[0].top)
        view.feature_dd.value = 1  # the dropdown redraws with the second feature
        assert f"feature {picks[1]}" in view.head.value
        assert list(view.fig_hist.data[0].y) == dashes[1].histogram[0]
        out = view.export_html(tmp_path / "dash.html")
        text = out.read_text()
        assert "top activating contexts" in text and "logit effect" in text
    finally:
        view.close()
