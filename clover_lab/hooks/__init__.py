"""Hooks: named points (``points``), the registry (``registry``), the events hooks receive
(``events``) and recordings over whole generations (``capture``)."""
from .capture import Capture, Record
from .events import CommitEvent, GDNPreviewEvent, GDNStateEvent, RouteEvent, StepEvent, Where
from .points import BLOCK_COMMIT, DENOISE_STEP, ENGINE_POINTS, hook_points, layer_point
from .registry import HookError, HookHandle, HookRegistry, HookView, StopGeneration, hook_depth

__all__ = ["Capture", "Record", "CommitEvent", "GDNPreviewEvent", "GDNStateEvent", "RouteEvent", "StepEvent",
           "Where", "BLOCK_COMMIT", "DENOISE_STEP", "ENGINE_POINTS", "hook_points", "layer_point", "HookError",
           "HookHandle", "HookRegistry", "HookView", "StopGeneration", "hook_depth"]
