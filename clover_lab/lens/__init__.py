"""Lenses over a generation: the logit lens per denoising step (``logit``), the routing lens across
steps (``routing``), and the coreset explorer (``coreset``)."""
from clover_lab.lens.coreset import coreset_sweep
from clover_lab.lens.logit import LensStep, LogitLens, logit_lens
from clover_lab.lens.routing import RoutingLens, entropy, overlap, routing_lens

__all__ = ["LensStep", "LogitLens", "logit_lens", "RoutingLens", "entropy", "overlap", "routing_lens",
           "coreset_sweep"]
