"""clover_lab: run, watch and take apart the Clover block-diffusion language model.

The names below are imported from the module that defines each on first use (PEP 562), and so are
the subpackages (``clover_lab.engine``): ``import clover_lab`` costs nothing, so that the command
line's entry point (``clover_lab.cli.main``) runs before torch is imported and handles a Ctrl-C
from its first instant (one raised during torch's import was a traceback, or was swallowed by it)."""
import importlib

__version__ = "0.1.0"

# name -> the module that defines it
_DEFINED_IN = {
    "PRESETS": "clover_lab.config", "CloverConfig": "clover_lab.config", "ConfigError": "clover_lab.config",
    "BatchResult": "clover_lab.engine.results", "Request": "clover_lab.engine.requests",
    "Handle": "clover_lab.engine.row",
    "GenerationResult": "clover_lab.engine.results", "GenerationStats": "clover_lab.engine.results",
    "StreamUpdate": "clover_lab.engine.results", "Engine": "clover_lab.engine.engine", "load": "clover_lab.engine.engine",
    "GenerationError": "clover_lab.engine.requests",
    "SamplerSettings": "clover_lab.engine.sampling", "SettingsError": "clover_lab.engine.sampling",
    "CheckpointError": "clover_lab.errors", "CloverError": "clover_lab.errors", "CorpusError": "clover_lab.errors",
    "InputError": "clover_lab.errors", "OutputError": "clover_lab.errors", "GrammarError": "clover_lab.errors",
    "Grammar": "clover_lab.grammar.grammar", "GrammarPolicy": "clover_lab.grammar.policy",
    "Capture": "clover_lab.hooks.capture", "CommitEvent": "clover_lab.hooks.events", "StepEvent": "clover_lab.hooks.events",
    "HookError": "clover_lab.hooks.registry", "StopGeneration": "clover_lab.hooks.registry",
    "Record": "clover_lab.hooks.records", "Trace": "clover_lab.hooks.trace", "load_trace": "clover_lab.hooks.trace",
    "TraceError": "clover_lab.hooks.trace",
    "CacheFullError": "clover_lab.model.cache", "CloverCache": "clover_lab.model.cache",
    "Coreset": "clover_lab.model.context",
    "CloverModel": "clover_lab.model.decoder", "StepOutput": "clover_lab.model.decoder",
}
__all__ = [
    "CloverError", "InputError", "CorpusError", "TraceError", "CloverConfig", "ConfigError", "PRESETS", "CloverModel", "CloverCache", "CacheFullError", "Coreset",
    "StepOutput", "CheckpointError", "HookError", "StopGeneration",
    "Engine", "load", "BatchResult", "Request", "Handle", "GenerationResult", "GenerationStats", "GenerationError", "SamplerSettings", "SettingsError",
    "StepEvent", "CommitEvent", "StreamUpdate", "Capture", "Record", "Trace", "load_trace", "OutputError",
    "GrammarError", "Grammar", "GrammarPolicy",
]


def __getattr__(name: str):
    if name in _DEFINED_IN:
        value = getattr(importlib.import_module(_DEFINED_IN[name]), name)
    else:
        try:  # a subpackage or module: clover_lab.engine, clover_lab.writes ...
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
