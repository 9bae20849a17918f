"""The autoregressive baseline: one token per forward, on the same model and caches as block
diffusion. Each token is a block of one: it fires ``block.commit`` with ``steps`` = 1."""
from __future__ import annotations

from typing import Iterator

from .. import sampling
from ..hooks.registry import StopGeneration
from .results import StreamUpdate


def run_ar(run) -> Iterator[StreamUpdate]:
    """Generate ``run.max_new`` tokens at most; yields a "commit" update per token (when the run
    emits) and a last "done" update."""
    logits = run.prefill("last")[0]  # [1, V]
    reason = "length"
    for i in range(run.max_new):
        tokens, _, _ = sampling.decide(logits, run.counts, run.s, run.generator)
        t = int(tokens[0])  # the one sync per token
        if run.counts is not None:
            run.counts[tokens] += 1
        run.committed.append(t)
        reason = _end_reason(run, t)
        last = reason != "length" or i + 1 == run.max_new
        try:
            out = run.commit([t], i, logits=None if last else "last")
        except StopGeneration:  # a model hook stopped the forward: the token is kept, not cached
            run.stats.cache_complete = False
            reason = "hook"
            break
        run.stats.blocks += 1
        stop = run.fire_commit(i, [t], 1, len(run.prompt_ids) + i)
        if run.emit:
            yield run.update("commit", i, None)
        if stop:
            reason = "hook"
            break
        if last:
            break
        logits = out[0]
    run.finish(reason)
    if run.emit:
        yield run.update("done", run.stats.blocks, None)


def _end_reason(run, token: int) -> str:
    """Why the run ends with ``token``, just appended to the response: "eos", "stop_string" or
    "length" (it goes on)."""
    if token in run.eos:
        return "eos"
    if run.stop_strings is not None and run.stop_strings.find(run.committed) is not None:
        return "stop_string"
    return "length"
