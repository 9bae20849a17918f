"""clover_lab: run, watch and take apart the Clover block-diffusion language model."""
from clover_lab.config import PRESETS, CloverConfig, ConfigError
from clover_lab.engine import (
    BatchResult,
    BatchStats,
    Engine,
    GenerationError,
    GenerationResult,
    GenerationStats,
    StreamUpdate,
    load,
)
from clover_lab.engine.sampling import SamplerSettings, SettingsError
from clover_lab.errors import CheckpointError, CloverError, CorpusError, InputError, OutputError
from clover_lab.hooks import Capture, CommitEvent, HookError, Record, StepEvent, StopGeneration, Trace, load_trace
from clover_lab.hooks.trace import TraceError
from clover_lab.model.cache import CacheFullError, CloverCache
from clover_lab.model.context import Coreset
from clover_lab.model.decoder import CloverModel, StepOutput

__version__ = "0.1.0"
__all__ = [
    "CloverError", "InputError", "CorpusError", "TraceError", "CloverConfig", "ConfigError", "PRESETS", "CloverModel", "CloverCache", "CacheFullError", "Coreset",
    "StepOutput", "CheckpointError", "HookError", "StopGeneration",
    "Engine", "load", "BatchResult", "BatchStats", "GenerationResult", "GenerationStats", "GenerationError", "SamplerSettings", "SettingsError",
    "StepEvent", "CommitEvent", "StreamUpdate", "Capture", "Record", "Trace", "load_trace", "OutputError",
]
