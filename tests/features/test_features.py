"""Autoencoders on the denoising axis (issue 42), on the tiny random model: rows collected from
generations carry their coordinates, a tiny autoencoder trains to a low FVU, the evaluation's
teacher-forced runs reproduce the clean one (an exact autoencoder changes no loss), the timeline
holds every preview, and the search finds a feature tied to the unmasking order."""
import pytest
import torch

from clover_lab import features
from clover_lab.errors import InputError
from clover_lab.features import Activations, TopKAutoencoder
from clover_lab.hooks import points as P

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPTS = [[5, 17, 33, 100, 2, 9], [400, 3, 250, 7], [9, 77, 301, 12, 64, 8, 1]]
KW = dict(max_new_tokens=32, threshold=0.3, max_tokens_per_step=4)


def test_collect_keeps_every_preview_row_with_its_coordinates(tiny_engine):
    with tiny_engine.capture([P.DENOISE_STEP, "layers.1.output"]) as cap:
        acts = features.collect(tiny_engine, PROMPTS, layer=1, batch_size=2, **KW)
    previews = sum(r.stats.preview_forwards for r in acts.results)  # fused forwards included
    assert len(acts) == previews * 16 and acts.values.shape == (len(acts), 64)
    assert acts.point == "layers.1.output" and acts.values.dtype == torch.float32
    # masked: as the step events say; unmask_step and token: as the results say
    for rec in cap[P.DENOISE_STEP]:
        run_offset = 0 if rec.run == cap.runs[0] else 2  # two batches: prompts 0-1, then 2
        r = run_offset + (rec.row or 0)
        rows = (acts.prompt == r) & (acts.block == rec.block) & (acts.step == rec.step)
        assert set(acts.position[rows & acts.masked].tolist()) == set(rec["masked"])
    for i, result in enumerate(acts.results):
        rows = acts.prompt == i
        t = acts.block[rows] * 16 + acts.position[rows]
        inside = t < len(result.token_ids)
        assert acts.token[rows][inside].tolist() == [result.token_ids[j] for j in t[inside].tolist()]
        assert acts.unmask_step[rows][inside].tolist() == [result.unmask_steps[j] for j in t[inside].tolist()]
        assert (acts.unmask_step[rows][~inside] == -1).all()
    # a row masked at its step was unmasked at that step or later
    masked = acts.masked & (acts.unmask_step >= 0)
    assert (acts.unmask_step[masked] >= acts.step[masked]).all()
    assert (acts.unmask_step[~acts.masked & (acts.unmask_step >= 0)] < acts.step[~acts.masked & (acts.unmask_step >= 0)]).all()
    # the same rows one prompt at a time (float32: a batch's rows equal the prompts alone)
    alone = features.collect(tiny_engine, PROMPTS[:1], layer=1, **KW)
    torch.testing.assert_close(alone.values, acts.values[acts.prompt == 0])
    sub = acts[acts.masked]
    assert isinstance(sub, Activations) and len(sub) == int(acts.masked.sum()) and "masked" in repr(acts)


def test_collect_refuses_what_it_cannot_read(tiny_engine):
    for kwargs, match in [(dict(prompts=[], layer=1), "non-empty"), (dict(prompts=[1, 2, 3], layer=1), "one prompt"),
                          (dict(prompts=PROMPTS, layer=9), "layers 0..3"),
                          (dict(prompts=PROMPTS, layer=3, kind="gdn.output"), "full_attention"),
                          (dict(prompts=PROMPTS, layer=1, mode="ar"), "mode must be 'diffusion'"),
                          (dict(prompts=PROMPTS, layer=1, batch_size=0), "batch_size")]:
        with pytest.raises(InputError, match=match):
            features.collect(tiny_engine, **kwargs)


def _sparse_data(n, d_in=16, atoms=48, active=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    dictionary = torch.randn(atoms, d_in, generator=g)
    dictionary /= dictionary.norm(dim=-1, keepdim=True)
    codes = torch.zeros(n, atoms)
    idx = torch.stack([torch.randperm(atoms, generator=g)[:active] for _ in range(n)])
    codes.scatter_(1, idx, torch.rand(n, active, generator=g) * 4 + 1)
    return codes @ dictionary * 7 + 3  # off-centre and scaled: the trainer's scale and b_dec handle it


def test_training_reaches_a_low_fvu_on_held_out_rows():
    data = _sparse_data(5000)
    x, held = data[:4000], data[4000:]
    sae = features.train(x, d_sae=96, k=6, steps=150, batch_size=256, lr=1e-2, seed=1)
    assert sae.fvu(held) < 0.2 and sae.log.curve[0][1] > 1.0  # from nothing explained to most
    assert sae.log.steps == 150 and sae.log.rows_seen == 150 * 256 and sae.log.curve[-1][1] < 0.2
    assert torch.allclose(sae.W_dec.norm(dim=-1), torch.ones(96), atol=1e-4)  # unit decoder rows (scale folded out)
    assert not sae.W_enc.requires_grad and sae.metadata["clover_lab"]["steps"] == 150
    timed = features.train(x, d_sae=32, k=4, seconds=0.5, batch_size=256)
    assert 0 < timed.log.steps and timed.log.seconds < 5
    for kwargs, match in [(dict(k=0), "k=0"), (dict(k=40, d_sae=32), "k=40 is more than d_sae=32"),
                          (dict(seconds=-1), "seconds"), (dict(lr=0), "lr"), (dict(steps=0), "steps"),
                          (dict(every=0), "every=0"), (dict(seconds=float("inf")), "seconds=inf"),
                          (dict(lr=float("inf")), "lr=inf"), (dict(aux_coef=float("nan")), "aux_coef")]:
        with pytest.raises(InputError, match=match):
            features.train(x, **kwargs)
    with pytest.raises(InputError, match="an empty capture"):
        features.train(torch.zeros(0, 16))
    with pytest.raises(InputError, match="NaN"):
        features.train(torch.full((10, 16), float("nan")))
    with pytest.raises(InputError, match=r"\[rows, hidden\]"):
        features.train(torch.zeros(10, 16, dtype=torch.long))


def _exact(d_in=64) -> TopKAutoencoder:
    """Features +x_i and -x_i: exactly one of each pair is positive, the top d_in: x_hat == x."""
    sae = TopKAutoencoder(d_in, 2 * d_in, d_in, hook_name="layers.2.output")
    with torch.no_grad():
        sae.W_enc.copy_(torch.cat([torch.eye(d_in), -torch.eye(d_in)], 1))
        sae.W_dec.copy_(torch.cat([torch.eye(d_in), -torch.eye(d_in)], 0))
    return sae


def test_evaluate_measures_fvu_and_the_masked_token_loss(tiny_engine):
    exact, held = features.evaluate(tiny_engine, _exact(), PROMPTS, batch_size=2, **KW)
    assert exact.fvu == 0.0 and exact.fvu_masked == 0.0
    assert exact.spliced_loss == pytest.approx(exact.clean_loss, abs=1e-5) and abs(exact.delta) < 1e-5
    assert exact.ablated_loss > exact.clean_loss + 0.1 and exact.recovered == pytest.approx(1.0, abs=1e-4)
    assert exact.positions > 0 and exact.rows == len(held) and exact.prompts == 3
    # the clean loss is the clean run's: -log p(final token) at each step's masked positions
    total, n = 0.0, 0
    with tiny_engine.capture([P.DENOISE_STEP]) as cap:
        seen = []
        with tiny_engine.hooks({P.DENOISE_STEP: lambda ev: seen.append(ev.logits.float().log_softmax(-1))}):
            result = tiny_engine.generate(PROMPTS[0], **KW)
    for rec, logp in zip(cap[P.DENOISE_STEP], seen):
        for i, p in enumerate(rec["masked"]):
            t = rec.block * 16 + p
            if t < len(result.token_ids):
                total -= float(logp[i, result.token_ids[t]])
                n += 1
    alone, _ = features.evaluate(tiny_engine, _exact(), PROMPTS[:1], **KW)
    assert alone.clean_loss == pytest.approx(total / n, rel=1e-5) and alone.positions == n
    # a poor autoencoder: a higher loss and FVU, between clean and ablated
    poor = features.train(held, d_sae=32, k=2, steps=30, batch_size=256)
    report, _ = features.evaluate(tiny_engine, poor, PROMPTS, batch_size=2, **KW)
    assert report.fvu > 0.05 and report.spliced_loss > report.clean_loss
    assert "held-out generations" in str(report) and report.to_dict()["delta"] == report.delta
    bad = _exact()
    bad.hook_name = "blocks.2.hook_resid_post"
    with pytest.raises(InputError, match="not a clover_lab residual point"):
        features.evaluate(tiny_engine, bad, PROMPTS, **KW)
    with pytest.raises(InputError, match="32-wide rows; the model.s stream is 64 wide"):
        features.evaluate(tiny_engine, TopKAutoencoder(32, 64, 4, hook_name="layers.2.output"), PROMPTS, **KW)


def test_the_timeline_follows_every_preview(tiny_engine):
    sae = _exact()
    tl = features.timeline(tiny_engine, sae, PROMPTS[0], **KW)
    r = tl.result
    assert len(tl.frames) == r.stats.preview_forwards
    assert [(f.block, f.step) for f in tl.frames] == [(b, s) for b, n in enumerate(r.stats.steps_per_block)
                                                      for s in range(n)]
    block = tl.frames_of(1)
    assert block[0].masked == list(range(16)) and sum(len(f.unmasked) for f in block) == 16
    # activation: feature i is x_i where positive (the exact autoencoder)
    with tiny_engine.capture(["layers.2.output"]) as cap:
        tiny_engine.generate(PROMPTS[0], **KW)
    rows = [rec["value"][0] for rec in cap["layers.2.output"] if rec["mode"] == "preview" and rec.block == 1]
    want = torch.stack([x[:, 5].clamp_min(0) for x in rows])
    torch.testing.assert_close(tl.activation(5, 1), want)
    torch.testing.assert_close(tl.dense(1, 0)[:, 5], want[0])
    assert len(tl.top(block=1, step=0, n=4)) == 4 and tl.unmask_steps(1) == r.unmask_steps[16:32]
    rel = tl.relative(5)
    assert 0 in rel and all(abs(o) <= 8 for o in rel)
    for call, match in [(lambda: tl.activation(999, 1), "features 0..127"), (lambda: tl.frames_of(9), "blocks"),
                        (lambda: tl.dense(0, 99), "no step 99"),
                        (lambda: features.timeline(tiny_engine, sae, PROMPTS, **KW), "batch"),
                        (lambda: features.timeline(tiny_engine, sae, PROMPTS[0], mode="ar"), "diffusion")]:
        with pytest.raises(InputError, match=match):
            call()


def test_the_search_finds_features_tied_to_the_unmasking_order():
    """Rows whose feature 0 grows with the step that will unmask them and feature 1 shrinks."""
    g = torch.Generator().manual_seed(0)
    n = 600
    unmask = torch.randint(0, 8, (n,), generator=g)
    values = torch.randn(n, 4, generator=g) * 0.1
    values[:, 0] += unmask.float()
    values[:, 1] += 8 - unmask.float()
    ones = torch.ones(n, dtype=torch.long)
    acts = Activations(values, torch.arange(n), 0 * ones, 0 * ones, ones, torch.ones(n, dtype=torch.bool), unmask,
                       ones, point="layers.0.output")
    sae = TopKAutoencoder(4, 8, 2, hook_name="layers.0.output")
    with torch.no_grad():
        sae.W_enc.copy_(torch.cat([torch.eye(4), -torch.eye(4)], 1))
        sae.W_dec.copy_(torch.cat([torch.eye(4), -torch.eye(4)], 0))
    order = features.unmasking_order(acts, sae, min_fires=5)
    assert order.late(1)[0].feature == 0 and order.late(1)[0].correlation > 0.95
    assert order.early(1)[0].feature == 1 and order.early(1)[0].correlation < -0.95
    assert order.late(1)[0].mean_when_firing > order.mean and order.rows == n
    with pytest.raises(InputError, match="at step 3"):
        features.unmasking_order(acts, sae, at_step=3)
    with pytest.raises(InputError, match="Activations"):
        features.unmasking_order(values, sae)


def test_a_timeline_from_a_capture_or_a_saved_trace(tiny_engine, tmp_path):
    import clover_lab

    sae = _exact()
    live = features.timeline(tiny_engine, sae, PROMPTS[0], **KW)
    with tiny_engine.capture(["layers.2.output", P.DENOISE_STEP, P.BLOCK_COMMIT]) as cap:
        result = tiny_engine.generate(PROMPTS[0], **KW)
    cap.save(tmp_path / "trace")
    for records in (cap, clover_lab.load_trace(tmp_path / "trace")):
        tl = features.timeline_of(records, sae)
        assert [(f.block, f.step, f.masked, f.unmasked) for f in tl.frames] == \
            [(f.block, f.step, f.masked, f.unmasked) for f in live.frames]
        assert all(torch.equal(a.indices, b.indices) for a, b in zip(tl.frames, live.frames))
        for b in live.blocks:
            assert tl.tokens(b) == live.tokens(b) and tl.unmask_steps(b) == live.unmask_steps(b)
        assert [t for b in tl.blocks for t in tl.tokens(b) if t is not None] == result.token_ids
    with tiny_engine.capture(["layers.2.output", P.DENOISE_STEP]) as two:
        tiny_engine.generate(PROMPTS[0], **KW)
        tiny_engine.generate(PROMPTS[1], **KW)
    assert features.timeline_of(two, sae, run=two.runs[1]).frames
    for call, match in [(lambda: features.timeline_of(two, sae), "2 generations"),
                        (lambda: features.timeline_of(two, sae, run=999), "no run 999"),
                        (lambda: features.timeline_of(cap.records, sae), "Capture or a Trace")]:
        with pytest.raises(InputError, match=match):
            call()
    with tiny_engine.capture([P.DENOISE_STEP]) as steps_only:
        tiny_engine.generate(PROMPTS[0], **KW)
    with pytest.raises(InputError, match="no layers.2.output"):
        features.timeline_of(steps_only, sae)
