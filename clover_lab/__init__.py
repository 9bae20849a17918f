"""clover_lab: run, watch and take apart the Clover block-diffusion language model."""
from .cache import CacheFullError, CloverCache
from .config import PRESETS, CloverConfig, ConfigError
from .hooks import HookError, StopGeneration
from .loading import CheckpointError
from .model import CloverModel, Coreset, StepOutput

__version__ = "0.1.0"
__all__ = [
    "CloverConfig", "ConfigError", "PRESETS", "CloverModel", "CloverCache", "CacheFullError", "Coreset",
    "StepOutput", "CheckpointError", "HookError", "StopGeneration",
]
