"""``clover-lab serve``: an OpenAI-compatible HTTP server over one engine (``app.py``), its
request bodies (``schemas.py``, checked into jobs by ``jobs.py``), the worker that owns the
engine and batches (``scheduler.py``), the answers' shapes (``responses.py``) and Prometheus
metrics (``prometheus.py``)."""
from clover_lab.serve.app import create_app

__all__ = ["create_app"]
