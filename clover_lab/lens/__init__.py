"""Lenses over a generation: the logit lens per denoising step (``logit``), the routing lens across
steps (``routing``), and the coreset explorer (``coreset``)."""
from .coreset import coreset_sweep
from .logit import LensStep, LogitLens, logit_lens
from .routing import RoutingLens, entropy, overlap, routing_lens

__all__ = ["LensStep", "LogitLens", "logit_lens", "RoutingLens", "entropy", "overlap", "routing_lens",
           "coreset_sweep"]
