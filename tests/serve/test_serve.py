"""clover-lab serve on loopback: the real openai client and raw HTTP against the embedded model in
float32, every answer equal to engine.generate's greedy text, alone or among 32 concurrent
streams; bad bodies get 4xx JSON naming the field; a client that leaves frees its row; the
provisional stream and the trace; SIGTERM lets a stream in flight finish."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

import clover_lab
from clover_lab.engine.requests import Request
from clover_lab.serve import create_app
from clover_lab.serve.jobs import Job, RequestError
from clover_lab.serve.scheduler import Scheduler

uvicorn = pytest.importorskip("uvicorn")

NAME = "clover-stdlib"
PROMPTS = ["def parse(line):\n", "import os\n", "class Stack:\n", "def f(x):\n    return", "for i in range(",
           "# read a file\n", "x = [", "with open(path) as f:\n"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def refs(engine):
    """Greedy texts from engine.generate, one prompt at a time, before the server owns the engine."""
    out = {(p, n): engine.generate(p, max_new_tokens=n).text for p in PROMPTS for n in (8, 20)}
    chat = [{"role": "user", "content": "write a loop"}]
    out["chat"] = engine.generate(chat, max_new_tokens=20).text
    out["chat-nothink"] = engine.generate(chat, max_new_tokens=20, thinking=False).text
    return out


@pytest.fixture(scope="module")
def server(engine, refs, live):
    app = create_app(engine, model_name=NAME, max_batch=32)
    return live(app), app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    if "{" in name:  # a labelled series appears with its first count
        return 0.0
    raise KeyError(name)


def sse_events(response) -> list:
    events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_openai_client_completions_and_chat_equal_generate(client, refs):
    p = PROMPTS[0]
    r = client.completions.create(model=NAME, prompt=p, max_tokens=20)
    assert r.choices[0].text == refs[(p, 20)]
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 20
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + 20
    chunks = list(client.completions.create(model=NAME, prompt=p, max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == refs[(p, 20)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20
    messages = [{"role": "user", "content": "write a loop"}]
    c = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20)
    assert c.choices[0].message.content == refs["chat"] and c.choices[0].message.role == "assistant"
    off = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == refs["chat-nothink"]
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == refs["chat"]
    assert [m.id for m in client.models.list().data] == [NAME]


def test_stop_string_and_seeded_sampling(client, engine, server):
    p = PROMPTS[0]
    full = client.completions.create(model=NAME, prompt=p, max_tokens=20).choices[0].text
    stop = full.strip()[3:6]
    r = client.completions.create(model=NAME, prompt=p, max_tokens=20, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert full.startswith(r.choices[0].text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=p, max_tokens=20, stop=[stop], stream=True))
    assert streamed == r.choices[0].text
    a, b = (client.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0.8, seed=5).choices[0].text
            for _ in range(2))
    assert a == b


@pytest.mark.parametrize("n", [8, 32])
def test_concurrent_streams_each_equal_their_single_request(server, refs, n):
    base, app = server
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    forwards = metric(base, "clover_forwards_total")
    client.completions.create(model=NAME, prompt=prompts[0], max_tokens=8)
    alone = metric(base, "clover_forwards_total") - forwards  # one request's forwards
    forwards += alone

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model=NAME, prompt=prompt, max_tokens=8, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_of():
        aclient = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(aclient, p) for p in prompts))

    texts = asyncio.run(all_of())
    assert texts == [refs[(p, 8)] for p in prompts]
    assert metric(base, "clover_forwards_total") - forwards < n * alone  # they shared forwards


def test_requests_join_the_running_rows(server, refs, engine):
    base = server[0]
    long = engine.generate(PROMPTS[0], max_new_tokens=120).text  # the engine is the server's too: thread-safe
    joined = metric(base, "clover_joined_rows_total")
    late, texts = PROMPTS[1:4], {}

    def ask(prompt):
        body = {"model": NAME, "prompt": prompt, "max_tokens": 20}
        texts[prompt] = httpx.post(base + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(p,)) for p in late]
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 120, "stream": True}
    text = ""
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
                if '"committed"' in line and not threads[0].is_alive() and not texts:
                    for t in threads:  # the first block is in: the others arrive while it runs
                        t.start()
    for t in threads:
        t.join(120)
    assert text == long and texts == {p: refs[(p, 20)] for p in late}
    assert metric(base, "clover_joined_rows_total") > joined  # at least one joined the running rows


def test_a_client_that_leaves_frees_its_row(server, client, refs):
    base, app = server
    scheduler = app.state.scheduler
    t0 = time.perf_counter()
    with httpx.stream("POST", base + "/v1/completions", timeout=60,
                      json={"model": NAME, "prompt": PROMPTS[1], "max_tokens": 2000, "stream": True}) as r:
        for line in r.iter_lines():
            if '"committed"' in line:
                break  # the first block is in: hang up
    deadline = time.time() + 30
    while scheduler.running:
        assert time.time() < deadline, "the row of a client that left is still running"
        time.sleep(0.05)
    assert time.perf_counter() - t0 < 60  # 2000 tokens would take far longer
    assert client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=8).choices[0].text == refs[(PROMPTS[2], 8)]



def idle_within(app, seconds: float) -> float:
    """Seconds until the server runs no row and its worker sleeps (its process CPU then stays
    still); fails past ``seconds``."""
    scheduler, engine = app.state.scheduler, app.state.engine
    t0 = time.perf_counter()
    while scheduler.running or not engine.loop.idle:
        assert time.perf_counter() - t0 < seconds, "rows of clients that left are still running"
        time.sleep(0.02)
    return time.perf_counter() - t0


def test_clients_that_leave_cancel_their_rows_streamed_or_not_running_or_queued(server, engine):
    base, app = server
    long = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 2000}

    def leave_after(seconds, body):
        try:
            httpx.post(base + "/v1/completions", json=body, timeout=seconds)
        except httpx.TimeoutException:
            pass  # the client hangs up

    # non-streamed: the client gives up while its row runs
    cancelled = metric(base, 'clover_rows_total{stop_reason="cancelled"}')
    leave_after(1.5, long)
    idle_within(app, 1.0)
    assert metric(base, 'clover_rows_total{stop_reason="cancelled"}') - cancelled == 1
    # queued: with the rows taken, a request waits; its client leaves before it ever runs
    engine.loop.max_rows = 1
    try:
        first = threading.Thread(target=leave_after, args=(3.0, long))
        first.start()
        time.sleep(0.5)
        cancelled = metric(base, 'clover_rows_total{stop_reason="cancelled"}')
        leave_after(1.0, {**long, "prompt": PROMPTS[2]})  # queued behind the first, then gone
        first.join()
    finally:
        engine.loop.max_rows = app.state.scheduler.max_batch
    idle_within(app, 1.0)
    assert metric(base, 'clover_rows_total{stop_reason="cancelled"}') - cancelled == 2
    # the worker sleeps: the process is still
    cpu = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - cpu < 0.3


def test_n_choices_are_n_rows_of_one_request(server, engine, client):
    want = [engine.generate(PROMPTS[0], max_new_tokens=12, temperature=0.8, seed=3 + i).text for i in range(3)]
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0.8, seed=3, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == want
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "a loop"}],
                                          max_tokens=8, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


BAD = [
    ({"model": NAME, "prompt": "x", "max_tokens": "3"}, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": 10**9}, "max_tokens"),
    ({"model": NAME, "prompt": "x", "surprise": 1}, "surprise"),
    ({"model": NAME, "prompt": ""}, "prompt"),
    ({"model": NAME, "prompt": []}, "prompt"),
    ({"model": NAME, "prompt": [1, 2, 10**7]}, "prompt"),
    ({"model": NAME, "prompt": "x " * 5000, "max_tokens": 4}, "prompt"),
    ({"model": NAME, "prompt": 5}, "prompt"),
    ({"model": NAME}, "prompt"),
    ({"model": NAME, "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": NAME, "prompt": "x", "temperature": 5000}, "temperature"),
    ({"model": NAME, "prompt": "x", "n": 0}, "n"),
    ({"model": NAME, "prompt": "x", "n": 2, "clover": {"trace": True}}, "n"),
    ({"model": NAME, "prompt": "x", "stop": ["a", ""]}, "stop"),
    ({"model": NAME, "prompt": "x", "seed": -1}, "seed"),
    ({"model": NAME, "prompt": "x", "clover": {"threshold": 2}}, "clover.threshold"),
    ({"model": NAME, "prompt": "x", "clover": {"coreset_size": 1}}, "clover.coreset_size"),
    ({"model": NAME, "prompt": "x", "clover": {"mode": "fast"}}, "clover.mode"),
    ({"model": NAME, "prompt": "x", "clover": {"block_size": 0}}, "clover.block_size"),
    ({"model": NAME, "prompt": "x", "clover": {"nope": 1}}, "clover.nope"),
    ({"model": NAME, "prompt": "x", "truncate_prompt_tokens": 4, "return_token_ids": True},
     "truncate_prompt_tokens"),  # several unknown fields: the first named, every one in the message
    ({"model": NAME, "prompt": "x", "clover": {"trace": ["no.such.point"]}}, "clover.trace"),
    ({"model": NAME, "prompt": "x", "clover": {"stream_provisional": True}}, "clover.stream_provisional"),
    ({"model": NAME, "prompt": "x", "logprobs": 99}, "logprobs"),
    ({"model": "gpt-4", "prompt": "x"}, "model"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_bodies_get_4xx_json_naming_the_field(server, body, param):
    r = httpx.post(server[0] + "/v1/completions", json=body, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and set(error) == {"message", "type", "param", "code"}


def test_log_probabilities_are_the_engines_in_openais_shapes(server, client, engine):
    """Completions (logprobs=K), chat (logprobs + top_logprobs) and a stream's chunks carry
    engine.generate's log-probabilities of the response tokens, named by their text."""
    ref = engine.generate(PROMPTS[0], max_new_tokens=8, logprobs=2)
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == ref.text and lp.token_logprobs == pytest.approx(ref.logprobs)
    assert lp.tokens == [engine.tokenizer.decode([t]) for t in ref.token_ids] and len(lp.text_offset) == len(lp.tokens)
    assert [v for top in lp.top_logprobs for v in top.values()] == pytest.approx(
        [v for top in ref.top_logprobs for _, v in top])
    chat = [{"role": "user", "content": "write a loop"}]
    cref = engine.generate(chat, max_new_tokens=8, logprobs=1)
    c = client.chat.completions.create(model=NAME, messages=chat, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=1)
    content = c.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx(cref.logprobs)
    assert [len(e.top_logprobs) for e in content] == [1] * len(cref.token_ids)
    events = [json.loads(line[6:]) for line in httpx.post(server[0] + "/v1/completions", timeout=60, json={
        "model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, "logprobs": 0, "stream": True}).text.splitlines()
        if line.startswith("data: {")]
    streamed = [v for e in events if e["choices"] and e["choices"][0]["logprobs"]
                for v in e["choices"][0]["logprobs"]["token_logprobs"]]  # with the chunks whose tokens they score
    assert streamed == pytest.approx(ref.logprobs)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=chat, max_tokens=4, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"


def test_bad_chat_bodies_and_invalid_json(server, client):
    base = server[0]
    for body, param in [({"model": NAME, "messages": []}, "messages"),
                        ({"model": NAME, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
                        ({"model": NAME, "messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
                        ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
                         "max_completion_tokens")]:
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for raw in (b"{bad json", b"[1, 2]", b""):
        r = httpx.post(base + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=-5)
    assert e.value.body["param"] == "max_tokens"
    assert httpx.get(base + "/v1/nowhere").status_code == 404


def test_provisional_stream_and_trace_by_id(server, refs, tmp_path):
    base = server[0]
    prompt = PROMPTS[0]  # a continuation of two blocks (20 tokens, no EOS before them)
    body = {"model": NAME, "prompt": prompt, "max_tokens": 20, "stream": True,
            "clover": {"stream_provisional": True, "trace": True}}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
        events = sse_events(r)
    kinds = [e["clover"]["kind"] for e in events]
    assert kinds.count("provisional") > 0 and kinds.count("committed") == 2 and kinds[-1] == "done"
    assert "".join(e["choices"][0]["text"] for e in events) == refs[(prompt, 20)]
    blocks = {e["clover"]["block"]: e["clover"]["tokens"] for e in events if e["clover"]["kind"] == "committed"}
    for e in events:
        c = e["clover"]
        if c["kind"] == "provisional":  # an unmasked position keeps its token until the block commits
            assert e["choices"][0]["text"] == ""
            final = blocks[c["block"]]
            assert all(t is None or t == final[i] for i, t in enumerate(c["tokens"][:len(final)]))
    trace_id = events[-1]["clover"]["trace_id"]
    meta = httpx.get(f"{base}/v1/traces/{trace_id}")
    tensors = httpx.get(f"{base}/v1/traces/{trace_id}/tensors.safetensors")
    assert meta.status_code == 200 and tensors.status_code == 200
    (tmp_path / "trace.json").write_bytes(meta.content)
    (tmp_path / "tensors.safetensors").write_bytes(tensors.content)
    trace = clover_lab.load_trace(tmp_path)
    assert len(trace["denoise.step"]) == kinds.count("provisional")
    assert [r["tokens"] for r in trace["block.commit"]] == list(blocks.values())
    assert httpx.get(f"{base}/v1/traces/cmpl-unknown").status_code == 404


def test_health_and_metrics(server):
    base = server[0]
    assert httpx.get(base + "/health").json()["status"] == "ok"
    text = httpx.get(base + "/metrics").text
    for name in ("clover_requests_total", "clover_generated_tokens_total", "clover_forwards_total",
                 "clover_tokens_per_forward", "clover_queue_length", "clover_running_rows",
                 "clover_forward_seconds_bucket", "clover_time_to_first_token_seconds_bucket"):
        assert name in text


def test_a_full_queue_refuses_with_429(engine):
    scheduler = Scheduler(engine, max_batch=4, max_queue=2)  # not started: nothing leaves the queue
    checked = engine.check(Request([1, 2], max_new_tokens=4))
    job = lambda: Job("cmpl-x", 0, checked)  # noqa: E731
    scheduler.submit([job(), job()])
    with pytest.raises(RequestError) as e:
        scheduler.submit([job()])
    assert e.value.status == 429 and e.value.body()["error"]["code"] == "queue_full"
    scheduler.close(timeout=0)
    with pytest.raises(RequestError) as e:
        scheduler.submit([job()])
    assert e.value.status == 503


@pytest.mark.slow  # a server process
def test_sigterm_lets_the_stream_in_flight_finish(refs):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "clover_lab.cli.main", "serve", "--port", str(port), "--dtype",
                             "float32", "--threads", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, "the server did not start"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 20, "stream": True}
        text, done, sent = "", False, False
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += json.loads(line[6:])["choices"][0]["text"]
                    if text and not sent:  # the first block is in: shut the server down
                        proc.send_signal(signal.SIGTERM)
                        sent = True
        assert done and text == refs[(PROMPTS[0], 20)]
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- in process: settings, bodies
@pytest.fixture(scope="module")
def tiny_app(gen_model, gen_tokenizer):
    """An app over the tiny text engine, called in process (fastapi's TestClient): fast tier."""
    from fastapi.testclient import TestClient

    engine = clover_lab.Engine(gen_model, gen_tokenizer)
    with TestClient(create_app(engine, model_name="tiny")) as client:
        yield client, engine


IGNORED = [({"mode": "ar", "threshold": 0.5}, "clover.threshold"),
           ({"mode": "ar", "coreset_size": 4}, "clover.coreset_size"),
           ({"mode": "ar", "max_steps_per_block": 3}, "clover.max_steps_per_block"),
           ({"mode": "ar", "block_size": 8}, "clover.block_size")]


@pytest.mark.parametrize("clover,param", IGNORED, ids=[p for _, p in IGNORED])
def test_a_setting_the_mode_ignores_is_refused_naming_it(tiny_app, clover, param):
    """clover.mode "ar" with clover.threshold was answered as if the threshold were not there: 400, as
    the API and the command line refuse it."""
    client, _ = tiny_app
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "w5 w6", "max_tokens": 4, "clover": clover})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "mode='ar'" in r.json()["error"]["message"] and r.json()["error"]["code"] == "ignored_setting"
    ok = client.post("/v1/completions", json={"model": "tiny", "prompt": "w5 w6", "max_tokens": 4,
                                              "clover": {"mode": "ar", "repetition_penalty": 1.2}})
    assert ok.status_code == 200, ok.text


def test_enable_thinking_on_a_tokenizer_without_thinking_is_refused(tiny_app, monkeypatch):
    client, engine = tiny_app
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w8"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}}
                       ).status_code == 200  # the fixture's template reads enable_thinking
    r = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.enable_thinking"
    assert "no <think> / </think> tokens" in r.json()["error"]["message"]  # no reasoning to tell apart
    monkeypatch.setattr(engine.tokenizer, "chat_template", "{% for m in messages %}w1 {{ m['content'] }} "
                        "{% endfor %}{% if add_generation_prompt %}w3 {% endif %}")
    for extra, param in [({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs.enable_thinking"),
                         ({"clover": {"thinking": False}}, "clover.thinking")]:
        r = client.post("/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "no thinking mode" in r.json()["error"]["message"]
    assert client.post("/v1/chat/completions", json=body).status_code == 200


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)
WORDS = st.lists(st.integers(0, 508).map(lambda i: f"w{i}"), max_size=4).map(" ".join)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=WORDS, lone=SURROGATES, after=WORDS, where=st.sampled_from(["prompt", "messages", "stop"]))
def test_a_lone_surrogate_is_a_400_naming_the_field(tiny_app, before, lone, after, where):
    """A prompt holding a lone surrogate (JSON's "\\ud800") was a 500: docs/guides/bad-input.md promises never a 500."""
    client, _ = tiny_app
    text = f"{before} {lone} {after}"
    body = {"model": "tiny", "max_tokens": 2}
    path = "/v1/chat/completions" if where == "messages" else "/v1/completions"
    if where == "messages":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text if where == "prompt" else "w5 w6"
    if where == "stop":
        body["stop"] = [text]
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == where, r.text
    assert "lone surrogate" in r.json()["error"]["message"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None, "application/json"])
def test_a_json_body_is_read_whatever_its_content_type(tiny_app, content_type):
    """A valid JSON body sent as text/plain (or by curl -d, form-encoded) was told "the body must be a JSON
    object"; a body that is not JSON still gets "not valid JSON"."""
    client, _ = tiny_app
    headers = {} if content_type is None else {"content-type": content_type}
    body = json.dumps({"model": "tiny", "prompt": "w5 w6", "max_tokens": 2})
    r = client.post("/v1/completions", content=body, headers=headers)
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"].split()) == 2, r.text
    r = client.post("/v1/completions", content=b"model=tiny&prompt=w5", headers=headers)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("depth", [2000, 10000])
def test_a_body_nested_past_the_parser_is_named(tiny_app, depth):
    """(At Python's default recursion limit: what ran earlier in the process may have raised it
    (torch.compile, hypothesis), and past ~2,050 a 2,000-deep body parses, to be refused as a
    wrong type: still a 400, but not this message.)"""
    client, _ = tiny_app
    body = '{"model": "tiny", "prompt": ' + "[" * depth + "]" * depth + "}"
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    finally:
        sys.setrecursionlimit(limit)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == "invalid_json"
