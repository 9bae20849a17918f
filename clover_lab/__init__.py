"""clover_lab: run, watch and take apart the Clover block-diffusion language model."""
from .cache import CacheFullError, CloverCache
from .config import PRESETS, CloverConfig, ConfigError
from .context import Coreset
from .errors import CloverError, CorpusError, InputError
from .engine import BatchResult, BatchStats, Engine, GenerationError, GenerationResult, GenerationStats, StreamUpdate, load
from .hooks import Capture, CommitEvent, HookError, Record, StepEvent, StopGeneration, Trace, load_trace
from .hooks.trace_checks import TraceError
from .loading import CheckpointError
from .model import CloverModel, StepOutput
from .sampling import SamplerSettings, SettingsError

__version__ = "0.1.0"
__all__ = [
    "CloverError", "InputError", "CorpusError", "TraceError", "CloverConfig", "ConfigError", "PRESETS", "CloverModel", "CloverCache", "CacheFullError", "Coreset",
    "StepOutput", "CheckpointError", "HookError", "StopGeneration",
    "Engine", "load", "BatchResult", "BatchStats", "GenerationResult", "GenerationStats", "GenerationError", "SamplerSettings", "SettingsError",
    "StepEvent", "CommitEvent", "StreamUpdate", "Capture", "Record", "Trace", "load_trace",
]
