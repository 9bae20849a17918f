"""The server's side of the engine: one worker thread steps the engine (``Engine.step``: the
engine's step loop, ``engine/step_loop.py``) while it has rows, and sleeps while it has none; a
bounded queue in front of it.

Each job (one row of a request: a prompt, or one of its ``n`` samples) is submitted to the engine
as a request of its own with its own settings (mode, length, stop strings, sampler settings,
block size), so requests that differ in any of them share the engine's forwards, rows join at
any step and leave as they end; what else runs never changes a row's tokens. A job whose client
went away (streamed or not, running or still queued) is cancelled (``Handle.cancel``): its row
leaves at the next step, and with no row left the worker sleeps. A full queue refuses new jobs
(HTTP 429); a closing scheduler refuses them too (503) and finishes what it holds.

Nothing a request does stops the worker: an error while a job is handed to the engine, stepped
or settled (its trace saved) ends that job with it, and the worker goes on. Should the worker
thread end all the same, :attr:`Scheduler.stopped` says why, ``/health`` answers 503 with it and
new jobs are refused (503) instead of waiting for a worker that is gone.
"""
from __future__ import annotations

import contextvars
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from clover_lab.engine.requests import GenerationError, Plan
from clover_lab.errors import GrammarError
from clover_lab.serve.jobs import Job, RequestError
from clover_lab.serve.prometheus import Metrics

DEFAULT_CAPACITY = 4096  # positions per row the engine's cache holds at least while serving


class Scheduler:
    def __init__(self, engine, max_batch: int = 32, max_queue: int = 256, metrics: Metrics | None = None,
                 traces: "TraceStore | None" = None, capacity: int | None = None):
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch and max_queue must be >= 1, got {max_batch}, {max_queue}")
        self.engine, self.max_batch, self.max_queue = engine, max_batch, max_queue
        engine.loop.max_rows = max_batch
        engine.loop.capacity = capacity or min(engine.model.config.max_position_embeddings, DEFAULT_CAPACITY)
        self.metrics = metrics or Metrics()
        self.traces = traces or TraceStore()
        self._cv = threading.Condition()
        self._inbox: list[Job] = []  # submitted, not yet handed to the engine
        self._jobs: list[Job] = []  # handed to the engine, not yet ended
        self._closing = False
        self._fault: BaseException | None = None  # what ended the worker thread, when it ended otherwise
        self._thread = threading.Thread(target=self._serve, name="clover-serve-engine", daemon=True)

    # ---------------------------------------------------------------- the request side
    def start(self) -> None:
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Jobs not yet running (queued here or in the engine)."""
        return len(self._inbox) + sum(1 for job in self._jobs if job.handle is not None and not job.started)

    @property
    def running(self) -> int:
        return sum(1 for job in self._jobs if job.started)

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def stopped(self) -> str | None:
        """Why the worker can no longer serve (its thread ended while the server was not closing),
        or None while it serves: what ``/health`` answers with a 503."""
        if self._closing or self._thread.ident is None or self._thread.is_alive():
            return None  # closing on purpose, not started yet, or serving
        e = self._fault
        return ("the engine's worker thread has ended" + (f": {type(e).__name__}: {e}" if e is not None else "")
                + "; restart the server")

    def submit(self, jobs: list[Job]) -> None:
        """Queue a request's jobs (all or none). A request with more jobs than the queue holds can
        never be taken: a 400, not a 429 to retry."""
        if len(jobs) > self.max_queue:
            raise RequestError(f"this request has {len(jobs)} prompts (times n), more than the server's queue holds "
                               f"({self.max_queue}, --max-queue); send fewer per request", "n")
        with self._cv:
            if self._closing:
                raise RequestError("the server is shutting down", status=503, type="service_unavailable",
                                   code="shutting_down")
            if self.stopped is not None:
                raise RequestError(f"the server cannot serve: {self.stopped}", status=503,
                                   type="service_unavailable", code="engine_stopped")
            if self.waiting + len(jobs) > self.max_queue:
                raise RequestError(f"the queue is full ({self.max_queue} waiting prompts); retry later", status=429,
                                   type="rate_limit_error", code="queue_full")
            self._inbox.extend(jobs)
            self.metrics.queue.set(self.waiting)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: the job's row leaves at the next step (or the queue at once)."""
        job.cancelled.set()
        if job.handle is not None:
            job.handle.cancel()
        with self._cv:
            if job in self._inbox:
                self._inbox.remove(job)
                self.metrics.queue.set(self.waiting)
            self._cv.notify()

    def close(self, timeout: float | None = None) -> None:
        """Refuse new jobs, finish the queued and running ones, stop the worker."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.traces.close()

    # ---------------------------------------------------------------- the worker
    def _serve(self) -> None:
        try:
            self._work()
        except BaseException as e:  # noqa: BLE001 - the thread ends; /health and new requests say why
            self._fault = e
            with self._cv:
                jobs, self._inbox = self._jobs + self._inbox, []
            gone = RequestError(f"the server cannot serve: its engine's worker thread ended ({type(e).__name__}: "
                                f"{e}); restart the server", status=503, type="service_unavailable",
                                code="engine_stopped")
            for job in jobs:  # nobody waits forever on a worker that is gone
                job.send(gone)
                job.send(None)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self._jobs and not self._closing:
                    self._cv.wait()
                if not self._inbox and not self._jobs:
                    return
                jobs, self._inbox = self._inbox, []
            for job in jobs:
                try:
                    self._start(job)
                except Exception as e:  # noqa: BLE001 - this job's own failure ends it, not the worker
                    self._end(job, e)
            if not self.engine.loop.idle:
                before = self.engine.loop.forwards
                try:
                    self.engine.step()
                except Exception as e:  # noqa: BLE001 - the engine failed outside any request: every job hears it
                    for job in self._jobs:
                        job.handle.fail(e)
                    self._drop_failed()
                self.metrics.stepped(self.engine.loop.forwards - before)
            self._settle()

    def _drop_failed(self) -> None:
        """The rows of requests that failed outside the step loop's own handling leave the engine."""
        loop = self.engine.loop
        failed = {job.handle for job in self._jobs if job.handle is not None and job.handle.error is not None}
        if failed:
            loop.fail(failed, next(iter(failed)).error)

    def _end(self, job: Job, error: BaseException) -> None:
        """``job`` ends with ``error`` (its request's answer); its scopes close, its rows leave."""
        try:
            self._close_scopes(job)
        except Exception:  # noqa: BLE001 - the job's error is what its client hears
            pass
        if job.handle is not None and not job.handle.done:
            job.handle.cancel()
        job.send(error)
        job.send(None)

    def _start(self, job: Job) -> None:
        """Hand a job to the engine as a request of its own (a traced one inside its capture's
        scope, one reporting its experts with its recorder's hooks: opened in a context of its own and closed
        when it ends)."""
        if job.cancelled.is_set():
            return
        if self.engine.loop.rows:
            self.metrics.joined.inc()
        request = job.plan  # checked when the body was (``make_jobs``): submitted as it is
        recorder = None if job.probe is None else job.probe.recorder
        try:
            if job.trace_points is None and recorder is None:
                job.handle = self.engine.submit(request, listener=job.deliver)
            else:
                job.context = contextvars.copy_context()
                job.capture = None if job.trace_points is None else self.engine.capture(job.trace_points, to="cpu")
                job.handle = job.context.run(self._scoped, job, request, recorder)
        except Exception as e:  # noqa: BLE001 - checked before it was queued; what is left is the request's
            self._close_scopes(job)
            job.send(e)
            job.send(None)
            return
        self._jobs.append(job)

    def _scoped(self, job: Job, request: Plan, recorder):
        """Submit ``job`` with its capture and its expert recorder's hooks open in its own context."""
        if job.capture is not None:
            job.capture.__enter__()
        if recorder is not None:
            job.scope = self.engine.model.hooks.open_scope(recorder.hooks())
        return self.engine.submit(request, listener=job.deliver)

    @staticmethod
    def _close_scopes(job: Job) -> None:
        if job.scope is not None:
            job.context.run(job.scope.remove)
        if job.capture is not None:
            job.context.run(job.capture.__exit__, None, None, None)

    def _settle(self) -> None:
        """Jobs whose request ended leave: an error is their answer; a traced one's trace is saved."""
        going = []
        for job in self._jobs:
            h = job.handle
            if not h.done:
                going.append(job)
                continue
            try:
                self._close_scopes(job)
                if job.capture is not None and h.error is None and not job.cancelled.is_set():
                    self.traces.add(job.id, job.capture, {"request": job.id})
            except Exception as e:  # noqa: BLE001 - e.g. a full disk under the trace: this job's answer
                self._end(job, RequestError(
                    f"the generation ran, but its trace could not be saved ({type(e).__name__}: {e}); free space "
                    f"in the server's trace directory ({self.traces.root}) or ask without clover.trace",
                    "clover.trace", status=507, type="server_error", code="trace_not_saved"))
                continue
            if h.error is not None:
                job.send(run_error(h.error))
            else:
                self.metrics.finished(h.result)
            job.send(None)
        with self._cv:
            self._jobs = going
            self.metrics.queue.set(self.waiting)
            self.metrics.running.set(self.running)


def run_error(error: BaseException) -> BaseException:
    """What a request that failed in its run is answered: what only a run could show wrong with
    the request (a grammar past the grammar engine's limits, a setting that left no token to
    choose) a 400 naming its field, never a 500; anything else as it is (the server's fault)."""
    if isinstance(error, GrammarError):
        return RequestError(str(error), error.what, code="grammar_failed")
    if isinstance(error, GenerationError) and error.field is not None:
        return RequestError(str(error), error.field, code="generation_failed")
    return error


class TraceStore:
    """The traces requests asked for, saved as the lab saves them (``Capture.save``: trace.json and
    tensors.safetensors in a directory), by request id; the oldest go past ``keep``."""

    def __init__(self, keep: int = 64, root: str | Path | None = None):
        self.keep = keep
        self._own = root is None
        self.root = Path(tempfile.mkdtemp(prefix="clover-serve-traces-") if root is None else root)
        self._paths: OrderedDict[str, Path] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, request_id: str, capture, meta: dict) -> None:
        path = self.root / request_id
        capture.save(path, meta)
        with self._lock:
            self._paths[request_id] = path
            while len(self._paths) > self.keep:
                _, old = self._paths.popitem(last=False)
                shutil.rmtree(old, ignore_errors=True)

    def get(self, request_id: str) -> Path | None:
        with self._lock:
            return self._paths.get(request_id)

    def close(self) -> None:
        if self._own:
            shutil.rmtree(self.root, ignore_errors=True)
