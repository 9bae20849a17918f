"""FP8 checkpoints (Qwen's and DeepSeek's block-scaled format): a bf16/fp32 checkpoint quantized
into it loads, dequantized on the CPU or kept in FP8, with the logits of the model whose weights
are the dequantized values; bad FP8 checkpoints are refused naming the tensor."""
import json
import warnings

import pytest
import torch
from injected_faults import FULL, Writes
from safetensors.torch import load_file, save_file

import clover_lab
from clover_kernels.fp8 import naive
from clover_lab import CheckpointError, CloverModel, load
from clover_lab.checkpoint import fp8 as fp8_checkpoint
from clover_lab.checkpoint.quantize import quantize_checkpoint
from clover_lab.errors import InputError, OutputError
from clover_lab.model.layers.fp8_linear import FP8Experts, FP8Linear
from clover_lab.model.layers.linear import Linear


def dequantized_reference(model: CloverModel, block) -> CloverModel:
    """``model`` with every weight the quantizer quantizes replaced by its dequantized FP8 value."""
    ref = CloverModel.random(model.config, seed=0)
    ref.load_state_dict(model.state_dict())
    I = model.config.moe_intermediate_size
    with torch.no_grad():
        for name, module in ref.named_modules():
            if type(module) is Linear and not any(s in name + "." for s in ("lm_head", "mlp.gate.", "shared_expert_gate",
                                                                             "in_proj_a.", "in_proj_b.")):
                module.weight.copy_(naive.dequantize(*naive.quantize(module.weight, block), block))
            elif name.endswith("mlp.experts"):
                gu = module.gate_up_proj
                for part in (slice(0, I), slice(I, None)):
                    gu[:, part] = naive.dequantize(*naive.quantize(gu[:, part], block), block)
                module.down_proj.copy_(naive.dequantize(*naive.quantize(module.down_proj, block), block))
    return ref


def logits(model, ids):
    return model.commit(model.new_cache(ids.shape[1]), ids, logits="all")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 500, (1, 48), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    model = CloverModel.random("clover-tiny", seed=3)
    path = tmp_path_factory.mktemp("bf16")
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("block,scale_dtype", [((16, 16), torch.float32), ((32, 16), torch.bfloat16),
                                               ((128, 128), torch.float32)], ids=str)
def test_fp8_checkpoint_loads_dequantized_with_the_dequantized_models_logits(source, ids, tmp_path, block, scale_dtype):
    model, path = source
    quantize_checkpoint(path, tmp_path, block=block, scale_dtype=scale_dtype)
    stored = load_file(tmp_path / "model.safetensors")
    assert stored["model.layers.0.mlp.experts.3.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"].dtype == scale_dtype
    assert stored["model.embed_tokens.weight"].dtype == torch.float32 and "lm_head.weight_scale_inv" not in stored
    loaded = CloverModel.from_pretrained(tmp_path)
    assert not any(isinstance(m, (FP8Linear, FP8Experts)) for m in loaded.modules())  # an ordinary model
    assert loaded.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    got = logits(loaded, ids)
    if scale_dtype == torch.float32:  # bf16 scales are rounded: the reference's quantize differs slightly
        torch.testing.assert_close(got, logits(dequantized_reference(model, block), ids), atol=2e-5, rtol=1e-4)
    error = (got - logits(model, ids)).abs().max()
    assert 0 < error < 0.5 * logits(model, ids).abs().max()  # quantization moves the logits, boundedly


def test_fp8_kept_on_request_runs_fp8_modules_with_the_same_logits(source, ids, tmp_path):
    model, path = source
    block = (16, 16)
    quantize_checkpoint(path, tmp_path, block=block)
    kept = CloverModel.from_pretrained(tmp_path, keep_fp8=True)
    layer = kept.model.layers[0]
    assert isinstance(layer.mlp.experts, FP8Experts) and layer.mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert isinstance(layer.linear_attn.in_proj_qkv, FP8Linear) and layer.linear_attn.in_proj_qkv.block == block
    assert type(kept.lm_head) is Linear and kept.dtype == torch.float32  # skipped modules stay as they were
    assert type(layer.linear_attn.in_proj_a) is Linear
    torch.testing.assert_close(logits(kept, ids), logits(CloverModel.from_pretrained(tmp_path), ids),
                               atol=2e-5, rtol=1e-4)
    with pytest.raises(CheckpointError, match="FP8"):
        kept.save_pretrained(tmp_path / "again")


def test_a_transformers_qwen_checkpoint_quantized_per_expert_loads(reference, tmp_path, ids):
    """transformers' per-expert Qwen3.5-MoE checkpoint in the real 128x128 blocks."""
    _, path = reference
    quantize_checkpoint(path, tmp_path, block=(128, 128), scale_dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no preview weights: the loader says so
        deq = CloverModel.from_pretrained(tmp_path)
        kept = CloverModel.from_pretrained(tmp_path, keep_fp8=True)
    assert isinstance(kept.model.layers[5].mlp.experts, FP8Experts)
    torch.testing.assert_close(logits(kept, ids), logits(deq, ids), atol=2e-5, rtol=1e-4)


def test_generation_runs_on_an_fp8_model(source, tmp_path):
    _, path = source
    quantize_checkpoint(path, tmp_path, block=(16, 16))
    engine = load(tmp_path, keep_fp8=True)
    for mode in ("diffusion", "ar"):
        assert len(engine.generate([1, 2, 3], mode=mode, max_new_tokens=8).token_ids) == 8


def test_streaming_dequantization_in_chunks_equals_the_reference(monkeypatch):
    monkeypatch.setattr(fp8_checkpoint, "CHUNK_ELEMENTS", 64 * 40)  # a few block rows per chunk
    q, s = naive.quantize(torch.randn(3, 100, 40), (16, 16))
    out = fp8_checkpoint.dequantize_streaming(q, s, (16, 16), torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, naive.dequantize(q, s, (16, 16), torch.bfloat16))


# --------------------------------------------------------------------------- bad FP8 checkpoints
@pytest.fixture
def fp8_dir(source, tmp_path):
    return quantize_checkpoint(source[1], tmp_path / "fp8", block=(16, 16))


def rewrite(path, fn):
    tensors = load_file(path / "model.safetensors")
    save_file(fn(tensors), path / "model.safetensors")


def edit_config(path, fn):
    raw = json.loads((path / "config.json").read_text())
    fn(raw["quantization_config"] if "quantization_config" in raw else raw)
    (path / "config.json").write_text(json.dumps(raw))


SCALE = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"


def test_a_missing_scale_is_named(fp8_dir):
    rewrite(fp8_dir, lambda t: {k: v for k, v in t.items() if k != SCALE})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight' is "
                                              r"float8_e4m3fn but the checkpoint has no scale tensor"):
        CloverModel.from_pretrained(fp8_dir)


def test_a_scale_of_the_wrong_shape_is_named(fp8_dir):
    rewrite(fp8_dir, lambda t: {**t, SCALE: t[SCALE][:, :1].contiguous()})
    with pytest.raises(CheckpointError, match=r"scale tensor '.*experts\.2\.down_proj\.weight_scale_inv' has shape "
                                              r"\[4, 1\], expected \[4, 2\] for .* of shape \[64, 32\] in blocks \[16, 16\]"):
        CloverModel.from_pretrained(fp8_dir)


def test_a_scale_without_an_fp8_tensor_is_named(fp8_dir):
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    rewrite(fp8_dir, lambda t: {**t, name: t[name].float()})
    with pytest.raises(CheckpointError, match=r"scales no float8_e4m3fn tensor .* is stored as F32"):
        CloverModel.from_pretrained(fp8_dir)


def test_a_scale_of_an_unsupported_dtype_is_named(fp8_dir):
    rewrite(fp8_dir, lambda t: {**t, SCALE: t[SCALE].to(torch.int32)})
    with pytest.raises(CheckpointError, match=r"'.*down_proj\.weight_scale_inv' has dtype I32"):
        CloverModel.from_pretrained(fp8_dir)


@pytest.mark.parametrize("edit,match", [
    (lambda q: q.update(quant_method="gptq"), r"quant_method='gptq' is not supported"),
    (lambda q: q.update(weight_block_size=[128]), r"weight_block_size=\[128\]: expected two positive integers"),
    (lambda q: q.pop("weight_block_size"), r"weight_block_size=None"),
    (lambda q: q.update(activation_scheme="static"), r"activation_scheme='static'"),
    (lambda raw: raw.pop("quantization_config"), r"no quantization_config, but the checkpoint holds"),
], ids=["method", "block", "no-block", "static", "no-config"])
def test_a_bad_quantization_config_is_named(fp8_dir, edit, match):
    if "no quantization_config" in match:
        raw = json.loads((fp8_dir / "config.json").read_text())
        edit(raw)
        (fp8_dir / "config.json").write_text(json.dumps(raw))
    else:
        edit_config(fp8_dir, edit)
    with pytest.raises(CheckpointError, match=match):
        CloverModel.from_pretrained(fp8_dir)


# --------------------------------------------------------------------------- 3. FP8 checkpoints
@pytest.fixture
def gen_fp8_dir(gen_model_dir, tmp_path):
    from clover_lab.checkpoint.quantize import quantize_checkpoint

    return quantize_checkpoint(gen_model_dir, tmp_path / "fp8", block=(16, 16))


def _rewrite(path, fn):
    from safetensors.torch import load_file, save_file

    save_file(fn(load_file(path / "model.safetensors")), path / "model.safetensors")


FP8_WEIGHT = "model.layers.1.mlp.experts.2.down_proj.weight"


FP8_SCALE = FP8_WEIGHT + "_scale_inv"


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_fp8_scales_must_be_finite_and_positive(gen_fp8_dir, value, keep):
    def damage(t):
        t[FP8_SCALE][0, 0] = value
        return t

    _rewrite(gen_fp8_dir, damage)
    with pytest.raises(clover_lab.CheckpointError, match=rf"scale tensor '{FP8_SCALE}' holds 1 entries that are "
                                                         r"not finite and positive"):
        clover_lab.CloverModel.from_pretrained(gen_fp8_dir, keep_fp8=keep)


def test_nan_in_kept_fp8_weights_is_found_at_load(gen_fp8_dir):
    def damage(t):
        raw = t[FP8_WEIGHT].view(torch.uint8).clone()
        raw[0, 0] = 0x7F  # float8_e4m3fn's NaN
        t[FP8_WEIGHT] = raw.view(torch.float8_e4m3fn)
        return t

    _rewrite(gen_fp8_dir, damage)
    for keep in (True, False):
        with pytest.raises(clover_lab.CheckpointError, match=rf"tensor '{FP8_WEIGHT}' holds NaN"):
            clover_lab.CloverModel.from_pretrained(gen_fp8_dir, keep_fp8=keep)
    clover_lab.CloverModel.from_pretrained(gen_fp8_dir, keep_fp8=True, check_finite=False)  # asked not to look


@pytest.mark.parametrize("kwargs,match", [
    (dict(block=(0, 0)), r"block=0"), (dict(block=(16,)), "two block sizes"), (dict(block=16), "two block sizes"),
    (dict(block=(16, -4)), "block=-4"), (dict(max_shard_bytes=0), "max_shard_bytes=0"),
])
def test_quantize_checkpoint_arguments(gen_model_dir, tmp_path, kwargs, match):
    from clover_lab.checkpoint.quantize import quantize_checkpoint

    with pytest.raises(InputError, match=match):
        quantize_checkpoint(gen_model_dir, tmp_path / "q", **kwargs)
    assert not (tmp_path / "q").exists()  # refused before anything is written



@pytest.mark.parametrize("error", [FULL, KeyboardInterrupt()], ids=["disk-full", "interrupt"])
def test_a_failed_quantization_leaves_the_previous_one(tmp_path, monkeypatch, error):
    from clover_lab.checkpoint.quantize import quantize_checkpoint

    src = tmp_path / "src"
    CloverModel.random("clover-tiny", seed=1).save_pretrained(src)
    dst = tmp_path / "fp8"
    quantize_checkpoint(src, dst, block=(32, 32), max_shard_bytes=1 << 16)
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    CloverModel.random("clover-tiny", seed=2).save_pretrained(src)
    with monkeypatch.context() as m:
        Writes(m, fail_at=3, error=error)  # the third shard
        with pytest.raises(type(error)):
            quantize_checkpoint(src, dst, block=(32, 32), max_shard_bytes=1 << 16)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before
    with pytest.raises(OutputError, match="is the input"):  # and never onto its own source
        quantize_checkpoint(src, src)
