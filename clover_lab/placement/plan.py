"""Where each part of a model lives and runs, planned with accelerate.

A placement is made of units, the pieces that move whole: the embedding, each decoder layer
without its routed experts (its *trunk*: attention or GDN, norms, router, shared expert), each
layer's routed experts, the final norm and the LM head. ``device_map="auto"`` asks accelerate's
``infer_auto_device_map`` to fill the devices in order (GPU 0, 1, ..., then the CPU) with the
units listed trunks first, experts last: every trunk lands on a GPU when they fit (they are ~7% of
the 35B model), then the experts fill what is left layer by layer, and the experts that do not
fit stay in host memory. A dict maps module names to devices the way accelerate's device maps do
(the longest matching prefix wins: ``{"": 0, "model.layers.30.mlp.experts": "cpu"}``).

How units run: a trunk runs where it lies (a GPU, or the CPU); a layer's experts run on their own
device when it is a GPU (the activations hop there and back), and when they lie in host memory
("cpu") while their layer runs on a GPU, or are marked "offload", an ``ExpertStore`` stages the
experts each forward routes to onto the layer's device (with an expert coreset, the block's
coreset once per block). Planning reserves room on each device that stages offloaded experts for
that: one layer's experts (a prefill chunk routes to nearly all of them) plus ``coreset_size``
experts per offloaded layer.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from clover_lab.checkpoint.fp8 import QWEN_UNQUANTIZED
from clover_lab.checkpoint.loading import resolve_device
from clover_lab.config import CloverConfig
from clover_lab.errors import CheckpointError
from clover_lab.model.layers.fp8_linear import FP8Experts, FP8Linear
from clover_lab.model.layers.linear import Linear
from clover_lab.model.layers.moe import Experts
from clover_lab.placement.offload import ElsewhereExperts, ExpertStore
from clover_lab.placement.staging import Staging, pin_in_place

OFFLOAD = "offload"  # a device_map value: host memory, staged onto the layer's device when routed
CPU = torch.device("cpu")


class _Trunk(nn.Module):
    """A decoder layer without its routed experts: the unit accelerate places for a layer."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        for name, child in layer.named_children():
            if name != "mlp":
                self.add_module(name, child)
        for name, child in layer.mlp.named_children():
            if name != "experts":
                self.add_module(f"mlp_{name}", child)


def units(model) -> dict[str, nn.Module]:
    """Unit name (the model's module name) -> module, in planning order: trunks first, experts last."""
    layers = model.model.layers
    out = {"model.embed_tokens": model.model.embed_tokens}
    out.update({f"model.layers.{i}": _Trunk(layer) for i, layer in enumerate(layers)})
    out.update({"model.norm": model.model.norm, "lm_head": model.lm_head})
    out.update({f"model.layers.{i}.mlp.experts": layer.mlp.experts for i, layer in enumerate(layers)})
    return out


def unit_bytes(model, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of each unit once loaded in ``dtype`` (FP8 weights at one byte)."""
    from accelerate.utils import compute_module_sizes

    return {name: compute_module_sizes(m, dtype=dtype)[""] for name, m in units(model).items()}


def as_device(value, what: str):
    """A device_map value as a torch.device, or OFFLOAD."""
    if value == OFFLOAD:
        return OFFLOAD
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return torch.device("cuda", value)
    try:
        device = None if isinstance(value, (bool, int)) else torch.device(value)
    except (TypeError, RuntimeError, ValueError):
        device = None
    if device is not None and device.type == "meta":
        raise CheckpointError(f"device_map: {what} -> 'meta' holds shapes but no weights, so nothing could run; "
                              f"place it on a GPU index, 'cuda:N', 'cpu' or 'offload'")
    if device is None or device.type not in ("cpu", "cuda"):
        raise CheckpointError(f"device_map: {what} -> {value!r} is not a device clover_lab places on "
                              f"(a GPU index, 'cuda:N', 'cpu' or 'offload'; 'disk' is not supported)")
    return device


@dataclass
class Placement:
    """Where each unit's weights lie (``storage``) and where it runs (``compute``)."""

    storage: dict[str, object]  # unit -> torch.device, or OFFLOAD
    compute: dict[str, torch.device]
    sizes: dict[str, int] = field(default_factory=dict)  # unit -> bytes, when planned from a model
    pin_memory: bool = False  # offloaded experts page-locked in place at load (asynchronous staging)

    @classmethod
    def from_map(cls, model, device_map: dict, sizes: dict | None = None) -> "Placement":
        """Every unit of ``model`` placed by ``device_map`` (longest matching key wins)."""
        names = list(units(model))
        if not isinstance(device_map, dict):
            raise CheckpointError(f"device_map: expected 'auto' or a dict of module name -> device, got "
                                  f"{type(device_map).__name__}")
        for key in device_map:
            if not isinstance(key, str) or not (key == "" or any(n == key or n.startswith(key + ".") for n in names)):
                deeper = isinstance(key, str) and any(key.startswith(n + ".") for n in names)
                raise CheckpointError(f"device_map: key {key!r} " + (
                    "splits a unit: clover_lab places the embedding, each layer, each layer's experts "
                    "(model.layers.N.mlp.experts), model.norm and lm_head whole" if deeper else
                    "names no module of this model"))
        storage = {}
        for name in names:
            keys = [k for k in device_map if k == "" or name == k or name.startswith(k + ".")]
            if not keys:
                raise CheckpointError(f"device_map: nothing places {name!r} (add it, or a \"\" entry)")
            key = max(keys, key=len)
            storage[name] = as_device(device_map[key], key or '""')
        return cls._with_compute(storage, sizes or {})

    @classmethod
    def _with_compute(cls, storage: dict, sizes: dict) -> "Placement":
        compute = {}
        for name, where in storage.items():
            layer = name.removesuffix(".mlp.experts")
            if layer != name and (where == OFFLOAD or (where == CPU and storage[layer] != CPU)):
                compute[name] = storage[layer] if storage[layer] != OFFLOAD else CPU
            elif where == OFFLOAD:  # only experts can be staged: anything else runs in host memory
                raise CheckpointError(f"device_map: {name!r} -> 'offload': only a layer's experts "
                                      f"(model.layers.N.mlp.experts) are staged from host memory")
            else:
                compute[name] = where
        return cls(storage, compute, sizes)

    # ------------------------------------------------------------------ reading it
    def unit_of(self, param_name: str) -> str:
        best = ""
        for name in self.storage:
            if (param_name == name or param_name.startswith(name + ".")) and len(name) > len(best):
                best = name
        if not best:
            raise KeyError(f"no unit holds {param_name!r}")
        return best

    def device_of(self, param_name: str) -> torch.device:
        """Where a parameter's weights are loaded (an offloaded expert tensor: host memory)."""
        where = self.storage[self.unit_of(param_name)]
        return CPU if where == OFFLOAD else where

    def offloaded(self) -> list[str]:
        """The experts units staged from host memory: marked "offload", or in host memory ("cpu")
        while their layer runs on a GPU."""
        return [n for n, where in self.storage.items()
                if where == OFFLOAD or (where == CPU and self.compute[n] != CPU)]

    @property
    def devices(self) -> list[torch.device]:
        return sorted({d for d in self.compute.values()}, key=str)

    @property
    def graph_safe(self) -> bool:
        """One device and nothing staged: the engine's static steps and CUDA graphs apply."""
        return len(self.devices) == 1 and not self.offloaded()

    def device_map(self) -> dict[str, str]:
        """The placement as an accelerate-style device map (unit -> "cuda:0" / "cpu" / "offload")."""
        return {n: str(where) for n, where in self.storage.items()}

    def bytes_by_device(self) -> dict[str, int]:
        """Weight bytes per storage place ("offload" counted as "cpu")."""
        out: dict[str, int] = {}
        for name, where in self.storage.items():
            key = "cpu" if where == OFFLOAD else str(where)
            out[key] = out.get(key, 0) + self.sizes.get(name, 0)
        return out

    # ------------------------------------------------------------------ the model
    def apply(self, model) -> None:
        """After loading: each layer told where it runs, offloaded experts given their store (one
        staging per device, each store linked to the next offloaded layer on its device, which it
        prefetches); with ``pin_memory`` on CUDA the offloaded experts are page-locked in place."""
        staging, last = {}, {}
        offloaded = set(self.offloaded())
        for i, layer in enumerate(model.model.layers):
            layer.device = self.compute[f"model.layers.{i}"]
            name = f"model.layers.{i}.mlp.experts"
            experts = layer.mlp.experts
            if name in offloaded:
                device = self.compute[name]
                if self.pin_memory and device.type == "cuda":
                    pin_in_place(experts, experts.expert_tensors())
                if device not in staging:
                    staging[device] = Staging(device, self.pin_memory)
                experts.store = ExpertStore(device, pin_memory=self.pin_memory, staging=staging[device])
                if device in last:
                    last[device].next = experts.store
                last[device] = experts.store
            elif self.compute[name] != layer.device:
                experts.store = ElsewhereExperts(self.compute[name])
        model.placement = self


def plan_placement(model, device_map="auto", max_memory: dict | None = None, dtype: torch.dtype = torch.bfloat16,
                   coreset_size: int = 0) -> Placement:
    """A placement for ``model`` (on the meta device): ``device_map`` "auto" (accelerate plans it
    within ``max_memory``, accelerate's format: {0: "70GiB", 1: 80e9, "cpu": "200GiB"}; default:
    what the devices have free) or a dict as accelerate's device maps."""
    sizes = unit_bytes(model, dtype)
    if device_map != "auto":
        return Placement.from_map(model, device_map, sizes)
    from accelerate.utils import get_max_memory, infer_auto_device_map

    with _quiet_accelerate():
        budgets = _budgets(max_memory, get_max_memory)
    view = nn.Module()
    for i, (name, module) in enumerate(units(model).items()):
        view.add_module(f"u{i}", module)
    names = list(units(model))
    expert = max(sizes[n] for n in names if n.endswith(".mlp.experts")) // model.config.num_experts
    budget, placement = dict(budgets), None
    for _ in range(len(names) + 1):  # reserve staging room until the plan stops moving
        planned = {names[int(k[1:])]: v for k, v in _quiet_plan(infer_auto_device_map, view, budget, dtype).items()}
        missing = [n for n in names if planned.get(n, "disk") == "disk"]  # accelerate's last resort
        if missing:
            gib = {k: round(v / 2**30, 1) for k, v in budget.items()}
            raise CheckpointError(f"device_map='auto': {missing[0]!r} ({sizes[missing[0]] / 2**30:.2f} GiB) fits on no "
                                  f"device within max_memory (GiB, staging room taken off): {gib}")
        storage = {n: as_device(v, n) for n, v in planned.items()}
        placement = Placement._with_compute(storage, sizes)
        reserve = _staging_reserve(placement, sizes, expert, coreset_size)
        next_budget = {d: budgets[d] - reserve.get(d, 0) for d in budgets}
        if next_budget == budget:
            break
        budget = next_budget
    return placement


def check_usable(device_map, max_memory) -> None:
    """Before anything is read (``clover_lab.load``): ``max_memory`` only with ``device_map="auto"``
    (the plan it bounds), and every device the map or the budget names usable here (a GPU on a
    torch without CUDA is the one-line CheckpointError a ``device="cuda"`` gets)."""
    if max_memory is not None and device_map != "auto":
        raise CheckpointError(f"max_memory bounds the plan of device_map='auto'; with device_map={device_map!r} "
                              f"it would be ignored: drop it, or use device_map='auto'")
    if isinstance(device_map, dict):
        devices = [as_device(v, k or '""' if isinstance(k, str) else repr(k)) for k, v in device_map.items()]
    elif device_map == "auto" and max_memory is not None:
        devices = [torch.device("cuda", k) for k in _keys(max_memory) if k != "cpu"]
        _check_sizes(max_memory)
    elif device_map == "auto":
        devices = []
    else:
        raise CheckpointError(f"device_map: expected 'auto' or a dict of module name -> device, got "
                              f"{type(device_map).__name__} {device_map!r}")
    for device in dict.fromkeys(devices):
        if device != OFFLOAD:
            resolve_device(device)


def _keys(max_memory) -> list:
    """max_memory's devices in accelerate's key form (0, 1, "cpu"), each checked."""
    if not isinstance(max_memory, dict):
        raise CheckpointError(f"max_memory: expected a dict of device -> size, got {type(max_memory).__name__}")
    out = []
    for key in max_memory:
        if isinstance(key, str) and key.startswith("cuda"):
            index = key.split(":", 1)[1] if ":" in key else "0"
            key = int(index) if index.isdigit() else key
        if key != "cpu" and (not isinstance(key, int) or isinstance(key, bool) or key < 0):
            raise CheckpointError(f"max_memory: device {key!r} is not one clover_lab places on (GPU indices, "
                                  f"'cuda:N' or 'cpu')")
        out.append(key)
    return out


def _check_sizes(max_memory: dict) -> None:
    """Every budget a size: bytes (a positive int) or a string accelerate reads ("22GiB", "500MB");
    ``{"cpu": None}`` was a TypeError from deep inside accelerate's planner."""
    from accelerate.utils import convert_file_size_to_int

    for key, size in max_memory.items():
        try:
            ok = not isinstance(size, bool) and isinstance(size, (int, str)) and convert_file_size_to_int(size) > 0
        except (ValueError, TypeError):
            ok = False
        if not ok:
            raise CheckpointError(f"max_memory[{key!r}]={size!r}: expected a size, bytes as a positive int or a "
                                  f"string like '22GiB' or '500MB'")


def _budgets(max_memory: dict | None, get_max_memory) -> dict:
    """accelerate's max_memory with devices in its key form (0, 1, "cpu") and sizes in bytes
    ("20GiB" strings read by accelerate). None: what the devices have free, GPUs at 90% (room
    for the cache and activations; pass max_memory to set it)."""
    if max_memory is None:
        return {k: int(v * 0.9) if isinstance(k, int) else v for k, v in get_max_memory().items()}
    out = dict(zip(_keys(max_memory), max_memory.values()))
    try:
        return dict(get_max_memory(out))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"max_memory={max_memory!r}: {e}") from None


def _staging_reserve(placement: Placement, sizes: dict, expert_bytes: int, coreset_size: int) -> dict:
    """Per accelerate device key: room to stage one layer's experts (accelerate's own reserve on
    GPU 0) and to hold every offloaded layer's coreset, on each device that runs offloaded experts."""
    reserve: dict = {}
    for name in placement.offloaded():
        device = placement.compute[name]
        key = device.index if device.type == "cuda" else "cpu"
        if key == "cpu":
            continue
        # accelerate itself keeps the largest unit's room free on GPU 0 (its "main device")
        reserve[key] = reserve.get(key, 0 if key == 0 else sizes[name]) + coreset_size * expert_bytes
    return reserve


@contextlib.contextmanager
def _quiet_accelerate():
    # accelerate warns for every GPU index this machine lacks: expected when planning for others
    logger = logging.getLogger("accelerate.utils.modeling")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _quiet_plan(infer, view, budget, dtype):
    with _quiet_accelerate():
        return infer(view, max_memory=budget, no_split_module_classes=["_Trunk", "Experts", "FP8Experts"],
                     dtype=dtype, clean_result=False)


def meta_model(model_cls, config: CloverConfig, fp8_block: tuple[int, int] | None = None):
    """``model_cls(config)`` on the meta device; with ``fp8_block``, shaped like an FP8 release
    (every linear except those Qwen keeps in bf16, and every layer's experts, in FP8): for
    planning and memory tables without a checkpoint."""
    with torch.device("meta"):
        model = model_cls(config)
        if fp8_block is not None:
            for name, module in list(model.named_modules()):
                parent, _, leaf = name.rpartition(".")
                if type(module) is Linear and not any(s in name + "." for s in QWEN_UNQUANTIZED):
                    setattr(model.get_submodule(parent), leaf, FP8Linear.like(module, fp8_block))
                elif type(module) is Experts:
                    setattr(model.get_submodule(parent), leaf, FP8Experts(config, fp8_block))
    return model
