"""The autoregressive baseline, the decoder of the step loop's AR rows: one token per row per
forward, on the same model and caches as block diffusion. Each token is a block of one: it fires
``block.commit`` with ``steps`` = 1. Rows leave at EOS, a stop string, their length or a
stopping commit hook; StopGeneration from a hook inside the model ends the forward's rows (the
token is kept, not cached)."""
from __future__ import annotations

import torch

from clover_lab.engine import sampling
from clover_lab.engine.faults import check_logits
from clover_lab.engine.runner import Part, Reader
from clover_lab.engine.sampling import OK, collapsed, logits_health
from clover_lab.hooks.registry import StopGeneration


def advance(loop, rows: list) -> None:
    """One token per row (``step_loop.py``): each row decides its token from the logits at its next
    position (the prompt's prefill, or its last commit), then the rows commit their tokens in one
    forward, which gives the logits for their next ones."""
    tokens, health, shaped = [], [], []
    for row in rows:
        logits = row.keep_going(row.allowed(row.logits[None]), [len(row.committed)])  # grammar; min_tokens
        t, conf, _ = sampling.decide(logits, row.counts, row.s, row.generator)
        tokens.append(t[0])
        health.append(logits_health(collapsed(row.logits[None]), conf))
        shaped.append(logits)
    # the one sync per step: every row's token, and whether its logits could be used (NaN or inf
    # make the confidence NaN, equal logits carry no answer; argmax would return token 0 either way)
    host = torch.stack(tokens + health).tolist()
    for j, row in enumerate(rows):
        if host[len(rows) + j] != OK:
            check_logits(row, host[len(rows) + j], f"token {len(row.committed)} (AR)")
    reasons = {}
    for row, t, logits in zip(rows, host, shaped):
        reasons[row.key] = append(row, t, logits)
    last = all(reasons[row.key] != "length" or len(row.committed) >= row.max_new for row in rows)
    ids = torch.tensor([[t] for t in host[:len(rows)]], device=rows[0].device)
    try:
        with loop.forward("commit", rows):
            out = loop.runner.use(rows[0].hooks).commit(
                [row.key for row in rows], ids, loop.where(rows, "decode", commit_block=len(rows[0].committed) - 1),
                logits=None if last else "last")
    except StopGeneration:  # a model hook stopped the forward: each row keeps its token, not cached
        loop.end(rows, "hook", cache_complete=False)
        return
    ending = []
    for j, (row, t) in enumerate(zip(rows, host)):
        i = len(row.committed) - 1
        row.stats.blocks += 1
        if row.fire_commit(i, [t], 1, len(row.prompt_ids) + i):
            reasons[row.key] = "hook"
        row.update("commit", i, None)
        if reasons[row.key] != "length" or len(row.committed) >= row.max_new:
            ending.append(row)
        else:
            row.logits = out[j, -1]
    loop.end(ending, reasons)


def schedule(loop, rows: list) -> list:
    """A packed step (``StepLoop._step_packed``): each row decides its token on the device from the
    logits at its next position, and its segment of the step's one forward commits it (the
    forward gives the logits for the next one); the host reads the token with the step's other
    decisions (:func:`committed`)."""
    parts = []
    for row in rows:
        logits = row.keep_going(row.allowed(row.logits[None]), [len(row.committed)])  # grammar; min_tokens
        t, conf, _ = sampling.decide(logits, row.counts, row.s, row.generator)
        health = logits_health(collapsed(row.logits[None]), conf)
        parts.append(Part(row, t[:1], 1, 0, [0], "commit",
                          lambda out, row=row, t=t, health=health, logits=logits:
                          [(torch.stack([t[0], health]), Reader(row, lambda v: committed(loop, row, v, logits, out)))]))
    return parts


def committed(loop, row, values: list, shaped: torch.Tensor, out: torch.Tensor) -> None:
    """A packed step committed the row's token, whose value and logits' health the host read
    (``values``): the token joins the response, ``block.commit`` fires; the row ends (EOS, a stop
    string, its length, a hook) or keeps the logits ``out`` [1, V] for its next token."""
    t, health = values
    if health != OK:
        check_logits(row, health, f"token {len(row.committed)} (AR)")
    reason = append(row, t, shaped)
    i = len(row.committed) - 1
    row.stats.blocks += 1
    if row.fire_commit(i, [t], 1, len(row.prompt_ids) + i):
        reason = "hook"
    row.update("commit", i, None)
    if reason != "length" or len(row.committed) >= row.max_new:
        loop.end([row], reason)
    else:
        row.logits = out[0]


def finish(loop, rows: list) -> None:
    """Nothing is left to do after a packed step's reads (:func:`committed` took each token)."""


def append(row, t: int, shaped: torch.Tensor) -> str:
    """Token ``t``, decided from ``shaped`` (the logits after the row's grammar and min_tokens),
    joins the row's response: its log-probabilities, the grammar, the penalty counts. Returns why
    the row ends with it, or "length" (it goes on)."""
    row.info.add(0, *row.info.chosen(row.info.distribution(shaped, row.counts, row.s), [0], [t])[0])
    row.follow([t])
    if row.counts is not None:
        row.counts[t] += 1
        window = row.s.penalty_window
        if window is not None and len(row.committed) >= window:  # the token leaving the window
            row.counts[row.committed[-window]] -= 1
    row.committed.append(t)
    return end_reason(row, t)


def abandon(loop, rows: list) -> None:
    """A model hook stopped a forward: these rows end, each with the tokens it has."""
    loop.end(rows, "hook", cache_complete=False)


def end_reason(row, token: int) -> str:
    """Why the row ends with ``token``, just appended to its response: "eos", "stop_string" or
    "length" (it goes on)."""
    if token in row.eos:
        return "eos"
    if row.stop_strings is not None and row.stop_strings.find(row.committed) is not None:
        return "stop_string"
    return "length"
