"""The server launcher that replaces vLLM's and SGLang's in their own OpenAI-server tests (the
tests are theirs and not committed here; docs/guides/serving.md, "Peers' tests"): ``clover-lab serve``'s app over
the embedded model in float32, in this process on 127.0.0.1, served under the model name the test
asks for. ``RemoteOpenAIServer`` has the interface of vLLM's ``tests.utils.RemoteOpenAIServer``
that their tests use (and ``get_tokenizer`` its tokenizer); ``start(model)`` returns the base URL and a stop function for SGLang's
``setUpClass``."""
from __future__ import annotations

import socket
import threading
import time

import openai
import torch

import clover_lab
from clover_lab.serve import create_app

_engine = None


def engine():
    global _engine
    if _engine is None:
        torch.set_num_threads(1)
        _engine = clover_lab.load(dtype=torch.float32)
    return _engine


def get_tokenizer(tokenizer_name=None, **_):
    """vLLM's ``get_tokenizer`` in its tests: the served model's tokenizer, whatever name it is served under."""
    return engine().tokenizer


def start(model: str, **app_kwargs):
    """The app serving ``model`` on a free loopback port: (root URL, stop())."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine(), model_name=model, **app_kwargs), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if time.time() > deadline:
            raise TimeoutError("the server did not start within 60 s")
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        thread.join(30)

    return f"http://127.0.0.1:{port}", stop


class RemoteOpenAIServer:
    """vLLM's test launcher's interface: ``with RemoteOpenAIServer(model, args) as server``; the
    arguments (vLLM's command line) are not read."""

    def __init__(self, model: str, vllm_serve_args=None, **_):
        self.model = model
        self.url_root, self._stop = start(model)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stop()

    def url_for(self, *parts: str) -> str:
        return "/".join([self.url_root, *parts])

    def get_client(self, **kwargs):
        return openai.OpenAI(base_url=self.url_for("v1"), api_key="none", max_retries=0,
                             **{"timeout": 600, **kwargs})

    def get_async_client(self, **kwargs):
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key="none", max_retries=0,
                                  **{"timeout": 600, **kwargs})
