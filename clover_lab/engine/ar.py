"""The autoregressive baseline, one loop for one row or many: one token per row per forward, on
the same model and caches as block diffusion. Each token is a block of one: it fires
``block.commit`` with ``steps`` = 1. Rows leave at EOS, a stop string, their length or a
stopping commit hook; StopGeneration from a hook inside the model ends every row (the token is
kept, not cached)."""
from __future__ import annotations

from typing import Iterator

import torch

from clover_lab.engine import sampling
from clover_lab.engine.faults import check_logits, collapsed, logits_health
from clover_lab.engine.results import StreamUpdate
from clover_lab.hooks.registry import StopGeneration


def run_ar(run) -> Iterator[StreamUpdate]:
    """Generate ``run.max_new`` tokens at most per row; yields a "commit" update per token (when
    the run emits), a "done" per row and, for a batch, a last "batch" update."""
    try:
        logits = run.prefill("last")  # [R, V]
    except StopGeneration:  # a model hook stopped a prompt's prefill: no tokens
        yield from run.end(run.active, "hook", cache_complete=False)
        yield from run.finish(0)
        return
    i = 0
    for i in range(run.max_new):
        rows = run.live()
        tokens, health = [], []
        for j, row in enumerate(rows):
            t, conf, _ = sampling.decide(logits[j:j + 1], row.counts, row.s, row.generator)
            tokens.append(t[0])
            health.append(logits_health(collapsed(logits[j:j + 1]), conf))
        # the one sync per step: every row's token, and whether its logits could be used (NaN or inf
        # make the confidence NaN, equal logits carry no answer; argmax would return token 0 either way)
        host = torch.stack(tokens + health).tolist()
        for j, row in enumerate(rows):
            check_logits(row, host[len(rows) + j], f"token {i} (AR)")
        reasons = {}
        for j, (row, t) in enumerate(zip(rows, host)):
            row.info.add(0, *row.info.chosen(row.info.distribution(logits[j:j + 1], row.counts, row.s), [0], [t])[0])
            if row.counts is not None:
                row.counts[t] += 1
            row.committed.append(t)
            reasons[row.index] = end_reason(row, t)
        last = i + 1 == run.max_new or all(reason != "length" for reason in reasons.values())
        ids = torch.tensor([[t] for t in host[:len(rows)]], device=run.device)
        names = [row.index for row in rows]
        try:
            out = run.commit(names, ids, run.where("decode", commit_block=i), logits=None if last else "last")
        except StopGeneration:  # a model hook stopped the forward: each row keeps its token, not cached
            yield from run.end(names, "hook", cache_complete=False, index=i)
            break
        ending = []
        for row, t in zip(rows, host):
            row.stats.blocks += 1
            stopped = row.fire_commit(i, [t], 1, len(row.prompt_ids) + i)
            if run.emit:
                yield row.update("commit", i, None)
            if stopped:
                reasons[row.index] = "hook"
            if reasons[row.index] != "length" or i + 1 == run.max_new:
                ending.append(row.index)
        yield from run.end(ending, reasons, index=i + 1)
        if not run.active:
            break
        logits = out[[j for j, r in enumerate(names) if r not in ending], -1]
    yield from run.finish(i + 1)


def end_reason(row, token: int) -> str:
    """Why the row ends with ``token``, just appended to its response: "eos", "stop_string" or
    "length" (it goes on)."""
    if token in row.eos:
        return "eos"
    if row.stop_strings is not None and row.stop_strings.find(row.committed) is not None:
        return "stop_string"
    return "length"
