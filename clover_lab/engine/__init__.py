"""The engine: the front door (``engine.py``), the block-diffusion loop (``diffusion.py``), the AR
loop (``ar.py``), one generation's state (``run.py``), request checks (``requests.py``), static
steps, CUDA graphs and torch.compile (``runner.py``), what a generation returns (``results.py``),
and batched generation (``batch.py``: rows sharing forwards; ``batch_loops.py``: their loops)."""
from .batch import BatchResult, BatchStats
from .engine import Engine, load
from .requests import GenerationError
from .results import GenerationResult, GenerationStats, StreamUpdate

__all__ = ["BatchResult", "BatchStats", "Engine", "load", "GenerationError", "GenerationResult", "GenerationStats",
           "StreamUpdate"]
