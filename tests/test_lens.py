"""The logit lens per denoising step and the routing lens (issue 17)."""
import pytest
import torch

from clover_lab import lens

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]
KW = dict(max_new_tokens=32, threshold=0.3)


def test_logit_lens_per_step_ends_in_the_models_own_decision(tiny_engine):
    steps = []
    with tiny_engine.hooks({"denoise.step": lambda ev: steps.append(ev)}):
        lz = lens.logit_lens(tiny_engine, PROMPT, k=3, **KW)
    r = lz.result
    assert r.token_ids == tiny_engine.generate(PROMPT, **KW).token_ids  # the lens changes nothing
    assert len(lz.steps) == r.stats.preview_forwards == len(steps)
    L = tiny_engine.model.config.num_hidden_layers
    for s, ev in zip(lz.steps, steps):
        assert (s.block, s.step, s.mode) == (ev.block, ev.step, "preview")
        start = len(PROMPT) + 16 * ev.block
        assert s.positions == [start + p for p in ev.masked]
        assert s.ids.shape == (L, len(ev.masked), 3) and s.probs.shape == s.ids.shape
        # the last layer's lens is the model's own distribution at this step
        assert s.ids[-1, :, 0].tolist() == ev.candidates.tolist()
        torch.testing.assert_close(s.probs[-1, :, 0], ev.logits.softmax(-1).max(-1).values)
        assert s.unmasked == [start + p for p in ev.unmask]
        assert (s.probs[:, :, :-1] >= s.probs[:, :, 1:]).all()
    decided = lz.decided()
    assert sorted(decided) == list(range(len(PROMPT), len(PROMPT) + 32))
    for p, (step, layer) in decided.items():
        assert 0 <= step < max(r.stats.steps_per_block) and 0 <= layer < L
        assert lz.at((p - len(PROMPT)) // 16, step).top(L - 1, p)[0][0] == \
            r.token_ids[p - len(PROMPT)]
    with pytest.raises(KeyError):
        lz.at(5, 0)


def test_logit_lens_of_an_ar_run(tiny_engine):
    lz = lens.logit_lens(tiny_engine, PROMPT, k=2, mode="ar", max_new_tokens=6)
    r = lz.result
    # the prefill reads the prompt's last row, each commit but the last its token's row
    assert [(s.block, s.step, s.mode) for s in lz.steps] == [(None, None, "commit")] + [(i, None, "commit")
                                                                                         for i in range(5)]
    assert [s.ids[-1, 0, 0].item() for s in lz.steps] == r.token_ids
    assert [s.positions for s in lz.steps] == [[len(PROMPT) - 1 + i] for i in range(6)]
    assert sorted(lz.decided()) == list(range(len(PROMPT), len(PROMPT) + 6))
    # a lens step's first layers need not agree with the last: decided_layer says from where they do
    s = lz.steps[0]
    layer = s.decided_layer()[0]
    assert all(s.ids[i, 0, 0] == s.ids[-1, 0, 0] for i in range(layer, s.ids.shape[0]))
    assert layer == 0 or s.ids[layer - 1, 0, 0] != s.ids[-1, 0, 0]
