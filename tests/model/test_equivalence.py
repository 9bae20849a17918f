"""The causal path equals transformers' Qwen3.5-MoE (the numerical ground truth) in fp32."""
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from clover_lab import CloverModel

TOL = 1e-4


def ref_logits(ref_model, ids):
    with torch.no_grad():
        return ref_model(ids).logits


def load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CloverModel.from_pretrained(path)


def test_whole_prompt_matches_transformers(reference, clover_ref, prompt_ids):
    ref_model, _ = reference
    want = ref_logits(ref_model, prompt_ids)
    got = clover_ref.logits(prompt_ids)
    assert got.shape == want.shape == (1, 150, 512)
    diff = (got - want).abs().max().item()
    print(f"max |logit diff| whole prompt: {diff:.3e}")
    assert diff <= TOL


@pytest.mark.parametrize("pieces", [[37, 64, 1, 1, 47], [64, 86], [1] * 5 + [145]])
def test_uneven_commits_match_transformers(reference, clover_ref, prompt_ids, pieces):
    """The same prompt committed in uneven pieces crossing the GDN chunk boundary (64)."""
    want = ref_logits(reference[0], prompt_ids)
    cache = clover_ref.new_cache(200)
    outs, start = [], 0
    for n in pieces:
        outs.append(clover_ref.commit(cache, prompt_ids[:, start:start + n], logits="all"))
        start += n
    assert cache.length == 150
    diff = (torch.cat(outs, dim=1) - want).abs().max().item()
    print(f"max |logit diff| pieces {pieces}: {diff:.3e}")
    assert diff <= TOL


def test_batch_of_two_matches_transformers(reference, clover_ref):
    ids = torch.randint(0, 512, (2, 70), generator=torch.Generator().manual_seed(5))
    diff = (clover_ref.logits(ids) - ref_logits(reference[0], ids)).abs().max().item()
    assert diff <= TOL


def _rewrite(src, dst, transform):
    """Copy a checkpoint directory, passing its tensors through ``transform``."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    save_file(transform(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})


def fuse_experts(tensors):
    out = {}
    layers = {k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k}
    for k, v in tensors.items():
        if ".mlp.experts." not in k:
            out[k] = v
    for prefix in layers:
        E = len({k.split(".")[5] for k in tensors if k.startswith(prefix + ".mlp.experts.")})
        gu = [torch.cat([tensors[f"{prefix}.mlp.experts.{e}.gate_proj.weight"],
                         tensors[f"{prefix}.mlp.experts.{e}.up_proj.weight"]]) for e in range(E)]
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(gu)
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack(
            [tensors[f"{prefix}.mlp.experts.{e}.down_proj.weight"] for e in range(E)])
    return out


def multimodal(tensors):
    out = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
           for k, v in tensors.items()}
    out["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    out["model.language_model.visual.merger.weight"] = torch.zeros(4, 4)  # mtp.* is loaded now (test_mtp.py)
    return out


def test_fused_experts_checkpoint(reference, prompt_ids, tmp_path):
    from pathlib import Path

    _rewrite(Path(reference[1]), tmp_path / "fused", fuse_experts)
    assert not any(".experts.0." in k for k in load_file(str(tmp_path / "fused" / "model.safetensors")))
    model = load(tmp_path / "fused")
    diff = (model.logits(prompt_ids) - ref_logits(reference[0], prompt_ids)).abs().max().item()
    assert diff <= TOL


def test_multimodal_prefixed_checkpoint(reference, prompt_ids, tmp_path):
    from pathlib import Path

    _rewrite(Path(reference[1]), tmp_path / "mm", multimodal)
    cfg = json.loads((tmp_path / "mm" / "config.json").read_text())
    wrapped = {"model_type": "qwen3_5_moe", "text_config": cfg, "vision_config": {"depth": 1}}
    (tmp_path / "mm" / "config.json").write_text(json.dumps(wrapped))
    with pytest.warns(UserWarning, match="skipped 2 tensors outside the text model"):
        model = CloverModel.from_pretrained(tmp_path / "mm")
    diff = (model.logits(prompt_ids) - ref_logits(reference[0], prompt_ids)).abs().max().item()
    assert diff <= TOL
