"""The server's worker (serve/scheduler.py) against what a request can do to it: a trace that
cannot be saved ends that request only (507 naming clover.trace) and the next request is served;
a worker that is gone is said by /health (503) and by every new request, never a wait forever;
a grammar compiles off the event loop (/health answers meanwhile) within its time limit; a
grammar with a setting it cannot honour is a 400 naming the setting, never a 500 mid-run."""
import errno
import threading
import time

import pytest
from fastapi.testclient import TestClient

from clover_lab.errors import GrammarError
from clover_lab.serve import create_app, tools
from clover_lab.serve.jobs import RequestError
from clover_lab.serve.scheduler import run_error

BODY = {"model": "m", "prompt": "def f(x):\n", "max_tokens": 4}


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine, model_name="m")) as client:
        yield client


def test_a_trace_that_cannot_be_saved_ends_that_request_and_the_server_goes_on(client, monkeypatch):
    """The temporary directory full under a traced request killed the engine thread: /health said
    "ok" and every later request waited forever."""
    scheduler = client.app.state.scheduler

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(scheduler.traces, "add", full)
    r = client.post("/v1/completions", json={**BODY, "clover": {"trace": True}})
    assert r.status_code == 507 and r.json()["error"]["param"] == "clover.trace", r.text
    assert "No space left" in r.json()["error"]["message"]
    assert client.get("/health").json()["status"] == "ok"
    assert client.post("/v1/completions", json=BODY).status_code == 200


class Fatal(BaseException):
    pass


def test_health_says_when_the_worker_is_gone_and_requests_are_refused(client, monkeypatch):
    engine = client.app.state.engine

    def fatal():
        raise Fatal("the worker met something it cannot survive")

    monkeypatch.setattr(engine, "step", fatal)
    r = client.post("/v1/completions", json=BODY)  # the request in flight is answered, not left waiting
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped", r.text
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "engine_stopped"
    assert "Fatal" in health.json()["error"]
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"
    monkeypatch.undo()
    engine.loop.fail({row.handle for row in list(engine.loop.queue) + engine.loop.rows}, Fatal("cleanup"))


def test_a_grammar_compiles_off_the_event_loop_within_its_time_limit(client, monkeypatch):
    """One 10,000-property schema froze /health for 16 s: the compile ran on the event loop."""
    started, release = threading.Event(), threading.Event()

    def slow(*_):  # format_grammar(engine, fmt, closed)
        started.set()
        release.wait(10)
        return None

    monkeypatch.setattr(tools, "format_grammar", slow)
    monkeypatch.setattr(tools, "GRAMMAR_SECONDS", 1.0)
    answer = {}
    body = {**BODY, "response_format": {"type": "json_object"}}
    thread = threading.Thread(target=lambda: answer.setdefault("r", client.post("/v1/completions", json=body)))
    thread.start()
    try:
        assert started.wait(10)
        t0 = time.perf_counter()
        assert client.get("/health").status_code == 200
        assert time.perf_counter() - t0 < 0.5  # answered while the grammar compiles
        thread.join(10)
    finally:
        release.set()
    r = answer["r"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert "took over 1 s" in r.json()["error"]["message"]


@pytest.mark.parametrize("extra,param", [({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 2}, "min_tokens"),
                                         ({"logit_bias": {"0": -100}}, "logit_bias")])
def test_a_grammar_with_a_setting_it_cannot_honour_is_a_400_naming_it(client, extra, param):
    """Benchmark clients send ignore_eos: with response_format it passed the checks and was a 500."""
    body = {**BODY, "response_format": {"type": "json_object"}, **extra}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "grammar" in r.json()["error"]["message"]


def test_bad_schemas_and_bias_keys_are_400s(client):
    for fmt, fragment in [({"$ref": "#"}, "only an empty response"),
                          ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}},
                           "limits in its first tokens")]:
        # read as written (open where silent): closed, the 500 optional properties run (they are
        # fewer choices at each token than an open object's any-key alternative)
        r = client.post("/v1/completions", json={**BODY, "clover": {"open_schemas": True}, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": fmt}}})
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    r = client.post("/v1/completions", json={**BODY, "logit_bias": {"³": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_what_only_a_run_shows_is_the_requests_400_not_a_500():
    e = run_error(GrammarError("response_format: past the engine's limits", "response_format"))
    assert isinstance(e, RequestError) and e.status == 400 and e.param == "response_format"
    other = RuntimeError("the server's own fault")
    assert run_error(other) is other
