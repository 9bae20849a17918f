"""clover_lab: run, watch and take apart the Clover block-diffusion language model."""
from .cache import CacheFullError, CloverCache
from .config import PRESETS, CloverConfig, ConfigError
from .hooks import HookError, StopGeneration
from .loading import CheckpointError
from .model import CloverModel, Coreset, StepOutput
from .capture import Capture, Record
from .events import CommitEvent, StepEvent, StreamUpdate
from .generate import Engine, GenerationError, GenerationResult, GenerationStats, load
from .sampling import SamplerSettings

__version__ = "0.1.0"
__all__ = [
    "CloverConfig", "ConfigError", "PRESETS", "CloverModel", "CloverCache", "CacheFullError", "Coreset",
    "StepOutput", "CheckpointError", "HookError", "StopGeneration",
    "Engine", "load", "GenerationResult", "GenerationStats", "GenerationError", "SamplerSettings",
    "StepEvent", "CommitEvent", "StreamUpdate", "Capture", "Record",
]
