"""Reading block-scaled FP8 checkpoints: the format of Qwen's FP8 releases (Qwen3.6-35B-A3B-FP8)
and DeepSeek's. config.json carries ``"quantization_config": {"quant_method": "fp8",
"weight_block_size": [128, 128], "activation_scheme": "dynamic", "modules_to_not_convert": [...]}``
(top level, or in a multimodal config's text_config); each quantized tensor is stored as
``F8_E4M3`` next to its scale, ``X.weight`` -> ``X.weight_scale_inv`` (a fused ``X.gate_up_proj``
-> ``X.gate_up_proj_scale_inv``), [ceil(N/bn), ceil(K/bk)] in fp32, bf16 or fp16. Which tensors
are FP8 is read from the stored dtypes; everything else (norms, router, embeddings, what the
ignore list names) loads as any tensor does.

Two ways to load, chosen by the loader (``keep``):
- dequantize (the default off CUDA): each FP8 tensor is dequantized as it is read from the memory
  map, in row chunks, straight into the load dtype; the model is an ordinary one.
- keep (the default on CUDA): linears and routed experts stored in FP8 become ``FP8Linear`` /
  ``FP8Experts`` (``layers/fp8.py``) on the meta model before loading, their FP8 values are copied
  as stored and their scales filled afterwards; FP8 tensors of other modules are dequantized.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from clover_kernels.fp8 import naive
from clover_kernels.fp8.naive import scale_shape
from clover_lab.config import CloverConfig
from clover_lab.errors import CheckpointError
from clover_lab.model.layers.fp8_linear import FP8Experts, FP8Linear
from clover_lab.model.layers.linear import Linear
from clover_lab.model.layers.moe import Experts

log = logging.getLogger("clover_lab")

FP8_DTYPE = "F8_E4M3"  # safetensors' name of float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
SCALE_DTYPES = ("F32", "BF16", "F16")
CHUNK_ELEMENTS = 1 << 24  # fp32 temporaries of a dequantization stay ~64 MB
# the linears Qwen's FP8 releases keep in bf16 (their modules_to_not_convert), by name fragment
QWEN_UNQUANTIZED = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "shared_expert_gate", "linear_attn.in_proj_a.",
                    "linear_attn.in_proj_b.")


def scale_name(weight_name: str) -> str:
    """The stored name of a weight's scales: ``X.weight`` -> ``X.weight_scale_inv``,
    ``X.gate_up_proj`` -> ``X.gate_up_proj_scale_inv``."""
    return weight_name + SCALE_SUFFIX


@dataclass(frozen=True)
class QuantConfig:
    block: tuple[int, int]
    ignored: tuple[str, ...] = ()

    @classmethod
    def read(cls, path: Path) -> "QuantConfig | None":
        """config.json's quantization_config, checked; None when it has none."""
        file = Path(path) / "config.json"
        raw = json.loads(file.read_text())
        qc = raw.get("quantization_config")
        if qc is None and isinstance(raw.get("text_config"), dict):
            qc = raw["text_config"].get("quantization_config")
        if qc is None:
            return None
        where = f"{file}: quantization_config"
        if not isinstance(qc, dict):
            raise CheckpointError(f"{where}: expected a JSON object, got {type(qc).__name__}")
        if qc.get("quant_method") != "fp8":
            raise CheckpointError(f"{where}.quant_method={qc.get('quant_method')!r} is not supported; clover_lab "
                                  f"reads block-scaled FP8 (quant_method 'fp8', weight_block_size [128, 128])")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"{where}.fmt={qc['fmt']!r}: only e4m3 (float8_e4m3fn) is supported")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise CheckpointError(f"{where}.activation_scheme={qc['activation_scheme']!r}: only 'dynamic' is "
                                  f"supported (activations are not quantized with stored scales)")
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise CheckpointError(f"{where}.weight_block_size={block!r}: expected two positive integers such as "
                                  f"[128, 128] (per-tensor FP8 is not supported)")
        ignored = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
        if not (isinstance(ignored, list) and all(isinstance(m, str) for m in ignored)):
            raise CheckpointError(f"{where}.modules_to_not_convert: expected a list of module names")
        return cls((block[0], block[1]), tuple(ignored))


def dequantize_streaming(q: torch.Tensor, scale: torch.Tensor, block, dtype: torch.dtype) -> torch.Tensor:
    """``naive.dequantize`` in row chunks straight into ``dtype``, so that a big FP8 tensor never
    exists in fp32 as a whole."""
    N, K = q.shape[-2:]
    out = torch.empty(q.shape, dtype=dtype)
    q3, s3, o3 = q.reshape(-1, N, K), scale.reshape(-1, *scale.shape[-2:]), out.view(-1, N, K)
    bn = block[0]
    rows = max(bn, CHUNK_ELEMENTS // max(K, 1) // bn * bn)
    for i in range(q3.shape[0]):
        for r0 in range(0, N, rows):
            r1 = min(N, r0 + rows)
            o3[i, r0:r1] = naive.dequantize(q3[i, r0:r1], s3[i, r0 // bn:-(-r1 // bn)], block, dtype)
    return out


class FP8Checkpoint:
    """The FP8 part of a checkpoint: which stored tensors are FP8, their scales, and which of them
    the model keeps in FP8 (``kept``, decided by :meth:`convert`)."""

    def __init__(self, path: Path, quant: QuantConfig, scales: dict[str, str], files: dict[str, Path], keep: bool):
        self.path, self.quant, self.scales, self.files, self.keep = path, quant, scales, files, keep
        self.kept: set[str] = set()

    @property
    def block(self) -> tuple[int, int]:
        return self.quant.block

    # ------------------------------------------------------------------ what is stored
    @classmethod
    def inspect(cls, path: Path, files: dict[str, Path], reader, keep: bool):
        """(the checkpoint's FP8 part, or None when it has none; ``files`` without the scale
        tensors). Every FP8 tensor must have scales of the right shape and dtype, every scale
        tensor an FP8 tensor; the error names the tensor and its file."""
        scale_names = {n for n in files if n.endswith(SCALE_SUFFIX)}
        fp8 = [n for n in files if n not in scale_names and reader.shape_dtype(files[n], n)[1] == FP8_DTYPE]
        rest = {n: f for n, f in files.items() if n not in scale_names}
        quant = QuantConfig.read(path)
        if not fp8 and not scale_names:
            return None, files
        if quant is None:
            raise CheckpointError(f"{path}/config.json has no quantization_config, but the checkpoint holds "
                                  f"{len(fp8)} float8_e4m3fn tensors, e.g. {fp8[:1]}")
        scales = {}
        for name in fp8:
            scales[name] = scale_name(name)
            if scales[name] not in files:
                raise CheckpointError(f"{files[name]}: tensor {name!r} is float8_e4m3fn but the checkpoint has no "
                                      f"scale tensor {scales[name]!r}")
        for orphan in sorted(scale_names - set(scales.values())):
            weight = orphan[:-len(SCALE_SUFFIX)]
            what = "missing" if weight not in files else f"stored as {reader.shape_dtype(files[weight], weight)[1]}"
            raise CheckpointError(f"{files[orphan]}: scale tensor {orphan!r} scales no float8_e4m3fn tensor "
                                  f"({weight!r} is {what})")
        for name, sname in scales.items():
            cls._check_scale(files, reader, name, sname, quant.block)
        return cls(path, quant, scales, files, keep), rest

    @staticmethod
    def _check_scale(files, reader, name: str, sname: str, block) -> None:
        shape, _ = reader.shape_dtype(files[name], name)
        s_shape, s_dtype = reader.shape_dtype(files[sname], sname)
        if len(shape) < 2:
            raise CheckpointError(f"{files[name]}: tensor {name!r} is float8_e4m3fn with shape {list(shape)}; "
                                  f"block-scaled FP8 needs a matrix or a stack of matrices")
        if s_dtype not in SCALE_DTYPES:
            raise CheckpointError(f"{files[sname]}: scale tensor {sname!r} has dtype {s_dtype}; expected one of "
                                  f"{', '.join(SCALE_DTYPES)}")
        want = scale_shape(shape, block)
        if tuple(s_shape) != want:
            raise CheckpointError(f"{files[sname]}: scale tensor {sname!r} has shape {list(s_shape)}, expected "
                                  f"{list(want)} for {name!r} of shape {list(shape)} in blocks {list(block)}")

    # ------------------------------------------------------------------ the model
    def convert(self, model, names, config: CloverConfig) -> None:
        """Keep mode, on the meta model before loading: each Linear whose weight is stored in FP8
        becomes an FP8Linear, each layer's experts stored wholly in FP8 FP8Experts."""
        if not self.keep:
            return
        plain, per_expert, fused = names
        with torch.device("meta"):
            self._convert(model, plain, per_expert, fused, config)
        log.info("keeping %d FP8 tensors in FP8", len(self.kept))

    def _convert(self, model, plain, per_expert, fused, config) -> None:
        for mname, module in list(model.named_modules()):
            if isinstance(module, Linear) and not isinstance(module, FP8Linear):
                stored = plain.get(f"{mname}.weight")
                if stored in self.scales:
                    self._replace(model, mname, FP8Linear.like(module, self.block), [stored])
            elif isinstance(module, Experts) and not isinstance(module, FP8Experts):
                stored = self._expert_names(mname, per_expert, fused, config)
                if stored:
                    self._replace(model, mname, FP8Experts(config, self.block), stored)

    def _expert_names(self, prefix: str, per_expert: dict, fused: dict, config: CloverConfig) -> list[str] | None:
        """The stored names of a layer's experts when all are FP8 in a layout FP8Experts holds."""
        if prefix in per_expert:
            stored = list(per_expert[prefix].values())
        else:
            stored = [fused[k] for k in (f"{prefix}.gate_up_proj", f"{prefix}.down_proj") if k in fused]
            # a fused gate_up's row blocks are gate's then up's only when bn divides I
            if config.moe_intermediate_size % self.block[0]:
                return None
        return stored if stored and all(n in self.scales for n in stored) else None

    def _replace(self, model, name: str, new, stored: list[str]) -> None:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)
        self.kept.update(stored)

    def reader(self, inner, dtype: torch.dtype) -> "_FP8Reader":
        return _FP8Reader(inner, self, dtype)

    @torch.no_grad()
    def fill_scales(self, model, plan: dict, reader) -> None:
        """After loading: every FP8 module's scales, read as fp32 onto its weight's device."""
        def read(stored: str) -> torch.Tensor:
            sname = self.scales[stored]
            return checked_scale(reader.get(self.files[sname], sname), self.files[sname], sname).float()

        for mname, module in model.named_modules():
            if isinstance(module, FP8Linear):
                module.weight_scale_inv = read(plan[f"{mname}.weight"]).to(module.weight.device)
            elif isinstance(module, FP8Experts):
                gu, dn = plan[f"{mname}.gate_up_proj"], plan[f"{mname}.down_proj"]
                if isinstance(gu, str):  # fused: the scales as stored
                    gate_up, down = read(gu), read(dn)
                else:  # per expert: gate's blocks then up's, stacked over experts
                    E = module.gate_up_proj.shape[0]
                    gate_up = torch.stack([torch.cat([read(gu[(e, "gate")]), read(gu[(e, "up")])]) for e in range(E)])
                    down = torch.stack([read(dn[(e, "down")]) for e in range(E)])
                module.gate_up_proj_scale_inv = gate_up.to(module.gate_up_proj.device)
                module.down_proj_scale_inv = down.to(module.down_proj.device)


class _FP8Reader:
    """The loader's reader, with FP8 tensors dequantized as they are read (raw when kept)."""

    def __init__(self, inner, checkpoint: FP8Checkpoint, dtype: torch.dtype):
        self.inner, self.checkpoint, self.dtype = inner, checkpoint, dtype

    def shape_dtype(self, file: Path, name: str):
        return self.inner.shape_dtype(file, name)

    def get(self, file: Path, name: str) -> torch.Tensor:
        tensor = self.inner.get(file, name)
        ck = self.checkpoint
        if name not in ck.scales or name in ck.kept:
            return tensor
        sname = ck.scales[name]
        scale = checked_scale(self.inner.get(ck.files[sname], sname), ck.files[sname], sname)
        return dequantize_streaming(tensor, scale, ck.block, self.dtype)


def checked_scale(scale: torch.Tensor, file: Path, name: str) -> torch.Tensor:
    """A block scale as read, refused unless every entry is finite and positive: a zero, negative
    or non-finite scale turns its block into zeros, flipped signs or NaN without a word."""
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        s = scale.float()
        bad = s[~(torch.isfinite(s) & (s > 0))]
        raise CheckpointError(f"{file}: scale tensor {name!r} holds {bad.numel()} entries that are not finite and "
                              f"positive (e.g. {float(bad[0])}); block scales must be > 0")
    return scale
