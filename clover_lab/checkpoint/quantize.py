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

from clover_kernels.fp8 import naive
from clover_lab.checkpoint import loading
from clover_lab.checkpoint.fp8 import QWEN_UNQUANTIZED, scale_name
from clover_lab.checkpoint.saving import ShardWriter
from clover_lab.errors import InputError, count
from clover_lab.writes import FileSet, check_writable, refuse_same

SKIPPED = QWEN_UNQUANTIZED
FUSED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)(?:\.weight)?$")


def quantize_checkpoint(src, dst, block=(128, 128), scale_dtype=torch.float32, skipped=SKIPPED,
                        max_shard_bytes: int = 5 << 30) -> Path:
    """``src`` (a model directory) written to ``dst`` as an FP8 checkpoint; returns ``dst``. The
    new files are put in place together at the end (``writes.FileSet``): a failed or interrupted
    run leaves ``dst`` as it was."""
    src, dst = Path(src), Path(dst)
    if not isinstance(block, (list, tuple)) or len(block) != 2:
        raise InputError(f"quantize_checkpoint block={block!r}: expected two block sizes (rows, columns)")
    block = tuple(count("quantize_checkpoint block", b) for b in block)
    max_shard_bytes = count("quantize_checkpoint max_shard_bytes", max_shard_bytes)
    loading.load_config(src)  # the same checks and messages as loading it
    refuse_same(dst, src, "quantize_checkpoint")
    check_writable(dst, what="quantize_checkpoint: the destination")  # now, not a shard in
    files = loading.checkpoint_files(src)
    with FileSet(dst) as out:
        writer = ShardWriter(out, dst, max_shard_bytes)
        left = set()
        handles = {}
        for name, file in files.items():
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt")
            tensor = handles[file].get_tensor(name)
            for out_name, tensor_out in _converted(name, tensor, block, scale_dtype, skipped, left):
                writer.add(out_name, tensor_out)
        writer.close()
        _write_config(src, out.path(dst / "config.json"), block, sorted(left))
        for extra in src.iterdir():  # tokenizer, generation_config.json, chat template, model card
            if extra.is_file() and extra.name != "config.json" and not extra.name.startswith("model"):
                shutil.copy2(extra, out.path(dst / extra.name))
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


def _write_config(src: Path, dest: Path, block, left: list[str]) -> None:
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "modules_to_not_convert": left}
    dest.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
