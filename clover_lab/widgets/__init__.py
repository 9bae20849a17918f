"""Live notebook views of a running Clover engine, fed by its hook points.

    from clover_lab.widgets import Dashboard, DenoiseView, ExpertView, MemoryView, SpeedView
    from clover_lab.widgets import LensView, PatchingView        # the logit lens, a patching sweep

    view = DenoiseView(engine)            # attached until view.close()
    view                                  # display it, then generate in this or a later cell
    engine.generate("def f(x):")          # the view updates while it runs

    with DenoiseView().attach(engine) as view:   # attached only inside the block
        engine.generate("def f(x):")

Every view redraws at most ``fps`` times a second while a generation runs (the final frame is
always drawn), keeps its frames for replay (the slider under it, or ``view.show_frame(i)``) and
exports to one self-contained HTML file (``view.export_html(path)``, plotly.js inline). Closing a
view removes its hooks; an engine with no view attached pays nothing.

Needs the notebook extra: ``pip install 'clover-lab[notebook]'``.
"""
from .base import Attachment, Throttle, View, export_html
from .dashboard import Dashboard
from .denoise import DenoiseView
from .experts import ExpertView
from .lens import LensView
from .memory import MemoryView
from .patching import PatchingView
from .speed import SpeedView

__all__ = ["Attachment", "Dashboard", "DenoiseView", "ExpertView", "LensView", "MemoryView", "PatchingView",
           "SpeedView", "Throttle", "View", "export_html"]
