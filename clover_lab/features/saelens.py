"""SAELens' on-disk layout of a sparse autoencoder, read and written without SAELens (its package
pulls in TransformerLens, datasets and more). The layout is SAELens 6's ``SAE.save_model`` /
``SAE.load_from_disk`` (``sae_lens/saes/sae.py``, ``sae_lens/loading/pretrained_sae_loaders.py``):

- ``sae_weights.safetensors``: ``W_enc`` [d_in, d_sae], ``b_enc`` [d_sae], ``W_dec`` [d_sae, d_in],
  ``b_dec`` [d_in];
- ``cfg.json``: the config dataclass's fields, ``d_in``, ``d_sae``, ``dtype``, ``device``,
  ``apply_b_dec_to_input``, ``normalize_activations``, ``reshape_activations``, ``metadata`` (an
  open dict: ``sae_lens_version``, ``model_name``, ``hook_name``, ...) and ``architecture``; a
  TopK autoencoder (``architecture: "topk"``) adds ``k`` and ``rescale_acts_by_decoder_norm``;
- the other architectures read here: ``jumprelu`` (``sae_lens/saes/jumprelu_sae.py``: one more
  tensor, ``threshold`` [d_sae]); ``transcoder``, ``jumprelu_transcoder`` (+ ``threshold``) and
  ``skip_transcoder`` (+ ``W_skip`` [d_out, d_in]) (``sae_lens/saes/transcoder.py``:
  ``TranscoderConfig`` adds ``d_out``, ``hook_name_out``, ``hook_layer_out``,
  ``hook_head_index_out``; ``W_dec`` [d_sae, d_out], ``b_dec`` [d_out]).

SAELens decides by ``metadata.sae_lens_version`` (or a top-level ``sae_lens_version``) whether a
config predates 6.0 and must be converted: we write "6.0.0", the first release of this layout,
and read both (a pre-6 TopK config names ``activation_fn: "topk"`` with ``activation_fn_kwargs.k``
and keeps ``hook_name`` / ``hook_point`` at the top). ``tests/features/test_saelens.py`` loads our
files with SAELens itself where it is installed.
"""
from __future__ import annotations

import json
import math
import numbers
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from clover_lab.errors import CheckpointError
from clover_lab.writes import FileSet, naming, refuse_foreign, refuse_unfinished

CFG_FILE, WEIGHTS_FILE = "cfg.json", "sae_weights.safetensors"
LAYOUT_VERSION = "6.0.0"  # metadata.sae_lens_version: the first SAELens release with this layout
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


ARCHITECTURES = ("topk", "jumprelu", "transcoder", "jumprelu_transcoder", "skip_transcoder")


class AutoencoderFileError(CheckpointError):
    """A file or directory that is not a sparse autoencoder clover_lab reads (SAELens' layout,
    Qwen-Scope's ``.pt``), or one it cannot use; the message names the file, the field or the
    tensor."""


def shapes(architecture: str, d_in: int, d_sae: int, d_out: int | None = None) -> dict[str, tuple[int, ...]]:
    """The tensors of an architecture and their shapes."""
    d_out = d_in if d_out is None else d_out
    out = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_out), "b_dec": (d_out,)}
    if architecture in ("jumprelu", "jumprelu_transcoder"):
        out["threshold"] = (d_sae,)
    if architecture == "skip_transcoder":
        out["W_skip"] = (d_out, d_in)
    return out


def config(sae) -> dict:
    """cfg.json of a float32 autoencoder, as SAELens 6's config ``to_dict`` has it."""
    meta = {k: (finite_number(v) if isinstance(v, float) else v) for k, v in sae.metadata.items()}
    cfg = {"d_in": sae.d_in, "d_sae": sae.d_sae, "dtype": "float32", "device": "cpu",
           "apply_b_dec_to_input": sae.apply_b_dec_to_input, "normalize_activations": "none",
           "reshape_activations": "none",
           "metadata": {"sae_lens_version": LAYOUT_VERSION, "sae_lens_training_version": None, **meta},
           "architecture": sae.architecture}
    if sae.architecture == "topk":
        if not sae.relu:
            raise AutoencoderFileError("SAELens' TopK applies a ReLU to the kept values; this autoencoder keeps them "
                                       "as they are (relu=False, Qwen-Scope's): save it with features.save_qwen_scope")
        cfg.update(k=sae.k, rescale_acts_by_decoder_norm=sae.rescale_acts_by_decoder_norm)
    if sae.architecture in ("transcoder", "jumprelu_transcoder", "skip_transcoder"):
        out = cfg["metadata"].pop("hook_name_out", None)
        cfg.update(d_out=sae.d_out, hook_name_out=out or "", hook_layer_out=0, hook_head_index_out=None)
    return cfg


def save(sae, path) -> Path:
    """The two files in the directory ``path`` (new, empty or an autoencoder: replaced), put in
    place together (``writes.FileSet``); cfg.json last."""
    path = Path(path)
    text = json.dumps(config(sae), indent=1)  # fails here, before anything is written, on what JSON cannot hold
    names = shapes(sae.architecture, sae.d_in, sae.d_sae, sae.d_out)
    refuse_foreign(path, {CFG_FILE, WEIGHTS_FILE, "README.md"}, "a sparse autoencoder")
    with naming(path), FileSet(path) as files:
        save_file({k: getattr(sae, k).detach().to("cpu", torch.float32).contiguous() for k in names},
                  str(files.path(path / WEIGHTS_FILE)))
        files.path(path / CFG_FILE).write_text(text)
    return path


def read(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of the autoencoder in ``path``: the config with architecture, d_in,
    d_sae, d_out, k (TopK), apply_b_dec_to_input, rescale_acts_by_decoder_norm and metadata
    (hook_name, hook_name_out, model_name, ...); tensors float32 on the CPU."""
    path = Path(path)
    if not path.is_dir():
        raise AutoencoderFileError(f"{path}: not a directory (a sparse autoencoder in SAELens' layout is a "
                                   f"directory holding {CFG_FILE} and {WEIGHTS_FILE})")
    cfg_file, weights_file = path / CFG_FILE, path / WEIGHTS_FILE
    if not cfg_file.is_file() or not weights_file.is_file():
        have = ", ".join(sorted(p.name for p in path.iterdir())[:6]) or "nothing"
        missing = " and ".join(f.name for f in (cfg_file, weights_file) if not f.is_file())
        raise AutoencoderFileError(f"{path}: not a sparse autoencoder in SAELens' layout: no {missing} (it holds "
                                   f"{have})")
    refuse_unfinished(path, AutoencoderFileError)
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AutoencoderFileError(f"{cfg_file}: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise AutoencoderFileError(f"{cfg_file}: expected a JSON object, got {type(raw).__name__}")
    if raw.get("metadata") is not None and not isinstance(raw["metadata"], dict):
        raise AutoencoderFileError(f"{cfg_file}: 'metadata' must be a JSON object (hook_name, model_name, ...), got "
                                   f"{type(raw['metadata']).__name__} {raw['metadata']!r:.60}")
    cfg = _normalized(raw, cfg_file)
    try:
        tensors = load_file(str(weights_file))
    except (OSError, SafetensorError) as e:
        raise AutoencoderFileError(f"{weights_file}: not a readable safetensors file ({e})") from None
    return cfg, _checked(tensors, cfg, weights_file)


def _version(raw: dict) -> tuple[int, ...] | None:
    v = raw.get("sae_lens_version") or (raw.get("metadata") or {}).get("sae_lens_version")
    if not isinstance(v, str):
        return None
    parts = []
    for piece in v.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or None


def _normalized(raw: dict, where: Path) -> dict:
    """SAELens 6's fields from a config of either generation, checked for what clover_lab runs."""
    version = _version(raw)
    pre6 = version is None or version < (6,)
    metadata = dict(raw.get("metadata") or {})
    architecture = raw.get("architecture")
    k = raw.get("k")
    if pre6:  # SAELens' handle_pre_6_0_config: the activation function names the architecture
        if raw.get("activation_fn", raw.get("activation_fn_str")) == "topk":
            architecture = "topk"
            k = (raw.get("activation_fn_kwargs") or {}).get("k", k)
        architecture = architecture or "standard"
        for key, new in (("model_name", "model_name"), ("hook_name", "hook_name"), ("hook_point", "hook_name")):
            if key in raw and new not in metadata:
                metadata[new] = raw[key]
    if architecture not in ARCHITECTURES:
        raise AutoencoderFileError(f"{where}: architecture {architecture!r}; clover_lab reads "
                                   f"{', '.join(ARCHITECTURES)}")
    transcoder = architecture.endswith("transcoder")
    wanted = ("d_in", "d_sae") + (("k",) if architecture == "topk" else ()) + (("d_out",) if transcoder else ())
    for name in wanted:
        value = raw.get(name) if name != "k" else k
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise AutoencoderFileError(f"{where}: field {name!r} is {value!r}; expected a positive integer")
    if architecture == "topk" and k > raw["d_sae"]:
        raise AutoencoderFileError(f"{where}: k={k} is more than d_sae={raw['d_sae']}")
    if transcoder:
        out = raw.get("hook_name_out") or metadata.get("hook_name_out")
        if out:
            metadata["hook_name_out"] = out
    norm = raw.get("normalize_activations", "none")
    if norm not in ("none", None, False):
        raise AutoencoderFileError(f"{where}: normalize_activations={norm!r}; clover_lab applies autoencoders to the "
                                   f"raw residual stream (normalize_activations 'none'): fold the normalisation "
                                   f"into the weights first")
    if raw.get("reshape_activations", "none") != "none":
        raise AutoencoderFileError(f"{where}: reshape_activations={raw['reshape_activations']!r}; clover_lab's "
                                   f"autoencoders read the residual stream ('none')")
    if raw.get("dtype", "float32") not in DTYPES and str(raw.get("dtype")).removeprefix("torch.") not in DTYPES:
        raise AutoencoderFileError(f"{where}: dtype {raw.get('dtype')!r}; one of {', '.join(DTYPES)}")
    flags = {}
    for name, default in (("apply_b_dec_to_input", True), ("rescale_acts_by_decoder_norm", False)):
        value = raw.get(name, default)
        if not isinstance(value, bool):
            raise AutoencoderFileError(f"{where}: field {name!r} is {value!r}; expected true or false")
        flags[name] = value
    if raw.get("finetuning_scaling_factor"):
        raise AutoencoderFileError(f"{where}: finetuning_scaling_factor is set; clover_lab does not apply a "
                                   f"finetuning scaling factor")
    if transcoder and flags["apply_b_dec_to_input"] and raw["d_out"] != raw["d_in"]:
        flags["apply_b_dec_to_input"] = False  # SAELens' transcoders never centre the input (process_sae_in)
    return dict(architecture=architecture, d_in=int(raw["d_in"]), d_sae=int(raw["d_sae"]),
                d_out=int(raw["d_out"]) if transcoder else int(raw["d_in"]), k=int(k) if architecture == "topk" else None,
                metadata=metadata, **flags)


def _checked(tensors: dict, cfg: dict, where: Path) -> dict[str, torch.Tensor]:
    scale = tensors.pop("scaling_factor", None)  # SAELens drops an all-ones one, as here
    if scale is not None and not bool((scale == 1).all()):
        raise AutoencoderFileError(f"{where}: tensor 'scaling_factor' is not all ones; clover_lab does not apply "
                                   f"a finetuning scaling factor")
    arch = cfg["architecture"]
    want = shapes(arch, cfg["d_in"], cfg["d_sae"], cfg["d_out"])
    missing = [k for k in want if k not in tensors]
    if missing:
        raise AutoencoderFileError(f"{where}: no tensor {', '.join(map(repr, missing))} (architecture {arch!r} has "
                                   f"{', '.join(want)}; it holds {', '.join(sorted(tensors)) or 'nothing'})")
    extra = sorted(set(tensors) - set(want))
    if extra:
        raise AutoencoderFileError(f"{where}: unexpected tensors {', '.join(map(repr, extra))} for architecture "
                                   f"{arch!r}")
    out = {}
    for name, shape in want.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise AutoencoderFileError(f"{where}: tensor {name!r} has shape {list(t.shape)}; d_in={cfg['d_in']}, "
                                       f"d_sae={cfg['d_sae']}, d_out={cfg['d_out']} give {list(shape)}")
        if not t.is_floating_point():
            raise AutoencoderFileError(f"{where}: tensor {name!r} is {t.dtype}, expected floats")
        t = t.to(torch.float32)
        if not bool(torch.isfinite(t).all()):
            raise AutoencoderFileError(f"{where}: tensor {name!r} holds NaN or inf")
        out[name] = t
    return out


def finite_number(value) -> float | None:
    """A number JSON can hold (NaN and inf become None)."""
    return float(value) if isinstance(value, numbers.Real) and math.isfinite(value) else None
