"""CloverConfig: the fields of a Hugging Face ``config.json`` for Clover, and named presets.

Reads ``clover_moe`` configs, plain Qwen3.5/3.6-MoE text configs (``qwen3_5_moe_text``) and the
multimodal ``qwen3_5_moe`` wrapper (its ``text_config``). Writes ``clover_moe`` with the
release's architecture ``CloverMoeModelLM`` (spec 3.2.1).

A config.json must name every field that decides a tensor's shape (``REQUIRED_FIELDS``: the
Qwen3.5/3.6-MoE configs all do); the others default to the released model's values. Every
field is checked for type and range when the config is made, so a bad one is a ConfigError
naming it, never a shape error later or a NaN at generation.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from clover_lab.errors import CloverError
from clover_lab.writes import write_text

MODEL_TYPE = "clover_moe"
ARCHITECTURE = "CloverMoeModelLM"  # the release's (spec 3.2.1); what clover_lab writes
ACCEPTED_MODEL_TYPES = (MODEL_TYPE, "qwen3_5_moe_text", "qwen3_5_moe")
LAYER_TYPES = ("linear_attention", "full_attention")
# fields that decide the tensors' shapes: a config.json without one would silently take the 35B
# preset's value and fail later on a tensor shape (real Qwen3.5/3.6-MoE configs name them all)
# How the release's four preview tensors are read (spec 3.2.1: inferred, not read from the release);
# the first of each is the spec's reading. ``clover-lab check`` measures which fits a checkpoint.
PREVIEW_READINGS = {
    "logit_scale": ("log", "multiplier"),  # bd_softmax_logit_scale: exp(stored) | stored, times <q, k>
    "history_c": ("ln_m", "m"),  # bd_softmax_history_c: the coefficient of ln(m) | of m
    "right_taps": ("nearest_first", "farthest_first"),  # conv_right_weight[:, d-1] weighs row t+d | t+K-d
}
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                   "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
                   "moe_intermediate_size", "shared_expert_intermediate_size")


class ConfigError(CloverError, ValueError):
    """A config.json or config field that clover_lab cannot use; the message names it."""


@dataclass
class CloverConfig:
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    layer_types: list[str] | None = None  # default: 3 x linear_attention + 1 x full_attention, repeated
    # gated attention
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    max_position_embeddings: int = 131072
    # Gated DeltaNet
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # MoE
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_shared_experts: int = 1  # the release's field: 1, or 0 for a model without a shared expert
    router_aux_loss_coef: float = 0.001
    # the multi-token-prediction head of Qwen3.5/3.6 (``mtp.*``, ``model/prediction_head.py``): its
    # decoder layers (0: none)
    mtp_num_hidden_layers: int = 0
    # common
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # block diffusion
    block_size: int = 32
    mask_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    dtype: str | None = None  # the checkpoint's dtype ("bfloat16", "float32", ...)
    preview_reading: dict = field(default_factory=dict)  # PREVIEW_READINGS chosen other than the spec's
    extra: dict = field(default_factory=dict, repr=False)  # unknown config.json fields, written back as they came

    def __post_init__(self):
        if self.layer_types is None and isinstance(self.num_hidden_layers, int):  # else validate() names it
            self.layer_types = [
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(self.num_hidden_layers)
            ]
        self.validate()

    # ----------------------------------------------------------------- checks
    def validate(self) -> None:
        def need(ok: bool, name: str, what: str):
            if not ok:
                raise ConfigError(f"config field {name!r}: {what} (got {getattr(self, name)!r})")

        def number(name: str, positive: bool = False) -> None:
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v)
            need(ok and (v > 0 if positive else True), name, "must be a " + ("positive " if positive else "")
                 + "finite number")

        def token_ids(name: str, ids: list, in_vocab: bool) -> None:
            ok = all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
            need(ok, name, "must be a token id (a non-negative integer)" + (" or a list of them"
                                                                           if name == "eos_token_id" else "") + " or null")
            if in_vocab:
                need(all(t < self.vocab_size for t in ids), name, f"must be below vocab_size={self.vocab_size}")

        for name in REQUIRED_FIELDS + ("block_size", "max_position_embeddings"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, "must be a positive integer")
        need(isinstance(self.layer_types, list) and len(self.layer_types) == self.num_hidden_layers, "layer_types",
             f"needs one entry per layer ({self.num_hidden_layers})")
        bad = sorted({str(t) for t in self.layer_types if t not in LAYER_TYPES})
        need(not bad, "layer_types", f"entries must be one of {LAYER_TYPES}")
        for name in ("rms_norm_eps", "rope_theta"):
            number(name, positive=True)
        for name in ("partial_rotary_factor", "initializer_range", "router_aux_loss_coef"):
            number(name)
        for name in ("attention_bias", "tie_word_embeddings"):
            need(isinstance(getattr(self, name), bool), name, "must be true or false")
        need(self.dtype is None or isinstance(self.dtype, str), "dtype", "must be a dtype name or null")
        eos = self.eos_token_id
        token_ids("eos_token_id", [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos], True)
        for name in ("bos_token_id", "pad_token_id", "mask_token_id"):
            v = getattr(self, name)
            token_ids(name, [] if v is None else [v], name == "mask_token_id")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
             "must divide num_attention_heads")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0, "linear_num_key_heads",
             "must divide linear_num_value_heads")
        need(self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok", "must be <= num_experts")
        need(0 < self.partial_rotary_factor <= 1, "partial_rotary_factor", "must be in (0, 1]")
        need(int(self.head_dim * self.partial_rotary_factor) % 2 == 0, "partial_rotary_factor",
             "head_dim * partial_rotary_factor must be even")
        need(self.hidden_act == "silu", "hidden_act", "only 'silu' is supported")
        reading = self.preview_reading
        need(isinstance(reading, dict) and all(k in PREVIEW_READINGS and v in PREVIEW_READINGS[k]
                                               for k, v in reading.items()), "preview_reading",
             "must map some of " + "; ".join(f"{k} to one of {v}" for k, v in PREVIEW_READINGS.items()))
        mtp = self.mtp_num_hidden_layers
        need(isinstance(mtp, int) and not isinstance(mtp, bool) and mtp >= 0, "mtp_num_hidden_layers",
             "must be an integer >= 0 (the MTP head's decoder layers; 0: no head)")
        shared = self.num_shared_experts
        need(isinstance(shared, int) and not isinstance(shared, bool) and shared in (0, 1), "num_shared_experts",
             "must be 1 (one shared expert, as released) or 0 (none); more are not supported")

    # ----------------------------------------------------------------- derived
    def reading(self, key: str) -> str:
        """How the preview tensor ``key`` of PREVIEW_READINGS is read: the spec's way unless
        ``preview_reading`` says otherwise."""
        return self.preview_reading.get(key, PREVIEW_READINGS[key][0])

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    # ----------------------------------------------------------------- HF json
    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "CloverConfig":
        d = dict(d)
        model_type = d.get("model_type")
        check_architectures(d.get("architectures"), model_type, source)
        if model_type == "qwen3_5_moe":
            if not isinstance(d.get("text_config"), dict):
                raise ConfigError(f"{source}: model_type 'qwen3_5_moe' needs a 'text_config' object")
            outer = d
            d = dict(d["text_config"])
            for key in ("eos_token_id", "bos_token_id", "pad_token_id", "block_size", "mask_token_id"):
                if d.get(key) is None and outer.get(key) is not None:
                    d[key] = outer[key]
            d["model_type"] = "qwen3_5_moe_text"
            model_type = d["model_type"]
        if model_type not in ACCEPTED_MODEL_TYPES:
            raise ConfigError(f"{source}: model_type {model_type!r} is not supported; expected one of "
                              f"{', '.join(ACCEPTED_MODEL_TYPES)}")
        missing = [name for name in REQUIRED_FIELDS if d.get(name) is None]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {', '.join(map(repr, missing))}: they decide "
                              f"the weights' shapes, and no default can be right for every checkpoint")
        rope = d.pop("rope_parameters", None) or d.pop("rope_scaling", None) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: rope_parameters must be an object, got {rope!r}")
        if rope.get("rope_type", "default") not in ("default", None):
            raise ConfigError(f"{source}: rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
        if "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        if "partial_rotary_factor" in rope:
            d["partial_rotary_factor"] = rope["partial_rotary_factor"]
        if d.get("torch_dtype") and not d.get("dtype"):
            d["dtype"] = d["torch_dtype"]
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names and k not in ("model_type", "torch_dtype", "architectures")}
        if "full_attention_interval" in extra and known.get("layer_types") is None:
            n, step = known["num_hidden_layers"], extra["full_attention_interval"]
            if isinstance(step, bool) or not isinstance(step, int) or step < 1 or not isinstance(n, int):
                raise ConfigError(f"{source}: config field 'full_attention_interval': must be a positive integer "
                                  f"(got {step!r})")
            known["layer_types"] = ["full_attention" if (i + 1) % step == 0 else "linear_attention" for i in range(n)]
        try:
            return cls(**known, extra=extra)
        except (TypeError, ConfigError) as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta"),
                                "partial_rotary_factor": d.pop("partial_rotary_factor")}
        out = {**extra, "model_type": MODEL_TYPE, "architectures": [ARCHITECTURE], **d}
        if out.get("dtype") is None:
            out.pop("dtype")
        if not out["preview_reading"]:  # the spec's reading: nothing to say
            out.pop("preview_reading")
        if not out["mtp_num_hidden_layers"]:  # no MTP head: config.json as before the field existed
            out.pop("mtp_num_hidden_layers")
        return out

    @classmethod
    def from_json_file(cls, path: str | Path) -> "CloverConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(d, source=str(path))

    def to_json(self) -> str:
        """config.json's text."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save(self, directory: str | Path) -> Path:
        """``directory``/config.json, whole or not at all."""
        return write_text(Path(directory) / "config.json", self.to_json())

    @classmethod
    def preset(cls, name: str, **overrides) -> "CloverConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
        return cls(**{**PRESETS[name], **overrides})

    def replace(self, **changes) -> "CloverConfig":
        return dataclasses.replace(self, **changes)


# the model classes each accepted model_type's checkpoints name in ``architectures`` (by prefix:
# CloverMoeModelLM, the release's; Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration)
ARCHITECTURE_FAMILIES = {MODEL_TYPE: "Clover", "qwen3_5_moe_text": "Qwen3_5Moe", "qwen3_5_moe": "Qwen3_5Moe"}


def check_architectures(architectures, model_type, source: str) -> None:
    """config.json's ``architectures`` (absent or null: nothing to check) must be a list of class
    names of ``model_type``'s family: a ``LlamaForCausalLM`` beside ``model_type: clover_moe`` is
    a config.json from another model (or a hand edit), whatever its fields say."""
    if architectures is None or model_type not in ARCHITECTURE_FAMILIES:  # an unknown model_type: named later
        return
    family = ARCHITECTURE_FAMILIES[model_type]
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ConfigError(f"{source}: config field 'architectures': must be a list of model class names "
                          f"(got {architectures!r})")
    foreign = [a for a in architectures if not a.startswith(family)]
    if foreign:
        raise ConfigError(f"{source}: config field 'architectures' names {', '.join(map(repr, foreign))}, not a "
                          f"{family}* model as model_type {model_type!r} says (expected e.g. "
                          f"{ARCHITECTURE if model_type == MODEL_TYPE else 'Qwen3_5MoeForCausalLM'!r}); is this "
                          f"config.json another model's?")


def _finite(v) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int beyond float's range
        return False


PRESETS: dict[str, dict] = {
    # the released model (section 2 of the spec)
    "clover-35b-a3b": dict(mask_token_id=248319),
    # small shapes with every structural feature (GQA, Hk != Hv, partial RoPE, 3:1 pattern): tests
    "clover-tiny": dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, max_position_embeddings=4096, block_size=16, mask_token_id=511,
        rope_theta=10000.0,
    ),
    # the embedded default model: trained on 2 CPU cores in about an hour, fast on a laptop CPU
    "clover-stdlib": dict(
        vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, max_position_embeddings=4096, block_size=16, mask_token_id=None,
        rope_theta=10000.0,
    ),
    # a bigger small model, for machines with more time (or a GPU)
    "clover-small": dict(
        vocab_size=8192, hidden_size=320, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=80, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, max_position_embeddings=8192, block_size=16, mask_token_id=None,
        rope_theta=10000.0,
    ),
}
