"""Checkpoint tensor names: other spellings -> this project's parameter names (the one table the
loader reads them through), and back to the release's names and shapes for writing (spec 3.2.1)."""
from __future__ import annotations

import re

import torch

# Other spellings of checkpoint names -> this project's names: the one place such mappings live.
NAME_TABLE = {
    "model.language_model.": "model.",  # multimodal Qwen3.5/3.6 checkpoints
}
# Clover's preview weights (spec 3.2, 3.2.1): the release's names (what clover_lab writes) -> the
# parameters, whose own names (the spec's earlier ones) stay readable. A checkpoint without them
# gets the spec's defaults.
RELEASE_NAMES = {
    "linear_attn.conv_right_weight": "linear_attn.conv1d_right.weight",
    "linear_attn.bd_softmax_logit_scale": "linear_attn.block_scale",
    "linear_attn.bd_softmax_history_bias": "linear_attn.history_bias",
    "linear_attn.bd_softmax_history_c": "linear_attn.history_log_n",
}
PREVIEW_PARAMS = tuple(RELEASE_NAMES.values())
_PARAM_TO_RELEASE = {param: release for release, param in RELEASE_NAMES.items()}
_LAYER_SUFFIX = re.compile(r"^(model\.layers\.\d+\.)(.+)$")
SKIPPED_PREFIXES = ("model.visual.", "model.language_model.visual.")
# the multi-token-prediction head (``model/prediction_head.py``): loaded into ``CloverModel.mtp`` under its own names
MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def mtp_layers(names) -> int | None:
    """How many MTP decoder layers the stored ``names`` hold (``mtp.layers.{j}.*``), 0 for an MTP
    head without layers (an incomplete one, refused later), None when they hold no ``mtp.*`` at all."""
    found = [n for n in names if (canonical_name(n) or "").startswith("mtp.")]
    if not found:
        return None
    return max((int(mt.group(1)) + 1 for n in found if (mt := MTP_LAYER.match(canonical_name(n)))), default=0)


def canonical_name(name: str) -> str | None:
    """The project's name for a checkpoint tensor, or None when it is skipped."""
    for old, new in NAME_TABLE.items():
        if name.startswith(old):
            name = new + name[len(old):]
    if name.startswith(SKIPPED_PREFIXES):
        return None
    if (mt := _LAYER_SUFFIX.match(name)) is not None and mt.group(2) in RELEASE_NAMES:
        return mt.group(1) + RELEASE_NAMES[mt.group(2)]
    return name


def preview_shapes(name: str, shape: tuple) -> list[tuple] | None:
    """The stored shapes accepted for the parameter ``name`` of ``shape`` when it is a preview
    weight (spec 3.2.1: right taps [conv_dim, K-1] or [conv_dim, 1, K-1], each softmax parameter
    [H_v] or one value for every head), else None."""
    mt = _LAYER_SUFFIX.match(name)
    if mt is None or mt.group(2) not in PREVIEW_PARAMS:
        return None
    if mt.group(2) == "linear_attn.conv1d_right.weight":
        return [(shape[0], shape[2]), tuple(shape)]
    return [tuple(shape), (), (1,)]


def stored_form(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A parameter as the release stores it: its name and shape there (right taps [conv_dim, K-1])."""
    mt = _LAYER_SUFFIX.match(name)
    if mt is None or mt.group(2) not in _PARAM_TO_RELEASE:
        return name, tensor
    if mt.group(2) == "linear_attn.conv1d_right.weight":
        tensor = tensor[:, 0]
    return mt.group(1) + _PARAM_TO_RELEASE[mt.group(2)], tensor
