"""Sparse autoencoders over one residual point, and the family they belong to.

``SparseAutoencoder`` is what every architecture shares: ``W_enc`` [d_in, d_sae], ``b_enc``
[d_sae], ``W_dec`` [d_sae, d_out], ``b_dec`` [d_out] (``d_out`` = ``d_in`` but for a transcoder),
the point it reads (``hook_name``), and

    pre = (x - b_dec) @ W_enc + b_enc            # [.., d_sae]   (b_dec subtracted when apply_b_dec_to_input)
    acts = activation(pre)                       # the architecture's sparsity
    x_hat = acts @ W_dec + b_dec                 # [.., d_out]

A TopK autoencoder (Gao et al. 2024, SAELens' ``topk``) keeps the k largest pre-activations
(``relu(topk(pre, k))``; Qwen-Scope's files keep them without the ReLU: ``relu=False``). JumpReLU
autoencoders and transcoders (``JumpReLUAutoencoder``, ``Transcoder``) below.

Files: SAELens' layout (``saelens.py``): ``sae.save(path)`` writes what SAELens'
``SAE.load_from_disk`` reads, and ``features.load(path)`` reads what SAELens saves; Qwen-Scope's
``layer{n}.sae.pt`` (``qwen_scope.py``). ``hook_name`` (``metadata.hook_name``) names the point it
reads, ``layers.2.output`` for the ones clover_lab trains. Everything is computed in float32
whatever the stream's dtype.
"""
from __future__ import annotations

import numbers
from pathlib import Path

import torch
from torch import nn

from clover_lab.errors import InputError
from clover_lab.features import saelens
from clover_lab.hooks import points as P


def _positive(owner: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InputError(f"{owner}: {name}={value!r}: expected a positive integer")
    return int(value)


class SparseAutoencoder(nn.Module):
    """The shared part of every architecture (see the module). Subclasses set ``architecture``
    (SAELens' name) and :meth:`activation`."""

    architecture = ""

    def __init__(self, d_in: int, d_sae: int, *, d_out: int | None = None, hook_name: str | None = None,
                 model_name: str | None = None, apply_b_dec_to_input: bool = True, metadata: dict | None = None):
        super().__init__()
        owner = type(self).__name__
        self.d_in, self.d_sae = _positive(owner, "d_in", d_in), _positive(owner, "d_sae", d_sae)
        self.d_out = self.d_in if d_out is None else _positive(owner, "d_out", d_out)
        if apply_b_dec_to_input and self.d_out != self.d_in:
            raise InputError(f"{owner}: apply_b_dec_to_input needs b_dec as wide as the input (d_out={self.d_out}, "
                             f"d_in={self.d_in})")
        self.W_enc = nn.Parameter(torch.zeros(self.d_in, self.d_sae))
        self.b_enc = nn.Parameter(torch.zeros(self.d_sae))
        self.W_dec = nn.Parameter(torch.zeros(self.d_sae, self.d_out))
        self.b_dec = nn.Parameter(torch.zeros(self.d_out))
        self.apply_b_dec_to_input = bool(apply_b_dec_to_input)
        self.metadata = dict(metadata or {})
        if hook_name is not None:
            self.metadata["hook_name"] = hook_name
        if model_name is not None:
            self.metadata["model_name"] = model_name

    def activation(self, pre: torch.Tensor) -> torch.Tensor:
        """Feature activations [.., d_sae] of pre-activations [.., d_sae]."""
        raise NotImplementedError

    # ---------------------------------------------------------------- where it reads
    @property
    def hook_name(self) -> str | None:
        return self.metadata.get("hook_name")

    @hook_name.setter
    def hook_name(self, name: str) -> None:
        self.metadata["hook_name"] = name

    @property
    def layer(self) -> int | None:
        """The layer of the clover_lab residual point it reads (None: another kind of hook name)."""
        name = self.hook_name
        if not isinstance(name, str) or not P.is_residual(name):
            return None
        return P.parse(name)[0]

    @property
    def kind(self) -> str | None:
        name = self.hook_name
        return P.parse(name)[1] if isinstance(name, str) and P.is_residual(name) and self.layer is not None else None

    def point(self, engine) -> str:
        """The residual point of ``engine``'s model this autoencoder reads, checked: it exists, and its
        width is ``d_in``."""
        name = self.hook_name
        if not isinstance(name, str) or not P.is_residual(name):
            raise InputError(f"this autoencoder reads {name!r}, not a clover_lab residual point (layers.{{i}}.output, "
                             f"...): set sae.hook_name to the point it was trained on")
        if name not in engine.model.hooks.points:
            raise InputError(f"this autoencoder reads {name}, which the model does not have (layers 0.."
                             f"{engine.model.config.num_hidden_layers - 1})")
        if engine.model.config.hidden_size != self.d_in:
            raise InputError(f"this autoencoder reads {self.d_in}-wide rows; the model's stream is "
                             f"{engine.model.config.hidden_size} wide")
        return name

    # ---------------------------------------------------------------- the map
    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.shape[-1:] != (self.d_in,):
            raise InputError(f"the autoencoder reads rows of {self.d_in} values; got "
                             f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        return x.to(self.W_enc.device, torch.float32)

    def pre(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-activations [.., d_sae] of rows x [.., d_in]."""
        x = self._rows(x)
        if self.apply_b_dec_to_input:
            x = x - self.b_dec
        return x @ self.W_enc + self.b_enc

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations [.., d_sae]."""
        return self.activation(self.pre(x))

    def encode_topk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [.., n], feature indices [.., n]) of the active features, largest first: n is
        the most features active in any row (at least 1; rows with fewer are padded with zeros)."""
        acts = self.encode(x)
        n = max(int((acts != 0).sum(-1).max()) if acts.numel() else 1, 1)
        return acts.topk(min(n, self.d_sae), dim=-1)

    def decode(self, acts: torch.Tensor) -> torch.Tensor:
        """Outputs [.., d_out] of activations [.., d_sae]."""
        return acts @ self.W_dec + self.b_dec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))

    @torch.no_grad()
    def fvu(self, x: torch.Tensor, chunk: int = 8192) -> float:
        """Fraction of variance unexplained over rows x [N, d_in]: sum |x - x_hat|^2 over sum
        |x - mean x|^2 (an autoencoder's: its output stands in for its input)."""
        if self.d_out != self.d_in:
            raise InputError(f"fvu compares a reconstruction with its input; this {type(self).__name__} writes "
                             f"{self.d_out} values from {self.d_in}")
        x = self._rows(x).reshape(-1, self.d_in)
        if len(x) < 2:
            raise InputError(f"fvu needs at least 2 rows, got {len(x)}")
        mean = x.mean(0)
        err = sum(float((self(c) - c).pow(2).sum()) for c in x.split(chunk))
        total = float((x - mean).pow(2).sum())
        return err / total if total > 0 else float("nan")

    def feature_index(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= index < self.d_sae:
            raise InputError(f"feature {index!r}: this autoencoder has features 0..{self.d_sae - 1}")
        return int(index)

    def feature_direction(self, index: int) -> torch.Tensor:
        """Feature ``index``'s decoder row [d_out]: what one unit of its activation adds."""
        return self.W_dec.detach()[self.feature_index(index)].float()

    # ---------------------------------------------------------------- files
    def save(self, path) -> Path:
        """Write SAELens' layout (cfg.json + sae_weights.safetensors) to the directory ``path``."""
        return saelens.save(self, path)

    @classmethod
    def load(cls, path) -> "SparseAutoencoder":
        """An autoencoder in SAELens' layout (ours, or one SAELens saved), of this class."""
        sae = from_saelens(path)
        if not isinstance(sae, cls):
            raise saelens.AutoencoderFileError(f"{path}: architecture {sae.architecture!r} is a "
                                               f"{type(sae).__name__}, not a {cls.__name__} (features.load reads "
                                               f"any)")
        return sae

    def extra_repr(self) -> str:
        out = f", d_out={self.d_out}" if self.d_out != self.d_in else ""
        return f"d_in={self.d_in}, d_sae={self.d_sae}{out}, hook_name={self.hook_name!r}"


class TopKAutoencoder(SparseAutoencoder):
    """The k largest pre-activations of each row (``relu``: then a ReLU, as SAELens does; Qwen-Scope
    keeps them as they are); ``rescale_acts_by_decoder_norm``: SAELens' option that scales the
    pre-activations by the decoder rows' norms (and the activations back before decoding)."""

    architecture = "topk"

    def __init__(self, d_in: int, d_sae: int, k: int, *, hook_name: str | None = None, model_name: str | None = None,
                 apply_b_dec_to_input: bool = True, rescale_acts_by_decoder_norm: bool = False, relu: bool = True,
                 metadata: dict | None = None):
        super().__init__(d_in, d_sae, hook_name=hook_name, model_name=model_name,
                         apply_b_dec_to_input=apply_b_dec_to_input, metadata=metadata)
        self.k = _positive("TopKAutoencoder", "k", k)
        if self.k > self.d_sae:
            raise InputError(f"TopKAutoencoder: k={k} is more than d_sae={d_sae} features")
        self.rescale_acts_by_decoder_norm = bool(rescale_acts_by_decoder_norm)
        self.relu = bool(relu)

    def pre(self, x: torch.Tensor) -> torch.Tensor:
        h = super().pre(x)
        return h * self.W_dec.norm(dim=-1) if self.rescale_acts_by_decoder_norm else h

    def encode_topk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [.., k], feature indices [.., k]) of the active features, largest first."""
        values, indices = self.pre(x).topk(self.k, dim=-1)
        return (values.relu() if self.relu else values), indices

    def activation(self, pre: torch.Tensor) -> torch.Tensor:
        values, indices = pre.topk(self.k, dim=-1)
        values = values.relu() if self.relu else values
        return torch.zeros_like(pre).scatter_(-1, indices, values)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations [.., d_sae] (k nonzero per row at most)."""
        values, indices = self.encode_topk(x)
        return torch.zeros(*values.shape[:-1], self.d_sae, device=values.device).scatter_(-1, indices, values)

    def decode(self, acts: torch.Tensor) -> torch.Tensor:
        if self.rescale_acts_by_decoder_norm:
            acts = acts / self.W_dec.norm(dim=-1)
        return acts @ self.W_dec + self.b_dec

    def feature_direction(self, index: int) -> torch.Tensor:
        row = super().feature_direction(index)
        return row / row.norm() if self.rescale_acts_by_decoder_norm else row

    def extra_repr(self) -> str:
        return (f"d_in={self.d_in}, d_sae={self.d_sae}, k={self.k}{'' if self.relu else ', relu=False'}, "
                f"hook_name={self.hook_name!r}")


class JumpReLUAutoencoder(SparseAutoencoder):
    """A JumpReLU sparse autoencoder (Rajamanoharan et al. 2024; Gemma Scope's architecture, SAELens'
    ``jumprelu``): a feature is active only above its own learned ``threshold``.

        pre = (x - b_dec) @ W_enc + b_enc           # b_dec subtracted when apply_b_dec_to_input
        acts = relu(pre) * (pre > threshold)        # [.., d_sae]
        x_hat = acts @ W_dec + b_dec

    as SAELens' ``JumpReLUSAE.encode`` computes it (``sae_lens/saes/jumprelu_sae.py``: ``hidden_pre =
    sae_in @ W_enc + b_enc``, ``activation_fn(hidden_pre) * (hidden_pre > threshold)``); its weights
    file adds ``threshold`` [d_sae] to the four tensors.
    """

    architecture = "jumprelu"

    def __init__(self, d_in: int, d_sae: int, *, hook_name: str | None = None, model_name: str | None = None,
                 apply_b_dec_to_input: bool = True, metadata: dict | None = None):
        super().__init__(d_in, d_sae, hook_name=hook_name, model_name=model_name,
                         apply_b_dec_to_input=apply_b_dec_to_input, metadata=metadata)
        self.threshold = nn.Parameter(torch.zeros(self.d_sae))

    def activation(self, pre: torch.Tensor) -> torch.Tensor:
        return pre.relu() * (pre > self.threshold)


TRANSCODERS = ("transcoder", "jumprelu_transcoder", "skip_transcoder")


class Transcoder(SparseAutoencoder):
    """Transcoders: a sparse map from one point of the residual stream to another (a layer's MoE input
    to its output, say), SAELens' ``transcoder``, ``jumprelu_transcoder`` and ``skip_transcoder``
    (``sae_lens/saes/transcoder.py``). The input is not centred by ``b_dec`` (it is as wide as the
    output, not the input):

        pre = x @ W_enc + b_enc                                  # [.., d_sae]
        acts = relu(pre)                      (transcoder, skip_transcoder)
             = relu(pre) * (pre > threshold)  (jumprelu_transcoder)
        out = acts @ W_dec + b_dec  (+ x @ W_skip.T for a skip transcoder)   # [.., d_out]

    ``W_dec`` is [d_sae, d_out], ``b_dec`` [d_out], ``W_skip`` [d_out, d_in]; ``hook_name`` is the
    point read and ``hook_name_out`` the point it stands in for (SAELens' cfg fields ``d_out`` and
    ``hook_name_out``). As an encoder (features, dashboards, timelines, clamps of the input) it
    works like an autoencoder; ``fvu`` and ``features.evaluate`` are for autoencoders only.
    """

    def __init__(self, d_in: int, d_sae: int, d_out: int, *, architecture: str = "transcoder",
                 hook_name: str | None = None, hook_name_out: str | None = None, model_name: str | None = None,
                 metadata: dict | None = None):
        if architecture not in TRANSCODERS:
            raise InputError(f"Transcoder: architecture={architecture!r}: expected one of {', '.join(TRANSCODERS)}")
        super().__init__(d_in, d_sae, d_out=d_out, hook_name=hook_name, model_name=model_name,
                         apply_b_dec_to_input=False, metadata=metadata)
        self.architecture = architecture
        if hook_name_out is not None:
            self.metadata["hook_name_out"] = hook_name_out
        if architecture == "jumprelu_transcoder":
            self.threshold = nn.Parameter(torch.zeros(self.d_sae))
        if architecture == "skip_transcoder":
            self.W_skip = nn.Parameter(torch.zeros(self.d_out, self.d_in))

    @property
    def hook_name_out(self) -> str | None:
        return self.metadata.get("hook_name_out")

    def activation(self, pre: torch.Tensor) -> torch.Tensor:
        acts = pre.relu()
        return acts * (pre > self.threshold) if self.architecture == "jumprelu_transcoder" else acts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.decode(self.encode(x))
        if self.architecture == "skip_transcoder":
            out = out + self._rows(x) @ self.W_skip.T
        return out

    def extra_repr(self) -> str:
        return (f"{self.architecture}: d_in={self.d_in}, d_sae={self.d_sae}, d_out={self.d_out}, "
                f"{self.hook_name!r} -> {self.hook_name_out!r}")


def from_saelens(path) -> SparseAutoencoder:
    """The autoencoder in the directory ``path`` (SAELens' layout, any architecture of
    ``saelens.ARCHITECTURES``), float32 on the CPU, without gradients."""
    cfg, tensors = saelens.read(path)
    arch = cfg["architecture"]
    if arch == "topk":
        sae = TopKAutoencoder(cfg["d_in"], cfg["d_sae"], cfg["k"], apply_b_dec_to_input=cfg["apply_b_dec_to_input"],
                              rescale_acts_by_decoder_norm=cfg["rescale_acts_by_decoder_norm"], metadata=cfg["metadata"])
    elif arch == "jumprelu":
        sae = JumpReLUAutoencoder(cfg["d_in"], cfg["d_sae"], apply_b_dec_to_input=cfg["apply_b_dec_to_input"],
                                  metadata=cfg["metadata"])
    else:
        sae = Transcoder(cfg["d_in"], cfg["d_sae"], cfg["d_out"], architecture=arch, metadata=cfg["metadata"])
    with torch.no_grad():
        for name, t in tensors.items():
            getattr(sae, name).copy_(t)
    return sae.requires_grad_(False)
