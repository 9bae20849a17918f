"""Qwen-Scope's released sparse autoencoders (the Qwen team's TopK SAEs on the residual stream of
Qwen3 / Qwen3.5, e.g. ``Qwen/SAE-Res-Qwen3.5-35B-A3B-Base-W32K-L0_50`` and ``-W128K-L0_100`` for
the trunk Clover is built on: layers 0-39, d_model 2048, widths 32768 / 131072, K 50 / 100).

The format, from their model card (https://huggingface.co/Qwen/SAE-Res-Qwen3.5-35B-A3B-Base-W32K-L0_50,
"Architecture" and "Feature Activation Extraction"; the same card ships with every Qwen-Scope
release): one file ``layer{n}.sae.pt`` per layer, a plain ``dict`` of four tensors

    W_enc [d_sae, d_model]    b_enc [d_sae]    W_dec [d_model, d_sae]    b_dec [d_model]

(both matrices stored transposed against SAELens'), read with ``torch.load``; the card's encoder
is ``pre_acts = residual @ W_enc.T + b_enc``, then the top K of ``pre_acts`` kept as they are (no
ReLU, no ``b_dec`` subtracted), and the residual is the output of ``model.model.layers[n]``:
clover_lab's ``layers.{n}.output``. K is not in the file: it is the ``L0_{K}`` of the release's
name (given here as ``k=``, or read from a folder so named).

    sae = features.load_qwen_scope("SAE-Res-Qwen3.5-35B-A3B-Base-W32K-L0_50/layer20.sae.pt")
    features.save_qwen_scope(sae, "runs/layer2.sae.pt")       # ours, in their format
"""
from __future__ import annotations

import numbers
import pickle
import re
from pathlib import Path

import torch

from clover_lab.errors import InputError
from clover_lab.features.autoencoder import SparseAutoencoder, TopKAutoencoder
from clover_lab.features.saelens import AutoencoderFileError
from clover_lab.hooks import points as P
from clover_lab.writes import atomic_path

KEYS = ("W_enc", "b_enc", "W_dec", "b_dec")
_LAYER = re.compile(r"layer(\d+)\.sae\.pt$")
_K = re.compile(r"L0_(\d+)")


def shapes(d_model: int, d_sae: int) -> dict[str, tuple[int, int] | tuple[int]]:
    return {"W_enc": (d_sae, d_model), "b_enc": (d_sae,), "W_dec": (d_model, d_sae), "b_dec": (d_model,)}


def _k_of(path: Path) -> int | None:
    for part in reversed(path.resolve().parts[:-1]):
        m = _K.search(part)
        if m:
            return int(m.group(1))
    return None


def load_qwen_scope(path, k: int | None = None, *, layer: int | None = None) -> TopKAutoencoder:
    """The Qwen-Scope file ``path`` (``layer{n}.sae.pt``) as a TopK autoencoder reading
    ``layers.{n}.output`` (``layer``: when the file is named otherwise), keeping the top ``k``
    pre-activations without a ReLU (``k`` default: the ``L0_{K}`` in a folder's name)."""
    path = Path(path)
    if not path.is_file():
        raise AutoencoderFileError(f"{path}: no such file (a Qwen-Scope SAE is a file layer{{n}}.sae.pt)")
    m = _LAYER.search(path.name)
    if layer is None:
        if m is None:
            raise AutoencoderFileError(f"{path}: the name does not say the layer (Qwen-Scope names its files "
                                       f"layer{{n}}.sae.pt); give layer=")
        layer = int(m.group(1))
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or layer < 0:
        raise InputError(f"load_qwen_scope: layer={layer!r}: expected a layer number (an int >= 0)")
    if k is None:
        k = _k_of(path)
        if k is None:
            raise AutoencoderFileError(f"{path}: the K of the TopK is not in the file, and no folder above it is named "
                                       f"like a release (…-L0_50); give k= (50 or 100 in Qwen-Scope's releases)")
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as e:
        raise AutoencoderFileError(f"{path}: not a readable PyTorch file ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise AutoencoderFileError(f"{path}: expected a dict of tensors ({', '.join(KEYS)}), got "
                                   f"{type(state).__name__}")
    missing = [key for key in KEYS if key not in state]
    if missing:
        raise AutoencoderFileError(f"{path}: no key {', '.join(map(repr, missing))} (a Qwen-Scope SAE holds "
                                   f"{', '.join(KEYS)}; this file holds {', '.join(map(str, sorted(state))) or 'nothing'})")
    extra = sorted(str(key) for key in state if key not in KEYS)
    if extra:
        raise AutoencoderFileError(f"{path}: unexpected keys {', '.join(map(repr, extra))} for a Qwen-Scope SAE "
                                   f"({', '.join(KEYS)})")
    for key in KEYS:
        t = state[key]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise AutoencoderFileError(f"{path}: key {key!r} is {getattr(t, 'dtype', type(t).__name__)}, expected a "
                                       f"float tensor")
    if state["W_enc"].dim() != 2:
        raise AutoencoderFileError(f"{path}: key 'W_enc' has shape {list(state['W_enc'].shape)}; expected "
                                   f"[d_sae, d_model]")
    d_sae, d_model = state["W_enc"].shape
    for key, shape in shapes(d_model, d_sae).items():
        if tuple(state[key].shape) != shape:
            raise AutoencoderFileError(f"{path}: key {key!r} has shape {list(state[key].shape)}; W_enc "
                                       f"[{d_sae}, {d_model}] (d_sae, d_model) makes it {list(shape)}")
        if not bool(torch.isfinite(state[key]).all()):
            raise AutoencoderFileError(f"{path}: key {key!r} holds NaN or inf")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= d_sae:
        raise InputError(f"load_qwen_scope: k={k!r}: expected an int in 1..{d_sae} (d_sae)")
    sae = TopKAutoencoder(d_model, d_sae, int(k), hook_name=P.layer_point(int(layer), P.OUTPUT),
                          apply_b_dec_to_input=False, relu=False,
                          metadata={"format": "qwen-scope", "source": str(path)})
    with torch.no_grad():
        sae.W_enc.copy_(state["W_enc"].float().T)
        sae.b_enc.copy_(state["b_enc"].float())
        sae.W_dec.copy_(state["W_dec"].float().T)
        sae.b_dec.copy_(state["b_dec"].float())
    return sae.requires_grad_(False)


def save_qwen_scope(sae: SparseAutoencoder, path) -> Path:
    """``sae`` in Qwen-Scope's format: the four tensors, transposed to theirs, in the file ``path``
    (written whole or not at all). Only what the format can say: a TopK autoencoder without
    ReLU, nothing subtracted from its input, no rescaling (the K lives in the release's name)."""
    if not isinstance(sae, TopKAutoencoder):
        raise InputError(f"save_qwen_scope: Qwen-Scope's format holds TopK autoencoders, got {type(sae).__name__}")
    bad = [what for what, on in (("relu=True", sae.relu), ("apply_b_dec_to_input=True", sae.apply_b_dec_to_input),
                                 ("rescale_acts_by_decoder_norm=True", sae.rescale_acts_by_decoder_norm)) if on]
    if bad:
        raise InputError(f"save_qwen_scope: the format's encoder is topk(x @ W_enc.T + b_enc) kept as it is; this "
                         f"autoencoder has {', '.join(bad)}")
    state = {"W_enc": sae.W_enc.detach().float().T.contiguous().cpu(), "b_enc": sae.b_enc.detach().float().cpu(),
             "W_dec": sae.W_dec.detach().float().T.contiguous().cpu(), "b_dec": sae.b_dec.detach().float().cpu()}
    with atomic_path(path) as tmp:
        torch.save(state, str(tmp))
    return Path(path)
