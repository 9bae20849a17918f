"""The scheduler: one worker thread owns the engine (a generation's cache and hooks belong to the
thread that runs it), a bounded queue in front of it, and batches.

At each start the worker takes the oldest waiting job and every waiting job that can share its
batch (``Job.key``: the same mode, length, stop strings, sampler settings and block size), up to
``max_batch`` rows, and runs them as one batched ``engine.stream``: the rows share every forward
and each leaves as it ends. In block diffusion (without a coreset) jobs of that key that arrive
meanwhile join the running batch at its next block boundary (``Engine.stream``'s ``join``), into
a cache of ``capacity`` positions per row; a job of another key waits for the batch to end, and
each batch is bounded by its length. Greedy float32 rows give the tokens each prompt gives alone, so what
else is in the batch never changes a response. A job whose client went away is stopped at its
next denoising step (a ``denoise.step`` hook stops its row; in AR, ``block.commit``) and its row
leaves the batch. A full queue refuses new jobs (HTTP 429); a closing scheduler refuses them too
(503) and finishes what it holds.
"""
from __future__ import annotations

import shutil
import tempfile
import threading
from collections import OrderedDict, deque
from contextlib import nullcontext
from pathlib import Path

from clover_lab.hooks import points
from clover_lab.serve.jobs import Job, RequestError
from clover_lab.serve.prometheus import Metrics

DEFAULT_CAPACITY = 4096  # positions per row of a batch that jobs join


class Scheduler:
    def __init__(self, engine, max_batch: int = 32, max_queue: int = 256, metrics: Metrics | None = None,
                 traces: "TraceStore | None" = None, capacity: int | None = None):
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch and max_queue must be >= 1, got {max_batch}, {max_queue}")
        self.engine, self.max_batch, self.max_queue = engine, max_batch, max_queue
        self.capacity = capacity or min(engine.model.config.max_position_embeddings, DEFAULT_CAPACITY)
        self.metrics = metrics or Metrics()
        self.traces = traces or TraceStore()
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._closing = False
        self.running = 0  # rows in the batch now running
        self._thread = threading.Thread(target=self._work, name="clover-serve-engine", daemon=True)

    # ---------------------------------------------------------------- the request side
    def start(self) -> None:
        self._thread.start()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def closing(self) -> bool:
        return self._closing

    def submit(self, jobs: list[Job]) -> None:
        """Queue a request's jobs (all or none)."""
        with self._cv:
            if self._closing:
                raise RequestError("the server is shutting down", status=503, type="service_unavailable",
                                   code="shutting_down")
            if len(self._waiting) + len(jobs) > self.max_queue:
                raise RequestError(f"the queue is full ({self.max_queue} waiting prompts); retry later", status=429,
                                   type="rate_limit_error", code="queue_full")
            self._waiting.extend(jobs)
            self.metrics.queue.set(len(self._waiting))
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: a waiting job leaves the queue, a running one its batch."""
        job.cancelled.set()
        with self._cv:
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.queue.set(len(self._waiting))

    def close(self, timeout: float | None = None) -> None:
        """Refuse new jobs, finish the queued and running ones, stop the worker."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.traces.close()

    # ---------------------------------------------------------------- the worker
    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closing:
                    self._cv.wait()
                if not self._waiting:
                    return
                batch = self._take()
                self.metrics.queue.set(len(self._waiting))
            self._run(batch)

    def _take(self) -> list[Job]:
        """The oldest job and the waiting jobs that can share its batch."""
        first = self._waiting.popleft()
        batch, key = [first], first.key()
        for job in list(self._waiting):
            if len(batch) == self.max_batch:
                break
            if job.key() == key:
                batch.append(job)
                self._waiting.remove(job)
        return batch

    def _run(self, batch: list[Job]) -> None:
        engine, first = self.engine, batch[0]
        live = [job for job in batch if not job.cancelled.is_set()]
        if not live:
            return
        batch = live

        def stop_cancelled(event):  # a gone client's row stops at its next step (AR: token)
            r = event.where.row
            if r is not None and batch[r].cancelled.is_set():
                event.stop()

        traced = first.trace_points is not None  # a traced job runs alone (Job.key)
        joins = first.mode == "diffusion" and not first.settings.coreset_size and not traced
        longest = max(len(job.prompt_ids) for job in batch) + first.max_new_tokens
        block_size = engine.block_size
        self.running = len(batch)
        self.metrics.running.set(len(batch))
        try:
            engine.block_size = first.block_size
            with engine.hooks({points.DENOISE_STEP: stop_cancelled, points.BLOCK_COMMIT: stop_cancelled}), \
                    (engine.capture(first.trace_points, to="cpu") if traced else nullcontext()) as capture:
                stream = engine.stream([job.prompt_ids for job in batch], mode=first.mode,
                                       max_new_tokens=first.max_new_tokens, stop=first.stop or None,
                                       settings=first.settings, join=self._joining(batch) if joins else None,
                                       capacity=max(longest, self.capacity) if joins else None)
                for update in stream:
                    if update.kind == "batch":
                        self.metrics.batch(update.result)
                        continue
                    job = batch[update.row]
                    if update.kind == "done":
                        with self._cv:
                            self.running -= 1
                        self.metrics.running.set(self.running)
                    if job.cancelled.is_set() or (update.kind == "step" and not job.provisional):
                        continue
                    job.send(update)
                    if update.kind == "done" and not traced:
                        job.send(None)
            if traced:
                self.traces.add(first.id, capture, {"request": first.id})
                first.send(None)
        except Exception as e:  # noqa: BLE001 - the jobs' requests answer it; the worker goes on
            for job in batch:
                job.send(e)
        finally:
            engine.block_size = block_size
            self.running = 0
            self.metrics.running.set(0)


    def _joining(self, batch: list[Job]):
        """``Engine.stream``'s join source: waiting jobs of the batch's key whose prompts fit,
        while the batch has rows free; they are appended to ``batch`` (their row indices)."""
        key = batch[0].key()

        def join(room: int) -> list[list[int]]:
            with self._cv:
                free = self.max_batch - self.running
                jobs = [job for job in self._waiting if job.key() == key and len(job.prompt_ids) <= room][:free]
                for job in jobs:
                    self._waiting.remove(job)
                self.metrics.queue.set(len(self._waiting))
                self.running += len(jobs)
                self.metrics.running.set(self.running)
                self.metrics.joined.inc(len(jobs))
            batch.extend(jobs)
            return [job.prompt_ids for job in jobs]

        return join


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
