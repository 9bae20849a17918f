"""The TopK autoencoder and SAELens' layout (issue 42): the map is SAELens' topk, our files are the
layout SAELens 6 writes and reads (cfg.json + sae_weights.safetensors), SAELens' files (6.x and
pre-6 configs) load here, anything else is named, and a failed save leaves the old files."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from clover_lab.errors import CheckpointError, InputError, OutputError
from clover_lab.features import AutoencoderFileError, TopKAutoencoder
from injected_faults import FULL, Writes, leftovers


def _sae(d_in=8, d_sae=24, k=3, seed=0, **kw) -> TopKAutoencoder:
    g = torch.Generator().manual_seed(seed)
    sae = TopKAutoencoder(d_in, d_sae, k, hook_name="layers.2.output", model_name="tiny", **kw)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return sae


def test_the_map_is_topk_then_relu():
    sae = _sae()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    pre = (x - sae.b_dec) @ sae.W_enc + sae.b_enc
    values, indices = pre.topk(3, dim=-1)
    want = torch.zeros(5, 24).scatter_(-1, indices, values.relu())
    torch.testing.assert_close(sae.encode(x), want)
    torch.testing.assert_close(sae(x), want @ sae.W_dec + sae.b_dec)
    assert (sae.encode(x) != 0).sum(-1).max() <= 3
    v, i = sae.encode_topk(x.to(torch.bfloat16))  # any dtype in: float32 out
    assert v.dtype == torch.float32 and i.shape == (5, 3)
    # rescale_acts_by_decoder_norm (SAELens): pre-activations times the decoder norms, divided back out
    r = _sae(rescale_acts_by_decoder_norm=True)
    norms = r.W_dec.norm(dim=-1)
    pre = ((x - r.b_dec) @ r.W_enc + r.b_enc) * norms
    values, indices = pre.topk(3, dim=-1)
    acts = torch.zeros(5, 24).scatter_(-1, indices, values.relu())
    torch.testing.assert_close(r(x), (acts / norms) @ r.W_dec + r.b_dec)
    with pytest.raises(InputError, match="rows of 8 values"):
        sae.encode(torch.zeros(5, 7))
    with pytest.raises(InputError, match="k=30 is more than d_sae=24"):
        TopKAutoencoder(8, 24, 30)


def test_fvu():
    sae = _sae(d_in=4, d_sae=8, k=4)
    with torch.no_grad():  # an exact autoencoder: features +x_i and -x_i, one of each pair active
        sae.W_enc.copy_(torch.cat([torch.eye(4), -torch.eye(4)], 1))
        sae.W_dec.copy_(torch.cat([torch.eye(4), -torch.eye(4)], 0))
        sae.b_enc.zero_()
        sae.b_dec.zero_()
    x = torch.randn(50, 4, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(sae(x), x)
    assert sae.fvu(x) == 0.0
    with torch.no_grad():
        sae.W_dec.zero_()
        sae.b_dec.copy_(x.mean(0))
    assert sae.fvu(x) == pytest.approx(1.0)  # the mean: nothing explained
    with pytest.raises(InputError, match="at least 2 rows"):
        sae.fvu(x[:1])


def test_our_files_are_saelens_layout(tmp_path):
    sae = _sae()
    sae.metadata["clover_lab"] = {"fvu": 0.1}
    sae.save(tmp_path / "sae")
    assert sorted(p.name for p in (tmp_path / "sae").iterdir()) == ["cfg.json", "sae_weights.safetensors"]
    cfg = json.loads((tmp_path / "sae" / "cfg.json").read_text())
    # SAELens 6's TopKSAEConfig.to_dict(): its fields, the metadata and the architecture
    assert cfg == {"d_in": 8, "d_sae": 24, "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": True,
                   "normalize_activations": "none", "reshape_activations": "none",
                   "metadata": {"sae_lens_version": "6.0.0", "sae_lens_training_version": None,
                                "hook_name": "layers.2.output", "model_name": "tiny", "clover_lab": {"fvu": 0.1}},
                   "k": 3, "rescale_acts_by_decoder_norm": False, "architecture": "topk"}
    weights = load_file(tmp_path / "sae" / "sae_weights.safetensors")
    assert {k: tuple(v.shape) for k, v in weights.items()} == {"W_enc": (8, 24), "b_enc": (24,), "W_dec": (24, 8),
                                                               "b_dec": (8,)}
    assert all(v.dtype == torch.float32 for v in weights.values())
    back = TopKAutoencoder.load(tmp_path / "sae")
    assert all(torch.equal(getattr(back, k), getattr(sae, k)) for k in ("W_enc", "b_enc", "W_dec", "b_dec"))
    assert back.k == 3 and back.hook_name == "layers.2.output" and back.layer == 2 and back.kind == "output"
    assert back.metadata["clover_lab"] == {"fvu": 0.1} and not back.W_enc.requires_grad


def _write(d, cfg, tensors):
    d.mkdir(parents=True, exist_ok=True)
    (d / "cfg.json").write_text(json.dumps(cfg))
    save_file(tensors, str(d / "sae_weights.safetensors"))


def _tensors(d_in=8, d_sae=24, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    return {"W_enc": torch.randn(d_in, d_sae, generator=g).to(dtype), "b_enc": torch.randn(d_sae, generator=g).to(dtype),
            "W_dec": torch.randn(d_sae, d_in, generator=g).to(dtype), "b_dec": torch.randn(d_in, generator=g).to(dtype)}


def test_saelens_files_load_here(tmp_path):
    """What SAELens writes: a 6.x TopK (as save_inference_model writes it: rescale flag set over
    folded weights, bfloat16, more metadata), and a pre-6 config (activation_fn topk)."""
    v6 = {"d_in": 8, "d_sae": 24, "dtype": "bfloat16", "device": "cuda", "apply_b_dec_to_input": False,
          "normalize_activations": "none", "reshape_activations": "none",
          "metadata": {"sae_lens_version": "6.54.12", "sae_lens_training_version": "6.54.12", "model_name": "gpt2",
                       "hook_name": "blocks.8.hook_resid_pre", "context_size": 128, "prepend_bos": True},
          "k": 5, "rescale_acts_by_decoder_norm": True, "architecture": "topk"}
    _write(tmp_path / "v6", v6, _tensors(dtype=torch.bfloat16))
    sae = TopKAutoencoder.load(tmp_path / "v6")
    assert (sae.k, sae.apply_b_dec_to_input, sae.rescale_acts_by_decoder_norm) == (5, False, True)
    assert sae.W_enc.dtype == torch.float32 and sae.hook_name == "blocks.8.hook_resid_pre" and sae.layer is None
    assert sae.metadata["context_size"] == 128
    pre5 = {"d_in": 8, "d_sae": 24, "dtype": "float32", "activation_fn_str": "topk",
            "activation_fn_kwargs": {"k": 4}, "hook_point": "blocks.2.hook_resid_post", "model_name": "gpt2",
            "sae_lens_training_version": "3.0.0", "normalize_activations": False}
    _write(tmp_path / "pre6", pre5, _tensors())
    old = TopKAutoencoder.load(tmp_path / "pre6")
    assert old.k == 4 and old.hook_name == "blocks.2.hook_resid_post" and old.apply_b_dec_to_input
    # SAELens drops an all-ones finetuning scaling factor, as we do
    _write(tmp_path / "ones", v6 | {"dtype": "float32"}, _tensors() | {"scaling_factor": torch.ones(24)})
    assert TopKAutoencoder.load(tmp_path / "ones").d_sae == 24


def test_other_files_are_named(tmp_path):
    good = json.loads(json.dumps({"d_in": 8, "d_sae": 24, "dtype": "float32", "k": 3, "architecture": "topk",
                                  "metadata": {"sae_lens_version": "6.1.0"}}))
    cases = [
        ({"architecture": "gated"}, {}, "architecture 'gated'.*topk, jumprelu"),
        ({"architecture": "jumprelu"}, {}, "no tensor 'threshold'"),
        ({"k": 0}, {}, "'k' is 0"),
        ({"k": 30}, {}, "k=30 is more than d_sae=24"),
        ({"d_in": "8"}, {}, "'d_in'"),
        ({"normalize_activations": "expected_average_only_in"}, {}, "normalize_activations"),
        ({"reshape_activations": "hook_z"}, {}, "reshape_activations"),
        ({"dtype": "int8"}, {}, "dtype 'int8'"),
        ({"apply_b_dec_to_input": "yes"}, {}, "apply_b_dec_to_input"),
        ({}, {"W_enc": torch.zeros(24, 8)}, r"'W_enc' has shape \[24, 8\].*\[8, 24\]"),
        ({}, {"b_dec": torch.full((8,), float("nan"))}, "'b_dec' holds NaN"),
        ({}, {"W_dec": None}, "no tensor 'W_dec'"),
        ({}, {"extra": torch.zeros(2)}, "unexpected tensors 'extra'"),
        ({}, {"scaling_factor": torch.full((24,), 2.0)}, "scaling factor"),
        ({"metadata": {}, "activation_fn": "relu", "architecture": None}, {}, "architecture 'standard'"),
    ]
    for i, (cfg, tensors, match) in enumerate(cases):
        t = {k: v for k, v in (_tensors() | tensors).items() if v is not None}
        _write(tmp_path / str(i), {k: v for k, v in (good | cfg).items() if v is not None}, t)
        with pytest.raises(AutoencoderFileError, match=match):
            TopKAutoencoder.load(tmp_path / str(i))
    assert issubclass(AutoencoderFileError, CheckpointError)
    with pytest.raises(AutoencoderFileError, match="not a directory"):
        TopKAutoencoder.load(tmp_path / "missing")
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "trace.json").write_text("{}")
    with pytest.raises(AutoencoderFileError, match="no cfg.json and sae_weights.safetensors.*trace.json"):
        TopKAutoencoder.load(tmp_path / "trace")
    _write(tmp_path / "bad", good, _tensors())
    (tmp_path / "bad" / "cfg.json").write_text("[1, 2")
    with pytest.raises(AutoencoderFileError, match="not JSON"):
        TopKAutoencoder.load(tmp_path / "bad")
    (tmp_path / "bad" / "cfg.json").write_text(json.dumps(good))
    (tmp_path / "bad" / "sae_weights.safetensors").write_bytes(b"junk")
    with pytest.raises(AutoencoderFileError, match="safetensors"):
        TopKAutoencoder.load(tmp_path / "bad")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "model.safetensors").write_bytes(b"")
    with pytest.raises(OutputError, match="model.safetensors"):
        _sae().save(tmp_path / "mine")


@pytest.mark.parametrize("fail_at", [1, 2, 3])
@pytest.mark.parametrize("error", [FULL, KeyboardInterrupt()])
def test_a_failed_save_leaves_the_old_autoencoder(tmp_path, monkeypatch, fail_at, error):
    old = _sae(seed=1)
    old.save(tmp_path / "sae")
    Writes(monkeypatch, fail_at=fail_at, error=error)  # the weights, cfg.json, the set's marker
    with pytest.raises(type(error)):
        _sae(seed=2).save(tmp_path / "sae")
    back = TopKAutoencoder.load(tmp_path / "sae")
    assert torch.equal(back.W_enc, old.W_enc)
    assert not leftovers(tmp_path)


def test_an_io_error_between_the_renames_leaves_the_old_autoencoder(tmp_path, monkeypatch):
    """The set's renames were not one step: an I/O error after the weights were renamed left new
    weights beside the old cfg.json under the marker, and the previous autoencoder would not load."""
    import os

    from clover_lab import writes

    old = _sae(seed=1)
    old.save(tmp_path / "sae")
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the first file of the set is in, the second fails
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(writes.os, "replace", replace)
    with pytest.raises(OSError, match="sae"):
        _sae(seed=2).save(tmp_path / "sae")
    monkeypatch.undo()
    back = TopKAutoencoder.load(tmp_path / "sae")
    assert torch.equal(back.W_enc, old.W_enc) and not leftovers(tmp_path)


def test_a_full_disk_names_the_autoencoder_and_a_string_metadata_is_named(tmp_path, monkeypatch):
    Writes(monkeypatch, fail_at=1, error=FULL)
    with pytest.raises(OSError, match=f"cannot write {tmp_path / 'sae'}"):
        _sae().save(tmp_path / "sae")
    monkeypatch.undo()
    _sae().save(tmp_path / "sae")
    cfg = json.loads((tmp_path / "sae" / "cfg.json").read_text())
    (tmp_path / "sae" / "cfg.json").write_text(json.dumps(cfg | {"metadata": "layers.2.output"}))
    with pytest.raises(AutoencoderFileError, match="'metadata' must be a JSON object"):
        TopKAutoencoder.load(tmp_path / "sae")
