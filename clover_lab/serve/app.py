"""The HTTP side: a FastAPI app over one engine and its scheduler.

    GET  /v1/models               the one model served (with its context length)
    GET  /v1/models/{id}          that model, or 404
    POST /v1/completions          text completion, streamed (server-sent events) or not
    POST /v1/chat/completions     chat, through the model's chat template (thinking switch)
    GET  /v1/traces/{id}          a traced request's trace.json; .../tensors.safetensors its tensors
    POST /v1/responses            OpenAI's Responses API (text, tools, text.format; events), serve/responses_api.py
    POST /tokenize, /detokenize   a prompt (text or chat messages) as token ids and back, in vLLM's shapes
    GET  /version                 the server's version, as vLLM's
    GET  /health                  200 while serving, 503 while shutting down or when the engine's
                                  worker is gone (``error`` says why)
    GET  /metrics                 Prometheus text format

Bad requests are answered 4xx with OpenAI's error body naming the field, never 500.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

import clover_lab
from clover_lab.engine.requests import GenerationError
from clover_lab.engine.results import Thinking
from clover_lab.hooks.trace import META_FILE, TENSOR_FILE
from clover_lab.serve import responses as R
from clover_lab.serve import responses_api, schemas, tools
from clover_lab.serve.call_stream import CallStream
from clover_lab.serve.jobs import RequestError, make_jobs
from clover_lab.serve.prometheus import Metrics
from clover_lab.serve.scheduler import Scheduler, TraceStore


def create_app(engine, model_name: str = "clover", max_batch: int = 32, max_queue: int = 256,
               trace_dir=None, open_schemas: bool = False) -> FastAPI:
    """The server's app. The scheduler's worker starts with the app (its lifespan) and, at
    shutdown, finishes the jobs it holds. ``open_schemas``: JSON schemas are read as written (open
    where silent), not closed as vLLM's and SGLang's default backend closes them (``tools.closes``)."""
    if engine.tokenizer is None:
        raise ValueError("serve: the model has no tokenizer; the server answers text, so it needs one")
    metrics = Metrics()
    scheduler = Scheduler(engine, max_batch, max_queue, metrics, TraceStore(root=trace_dir))

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            await run_in_threadpool(scheduler.close)

    app = FastAPI(title="clover-lab", lifespan=lifespan)
    app.add_middleware(JSONBodies)
    app.state.engine, app.state.scheduler, app.state.metrics = engine, scheduler, metrics
    _errors(app, metrics)

    app.add_middleware(Counted, metrics=metrics)

    context = engine.model.config.max_position_embeddings

    def entry() -> dict:  # the context length as vLLM names it (max_model_len) and as others do
        return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "clover-lab",
                "root": model_name, "parent": None, "max_model_len": context, "context_length": context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [entry()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise RequestError(f"model {model_id!r} is not served here; this server serves {model_name!r}",
                               "model", status=404, code="model_not_found")
        return entry()

    @app.get("/version")
    async def version():
        return {"version": clover_lab.__version__}

    @app.post("/tokenize")
    async def tokenize(body: schemas.TokenizeRequest):
        _model(body, model_name)
        if isinstance(body, schemas.TokenizeChat):
            functions = [t.function.model_dump(exclude_none=True) for t in body.tools or []]
            try:
                if body.add_generation_prompt and body.continue_final_message:
                    raise RequestError("continue_final_message continues the last message, and add_generation_prompt "
                                       "opens a new one; ask for one", "continue_final_message")
                ids = tools.chat_ids(engine, schemas.chat_messages(body), functions, schemas.thinking(body), (
                    body.add_generation_prompt, body.continue_final_message, body.add_special_tokens))
            except GenerationError as e:
                raise RequestError(str(e), "messages") from None
        else:
            try:
                ids = engine.encode(body.prompt) if body.add_special_tokens else engine.encode(
                    list(engine.tokenizer(body.prompt, add_special_tokens=False)["input_ids"]))
            except GenerationError as e:
                raise RequestError(str(e), "prompt") from None
        strs = [engine.tokenizer.convert_ids_to_tokens(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: schemas.DetokenizeRequest):
        _model(body, model_name)
        vocab = engine.model.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"tokens: {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.get("/health")
    async def health():
        stopped = scheduler.stopped  # the worker thread is gone: nothing queued would ever run
        body = {"status": "shutting_down" if scheduler.closing else "engine_stopped" if stopped else "ok",
                "waiting": scheduler.waiting, "running": scheduler.running, **({"error": stopped} if stopped else {})}
        return JSONResponse(body, status_code=503 if scheduler.closing or stopped else 200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/traces/{rid}")
    async def trace(rid: str):
        return FileResponse(_trace(scheduler, rid) / META_FILE, media_type="application/json")

    @app.get("/v1/traces/{rid}/" + TENSOR_FILE)
    async def trace_tensors(rid: str):
        return FileResponse(_trace(scheduler, rid) / TENSOR_FILE, media_type="application/octet-stream")

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, request: Request):
        _model(body, model_name)
        _stream_options(body)
        p = body.prompt
        prompts = [p] if isinstance(p, str) or not p or isinstance(p[0], int) else p
        grammar, _ = await tools.off_loop(lambda: tools.constraint(engine, body, tools.closes(body, open_schemas)),
                                          tools.constraint_field(body))
        jobs = make_jobs(engine, body, prompts, "prompt", "cmpl", max_tokens=body.max_tokens,
                         logprobs=(body.logprobs, "logprobs"), grammar=grammar, echo=body.echo)
        return await _answer(request, scheduler, metrics, jobs, body,
                             R.Shape(False, jobs[0].id, model_name, engine.tokenizer, n=body.n))

    @app.post("/v1/chat/completions")
    async def chat(body: schemas.ChatRequest, request: Request):
        jobs, shape = await chat_jobs(body)
        return await _answer(request, scheduler, metrics, jobs, body, shape)

    @app.post("/v1/responses")
    async def responses(body: responses_api.ResponsesRequest, request: Request):
        _model(body, model_name)
        chat_body = responses_api.chat_request(body)
        jobs, shape = await chat_jobs(chat_body)
        answer = await _answer(request, scheduler, metrics, jobs, chat_body, shape)
        if isinstance(answer, Response):  # a stream of chat chunks (or the 499 of a client gone)
            if not body.stream:
                return answer
            return StreamingResponse(responses_api.events(answer.body_iterator, body, jobs[0].id),
                                     media_type="text/event-stream")
        return responses_api.response(answer, body, jobs[0].id)

    async def chat_jobs(body: schemas.ChatRequest):
        """A chat request's jobs and the shape of its answer, every check done."""
        _model(body, model_name)
        _stream_options(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        limit, param = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens
                        is not None else (body.max_tokens, "max_tokens"))
        plan = await tools.off_loop(lambda: tools.plan(engine, body, open_schemas),
                                    "tools" if body.tools else tools.constraint_field(body))
        jobs = make_jobs(engine, body, [schemas.chat_messages(body)], "messages", "chatcmpl",
                         thinking=schemas.thinking(body), thinking_param=schemas.thinking_param(body),
                         max_tokens_param=param, max_tokens=limit,
                         logprobs=((body.top_logprobs or 0) if body.logprobs else None, "logprobs"),
                         grammar=plan.grammar,
                         encode=lambda prompt, thinking: tools.chat_ids(engine, prompt, plan.functions, thinking))
        think = Thinking.of(engine.tokenizer, jobs[0].prompt_ids)
        if plan.grammar is not None and think is not None and think.open:
            raise RequestError(f"{plan.grammar_param}: the prompt opens a reasoning (<think>), which the grammar "
                               f"does not allow; turn thinking off (chat_template_kwargs.enable_thinking: false)",
                               schemas.thinking_param(body), code="thinking_with_grammar")
        return jobs, R.Shape(True, jobs[0].id, model_name, engine.tokenizer, parse_calls=plan.parse_calls, n=body.n)

    return app


log = logging.getLogger("uvicorn.error")  # the server's log is uvicorn's (its level, its format)
DISCONNECT_POLL = 0.1  # seconds between checks that a non-streamed request's client is still there
_COUNTED = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize",
            "/version", "/health", "/metrics"}


def _stream_options(body) -> None:
    if body.stream_options is not None and not body.stream:
        raise RequestError("stream_options applies to a stream: set stream: true or leave stream_options out",
                           "stream_options")


def _model(body, model_name: str) -> None:
    """The request's model is the one served (a request without one asks for it, as vLLM takes it)."""
    if body.model is None:
        body.model = model_name
    elif body.model != model_name:
        raise RequestError(f"model {body.model!r} is not served here; this server serves {model_name!r} "
                           f"(GET /v1/models)", "model", status=404, code="model_not_found")


def _trace(scheduler, rid: str) -> Path:
    path = scheduler.traces.get(rid)
    if path is None:
        raise RequestError(f"no trace {rid!r}: ask for one with \"clover\": {{\"trace\": true}}; the server keeps "
                           f"the last {scheduler.traces.keep}", "id", status=404, code="trace_not_found")
    return path


# --------------------------------------------------------------------------- answering a request
async def _answer(request, scheduler, metrics, jobs, body, shape: R.Shape):
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    for job in jobs:
        job.loop, job.updates = loop, queue
    scheduler.submit(jobs)
    started = time.perf_counter()
    if body.stream:
        return StreamingResponse(_stream(scheduler, metrics, jobs, body, shape, started),
                                 media_type="text/event-stream")
    collect = asyncio.ensure_future(_collect(jobs, metrics, started))
    gone = False
    try:
        while not collect.done():  # a client that went away cancels its rows: they leave at the next step
            await asyncio.wait({collect}, timeout=DISCONNECT_POLL)
            if not collect.done() and await request.is_disconnected():
                gone = True
                collect.cancel()
        try:
            results = await collect
        except asyncio.CancelledError:
            if not gone:  # the server's own cancellation (shutdown): not ours to swallow
                raise
            log.info("%s: the client went away; its %d row(s) left the batch", jobs[0].id, len(jobs))
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
    finally:
        for job in jobs:
            scheduler.cancel(job)  # a no-op for the finished; frees the rows of a client gone meanwhile
    return shape.response(results, [r.text for r in results], jobs[0].trace_points is not None,
                          [job.probe for job in jobs], [job.echo for job in jobs])


async def _next(queue):
    """The next (job, update) from the worker; an update None ends the job; an error is raised."""
    job, item = await queue.get()
    if isinstance(item, BaseException):
        raise item
    return job, item


async def _collect(jobs, metrics, started) -> list:
    results, open_ = {}, {job.index for job in jobs}
    first = None
    while open_:
        job, update = await _next(jobs[0].updates)
        if update is None:
            open_.discard(job.index)
        elif update.kind == "commit" and first is None:
            first = time.perf_counter() - started
        elif update.kind == "done":
            results[job.index] = update.result
    _observe(metrics, started, first)
    return [results[i] for i in range(len(jobs))]


def _observe(metrics, started, first) -> None:
    if first is not None:
        metrics.first_token.observe(first)
    metrics.request_seconds.observe(time.perf_counter() - started)


async def _stream(scheduler, metrics, jobs, body, shape: R.Shape, started):
    """The server-sent events of one request: per job its text as blocks commit (and, asked for,
    each denoising step), its finish, then usage (asked for) and [DONE]."""
    tok = scheduler.engine.tokenizer
    texts = {job.index: R.TextStream(tok, job.plan.stop) for job in jobs}
    reasons = {job.index: R.TextStream(tok, job.plan.stop) for job in jobs}  # a chat's reasoning, apart (thinking)
    lengths = {job.index: 0 for job in jobs}
    streams = {job.index: CallStream() for job in jobs}  # a chat's tool calls, as deltas as they commit
    offsets = {job.index: 0 for job in jobs}  # where a completion's next scored token's text begins
    echoed: set[int] = set()
    results, open_, first = {}, {job.index for job in jobs}, None
    try:
        if shape.chat:
            for job in jobs:
                yield R.sse(shape.chunk(job.index, "", first=True))
        while open_:
            try:
                job, update = await _next(jobs[0].updates)
            except Exception as e:  # noqa: BLE001 - the stream has begun: the error is its last event
                yield R.sse({"error": {"message": f"generation failed: {type(e).__name__}: {e}",
                                       "type": "server_error", "param": None, "code": None}})
                break
            i = job.index
            if job.echo is not None and i not in echoed and update is not None:  # the prompt first, scored if asked
                echoed.add(i)
                scores = job.prompt_scores or (update.result is not None and (
                    update.result.prompt_logprobs, update.result.prompt_top_logprobs)) or None
                lp = None
                if body.logprobs is not None and scores and scores[0] is not None:
                    lp, offsets[i] = shape.scored(job.prompt_ids, scores[0], scores[1])
                yield R.sse(shape.chunk(i, job.echo, logprobs=lp))
            if update is None:
                open_.discard(i)
            elif update.kind == "step":
                yield R.sse(shape.chunk(i, "", clover=R.provisional(update)))
            elif update.kind == "commit":
                first = first if first is not None else time.perf_counter() - started
                tokens, lengths[i] = update.committed[lengths[i]:], len(update.committed)
                reasoning, answer = (None, update.committed) if not shape.chat or update.thinking is None else \
                    update.thinking.split(update.committed)
                thought = "" if reasoning is None else reasons[i].delta(reasoning, part=True)
                calls = [] if not shape.parse_calls else streams[i].update(texts[i].visible(answer))
                lp = None  # the log-probabilities of this chunk's tokens, with it
                if update.logprobs is not None:
                    lo, hi = len(update.committed) - len(tokens), len(update.committed)
                    lp, offsets[i] = shape.scored(tokens, update.logprobs[lo:hi], update.top_logprobs and
                                                  update.top_logprobs[lo:hi], offsets[i])
                yield R.sse(shape.chunk(i, texts[i].delta(answer, hold_calls=shape.parse_calls,
                                                          part=reasoning is not None), calls=calls, logprobs=lp,
                                        clover=R.committed(update, tokens, job.frames.pop(len(update.committed), None)),
                                        reasoning=thought))
            elif update.kind == "done":
                r = results[i] = update.result
                done = {"kind": "done", "stop_reason": r.stop_reason, "stats": r.stats.to_dict()}
                if job.trace_points is not None:
                    done["trace_id"] = job.id
                text = r.text if r.reasoning is None else r.answer
                content, calls, finish = shape.split_calls(text, r.stop_reason)
                deltas = streams[i].finish(text, calls) if calls else []
                thought = "" if r.reasoning is None else reasons[i].final(r.reasoning)
                lp = None  # every token's were sent with its chunk; any left (none, as the engine commits) here
                if r.logprobs is not None and len(r.token_ids) > lengths[i]:
                    lp, offsets[i] = shape.scored(r.token_ids[lengths[i]:], r.logprobs[lengths[i]:], r.top_logprobs
                                                  and r.top_logprobs[lengths[i]:], offsets[i])
                yield R.sse(shape.chunk(i, texts[i].final(content), finish, clover=done, logprobs=lp, calls=deltas,
                                        reasoning=thought))
        if len(results) == len(jobs):
            _observe(metrics, started, first)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield R.sse(shape.usage_chunk([results[i] for i in range(len(jobs))]))
        yield R.DONE
    finally:  # ended, or the client went away (the generator is closed): free the rows at once
        for job in jobs:
            scheduler.cancel(job)


# --------------------------------------------------------------------------- errors, OpenAI's way
def _errors(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(RequestError)
    async def request_error(request, e: RequestError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        return JSONResponse(validation_error(e.errors()).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message, code = str(e.detail), None
        if isinstance(e.__cause__, RecursionError):  # the body's JSON nests past what the parser follows
            message, code = ("the body is JSON nested too deeply to parse (past about 1,000 levels); a request "
                             "nests a few (messages, their content parts)"), "invalid_json"
        elif e.__cause__ is not None:
            message, code = f"the body cannot be parsed as JSON: {type(e.__cause__).__name__}: {e.__cause__}", \
                "invalid_json"
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def failed(request, e: Exception):  # the server's fault, never the request's: 500
        return JSONResponse({"error": {"message": f"generation failed: {type(e).__name__}: {e}",
                                       "type": "server_error", "param": None, "code": None}}, status_code=500)


class Counted:
    """Counts every answer by endpoint and status (``clover_requests_total``). A plain ASGI
    middleware: Starlette's ``BaseHTTPMiddleware`` would hide a client's disconnect from the
    endpoint, and a non-streamed request whose client left would then run to its end."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in _COUNTED else "other"

        async def sent(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, sent)


class JSONBodies:
    """Every POST body is read as JSON, whatever its content-type says: ``curl -d`` sends
    application/x-www-form-urlencoded and some clients text/plain, and a valid JSON body was then told
    "the body must be a JSON object". A body that is not JSON is still "not valid JSON"."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope = dict(scope, headers=headers + [(b"content-type", b"application/json")])
        await self.app(scope, receive, send)


def _untagged(err: dict) -> tuple[str, ...]:
    """An error's location past "body", without the shape a union field tried (schemas.UNION_FIELDS)
    and, where no shape's tag matched, ending with the tag's field (``messages.0.role``)."""
    loc, out = [str(x) for x in err["loc"][1:]], []
    i = 0
    while i < len(loc):
        out.append(loc[i])
        star = ".".join(out[:-1] + ["*"]) if out[-1].isdigit() else None
        i += 2 if (".".join(out) in schemas.UNION_FIELDS or star in schemas.UNION_FIELDS) and i + 1 < len(loc) else 1
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
        out.append(str(err.get("ctx", {}).get("discriminator", "")).strip("'"))
    return tuple(out)


def validation_error(errors: list[dict]) -> RequestError:
    """pydantic's errors as one RequestError naming the field (the common part of every error's
    location: a union's alternatives each report one)."""
    first = errors[0]
    if first["type"] == "json_invalid":
        return RequestError(f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                            code="invalid_json")
    locs = [_untagged(err) for err in errors]
    if all(err["type"] == "extra_forbidden" for err in errors) and len(errors) > 1:  # several unknown fields
        names = [".".join(loc) for loc in locs]
        return RequestError(f"unknown fields {', '.join(map(repr, names))}", names[0], code="unknown_field")
    common = []
    for parts in zip(*locs):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    param = ".".join(common) or None
    if first["type"] == "extra_forbidden":
        return RequestError(f"unknown field {param!r}", param, code="unknown_field")
    if first["type"] == "missing":
        return RequestError(f"{param}: a required field is missing", param, code="missing_field")
    if param is None:
        return RequestError(f"the body must be a JSON object: {first['msg']}")
    return RequestError(f"{param}: {first['msg']}" + (f" (input {first['input']!r})" if "input" in first and len(
        repr(first['input'])) < 80 else ""), param)
