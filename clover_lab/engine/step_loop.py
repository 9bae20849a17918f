"""The step loop: the one place where generation happens. ``Engine.submit`` queues a request's
rows; each :meth:`StepLoop.step`

1. ends the rows of cancelled requests (stop reason "cancelled", their partial results intact);
2. admits queued rows while there is room, prefilling their prompts (at an idle engine: a forward
   per prompt length; beside decoding rows: in the step's forward, a chunk a step; a prompt the
   prefix cache serves or keeps, ``model/prefix_cache.py``: its cached positions restored, the
   rest in parts that end where a GDN snapshot is taken);
3. on the eager forward with no hook inside the model, runs the step as schedule -> run -> take
   (:meth:`StepLoop._step_packed`): every row's decoder (``diffusion.py``, ``ar.py``,
   ``speculative.py``) gives its segment, the runner (``runner.py``) runs them all as ONE
   forward, each row decides on the device and the host reads every decision in one transfer;
   elsewhere (the static steps, a hook inside the model, a coreset, mtp rows) it groups the
   rows into cohorts, rows that may share a forward (the same hooks; with a hook inside the
   model, the same request), and hands each cohort's rows of each mode to that mode's decoder,
   which asks the runner for its forwards through :meth:`StepLoop.forward`;
4. returns the step's updates (also handed to each request's handle).

Rows join and leave at any step; rows with different settings (mode, sampler, policy, length,
stop strings) share forwards wherever their forward kind and shape agree, and each row's tokens
are the ones it gives alone. A request with an expert coreset runs alone (its coreset's experts
are shared by the rows of a block). An error ends the requests whose rows it concerns, and the
loop goes on with the others (a listener's or a row's hook's error ends its own request only,
even among rows that shared its forward); the runner's cache is dropped when the last row has left.

One loop per engine (``engine.loop``): a request submitted from a listener or a hook joins it at
the next step; one *waited for* inside a hook (a nested ``generate``) gets a loop of its own.

(One concept in a little over 600 lines: what a step does with its rows, admission, prefill and the
prefix cache's use included, is one schedule; split, each part would reach into the others' state.)
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from contextlib import contextmanager, nullcontext

import torch

from clover_lab.engine import ar, diffusion, mtp, speculative
from clover_lab.engine.row import Handle, Row
from clover_lab.engine.runner import Part, Runner
from clover_lab.hooks.events import Where
from clover_lab.hooks.registry import StopGeneration

DECODERS = {"diffusion": diffusion, "ar": ar, "speculative": speculative, "mtp": mtp}
PACKED = ("diffusion", "ar", "speculative")  # the modes whose rows share a step's one packed forward (``StepLoop._step_packed``)



class StepLoop:
    def __init__(self, engine):
        self.engine = engine
        self.queue: deque[Row] = deque()  # rows waiting for room, oldest first
        self.rows: list[Row] = []  # the rows going on, in the order they were admitted
        self.runner: Runner | None = None
        self.heads = None  # the MTP head's cache of the mtp rows (``mtp.HeadCache``), beside the runner's
        self.max_rows = 64  # rows going on at once (the server sets its --max-batch)
        self.capacity = 0  # positions per row the runner's cache holds at least (the server's)
        self.in_step = False  # diffusion rows begin their blocks together even where not needed (a comparison)
        self.packed = True  # False: each mode's rows and each prompt take forwards of their own (a comparison)
        # prompt positions prefilled per step while other rows decode (None: every prompt whole at once)
        self.prefill_budget: int | None = 512
        self.filling: dict[int, int] = {}  # row key -> positions of its prompt in the cache, while partly
        self.forwards = 0  # forwards run after the prefills, every request's together
        self.steps = 0  # steps taken
        self._keys = itertools.count()
        self._lock = threading.RLock()
        self._stepping: threading.Thread | None = None
        self.produced: list | None = None  # the updates of the step running now (Handle.put adds them)

    @property
    def busy(self) -> bool:
        """Whether rows of requests not cancelled are queued or going on."""
        return any(not row.handle.cancelled for row in itertools.chain(self.queue, self.rows))

    @property
    def idle(self) -> bool:
        """No row queued or going on (cancelled ones included: a step ends them)."""
        return not (self.queue or self.rows)

    def stepping_here(self) -> bool:
        """Whether this thread is inside :meth:`step` (a hook generating: a nested generation)."""
        return self._stepping is threading.current_thread()

    def submit(self, handle: Handle) -> None:
        with self._lock:
            self.queue.extend(handle.rows)

    # ---------------------------------------------------------------- one step
    def step(self) -> list:
        """One scheduler step; returns the updates it produced (of requests that stream)."""
        with self._lock:
            self._stepping, self.produced = threading.current_thread(), []
            self.steps += 1
            try:
                self._cancel()
                self._admit()
                packed = self._packs()
                if packed:
                    self._step_packed()
                else:
                    self._fill()
                for cohort in self._cohorts():
                    for mode, decoder in DECODERS.items():
                        rows = [row for row in cohort if row.mode == mode and row.live]
                        if rows and not (packed and mode in PACKED):
                            self._advance(decoder, rows)
                self._leave_failed()
                self._release()
                return self.produced
            finally:
                self._stepping, self.produced = None, None

    # ---------------------------------------------------------------- one forward: schedule -> run -> take
    def _packs(self) -> bool:
        """Whether this step's rows run in one packed forward (``_step_packed``): on the eager forward
        (a static step has a layout of its own), with no hook inside the model on any row (its
        events name one request, block and step), no expert coreset and rows not kept in step."""
        runner = self.runner
        if (runner is None or runner.graphs is not None or runner.coreset is not None or self.in_step
                or not self.packed):
            return False
        return not any(row.hooks.model_hooks_attached() for row in self.rows if row.live)

    def _step_packed(self) -> None:
        """A step as schedule -> run -> take: each row gives its segment for this step (a prompt's
        chunk, a diffusion row's preview, fused commit+preview or last commit, an AR token, a
        speculative row's draft pass or verify: ``diffusion.schedule``, ``ar.schedule``,
        ``speculative.schedule``), the runner runs them as ONE forward (``Runner.run``), and each
        part takes its row's logits, deciding on the device; the host reads every row's decision
        in one transfer, then each row takes its values (``_run``). mtp rows still take forwards
        of their own (``step``)."""
        parts: list[Part] = []
        for row in [r for r in self.rows if r.key in self.filling and r.live]:
            parts += self._fill_part(row, (self.prefill_budget or len(row.prompt_ids)) - sum(p.commit for p in parts))
        # a diffusion row whose prompt ends in this step begins its first block in the same segment
        first = {p.row.key: p for p in parts if p.row.mode == "diffusion" and p.last}
        for mode in PACKED:
            rows = [row for row in self.rows if row.mode == mode and row.live
                    and (row.key not in self.filling or row.key in first)]
            if rows:
                try:
                    parts += DECODERS[mode].schedule(self, rows)
                except BaseException as e:
                    self.fail({row.handle for row in rows}, e)
                    if not isinstance(e, Exception):
                        raise
        if first:
            begun = {p.row.key: p for p in parts if p.row.key in first and p.kind != "prefill"}
            parts = [after_prompt(p, begun[p.row.key]) if p.kind == "prefill" and p.row.key in begun else p
                     for p in parts if p.kind == "prefill" or p.row.key not in begun]
        parts = [part for part in parts if part.row.live]
        if parts:
            self._run(parts)
        for mode in PACKED:
            rows = [row for row in self.rows if row.mode == mode and row.live and row.key not in self.filling]
            if rows:
                self._guarded(rows, DECODERS[mode].finish, self, rows)

    def _fill_part(self, row: Row, left: int) -> list["Part"]:
        """Chunked prefill in a packed step: the next chunk of a prompt being prefilled beside
        decoding rows, within the positions of this step's budget ``left`` (and
        ``prefill_chunk_size``); its row decodes from the step after its last chunk."""
        if left <= 0:
            return []
        done, look = self.filling[row.key], row.prefix
        end = min([done + min(left, self.engine.prefill_chunk_size), len(row.prompt_ids)]
                  + ([s for s in look.stops if s > done] if look else []))  # a chunk ends at a GDN snapshot
        ids = row.prompt_ids[done:end]
        last = end == len(row.prompt_ids)
        want = [len(ids) - 1] if last and row.mode != "diffusion" else []

        def taken(logits):
            row.stats.prefill_forwards += 1
            if look is not None:
                self._keep_prefix(row, end, last)
            if not last:
                self.filling[row.key] = end
                return []
            del self.filling[row.key]
            row.prefix = None
            self._prefilled([row], logits if want else None, score=False)
            return []
        part = Part(row, torch.tensor(ids, device=row.device), len(ids), 0, want, "prefill", taken)
        part.last = last
        return [part]

    def _run(self, parts: list["Part"]) -> None:
        """The step's one forward over ``parts``, then each part takes its logits, the host reads
        every decision in one transfer, and each part's reader takes its values. An error in the
        forward fails every request in it; an error taking a row's values fails its request."""
        rows = [part.row for part in parts]
        try:
            with self.forward({p.row.key: p.kind for p in parts}, rows, fused={p.row.key for p in parts if p.fused}):
                logits = self.runner.use(rows[0].hooks).run(parts)
        except BaseException as e:
            self.fail({row.handle for row in rows}, e)
            if not isinstance(e, Exception):
                raise
            return
        reads = []
        for part, mine in zip(parts, logits):
            if part.row.live:  # (a row's error ended its request's other rows)
                reads += self._guarded([part.row], part.taken, mine) or []
        if not reads:
            return
        values = torch.cat([t for t, _ in reads]).tolist()  # the step's one host transfer
        at = 0
        for t, back in reads:
            n, at = t.shape[0], at + t.shape[0]
            self._guarded(None, back, values[at - n:at])

    def _guarded(self, rows, fn, *args):
        """``fn(*args)``; an error fails the requests of ``rows`` (None: of the row ``fn`` reads for,
        ``fn.row``) and the step goes on with the others."""
        try:
            return fn(*args)
        except BaseException as e:
            handles = {row.handle for row in rows} if rows is not None else {fn.row.handle}
            self.fail(handles, e)
            if not isinstance(e, Exception):
                raise
            return None

    def _advance(self, decoder, rows: list[Row]) -> None:
        """One step of a cohort's rows of one mode; a model hook's StopGeneration ends their
        requests' rows (``decoder.abandon``), an error fails their requests."""
        try:
            decoder.advance(self, rows)
        except StopGeneration:
            decoder.abandon(self, [row for row in self.rows if row.live and row.handle in {r.handle for r in rows}])
        except BaseException as e:
            self.fail({row.handle for row in rows}, e)
            if not isinstance(e, Exception):  # an interrupt reaches whoever steps
                raise

    def _cohorts(self) -> list[list[Row]]:
        """The rows going on, by what lets them share a forward: the hooks that apply to them,
        and, with a hook inside the model (whose events name one request), the request."""
        cohorts: dict[tuple, list[Row]] = {}
        for row in self.rows:
            if row.live and row.key not in self.filling:  # a prompt partly prefilled: not decoding yet
                hooks = row.hooks
                alone = row.handle.number if hooks.model_hooks_attached() else None
                cohorts.setdefault((hooks.scopes, alone), []).append(row)
        return list(cohorts.values())

    # ---------------------------------------------------------------- rows arrive
    def _admit(self) -> None:
        """Queued rows join while there is room (``max_rows``): a coreset request only into an idle
        loop, and alone; the runner's cache grows by them."""
        new: list[Row] = []
        while self.queue:
            row = self.queue[0]
            if row.handle.error is not None:  # its request failed: its rows are gone
                self.queue.popleft()
                continue
            if row.handle.cancelled or not self._room(row, self.rows + new):  # a cancelled one: the next step ends it
                break
                break
            new.append(self.queue.popleft())
        if not new:
            return
        for row in new:
            row.key, row.loop = next(self._keys), self
        keys = [row.key for row in new]
        if self.runner is None:
            length = max(max(len(r.prompt_ids) + r.max_new for r in new), self.capacity)
            length = min(length, self.engine.model.config.max_position_embeddings)
            coreset = next((r.s.coreset_size for r in new if alone(r)), None)
            try:
                self.runner = Runner(self.engine, self, length, keys, coreset)
            except BaseException as e:
                self.fail({row.handle for row in new}, e)
                if not isinstance(e, Exception):
                    raise
                return
        else:
            try:  # the cache grows by the new rows (and to the longest of them)
                self.runner.add(keys, max(len(r.prompt_ids) + r.max_new for r in new))
            except BaseException as e:
                self.fail({row.handle for row in new}, e)
                if not isinstance(e, Exception):
                    raise
                return
        decoding = [row for row in self.rows if row.key not in self.filling]
        self.rows += new
        budget = self.prefill_budget
        packs = bool(decoding) and self._packs()  # beside decoding rows, in this step's one forward
        groups: dict[tuple, list[Row]] = {}
        for row in new:
            if row.handle.error is not None:  # another row of its request failed in its prefill just now
                continue
            use = self._prefix_use(row)
            # (not rows scoring their prompt, nor mtp rows: their head reads the whole prompt's trunk states)
            if (decoding and (packs or (budget and len(row.prompt_ids) > budget)) and row.prompt_logprobs is None
                    and row.mode != "mtp"):
                # beside decoding rows: a chunk a step (``_fill``, ``_fill_part``), after its cached positions
                try:
                    self.filling[row.key] = 0 if use is None or self._look(row, *use) is None else self._restore(row)
                except Exception as e:
                    row.prefix = None
                    self.fail({row.handle}, e)
                    continue
                if self.filling[row.key] == len(row.prompt_ids):  # a diffusion row's whole prompt came from the cache
                    del self.filling[row.key]
                    row.prefix = None
                    self._prefilled([row], None, score=False)
                continue
            if use is not None and self._look(row, *use) is not None:
                self._prefill_cached(row)  # now: a row admitted after it finds what it added
                continue
            groups.setdefault((row.hooks.scopes, len(row.prompt_ids), row.prompt_logprobs is not None), []).append(row)
        for rows in groups.values():
            self._prefill(rows)

    def _fill(self) -> None:
        """Chunked prefill: the prompts being prefilled beside decoding rows take ``prefill_budget``
        positions of this step between them, oldest first; a row whose prompt is complete decodes
        from the next step on (its next-token logits kept as a whole prefill keeps them)."""
        left = self.prefill_budget or 0
        for row in [r for r in self.rows if r.key in self.filling]:
            if left <= 0:
                return
            done, look = self.filling[row.key], row.prefix
            end = min([done + left, len(row.prompt_ids)] + ([s for s in look.stops if s > done] if look else []))
            ids = row.prompt_ids[done:end]
            last = end == len(row.prompt_ids)
            cached = 0 if look is None else look.cached
            try:
                with self.forward("prefill", [row]):
                    logits = self.runner.use(row.hooks).prefill_part(
                        row.key, done, ids, self.engine.prefill_chunk_size,
                        "last" if last and row.mode != "diffusion" else None,
                        self.where([row], "prefill", cached=cached))
                    if look is not None:
                        self._keep_prefix(row, end, last)
            except StopGeneration:
                self.filling.pop(row.key, None)
                row.prefix = None
                self.end([row], "hook", cache_complete=False)
                continue
            except BaseException as e:
                self.filling.pop(row.key, None)
                row.prefix = None
                self.fail({row.handle}, e)
                if not isinstance(e, Exception):
                    raise
                continue
            left -= len(ids)
            row.stats.prefill_forwards += -(-len(ids) // self.engine.prefill_chunk_size)
            if not last:
                self.filling[row.key] = end
                continue
            del self.filling[row.key]
            row.prefix = None
            self._prefilled([row], None if logits is None else logits[None], score=False)

    # ---------------------------------------------------------------- the prefix cache
    def _prefix_use(self, row: Row) -> tuple[bool, bool] | None:
        """Whether ``row`` reads the engine's prefix cache and adds its prompt to it (read, write),
        or None: neither. Not rows whose prompt is scored (every position's logits are wanted) nor
        mtp rows (their head reads every trunk state of the prompt); a request with a hook inside
        the model reads it only where it asks (``skip_reading_prefix_cache=False``: its hooks see
        the positions that run) and never adds to it (its hooks may change the states)."""
        if not self.engine.prefix_cache.on or row.prompt_logprobs is not None or row.mode == "mtp":
            return None
        if row.hooks.model_hooks_attached():
            return (True, False) if row.skip_reading_prefix_cache is False else None
        return not row.skip_reading_prefix_cache, True

    def _look(self, row: Row, read: bool, write: bool):
        """``row``'s prompt looked up in the prefix cache: ``row.prefix`` (returned), None where
        the cache does nothing for it (no whole block to read or add)."""
        row.prefix = self.engine.prefix_cache.lookup(self.engine.model, row.prompt_ids, read, write,
                                                     last_logits=row.mode != "diffusion")
        return row.prefix

    def _restore(self, row: Row) -> int:
        """``row``'s cached positions (``row.prefix``) into its cache row; returns how many."""
        if row.prefix is None:
            return 0
        self.runner.restore(row.key, self.engine.prefix_cache, row.prefix)
        row.stats.cached_positions = row.prefix.cached
        return row.prefix.cached

    def _keep_prefix(self, row: Row, end: int, last: bool) -> None:
        """``row``'s prompt is prefilled up to ``end``: the GDN snapshot its lookup stops there
        for, and once it is ``last``, its whole blocks into the prefix cache."""
        prefix, look = self.engine.prefix_cache, row.prefix
        if end in look.stops:
            prefix.snapshot(look, self.runner.row_view(row.key), end)
        if last:
            prefix.insert(look, self.runner.row_view(row.key))

    def _prefill_cached(self, row: Row) -> None:
        """``row``'s prompt through the prefix cache (``row.prefix``), alone: its cached positions
        restored, the rest prefilled in parts that end where its lookup takes a GDN snapshot, its
        whole blocks added at the end."""
        chunk, ids = self.engine.prefill_chunk_size, row.prompt_ids
        logits, forwards, segments = None, 0, row.prefix.segments()  # none: the whole prompt is cached
        try:
            with self.forward("prefill", [row]) if segments else nullcontext():
                where = self.where([row], "prefill", cached=self._restore(row))
                for start, end in segments:
                    logits = self.runner.use(row.hooks).prefill_part(
                        row.key, start, ids[start:end], chunk,
                        "last" if end == len(ids) and row.mode != "diffusion" else None, where)
                    forwards += -(-(end - start) // chunk)
                    self._keep_prefix(row, end, end == len(ids))
        except StopGeneration:  # a model hook stopped a prompt's prefill: no tokens, the prompt half cached
            self.end([row], "hook", cache_complete=False)
            return
        except BaseException as e:
            self.fail({row.handle}, e)
            if not isinstance(e, Exception):
                raise
            return
        finally:
            row.prefix = None
        row.stats.prefill_forwards = forwards
        self._prefilled([row], None if logits is None else logits[None], score=False)

    def _room(self, row: Row, going: list[Row]) -> bool:
        """Whether ``row`` may join ``going``: within ``max_rows``; a request with a coreset only
        into an idle loop, and nothing beside it but its own rows."""
        if not going:
            return True
        if len(going) >= self.max_rows:
            return False
        if alone(row) or any(alone(r) for r in going):
            return {r.handle for r in going} == {row.handle}
        return True

    def _prefill(self, rows: list[Row]) -> None:
        """These rows' prompts (of one length) into the cache, in one forward (or one per chunk of
        ``prefill_chunk_size``); rows that decode from the prompt's next-token logits keep them."""
        chunk = self.engine.prefill_chunk_size
        score = rows[0].prompt_logprobs is not None  # the group's rows agree
        want = "all" if score else "last" if any(row.mode != "diffusion" for row in rows) else None
        try:
            keep = mtp.prefill(self, rows) if any(r.mode == "mtp" for r in rows) else nullcontext()
            with self.forward("prefill", rows), keep:  # mtp rows keep the trunk's states
                logits = self.runner.use(rows[0].hooks).prefill(
                    [r.key for r in rows], [r.prompt_ids for r in rows], chunk, want, self.where(rows, "prefill"))
        except StopGeneration:  # a model hook stopped a prompt's prefill: no tokens, the prompt half cached
            self.end(rows, "hook", cache_complete=False)
            return
        except BaseException as e:
            self.fail({row.handle for row in rows}, e)
            if not isinstance(e, Exception):
                raise
            return
        for row in rows:
            row.stats.prefill_forwards = -(-len(rows[0].prompt_ids) // chunk)
        self._prefilled(rows, logits, score)

    def _prefilled(self, rows: list[Row], logits, score: bool) -> None:
        """These rows' prompts are in the cache (``logits``: what the prefill gave, [R, V] or, to
        score the prompt, [R, T, V]): they decode from the next step (a prompt and nothing to
        generate ends here)."""
        last = logits[:, -1] if score else logits  # [R, V]: the logits at each row's next position
        if self.engine.model.device.type == "cuda":  # decode time starts after the prefill really ended
            torch.cuda.synchronize(self.engine.model.device)
        now = time.perf_counter()
        for i, row in enumerate(rows):
            row.t_decode = now
            if row.handle.t_decode is None:
                row.handle.t_decode = now
            if score:
                row.prompt_scores = prompt_scores(row, logits[i])
            if last is not None and row.mode != "diffusion":
                row.logits = last[i]
        self.end([row for row in rows if row.max_new == 0], "length")  # a prompt scored, no response asked

    # ---------------------------------------------------------------- forwards, timed and counted
    @contextmanager
    def forward(self, kind: str | dict, rows: list[Row], fused: bool | set = False):
        """One forward of ``kind`` ("prefill", "preview", "commit"; or, a packed step, a dict row
        key -> its part's kind) over ``rows``: its time goes to each row and request; a forward
        that succeeded counts for them, with the path it took. ``fused``: the preview commits
        every row's finished block too, or the keys of the rows whose it commits."""
        kinds = kind if isinstance(kind, dict) else dict.fromkeys((row.key for row in rows), kind)
        handles = list(dict.fromkeys(row.handle for row in rows))
        first = {}
        for row in rows:
            first.setdefault(row.handle, kinds[row.key])
        clocks = [(h.clock, first[h]) for h in handles] + [(row.clock, kinds[row.key]) for row in rows]
        for c, k in clocks:
            c.start(k)
        try:
            yield
        finally:
            for c, _ in clocks:
                c.stop()
        label = self.runner.last
        def fuses(row: Row) -> bool:
            return fused is True or (bool(fused) and row.key in fused)

        for h in handles:
            h.took("fused" if any(fuses(row) for row in rows if row.handle is h) else first[h], label)
        if all(k == "prefill" for k in kinds.values()):
            return
        self.forwards += 1
        for row in rows:
            st = row.stats
            if kinds[row.key] == "prefill":
                continue
            if kinds[row.key] == "preview":
                st.preview_forwards += 1
                st.fused_forwards += fuses(row)
            else:
                st.commit_forwards += 1
            if label is not None:
                row.paths[label] = row.paths.get(label, 0) + 1

    def where(self, rows: list[Row], phase: str, block: int | None = None, step: int | None = None,
              commit_block: int | None = None, cached: int = 0) -> Where:
        """Where a forward of ``rows`` stands: their request's number and, in a batch, their rows
        (rows of several requests share a forward only where no event inside the model names it);
        ``cached``: a prefill's prompt positions that came from the prefix cache."""
        handle = rows[0].handle
        one = all(row.handle is handle for row in rows)
        return Where(handle.number, phase, block, step, commit_block,
                     tuple(row.index for row in rows) if one and handle.batched else None, cached)

    # ---------------------------------------------------------------- rows leave
    def end(self, rows: list[Row], reason: str | dict, cache_complete: bool = True) -> None:
        """These rows are done: their results (a "done" update each), and out of the cache."""
        rows = [row for row in rows if row.live]
        for row in rows:
            if not cache_complete:
                row.stats.cache_complete = False
            row.finish(reason if isinstance(reason, str) else reason[row.key])
            row.update("done", row.stats.blocks, None)
        self._drop(rows)
        for handle in dict.fromkeys(row.handle for row in rows):
            handle.row_ended()

    def fail(self, handles, error: BaseException) -> None:
        """These requests end with ``error``: their rows leave, queued or going on."""
        for handle in handles:
            handle.fail(error)
        self.queue = deque(row for row in self.queue if row.handle not in handles)
        self._drop([row for row in self.rows if row.handle in handles])

    def _leave_failed(self) -> None:
        """Requests that failed on their own during the step (a listener or a row's hook raised)
        leave the loop, queued rows and running ones: the others went on."""
        failed = {row.handle for row in itertools.chain(self.queue, self.rows) if row.handle.error is not None}
        if failed:
            self.fail(failed, None)

    def _drop(self, rows: list[Row]) -> None:
        gone = {row.key for row in rows}
        if not gone:
            return
        for key in gone:
            self.filling.pop(key, None)
        self.rows = [row for row in self.rows if row.key not in gone]
        if self.runner is not None:
            self.runner.drop([k for k in gone if k in self.runner.slots])

    def _cancel(self) -> None:
        """Rows of cancelled requests end here, at a step boundary: a queued one with no tokens; a
        finished block waiting for its fused commit is part of its row's response."""
        queued = [row for row in self.queue if row.handle.cancelled and row.handle.error is None]
        if queued:
            self.queue = deque(row for row in self.queue if row not in queued)
            for row in queued:
                row.finish("cancelled")
                row.update("done", 0, None)
            for handle in dict.fromkeys(row.handle for row in queued):
                handle.row_ended()
        going = [row for row in self.rows if row.handle.cancelled and row.live]
        for row in going:
            row.keep_pending()
        self.end(going, "cancelled")

    def _release(self) -> None:
        """The last row has left: the cache goes (and the fast path's graphs are free)."""
        if not self.rows and self.runner is not None:
            self.runner = self.heads = None
            self.engine.fast_path.release(self)


def after_prompt(prompt: Part, part: Part) -> Part:
    """A diffusion row's last prompt chunk and its first block's preview as one segment: the
    prompt committed, the block previewed after it (a fused commit+preview)."""
    def taken(logits):
        prompt.taken(None)
        return part.taken(logits)
    return Part(part.row, torch.cat([prompt.ids, part.ids]), prompt.commit + part.commit, part.preview,
                [prompt.commit + j for j in part.want], part.kind, taken, fused=False)


def alone(row: Row) -> bool:
    """A block-diffusion row with an expert coreset: its request runs alone (the coreset is one
    set of experts per block for the rows of the step)."""
    return row.mode == "diffusion" and bool(row.s.coreset_size)


def prompt_scores(row: Row, logits: torch.Tensor) -> tuple[list, list | None]:
    """Each prompt token's log-probability under the prompt before it (the first has none) and,
    with ``prompt_logprobs`` k > 0, the k most probable alternatives' (``logits`` [T, V])."""
    logp = logits[:-1].float().log_softmax(-1)
    ids = torch.tensor(row.prompt_ids[1:], device=logp.device)
    lp = logp.gather(-1, ids[:, None])[:, 0].tolist()
    top = None
    if row.prompt_logprobs:
        best = logp.topk(min(row.prompt_logprobs, logp.shape[-1]), dim=-1)
        top = [None] + [list(zip(i, v)) for i, v in zip(best.indices.tolist(), best.values.tolist())]
    return [None] + lp, top
