"""The runner's no-hook fast path: static-shape forwards, replayed as CUDA graphs (or compiled on
a CPU). Everything here runs without autograd.

At batch 1 a step of a big MoE model is hundreds of small kernels; launching them one by one
from Python costs more than running them. ``StepGraphs`` owns one preallocated cache and, per
step shape (commit rows c, block rows m, whether the last commit row's logits are wanted),
one captured graph of :func:`static_step`: a preview of a block (c = 0), the fused
commit of the previous block with the preview of the next (c = m = block size) and an AR step
(c = 1). Replaying a graph writes the step's ids and the committed length into static input
buffers and launches the whole forward at once.

On a CPU (or with ``capture=False``) the same static-shape forwards run eagerly, so that the
path is tested everywhere; with ``compile=True`` they run through ``torch.compile`` (inductor
fuses the few hundred small ops of a step and contracts the experts hit without a host sync:
steps 2-3x faster than eager on 2 CPU cores, see bench/compare_transformers.py); a compile
costs ~10 s per step shape, once per process. The engine takes this path only while no hook
is attached inside the model (engine points ``denoise.step`` / ``block.commit`` are fine: they
run between forwards); anything else takes the ordinary forward. With an expert coreset, a block's first preview
(which records the coreset) and its later previews (which route within it) are two graphs
that share the coreset's buffers, owned here (``coreset(size)``).
"""
from __future__ import annotations

import warnings
import weakref

import torch

from ..cache import CloverCache
from ..context import Coreset, ForwardContext
from ..model import CloverModel


# --------------------------------------------------------------------------- one static step
@torch.no_grad()
def static_step(model: CloverModel, cache: CloverCache, ids: torch.Tensor, n: torch.Tensor, c: int, m: int,
                commit_logits: bool = False, coreset: Coreset | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``CloverModel.forward`` with static shapes and no host synchronisation, the body of a CUDA
    graph: ids [B, c + m] on the model's device, ``n`` the committed length as a 0-d device
    tensor. Writes the cache (K,V rows at n.., GDN ring and state when c > 0) but leaves
    ``cache.length`` to the caller. Refused while a hook is attached inside the model: a graph
    replays kernels and would never call it.
    Returns (logits of the last commit row or None, logits of every block row or None)."""
    check_static_step(model, cache, ids, c, m)
    return static_body(model, cache, ids, n, c, m, commit_logits, coreset)


def check_static_step(model: CloverModel, cache: CloverCache, ids: torch.Tensor, c: int, m: int) -> None:
    """What a static step refuses, checked outside any traced or captured code."""
    if model.hooks.model_hooks_attached():
        raise RuntimeError("static_step: hooks are attached to model points; use forward()")
    if cache.batch_size != ids.shape[0] or ids.shape[1] != c + m:
        raise ValueError(f"static_step: ids {tuple(ids.shape)} do not match batch {cache.batch_size}, "
                         f"c + m = {c + m}")


@torch.no_grad()
def static_body(model: CloverModel, cache, ids, n, c, m, commit_logits, coreset):
    """What ``torch.compile`` traces for a static step: no hook lookups, so that attaching an
    engine hook does not invalidate the compiled code; no autograd history either."""
    ctx = ForwardContext.static(cache, n, c, m, coreset)
    x = model.hidden_states(ids, ctx)
    for dst, src in ctx.pending:
        dst.copy_(src)
    out_commit = model.head(x[:, c - 1:c]) if c and commit_logits else None
    out_preview = model.head(x[:, c:]) if m else None
    return out_commit, out_preview


# --------------------------------------------------------------------------- graphs per step shape


class StepGraphs:
    MAX_COMPILED = 6  # step shapes compiled at most (torch._dynamo keeps 8 per function)

    def __init__(self, model: CloverModel, max_len: int, capture: bool | None = None, compile: bool = False):
        self.model = model
        self.device, self.dtype = model.device, model.dtype
        self.cache: CloverCache = model.new_cache(max_len)
        self.capture = (self.device.type == "cuda") if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("StepGraphs: capture needs a CUDA device")
        self._n = torch.zeros((), dtype=torch.long, device=self.device)
        self._graphs: dict[tuple, tuple] = {}  # (c, m, commit_logits, coreset phase) -> (graph, ids, outputs)
        self._coresets: dict[int, Coreset] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.disabled: str | None = None  # why capture failed, once it has
        self.compile = compile and not self.capture
        self._compiled = torch.compile(static_body, dynamic=False) if self.compile else None
        self._compiled_keys: set = set()
        self.compile_failed: str | None = None

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def fits(self, length: int) -> bool:
        return length <= self.cache.max_len

    def coreset(self, size: int) -> Coreset:
        """The coreset of this size whose buffers the graphs read and write (emptied)."""
        core = self._coresets.setdefault(size, Coreset(size))
        core.reset()
        return core

    def reset(self) -> CloverCache:
        """The cache, emptied for a new generation (its buffers, and so every graph, are kept)."""
        self.cache.reset()
        return self.cache

    # ------------------------------------------------------------------ a step
    def step(self, ids: torch.Tensor, c: int, m: int, commit_logits: bool = False, coreset: Coreset | None = None):
        """Run one step on the owned cache: ids [1, c + m]; advances ``cache.length`` by c.
        ``coreset``: one from :meth:`coreset`; empty, the step records it, else routes within it.
        Returns (commit logits [1, 1, V] or None, preview logits [1, m, V] or None), fresh tensors."""
        if coreset is not None and self._coresets.get(coreset.size) is not coreset:
            raise ValueError("StepGraphs.step: pass a coreset made by StepGraphs.coreset(size)")
        cache = self.cache
        # block rows are written as scratch past the committed rows; the cache is never longer
        # than the context (CloverCache.allocate refuses it), so this bounds the positions too
        cache.check_room(c + m)
        ids = ids.to(self.device, torch.long)
        phase = None if coreset is None else (coreset.size, "use" if coreset.experts else "record")
        key = (c, m, bool(commit_logits), phase)
        graph = self._graphs.get(key) if self.capture and not self.disabled else None
        if graph is None and self.capture and not self.disabled:
            graph = self._capture(key)
        self._n.fill_(cache.length)  # a capture above restored the cache, and so its length
        if graph is None:
            out = self._compiled_step(key, ids, coreset) if self._compiled is not None else None
            if out is None:  # eager static step
                out = static_step(self.model, cache, ids, self._n, c, m, commit_logits, coreset)
        else:
            g, static_ids, static_out = graph
            static_ids.copy_(ids)
            g.replay()
            if phase is not None and phase[1] == "record":  # the graph wrote every layer's buffer
                coreset.experts.update(coreset._buffers)
            # outputs live in the graphs' shared pool: the next replay may overwrite them
            out = tuple(None if t is None else t.clone() for t in static_out)
        cache.length += c
        return out

    def _compiled_step(self, key, ids, coreset):
        """The step through torch.compile, or None to run it eagerly (compilation failed once, or
        too many shapes already compiled)."""
        if self.compile_failed or (key not in self._compiled_keys and len(self._compiled_keys) >= self.MAX_COMPILED):
            return None
        c, m, commit_logits, _ = key
        check_static_step(self.model, self.cache, ids, c, m)
        try:
            out = self._compiled(self.model, self.cache, ids, self._n, c, m, commit_logits, coreset)
        except Exception as e:  # noqa: BLE001 - a first compilation fails before anything runs
            if key in self._compiled_keys:
                raise
            self.compile_failed = f"{type(e).__name__}: {e}"
            warnings.warn(f"torch.compile of the step failed, running steps eagerly from now on "
                          f"({self.compile_failed})", RuntimeWarning, stacklevel=3)
            return None
        self._compiled_keys.add(key)
        return out

    def _capture(self, key):
        c, m, commit_logits, phase = key
        cache, model = self.cache, self.model
        coreset = None if phase is None else self._coresets[phase[0]]
        recorded = None if coreset is None else dict(coreset.experts)

        def run():
            if coreset is not None:  # every run starts from the coreset the step was asked with
                coreset.experts.clear()
                coreset.experts.update(recorded)
            return static_step(model, cache, static_ids, self._n, c, m, commit_logits, coreset)

        static_ids = torch.zeros(1, c + m, dtype=torch.long, device=self.device)
        snapshot = cache.clone()  # warm-up runs write the cache; capture itself runs nothing
        try:
            self._n.fill_(cache.length)
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


# --------------------------------------------------------------------------- which graphs a run uses
class FastPath:
    """An engine's StepGraphs, handed to one generation at a time: a stream left open holds them,
    and a generation started meanwhile takes the plain path."""

    def __init__(self):
        self.graphs: StepGraphs | None = None
        self._holder = None  # weakref to the generation running on them

    def acquire(self, run, model: CloverModel, length: int, use: bool, compile: bool) -> StepGraphs | None:
        """The StepGraphs for ``run``, a generation of ``length`` positions, or None for the plain
        path (``use`` False, or another unfinished generation holds them)."""
        if not use:
            return None
        if self._holder is not None and self._holder() is not None:
            return None
        self._holder = weakref.ref(run)
        g = self.graphs
        if (g is None or not g.fits(length) or (g.device, g.dtype) != (model.device, model.dtype)
                or g.compile != compile):
            size = max(1024, 1 << (length - 1).bit_length())  # a power of two: few re-allocations
            size = min(size, model.config.max_position_embeddings)
            self.graphs = None  # free the old cache and graphs first
            self.graphs = StepGraphs(model, size, compile=compile)
        return self.graphs

    def release(self, run) -> None:
        """``run`` ended, failed or was abandoned: the graphs' cache is free for the next one."""
        if self._holder is not None and self._holder() is run:
            self._holder = None
