"""The engine: the front door (``engine.py``: ``Engine`` and ``load``; its checked settings in
``attributes.py``), one generation's rows (``run.py``: a single prompt is a batch of one), the
block-diffusion loop (``diffusion.py``) and the AR loop (``ar.py``), each written once, decoding
policies (``policies.py``: the seam and the rules behind it), sampling (``sampling.py``), exact
self-speculative decoding (``speculative.py``, with ``acceptance.py``), the runner (``runner.py``:
the only caller of the model, it owns the cache and picks per step a static step or the eager
forward), static steps, CUDA graphs and torch.compile (``graphs.py``), request checks
(``requests.py``), where non-finite logits came from (``faults.py``) and what a generation
returns (``results.py``)."""
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
from clover_lab.engine.requests import GenerationError
from clover_lab.engine.results import BatchResult, BatchStats, GenerationResult, GenerationStats, StreamUpdate

__all__ = ["BatchResult", "BatchStats", "DecodingPolicy", "Engine", "load", "GenerationError", "GenerationResult",
           "GenerationStats", "Proposal", "StreamUpdate", "ThresholdPolicy", "EntropyBoundedPolicy", "LookAheadPolicy",
           "TopKPolicy", "make_policy"]
