"""CloverModel -> Hugging Face directory: config.json and the weights as safetensors, one file or
shards with an index (what ``loading.py`` reads back), in the release's layout (spec 3.2.1: its
architecture and its names of the preview weights)."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from .errors import CheckpointError
from .loading import KEPT_DTYPES
from .names import stored_form


def save_model(model, path, max_shard_bytes: int | None = None) -> None:
    """Write config.json and the weights (fused experts) as one file or as shards with an index."""
    kept = [name for name, p in model.named_parameters() if p.dtype in KEPT_DTYPES]
    if kept:
        raise CheckpointError(f"save_pretrained: the model keeps {len(kept)} weights in FP8 (e.g. {kept[0]!r}), which "
                              f"this writer does not store; load it with keep_fp8=False to save it dequantized, or "
                              f"write an FP8 checkpoint with clover_lab.fp8.quantize.quantize_checkpoint")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config.replace(dtype=str(model.dtype).removeprefix("torch."))
    config.save(path)
    tensors = dict(stored_form(name, p.detach().to("cpu")) for name, p in model.named_parameters())
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    limit = max_shard_bytes or (5 << 30)
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    for stale in list(path.glob("model*.safetensors")) + [path / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata=metadata)
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
