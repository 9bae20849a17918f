"""A feature clamped or ablated during chosen denoising steps (issue 51): on the rows the schedule
picks, the point's value becomes x + (value - a(x)) * d (the feature's activation set, the error
term kept), nowhere else; clamping a feature to the activation it has changes no token; ablating
from step k keeps every token unmasked before k; clamps are refused where they cannot apply."""
import pytest
import torch

from clover_lab import steering
from clover_lab.errors import InputError
from clover_lab.features import JumpReLUAutoencoder, TopKAutoencoder, Transcoder
from clover_lab.steering import Schedule, Steer

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]
KW = dict(max_new_tokens=16, threshold=0.3, max_tokens_per_step=3)
H = 64


def _sae(kind="topk", seed=0):
    g = torch.Generator().manual_seed(seed)
    sae = (TopKAutoencoder(H, 128, 8, hook_name="layers.2.output") if kind == "topk"
           else JumpReLUAutoencoder(H, 128, hook_name="layers.2.output"))
    with torch.no_grad():
        sae.W_enc.copy_(torch.randn(H, 128, generator=g) / H ** 0.5)
        sae.W_dec.copy_(torch.randn(128, H, generator=g) / H ** 0.5)
        sae.b_dec.copy_(torch.randn(H, generator=g) * 0.1)
    return sae.requires_grad_(False)


def _point_values(engine, steer=None):
    """layers.2.output's preview values by (block, step) as the next layer reads them."""
    hooks = steering.hooks(engine, steer) if steer is not None else {}
    with engine.hooks(hooks), engine.capture(["layers.3.input"]) as cap:
        result = engine.generate(PROMPT, **KW)
    return {(r.block, r.step): r["value"][0].float() for r in cap["layers.3.input"] if r["mode"] == "preview"}, result


@pytest.mark.parametrize("kind", ["topk", "jumprelu"])
def test_a_clamp_sets_the_feature_where_its_schedule_says(tiny_engine, kind):
    sae = _sae(kind)
    base, _ = _point_values(tiny_engine)
    x = base[(0, 1)]  # step 1: some positions unmasked, so the rows differ
    acts = sae.encode(x)
    fires = acts.gt(0).sum(0)
    f = int(torch.where(fires < len(x), fires, 0).argmax())  # fires on some rows, not all
    assert 0 < fires[f] < len(x)
    steer = steering.clamp(sae, f, 5.0, steps=1, blocks=0)
    assert steer.layers == (2,) and steer.kind == "output" and steer.name == f"feature {f} clamped to 5"
    steered, _ = _point_values(tiny_engine, steer)
    want = x + (5.0 - acts[:, f])[:, None] * sae.feature_direction(f)
    torch.testing.assert_close(steered[(0, 1)], want, rtol=1e-5, atol=1e-5)
    # ablation: the feature's share of the reconstruction removed, rows where it is off untouched
    steered, _ = _point_values(tiny_engine, steering.ablate(sae, f, steps=1, blocks=0))
    want = x - acts[:, f][:, None] * sae.feature_direction(f)
    torch.testing.assert_close(steered[(0, 1)], want, rtol=1e-5, atol=1e-5)
    off = acts[:, f] == 0
    torch.testing.assert_close(steered[(0, 1)][off], x[off])


def test_clamping_to_the_activation_it_has_changes_nothing_and_ablation_keeps_earlier_tokens(tiny_engine):
    sae = _sae()
    base = tiny_engine.generate(PROMPT, **KW)
    # a clamp that writes each row's own activation back: x' = x, every token as before
    class Same(steering.FeatureClamp):
        def apply(self, rows, value):
            return super().apply(rows, 0.0) + self.activation(rows.float())[..., None] * self.direction(rows)
    same = Steer(sae.feature_direction(3), 0.0, layers=2, clamp=Same(sae, 3))
    run = steering.steer(tiny_engine, PROMPT, same, **KW)
    assert run.result.token_ids == base.token_ids and run.applied
    # ablating the busiest features from step 2 on cannot change a token unmasked before step 2
    busiest = sae.encode(torch.randn(256, H)).gt(0).sum(0).topk(8).indices.tolist()
    plan = Schedule([steering.ablate(sae, f, steps="2:") for f in busiest])
    run = steering.steer(tiny_engine, PROMPT, plan, **KW)
    fx = steering.compare(base, run.result, from_step=2)
    assert fx.kept_before[0] == fx.kept_before[1] > 0
    assert {a.step for a in run.applied} and min(a.step for a in run.applied) == 2


def test_clamps_are_checked(tmp_path):
    sae = _sae()
    for call, match in [
        (lambda: steering.clamp(sae, 128, 1.0), "features 0..127"),
        (lambda: steering.clamp(sae, 1, float("nan")), "finite number"),
        (lambda: steering.clamp(sae, 1, 1.0, layers=1), "clamped there only"),
        (lambda: steering.clamp(sae, 1, 1.0, coefficient=2.0), "set by the clamp"),
        (lambda: steering.clamp(Transcoder(H, 32, H, hook_name="layers.1.output"), 1, 1.0), "transcoder"),
        (lambda: steering.clamp("sae", 1, 1.0), "expected a sparse autoencoder"),
        (lambda: Steer(torch.ones(H), 1.0, layers=1, clamp="yes"), "expected a FeatureClamp"),
    ]:
        with pytest.raises(InputError, match=match):
            call()
    plan = Schedule([steering.ablate(sae, 4, steps="1:")])
    assert "feature 4 ablated" in str(plan)
    with pytest.raises(InputError, match="clamps an autoencoder's feature"):
        plan.save(tmp_path / "plan")
    assert not (tmp_path / "plan").exists()
