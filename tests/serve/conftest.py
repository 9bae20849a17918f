"""The server tests' shared fixtures: the embedded model in float32 (one intra-op thread, so that
a batch sums as the single request does), and ``live(app)``: the app served by uvicorn on a free
port of 127.0.0.1 in a thread, stopped when the test module ends."""
import socket
import threading
import time

import pytest
import torch

import clover_lab


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
