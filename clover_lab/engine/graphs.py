"""Static-shape steps, replayed as CUDA graphs (or compiled on a CPU); the runner
(``runner.py``) picks them per step. Everything here runs without autograd.

At batch 1 a step of a big MoE model is hundreds of small kernels; launching them one by one
from Python costs more than running them. ``StepGraphs`` owns preallocated caches (one per
batch bucket: 1, 2, 4, 8, ... rows) and, per step shape (rows B, commit rows c, block rows m,
whether the last commit row's logits are wanted, the coreset's phase), one captured graph of
:func:`static_step`: a preview of a block (c = 0), the fused commit of the previous block with
the preview of the next (c = m = block size) and an AR step (c = 1). Rows stand at their own
committed lengths (a [B] device tensor). Replaying a graph writes the step's ids and the
lengths into static input buffers and launches the whole forward at once.

On a CPU (or with ``capture=False``) the same static-shape forwards run eagerly, so that the
path is tested everywhere; with ``compile=True`` they run through ``torch.compile`` (inductor
fuses the few hundred small ops of a step and contracts the experts hit without a host sync:
steps 2-3x faster than eager on 2 CPU cores, see bench/compare_transformers.py); a compile
costs ~10 s per step shape, once per process. With an expert coreset, a block's first preview
(which records the coreset) and its later previews (which route within it) are two graphs
that share the coreset's buffers, owned here (``coreset(size)``).

Hooks inside the model (``observed.py``): a step records what observers read and leaves
its cache writes for the caller to publish after them (``observed``); ``split_step`` runs a
compiled step as compiled segments of layers around the layers whose hooks run live.
"""
from __future__ import annotations

import warnings

import torch

from clover_lab.engine.observed import copied
from clover_lab.hooks import points
from clover_lab.hooks.events import NOWHERE
from clover_lab.model.cache import CloverCache
from clover_lab.model.context import Coreset, ForwardContext, publish
from clover_lab.model.decoder import CloverModel
from clover_lab.model.layers.moe import calibrate_experts


# --------------------------------------------------------------------------- one static step
@torch.no_grad()
def static_step(model: CloverModel, cache: CloverCache, ids: torch.Tensor, n: torch.Tensor, c: int, m: int,
                commit_logits: bool = False, coreset: Coreset | None = None, observed: frozenset = frozenset(),
                keys: int | None = None):
    """``CloverModel.forward`` with static shapes and no host synchronisation, the body of a CUDA
    graph: ids [B, c + m] on the model's device, ``n`` the rows' committed lengths, [B] on the
    device. Writes the cache (K,V rows at n.., GDN ring and state when c > 0) but leaves its
    lengths to the caller. Refused while a hook is attached inside the model, except observers
    on the ``observed`` points: a graph replays kernels and would never call a hook. ``keys``:
    the cache rows attention reads (:func:`key_span`; None, the whole buffer, in a CUDA graph).
    Returns (logits of the last commit row or None, logits of every block row or None); with
    ``observed`` also (what the observers read, the GDN writes still to publish: the caller
    fires the observers first, ``engine/observed.py``)."""
    check_static_step(model, cache, ids, c, m, observed)
    return static_body(model, cache, ids, n, c, m, commit_logits, coreset, observed, keys)


def check_static_step(model: CloverModel, cache: CloverCache, ids: torch.Tensor, c: int, m: int,
                      observed: frozenset = frozenset(), live: tuple[int, ...] = ()) -> None:
    """What a static step refuses, checked outside any traced or captured code: a hook it would
    not call (one not on an ``observed`` point and only observing, nor in a ``live`` layer); a
    fused projection weight gone stale is dropped here, where its data pointers can be read."""
    model.check_projections()
    if model.hooks.model_hooks_attached():
        missed = [p for p in model.hooks.model_points()
                  if not (p in observed and model.hooks.observers_only(p))
                  and not (points.parse(p)[0] in live or (live and p == points.FINAL_NORM_OUTPUT))]
        if missed:
            raise RuntimeError(f"static_step: hooks are attached to model points ({', '.join(missed[:3])}); "
                               f"use forward()")
    if cache.batch_size != ids.shape[0] or ids.shape[1] != c + m:
        raise ValueError(f"static_step: ids {tuple(ids.shape)} do not match batch {cache.batch_size}, "
                         f"c + m = {c + m}")


@torch.no_grad()
def static_body(model: CloverModel, cache, ids, n, c, m, commit_logits, coreset, observed=frozenset(), keys=None):
    """What ``torch.compile`` traces for a static step: no hook lookups, so that attaching an
    engine hook does not invalidate the compiled code; no autograd history either. The tail is
    the ordinary forward's (``ForwardContext.publish``, ``CloverModel.heads``)."""
    ctx = ForwardContext.static(cache, n, c, m, coreset, observed, keys)
    x = model.hidden_states(ids, ctx)
    if observed:  # the caller publishes once the observers have read
        out = model.heads(x, ctx, "last" if commit_logits else None)
        return out.commit_logits, out.preview_logits, ctx.observations, ctx.pending
    ctx.publish()
    out = model.heads(x, ctx, "last" if commit_logits else None)
    return out.commit_logits, out.preview_logits


@torch.no_grad()
def static_layers(model: CloverModel, cache, ids, x, n, c, m, coreset, start: int, stop: int, keys=None):
    """Layers [start, stop) of a static step, from the embedding of ``ids`` (``x`` None) or from
    ``x``: what torch.compile traces between a split step's live layers. Returns (the layers'
    output, their deferred cache writes)."""
    ctx = ForwardContext.static(cache, n, c, m, coreset, keys=keys)
    return model.hidden_states(ids, ctx, start, stop, x), ctx.pending


def bucket(rows: int) -> int:
    """The batch a static step of ``rows`` rows runs at: the next power of two (the rest padding),
    so that rows leaving one by one do not compile or capture a step per row count."""
    return 1 << max(rows - 1, 0).bit_length()


MIN_KEY_SPAN = 256


def key_span(cache: CloverCache, rows: int) -> int:
    """The cache rows a static step's attention reads off a CUDA graph: the longest row's
    committed length plus the step's ``rows``, rounded up to a power of two (at least
    ``MIN_KEY_SPAN``, at most the buffer), so that a generation compiles a few spans, not one
    per length. The torch path of ``cache_attention`` masks every key it is given: a 1,024-row
    buffer read whole cost 4.7 ms a call at 16 rows on 2 CPU cores, against 0.75 ms eager."""
    return min(cache.max_len, max(MIN_KEY_SPAN, 1 << (cache.length + rows - 1).bit_length()))


# --------------------------------------------------------------------------- graphs per step shape


class StepGraphs:
    MAX_COMPILED = 24  # step shapes compiled at most (torch._dynamo's recompile limit is raised to match)

    def __init__(self, model: CloverModel, max_len: int, capture: bool | None = None, compile: bool = False):
        self.model = model
        self.device, self.dtype = model.device, model.dtype
        self.max_len = max_len
        self._caches: dict[int, CloverCache] = {}  # batch -> its preallocated cache
        self._lengths: dict[int, torch.Tensor] = {}  # batch -> the rows' committed lengths [B] (a graph input)
        self.cache: CloverCache = self._cache_for(1)
        self.capture = (self.device.type == "cuda") if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("StepGraphs: capture needs a CUDA device")
        self._graphs: dict[tuple, tuple] = {}  # (B, c, m, commit_logits, coreset phase) -> (graph, ids, outputs)
        self._coresets: dict[int, Coreset] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.disabled: str | None = None  # why capture failed, once it has
        self.compile = compile and not self.capture
        self._compiled = torch.compile(static_body, dynamic=False) if self.compile else None
        self._compiled_keys: set = set()
        self._compiled_layers = torch.compile(static_layers, dynamic=False) if self.compile else None
        self._segment_keys: set = set()  # split steps' compiled segments
        self.compile_failed: str | None = None
        self.last: str | None = None  # how the last step ran: "cuda graph", "compiled" or "static" (eager)

    @property
    def shapes(self) -> dict[str, frozenset]:
        """What has been built so far, by kind: ``captured`` CUDA graphs and ``compiled`` whole steps
        (keyed by batch, committed rows, preview rows, commit logits, coreset phase), ``segments``
        (the compiled parts of split steps) and ``caches`` (the batch sizes given a preallocated cache)."""
        return {"captured": frozenset(self._graphs), "compiled": frozenset(self._compiled_keys),
                "segments": frozenset(self._segment_keys), "caches": frozenset(self._caches)}

    def fits(self, length: int) -> bool:
        return length <= self.max_len

    def _cache_for(self, batch: int) -> CloverCache:
        if batch not in self._caches:
            self._caches[batch] = self.model.new_cache(self.max_len, batch)
            self._lengths[batch] = torch.zeros(batch, dtype=torch.long, device=self.device)
        return self._caches[batch]

    def coreset(self, size: int) -> Coreset:
        """The coreset of this size whose buffers the graphs read and write (emptied)."""
        core = self._coresets.setdefault(size, Coreset(size))
        core.reset()
        return core

    def reset(self, batch: int = 1) -> CloverCache:
        """The cache of ``batch`` rows, emptied for a new generation (its buffers, and so every
        graph, are kept)."""
        self.cache = self._cache_for(batch)
        self.cache.reset()
        return self.cache

    def adopt(self, part: CloverCache, batch: int) -> CloverCache:
        """The rows of ``part`` (a cache of k <= batch rows) become rows 0..k-1 of the cache of
        ``batch`` rows, the rest padding at length 0: a batch that lost rows steps at a smaller
        bucket, a cache the eager forward compacted comes back."""
        cache = self._cache_for(batch)
        if part is not cache:
            cache.put(list(range(part.batch_size)), part)
            lengths = part.row_lengths or [part.length] * part.batch_size
            cache.set_row_lengths(lengths + [0] * (batch - part.batch_size))
        self.cache = cache
        return cache

    def _load_lengths(self, cache: CloverCache) -> torch.Tensor:
        n = self._lengths[cache.batch_size]
        if cache.row_lengths is None or cache.batch_size == 1:
            n.fill_(cache.length)  # no host-to-device copy for one row
        else:
            n.copy_(torch.tensor(cache.row_lengths))
        return n

    # ------------------------------------------------------------------ a step
    def step(self, ids: torch.Tensor, c: int, m: int, commit_logits: bool = False, coreset: Coreset | None = None,
             observed: frozenset = frozenset(), read=None):
        """Run one step on the owned cache: ids [B, c + m] (B the cache's rows); advances every
        row's length by c. ``coreset``: one from :meth:`coreset`; empty, the step records it, else
        routes within it. ``observed``: points whose observer hooks read this step; the step
        records their events and calls ``read(observations)`` (``engine/observed.py``) after it,
        before its cache writes land (an observer that raises leaves the cache as it was).
        Returns (commit logits [B, 1, V] or None, preview logits [B, m, V] or None), fresh tensors."""
        self._check_coreset(coreset, "step")
        cache = self.cache
        # block rows are written as scratch past the committed rows; the cache is never longer
        # than the context (CloverCache.allocate refuses it), so this bounds the positions too
        cache.check_room(c + m)
        ids = ids.to(self.device, torch.long)
        phase = _phase(coreset)
        capturing = self.capture and not self.disabled
        # a CUDA graph's kernel bounds its keys on the device; other static steps read key_span rows
        keys = None if capturing else key_span(cache, c + m)
        key = (cache.batch_size, c, m, bool(commit_logits), phase, keys, frozenset(observed))
        graph = self._graphs.get(key) if capturing else None
        if graph is None and capturing:
            graph = self._capture(key)
        n = self._load_lengths(cache)  # a capture above restored the cache, and so its lengths
        if graph is None:
            out = self._compiled_step(key, ids, n, coreset) if self._compiled is not None else None
            self.last = "compiled"
            if out is None:  # eager static step
                out = static_step(self.model, cache, ids, n, c, m, commit_logits, coreset, key[-1], keys)
                self.last = "static"
        else:
            self.last = "cuda graph"
            g, static_ids, static_out = graph
            static_ids.copy_(ids)
            g.replay()
            if phase is not None and phase[1] == "record":  # the graph wrote every layer's buffer
                coreset.experts.update(coreset.buffers(cache.batch_size))
            out = _fresh(static_out)
        if observed:
            *out, observations, pending = out
            if read is not None:
                read(observations)
            publish(pending)
        cache.advance(c)
        return tuple(out)

    def split_step(self, ids: torch.Tensor, c: int, m: int, commit_logits: bool, coreset: Coreset | None,
                   live: tuple[int, ...], where=NOWHERE):
        """A compiled step split at the ``live`` layers (those with hooks that must run): the
        layers between them compiled segments (:func:`static_layers`), each live layer the eager
        forward's, on the eager forward's context (its events are the eager forward's: ``where``
        theirs), and the forward's tail once (publishing the cache writes, ``CloverModel.heads``).
        Every batch row is a request row (no padding: the hooks see every row). Advances every
        row's length by c; returns what :meth:`step` does."""
        model, cache = self.model, self.cache
        self._check_coreset(coreset, "split_step")
        cache.check_room(c + m)
        ids = ids.to(self.device, torch.long)
        check_static_step(model, cache, ids, c, m, live=tuple(live))
        n = self._load_lengths(cache)
        ctx = ForwardContext.cached(cache, c, m, model.input_device, coreset, where)
        x, start, end = None, 0, model.config.num_hidden_layers
        self.last = "compiled"
        for stop in (*live, end):
            if stop > start:
                x, pending = self._segment(ids, x, n, c, m, coreset, start, stop)
                ctx.pending += pending
            if stop < end:
                x = model.hidden_states(ids, ctx, stop, stop + 1, x)
            start = stop + 1
        ctx.publish()
        cache.advance(c)
        out = model.heads(x, ctx, "last" if commit_logits else None)
        return out.commit_logits, out.preview_logits

    def _segment(self, ids, x, n, c, m, coreset, start: int, stop: int):
        """Layers [start, stop) of a split step through torch.compile (eagerly once compiling
        failed, or too many segments are compiled)."""
        keys = key_span(self.cache, c + m)
        key = (self.cache.batch_size, c, m, start, stop, _phase(coreset), keys)
        if self._compiled_layers is not None and key not in self._segment_keys:
            self._calibrate_experts(self.cache.batch_size * (c + m))
        args = (self.model, self.cache, ids, x, n, c, m, coreset, start, stop, keys)
        out = None if self._compiled_layers is None else self._through_compile(self._compiled_layers,
                                                                               self._segment_keys, key, args)
        if out is None:
            self.last = "static"
            out = static_layers(*args)
        return out

    def _calibrate_experts(self, tokens: int) -> None:
        """Before a step of ``tokens`` tokens compiles: which form its experts take (``layers/moe.py``)."""
        if not self.compile_failed:
            calibrate_experts(self.model.model.layers, tokens, self.model.config.num_experts_per_tok)

    def _compiled_step(self, key, ids, n, coreset):
        """The step through torch.compile, or None to run it eagerly."""
        batch, c, m, commit_logits, _, keys, observed = key
        check_static_step(self.model, self.cache, ids, c, m, observed)
        if key not in self._compiled_keys:
            self._calibrate_experts(batch * (c + m))
        return self._through_compile(self._compiled, self._compiled_keys, key,
                                     (self.model, self.cache, ids, n, c, m, commit_logits, coreset, observed, keys))

    def _through_compile(self, compiled, keys: set, key, args: tuple):
        """``compiled(*args)`` for the shape ``key`` (recorded in ``keys``), or None to run it
        eagerly: compilation failed once (a warning, then eager from now on), or too many shapes
        are compiled already."""
        if self.compile_failed or (key not in keys and len(keys) >= self.MAX_COMPILED):
            return None
        try:
            with torch._dynamo.config.patch(recompile_limit=self.MAX_COMPILED + 2):
                out = compiled(*args)
        except Exception as e:  # noqa: BLE001 - a first compilation fails before anything runs
            if key in keys:
                raise
            self.compile_failed = f"{type(e).__name__}: {e}"
            warnings.warn(f"torch.compile of the step failed, running steps eagerly from now on "
                          f"({self.compile_failed})", RuntimeWarning, stacklevel=5)
            return None
        keys.add(key)
        return out

    def _check_coreset(self, coreset: Coreset | None, method: str) -> None:
        if coreset is not None and self._coresets.get(coreset.size) is not coreset:
            raise ValueError(f"StepGraphs.{method}: pass a coreset made by StepGraphs.coreset(size)")

    def _capture(self, key):
        batch, c, m, commit_logits, phase, _, observed = key
        cache, model = self.cache, self.model
        coreset = None if phase is None else self._coresets[phase[0]]
        recorded = None if coreset is None else dict(coreset.experts)

        def run():
            if coreset is not None:  # every run starts from the coreset the step was asked with
                coreset.experts.clear()
                coreset.experts.update(recorded)
            return static_step(model, cache, static_ids, n, c, m, commit_logits, coreset, observed)

        static_ids = torch.zeros(batch, c + m, dtype=torch.long, device=self.device)
        snapshot = cache.clone()  # warm-up runs write the cache; capture itself runs nothing
        try:
            n = self._load_lengths(cache)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # compiles the Triton kernels, settles the allocator
                for _ in range(2):
                    run()
            torch.cuda.current_stream(self.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            # thread_local: a notebook thread touching CUDA meanwhile must not break the capture
            with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                static_out = run()
        except Exception as e:  # noqa: BLE001 - the eager static step is always there
            self.disabled = f"{type(e).__name__}: {e}"
            warnings.warn(f"CUDA graph capture failed, running steps eagerly from now on ({self.disabled})",
                          RuntimeWarning, stacklevel=3)
            return None
        finally:
            cache.restore(snapshot)
            if coreset is not None:
                coreset.experts.clear()
                coreset.experts.update(recorded)
        self._graphs[key] = (g, static_ids, static_out)
        return self._graphs[key]


def _phase(coreset: Coreset | None) -> tuple | None:
    """A step's coreset phase: none, recording it (a block's first preview) or routing within it."""
    return None if coreset is None else (coreset.size, "use" if coreset.experts else "record")


def _fresh(static_out: tuple) -> tuple:
    """A replayed graph's outputs as fresh tensors (they live in the graphs' shared pool: the next
    replay may overwrite them); the cache writes it leaves to publish are read at once."""
    logits = tuple(None if t is None else t.clone() for t in static_out[:2])
    if len(static_out) == 2:
        return logits
    return (*logits, copied(static_out[2]), static_out[3])
