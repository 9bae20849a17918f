"""The trunk's SAE formats (issue 51): Qwen-Scope's ``layer{n}.sae.pt`` (TopK, W_enc stored
[d_sae, d_model], no ReLU) and SAELens' JumpReLU autoencoders and transcoders (plain, JumpReLU,
skip). Each file written here in its format loads back to the same tensors and computes what its
source's formula says, on rows of the residual stream at every denoising step of real
generations; damaged files are refused naming the file and the key."""
import json

import pytest
import torch

from clover_lab import features
from clover_lab.errors import InputError
from clover_lab.features import (AutoencoderFileError, JumpReLUAutoencoder, TopKAutoencoder, Transcoder,
                                 load_qwen_scope, save_qwen_scope)

pytestmark = pytest.mark.usefixtures("gen_one_thread")
KW = dict(max_new_tokens=16, threshold=0.3, max_tokens_per_step=4)
D, F = 64, 96  # the tiny model's residual width; features


@pytest.fixture(scope="module")
def rows(gen_model):
    """Preview rows of layers.2.output over every denoising step of two generations."""
    from clover_lab import Engine

    acts = features.collect(Engine(gen_model), [[5, 17, 33, 100, 2, 9], [400, 3, 250, 7]], layer=2, **KW)
    assert len(set(acts.step.tolist())) > 2  # several steps per block
    return acts


def _random(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _qwen_scope_file(path, seed=0, d=D, f=F, **changes):
    state = {"W_enc": _random(f, d, seed=seed) / d ** 0.5, "b_enc": _random(f, seed=seed + 1) * 0.1,
             "W_dec": _random(d, f, seed=seed + 2), "b_dec": _random(d, seed=seed + 3)}
    state.update(changes)
    state = {k: v for k, v in state.items() if v is not None}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, str(path))
    return state


def test_qwen_scope_files_load_compute_their_cards_formula_and_round_trip(tmp_path, rows):
    path = tmp_path / "SAE-Res-Clover-Tiny-W96-L0_5" / "layer2.sae.pt"
    state = _qwen_scope_file(path, b_enc=_random(F, seed=1) - 40.0)  # biased low: kept values below zero
    sae = features.load(path)  # K from the release's folder name, the layer from the file's
    assert isinstance(sae, TopKAutoencoder) and sae.k == 5 and not sae.relu and not sae.apply_b_dec_to_input
    assert sae.hook_name == "layers.2.output" and (sae.d_in, sae.d_sae) == (D, F)
    x = rows.values
    # the card's encoder: pre_acts = residual @ W_enc.T + b_enc; topk kept as it is (negative values too)
    pre = x @ state["W_enc"].T + state["b_enc"]
    vals, idx = pre.topk(5, dim=-1)
    want = torch.zeros_like(pre).scatter_(-1, idx, vals)
    torch.testing.assert_close(sae.encode(x), want)
    assert bool((vals < 0).any())  # no ReLU: a kept pre-activation may be negative, and stays so
    torch.testing.assert_close(sae(x), want @ state["W_dec"].T + state["b_dec"])
    # ours, written in their format, reads back to the same tensors
    out = save_qwen_scope(sae, tmp_path / "ours" / "layer2.sae.pt")
    back = torch.load(str(out), weights_only=True)
    assert sorted(back) == ["W_dec", "W_enc", "b_dec", "b_enc"]
    for k in back:
        assert torch.equal(back[k], state[k]), k
    again = load_qwen_scope(out, k=5)
    torch.testing.assert_close(again(x), sae(x))


def test_a_qwen_scope_sae_follows_every_denoising_step(tmp_path, tiny_engine):
    path = tmp_path / "layer1.sae.pt"
    _qwen_scope_file(path, seed=4)
    sae = load_qwen_scope(path, k=3)
    with tiny_engine.capture(["layers.1.output"]) as cap:
        tl = features.timeline(tiny_engine, sae, [5, 17, 33, 100], **KW)
    previews = [r for r in cap["layers.1.output"] if r["mode"] == "preview"]
    assert len(tl.frames) == len(previews) and len(tl.frames) > 3
    for frame, rec in zip(tl.frames, previews):
        assert (frame.block, frame.step) == (rec.block, rec.step)
        vals, idx = sae.pre(rec["value"][0, :16]).topk(3, dim=-1)
        torch.testing.assert_close(frame.values, vals)
        assert torch.equal(frame.indices, idx)


def test_saelens_jumprelu_loads_and_computes_its_formula(tmp_path, rows):
    sae = JumpReLUAutoencoder(D, F, hook_name="layers.2.output", model_name="clover-tiny")
    with torch.no_grad():
        for name, p in sae.named_parameters():
            p.copy_(_random(*p.shape, seed=len(name)) / (D ** 0.5 if name == "W_enc" else 1))
        sae.threshold.copy_(_random(F, seed=9).abs() * 0.5)
    sae.save(tmp_path / "jr")
    cfg = json.loads((tmp_path / "jr" / "cfg.json").read_text())
    assert cfg["architecture"] == "jumprelu" and cfg["metadata"]["hook_name"] == "layers.2.output"
    back = features.load(tmp_path / "jr")
    assert isinstance(back, JumpReLUAutoencoder)
    for name, p in sae.named_parameters():
        assert torch.equal(getattr(back, name), p.detach()), name
    x = rows.values
    pre = (x - sae.b_dec) @ sae.W_enc + sae.b_enc  # SAELens' JumpReLUSAE.encode
    want = pre.relu() * (pre > sae.threshold)
    got = back.encode(x)
    torch.testing.assert_close(got, want.detach())
    active = (got != 0).sum(-1)
    assert active.min() < active.max()  # the threshold, not a fixed K, decides how many
    torch.testing.assert_close(back(x), (want @ sae.W_dec + sae.b_dec).detach())
    vals, idx = back.encode_topk(x)  # as many columns as the busiest row
    assert vals.shape[-1] == int(active.max())
    torch.testing.assert_close(torch.zeros_like(got).scatter_(-1, idx, vals), got)
    assert back.fvu(x) > 0


@pytest.mark.parametrize("architecture", ["transcoder", "jumprelu_transcoder", "skip_transcoder"])
def test_saelens_transcoders_load_and_compute_their_formula(tmp_path, rows, architecture):
    tc = Transcoder(D, F, 48, architecture=architecture, hook_name="layers.2.output",
                    hook_name_out="layers.3.moe.output")
    with torch.no_grad():
        for name, p in tc.named_parameters():
            p.copy_(_random(*p.shape, seed=len(name) + 3) / (D ** 0.5 if name in ("W_enc", "W_skip") else 1))
    tc.save(tmp_path / architecture)
    cfg = json.loads((tmp_path / architecture / "cfg.json").read_text())
    assert (cfg["architecture"], cfg["d_out"], cfg["hook_name_out"]) == (architecture, 48, "layers.3.moe.output")
    back = features.load(tmp_path / architecture)
    assert isinstance(back, Transcoder) and back.architecture == architecture and back.d_out == 48
    assert back.hook_name == "layers.2.output" and back.hook_name_out == "layers.3.moe.output"
    x = rows.values
    pre = x @ tc.W_enc + tc.b_enc  # no b_dec subtracted: SAELens' Transcoder.process_sae_in
    acts = pre.relu() * (pre > tc.threshold) if architecture == "jumprelu_transcoder" else pre.relu()
    out = acts @ tc.W_dec + tc.b_dec + (x @ tc.W_skip.T if architecture == "skip_transcoder" else 0)
    torch.testing.assert_close(back(x), out.detach())
    with pytest.raises(InputError, match="compares a reconstruction"):
        back.fvu(x)


def test_bad_files_are_named(tmp_path, tiny_engine):
    cases = [
        (dict(W_enc=None), "no key 'W_enc'"),
        (dict(b_dec=torch.zeros(D + 1)), r"key 'b_dec' has shape \[65\]"),
        (dict(W_dec=torch.zeros(F, D)), r"key 'W_dec' has shape \[96, 64\].*\[64, 96\]"),
        (dict(extra=torch.zeros(2)), "unexpected keys 'extra'"),
        (dict(b_enc=torch.zeros(F, dtype=torch.int64)), "key 'b_enc' is torch.int64"),
        (dict(W_enc=torch.full((F, D), float("nan"))), "'W_enc' holds NaN"),
    ]
    for i, (change, match) in enumerate(cases):
        path = tmp_path / f"c{i}" / "layer0.sae.pt"
        _qwen_scope_file(path, **change)
        with pytest.raises(AutoencoderFileError, match=match) as err:
            load_qwen_scope(path, k=4)
        assert str(path) in str(err.value)
    torch.save([1, 2], str(tmp_path / "layer0.sae.pt"))
    with pytest.raises(AutoencoderFileError, match="expected a dict of tensors"):
        load_qwen_scope(tmp_path / "layer0.sae.pt", k=4)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "layer0.sae.pt").write_bytes(b"not torch")
    with pytest.raises(AutoencoderFileError, match="not a readable PyTorch file"):
        load_qwen_scope(tmp_path / "junk" / "layer0.sae.pt", k=4)
    _qwen_scope_file(tmp_path / "plain" / "layer0.sae.pt")
    with pytest.raises(AutoencoderFileError, match="give k="):
        load_qwen_scope(tmp_path / "plain" / "layer0.sae.pt")
    _qwen_scope_file(tmp_path / "plain" / "sae.pt")
    with pytest.raises(AutoencoderFileError, match="give layer="):
        load_qwen_scope(tmp_path / "plain" / "sae.pt", k=4)
    with pytest.raises(AutoencoderFileError, match="no such file"):
        features.load(tmp_path / "nothing.pt")
    # SAELens' layout: a transcoder without its skip matrix, a JumpReLU without its threshold
    tc = Transcoder(D, F, D, architecture="skip_transcoder", hook_name="layers.0.output")
    tc.save(tmp_path / "skip")
    from safetensors.torch import load_file, save_file
    t = load_file(str(tmp_path / "skip" / "sae_weights.safetensors"))
    t["W_skip"] = torch.zeros(D, D + 1)
    save_file(t, str(tmp_path / "skip" / "sae_weights.safetensors"))
    with pytest.raises(AutoencoderFileError, match=r"sae_weights.safetensors: tensor 'W_skip' has shape \[64, 65\]"):
        features.load(tmp_path / "skip")
    # what a format cannot hold is refused before anything is written
    with pytest.raises(InputError, match="relu=True"):
        save_qwen_scope(TopKAutoencoder(D, F, 4, apply_b_dec_to_input=False), tmp_path / "x" / "layer0.sae.pt")
    assert not (tmp_path / "x" / "layer0.sae.pt").exists()
    with pytest.raises(AutoencoderFileError, match="save it with features.save_qwen_scope"):
        load_qwen_scope(tmp_path / "plain" / "layer0.sae.pt", k=4).save(tmp_path / "as-saelens")
    # a transcoder is not spliced in place of its input
    with pytest.raises(InputError, match="writes another point"):
        features.evaluate(tiny_engine, tc, [[1, 2, 3]], **KW)


@pytest.mark.slow  # about 10 s: the embedded model loaded, two generations
def test_on_the_embedded_model_each_format_round_trips_and_reads_every_step(tmp_path):
    import clover_lab
    from clover_lab.checkpoint.loading import default_model_dir

    if default_model_dir() is None:
        pytest.skip("the embedded default model is missing")
    engine = clover_lab.load(threads=1)
    d = engine.model.config.hidden_size
    acts = features.collect(engine, ["def parse(line):\n", "import os\n"], layer=2, max_new_tokens=16)
    x = acts.values
    made = {}
    _qwen_scope_file(tmp_path / "W-L0_8" / "layer2.sae.pt", d=d, f=4 * d)
    made["qwen-scope"] = features.load(tmp_path / "W-L0_8" / "layer2.sae.pt")
    jr = JumpReLUAutoencoder(d, 4 * d, hook_name="layers.2.output")
    tc = Transcoder(d, 4 * d, d, architecture="jumprelu_transcoder", hook_name="layers.2.output",
                    hook_name_out="layers.3.moe.output")
    for i, sae in enumerate((jr, tc)):
        with torch.no_grad():
            for name, p in sae.named_parameters():
                p.copy_(_random(*p.shape, seed=10 * i + len(name)) / (d ** 0.5 if name.startswith("W_") else 4))
        sae.save(tmp_path / sae.architecture)
        made[sae.architecture] = features.load(tmp_path / sae.architecture)
        torch.testing.assert_close(made[sae.architecture](x), sae(x))
    save_qwen_scope(made["qwen-scope"], tmp_path / "again" / "layer2.sae.pt")
    torch.testing.assert_close(load_qwen_scope(tmp_path / "again" / "layer2.sae.pt", k=8)(x), made["qwen-scope"](x))
    for name, sae in made.items():
        tl = features.timeline(engine, sae, "def parse(line):\n", max_new_tokens=16)
        assert len(tl.frames) == tl.result.stats.preview_forwards > 1, name  # every denoising step
        assert tl.top(n=3), name
