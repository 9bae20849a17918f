"""The engine, the front door: ``Engine`` runs generations on one model (block diffusion, AR or
speculative), checks requests up front (``check``), queues them (``submit``, a Handle each) and
runs them a step at a time (``step``: ``engine/step_loop.py``), ``generate`` and ``stream`` on top;
it hands out hooks and captures; ``load`` builds one from a Hugging Face
directory (or the embedded default model), with the defaults of its generation_config.json, its
weights placed on one device or over several.

Hooks: any exception in a hook ends its request with HookError naming the point (the other
requests go on), and the engine is ready for the next call either way (a request's rows leave the
cache when it ends). Scoped hooks and captures
apply to the generations started inside their ``with`` block in that thread or context;
permanent hooks (``add_hook``) to every generation.

Every public setting is checked when it is set (:class:`Checked`, below): a bad value is a
ValueError naming it, and the attribute keeps the value it had.
"""
from __future__ import annotations

import itertools
import os
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from clover_lab.checkpoint import defaults as checkpoint_defaults
from clover_lab.checkpoint import loading
from clover_lab.checkpoint.loading import resolve_device
from clover_lab.cpu import check_threads, set_threads, tune_malloc
from clover_lab.engine.policies import DecodingPolicy, ThresholdPolicy, make_policy
from clover_lab.model.prefix_cache import PrefixCache
from clover_lab.engine.requests import GenerationError, Plan, Request, check_coreset, encode_prompt, plain_int, plan
from clover_lab.engine.results import GenerationResult, StreamUpdate
from clover_lab.engine.row import Handle
from clover_lab.engine.runner import FastPath
from clover_lab.engine.sampling import SamplerSettings, SettingsError
from clover_lab.engine.step_loop import StepLoop
from clover_lab.errors import CheckpointError, flag
from clover_lab.hooks.capture import Capture
from clover_lab.hooks.registry import MAX_NESTED_GENERATIONS, hook_depth
from clover_lab.model.decoder import CloverModel
from clover_lab.placement import plan_placement
from clover_lab.placement.plan import check_usable

DEFAULT_MAX_NEW_TOKENS = 256


class HooksClosedWarning(UserWarning):
    """A ``with engine.hooks(...)`` block closed while a request submitted inside it still runs."""


# --------------------------------------------------------------------------- checked settings
class Checked:
    """An attribute whose every assignment passes ``check(owner, name, value)``, which returns the
    value kept (possibly converted) or raises ValueError. ``copy``: what a read hands out instead of
    the kept value itself (``list`` for a list the caller must not edit in place)."""

    def __init__(self, check: Callable[[Any, str, Any], Any], doc: str = "", copy: Callable | None = None):
        self.check, self.copy, self.__doc__ = check, copy, doc

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = obj.__dict__[self.slot]
        return value if self.copy is None else self.copy(value)

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = self.check(obj, self.name, value)


def positive_int(owner, name: str, value) -> int:
    value = plain_int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def one_of(*allowed, what: str) -> Callable:
    """A check that the value is one of ``allowed`` (compared by identity: True is not 1)."""
    def check(owner, name: str, value):
        if not any(value is a for a in allowed):
            raise ValueError(f"{name} must be {what}, got {value!r}")
        return value

    return check


def instance_of(cls: type, what: str) -> Callable:
    def check(owner, name: str, value):
        if not isinstance(value, cls):
            raise ValueError(f"{name} must be {what}, got {type(value).__name__} {value!r:.80}")
        return value

    return check


def a_tokenizer(owner, name: str, value):
    """A transformers tokenizer (callable, with ``decode``), or None."""
    if value is not None and not (callable(value) and callable(getattr(value, "decode", None))):
        raise ValueError(f"{name} must be a tokenizer (callable, with decode) or None, got {type(value).__name__}")
    return value


def token_ids(owner, name: str, value) -> list[int]:
    """Token ids of the owner's model (``owner.model.config.vocab_size``): one id or a list, possibly empty."""
    V = owner.model.config.vocab_size
    ids = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < V for t in ids):
        raise ValueError(f"{name} must be token ids in [0, {V}) (a list, possibly empty), got {value!r}")
    return list(ids)


def token_id_or_none(owner, name: str, value) -> int | None:
    V = owner.model.config.vocab_size
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < V):
        raise ValueError(f"{name} must be a token id in [0, {V}) or None, got {value!r}")
    return value


class Engine:
    """Runs generations on one model: ``generate`` (a result), ``stream`` (updates as it goes),
    ``hooks`` / ``add_hook`` (interventions), ``capture`` (recordings). For a model on the CPU it
    applies ``clover_lab.cpu.tune()`` once per process (``CLOVER_MALLOC=system`` opts out).

    ``settings``: the sampler settings a request does not override; ``max_new_tokens``: the
    default length of a response (a model directory's generation_config.json sets both)."""

    def __init__(self, model: CloverModel, tokenizer=None, settings: SamplerSettings | None = None,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS):
        if not isinstance(model, CloverModel):
            raise TypeError(f"Engine needs a CloverModel, got {type(model).__name__}")
        if model.device.type == "cpu":
            tune_malloc()  # large activations from glibc's heap, reused: no page fault per fresh page
        if model.device.type == "meta":
            raise ValueError("Engine: the model is on the meta device (shapes only, no weights); "
                             "load it onto a real device, e.g. CloverModel.from_pretrained(path, device='cpu')")
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings or SamplerSettings()
        self.max_new_tokens = max_new_tokens
        self.prefill_chunk_size = 1024
        self.block_size = model.config.block_size
        self.mask_token_id = model.config.mask_token_id
        # where the mask token came from (clover_lab/checkpoint/defaults.py): "config.json", the tokenizer, ...
        self.mask_token_source = "config.json" if model.config.mask_token_id is not None else None
        eos = list(model.config.eos_token_ids)
        tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        if not eos and isinstance(tok_eos, int) and 0 <= tok_eos < model.config.vocab_size:
            eos = [tok_eos]
        self.eos_token_ids = eos
        self._runs = itertools.count(1)  # request numbers (events' ``where.run``)
        # the no-hook fast path (engine/runner.py): None = on where it pays (CUDA, as CUDA graphs),
        # True = also on a CPU (static-shape steps run eagerly: tests), False = off
        self.step_graphs = None
        # on a CPU, run the fast path's steps through torch.compile (~10 s of compilation per step
        # shape on first use, then steps 2-3x faster: bench/compare_transformers.py)
        self.compile_steps = False
        # the static steps (StepGraphs) the step loop runs on: ``fast_path.graphs`` is what it last
        # built (None before any), ``fast_path.held`` whether rows run on them now
        self.fast_path = FastPath()
        self.policy = ThresholdPolicy()  # which block positions a denoising step unmasks (policies.py)
        # prompts' committed prefixes kept across requests (model/prefix_cache.py); budget in bytes, 0 or None: off
        self.prefix_cache = PrefixCache(model.config.block_size)
        self.loop = StepLoop(self)  # where every generation runs (engine/step_loop.py): submit, step

    def fast_path_off(self) -> str | None:
        """Why generations take the eager forward (what their stats' ``path`` says), or None
        when the fast path applies."""
        placement = self.model.placement
        if placement is not None and not placement.graph_safe:  # several devices, or experts staged
            return "the model is placed over several devices or stages experts from host memory"
        if self.step_graphs is False:
            return "engine.step_graphs is False"
        if self.step_graphs is None and self.model.device.type != "cuda" and not self.compile_steps:
            return "on a CPU the fast path takes engine.compile_steps = True (or step_graphs = True)"
        return None

    def __repr__(self):
        c = self.model.config
        return (f"Engine(layers={c.num_hidden_layers}, hidden={c.hidden_size}, experts={c.num_experts}, "
                f"block_size={self.block_size}, mask_token_id={self.mask_token_id}, device={self.model.device}, "
                f"dtype={self.model.dtype}, tokenizer={'yes' if self.tokenizer is not None else 'no'})")

    # ---------------------------------------------------------------- settings (Checked, below)
    tokenizer = Checked(a_tokenizer, "The tokenizer (a transformers tokenizer: callable, with ``decode``), or None.")
    settings = Checked(instance_of(SamplerSettings, "a SamplerSettings"),
                       "The sampler settings a request does not override.")
    max_new_tokens = Checked(positive_int, "The default length of a response.")
    prefill_chunk_size = Checked(positive_int,
                                 "Prompt tokens committed per forward during the prefill (bounds activation memory).")
    eos_token_ids = Checked(token_ids, "Token ids that end a response (a copy: assign a new list to change them).",
                            copy=list)
    step_graphs = Checked(one_of(None, True, False, what="None, True or False"),
                          "The no-hook fast path: None = where it pays (CUDA), True = also on a CPU, False = off.")
    compile_steps = Checked(one_of(True, False, what="True or False"),
                            "On a CPU, run the fast path's steps through torch.compile.")
    policy = Checked(instance_of(DecodingPolicy, "a DecodingPolicy (clover_lab.engine.policies)"),
                     "The decoding rule block diffusion asks, per row and step, which positions to unmask with "
                     "which tokens and when a block is done (``clover_lab.engine.policies``).")
    block_size = Checked(positive_int, "Tokens per block.")
    mask_token_id = Checked(token_id_or_none, "The mask token a preview's masked positions hold, or None.")

    # ---------------------------------------------------------------- hooks
    @contextmanager
    def hooks(self, hooks: dict[str, Callable | list[Callable]]):
        """``with engine.hooks({"denoise.step": fn, "layers.*.moe.route": fn2}):`` - for the
        generations started inside the block in this thread or context; removed on exit (a
        request submitted inside that still runs then is said: a HooksClosedWarning)."""
        with self.model.hooks.scoped(hooks) as handle:
            try:
                yield handle
            finally:
                self._outlived(handle)

    def _outlived(self, handle) -> None:
        """Requests still queued or running with the scope ``handle`` is about to close: its hooks
        stop applying to them from their next step, which a user should hear of."""
        scope = getattr(handle, "_scope", None)
        going = sorted({row.handle.number for row in itertools.chain(self.loop.queue, self.loop.rows)
                        if not row.handle.done and not row.handle.cancelled and scope in row.hooks.scopes})
        if going:
            warnings.warn(f"the hooks of this `with engine.hooks(...)` block stop applying to request(s) "
                          f"{', '.join(map(str, going))}, submitted inside it and still running: their later steps "
                          f"run without them. Wait for them inside the block (engine.wait(handle)), or use "
                          f"engine.add_hook for hooks that outlive it", HooksClosedWarning, stacklevel=3)

    def add_hook(self, name: str, fn: Callable):
        """A permanent hook, for every generation in every thread; ``handle.remove()`` takes it off."""
        return self.model.hooks.add(name, fn)

    def capture(self, points, to: str | torch.device | None = None) -> Capture:
        """``with engine.capture(["layers.*.moe.route", "denoise.step"]) as cap:`` records those
        points over the generations started inside the block in this thread or context, tagged
        with block and step."""
        return Capture(self.model.hooks, points, to=to, config=self.model.config, tokenizer=self.tokenizer,
                       prompt_of=self.prompt_of)

    # ---------------------------------------------------------------- requests
    def encode(self, prompt, thinking: bool | None = None) -> list[int]:
        """A prompt as token ids: a string (needs a tokenizer), token ids, or chat messages."""
        return encode_prompt(prompt, self.tokenizer, self.model.config.vocab_size, thinking)

    def check(self, request: Request) -> Plan:
        """Refuse up front what cannot run (an unknown mode or setting, a bad prompt, no mask token,
        context or memory overflow): a GenerationError naming the field (``error.field``); else the
        request's :class:`Plan` (its prompts as token ids, the settings each row runs with)."""
        checked = plan(self, request)
        if checked.policy is not None:
            try:
                checked.policy = make_policy(checked.policy)
            except SettingsError as e:  # it names the policy's setting; ``field`` the request's
                e.field = "policy"
                raise
            except (ValueError, TypeError) as e:
                raise GenerationError(str(e), "policy") from None
        return checked

    # ---------------------------------------------------------------- the step loop
    def submit(self, request: Request | Plan, *, emit: bool = True, listener: Callable | None = None) -> Handle:
        """Queue ``request``'s rows (checked first: :meth:`check`; a Plan is a request it checked, as the
        server's are, and runs as it is); :meth:`step` runs them.
        ``emit``: build StreamUpdates for it (``handle.updates()``, or ``listener(update)`` in the
        thread that steps). Thread-safe."""
        if hook_depth() >= MAX_NESTED_GENERATIONS:
            raise GenerationError(f"generate() called from inside hooks {hook_depth()} levels deep; a hook that "
                                  f"generates must not do so again unconditionally (at most "
                                  f"{MAX_NESTED_GENERATIONS} nested generations)")
        checked = request if isinstance(request, Plan) else self.check(request)
        handle = Handle(self, checked, next(self._runs), self.model.hooks.view(), emit, listener)
        handle.loop = self.loop  # from a listener or a hook too: the next step admits it
        handle.loop.submit(handle)
        return handle

    def _waited(self, handle: Handle) -> None:
        """A request waited for from inside a hook or listener, while this thread steps the engine
        (whose step cannot go on until the wait ends), moves to a step loop of its own."""
        loop = self.loop
        if handle.loop is loop and loop.stepping_here() and not handle.started:
            loop.queue = type(loop.queue)(row for row in loop.queue if row.handle is not handle)
            handle.loop = StepLoop(self)
            handle.loop.submit(handle)

    def step(self) -> list[StreamUpdate]:
        """One step of every request submitted: rows admitted and prefilled, each row's next
        forward (grouped with the rows that can share it), its decision; returns the updates."""
        return self.loop.step()

    def prompt_of(self, where) -> list[int] | None:
        """The prompt's token ids of the running row that an event's ``where`` names (its request
        ``run`` and, in a batch, its ``row``), so that an observer can name a prefill's positions by
        their tokens; None when no such row runs in this engine's step loop."""
        for row in self.loop.rows:
            if row.handle.number == where.run and row.row == where.row:
                return list(row.prompt_ids)
        return None

    def wait(self, handle: Handle):
        """Step until ``handle``'s request has ended; its result (an error it ended with is raised).
        An interrupt meanwhile cancels it."""
        self._waited(handle)
        try:
            while not handle.done:
                handle.loop.step()
        except BaseException:
            handle.cancel()
            raise
        if handle.error is not None:
            raise handle.error
        return handle.result

    def _follow(self, handle: Handle) -> Iterator[StreamUpdate]:
        # no inference_mode around the yields: it would leak into the consumer's code between updates
        self._waited(handle)
        try:
            while True:
                updates = handle.updates()  # other streams' steps may have produced some meanwhile
                if updates:
                    yield from updates
                elif handle.done:
                    break
                else:
                    try:
                        handle.loop.step()
                    except BaseException:  # an interrupt: what the step decided before it comes first
                        yield from handle.updates()
                        raise
            if handle.error is not None:
                raise handle.error
        finally:  # abandoned or interrupted: its rows leave at the next step
            if not handle.done:
                handle.cancel()

    # ---------------------------------------------------------------- generation
    def stream(self, prompt, *, mode: str = "diffusion", max_new_tokens: int | None = None, stop=None,
               thinking: bool | None = None, settings: SamplerSettings | None = None, policy=None,
               **sampler: Any) -> Iterator[StreamUpdate]:
        """Like :meth:`generate`, yielding a :class:`StreamUpdate` per denoising step ("step":
        provisional tokens of the current block), per committed block ("commit") and one "done"
        whose ``result`` is the GenerationResult. Requests are checked before the first update.
        A list of prompts streams a batch: updates carry their ``row``, a "done" per row as it
        ends, and a last "batch" update whose ``result`` is the :class:`BatchResult`. Other
        requests (another stream, a server's) advance meanwhile: every step is the engine's.
        ``prompt`` may be a :class:`Request` (then without other arguments)."""
        request = self._request(prompt, mode, max_new_tokens, stop, thinking, settings, policy, sampler)
        return self._follow(self.submit(request, emit=True))

    def generate(self, prompt, *, mode: str = "diffusion", max_new_tokens: int | None = None, stop=None,
                 thinking: bool | None = None, settings: SamplerSettings | None = None, policy=None,
                 **sampler: Any) -> GenerationResult:
        """Generate a response to ``prompt`` (a string, token ids, or chat messages; or a
        :class:`Request`, then without other arguments).

        ``mode``: "diffusion" (block diffusion), "ar" (one token per forward, the baseline) or
        "speculative" (AR's answer: each block drafted by ``draft_passes`` previews and accepted
        by one causal commit up to its first disagreement; ``engine/speculative.py``).
        ``policy``: this generation's decoding rule instead of ``engine.policy``: a DecodingPolicy,
        or a name with settings (``"eb:gamma=0.5"``, ``"topk:k=1/2/4"``; ``engine/policies.py``).
        ``max_new_tokens``: default ``engine.max_new_tokens`` (256, or the model directory's
        generation_config.json). ``stop``: stop strings (need a tokenizer). ``thinking``: the chat
        template's ``enable_thinking`` flag; with a tokenizer that has ``<think>``/``</think>``, the
        result's ``reasoning`` and ``answer`` are apart, and with thinking off a ``</think>`` ends
        the response. Sampler settings (see :class:`SamplerSettings`) come
        as keyword arguments (``threshold=0.9, temperature=0, top_p, top_k, min_p, confidence,
        max_tokens_per_step, max_steps_per_block, repetition_penalty, presence_penalty,
        frequency_penalty, coreset_size, seed``) or as ``settings``; they override ``engine.settings``.

        A list of prompts (strings, token-id lists or chat conversations) is a batch: the rows
        share every forward, each progresses on its own, and the result is a :class:`BatchResult`
        (a list of GenerationResults, one per prompt, with the batch's figures in ``stats``).
        Each row gives the tokens its prompt gives alone; a ``seed`` seeds every row alike.

        A list of :class:`Request` objects (each with its own settings, as vLLM's ``generate``
        takes a list) runs them together, sharing forwards; the result is a list, each request's
        result in its place (a GenerationResult, or a BatchResult for a request of several
        prompts). A request that fails ends only itself while the others run to their end; then
        the first error is raised.
        """
        if isinstance(prompt, (list, tuple)) and prompt and any(isinstance(p, Request) for p in prompt):
            return self._generate_requests(list(prompt), mode, max_new_tokens, stop, thinking, settings, policy,
                                           sampler)
        request = self._request(prompt, mode, max_new_tokens, stop, thinking, settings, policy, sampler)
        return self.wait(self.submit(request, emit=False))

    def _generate_requests(self, requests: list, mode, max_new_tokens, stop, thinking, settings, policy,
                           sampler) -> list:
        """``generate([Request, ...])``: every request checked, then submitted together."""
        others = [i for i, r in enumerate(requests) if not isinstance(r, Request)]
        if others:
            raise TypeError(f"generate: a list that holds Requests must hold only Requests; item {others[0]} is "
                            f"a {type(requests[others[0]]).__name__} (wrap it in Request(...))")
        for r in requests:
            self._request(r, mode, max_new_tokens, stop, thinking, settings, policy, sampler)  # settings: none here
        for i, r in enumerate(requests):  # every request checked before any runs
            try:
                self.check(r)
            except Exception as e:
                e.add_note(f"(request {i} of the list given to generate; none of them ran)")
                raise
        handles = []
        try:
            handles = [self.submit(r, emit=False) for r in requests]
            while not all(h.done for h in handles):
                handles[0].loop.step()
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        failed = next((h for h in handles if h.error is not None), None)
        if failed is not None:
            raise failed.error
        return [h.result for h in handles]

    @staticmethod
    def _request(prompt, mode, max_new_tokens, stop, thinking, settings, policy, sampler) -> Request:
        if not isinstance(prompt, Request):
            return Request(prompt, mode=mode, max_new_tokens=max_new_tokens, stop=stop, thinking=thinking,
                           settings=settings, policy=policy, **sampler)
        given = [k for k, v in (("max_new_tokens", max_new_tokens), ("stop", stop), ("thinking", thinking),
                                ("settings", settings), ("policy", policy)) if v is not None]
        if given or sampler or mode != "diffusion":
            raise TypeError(f"a Request carries its own settings; pass them to Request(...), not here "
                            f"({', '.join(given + list(sampler) + (['mode'] if mode != 'diffusion' else []))})")
        return prompt




def load(path=None, device=None, dtype=None, *, device_map=None, max_memory: dict | None = None,
         keep_fp8: bool | None = None, coreset_size: int | None = None, pin_memory: bool = False,
         progress: bool | None = None, check_finite: bool | None = None, threads: int | None = None) -> Engine:
    """An Engine over the model (and tokenizer, when present) in the Hugging Face directory ``path``,
    with the defaults of its generation_config.json. ``check_finite``: refuse weights holding NaN
    or inf (default: for checkpoints up to ``loading.CHECK_FINITE_MAX_BYTES``).

    With no path: ``$CLOVER_LAB_MODEL`` when set, else the embedded default model
    (``assets/clover-stdlib``). Without one that is a FileNotFoundError saying so; there is
    deliberately no random-weights fallback, whose output would look like a broken model.

    ``device``: one device for the whole model. ``device_map``: "auto" (planned by accelerate
    within ``max_memory``, e.g. ``{0: "22GiB", 1: "22GiB", "cpu": "120GiB"}``) or a dict of
    module name -> device; routed experts that do not fit stay in host memory and are staged onto
    their layer's GPU when routed (``clover_lab/placement``). ``coreset_size``: the engine's
    default expert coreset, and the staging room the plan reserves for it. ``pin_memory``:
    offloaded experts in page-locked memory. ``keep_fp8``: an FP8 checkpoint's linears and experts
    stay FP8 (default: when they run on CUDA) or are dequantized as they load. ``progress``: a
    progress bar (default: for checkpoints over 1 GB). ``threads``: torch's intra-op threads; by
    default one for a small model on the CPU (the embedded one), as the CLI chooses, unless you
    set a count yourself (``OMP_NUM_THREADS``, or ``torch.set_num_threads`` after importing
    clover_lab): ``clover_lab/cpu.py``."""
    check_threads(threads, "load(threads)")  # before the weights are read
    keep_fp8, progress, check_finite = (flag(n, v) for n, v in (("keep_fp8", keep_fp8), ("progress", progress),
                                                               ("check_finite", check_finite)))
    pin_memory = flag("pin_memory", pin_memory, none=False)
    if device_map is None:
        resolve_device(device)  # before anything is read: an unknown or unusable device, or meta
        if max_memory is not None:
            raise CheckpointError("max_memory bounds the plan of device_map='auto'; without a device_map "
                                          "it would be ignored: pass device_map='auto' too, or drop it")
    else:
        check_usable(device_map, max_memory)
    if path is None:
        path = loading.model_path()
        if path is None:
            raise FileNotFoundError(
                "no default model found (looked for a model directory in "
                + ", ".join(str(d) for d in loading.DEFAULT_MODEL_ROOTS)
                + "); pass a model directory: clover_lab.load('path/to/model'), or set CLOVER_LAB_MODEL")
    if coreset_size is not None:  # the argument's own error, before the weights are read
        if isinstance(plain_int(coreset_size), bool) or not isinstance(plain_int(coreset_size), int):
            raise GenerationError(f"load(coreset_size={coreset_size!r}): expected an int (or None for no coreset)")
        try:
            check_coreset(loading.load_config(path), plain_int(coreset_size))
        except GenerationError as e:
            raise GenerationError(f"load(coreset_size={coreset_size!r}): {e}") from None
    placement = None
    if device_map is not None:
        if device is not None:
            raise ValueError("load: pass device (one device) or device_map (placed over devices), not both")
        placement = _planner(device_map, max_memory, coreset_size, pin_memory)
        if keep_fp8 is None:
            keep_fp8 = torch.cuda.is_available() and (device_map == "auto" or _names_a_gpu(device_map))
    model = CloverModel.from_pretrained(path, device=device, dtype=dtype, keep_fp8=keep_fp8, progress=progress,
                                        placement=placement, check_finite=check_finite)
    generation = loading.load_generation_config(path, SamplerSettings.names())
    engine = Engine(model, loading.load_tokenizer(path),
                    max_new_tokens=generation.pop("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
    try:
        defaults = checkpoint_defaults.apply(engine, model.config, generation, SamplerSettings, coreset_size)
        engine.settings = SamplerSettings(**defaults)
        check_coreset(model.config, engine.settings.coreset_size)
    except (TypeError, ValueError) as e:
        where = "/generation_config.json" if os.path.isfile(os.path.join(path, "generation_config.json")) else \
            " (its sampler defaults)"
        raise CheckpointError(f"{path}{where}: {e}") from None
    set_threads(model, threads)
    return engine


def _planner(device_map, max_memory, coreset_size, pin_memory):
    """The loader's placement callable: (meta model, dtype) -> Placement."""
    def plan(model, dtype):
        placed = plan_placement(model, device_map, max_memory, dtype, coreset_size or 0)
        placed.pin_memory = pin_memory
        return placed

    return plan


def _names_a_gpu(device_map) -> bool:
    return isinstance(device_map, dict) and any(
        (isinstance(v, int) and not isinstance(v, bool)) or str(v).startswith("cuda") for v in device_map.values())
