"""A TopK sparse autoencoder over one residual point (Gao et al. 2024, SAELens' ``topk``):

    pre = (x - b_dec) @ W_enc + b_enc            # [.., d_sae]   (b_dec subtracted when apply_b_dec_to_input)
    acts = relu(topk(pre, k))                    # k nonzero features per row, the rest 0
    x_hat = acts @ W_dec + b_dec                 # [.., d_in]

Its files are SAELens' layout (``saelens.py``): ``sae.save(path)`` writes what SAELens'
``SAE.load_from_disk`` reads, and ``TopKAutoencoder.load(path)`` reads what SAELens saves.
``hook_name`` (``metadata.hook_name``) names the point it reads, ``layers.2.output`` for the ones
clover_lab trains. Everything is computed in float32 whatever the stream's dtype.
"""
from __future__ import annotations

import numbers
from pathlib import Path

import torch
from torch import nn

from clover_lab.errors import InputError
from clover_lab.features import saelens
from clover_lab.hooks import points as P


class TopKAutoencoder(nn.Module):
    def __init__(self, d_in: int, d_sae: int, k: int, *, hook_name: str | None = None, model_name: str | None = None,
                 apply_b_dec_to_input: bool = True, rescale_acts_by_decoder_norm: bool = False,
                 metadata: dict | None = None):
        super().__init__()
        for name, value in (("d_in", d_in), ("d_sae", d_sae), ("k", k)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise InputError(f"TopKAutoencoder: {name}={value!r}: expected a positive integer")
        if k > d_sae:
            raise InputError(f"TopKAutoencoder: k={k} is more than d_sae={d_sae} features")
        self.d_in, self.d_sae, self.k = int(d_in), int(d_sae), int(k)
        self.W_enc = nn.Parameter(torch.zeros(d_in, d_sae))
        self.b_enc = nn.Parameter(torch.zeros(d_sae))
        self.W_dec = nn.Parameter(torch.zeros(d_sae, d_in))
        self.b_dec = nn.Parameter(torch.zeros(d_in))
        self.apply_b_dec_to_input = bool(apply_b_dec_to_input)
        self.rescale_acts_by_decoder_norm = bool(rescale_acts_by_decoder_norm)
        self.metadata = dict(metadata or {})
        if hook_name is not None:
            self.metadata["hook_name"] = hook_name
        if model_name is not None:
            self.metadata["model_name"] = model_name

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
        h = x @ self.W_enc + self.b_enc
        return h * self.W_dec.norm(dim=-1) if self.rescale_acts_by_decoder_norm else h

    def encode_topk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [.., k] >= 0, feature indices [.., k]) of the active features, largest first."""
        values, indices = self.pre(x).topk(self.k, dim=-1)
        return values.relu(), indices

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations [.., d_sae] (k nonzero per row at most)."""
        values, indices = self.encode_topk(x)
        return torch.zeros(*values.shape[:-1], self.d_sae, device=values.device).scatter_(-1, indices, values)

    def decode(self, acts: torch.Tensor) -> torch.Tensor:
        """Reconstructions [.., d_in] of activations [.., d_sae]."""
        if self.rescale_acts_by_decoder_norm:
            acts = acts / self.W_dec.norm(dim=-1)
        return acts @ self.W_dec + self.b_dec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))

    @torch.no_grad()
    def fvu(self, x: torch.Tensor, chunk: int = 8192) -> float:
        """Fraction of variance unexplained over rows x [N, d_in]: sum |x - x_hat|^2 over sum
        |x - mean x|^2."""
        x = self._rows(x).reshape(-1, self.d_in)
        if len(x) < 2:
            raise InputError(f"fvu needs at least 2 rows, got {len(x)}")
        mean = x.mean(0)
        err = sum(float((self(c) - c).pow(2).sum()) for c in x.split(chunk))
        total = float((x - mean).pow(2).sum())
        return err / total if total > 0 else float("nan")

    def feature_direction(self, index: int) -> torch.Tensor:
        """Feature ``index``'s decoder row [d_in] (the direction it adds per unit of activation)."""
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= index < self.d_sae:
            raise InputError(f"feature {index!r}: this autoencoder has features 0..{self.d_sae - 1}")
        row = self.W_dec.detach()[int(index)].float()
        return row / self.W_dec.detach().norm(dim=-1)[int(index)] if self.rescale_acts_by_decoder_norm else row

    # ---------------------------------------------------------------- files
    def save(self, path) -> Path:
        """Write SAELens' layout (cfg.json + sae_weights.safetensors) to the directory ``path``."""
        meta = {k: (saelens.finite_number(v) if isinstance(v, float) else v) for k, v in self.metadata.items()}
        cfg = saelens.config(self.d_in, self.d_sae, self.k, meta, self.apply_b_dec_to_input,
                             self.rescale_acts_by_decoder_norm)
        return saelens.write(path, cfg, {k: getattr(self, k) for k in saelens.TENSORS})

    @classmethod
    def load(cls, path) -> "TopKAutoencoder":
        """A TopK autoencoder in SAELens' layout (ours, or one SAELens saved)."""
        cfg, tensors = saelens.read(path)
        sae = cls(cfg["d_in"], cfg["d_sae"], cfg["k"], apply_b_dec_to_input=cfg["apply_b_dec_to_input"],
                  rescale_acts_by_decoder_norm=cfg["rescale_acts_by_decoder_norm"], metadata=cfg["metadata"])
        with torch.no_grad():
            for name, t in tensors.items():
                getattr(sae, name).copy_(t)
        return sae.requires_grad_(False)

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_sae={self.d_sae}, k={self.k}, hook_name={self.hook_name!r}"
