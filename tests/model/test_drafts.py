"""A committed draft kept at its accepted length (issue 30): the cache then equals a plain commit
of the kept prefix, on a random transformers-equal model and on the embedded model, in fp32."""
import pytest
import torch

from clover_lab.model.cache import AttentionCache
from clover_lab.model.drafts import DraftError

pytestmark = pytest.mark.usefixtures("gen_one_thread")


def assert_caches_equal(got, want, tol=1e-5):
    assert got.length == want.length
    for i, (a, b) in enumerate(zip(got.layers.values(), want.layers.values())):
        if isinstance(a, AttentionCache):
            n = want.length
            pairs = [(a.k[:, :, :n], b.k[:, :, :n]), (a.v[:, :, :n], b.v[:, :, :n])]
        else:
            pairs = [(a.ring, b.ring), (a.state, b.state)]
        for x, y in pairs:
            assert (x - y).abs().max().item() <= tol, f"layer {i}"


def check_keep(model, prompt, draft, keep, then):
    """Draft-commit ``draft`` after ``prompt``, keep ``keep`` rows, commit ``then``: the cache and
    the logits equal committing prompt + draft[:keep] + then plainly."""
    V = model.config.vocab_size
    got = model.new_cache(128)
    model.commit(got, prompt, logits=None)
    d = model.commit_draft(got, draft)
    assert d.logits.shape == (1, draft.shape[1], V)
    want = model.new_cache(128)
    model.commit(want, prompt, logits=None)
    if keep:
        plain = model.commit(want, draft[:, :keep], logits="all")
        assert (d.logits[:, :keep] - plain).abs().max().item() <= 1e-4  # the draft's rows are causal
    d.keep(keep)
    assert_caches_equal(got, want)
    a = model.commit(got, then, logits="all")
    b = model.commit(want, then, logits="all")
    assert (a - b).abs().max().item() <= 1e-4


@pytest.mark.parametrize("keep", [0, 1, 3, 31, 32])
def test_kept_draft_equals_a_plain_commit_transformers_model(clover_ref, keep):
    g = torch.Generator().manual_seed(keep)
    ids = torch.randint(0, 512, (1, 60), generator=g)
    check_keep(clover_ref, ids[:, :20], ids[:, 20:52], keep, ids[:, 52:])


def test_kept_draft_equals_a_plain_commit_default_model():
    import clover_lab

    engine = clover_lab.load(dtype=torch.float32)
    model, tok = engine.model, engine.tokenizer
    text = "def parse(line):\n    return line.split(',')\n\n\nclass Stack:\n    def push(self, item):\n"
    ids = torch.tensor([tok.encode(text * 2)])
    assert ids.shape[1] > 30
    for keep in (2, 7):
        check_keep(model, ids[:, :8], ids[:, 8:8 + 16], keep, ids[:, 8 + 16:])


def test_rows_keep_their_own_lengths(clover_ref):
    """A batch of rows at different lengths, each keeping its own prefix: each row equals its
    plain commit alone."""
    model = clover_ref
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=g) for n in (5, 9, 7)]
    draft = torch.randint(0, 512, (3, 16), generator=g)
    keep = [4, 16, 0]
    cache = model.new_cache(64, 3)
    for r, p in enumerate(prompts):
        model.prefill(cache.row(r), p, logits=None)
    cache.set_row_lengths([len(p) for p in prompts])
    model.commit_draft(cache, draft).keep(keep)
    assert cache.row_lengths == [9, 25, 7]
    for r, p in enumerate(prompts):
        want = model.new_cache(64)
        model.commit(want, torch.cat([p, draft[r, :keep[r]]])[None], logits=None)
        one = cache.select([r])
        one.length, one.row_lengths = one.row_lengths[0], None
        assert_caches_equal(one, want)


def test_keep_refuses_bad_lengths(clover_ref):
    cache = clover_ref.new_cache(64)
    clover_ref.commit(cache, torch.arange(5)[None], logits=None)
    d = clover_ref.commit_draft(cache, torch.arange(8)[None])
    for bad in (9, -1, [1, 2], 2.0, True):
        with pytest.raises(DraftError, match="keep"):
            d.keep(bad)
    d.keep(3)
    assert cache.length == 8
    with pytest.raises(DraftError, match="already kept"):
        d.keep(3)
