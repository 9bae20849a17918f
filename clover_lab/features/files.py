"""One reader for every sparse-autoencoder file clover_lab knows: a directory in SAELens' layout
(TopK, JumpReLU, transcoders: ``saelens.py``) or a Qwen-Scope ``layer{n}.sae.pt`` (``qwen_scope.py``).

    sae = features.load("runs/sae")                                   # SAELens' cfg.json + weights
    sae = features.load("SAE-Res-Qwen3.5-35B-A3B-Base-W32K-L0_50/layer20.sae.pt")
"""
from __future__ import annotations

from pathlib import Path

from clover_lab.features import saelens
from clover_lab.features.autoencoder import from_saelens
from clover_lab.features.qwen_scope import load_qwen_scope


def load(path, **options):
    """The autoencoder at ``path``: a directory is SAELens' layout, a ``.pt`` file Qwen-Scope's
    (``options``: ``k=``, ``layer=`` of ``load_qwen_scope``)."""
    path = Path(path)
    if path.suffix == ".pt":
        return load_qwen_scope(path, **options)
    if options:
        raise saelens.AutoencoderFileError(f"{path}: {', '.join(options)} apply to Qwen-Scope's .pt files; a "
                                           f"SAELens directory says everything in its cfg.json")
    if path.is_file():
        raise saelens.AutoencoderFileError(f"{path}: a file that is not a Qwen-Scope .pt; clover_lab reads SAELens' "
                                           f"layout (a directory with {saelens.CFG_FILE}) and Qwen-Scope's "
                                           f"layer{{n}}.sae.pt")
    return from_saelens(path)
