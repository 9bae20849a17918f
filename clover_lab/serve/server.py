"""``clover-lab serve``: the app on uvicorn. SIGTERM and Ctrl-C stop accepting connections and
let the streams in flight finish (up to ``graceful`` seconds; past that they are cut and their
rows freed), then the worker finishes and the process exits 0."""
from __future__ import annotations

import contextlib
import signal
import threading

import uvicorn

from clover_lab.serve.app import create_app


class Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, less re-raising the signal after the shutdown: a shutdown asked for and done
        cleanly exits 0, not killed by the signal."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def serve(engine, host: str = "127.0.0.1", port: int = 8000, model_name: str = "clover", max_batch: int = 32,
          max_queue: int = 256, graceful: float = 60.0, log_level: str = "info", sock=None,
          open_schemas: bool = False) -> None:
    """Serve until SIGTERM or Ctrl-C; ``sock``: a socket bound already (``clover-lab serve`` binds it
    before the model loads), else uvicorn binds ``host``:``port``."""
    app = create_app(engine, model_name=model_name, max_batch=max_batch, max_queue=max_queue,
                     open_schemas=open_schemas)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful)
    Server(config).run(sockets=None if sock is None else [sock])
