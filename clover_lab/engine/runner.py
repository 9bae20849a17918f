"""The runner: the only caller of the model during a generation. It owns the generation's cache,
whose batch rows (``slots``) hold the request rows still going, and runs the prefill, the
previews and the commits the loops ask for, picking per step the static step (``graphs.py``: a
CUDA graph on CUDA, compiled or eager static steps on a CPU) or the eager forward.

A single prompt is a batch of one. On the static path the cache has a bucket of rows (1, 2, 4,
8, ...): rows that leave become padding (filler ids, never read) until the rows left fit a
smaller bucket, and then move into that bucket's cache; so rows finishing one by one do not
compile or capture a step per row count. The eager forward runs on the rows exactly: a row
whose block is done sits out the others' previews (they preview against a copy of their own
cache rows), and a padded cache is compacted before it. Every forward runs inside
``hooks.applied()``, so that the model's events see the generation's hooks, and inside a named
region of torch.profiler's traces (``clover_lab.prefill``, ``.preview``, ``.commit``): a profile
of a generation tells the steps' time from the loop's (``bench/bench_batch_bound.py``).
"""
from __future__ import annotations

import contextlib

import torch

from clover_lab.engine.graphs import bucket
from clover_lab.engine.observed import describe, fire_observed, live_layers, observed_points
from clover_lab.engine.requests import GenerationError
from clover_lab.model.cache import CloverCache, cache_bytes
from clover_lab.model.context import Coreset


class Runner:
    FILL = 0  # the token id padding rows carry

    def __init__(self, engine, run, length: int, rows: int):
        model = engine.model
        self.model, self.hooks = model, run.hooks
        self.coreset: Coreset | None = None
        self.off = engine.fast_path_off()  # why this generation has no fast path, or None
        self.paths: dict[str, int] = {}  # which path the forwards after the prefill took -> how many
        try:
            self.graphs = engine.fast_path.acquire(run, model, length, self.off is None,
                                                    engine.compile_steps and model.device.type != "cuda")
            if self.graphs is None and self.off is None:
                self.off = "another generation holds the fast path (a stream left open?)"
            if self.graphs is not None:
                self.cache = self.graphs.reset(bucket(rows))
            else:
                self.cache = model.new_cache(length, rows)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            raise allocation_error(model, length, rows, e) from e
        self.slots: list[int | None] = list(range(rows)) + [None] * (self.cache.batch_size - rows)

    @property
    def rows(self) -> list[int]:
        """The request rows still going, in the cache's order."""
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

    def path(self) -> str | None:
        """Which path the forwards took, and why the eager forward where it ran: "compiled",
        "eager: a hook on layers.2.moe.route", or each with its count when they changed."""
        if len(self.paths) <= 1:
            return next(iter(self.paths), None)
        return "; ".join(f"{label} ({n} forwards)" for label, n in self.paths.items())

    def _took(self, kind: str, detail) -> None:
        if kind == "eager":
            label = "eager: " + detail
        elif kind == "split":
            layers = ", ".join(map(str, detail))
            label = (f"{self.graphs.last}, layer{'s' * (len(detail) > 1)} {layers} eager: a hook on "
                     f"{describe(self.hooks.model_points())}")
        else:
            label = self.graphs.last + (f" (observers read after each step: {describe(sorted(detail))})"
                                        if detail else "")
        self.paths[label] = self.paths.get(label, 0) + 1

    def new_coreset(self, size: int | None) -> Coreset | None:
        """The generation's expert coreset (on the fast path, the one whose buffers its steps share)."""
        if not size:
            return None
        self.coreset = self.graphs.coreset(size) if self.graphs is not None else Coreset(size)
        return self.coreset

    def row_cache(self, row: int) -> CloverCache:
        """Row ``row``'s part of the cache, as a cache of its own (a copy: the error path inspects it)."""
        return self.cache.select([self.slots.index(row)])

    # ---------------------------------------------------------------- forwards
    def prefill(self, prompts: dict[int, list[int]], chunk: int, logits: str | None, where, timed,
                join: bool = False) -> dict:
        """Every row's prompt into its row of the cache, the prompts of one length in one forward
        (no padding inside the model). ``where(rows)`` and ``timed(rows)`` give each forward's
        place and clock. Returns row -> last-position logits [V] when ``logits`` is "last".
        ``join``: these are new rows, joining the rows going on (the cache grows by them)."""
        lengths = self._grow(list(prompts)) if join else [0] * len(self.slots)
        groups: dict[int, list[int]] = {}
        for r, ids in prompts.items():
            groups.setdefault(len(ids), []).append(r)
        outs = {}
        for rows in groups.values():
            index = [self.slots.index(r) for r in rows]
            if len(rows) == self.cache.batch_size:
                cache = self.cache
            elif len(rows) == 1:
                cache = self.cache.row(index[0])  # views: the commit lands in this cache
            else:
                cache = self.model.new_cache(self.cache.max_len, len(rows))
            with timed(rows), self.hooks.applied(), region("prefill"):
                out = self.model.prefill(cache, [prompts[r] for r in rows], chunk_size=chunk, logits=logits,
                                         where=where(rows))
            if 1 < len(rows) < self.cache.batch_size:
                self.cache.put(index, cache)
            if out is not None:
                outs.update(zip(rows, out[:, -1]))
        self.cache.set_row_lengths([len(prompts[r]) if r in prompts else n for r, n in zip(self.slots, lengths)])
        return outs

    def _grow(self, rows: list[int]) -> list[int]:
        """A cache of the rows going on plus ``rows`` (empty, after them); returns its row lengths.
        The static path adopts it into its bucket at the next step."""
        going = self.rows
        keep = [self.slots.index(r) for r in going]
        old = self.cache
        lengths = [(old.row_lengths or [old.length] * old.batch_size)[i] for i in keep] + [0] * len(rows)
        self.cache = self.model.new_cache(old.max_len, len(going) + len(rows))
        if going:
            self.cache.put(list(range(len(going))), old if keep == list(range(old.batch_size)) else old.select(keep))
        self.slots = going + rows
        return lengths

    def preview(self, rows: list[int], canvas: torch.Tensor, where, pending: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Preview logits [R, m, V] of these rows' blocks ``canvas`` [R, m], after committing
        ``pending`` [R, c] (each row's previous block: every row then) in the same forward.
        ``positions``: one row's block positions whose logits are wanted ([1, N, V]). Some rows
        only commit too when rows joined since (they have no finished block): eagerly, on a copy
        of their rows written back."""
        c = 0 if pending is None else pending.shape[1]
        ids = canvas if pending is None else torch.cat([pending, canvas], dim=1)
        with self.hooks.applied(), region("preview"):
            kind, detail = self.plan()
            if kind != "eager" and rows != self.rows:
                if c:  # a static step commits every row of its cache
                    kind, detail = "eager", "a fused commit of some rows (rows joined since)"
                elif kind == "split":  # a live hook sees exactly the rows the forward runs
                    kind, detail = "eager", f"a hook on {describe(self.hooks.model_points())} (a preview of some rows)"
            if kind != "eager":
                logits = self._static(rows, ids, c, canvas.shape[1], where, kind, detail)[1]
                self._took(kind, detail)
                return logits if positions is None else logits[:, positions]
            logits = self._eager(rows, ids, c, canvas.shape[1], where, None, positions).preview_logits
            self._took(kind, detail)
            return logits

    def commit(self, rows: list[int], ids: torch.Tensor, where, logits: str | None = None) -> torch.Tensor | None:
        """Commit ``ids`` [R, c] (a token or a block per row); the last row's logits [R, 1, V] when
        ``logits`` is "last" (the static AR step always gives them). Every row: in place; some rows
        only (their last block, as they leave): on a copy of their rows, the others' untouched."""
        with self.hooks.applied(), region("commit"):
            if rows != self.rows:
                index = [self.slots.index(r) for r in rows]
                return self.model.commit(self.cache.select(index), ids, logits=logits, where=where)
            kind, detail = self.plan()
            if ids.shape[1] == 1 and kind != "eager":
                out = self._static(rows, ids, 1, 0, where, kind, detail, commit_logits=True)[0]
                self._took(kind, detail)
                return out
            out = self._eager(rows, ids, ids.shape[1], 0, where, logits, None).commit_logits
            if ids.shape[1] == 1 or self.graphs is None:  # a block's own commit is eager by design
                self._took(kind, detail)
            return out

    def commit_draft(self, rows: list[int], ids: torch.Tensor, where):
        """Commit every row's drafted block ``ids`` [R, m] on the eager forward; the
        ``DraftCommit`` then keeps each row's accepted prefix in the cache (``drafts.py``)."""
        if rows != self.rows:
            raise ValueError(f"commit_draft: every row commits its draft together ({self.rows}), got {rows}")
        with self.hooks.applied(), region("commit"):
            self._arrange(fast=False)
            out = self.model.commit_draft(self.cache, ids, where=where)
            kind, detail = self.plan()
            self._took("eager", detail if kind == "eager" else "a drafted block's commit")
            return out

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

    def _eager(self, rows, ids, c: int, m: int, where, commit_logits, positions):
        """The ordinary forward over these rows: in place when they are every row of the cache,
        else (a preview of some rows) against a copy of their rows."""
        self._arrange(fast=False)
        cache, coreset, index = self.cache, self.coreset, None
        if rows != self.slots:
            index = [self.slots.index(r) for r in rows]
            cache, coreset = cache.select(index), None if coreset is None else coreset.subset(index)
        out = self.model.forward(cache, ids[:, :c] if c else None, ids[:, c:] if m else None,
                                 commit_logits=commit_logits, preview_positions=positions, coreset=coreset,
                                 where=where)
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

