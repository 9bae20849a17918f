"""The engine, the front door: ``Engine`` runs generations on one model (block diffusion or AR),
checks requests up front, and hands out hooks and captures; ``load`` builds one from a
Hugging Face directory or the embedded default model.

Hooks: any exception in a hook ends the run with HookError naming the point, and the engine is
ready for the next call either way (the cache is per generation).
"""
from __future__ import annotations

import itertools
import os
from typing import Any, Callable, Iterator

import torch

from .. import defaults as checkpoint_defaults
from .. import loading, malloc
from ..hooks.capture import Capture
from ..model import CloverModel
from ..placement import plan_placement
from ..sampling import SamplerSettings
from .ar import run_ar
from .diffusion import run_diffusion
from .requests import check_request, encode_prompt, stop_list
from .results import GenerationResult, StreamUpdate
from .run import Run
from .runner import FastPath

DEFAULT_MAX_NEW_TOKENS = 256


class Engine:
    """Runs generations on one model: ``generate`` (a result), ``stream`` (updates as it goes),
    ``hooks`` / ``add_hook`` (interventions), ``capture`` (recordings). For a model on the CPU it
    applies ``clover_lab.malloc.tune()`` once per process (``CLOVER_MALLOC=system`` opts out).

    ``settings``: the sampler settings a request does not override; ``max_new_tokens``: the
    default length of a response (a model directory's generation_config.json sets both)."""

    def __init__(self, model: CloverModel, tokenizer=None, settings: SamplerSettings | None = None,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS):
        if not isinstance(model, CloverModel):
            raise TypeError(f"Engine needs a CloverModel, got {type(model).__name__}")
        if model.device.type == "cpu":
            malloc.tune()  # large activations from glibc's heap, reused: no page fault per fresh page
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings or SamplerSettings()
        self.max_new_tokens = max_new_tokens
        self.prefill_chunk_size = 1024
        self._block_size = model.config.block_size
        self._mask_token_id = model.config.mask_token_id
        # where the mask token came from (clover_lab/defaults.py): "config.json", the tokenizer, ...
        self.mask_token_source = "config.json" if model.config.mask_token_id is not None else None
        eos = list(model.config.eos_token_ids)
        if not eos and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos = [tokenizer.eos_token_id]
        self.eos_token_ids: list[int] = eos
        self._runs = itertools.count(1)
        # the no-hook fast path (engine/runner.py): None = on where it pays (CUDA, as CUDA graphs),
        # True = also on a CPU (static-shape steps run eagerly: tests), False = off
        self.step_graphs: bool | None = None
        # on a CPU, run the fast path's steps through torch.compile (~10 s of compilation per step
        # shape on first use, then steps 2-3x faster: bench/compare_transformers.py)
        self.compile_steps = False
        self._fast_path = FastPath()

    def _uses_fast_path(self) -> bool:
        placement = self.model.placement
        if placement is not None and not placement.graph_safe:  # several devices, or experts staged
            return False
        if self.step_graphs is not None:
            return self.step_graphs
        return self.model.device.type == "cuda" or self.compile_steps

    def __repr__(self):
        c = self.model.config
        return (f"Engine(layers={c.num_hidden_layers}, hidden={c.hidden_size}, experts={c.num_experts}, "
                f"block_size={self.block_size}, mask_token_id={self.mask_token_id}, device={self.model.device}, "
                f"dtype={self.model.dtype}, tokenizer={'yes' if self.tokenizer is not None else 'no'})")

    # ---------------------------------------------------------------- settings
    @property
    def block_size(self) -> int:
        return self._block_size

    @block_size.setter
    def block_size(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"block_size must be a positive integer, got {value!r}")
        self._block_size = value

    @property
    def mask_token_id(self) -> int | None:
        return self._mask_token_id

    @mask_token_id.setter
    def mask_token_id(self, value: int | None) -> None:
        V = self.model.config.vocab_size
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < V):
            raise ValueError(f"mask_token_id must be a token id in [0, {V}) or None, got {value!r}")
        self._mask_token_id = value

    # ---------------------------------------------------------------- hooks
    def hooks(self, hooks: dict[str, Callable | list[Callable]]):
        """``with engine.hooks({"denoise.step": fn, "layers.*.moe.route": fn2}):`` - removed on exit."""
        return self.model.hooks.scoped(hooks)

    def add_hook(self, name: str, fn: Callable):
        """A permanent hook; ``handle.remove()`` takes it off."""
        return self.model.hooks.add(name, fn)

    def capture(self, points, to: str | torch.device | None = None) -> Capture:
        """``with engine.capture(["layers.*.moe.route", "denoise.step"]) as cap:`` records those
        points over every generation inside the block, tagged with block and step."""
        return Capture(self.model.hooks, points, to=to, config=self.model.config)

    # ---------------------------------------------------------------- requests
    def encode(self, prompt, thinking: bool | None = None) -> list[int]:
        """A prompt as token ids: a string (needs a tokenizer), token ids, or chat messages."""
        return encode_prompt(prompt, self.tokenizer, self.model.config.vocab_size, thinking)

    def check_request(self, prompt_len: int, max_new_tokens: int, mode: str) -> None:
        """Refuse up front what cannot run: unknown mode, no mask token, context or memory overflow."""
        check_request(self.model, self.mask_token_id, prompt_len, max_new_tokens, mode)

    def _start(self, prompt, mode, max_new_tokens, stop, thinking, settings, sampler, emit) -> Run:
        s = SamplerSettings.from_kwargs(settings or self.settings, **sampler)
        stop = stop_list(stop, self.tokenizer)
        ids = self.encode(prompt, thinking)
        max_new_tokens = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        self.check_request(len(ids), max_new_tokens, mode)
        return Run(self, ids, mode, max_new_tokens, s, stop, emit, next(self._runs))

    # ---------------------------------------------------------------- generation
    def stream(self, prompt, *, mode: str = "diffusion", max_new_tokens: int | None = None, stop=None,
               thinking: bool | None = None, settings: SamplerSettings | None = None,
               **sampler: Any) -> Iterator[StreamUpdate]:
        """Like :meth:`generate`, yielding a :class:`StreamUpdate` per denoising step ("step":
        provisional tokens of the current block), per committed block ("commit") and one "done"
        whose ``result`` is the GenerationResult. Requests are checked before the first update."""
        run = self._start(prompt, mode, max_new_tokens, stop, thinking, settings, sampler, emit=True)
        return self._drive(run)

    def _drive(self, run: Run) -> Iterator[StreamUpdate]:
        # no inference_mode around the yields: it would leak into the consumer's code between updates
        try:
            yield from (run_diffusion(run) if run.mode == "diffusion" else run_ar(run))
        finally:  # ended, failed or abandoned: the fast path's cache is free for the next generation
            self._fast_path.release(run)

    def generate(self, prompt, *, mode: str = "diffusion", max_new_tokens: int | None = None, stop=None,
                 thinking: bool | None = None, settings: SamplerSettings | None = None,
                 **sampler: Any) -> GenerationResult:
        """Generate a response to ``prompt`` (a string, token ids, or chat messages).

        ``mode``: "diffusion" (block diffusion) or "ar" (one token per forward, the baseline).
        ``max_new_tokens``: default ``engine.max_new_tokens`` (256, or the model directory's
        generation_config.json). ``stop``: stop strings (need a tokenizer). ``thinking``: the chat
        template's ``enable_thinking`` flag. Sampler settings (see :class:`SamplerSettings`) come
        as keyword arguments (``threshold=0.9, temperature=0, top_p, top_k, confidence,
        max_tokens_per_step, max_steps_per_block, repetition_penalty, presence_penalty,
        frequency_penalty, coreset_size, seed``) or as ``settings``; they override ``engine.settings``.
        """
        run = self._start(prompt, mode, max_new_tokens, stop, thinking, settings, sampler, emit=False)
        for _ in self._drive(run):
            pass
        return run.result


def load(path=None, device=None, dtype=None, *, device_map=None, max_memory: dict | None = None,
         keep_fp8: bool | None = None, coreset_size: int | None = None, pin_memory: bool = False,
         progress: bool | None = None) -> Engine:
    """An Engine over the model (and tokenizer, when present) in the Hugging Face directory ``path``,
    with the defaults of its generation_config.json.

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
    progress bar (default: for checkpoints over 1 GB)."""
    if path is None:
        path = os.environ.get("CLOVER_LAB_MODEL") or loading.default_model_dir()
        if path is None:
            raise FileNotFoundError(
                "no default model found (looked for a model directory in "
                + ", ".join(str(d) for d in loading.DEFAULT_MODEL_ROOTS)
                + "); pass a model directory: clover_lab.load('path/to/model'), or set CLOVER_LAB_MODEL")
    placement = None
    if device_map is not None:
        if device is not None:
            raise ValueError("load: pass device (one device) or device_map (placed over devices), not both")
        placement = _planner(device_map, max_memory, coreset_size, pin_memory)
        if keep_fp8 is None:
            keep_fp8 = torch.cuda.is_available() and (device_map == "auto" or _names_a_gpu(device_map))
    model = CloverModel.from_pretrained(path, device=device, dtype=dtype, keep_fp8=keep_fp8, progress=progress,
                                        placement=placement)
    generation = loading.load_generation_config(path, SamplerSettings.names())
    engine = Engine(model, loading.load_tokenizer(path),
                    max_new_tokens=generation.pop("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
    defaults = checkpoint_defaults.apply(engine, model.config, generation, SamplerSettings, coreset_size)
    try:
        engine.settings = SamplerSettings(**defaults)
    except (TypeError, ValueError) as e:
        raise loading.CheckpointError(f"{path}/generation_config.json: {e}") from None
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
