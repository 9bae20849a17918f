"""Hugging Face directory -> CloverModel: config.json + safetensors (single file or shards),
the tokenizer, generation_config.json and where the embedded default model lives (writing a
directory: ``saving.py``).

Loading is memory-mapped and tensor by tensor onto a model built on the ``meta`` device, so a
checkpoint never exists twice in memory; onto a GPU each tensor goes from the map to the device
as it is read, and the host keeps about one read window (RELEASE_BYTES) of mapped pages.
Per-expert and fused expert tensors are both accepted, as is the multimodal
``model.language_model.`` prefix (``model.visual.*`` is skipped); the multi-token-prediction head
(``mtp.*``, ``model/prediction_head.py``) is loaded when the checkpoint has it (config.json's
``mtp_num_hidden_layers`` follows the stored layers; a config that declares a head the weights
lack loads without one, and mode "mtp" then says so); two stored
tensors for one parameter are an error, never resolved silently. Weights holding NaN or inf are
refused (``check_finite``, on by default up to CHECK_FINITE_MAX_BYTES). Every failure names the
file and the tensor; a failed load returns nothing.

Besides the checkpoint's names and shapes (``names.py``), a load is checked against the device it
is asked to load onto (``resolve_device``) and the weights' values once read.
"""
from __future__ import annotations

import json
import logging
import os
import re
import warnings
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from clover_lab.checkpoint.fp8 import FP8Checkpoint
from clover_lab.checkpoint.names import PREVIEW_PARAMS, RELEASE_NAMES, canonical_name, mtp_layers, preview_shapes
from clover_lab.config import CloverConfig, ConfigError
from clover_lab.errors import CheckpointError, flag
from clover_lab.writes import refuse_unfinished

log = logging.getLogger("clover_lab")

SUPPORTED_DTYPES = {torch.float32, torch.float16, torch.bfloat16}
DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
               "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PER_EXPERT = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
FUSED_EXPERT = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?$")


def resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and dtype not in SUPPORTED_DTYPES:
            raise CheckpointError(f"dtype {dtype} is not supported; use one of float32, float16, bfloat16")
        return dtype
    if dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    raise CheckpointError(f"unknown dtype {dtype!r}; use one of float32, float16, bfloat16")


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Tensor name (as stored) -> the file holding it."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = {}
        for name, shard in weight_map.items():
            shard_path = path / shard
            if not shard_path.exists():
                raise CheckpointError(f"{index} names shard {shard!r} for tensor {name!r}, but {shard_path} is "
                                      f"missing: the checkpoint is incomplete")
            files[name] = shard_path
        return files
    if single.exists():
        return {name: single for name in _read_keys(single)}
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _read_keys(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


# Pages read through a shard's memory map stay resident (and count in the process's RSS) for as
# long as the shard is open, so the reader closes its shards after every this many bytes: a load
# that copies each tensor elsewhere (onto a GPU, into another dtype) then keeps about one window
# of the checkpoint on the host instead of all of it. Reopening costs one header parse.
RELEASE_BYTES = 64 << 20


class _Reader:
    """Opens shards as needed; yields tensors memory-mapped. Read failures name file and tensor.
    Tensors already returned keep their own mapping when the shards are closed."""

    def __init__(self, release_bytes: int = RELEASE_BYTES):
        self._open = {}
        self._release_bytes = release_bytes
        self._since_release = 0

    def _read(self, file: Path, name: str, what):
        try:
            if file not in self._open:
                self._open[file] = safe_open(str(file), framework="pt")
            return what(self._open[file])
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{file}: cannot read tensor {name!r} ({e})") from None

    def get(self, file: Path, name: str) -> torch.Tensor:
        if self._since_release >= self._release_bytes:
            self._open.clear()  # unmaps what no returned tensor still holds
            self._since_release = 0
        tensor = self._read(file, name, lambda f: f.get_tensor(name))
        self._since_release += tensor.numel() * tensor.element_size()
        return tensor

    def shape_dtype(self, file: Path, name: str):
        def read(f):
            sl = f.get_slice(name)
            return tuple(sl.get_shape()), sl.get_dtype()

        return self._read(file, name, read)


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                       "F8_E4M3": torch.float8_e4m3fn}  # FP8 only with its scales (fp8/checkpoint.py checks)
KEPT_DTYPES = (torch.float8_e4m3fn,)  # parameters loaded in their own dtype, not the load dtype


def load_config(path) -> CloverConfig:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory (expected a Hugging Face model directory)")
    refuse_unfinished(path)  # a save stopped while putting its files in place
    cfg = path / "config.json"
    if not cfg.exists():
        raise CheckpointError(f"{path}: no config.json")
    try:
        return CloverConfig.from_json_file(cfg)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def load_model(model_cls, path, device=None, dtype=None, progress: bool | None = None, keep_fp8: bool | None = None,
               placement=None, check_finite: bool | None = None):
    """A ``model_cls`` (CloverModel) built on the meta device from ``path``'s config.json, then
    filled tensor by tensor from the memory-mapped checkpoint, each tensor read straight onto
    ``device`` in ``dtype``. Any failure names the file and tensor, and returns nothing.

    FP8 checkpoints (``checkpoint/fp8.py``): ``keep_fp8`` keeps linears and experts stored in FP8
    as FP8 modules (default: on CUDA), else they are dequantized as they are read. ``placement``:
    a callable (meta model, dtype) -> placement (``clover_lab.placement``) that says where each
    parameter goes and is applied once the weights are in. ``check_finite``: refuse weights
    holding NaN or inf (None: when the weights take at most CHECK_FINITE_MAX_BYTES)."""
    path = Path(path)
    keep_fp8, progress, check_finite = flag("keep_fp8", keep_fp8), flag("progress", progress), \
        flag("check_finite", check_finite)  # booleans: "false" would be truthy
    device = resolve_device(device, allow_meta=True)
    config = load_config(path)
    files = checkpoint_files(path)
    config = with_stored_mtp(path, config, files)
    dtype = resolve_dtype(dtype) or resolve_dtype(config.dtype) or torch.float32
    reader = _Reader()
    fp8, files = FP8Checkpoint.inspect(path, files, reader, device.type == "cuda" if keep_fp8 is None else keep_fp8)
    names = _sort_names(path, files)
    with torch.device("meta"):
        model = model_cls(config)
    if fp8 is not None:
        fp8.convert(model, names, config)
        reader = fp8.reader(reader, dtype)
    expected = dict(model.named_parameters())
    _refuse_unexpected(path, names, expected, config.num_experts)
    plan, untrained = _plan(path, files, reader, names, expected, config)
    placed = placement(model, dtype) if placement is not None else None
    _fill(model, path, files, reader, plan, expected, dtype, placed.device_of if placed else device, progress,
          config.moe_intermediate_size)
    if fp8 is not None:
        fp8.fill_scales(model, plan, reader)
    total = sum(p.numel() * dtype.itemsize for p in expected.values())
    if device.type != "meta" and (check_finite or (check_finite is None and total <= CHECK_FINITE_MAX_BYTES)):
        refuse_nonfinite(model, files, reader, plan)
    if device.type != "meta" and config.reading("logit_scale") == "multiplier":
        refuse_unreadable_scales(model, files, plan)
    if placed is not None:
        placed.apply(model)
    model.preview_untrained = bool(untrained)  # no preview weights stored: what ``check`` refuses to rank
    if untrained:
        model.reset_preview_parameters()
        warnings.warn(f"{path}: the checkpoint has no Clover preview weights ({len(untrained)} tensors); "
                      f"they get the spec's defaults, so the preview mode is untrained", stacklevel=3)
    model.checkpoint_dir = path
    return model.eval()


def with_stored_mtp(path: Path, config: CloverConfig, files) -> CloverConfig:
    """``config`` with ``mtp_num_hidden_layers`` set to the MTP layers the checkpoint stores: a
    Qwen3.5/3.6 config declares one whether or not a converter kept the head's weights."""
    stored = mtp_layers(files)
    if stored is None and config.mtp_num_hidden_layers:
        log.info("%s: config.json declares %d MTP layer(s) but the checkpoint has no mtp.* tensors: "
                 "loaded without the head (mode 'mtp' unavailable)", path, config.mtp_num_hidden_layers)
    if stored == 0:
        raise CheckpointError(f"{path}: the checkpoint has mtp.* tensors but no mtp.layers.0.*: an MTP head has "
                              f"mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.N.*, mtp.norm")
    return config if (stored or 0) == config.mtp_num_hidden_layers else config.replace(mtp_num_hidden_layers=stored or 0)


def _sort_names(path: Path, files: dict[str, Path]):
    """Stored names sorted by canonical name into (plain, per-expert, fused); skipped ones logged."""
    skipped, plain, per_expert, fused = [], {}, {}, {}

    def put(table: dict, key, stored: str) -> None:
        if key in table:  # two stored tensors for one parameter: which one is right cannot be guessed
            raise CheckpointError(f"{path}: tensors {table[key]!r} ({files[table[key]].name}) and {stored!r} "
                                  f"({files[stored].name}) are both the parameter {canonical_name(stored)!r}; "
                                  f"keep one of them")
        table[key] = stored

    for stored in files:
        name = canonical_name(stored)
        if name is None:
            skipped.append(stored)
            continue
        if (mt := PER_EXPERT.match(name)) is not None:
            put(per_expert.setdefault(mt.group(1), {}), (int(mt.group(2)), mt.group(3)), stored)
        elif (mt := FUSED_EXPERT.match(name)) is not None:
            put(fused, f"{mt.group(1)}.{mt.group(2)}", stored)
        else:
            put(plain, name, stored)
    both = sorted(prefix for prefix in per_expert if f"{prefix}.gate_up_proj" in fused or f"{prefix}.down_proj" in fused)
    if both:
        raise CheckpointError(f"{path}: {both[0]} is stored both as fused tensors and per expert "
                              f"({len(both)} layers like it); keep one form")
    if skipped:
        log.info("skipping %d tensors outside the text model (model.visual.*)", len(skipped))
        warnings.warn(f"{path}: skipped {len(skipped)} tensors outside the text model (model.visual.*)",
                      stacklevel=4)
    return plain, per_expert, fused


def _refuse_unexpected(path: Path, names, expected: dict, num_experts: int) -> None:
    plain, per_expert, fused = names
    unexpected = [plain[n] for n in plain if n not in expected]
    unexpected += [fused[n] for n in fused if n not in expected]
    unexpected += [s for prefix, d in per_expert.items() for (e, _), s in d.items()
                   if f"{prefix}.gate_up_proj" not in expected or not 0 <= e < num_experts]
    preview = sorted(s for s in unexpected if _looks_preview(s))
    if preview:  # a preview tensor this model has no place for: an unknown name, or the wrong layer
        gdn = sorted({int(n.split("layers.")[1].split(".")[0]) for n in expected if _preview_kind(n)})
        raise CheckpointError(f"{path}: {len(preview)} preview tensor(s) this model has no place for, e.g. "
                              f"{preview[:3]}: a GDN layer's preview tensors are linear_attn."
                              f"{{{', '.join(n.removeprefix('linear_attn.') for n in RELEASE_NAMES)}}} (the spec's "
                              f"earlier names too), and the GDN layers are {gdn} (config.json's layer_types)")
    if unexpected:
        raise CheckpointError(f"{path}: {len(unexpected)} unexpected tensors, e.g. {sorted(unexpected)[:5]} "
                              f"(is the config.json the right one for this checkpoint?)")


PREVIEW_LIKE = ("linear_attn.bd_", "linear_attn.conv_right", "linear_attn.conv1d_right", "linear_attn.block_scale",
                "linear_attn.history_")


def _looks_preview(stored: str) -> bool:
    """A stored name that reads as a preview tensor (the release's prefixes, the spec's names)."""
    name = canonical_name(stored) or ""
    suffix = name.split("layers.")[-1].split(".", 1)[-1] if "layers." in name else ""
    stored_suffix = stored.split("layers.")[-1].split(".", 1)[-1] if "layers." in stored else ""
    return suffix in PREVIEW_PARAMS or stored_suffix.startswith(PREVIEW_LIKE)


def _plan(path: Path, files, reader: "_Reader", names, expected: dict, config: CloverConfig):
    """(canonical parameter name -> stored name, or per-expert {(expert, part): stored}; the
    untrained preview parameters), every stored shape and dtype checked before anything is read."""
    plain, per_expert, fused = names
    E, I, H = config.num_experts, config.moe_intermediate_size, config.hidden_size

    def check(stored: str, want_shape: tuple) -> None:
        shape, st_dtype = reader.shape_dtype(files[stored], stored)
        if st_dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{files[stored]}: tensor {stored!r} has dtype {st_dtype}; supported: "
                                  f"{', '.join(_SAFETENSORS_DTYPES)}")
        accepted = preview_shapes(canonical_name(stored), tuple(want_shape)) or [tuple(want_shape)]
        if shape not in accepted:
            raise CheckpointError(f"{files[stored]}: tensor {stored!r} has shape {list(shape)}, expected "
                                  + " or ".join(str(list(a)) for a in accepted))

    plan: dict[str, object] = {}
    missing, untrained = [], []
    for name, param in expected.items():
        if name in plain or name in fused:
            stored = plain.get(name) or fused[name]
            check(stored, param.shape)
            plan[name] = stored
        elif name.endswith((".gate_up_proj", ".down_proj")) and name.rsplit(".", 1)[0] in per_expert:
            prefix, kind = name.rsplit(".", 1)
            parts = per_expert[prefix]
            needed = [(e, w) for e in range(E) for w in (("gate", "up") if kind == "gate_up_proj" else ("down",))]
            lacking = [f"{prefix}.{e}.{w}_proj.weight" for e, w in needed if (e, w) not in parts]
            if lacking:
                missing += lacking
                continue
            for (e, w) in needed:
                check(parts[(e, w)], (I, H) if w != "down" else (H, I))
            plan[name] = {k: parts[k] for k in needed}
        elif name.split("layers.")[-1].split(".", 1)[-1] in PREVIEW_PARAMS:
            untrained.append(name)
        else:
            missing.append(name)
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} tensors missing from the checkpoint, e.g. {missing[:5]}")
    if untrained and len(untrained) < sum(1 for n in expected if _preview_kind(n) is not None):
        raise CheckpointError(partial_preview(path, untrained, expected))
    return plan, untrained


def _preview_kind(name: str) -> str | None:
    """The release's name of the preview parameter ``name`` (``bd_softmax_history_c``), or None."""
    suffix = name.split("layers.")[-1].split(".", 1)[-1]
    return next((release.removeprefix("linear_attn.") for release, param in RELEASE_NAMES.items()
                 if param == suffix), None) if suffix in PREVIEW_PARAMS else None


def partial_preview(path: Path, untrained: list[str], expected: dict) -> str:
    """The error for a checkpoint holding some of its preview tensors but not all: each missing
    one named (a converter that drops one would otherwise give a quietly worse preview, with the
    other layers' trained values beside the spec's defaults)."""
    layers = {}
    for name in expected:
        if (kind := _preview_kind(name)) is not None:
            layers.setdefault(kind, []).append(int(name.split("layers.")[1].split(".")[0]))
    parts = []
    for kind, all_layers in layers.items():
        lacking = [int(n.split("layers.")[1].split(".")[0]) for n in untrained if _preview_kind(n) == kind]
        if len(lacking) == len(all_layers):
            parts.append(f"{kind} in every GDN layer ({len(lacking)})")
        elif lacking:
            parts.append(f"{kind} in layer{'s' if len(lacking) > 1 else ''} {', '.join(map(str, lacking))}")
    first = untrained[0].rsplit(".", 2)[0] + ".linear_attn." + _preview_kind(untrained[0])
    return (f"{path}: the checkpoint holds only some of its preview tensors: missing "
            f"{'; '.join(parts)} (e.g. {first!r}). A checkpoint has all four per GDN layer "
            f"({', '.join(n.removeprefix('linear_attn.') for n in RELEASE_NAMES)}) or none (an untrained "
            f"preview, given the spec's defaults); mixing trained values with defaults would make the preview "
            f"quietly worse: convert the checkpoint again with every preview tensor")


def _fill(model, path: Path, files, reader: "_Reader", plan: dict, expected: dict, dtype, device, progress,
          moe_width: int) -> None:
    """Every parameter read onto ``device`` (or ``device(name)``: a placement) in ``dtype`` (FP8
    parameters of FP8 modules stay FP8), one tensor (or one expert) at a time."""
    from tqdm.auto import tqdm

    def dtype_of(param):
        return param.dtype if param.dtype in KEPT_DTYPES else dtype

    total = sum(p.numel() * dtype_of(p).itemsize for p in expected.values())
    show = progress if progress is not None else total > (1 << 30)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {path.name}", disable=not show)
    for name, param in expected.items():
        source = plan.get(name)
        dev, want = (device(name) if callable(device) else device), dtype_of(param)
        if source is None:  # an untrained preview weight: filled with defaults by the caller
            tensor = torch.empty(param.shape, dtype=want, device=dev)
        elif isinstance(source, str):
            tensor = reader.get(files[source], source).to(device=dev, dtype=want)
            if tensor.shape != param.shape:  # a preview weight in another accepted shape (_plan checked it)
                tensor = tensor.reshape(param.shape) if tensor.numel() == param.numel() else tensor.expand(param.shape)
                tensor = tensor.contiguous()
        else:  # per-expert tensors gathered into the fused [E, ...] parameter, one expert at a time
            tensor = torch.empty(param.shape, dtype=want, device=dev)
            for (e, w), stored in source.items():
                rows = {"gate": slice(0, moe_width), "up": slice(moe_width, None), "down": slice(None)}[w]
                tensor[e, rows].copy_(reader.get(files[stored], stored))
        _set_parameter(model, name, tensor)
        bar.update(tensor.numel() * want.itemsize)
    bar.close()


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))


def load_tokenizer(path):
    """transformers' AutoTokenizer from the model directory, or None when it has no tokenizer files.

    Never runs the directory's Python code, and never asks whether to: a custom-code release
    (an ``auto_map`` in config.json or tokenizer_config.json) made transformers ask "Do you wish
    to run the custom code? [y/N]" on every load (15 s in a terminal, a wait on input in Jupyter).
    clover_lab reads config.json itself and needs only the tokenizer's files: the tokenizer is
    loaded with ``trust_remote_code=False`` (a class of transformers' own, named by
    tokenizer_config.json), else straight from tokenizer.json; the code is mentioned once."""
    path = Path(path)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    code = remote_code(path)
    # AutoTokenizer reads config.json and warns that model_type clover_moe is unknown to it: noise
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - a tokenizer class only its own code defines
            if not code or not (path / "tokenizer.json").exists():
                raise
            log.info("%s: AutoTokenizer without the release's code failed (%s); reading tokenizer.json", path, e)
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - re-raised with the directory named
        what = f" (it names custom code, {', '.join(code)}, which clover_lab does not run)" if code else ""
        raise CheckpointError(f"{path}: tokenizer files present but unreadable{what} ({e})") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    if code and path.resolve() not in _CODE_SAID:
        _CODE_SAID.add(path.resolve())
        warnings.warn(f"{path} carries custom code ({', '.join(code)}); clover_lab never runs it: it reads "
                      f"config.json and the weights itself and the tokenizer from its files", RemoteCodeNotRun,
                      stacklevel=3)
    return tokenizer


class RemoteCodeNotRun(UserWarning):
    """A checkpoint names Python code of its own (``auto_map``), which clover_lab does not run."""


_CODE_SAID: set = set()  # directories whose code was mentioned in this process (once each)


def remote_code(path: Path) -> list[str]:
    """The Python classes a Hugging Face directory's ``auto_map`` entries name (config.json,
    tokenizer_config.json: ``"modeling_clover.CloverMoeModelLM"``); [] when none."""
    named = []
    for file in ("config.json", "tokenizer_config.json"):
        try:
            auto_map = json.loads((path / file).read_text()).get("auto_map")
        except (OSError, ValueError, AttributeError):
            continue
        refs = auto_map.values() if isinstance(auto_map, dict) else auto_map if isinstance(auto_map, list) else []
        for ref in refs:
            for one in ref if isinstance(ref, (list, tuple)) else [ref]:
                if isinstance(one, str) and one not in named:
                    named.append(one)
    return named


# --------------------------------------------------------------------------- around the weights
# Where clover_lab.load() looks for the embedded default model: a model directory (one with a
# config.json) in one of these folders, "clover-stdlib" first: the installed package's data (a
# wheel carries assets/clover-stdlib as clover_lab/assets), then the source tree's assets/.
_PACKAGE = Path(__file__).resolve().parents[1]  # clover_lab/
DEFAULT_MODEL_ROOTS = (_PACKAGE / "assets", _PACKAGE.parent / "assets")
DEFAULT_MODEL_NAME = "clover-stdlib"


def model_path(path=None) -> Path | None:
    """The model directory ``load(path)`` reads: ``path``, else ``$CLOVER_LAB_MODEL``, else the
    embedded default model (None when there is none)."""
    path = path or os.environ.get("CLOVER_LAB_MODEL") or default_model_dir()
    return None if path is None else Path(path)


def default_model_dir() -> Path | None:
    """The embedded default model's directory, or None when there is none."""
    for root in DEFAULT_MODEL_ROOTS:
        if (root / DEFAULT_MODEL_NAME / "config.json").exists():
            return root / DEFAULT_MODEL_NAME
        found = sorted(p.parent for p in root.glob("*/config.json")) if root.is_dir() else []
        if found:
            return found[0]
    return None


def load_generation_config(path, sampler_fields) -> dict:
    """What ``path``/generation_config.json sets of a generation: the sampler settings named in
    ``sampler_fields``, ``max_new_tokens``, ``eos_token_ids``, ``block_size`` and ``mask_token_id``. transformers' fields map as it
    means them (``do_sample: false`` is greedy); fields it has that Clover does not use are
    ignored. No file: an empty dict."""
    file = Path(path) / "generation_config.json"
    if not file.exists():
        return {}
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    out = {k: raw[k] for k in sampler_fields if k in raw and k != "seed"}
    if raw.get("do_sample") is False:
        out["temperature"] = 0.0
    if "max_new_tokens" in raw:
        value = raw["max_new_tokens"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{file}: max_new_tokens={value!r}: expected a positive integer")
        out["max_new_tokens"] = value
    for key, least in (("block_size", 1), ("mask_token_id", 0)):  # Clover's own generation fields
        value = raw.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise CheckpointError(f"{file}: {key}={value!r}: expected an integer >= {least}")
            out[key] = value
    if raw.get("eos_token_id") is not None:
        eos = raw["eos_token_id"]
        eos = [eos] if isinstance(eos, int) else eos
        if not isinstance(eos, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
            raise CheckpointError(f"{file}: eos_token_id={raw['eos_token_id']!r}: expected a token id or a list")
        out["eos_token_ids"] = eos
    return out


# checkpoints up to this size get their weights checked for NaN / inf by default (one extra pass
# over memory: ~1 s per GB on a CPU); bigger ones only when asked
CHECK_FINITE_MAX_BYTES = 4 << 30


def resolve_device(device, allow_meta: bool = False) -> torch.device:
    """``device`` (None: the CPU) as a torch.device that can hold the weights here, or a
    CheckpointError saying why not (unknown name, no CUDA in this torch, no such GPU, meta).
    ``allow_meta``: a model of shapes only (``CloverModel.from_pretrained(device="meta")``, for
    planning); an engine refuses it."""
    try:
        dev = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError, ValueError):
        raise CheckpointError(f"device {device!r} is not a device name (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "meta" and not allow_meta:
        raise CheckpointError("device 'meta' holds shapes but no weights, so nothing could run; load onto cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(f"device {str(dev)!r}: no CUDA device is available to this torch "
                              f"({torch.__version__}); use --device cpu")
    try:
        torch.empty(1, device=dev)
    except (RuntimeError, AssertionError, ValueError) as e:
        raise CheckpointError(f"device {str(dev)!r} cannot be used here: {e}") from None
    return dev


CHECKED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool: no NaN or inf in ``t``. float8_e4m3fn (FP8 weights kept as FP8) has no inf and
    no isfinite kernel: its NaN is every exponent and mantissa bit set (0x7F / 0xFF)."""
    if t.dtype == torch.float8_e4m3fn:
        return ((t.view(torch.uint8) & 0x7F) != 0x7F).all()
    return torch.isfinite(t).all()


def refuse_nonfinite(model, files: dict, reader, plan: dict) -> None:
    """A CheckpointError naming the first stored tensor that holds NaN or inf, for a model just
    filled from ``files`` by ``plan`` (loading.py's: parameter -> stored name, or per-expert
    {(expert, part): stored name}); one host read for the whole model unless one does."""
    params = dict(model.named_parameters())
    names = [n for n in plan if n in params and params[n].dtype in CHECKED_DTYPES]
    if not names:
        return
    finite = torch.stack([all_finite(params[n]).cpu() for n in names]).tolist()  # placed: many devices
    for name, ok in zip(names, finite):
        if ok:
            continue
        source = plan[name]
        stored = [source] if isinstance(source, str) else list(source.values())
        for st in stored:  # per-expert tensors: the expert that holds them
            if not bool(all_finite(reader.get(files[st], st))):
                raise CheckpointError(f"{files[st]}: tensor {st!r} holds NaN or inf values "
                                      f"(check_finite=False loads it anyway)")
        dtype = str(params[name].dtype).removeprefix("torch.")
        raise CheckpointError(f"{files[stored[0]]}: tensor {stored[0]!r} is finite as stored but overflows to inf "
                              f"in {dtype}; load it in another dtype")


def refuse_unreadable_scales(model, files: dict, plan: dict) -> None:
    """With ``preview_reading: {"logit_scale": "multiplier"}`` every stored logit scale is the
    multiplier itself, so it must be > 0 (the preview computes with its log): a CheckpointError
    naming the first tensor that is not."""
    for name, param in model.named_parameters():
        if name.endswith("linear_attn.block_scale") and name in plan and not bool((param > 0).all()):
            stored = plan[name]
            raise CheckpointError(f"{files[stored]}: tensor {stored!r} holds values <= 0 "
                                  f"({param.min().item():.4g}), which config.json's preview_reading "
                                  f"logit_scale 'multiplier' cannot read; the 'log' reading can")
