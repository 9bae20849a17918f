"""The server tests' shared fixtures: the embedded model in float32 (one intra-op thread, so that
a batch sums as the single request does); ``live(app)``: the app served by uvicorn on a free
port of 127.0.0.1 in a thread, stopped when the test module ends; ``server`` (its address and the
engine), ``base`` (its ``/v1``) and ``client`` (the openai client on it): the embedded model served
as ``clover-stdlib`` with at most 8 rows a step, once per module (test_serve.py serves its own)."""
import socket
import threading
import time

import pytest
import torch

import clover_lab

NAME = "clover-stdlib"  # the served model's name in the tests that use ``server``


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return clover_lab.load(dtype=torch.float32)


@pytest.fixture(scope="module")
def live():
    uvicorn = pytest.importorskip("uvicorn")
    running = []

    def serve(app) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=srv.run, daemon=True)
        thread.start()
        running.append((srv, thread))
        deadline = time.time() + 30
        while not srv.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.05)
        return f"http://127.0.0.1:{port}"

    yield serve
    for srv, thread in running:
        srv.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def server(engine, live):
    from clover_lab.serve import create_app

    return live(create_app(engine, model_name=NAME, max_batch=8)), engine


@pytest.fixture(scope="module")
def base(server):
    return server[0] + "/v1"


@pytest.fixture(scope="module")
def client(base):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
