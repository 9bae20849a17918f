"""Writing a block-scaled FP8 checkpoint from any checkpoint the loader reads, in the layout of
Qwen's FP8 releases: every linear weight as float8_e4m3fn with ``weight_scale_inv`` per block,
the routed experts per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``), everything that
is not a linear weight (norms, embeddings, the router, conv and GDN parameters) and the modules
Qwen leaves unquantized (``SKIPPED``) as they were; config.json gains the quantization_config.
Used to make FP8 test checkpoints, and to turn a trained Clover into an FP8 release. Streams
tensor by tensor; nothing is held but the shard being written."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from clover_kernels.fp8 import naive

from .. import loading
from ..errors import InputError, count
from .checkpoint import QWEN_UNQUANTIZED, scale_name

SKIPPED = QWEN_UNQUANTIZED
FUSED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)(?:\.weight)?$")


def quantize_checkpoint(src, dst, block=(128, 128), scale_dtype=torch.float32, skipped=SKIPPED,
                        max_shard_bytes: int = 5 << 30) -> Path:
    """``src`` (a model directory) written to ``dst`` as an FP8 checkpoint; returns ``dst``."""
    src, dst = Path(src), Path(dst)
    if not isinstance(block, (list, tuple)) or len(block) != 2:
        raise InputError(f"quantize_checkpoint block={block!r}: expected two block sizes (rows, columns)")
    block = tuple(count("quantize_checkpoint block", b) for b in block)
    max_shard_bytes = count("quantize_checkpoint max_shard_bytes", max_shard_bytes)
    loading.load_config(src)  # the same checks and messages as loading it
    if dst.resolve() == src.resolve():
        raise ValueError(f"quantize_checkpoint: the destination {dst} is the source")
    files = loading.checkpoint_files(src)
    dst.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(dst, max_shard_bytes)
    left = set()
    handles = {}
    for name, file in files.items():
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        tensor = handles[file].get_tensor(name)
        for out_name, out in _converted(name, tensor, block, scale_dtype, skipped, left):
            writer.add(out_name, out)
    writer.close()
    _write_config(src, dst, block, sorted(left))
    for extra in src.iterdir():  # tokenizer, generation_config.json, chat template, model card
        if extra.is_file() and extra.name != "config.json" and not extra.name.startswith("model"):
            shutil.copy2(extra, dst / extra.name)
    return dst


def _converted(name: str, tensor: torch.Tensor, block, scale_dtype, skipped, left: set):
    """(name, tensor) pairs written for one source tensor."""
    fused = FUSED.match(name)
    if fused is not None:  # un-fused: Qwen's FP8 layout is per expert
        prefix, I = fused["prefix"], tensor.shape[1] // 2
        for e, matrix in enumerate(tensor):
            parts = {"gate": matrix[:I], "up": matrix[I:]} if fused["kind"] == "gate_up_proj" else {"down": matrix}
            for part, w in parts.items():
                yield from _quantized(f"{prefix}.{e}.{part}_proj.weight", w, block, scale_dtype)
        return
    if name.endswith(".weight") and tensor.dim() == 2 and tensor.is_floating_point():
        if any(s in name for s in skipped):
            left.add(name.removesuffix(".weight"))
        else:
            yield from _quantized(name, tensor, block, scale_dtype)
            return
    yield name, tensor


def _quantized(name: str, w: torch.Tensor, block, scale_dtype):
    q, scale = naive.quantize(w, block, scale_dtype)
    yield name, q
    yield scale_name(name), scale


def _write_config(src: Path, dst: Path, block, left: list[str]) -> None:
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "modules_to_not_convert": left}
    (dst / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


class _ShardWriter:
    """Tensors written to model.safetensors, or to numbered shards with an index past the limit."""

    def __init__(self, path: Path, limit: int):
        self.path, self.limit = path, limit
        self.current, self.size, self.shards = {}, 0, []
        for stale in list(path.glob("model*.safetensors")) + [path / "model.safetensors.index.json"]:
            stale.unlink(missing_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.size + nbytes > self.limit:
            self._flush()
        self.current[name] = tensor.contiguous()
        self.size += nbytes

    def _flush(self) -> None:
        file = self.path / f"model-part-{len(self.shards) + 1:05d}.safetensors"
        save_file(self.current, str(file), metadata={"format": "pt"})
        self.shards.append((file, list(self.current)))
        self.current, self.size = {}, 0

    def close(self) -> None:
        if not self.shards:
            save_file(self.current, str(self.path / "model.safetensors"), metadata={"format": "pt"})
            return
        self._flush()
        n = len(self.shards)
        weight_map = {}
        for i, (file, names) in enumerate(self.shards, 1):
            final = self.path / f"model-{i:05d}-of-{n:05d}.safetensors"
            file.rename(final)
            weight_map.update({name: final.name for name in names})
        index = {"metadata": {}, "weight_map": weight_map}
        (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
