"""The engine: the front door (``engine.py``; its checked settings in ``attributes.py``, ``load``
in ``loader.py``), one generation's rows (``run.py``: a single
prompt is a batch of one), the block-diffusion loop (``diffusion.py``) and the AR loop
(``ar.py``), each written once, the decoding seam (``policy.py``) and the rules behind it (``policies.py``), exact
self-speculative decoding (``speculative.py``), the runner (``runner.py``:
the only caller of the model, it owns the cache and picks per step a static step or the eager
forward), static steps, CUDA graphs and torch.compile (``graphs.py``), request checks
(``requests.py``), where non-finite logits came from (``faults.py``) and what a generation
returns (``results.py``, ``batch.py``)."""
from .batch import BatchResult, BatchStats
from .engine import Engine
from .loader import load
from .policies import EntropyBoundedPolicy, TopKPolicy, make_policy
from .policy import DecodingPolicy, Proposal, ThresholdPolicy
from .requests import GenerationError
from .results import GenerationResult, GenerationStats, StreamUpdate

__all__ = ["BatchResult", "BatchStats", "DecodingPolicy", "Engine", "load", "GenerationError", "GenerationResult",
           "GenerationStats", "Proposal", "StreamUpdate", "ThresholdPolicy"]
