"""Lenses over a generation: the logit lens per denoising step (``logit``) and the routing lens
across steps (``routing``)."""
from .logit import LensStep, LogitLens, logit_lens

__all__ = ["LensStep", "LogitLens", "logit_lens"]
