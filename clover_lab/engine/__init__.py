"""The engine: the front door (``engine.py``), the block-diffusion loop (``diffusion.py``), the AR
loop (``ar.py``), one generation's state (``run.py``), request checks (``requests.py``), static
steps, CUDA graphs and torch.compile (``runner.py``) and what a generation returns (``results.py``)."""
from .engine import Engine, load
from .requests import GenerationError
from .results import GenerationResult, GenerationStats, StreamUpdate

__all__ = ["Engine", "load", "GenerationError", "GenerationResult", "GenerationStats", "StreamUpdate"]
