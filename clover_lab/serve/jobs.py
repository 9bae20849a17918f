"""A request body, checked by the engine's own rules, as the jobs the scheduler runs (one per
prompt): token ids, length, stop strings, sampler settings, block size, what to stream and
record. Whatever is wrong is a :class:`RequestError` naming the field (``param``), raised before
anything is queued; the server answers it as OpenAI does, ``{"error": {...}}`` with a 4xx status.
"""
from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
import time
from dataclasses import dataclass, field, replace

from clover_lab.engine.requests import (
    GenerationError,
    IgnoredSettingError,
    Plan,
    Request,
    ignored_settings,
    stop_list,
)
from clover_lab.engine.sampling import SettingsError
from clover_lab.errors import CloverError
from clover_lab.serve import schemas
from clover_lab.serve.explore import NOT_ROUTED, ExpertRecorder, Probe


class RequestError(CloverError, ValueError):
    """A request the server refuses: HTTP ``status``, OpenAI's error ``type`` and ``code``, and
    the body field it is about (``param``, dotted: ``clover.threshold``)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# request field -> SamplerSettings field, for the settings OpenAI's API names and Clover's own
OPENAI_SAMPLER = {"temperature": "temperature", "top_p": "top_p", "seed": "seed",
                  "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                  "logit_bias": "logit_bias", "ignore_eos": "ignore_eos", "min_tokens": "min_tokens",
                  "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty"}  # vLLM's extras
OPENAI_PARAMS = {name: f for f, name in OPENAI_SAMPLER.items()}  # SamplerSettings field -> request field
CLOVER_SAMPLER = ("threshold", "coreset_size", "confidence", "top_k", "max_tokens_per_step", "max_steps_per_block",
                  "repetition_penalty")


@dataclass(eq=False)
class Job:
    """One row of a request (a prompt, or one of its ``n`` samples), as the scheduler hands it to
    the engine (``plan``: checked once, when the body was; ``handle``: the engine's request).
    ``updates`` carries the engine's StreamUpdates (and a final None, or an exception) back to the
    request's event loop, as (job, item) pairs: a request's jobs share one queue."""

    id: str
    index: int
    plan: Plan  # its request as ``Engine.check`` checked it (one row: its prompt, length, stop, settings, grammar)
    provisional: bool = False
    trace_points: list[str] | None = None
    echo: str | None = None  # the prompt's text a completion echoes before its own, or None
    prompt_scores: tuple | None = None  # the prompt's scores, read as the job's first update comes (a stream's echo)
    probe: Probe | None = None  # what it reports beside its tokens (clover.step_map, clover.experts), or None
    streamed: bool = False  # the request streams: the probe frames each commit as it comes
    frames: dict = field(default_factory=dict)  # the probe's frame per committed length (a streamed chunk's)
    reported: int = 0  # response tokens the probe has framed
    created: float = field(default_factory=time.time)
    cancelled: threading.Event = field(default_factory=threading.Event)
    loop: asyncio.AbstractEventLoop | None = None
    updates: asyncio.Queue | None = None
    handle: object = None  # the engine's Handle, once submitted
    capture: object = None  # a traced job's Capture
    scope: object = None  # the hook scope of its expert recorder (clover.experts)
    context: object = None  # the context the capture and the scope are open in

    @property
    def prompt_ids(self) -> list[int]:
        return self.plan.prompts[0]

    @property
    def started(self) -> bool:
        """The engine has admitted its row (it runs)."""
        return self.handle is not None and self.handle.started

    def deliver(self, update) -> None:
        """The engine's listener (in the worker thread): the updates the client asked for."""
        if self.cancelled.is_set() or (update.kind == "step" and not self.provisional):
            return
        if self.plan.prompt_logprobs is not None and self.streamed and self.prompt_scores is None:
            self.prompt_scores = (update.prompt_logprobs, update.prompt_top_logprobs)  # scored at its prefill
        if self.probe is not None and self.streamed and update.kind == "commit":  # read now: the row goes on meanwhile
            hi = len(update.committed)
            self.frames[hi] = self.probe.frame(update.unmask_steps, self.reported, hi)
            self.reported = hi
        self.send(update)

    def send(self, item) -> None:
        """From the worker thread: an update (or None at the end, or an exception) to the request."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.updates.put_nowait, (self, item))


_ids = itertools.count()


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(8)}{next(_ids):x}"


def sampler_settings(request: schemas.Common) -> tuple[dict, dict]:
    """The sampler settings the request gives (SamplerSettings field -> value, over the engine's) and
    the body field each came from (what an error names). They are checked once, by ``Engine.check``."""
    given = {name: getattr(request, f) for f, name in OPENAI_SAMPLER.items() if getattr(request, f) is not None}
    if given.get("top_k") == -1:  # vLLM's "off"
        given["top_k"] = 0
    params = dict(OPENAI_PARAMS)
    for name in CLOVER_SAMPLER:
        value = getattr(request.clover, name)
        if value is not None:
            given[name], params[name] = value, f"clover.{name}"
    return given, params


def trace_points(engine, option) -> list[str] | None:
    if option is False:
        return None
    patterns = list(schemas.TRACE_POINTS) if option is True else option
    if not patterns:
        raise RequestError("clover.trace: name at least one hook point (or pass true)", "clover.trace")
    for p in patterns:
        try:
            known = engine.model.hooks.resolve(p)
        except KeyError:
            known = []
        if not known:
            raise RequestError(f"clover.trace: {p!r} names no hook point of this model "
                               f"(e.g. {', '.join(schemas.TRACE_POINTS)}, layers.*.moe.route)", "clover.trace")
    return patterns


def make_jobs(engine, request: schemas.Common, prompts: list, prompt_param: str, prefix: str,
              thinking: bool | None = None, max_tokens_param: str = "max_tokens",
              max_tokens: int | None = None, logprobs: tuple[int | None, str] = (None, "logprobs"),
              thinking_param: str = "clover.thinking", grammar=None, encode=None, echo: bool = False) -> list[Job]:
    """The jobs of one request: one per prompt, every check done. ``logprobs``: how many
    alternatives per token (None: no log-probabilities), and the field that asks. ``grammar``: the
    Grammar its responses follow, in any mode; ``encode(prompt, thinking)``: its prompts' token ids (default
    ``engine.encode``; chat with tools renders them too); ``echo``: a completion's prompt comes back before its
    text, scored (its log-probabilities) where ``logprobs`` asks, and ``max_tokens`` 0 scores it alone."""
    opts = request.clover
    mode = opts.mode or getattr(engine, "default_mode", None) or "diffusion"  # serve --speculative-config: "mtp"
    max_new = max_tokens if max_tokens is not None else engine.max_new_tokens
    if max_new == 0 and not echo:
        raise RequestError(f"{max_tokens_param}: 0 asks for no tokens, which scores the prompt: it needs echo: true "
                           f"(with logprobs, the prompt's log-probabilities); else ask for at least 1",
                           max_tokens_param)
    if request.min_tokens is not None and request.min_tokens > max_new:
        raise RequestError(f"min_tokens={request.min_tokens} is more than {max_tokens_param}={max_new}: the response "
                           f"could never have them", "min_tokens")
    # the prompt is scored where its log-probabilities come back (echo with logprobs), or is all there is to run
    prompt_logprobs = logprobs[0] if echo and logprobs[0] is not None else (0 if max_new == 0 else None)
    sampler, params = sampler_settings(request)
    if logprobs[0] is not None:
        sampler["logprobs"], params["logprobs"] = logprobs[0], logprobs[1]
    given = {name: getattr(opts, name) for name in CLOVER_SAMPLER if getattr(opts, name) is not None}
    for names, why in ignored_settings(mode, given, policy=opts.policy, block_size=opts.block_size,
                                       draft_passes=sampler.get("draft_passes")):
        # as the API and the command line refuse them; the field is the body's
        raise RequestError(f"{why}; leave {'them' if len(names) > 1 else 'it'} out, or use a mode that reads "
                           f"{'them' if len(names) > 1 else 'it'}", f"clover.{names[0]}", code="ignored_setting")
    ends = set(engine.eos_token_ids or ())
    odd = [t for t in request.stop_token_ids or () if t not in ends]
    if odd:
        raise RequestError(f"stop_token_ids: {odd[:5]} are not end tokens of this model (it ends a response at "
                           f"{sorted(ends)}, which it always does); stop at text with stop strings instead",
                           "stop_token_ids")
    try:
        stop = stop_list(request.stop, engine.tokenizer)
    except GenerationError as e:
        raise RequestError(str(e), "stop") from None
    if len(stop) > schemas.MAX_STOP_STRINGS:
        raise RequestError(f"stop: at most {schemas.MAX_STOP_STRINGS} stop strings, got {len(stop)}", "stop")
    if grammar is not None:  # the grammar decides where the response ends; a stop string could only cut it short
        stop = []  # (unparsable), so it changes nothing: smolagents sends two with every required tool call
    if opts.stream_provisional and not request.stream:
        raise RequestError("clover.stream_provisional needs stream: true", "clover.stream_provisional")
    if opts.stream_provisional and mode == "ar":
        raise RequestError("clover.stream_provisional: AR decoding has no denoising steps to stream; "
                           "use mode diffusion", "clover.stream_provisional")
    points = trace_points(engine, opts.trace)
    if opts.experts and engine.model.config.num_experts > NOT_ROUTED:
        raise RequestError(f"clover.experts: this model has {engine.model.config.num_experts} experts, more than "
                           f"the wire's uint8 ids hold (at most {NOT_ROUTED})", "clover.experts")
    n = request.n
    if n > 1 and points is not None:
        raise RequestError("clover.trace records one generation; ask for it with n = 1", "n")
    rid = new_id(prefix)
    jobs = []
    for i, prompt in enumerate(prompts):
        where = prompt_param if len(prompts) == 1 else f"{prompt_param}.{i}"
        try:
            ids = (encode or engine.encode)(prompt, thinking)
        except IgnoredSettingError as e:
            raise RequestError(str(e), thinking_param, code="ignored_setting") from None
        except GenerationError as e:
            raise RequestError(str(e), where) from None
        try:  # the engine's one request check (its sampler settings too); its error names the field, the body's here
            checked = engine.check(Request(ids, mode=mode, max_new_tokens=max_new, stop=stop or None, n=n,
                                           block_size=opts.block_size, grammar=grammar, policy=opts.policy,
                                           prompt_logprobs=prompt_logprobs,
                                           skip_reading_prefix_cache=request.skip_reading_prefix_cache, **sampler))
        except (GenerationError, SettingsError) as e:
            field = getattr(e, "field", None)
            over = "context length" in str(e)
            param = {"prompt": where, "max_new_tokens": max_tokens_param, "mode": "clover.mode", "stop": "stop",
                     "block_size": "clover.block_size", "policy": "clover.policy", "n": "n",
                     "prompt_logprobs": logprobs[1],
                     "skip_reading_prefix_cache": "skip_reading_prefix_cache"}.get(field)
            param = param or params.get(field) or (f"clover.{field}" if field else max_tokens_param)
            code = "context_length_exceeded" if over else "ignored_setting" if isinstance(e, IgnoredSettingError) else None
            raise RequestError(str(e), param, code=code) from None
        for k in range(n):  # n rows of one request (the Plan's: sampled with a seed, row k takes seed + k), a job each
            probe = None if not (opts.step_map or opts.experts) else Probe(
                opts.step_map, ExpertRecorder(engine.model.config, len(ids), max_new) if opts.experts else None)
            row = replace(checked, prompts=[checked.prompts[k]], settings=[checked.settings[k]], sources=[0],
                          batched=False)
            jobs.append(Job(rid, i * n + k, row, provisional=opts.stream_provisional,
                            trace_points=points, probe=probe, streamed=request.stream,
                            echo=None if not echo else prompt if isinstance(prompt, str) else
                            engine.tokenizer.decode(ids)))
    return jobs
