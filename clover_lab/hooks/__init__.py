"""Hooks: named points, each declared once with its event class and saved fields (``points``),
the registry (``registry``), the events hooks receive (``events``) and recordings over whole
generations (``capture``)."""
from clover_lab.hooks.capture import Capture
from clover_lab.hooks.events import (
    CommitEvent,
    GDNPreviewEvent,
    GDNStateEvent,
    ResidualEvent,
    RouteEvent,
    StepEvent,
    Where,
)
from clover_lab.hooks.points import BLOCK_COMMIT, DENOISE_STEP, ENGINE_POINTS, hook_points, layer_point
from clover_lab.hooks.records import Record
from clover_lab.hooks.registry import HookError, HookHandle, HookRegistry, HookView, StopGeneration, hook_depth
from clover_lab.hooks.trace import Divergence, Trace, load_trace

__all__ = ["Capture", "Record", "Divergence", "Trace", "load_trace", "CommitEvent", "GDNPreviewEvent", "GDNStateEvent", "ResidualEvent", "RouteEvent", "StepEvent",
           "Where", "BLOCK_COMMIT", "DENOISE_STEP", "ENGINE_POINTS", "hook_points", "layer_point", "HookError",
           "HookHandle", "HookRegistry", "HookView", "StopGeneration", "hook_depth"]
