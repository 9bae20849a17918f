"""Checkpoint loading and saving: round trips, shards, and a clear error for each bad input."""
import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import clover_lab
from clover_lab import (
    CheckpointError,
    CloverConfig,
    CloverError,
    CloverModel,
    ConfigError,
)


@pytest.fixture
def saved(tiny_model, tmp_path):
    path = tmp_path / "tiny"
    tiny_model.save_pretrained(path)
    return tiny_model, path


def params_equal(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    return all(torch.equal(pa[k], pb[k]) for k in pa)


def test_round_trip_is_bit_exact(saved):
    model, path = saved
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Clover checkpoint has its preview weights: no warning
        loaded = CloverModel.from_pretrained(path)
    assert params_equal(model, loaded)
    assert loaded.config == model.config.replace(dtype="float32")
    ids = torch.arange(30)[None]
    assert torch.equal(model.logits(ids), loaded.logits(ids))


def test_sharded_round_trip(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path, max_shard_bytes=200_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    assert params_equal(tiny_model, CloverModel.from_pretrained(tmp_path))


def test_load_in_other_dtype(saved):
    model, path = saved
    half = CloverModel.from_pretrained(path, dtype="bfloat16")
    assert half.dtype == torch.bfloat16
    assert half.model.layers[0].linear_attn.A_log.dtype == torch.bfloat16
    out = half.logits(torch.arange(20)[None])
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_plain_qwen_checkpoint_warns_preview_untrained(reference):
    with pytest.warns(UserWarning, match="preview mode is untrained"):
        model = CloverModel.from_pretrained(reference[1])
    gdn = model.model.layers[0].linear_attn
    assert torch.equal(gdn.conv1d_right.weight, torch.zeros_like(gdn.conv1d_right.weight))
    assert torch.allclose(gdn.block_scale, torch.full_like(gdn.block_scale, 0.5 * torch.log(torch.tensor(16.0))))
    assert torch.equal(gdn.history_bias, torch.zeros(4)) and torch.equal(gdn.history_log_n, torch.ones(4))


def rewrite(path, fn):
    tensors = load_file(str(path / "model.safetensors"))
    save_file(fn(tensors), str(path / "model.safetensors"))


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        CloverModel.from_pretrained(tmp_path / "nope")


def test_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        CloverModel.from_pretrained(f)


def test_missing_config(saved):
    _, path = saved
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        CloverModel.from_pretrained(path)


def test_invalid_config_json(saved):
    _, path = saved
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        CloverModel.from_pretrained(path)


def test_unsupported_model_type(saved):
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="model_type 'llama' is not supported"):
        CloverModel.from_pretrained(path)


def test_missing_weights_file(saved):
    _, path = saved
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        CloverModel.from_pretrained(path)


def test_corrupt_header(saved):
    _, path = saved
    (path / "model.safetensors").write_bytes(b"\xff" * 8 + b"garbage")
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors file"):
        CloverModel.from_pretrained(path)


def test_missing_tensor(saved):
    _, path = saved
    rewrite(path, lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.gate.weight"})
    with pytest.raises(CheckpointError, match=r"missing .*model\.layers\.1\.mlp\.gate\.weight"):
        CloverModel.from_pretrained(path)


def test_missing_expert_of_per_expert_checkpoint(reference, tmp_path):
    import shutil

    path = tmp_path / "ref"
    shutil.copytree(reference[1], path)
    rewrite(path, lambda t: {k: v for k, v in t.items() if k != "model.layers.2.mlp.experts.5.up_proj.weight"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        CloverModel.from_pretrained(path)


def test_unexpected_tensor(saved):
    _, path = saved
    rewrite(path, lambda t: {**t, "model.layers.0.bogus.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*model\.layers\.0\.bogus\.weight"):
        CloverModel.from_pretrained(path)


def test_shape_mismatch(saved):
    _, path = saved
    rewrite(path, lambda t: {**t, "lm_head.weight": torch.zeros(512, 63)})
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight' has shape \[512, 63\], expected \[512, 64\]"):
        CloverModel.from_pretrained(path)


def test_unsupported_tensor_dtype(saved):
    _, path = saved
    rewrite(path, lambda t: {**t, "model.norm.weight": torch.zeros(64, dtype=torch.int8)})
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has dtype I8"):
        CloverModel.from_pretrained(path)


def test_missing_shard(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path, max_shard_bytes=200_000)
    next(tmp_path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-.* is missing"):
        CloverModel.from_pretrained(tmp_path)


def test_unknown_dtype_argument(saved):
    with pytest.raises(CheckpointError, match="unknown dtype 'float8'"):
        CloverModel.from_pretrained(saved[1], dtype="float8")


# ----------------------------------------------------------------------------- config
def test_config_json_round_trip(tmp_path):
    cfg = CloverConfig.preset("clover-tiny", mask_token_id=7)
    cfg.save(tmp_path)
    again = CloverConfig.from_json_file(tmp_path / "config.json")
    assert again == cfg
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["model_type"] == "clover_moe" and d["block_size"] == 16 and d["mask_token_id"] == 7


def test_config_reads_transformers_text_and_multimodal_configs(reference):
    d = json.loads(open(reference[1] + "/config.json").read())
    text = CloverConfig.from_dict(d)
    assert text.num_hidden_layers == 8 and text.partial_rotary_factor == 0.25
    assert text.layer_types.count("full_attention") == 2
    wrapped = CloverConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": d, "eos_token_id": 3})
    assert wrapped.hidden_size == 64 and wrapped.eos_token_ids == [3]


def test_full_size_preset_on_meta():
    cfg = CloverConfig.preset("clover-35b-a3b")
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.block_size) == (40, 256, 8, 32)
    assert cfg.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    with torch.device("meta"):
        model = CloverModel(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert 34e9 < total < 36e9


@pytest.mark.parametrize("field,value,match", [
    ("num_key_value_heads", 3, "must divide num_attention_heads"),
    ("num_experts_per_tok", 99, "must be <= num_experts"),
    ("mask_token_id", 10_000, "mask_token_id"),
    ("block_size", 0, "block_size"),
])
def test_invalid_config_fields(field, value, match):
    with pytest.raises(ConfigError, match=match):
        CloverConfig.preset("clover-tiny", **{field: value})


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'clover-9000'"):
        CloverConfig.preset("clover-9000")


# --------------------------------------------------------------------------- generation_config.json
def test_load_takes_the_generation_config_defaults(gen_text_model_dir, tmp_path):
    """What training writes into generation_config.json (threshold, max_new_tokens), and
    transformers' own fields (do_sample, eos_token_id), become the engine's defaults; a
    request still overrides them."""
    import shutil

    import clover_lab

    d = tmp_path / "m"
    shutil.copytree(gen_text_model_dir, d)
    (d / "generation_config.json").write_text(json.dumps(
        {"threshold": 0.5, "max_new_tokens": 12, "do_sample": False, "temperature": 0.7, "top_k": 20,
         "bos_token_id": 1, "transformers_version": "5.0"}))
    engine = clover_lab.load(d)
    assert engine.settings.threshold == 0.5 and engine.settings.temperature == 0.0 and engine.settings.top_k == 20
    assert engine.max_new_tokens == 12
    ids = list(range(5, 15))
    assert engine.generate(ids).stats.new_tokens <= 12
    assert engine.generate(ids, max_new_tokens=3).stats.new_tokens <= 3
    assert len(engine.generate(ids, threshold=1.0, max_new_tokens=4).token_ids) <= 4
    plain = clover_lab.load(gen_text_model_dir)  # no file: the library's defaults
    assert plain.settings == clover_lab.SamplerSettings() and plain.max_new_tokens == 256


@pytest.mark.parametrize("content,match", [
    ('{"threshold": 7}', "threshold"),
    ('{"max_new_tokens": 0}', "max_new_tokens"),
    ('{"eos_token_id": "x"}', "eos_token_id"),
    ('[1, 2]', "JSON object"),
    ('{"threshold": ', "not valid JSON"),
])
def test_a_bad_generation_config_is_named(gen_model_dir, tmp_path, content, match):
    import shutil

    import clover_lab

    d = tmp_path / "m"
    shutil.copytree(gen_model_dir, d)
    (d / "generation_config.json").write_text(content)
    with pytest.raises(CheckpointError, match=match) as err:
        clover_lab.load(d)
    assert "generation_config.json" in str(err.value)


# --------------------------------------------------------------------------- 8. config.json
@pytest.fixture
def model_copy(gen_model_dir, tmp_path):
    dest = tmp_path / "model"
    shutil.copytree(gen_model_dir, dest)
    return dest


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            cfg.pop(key)
        elif key in ("rope_theta", "partial_rotary_factor"):
            cfg["rope_parameters"][key] = value
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


_DROP = object()


# --------------------------------------------------------------------------- smaller
def _rewrite_weights(path, change):
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("changes,match", [
    (dict(hidden_size=_DROP), "missing required field.*'hidden_size'"),
    (dict(num_experts=_DROP, moe_intermediate_size=_DROP), "'num_experts', 'moe_intermediate_size'"),
    (dict(rms_norm_eps="abc"), "'rms_norm_eps': must be a positive finite number"),
    (dict(rms_norm_eps=-1e-6), "'rms_norm_eps': must be a positive"),
    (dict(rope_theta=0), "'rope_theta': must be a positive"),
    (dict(eos_token_id=100_000), "'eos_token_id': must be below vocab_size=512"),
    (dict(eos_token_id=[510, -1]), "'eos_token_id': must be a token id"),
    (dict(attention_bias="no"), "'attention_bias': must be true or false"),
])
def test_bad_config_fields_are_named_at_load(model_copy, changes, match):
    _edit_config(model_copy, **changes)
    with pytest.raises(CheckpointError, match=r"config\.json.*" + match):
        clover_lab.load(model_copy)


def test_two_stored_tensors_for_one_parameter_are_an_error(model_copy):
    def both_norms(t):
        t["model.language_model.norm.weight"] = t["model.norm.weight"] + 1.0

    _rewrite_weights(model_copy, both_norms)
    with pytest.raises(CheckpointError, match=r"'model.language_model.norm.weight' \(model.safetensors\) and "
                                              r"'model.norm.weight' .* are both the parameter 'model.norm.weight'"):
        clover_lab.load(model_copy)


def test_fused_and_per_expert_copies_are_an_error(model_copy):
    def add_expert(t):
        I, H = 32, 64
        t["model.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(I, H)

    _rewrite_weights(model_copy, add_expert)
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.experts is stored both as fused tensors and "
                                              "per expert"):
        clover_lab.load(model_copy)


# --------------------------------------------------------------------------- 4. booleans, placement, shards
@pytest.mark.parametrize("kwargs,match", [
    (dict(keep_fp8="false"), "keep_fp8='false'"), (dict(check_finite=1), "check_finite=1"),
    (dict(progress="no"), "progress='no'"), (dict(pin_memory=None), "pin_memory=None"),
    (dict(coreset_size=1), r"load\(coreset_size=1\): .*num_experts_per_tok"),
    (dict(coreset_size="4"), r"load\(coreset_size='4'\): expected an int"),
    (dict(max_memory={"cpu": "1GiB"}), "without a device_map it would be ignored"),
    (dict(device_map={"": "cpu"}, max_memory={"cpu": "1GiB"}), "it would be ignored"),
    (dict(device_map={"": -1}), r'"" -> -1 is not a device'),
    (dict(device_map={"": "meta"}), "'meta' holds shapes but no weights"),
    (dict(device_map={"": "cuda:x"}), "'cuda:x' is not a device"),
    (dict(device_map="everywhere"), "expected 'auto' or a dict"),
    (dict(device_map="auto", max_memory=5), "max_memory: expected a dict"),
])
def test_load_arguments_are_named_before_anything_is_read(gen_model_dir, kwargs, match):
    with pytest.raises(CloverError, match=match):
        clover_lab.load(gen_model_dir, **kwargs)
