"""CloverModel -> Hugging Face directory: config.json and the weights as safetensors, one file or
shards with an index (what ``loading.py`` reads back), in the release's layout (spec 3.2.1: its
architecture and its names of the preview weights).

A save never destroys the checkpoint it replaces: the new files are written under temporary
names beside the old ones and put in place together at the end, the index last, the old shards
removed only after that (``writes.FileSet``); a save stopped by an error, a full disk or Ctrl-C
leaves the directory as it was. Files that are not the checkpoint's (a tokenizer, a model card)
stay beside it."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from clover_lab.checkpoint.loading import KEPT_DTYPES
from clover_lab.checkpoint.names import stored_form
from clover_lab.errors import CheckpointError
from clover_lab.writes import FileSet

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
DEFAULT_SHARD_BYTES = 5 << 30


def save_model(model, path, max_shard_bytes: int | None = None) -> None:
    """Write config.json and the weights (fused experts) as one file or as shards with an index."""
    path = Path(path)
    with FileSet(path) as files:
        stage_model(model, files, path, max_shard_bytes)


def stage_model(model, files: FileSet, path: Path, max_shard_bytes: int | None = None) -> None:
    """The files of ``save_model`` written into the set ``files`` (put in place at its commit),
    so that a caller can commit other files with them (a training run's state)."""
    kept = [name for name, p in model.named_parameters() if p.dtype in KEPT_DTYPES]
    if kept:
        raise CheckpointError(f"save_pretrained: the model keeps {len(kept)} weights in FP8 (e.g. {kept[0]!r}), which "
                              f"this writer does not store; load it with keep_fp8=False to save it dequantized, or "
                              f"write an FP8 checkpoint with clover_lab.checkpoint.quantize.quantize_checkpoint")
    config = model.config.replace(dtype=str(model.dtype).removeprefix("torch."))
    files.path(path / "config.json").write_text(config.to_json())
    writer = ShardWriter(files, path, max_shard_bytes or DEFAULT_SHARD_BYTES)
    for name, p in model.named_parameters():
        writer.add(*stored_form(name, p.detach().to("cpu").contiguous()))
    writer.close()


class ShardWriter:
    """Tensors streamed into model.safetensors, or past ``limit`` bytes into numbered shards with
    an index, all as temporaries of ``files``; ``close`` binds them to their final names (the
    index last) and marks the previous checkpoint's weight files stale."""

    def __init__(self, files: FileSet, path: Path, limit: int):
        self.files, self.path, self.limit = files, Path(path), limit
        self.current: dict[str, torch.Tensor] = {}
        self.size = self.total = 0
        self.shards: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.size + nbytes > self.limit:
            self._flush()
        self.current[name] = tensor.contiguous()
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        tmp = self.files.temp(self.path / f"model-part-{len(self.shards) + 1:05d}.safetensors")
        save_file(self.current, str(tmp), metadata={"format": "pt"})
        self.shards.append((tmp, list(self.current)))
        self.current, self.size = {}, 0

    def close(self) -> None:
        for stale in previous_weight_files(self.path):
            self.files.remove(stale)
        if not self.shards:
            save_file(self.current, str(self.files.path(self.path / SINGLE)), metadata={"format": "pt"})
            return
        self._flush()
        n, weight_map = len(self.shards), {}
        for i, (tmp, names) in enumerate(self.shards, 1):
            final = self.path / f"model-{i:05d}-of-{n:05d}.safetensors"
            self.files.put(tmp, final)
            weight_map.update({name: final.name for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        self.files.path(self.path / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def previous_weight_files(path: Path) -> list[Path]:
    """The weight files of the checkpoint in ``path`` now: model.safetensors, the index and the
    shards it names, and any file named like a shard."""
    found = [path / SINGLE, path / INDEX]
    try:
        found += [path / shard for shard in set(json.loads((path / INDEX).read_text())["weight_map"].values())]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # no index, or a damaged one: the files named like shards below
    if path.is_dir():
        found += [p for p in path.iterdir() if SHARD.fullmatch(p.name)]
    return [p for p in dict.fromkeys(found) if p.is_file() and p.parent == path]
