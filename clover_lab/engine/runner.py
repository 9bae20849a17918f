"""The runner: the only caller of the model while the engine generates. It owns the cache, whose
batch rows (``slots``) hold the rows going on (by their keys), and runs the prefill, the
previews and the commits the step loop (``step_loop.py``) asks for, over all of its rows or some,
each forward with the hooks of the rows it runs; it is the one place that picks, per forward,
the static step (``graphs.py``: a CUDA graph on CUDA, compiled or eager static steps on a CPU)
or the eager forward. The step loop makes one when rows arrive at an idle engine and drops it
when the last row has left; rows joining meanwhile grow its cache.

A single prompt is a batch of one. On the static path the cache has a bucket of rows (1, 2, 4,
8, ...): rows that leave become padding (filler ids, never read) until the rows left fit a
smaller bucket, and then move into that bucket's cache; so rows finishing one by one do not
compile or capture a step per row count. The eager forward runs on the rows exactly (rows
that sit a forward out are not in it: the others run against a copy of their own cache rows),
and a padded cache is compacted before it. A fused commit of some rows beside others' previews
is one forward (``committing``: the rows without a commit pad theirs, ``ForwardContext.cached``). Every forward runs inside
``hooks.applied()``, so that the model's events see the generation's hooks, and inside a named
region of torch.profiler's traces (``clover_lab.prefill``, ``.preview``, ``.commit``; a packed step's
is named after the widest of its parts: preview, else commit, else prefill): a profile
of a generation tells the steps' time from the loop's (``bench/bench_batch_bound.py``).
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from clover_lab.engine.graphs import StepGraphs, bucket
from clover_lab.engine.observed import describe, fire_observed, live_layers, observed_points
from clover_lab.engine.requests import GenerationError
from clover_lab.model.cache import CloverCache, cache_bytes
from clover_lab.model.context import Coreset, Segment
from clover_lab.model.drafts import DraftCommit


class Runner:
    FILL = 0  # the token id padding rows carry

    def __init__(self, engine, owner, length: int, keys: list[int], coreset_size: int | None = None):
        """A cache of ``length`` positions for the rows ``keys`` (empty, to be prefilled); the
        fast path's graphs when it applies and ``owner`` (a step loop) can hold them."""
        model = engine.model
        self.model, self.hooks = model, model.hooks.view()
        self.engine_fast_path, self.owner = engine.fast_path, owner
        self.coreset: Coreset | None = None
        self.off = engine.fast_path_off()  # why these rows have no fast path, or None
        self.last: str | None = None  # the path the last forward took (a label, ``_took``)
        self.drafts: dict = {}  # row -> (its length before, GDN records): drafts the last packed forward committed
        rows = len(keys)
        try:
            self.graphs = engine.fast_path.acquire(owner, model, length, self.off is None,
                                                    engine.compile_steps and model.device.type != "cuda")
            if self.graphs is None and self.off is None:
                self.off = "another step loop holds the fast path (a generation started inside a hook)"
            if self.graphs is not None:
                self.cache = self.graphs.reset(bucket(rows))
            else:
                self.cache = model.new_cache(length, rows)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            raise allocation_error(model, length, rows, e) from e
        self.slots: list[int | None] = list(keys) + [None] * (self.cache.batch_size - rows)
        self.cache.set_row_lengths([0] * self.cache.batch_size)
        if coreset_size:
            self.coreset = self.graphs.coreset(coreset_size) if self.graphs is not None else Coreset(coreset_size)

    @property
    def rows(self) -> list[int]:
        """The rows going on (their keys), in the cache's order."""
        return [r for r in self.slots if r is not None]

    def plan(self) -> tuple[str, object]:
        """How a step of the rows runs now (``engine/observed.py``): ("static", the points whose
        observers read after the step), ("split", the layers whose hooks run live: compiled steps
        only) or ("eager", why)."""
        if self.graphs is None:
            return "eager", self.off
        names = self.hooks.model_points()
        if not names:
            return "static", frozenset()
        observed = observed_points(self.hooks)
        if observed is not None:
            return "static", observed
        if self.graphs.compile and not self.graphs.compile_failed:
            return "split", live_layers(names)
        return "eager", "a hook on " + describe(names)

    def _took(self, kind: str, detail) -> None:
        """The path this forward took, as a label (``last``): "compiled", "eager: a hook on
        layers.2.moe.route" (which path, and why the eager forward where it ran)."""
        if kind == "eager":
            label = "eager: " + detail
        elif kind == "split":
            layers = ", ".join(map(str, detail))
            label = (f"{self.graphs.last}, layer{'s' * (len(detail) > 1)} {layers} eager: a hook on "
                     f"{describe(self.hooks.model_points())}")
        else:
            label = self.graphs.last + (f" (observers read after each step: {describe(sorted(detail))})"
                                        if detail else "")
        self.last = label

    def row_cache(self, row: int) -> CloverCache:
        """Row ``row``'s part of the cache, as a cache of its own (a copy: the error path inspects it)."""
        return self.cache.select([self.slots.index(row)])

    def packs_commits(self, hooks) -> bool:
        """Whether rows that commit a finished block and rows that only preview share one forward:
        on the eager forward, with no hook inside the model (its events would show the padding
        rows); a static step commits every row of its cache, so there they take a forward each."""
        return self.graphs is None and not hooks.model_hooks_attached()

    def use(self, hooks) -> "Runner":
        """The hooks the next forward runs with (those of the rows it runs)."""
        self.hooks = hooks
        return self

    # ---------------------------------------------------------------- forwards
    def prefill(self, rows: list[int], prompts: list[list[int]], chunk: int, logits: str | None, where):
        """These rows' prompts (of one length) into their rows of the cache in one forward (no
        padding inside the model); their logits [R, T, V] when ``logits`` is "all", the last
        position's [R, V] when "last"."""
        index = [self.slots.index(r) for r in rows]
        if len(rows) == self.cache.batch_size:
            cache = self.cache
        elif len(rows) == 1:
            cache = self.cache.row(index[0])  # views: the commit lands in this cache
        else:
            cache = self.model.new_cache(self.cache.max_len, len(rows))
        lengths = list(self.cache.row_lengths or [self.cache.length] * self.cache.batch_size)
        with self.hooks.applied(), region("prefill"):
            out = self.model.prefill(cache, prompts, chunk_size=chunk, logits=logits, where=where)
        if cache is not self.cache and len(rows) > 1:
            self.cache.put(index, cache)
        for i, ids in zip(index, prompts):
            lengths[i] = len(ids)
        self.cache.set_row_lengths(lengths)
        return out if out is None or logits == "all" else out[:, -1]

    def prefill_part(self, row: int, start: int, ids: list[int], chunk: int, logits: str | None, where):
        """Positions [start, start + len(ids)) of row ``row``'s prompt into its cache row (the
        positions before are there: a chunked prefill beside decoding rows); the last position's
        logits [V] when ``logits`` is "last"."""
        index = self.slots.index(row)
        cache = self.cache.row(index)  # views: the commit lands in this cache
        cache.set_row_lengths([start])
        with self.hooks.applied(), region("prefill"):
            out = self.model.prefill(cache, [ids], chunk_size=chunk, logits=logits, where=where)
        lengths = list(self.cache.row_lengths or [self.cache.length] * self.cache.batch_size)
        lengths[index] = start + len(ids)
        self.cache.set_row_lengths(lengths)
        return None if out is None else out[0, -1]

    def row_view(self, row: int) -> CloverCache:
        """Row ``row``'s part of the cache as views (what lands there lands in the cache)."""
        return self.cache.row(self.slots.index(row))

    def restore(self, row: int, prefix, lookup) -> None:
        """Row ``row``'s cached prompt positions from the prefix cache ``prefix`` into its cache
        row (``lookup``: ``prefix.lookup``'s answer for its prompt)."""
        index = self.slots.index(row)
        prefix.restore(lookup, self.cache.row(index))
        lengths = list(self.cache.row_lengths or [self.cache.length] * self.cache.batch_size)
        lengths[index] = lookup.cached
        self.cache.set_row_lengths(lengths)

    def add(self, rows: list[int], length: int = 0) -> None:
        """A cache of the rows going on plus ``rows`` (empty, after them), to be prefilled, of
        ``length`` positions per row at least (more than the static steps' cache holds: the rows
        go on on the eager forward). The static path adopts it into its bucket at its next step."""
        going = self.rows
        keep = [self.slots.index(r) for r in going]
        old = self.cache
        lengths = [(old.row_lengths or [old.length] * old.batch_size)[i] for i in keep] + [0] * len(rows)
        if self.graphs is not None and not self.graphs.fits(max(length, old.max_len)):
            self.graphs, self.off = None, f"a row of {length} positions is longer than the fast path's cache"
            self.engine_fast_path.release(self.owner)
        try:
            self.cache = self.model.new_cache(max(length, old.max_len), len(going) + len(rows))
        except (torch.OutOfMemoryError, RuntimeError) as e:
            raise allocation_error(self.model, max(length, old.max_len), len(going) + len(rows), e) from e
        if going:
            self.cache.put(list(range(len(going))), old if keep == list(range(old.batch_size)) else old.select(keep))
        self.slots = going + rows
        self.cache.set_row_lengths(lengths)

    def preview(self, rows: list[int], canvas: torch.Tensor, where, pending: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, committing: list[bool] | None = None) -> torch.Tensor:
        """Preview logits [R, m, V] of these rows' blocks ``canvas`` [R, m], after committing
        ``pending`` [R, c] (each row's previous block) in the same forward; ``committing``: per
        row, whether it has one (None: every row; a row without pads its commit rows).
        ``positions``: one row's block positions whose logits are wanted ([1, N, V]). Some rows
        only commit too when rows joined since (they have no finished block): eagerly, on a copy
        of their rows written back."""
        c = 0 if pending is None else pending.shape[1]
        ids = canvas if pending is None else torch.cat([pending, canvas], dim=1)
        if committing is not None and (all(committing) or pending is None):
            committing = None
        with self.hooks.applied(), region("preview"):
            kind, detail = self.plan()
            if kind != "eager" and committing is not None:  # the static steps commit every row
                kind, detail = "eager", "a fused commit of some rows beside others' previews"
            if kind != "eager" and rows != self.rows:
                if c:  # a static step commits every row of its cache
                    kind, detail = "eager", "a fused commit of some rows (rows joined since)"
                elif kind == "split":  # a live hook sees exactly the rows the forward runs
                    kind, detail = "eager", f"a hook on {describe(self.hooks.model_points())} (a preview of some rows)"
            if kind != "eager":
                logits = self._static(rows, ids, c, canvas.shape[1], where, kind, detail)[1]
                self._took(kind, detail)
                return logits if positions is None else logits[:, positions]
            logits = self._eager(rows, ids, c, canvas.shape[1], where, None, positions, committing).preview_logits
            self._took(kind, detail)
            return logits

    def commit(self, rows: list[int], ids: torch.Tensor, where, logits: str | None = None) -> torch.Tensor | None:
        """Commit ``ids`` [R, c] (a token or a block per row); the last row's logits [R, 1, V] when
        ``logits`` is "last" (the static AR step always gives them). Every row: in place; some rows
        only (rows of other modes or requests go on beside them): on a copy of their rows, written
        back."""
        with self.hooks.applied(), region("commit"):
            if rows != self.rows:
                self._arrange(fast=False)
                index = [self.slots.index(r) for r in rows]
                part = self.cache.select(index)
                out = self.model.commit(part, ids, logits=logits, where=where)
                self._write_back(index, part)
                kind, detail = self.plan()
                self._took("eager", detail if kind == "eager" else "a commit of some rows (others go on beside)")
                return out
            kind, detail = self.plan()
            if ids.shape[1] == 1 and kind != "eager":
                out = self._static(rows, ids, 1, 0, where, kind, detail, commit_logits=True)[0]
                self._took(kind, detail)
                return out
            out = self._eager(rows, ids, ids.shape[1], 0, where, logits, None).commit_logits
            if ids.shape[1] == 1 or self.graphs is None:  # a block's own commit is eager by design
                self._took(kind, detail)
            return out

    def run(self, parts: list) -> list[torch.Tensor]:
        """One forward over the step's segments (``step_loop.Part``: a row's commit tokens and/or
        its block, whatever its phase and mode), packed (``CloverModel.forward_packed``); each
        part's logits [len(part.want), V] at the segment positions it wants, in order. The eager
        forward, with no hook inside the model (the step loop packs only such rows)."""
        kinds = {part.kind for part in parts}  # the region: "preview" if a row previews, else "commit", else "prefill"
        with self.hooks.applied(), region(next(k for k in ("preview", "commit", "prefill") if k in kinds)):
            self._arrange(fast=False)
            segments, wanted, at = [], [], 0
            lengths = self.cache.row_lengths or [self.cache.length] * self.cache.batch_size
            for part in parts:
                segments.append(Segment(self.slots.index(part.row.key), part.commit, part.preview, at, part.draft))
                wanted += [at + j for j in part.want]
                at += part.commit + part.preview
            drafts = {} if any(part.draft for part in parts) else None
            before = {part.row.key: lengths[s.row] for part, s in zip(parts, segments) if part.draft}
            ids = torch.cat([part.ids for part in parts])
            logits = self.model.forward_packed(self.cache, segments, ids,
                                               torch.tensor(wanted, device=ids.device, dtype=torch.long),
                                               drafts=drafts)
            self.drafts = {key: (before[key], drafts.get(s.row, {})) for key, s in
                           ((p.row.key, s) for p, s in zip(parts, segments) if p.draft)}
            kind, detail = self.plan()
            self._took("eager", detail if kind == "eager" else "rows in different phases packed into one forward")
        return list(logits.split([len(part.want) for part in parts]))

    def keep_draft(self, row: int, logits: torch.Tensor, kept: int) -> None:
        """Row ``row``'s drafted block, committed by the last packed forward (``run``), kept up to its
        first ``kept`` tokens (``DraftCommit.keep`` on that cache row)."""
        before, records = self.drafts.pop(row)
        index = self.slots.index(row)
        DraftCommit(self.model, self.cache.row(index), [before], logits[None], records).keep([kept])
        lengths = list(self.cache.row_lengths or [self.cache.length] * self.cache.batch_size)
        lengths[index] = before + kept
        self.cache.set_row_lengths(lengths)

    def commit_draft(self, rows: list[int], ids: torch.Tensor, where) -> "KeptDraft":
        """Commit these rows' drafted blocks ``ids`` [R, m] on the eager forward; the returned
        draft's ``keep`` then keeps each row's accepted prefix in the cache (``drafts.py``)."""
        with self.hooks.applied(), region("commit"):
            self._arrange(fast=False)
            index = None if rows == self.rows else [self.slots.index(r) for r in rows]
            cache = self.cache if index is None else self.cache.select(index)
            out = self.model.commit_draft(cache, ids, where=where)
            kind, detail = self.plan()
            self._took("eager", detail if kind == "eager" else "a drafted block's commit")
            return KeptDraft(out, None if index is None else lambda: self._write_back(index, cache))

    def _static(self, rows, ids, c: int, m: int, where, kind: str, detail, commit_logits: bool = False):
        """The static step of ``plan()``: whole (observers, if any, fired after it) or split."""
        if kind == "split":
            self._arrange(fast=True, exact=True)  # rows == slots: the live layers run on exactly the rows
            return self.graphs.split_step(ids, c, m, commit_logits, self.coreset, detail, where)
        self._arrange(fast=True)
        index = None if rows == self.slots else [self.slots.index(r) for r in rows]
        read = None
        if detail:
            lengths = self.cache.row_lengths or [self.cache.length] * self.cache.batch_size

            def read(observations):
                fire_observed(self.model, self.hooks, observations, lengths, c, index, where)
        if index is None:
            return self.graphs.step(ids, c, m, commit_logits, self.coreset, detail, read)
        at = torch.tensor(index, device=ids.device)
        full = ids.new_full((len(self.slots), c + m), self.FILL)
        full[at] = ids
        out = self.graphs.step(full, c, m, commit_logits, self.coreset, detail, read)
        return tuple(None if t is None else t[at.to(t.device)] for t in out)

    def _eager(self, rows, ids, c: int, m: int, where, commit_logits, positions, committing=None):
        """The ordinary forward over these rows: in place when they are every row of the cache,
        else (a preview of some rows) against a copy of their rows."""
        self._arrange(fast=False)
        cache, coreset, index = self.cache, self.coreset, None
        if rows != self.slots:
            index = [self.slots.index(r) for r in rows]
            cache, coreset = cache.select(index), None if coreset is None else coreset.subset(index)
        out = self.model.forward(cache, ids[:, :c] if c else None, ids[:, c:] if m else None,
                                 commit_logits=commit_logits, preview_positions=positions, coreset=coreset,
                                 where=where, commit_rows=committing)
        if index is not None and c and m:  # some rows' blocks committed (rows joined since): theirs now
            self._write_back(index, cache)
        return out

    def _write_back(self, index: list[int], part: CloverCache) -> None:
        self.cache.put(index, part)
        lengths = list(self.cache.row_lengths or [self.cache.length] * self.cache.batch_size)
        for i, n in zip(index, part.row_lengths or [part.length] * part.batch_size):
            lengths[i] = n
        self.cache.set_row_lengths(lengths)

    # ---------------------------------------------------------------- rows leave
    def drop(self, rows: list[int]) -> None:
        """These rows have finished: their slots become padding (rearranged at the next forward)."""
        self.slots = [None if r in rows else r for r in self.slots]
        if self.graphs is None and self.rows:
            self._arrange(fast=False)  # the eager path frees the rows at once

    def _arrange(self, fast: bool, exact: bool = False) -> None:
        """The cache as the next forward needs it: the static step a bucket's cache of the graphs
        (the rows first, then padding; ``exact``: no padding, for a split step), the eager forward
        exactly the rows."""
        rows = self.rows
        keep = [self.slots.index(r) for r in rows]
        if fast:
            size = len(rows) if exact else bucket(len(rows))
            if len(self.slots) == size and self.cache is self.graphs.cache:
                return
            part = self.cache if keep == list(range(self.cache.batch_size)) else self.cache.select(keep)
            self.cache = self.graphs.adopt(part, size)
            keep += keep[:1] * (size - len(rows))  # padding rows' coresets: any row's
            self.slots = rows + [None] * (size - len(rows))
        elif None in self.slots:
            self.cache = self.cache.select(keep)
            self.slots = rows
        else:
            return
        if self.coreset is not None and self.coreset.experts:
            self.coreset.keep(keep)


class Part:
    """A row's segment of a step's one forward: ``ids`` [commit + preview] on the device (its
    commit tokens, then its block), the segment positions whose logits it ``want``s, its ``kind``
    ("prefill", "preview", "commit"), whether it commits a finished block beside its preview
    (``fused``), whether its commit is a drafted block, kept up to a prefix (``draft``:
    ``Runner.keep_draft``), and ``taken(logits [len(want), V])``: what the row does with them, deciding on
    the device; it returns the (1-D tensor, reader) pairs the host reads in the step's one
    transfer, each reader taking the values of its tensor."""

    __slots__ = ("row", "ids", "commit", "preview", "want", "kind", "taken", "fused", "draft", "last")

    def __init__(self, row, ids, commit: int, preview: int, want: list[int], kind: str, taken, fused: bool = False,
                 draft: bool = False):
        self.row, self.ids, self.commit, self.preview, self.want = row, ids, commit, preview, want
        self.kind, self.taken, self.fused, self.draft = kind, taken, fused, draft
        self.last = False  # a prompt's chunk: its last


class Reader:
    """A reader of a row's values in a step's one host transfer (``Part.taken``): ``fn(values)``."""

    __slots__ = ("row", "fn")

    def __init__(self, row, fn):
        self.row, self.fn = row, fn

    def __call__(self, values):
        if self.row.live:
            return self.fn(values)


# --------------------------------------------------------------------------- which step loop holds the graphs
class FastPath:
    """An engine's StepGraphs, held by one step loop at a time (the engine's; a generation started
    inside a hook runs on a loop of its own, and takes the plain path)."""

    def __init__(self):
        self.graphs: "StepGraphs | None" = None
        self._holder = None  # weakref to the step loop holding them

    def acquire(self, owner, model, length: int, use: bool, compile: bool) -> "StepGraphs | None":
        """The StepGraphs for ``owner`` (a step loop), rows of ``length`` positions, or None for the
        plain path (``use`` False, or another loop holds them)."""
        if not use:
            return None
        holder = None if self._holder is None else self._holder()
        if holder is not None and holder is not owner and holder.runner is not None:
            return None
        self._holder = weakref.ref(owner)
        g = self.graphs
        if (g is None or not g.fits(length) or (g.device, g.dtype) != (model.device, model.dtype)
                or g.compile != compile):
            size = max(1024, 1 << (length - 1).bit_length())  # a power of two: few re-allocations
            size = min(size, model.config.max_position_embeddings)
            self.graphs = None  # free the old cache and graphs first
            self.graphs = StepGraphs(model, size, compile=compile)
        return self.graphs

    @property
    def held(self) -> bool:
        """Whether rows (of requests not cancelled) run on the graphs now (a stream left open)."""
        holder = None if self._holder is None else self._holder()
        return holder is not None and holder.runner is not None and holder.runner.graphs is not None and holder.busy

    def release(self, owner) -> None:
        """``owner``'s rows have all left: the graphs are free for the next loop."""
        if self._holder is not None and self._holder() is owner:
            self._holder = None


class KeptDraft:
    """A committed draft (``drafts.DraftCommit``) of some rows, committed on a copy of their cache
    rows: keeping the accepted prefixes writes them back."""

    def __init__(self, draft, write_back=None):
        self.draft, self.logits, self.write_back = draft, draft.logits, write_back

    def keep(self, lengths: list[int]) -> None:
        self.draft.keep(lengths)
        if self.write_back is not None:
            self.write_back()


def region(name: str):
    """A forward's named region in torch.profiler's traces (``clover_lab.<name>``) while a profiler
    runs; otherwise nothing (a record_function costs ~17 us even then)."""
    return torch.profiler.record_function(f"clover_lab.{name}") if torch._C._autograd._profiler_enabled() else NO_REGION


NO_REGION = contextlib.nullcontext()


def allocation_error(model, length: int, rows: int, e: BaseException) -> GenerationError:
    """A cache of ``rows`` x ``length`` positions could not be allocated: what it needed, where."""
    what = f"{length} positions" if rows == 1 else f"{rows} rows x {length} positions"
    return GenerationError(f"cannot allocate a cache of {what} "
                           f"({cache_bytes(model.config, length, rows, dtype=model.dtype) / 2**30:.2f} GiB) "
                           f"on {model.device}: {e}")

