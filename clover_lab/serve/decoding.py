"""A batch's decoding policy: a job may carry its request's own (``Job.policy``: GrammarPolicy for
structured output and required tool calls); jobs share a batch only with jobs of the same policy
(``Job.key``), and :class:`PolicyScheduler` runs each batch with its jobs' policy as the engine's.
This bridges the engine of today, which takes one policy per generation, until the scheduler of
rows (issue 38) hands each row its own request's policy."""
from __future__ import annotations

from clover_lab.serve.scheduler import Scheduler


class PolicyScheduler(Scheduler):
    def _run(self, batch) -> None:
        policy = batch[0].policy
        if policy is None:
            return super()._run(batch)
        engine = self.engine
        default, engine.policy = engine.policy, policy  # the worker thread owns the engine: nobody else reads it
        try:
            return super()._run(batch)
        finally:
            engine.policy = default
