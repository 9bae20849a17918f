"""``load``: an Engine from a Hugging Face model directory (or the embedded default model), with
the defaults of its generation_config.json, its weights placed on one device or over several."""
from __future__ import annotations

import os

import torch

from .. import defaults as checkpoint_defaults
from .. import loading
from ..errors import flag
from ..load_checks import resolve_device
from ..model import CloverModel
from ..placement import plan_placement
from ..placement.plan import check_usable
from ..sampling import SamplerSettings
from .attributes import plain_int
from .engine import DEFAULT_MAX_NEW_TOKENS, Engine
from .requests import GenerationError, check_coreset


def load(path=None, device=None, dtype=None, *, device_map=None, max_memory: dict | None = None,
         keep_fp8: bool | None = None, coreset_size: int | None = None, pin_memory: bool = False,
         progress: bool | None = None, check_finite: bool | None = None) -> Engine:
    """An Engine over the model (and tokenizer, when present) in the Hugging Face directory ``path``,
    with the defaults of its generation_config.json. ``check_finite``: refuse weights holding NaN
    or inf (default: for checkpoints up to ``loading.CHECK_FINITE_MAX_BYTES``).

    With no path: ``$CLOVER_LAB_MODEL`` when set, else the embedded default model
    (``assets/clover-stdlib``). Without one that is a FileNotFoundError saying so; there is
    deliberately no random-weights fallback, whose output would look like a broken model.

    ``device``: one device for the whole model. ``device_map``: "auto" (planned by accelerate
    within ``max_memory``, e.g. ``{0: "22GiB", 1: "22GiB", "cpu": "120GiB"}``) or a dict of
    module name -> device; routed experts that do not fit stay in host memory and are staged onto
    their layer's GPU when routed (``clover_lab/placement``). ``coreset_size``: the engine's
    default expert coreset, and the staging room the plan reserves for it. ``pin_memory``:
    offloaded experts in page-locked memory. ``keep_fp8``: an FP8 checkpoint's linears and experts
    stay FP8 (default: when they run on CUDA) or are dequantized as they load. ``progress``: a
    progress bar (default: for checkpoints over 1 GB)."""
    keep_fp8, progress, check_finite = (flag(n, v) for n, v in (("keep_fp8", keep_fp8), ("progress", progress),
                                                               ("check_finite", check_finite)))
    pin_memory = flag("pin_memory", pin_memory, none=False)
    if device_map is None:
        resolve_device(device)  # before anything is read: an unknown or unusable device, or meta
        if max_memory is not None:
            raise loading.CheckpointError("max_memory bounds the plan of device_map='auto'; without a device_map "
                                          "it would be ignored: pass device_map='auto' too, or drop it")
    else:
        check_usable(device_map, max_memory)
    if path is None:
        path = os.environ.get("CLOVER_LAB_MODEL") or loading.default_model_dir()
        if path is None:
            raise FileNotFoundError(
                "no default model found (looked for a model directory in "
                + ", ".join(str(d) for d in loading.DEFAULT_MODEL_ROOTS)
                + "); pass a model directory: clover_lab.load('path/to/model'), or set CLOVER_LAB_MODEL")
    if coreset_size is not None:  # the argument's own error, before the weights are read
        if isinstance(plain_int(coreset_size), bool) or not isinstance(plain_int(coreset_size), int):
            raise GenerationError(f"load(coreset_size={coreset_size!r}): expected an int (or None for no coreset)")
        try:
            check_coreset(loading.load_config(path), plain_int(coreset_size))
        except GenerationError as e:
            raise GenerationError(f"load(coreset_size={coreset_size!r}): {e}") from None
    placement = None
    if device_map is not None:
        if device is not None:
            raise ValueError("load: pass device (one device) or device_map (placed over devices), not both")
        placement = _planner(device_map, max_memory, coreset_size, pin_memory)
        if keep_fp8 is None:
            keep_fp8 = torch.cuda.is_available() and (device_map == "auto" or _names_a_gpu(device_map))
    model = CloverModel.from_pretrained(path, device=device, dtype=dtype, keep_fp8=keep_fp8, progress=progress,
                                        placement=placement, check_finite=check_finite)
    generation = loading.load_generation_config(path, SamplerSettings.names())
    engine = Engine(model, loading.load_tokenizer(path),
                    max_new_tokens=generation.pop("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
    try:
        defaults = checkpoint_defaults.apply(engine, model.config, generation, SamplerSettings, coreset_size)
        engine.settings = SamplerSettings(**defaults)
        check_coreset(model.config, engine.settings.coreset_size)
    except (TypeError, ValueError) as e:
        where = "/generation_config.json" if os.path.isfile(os.path.join(path, "generation_config.json")) else \
            " (its sampler defaults)"
        raise loading.CheckpointError(f"{path}{where}: {e}") from None
    return engine


def _planner(device_map, max_memory, coreset_size, pin_memory):
    """The loader's placement callable: (meta model, dtype) -> Placement."""
    def plan(model, dtype):
        placed = plan_placement(model, device_map, max_memory, dtype, coreset_size or 0)
        placed.pin_memory = pin_memory
        return placed

    return plan


def _names_a_gpu(device_map) -> bool:
    return isinstance(device_map, dict) and any(
        (isinstance(v, int) and not isinstance(v, bool)) or str(v).startswith("cuda") for v in device_map.values())
