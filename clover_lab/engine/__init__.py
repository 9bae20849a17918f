"""The engine: the front door (``engine.py``: ``Engine`` and ``load``; its checked settings in
``attributes.py``), requests and their check (``requests.py``), rows and the handles of their
requests (``row.py``), the one step loop (``step_loop.py``: submit -> step -> runner -> decoders ->
updates), the decoders of its three modes (``diffusion.py``, ``ar.py``, ``speculative.py`` with
``acceptance.py``), decoding policies (``policies.py``: the seam and the rules behind it),
sampling (``sampling.py``), the runner (``runner.py``: the only caller of the model, it owns the
cache and picks per forward a static step or the eager forward), static steps, CUDA graphs and
torch.compile (``graphs.py``), where non-finite logits came from (``faults.py``) and what a
generation returns (``results.py``)."""
from clover_lab.engine.engine import Engine, load
from clover_lab.engine.policies import (
           DecodingPolicy,
           EntropyBoundedPolicy,
           LookAheadPolicy,
           Proposal,
           ThresholdPolicy,
           TopKPolicy,
           make_policy,
)
from clover_lab.engine.requests import GenerationError, Request
from clover_lab.engine.results import BatchResult, GenerationResult, GenerationStats, StreamUpdate
from clover_lab.engine.row import Handle

__all__ = ["BatchResult", "Handle", "Request", "DecodingPolicy", "Engine", "load", "GenerationError",
           "GenerationResult", "GenerationStats", "Proposal", "StreamUpdate", "ThresholdPolicy",
           "EntropyBoundedPolicy", "LookAheadPolicy", "TopKPolicy", "make_policy"]
