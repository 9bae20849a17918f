"""Live notebook views of a running Clover engine, fed by its hook points.

    from clover_lab.widgets import Dashboard, DenoiseView, ExpertView, MemoryView, SpeedView
    from clover_lab.widgets import LensView, PatchingView        # the logit lens, a patching sweep
    from clover_lab.widgets import FeatureView                   # an autoencoder's features per step
    from clover_lab.widgets import AttentionView, ProbeView      # attention patterns, GDN history, probes
    from clover_lab.widgets import FeatureDashboardView          # one feature over a corpus

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
from clover_lab.widgets.attention_patterns import AttentionView
from clover_lab.widgets.base import View
from clover_lab.widgets.dashboard import Dashboard
from clover_lab.widgets.denoise import DenoiseView
from clover_lab.widgets.experts import ExpertView
from clover_lab.widgets.feature_dashboard import FeatureDashboardView
from clover_lab.widgets.features import FeatureView
from clover_lab.widgets.lens import LensView
from clover_lab.widgets.memory import MemoryView
from clover_lab.widgets.patching import PatchingView
from clover_lab.widgets.pieces import export_html
from clover_lab.widgets.probe_map import ProbeView
from clover_lab.widgets.speed import SpeedView
from clover_lab.widgets.throttle import Attachment, Throttle

__all__ = ["Attachment", "AttentionView", "Dashboard", "DenoiseView", "ExpertView", "FeatureDashboardView", "FeatureView",
           "LensView", "MemoryView", "PatchingView", "ProbeView", "SpeedView", "Throttle", "View", "export_html"]
