"""The autoregressive baseline: one token per forward, on the same model and caches as block
diffusion. Each token is a block of one: it fires ``block.commit`` with ``steps`` = 1."""
from __future__ import annotations

from typing import Iterator

import torch

from .. import sampling
from ..hooks.registry import StopGeneration
from .faults import check_logits, collapsed, logits_health
from .results import StreamUpdate


def run_ar(run) -> Iterator[StreamUpdate]:
    """Generate ``run.max_new`` tokens at most; yields a "commit" update per token (when the run
    emits) and a last "done" update."""
    try:
        logits = run.prefill("last")[0]  # [1, V]
    except StopGeneration:  # a model hook stopped the prompt's prefill: no tokens
        run.stats.cache_complete = False
        run.finish("hook")
        if run.emit:
            yield run.update("done", 0, None)
        return
    reason = "length"
    for i in range(run.max_new):
        tokens, conf, _ = sampling.decide(logits, run.counts, run.s, run.generator)
        # the one sync per token: the token, and whether the logits could be used (NaN or inf make
        # the confidence NaN, equal logits carry no answer; argmax would return token 0 either way)
        t, health = torch.stack([tokens[0], logits_health(collapsed(logits), conf)]).tolist()
        check_logits(run, health, f"token {i} (AR)")
        run.info.add(0, *run.info.chosen(run.info.distribution(logits, run.counts, run.s), [0], [t])[0])
        if run.counts is not None:
            run.counts[tokens] += 1
        run.committed.append(t)
        reason = end_reason(run, t)
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


def end_reason(run, token: int) -> str:
    """Why the run ends with ``token``, just appended to the response: "eos", "stop_string" or
    "length" (it goes on)."""
    if token in run.eos:
        return "eos"
    if run.stop_strings is not None and run.stop_strings.find(run.committed) is not None:
        return "stop_string"
    return "length"
