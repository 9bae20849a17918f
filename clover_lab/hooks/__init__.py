"""Hooks: named points, each declared once with its event class and saved fields (``points``),
the registry (``registry``), the events hooks receive (``events``) and recordings over whole
generations (``capture``)."""
from .capture import Capture
from .records import Record
from .trace import Divergence, Trace, load_trace
from .events import CommitEvent, GDNPreviewEvent, GDNStateEvent, ResidualEvent, RouteEvent, StepEvent, Where
from .points import BLOCK_COMMIT, DENOISE_STEP, ENGINE_POINTS, hook_points, layer_point
from .registry import HookError, HookHandle, HookRegistry, HookView, StopGeneration, hook_depth

__all__ = ["Capture", "Record", "Divergence", "Trace", "load_trace", "CommitEvent", "GDNPreviewEvent", "GDNStateEvent", "ResidualEvent", "RouteEvent", "StepEvent",
           "Where", "BLOCK_COMMIT", "DENOISE_STEP", "ENGINE_POINTS", "hook_points", "layer_point", "HookError",
           "HookHandle", "HookRegistry", "HookView", "StopGeneration", "hook_depth"]
