"""The engine, the front door: ``Engine`` runs generations on one model (block diffusion or AR),
checks requests up front, and hands out hooks and captures; ``load`` builds one from a Hugging Face
directory (or the embedded default model), with the defaults of its generation_config.json, its
weights placed on one device or over several.

Hooks: any exception in a hook ends the run with HookError naming the point, and the engine is
ready for the next call either way (the cache is per generation). Scoped hooks and captures
apply to the generations started inside their ``with`` block in that thread or context;
permanent hooks (``add_hook``) to every generation.

Every public setting is checked when it is set (``attributes.py``): a bad value is a ValueError
naming it.
"""
from __future__ import annotations

import itertools
import os
from typing import Any, Callable, Iterator

import torch

from clover_lab.checkpoint import defaults as checkpoint_defaults
from clover_lab.checkpoint import loading
from clover_lab.checkpoint.loading import resolve_device
from clover_lab.cpu import check_threads, set_threads, tune_malloc
from clover_lab.engine import attributes as A
from clover_lab.engine.ar import run_ar
from clover_lab.engine.attributes import Checked, plain_int
from clover_lab.engine.diffusion import run_diffusion
from clover_lab.engine.graphs import FastPath
from clover_lab.engine.policies import DecodingPolicy, ThresholdPolicy, make_policy
from clover_lab.engine.requests import (
    GenerationError,
    check_coreset,
    check_join,
    check_memory,
    check_mode_settings,
    check_request,
    encode_prompt,
    is_batch,
    stop_list,
)
from clover_lab.engine.results import GenerationResult, StreamUpdate
from clover_lab.engine.run import Run
from clover_lab.engine.sampling import SamplerSettings
from clover_lab.engine.speculative import run_speculative
from clover_lab.engine.thinking import Thinking, stop_ids
from clover_lab.errors import CheckpointError, flag
from clover_lab.hooks.capture import Capture
from clover_lab.hooks.registry import MAX_NESTED_GENERATIONS, hook_depth
from clover_lab.model.decoder import CloverModel
from clover_lab.placement import plan_placement
from clover_lab.placement.plan import check_usable

DEFAULT_MAX_NEW_TOKENS = 256


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
        self._runs = itertools.count(1)
        # the no-hook fast path (engine/runner.py): None = on where it pays (CUDA, as CUDA graphs),
        # True = also on a CPU (static-shape steps run eagerly: tests), False = off
        self.step_graphs = None
        # on a CPU, run the fast path's steps through torch.compile (~10 s of compilation per step
        # shape on first use, then steps 2-3x faster: bench/compare_transformers.py)
        self.compile_steps = False
        # the static steps (StepGraphs) generations run on, one generation at a time: ``fast_path.graphs``
        # is what the last one built (None before any), ``fast_path.held`` whether one holds them now
        self.fast_path = FastPath()
        self.policy = ThresholdPolicy()  # which block positions a denoising step unmasks (policies.py)

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

    # ---------------------------------------------------------------- settings (engine/attributes.py)
    tokenizer = Checked(A.tokenizer, "The tokenizer (a transformers tokenizer: callable, with ``decode``), or None.")
    settings = Checked(A.instance_of(SamplerSettings, "a SamplerSettings"),
                       "The sampler settings a request does not override.")
    max_new_tokens = Checked(A.positive_int, "The default length of a response.")
    prefill_chunk_size = Checked(A.positive_int,
                                 "Prompt tokens committed per forward during the prefill (bounds activation memory).")
    eos_token_ids = Checked(A.token_ids, "Token ids that end a response (a copy: assign a new list to change them).",
                            copy=list)
    step_graphs = Checked(A.one_of(None, True, False, what="None, True or False"),
                          "The no-hook fast path: None = where it pays (CUDA), True = also on a CPU, False = off.")
    compile_steps = Checked(A.one_of(True, False, what="True or False"),
                            "On a CPU, run the fast path's steps through torch.compile.")
    policy = Checked(A.instance_of(DecodingPolicy, "a DecodingPolicy (clover_lab.engine.policies)"),
                     "The decoding rule block diffusion asks, per row and step, which positions to unmask with "
                     "which tokens and when a block is done (``clover_lab.engine.policies``).")
    block_size = Checked(A.positive_int, "Tokens per block.")
    mask_token_id = Checked(A.token_id_or_none, "The mask token a preview's masked positions hold, or None.")

    # ---------------------------------------------------------------- hooks
    def hooks(self, hooks: dict[str, Callable | list[Callable]]):
        """``with engine.hooks({"denoise.step": fn, "layers.*.moe.route": fn2}):`` - for the
        generations started inside the block in this thread or context; removed on exit."""
        return self.model.hooks.scoped(hooks)

    def add_hook(self, name: str, fn: Callable):
        """A permanent hook, for every generation in every thread; ``handle.remove()`` takes it off."""
        return self.model.hooks.add(name, fn)

    def capture(self, points, to: str | torch.device | None = None) -> Capture:
        """``with engine.capture(["layers.*.moe.route", "denoise.step"]) as cap:`` records those
        points over the generations started inside the block in this thread or context, tagged
        with block and step."""
        return Capture(self.model.hooks, points, to=to, config=self.model.config, tokenizer=self.tokenizer)

    # ---------------------------------------------------------------- requests
    def encode(self, prompt, thinking: bool | None = None) -> list[int]:
        """A prompt as token ids: a string (needs a tokenizer), token ids, or chat messages."""
        return encode_prompt(prompt, self.tokenizer, self.model.config.vocab_size, thinking)

    def check_request(self, prompt_len: int, max_new_tokens: int, mode: str) -> None:
        """Refuse up front what cannot run: unknown mode, no mask token, context or memory overflow."""
        check_request(self.model, self.mask_token_id, prompt_len, max_new_tokens, mode)

    def _request(self, mode, max_new_tokens, stop, settings, sampler, policy=None) -> tuple:
        """What every request checks before its prompts: nesting, sampler settings, stop strings,
        the response length. Returns (settings, stop strings, max_new_tokens)."""
        if hook_depth() >= MAX_NESTED_GENERATIONS:
            raise GenerationError(f"generate() called from inside hooks {hook_depth()} levels deep; a hook that "
                                  f"generates must not do so again unconditionally (at most "
                                  f"{MAX_NESTED_GENERATIONS} nested generations)")
        s = SamplerSettings.from_kwargs(self.settings if settings is None else settings, **sampler)
        if mode == "speculative" and not s.greedy and s.draft_passes != 1:
            raise GenerationError(f"sampled speculative decoding takes draft_passes=1 (got {s.draft_passes}): the "
                                  f"acceptance rule needs each drafted token's own distribution, which only a one-pass "
                                  f"draft gives")
        if mode == "speculative" and s.logprobs is not None:
            raise GenerationError("logprobs: not reported in speculative mode yet; its greedy tokens are AR's, and "
                                  "mode='ar' reports them with their log-probabilities")
        check_coreset(self.model.config, s.coreset_size)
        check_mode_settings(mode, sampler, policy)
        stop = stop_list(stop, self.tokenizer)
        return s, stop, self.max_new_tokens if max_new_tokens is None else A.plain_int(max_new_tokens)

    def _start(self, prompt, mode, max_new_tokens, stop, thinking, settings, sampler, emit, policy=None,
               join=None, capacity=None) -> Run:
        """A generation of one prompt or (a list) a batch: checked, its cache allocated."""
        s, stop, max_new_tokens = self._request(mode, max_new_tokens, stop, settings, sampler, policy)
        if join is not None:
            check_join(self.model.config, is_batch(prompt), mode, s.coreset_size, capacity)
        batched = is_batch(prompt)
        ids = []
        for r, one in enumerate(prompt if batched else [prompt]):
            try:
                ids.append(self.encode(one, thinking))
                check_request(self.model, self.mask_token_id, len(ids[-1]), max_new_tokens, mode, memory=False)
            except GenerationError as e:
                if not batched:
                    raise
                raise GenerationError(f"prompt {r} of the batch: {e}") from e
        length = max(max(map(len, ids)) + max_new_tokens, capacity or 0)
        check_memory(self.model, length, len(ids))
        policy = None if policy is None else make_policy(policy)
        run = Run(self, ids, mode, max_new_tokens, s, stop, emit, next(self._runs), batched, policy, join, length)
        for row in run.rows:
            self._think(row, thinking)
        return run

    def _think(self, row, thinking: bool | None) -> None:
        """The row's thinking tokens (``engine/thinking.py``); with thinking off, ``</think>`` ends it."""
        row.thinking = Thinking.of(self.tokenizer, row.prompt_ids)
        row.eos |= stop_ids(row.thinking, thinking)

    # ---------------------------------------------------------------- generation
    def stream(self, prompt, *, mode: str = "diffusion", max_new_tokens: int | None = None, stop=None,
               thinking: bool | None = None, settings: SamplerSettings | None = None, policy=None,
               join: Callable[[int], list] | None = None, capacity: int | None = None,
               **sampler: Any) -> Iterator[StreamUpdate]:
        """Like :meth:`generate`, yielding a :class:`StreamUpdate` per denoising step ("step":
        provisional tokens of the current block), per committed block ("commit") and one "done"
        whose ``result`` is the GenerationResult. Requests are checked before the first update.
        A list of prompts streams a batch: updates carry their ``row``, a "done" per row as it
        ends, and a last "batch" update whose ``result`` is the :class:`BatchResult`.

        ``join`` (a batch in diffusion mode, without a coreset): rows join the running batch at
        block boundaries. At each, ``join(room)`` returns the token-id prompts (of at most
        ``room`` tokens) that join now, with this request's settings; they become rows
        ``len(prompts)``, ``len(prompts) + 1``, ... in the order given. ``capacity``: positions
        per row of the cache (a joining prompt plus ``max_new_tokens`` must fit in it)."""
        return self._drive(self._start(prompt, mode, max_new_tokens, stop, thinking, settings, sampler, emit=True,
                                       policy=policy, join=join, capacity=capacity))

    def _drive(self, run: Run) -> Iterator[StreamUpdate]:
        # no inference_mode around the yields: it would leak into the consumer's code between updates
        try:
            yield from LOOPS[run.mode](run)
        finally:  # ended, failed or abandoned: the fast path's cache is free for the next generation
            self.fast_path.release(run)

    def generate(self, prompt, *, mode: str = "diffusion", max_new_tokens: int | None = None, stop=None,
                 thinking: bool | None = None, settings: SamplerSettings | None = None, policy=None,
                 **sampler: Any) -> GenerationResult:
        """Generate a response to ``prompt`` (a string, token ids, or chat messages).

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
        Greedy rows give the tokens each prompt gives alone; a ``seed`` seeds every row alike.
        """
        run = self._start(prompt, mode, max_new_tokens, stop, thinking, settings, sampler, emit=False, policy=policy)
        for _ in self._drive(run):
            pass
        return run.result if run.batched else run.result[0]


LOOPS = {"diffusion": run_diffusion, "ar": run_ar, "speculative": run_speculative}


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
