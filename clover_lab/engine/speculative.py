"""Exact self-speculative decoding (issue 30), the decoder of the step loop's speculative rows: the preview drafts
a block, one causal forward commits it and so scores every drafted token under the AR model,
and the draft is accepted up to its first disagreement with the causal choice, which takes that
position. Greedy, that is AR's greedy answer token for token; sampled, the acceptance follows
the speculative-sampling rule (``acceptance.py``), so the tokens follow AR's distribution.

A cycle, per block k and row:

1. the causal token c0 at the row's next position, from the last forward's logits (the
   prompt's prefill, or the previous verify's row at the last kept token);
2. a draft of the block ``[c0, mask, ...]`` by ``draft_passes`` denoising steps (the usual
   ``denoise.step`` decision and hooks; the last pass unmasks everything left);
3. one forward commits the whole drafted block (``CloverModel.commit_draft``); its row i gives
   the causal choice at position i + 1;
4. the accepted tokens are c0, the drafted tokens equal to the causal choice up to the first
   difference, and nothing after an EOS, a stop string or the length; the cache is cut back to
   exactly those (``DraftCommit.keep``: attention rows past the length are never read, the GDN
   state is recomputed over the kept rows from the block's chunk state); the causal choice at
   the first difference becomes the next cycle's c0, without another forward.

So a cycle costs ``draft_passes`` previews and one commit, and yields 1 + accepted tokens. Step
hooks see every draft step; ``block.commit`` fires per cycle with the kept tokens and the
acceptance (``drafted``, ``accepted``, ``rejected``); stats keep the same per block. A step hook
that stops ends the row after that cycle; StopGeneration inside a forward ends the forward's rows (a
draft commit it stopped changed nothing).
"""
from __future__ import annotations

import torch

from clover_lab.engine import sampling
from clover_lab.engine.acceptance import greedy_accept, speculative_accept
from clover_lab.engine.ar import end_reason
from clover_lab.engine.diffusion import Block, decide, denoise_step, take
from clover_lab.engine.faults import check_logits
from clover_lab.engine.runner import Part, Reader
from clover_lab.engine.sampling import OK, collapsed, logits_health


def advance(loop, rows: list) -> None:
    """One step of a cohort's speculative rows (``step_loop.py``): when none is in a cycle, every row
    begins one (its block ``[c0, mask, ...]``); the rows still drafting take a draft pass (one
    preview forward per block length); when none is drafting any more, the rows commit their
    drafts (one forward per block length) and each accepts on its own, and leaves on its own."""
    if not any(row.block is not None for row in rows):
        for row in rows:
            begin_cycle(row, min(row.block_size, room(loop, row)))
    groups: dict[int, list] = {}
    for row in rows:
        if drafting(row):
            groups.setdefault(len(row.block), []).append(row)
    for group in groups.values():
        draft(loop, group)
    rows = [row for row in rows if row.live]
    if rows and not any(drafting(row) for row in rows):
        by_length: dict[int, list] = {}
        for row in rows:
            by_length.setdefault(len(row.block), []).append(row)
        for group in by_length.values():
            verify(loop, group)


def drafting(row) -> bool:
    return row.block is not None and bool(row.block.masked) and not row.stopped


def room(loop, row) -> int:
    """Positions the row's next block may take: what its own length leaves (at least 1), within the
    cache. The row's own, not the cohort's: the blocks, and with them a sampled row's draws, of a
    row beside others are the ones it drafts alone (they followed the batch's longest row, so a
    row that ended, a ``block.commit`` hook's stop among them, changed the others' samples)."""
    own = len(row.prompt_ids) + len(row.committed)
    return max(1, min(row.max_new - len(row.committed), loop.runner.cache.max_len - own))


def begin_cycle(row, m: int, filler: int | None = None) -> None:
    """The block ``[c0, mask, ...]`` of ``m`` positions. c0, the causal token, is the last
    verify's choice at the first difference, or (after the prefill) decided here exactly as
    the AR decoder decides it. The penalty counts and the stop strings' scan are kept, to be
    the response's again after the draft (a draft is not the response)."""
    c0, row.next_token = row.next_token, None
    if c0 is None:
        logits = row.logits
        shaped = row.keep_going(row.allowed(logits[None]), [len(row.committed)])
        t, conf, _ = sampling.decide(shaped, row.counts, row.s, row.generator)
        c0, health = torch.stack([t[0], logits_health(collapsed(logits[None]), conf)]).tolist()
        if health != OK:
            check_logits(row, health, "the prompt's next token")
        # its log-probabilities, as AR's (None unless asked for: nothing computed)
        row.next_details = row.info.chosen(row.info.distribution(shaped, row.counts, row.s), [0], [c0])[0]
    block = Block(row.stats.blocks, m, row.engine.mask_token_id if filler is None else filler, row.device,
                  row.s.draft_passes)
    block.canvas[0] = c0
    block.place({0: c0}, row.eos)
    block.masked = [p for p in range(1, m) if p < block.end]
    block.memo = row.policy.begin_block(row, block)
    row.block, row.stopped, row.produced = block, False, len(row.committed)
    row.draft = (None if row.counts is None else row.counts.clone(),
                 None if row.stop_strings is None else row.stop_strings.clean)


def draft(loop, rows: list) -> None:
    """A draft pass over these rows' blocks (the usual ``denoise.step`` decision and hooks; sampled
    rows keep their draft's distribution, ``block.q``)."""
    first = rows[0]
    canvas = torch.stack([row.block.canvas for row in rows])
    one = first.block.masked_index() if len(rows) == 1 else None
    where = loop.where(rows, "decode", first.block.index, first.block.step)
    with loop.forward("preview", rows):
        logits = loop.runner.use(first.hooks).preview([row.key for row in rows], canvas, where, positions=one)
    for i, row in enumerate(rows):
        block = row.block
        idx = block.masked_index()
        mine = logits[i:i + 1] if idx is None or one is not None else logits[i:i + 1, idx]
        if not row.s.greedy:  # one pass: every position drawn from these distributions
            masked = mine[0].float().clone()
            masked[:, row.engine.mask_token_id] = float("-inf")
            block.q = sampling.sampling_probs(masked, row.counts, row.s)
        unmask, stop = denoise_step(row, block, mine, idx)
        row.stopped |= stop
        row.update("step", block.index, block.step - 1, block.host, unmask)


def verify(loop, rows: list) -> None:
    """One forward commits these rows' drafted blocks; each row accepts its draft up to the first
    disagreement with the causal choice, the cache keeps exactly the accepted tokens, and
    ``block.commit`` fires with the acceptance."""
    for row in rows:  # the response's penalty counts and stop-string scan again
        counts, clean = row.draft
        if counts is not None:
            row.counts.copy_(counts)
        if clean is not None:
            row.stop_strings.clean = clean
    ids = torch.stack([row.block.canvas for row in rows])
    with loop.forward("commit", rows):
        committed = loop.runner.use(rows[0].hooks).commit_draft(
            [row.key for row in rows], ids, loop.where(rows, "decode", commit_block=rows[0].block.index))
    keep, ending, reasons = [], [], {}
    for j, row in enumerate(rows):
        kept, reason = accept(row, row.block, committed.logits[j])
        keep.append(kept)
        if row.stopped:
            reason = "hook"
        if reason != "length" or len(row.committed) >= row.max_new:
            ending.append(row)
            reasons[row.key] = reason
    committed.keep(keep)
    for j, row in enumerate(rows):
        block, row.block = row.block, None
        tokens = row.committed[len(row.committed) - keep[j]:]
        start = len(row.prompt_ids) + len(row.committed) - keep[j]
        if row.fire_commit(block.index, tokens, block.step, start, row.stats.acceptance(-1)):
            if row not in ending:
                ending.append(row)
            reasons[row.key] = "hook"
        row.update("commit", block.index, None)
    loop.end(ending, reasons)


def schedule(loop, rows: list) -> list:
    """A packed step (``StepLoop._step_packed``): each row's segment of the step's one forward, each
    row on its own cycle: a draft pass of its block (begun here when the row has none), or, once
    drafted, its block's commit whose logits verify the draft (kept up to the accepted tokens:
    ``Runner.keep_draft``); the host reads the decisions with the step's others."""
    parts = []
    for row in rows:
        if row.block is None:
            # the room its cache would have alone (a draft near the end of the cache is shorter)
            own = min(loop.runner.cache.max_len, max(len(row.prompt_ids) + row.max_new, loop.capacity))
            room = own - len(row.prompt_ids) - len(row.committed)
            begin_cycle(row, max(1, min(row.block_size, room)))
        block = row.block
        if drafting(row):
            parts.append(Part(row, block.canvas, 0, len(block), list(block.masked), "preview",
                              lambda logits, row=row: drafted(row, logits)))
            continue
        counts, clean = row.draft  # the response's penalty counts and stop-string scan again
        if counts is not None:
            row.counts.copy_(counts)
        if clean is not None:
            row.stop_strings.clean = clean
        parts.append(Part(row, block.canvas, len(block), 0, list(range(len(block))), "commit",
                          lambda logits, row=row: verified(loop, row, logits), draft=True))
    return parts


def drafted(row, logits: torch.Tensor) -> list:
    """A packed step's draft pass of the row's block (``logits`` [N, V] at its masked positions):
    decided on the device, taken once the host has read it."""
    block = row.block
    mine = logits[None]
    if not row.s.greedy:  # one pass: every position drawn from these distributions
        masked = mine[0].float().clone()
        masked[:, row.engine.mask_token_id] = float("-inf")
        block.q = sampling.sampling_probs(masked, row.counts, row.s)
    d = decide(row, block, mine, block.masked_index())

    def read(values):
        unmask, stop = take(d, values)
        row.stopped |= stop
        row.update("step", block.index, block.step - 1, block.host, unmask)
    return [(d.host, Reader(row, read))]


def verified(loop, row, logits: torch.Tensor) -> list:
    """A packed step committed the row's drafted block (``logits`` [m, V]): it accepts its draft up
    to the first disagreement with the causal choice, the cache keeps exactly the accepted
    tokens, ``block.commit`` fires with the acceptance, and the row ends or begins its next cycle
    at the next step."""
    host, accepted = accepting(row, row.block, logits)

    def read(values):
        kept, reason = accepted(values)
        if row.stopped:
            reason = "hook"
        loop.runner.keep_draft(row.key, logits, kept)
        block, row.block = row.block, None
        tokens = row.committed[len(row.committed) - kept:]
        start = len(row.prompt_ids) + len(row.committed) - kept
        if row.fire_commit(block.index, tokens, block.step, start, row.stats.acceptance(-1)):
            reason = "hook"
        row.update("commit", block.index, None)
        if reason != "length" or len(row.committed) >= row.max_new:
            loop.end([row], reason)
    if host is None:
        read(None)
        return []
    return [(host, Reader(row, read))]


def finish(loop, rows: list) -> None:
    """Nothing is left to do after a packed step's reads (:func:`verified` took each draft)."""


def abandon(loop, rows: list) -> None:
    """A model hook stopped a forward, which changed nothing: these rows end."""
    loop.end(rows, "hook")


def accept(row, block: Block, logits: torch.Tensor) -> tuple[int, str]:
    """The row's accepted tokens of its committed draft (``logits`` [m, V]: row i the causal
    distribution at position i + 1) join its response; the causal token after them is kept
    for the next cycle. Returns (tokens kept, why the row ends or "length")."""
    host, take = accepting(row, block, logits)
    return take(None if host is None else host.tolist())


def accepting(row, block: Block, logits: torch.Tensor):
    """:func:`accept` in two halves: on the device, the causal choices at the drafted positions
    (greedy rows) -> (the 1-D tensor the host reads, or None: a sampled row's acceptance reads on
    its own, ``take(values)`` -> (tokens kept, why the row ends or "length"))."""
    d = min(block.prefix, block.end) - 1  # drafted positions 1..d
    drafted = block.host[1:d + 1]
    rows, counts = logits[:d + 1].float(), draft_counts(row, block.host[:d + 1])
    flat = collapsed(rows)
    rows = row.allowed(rows, block.host[:d + 1], skip=1)  # row i follows the block's first i + 1 tokens
    rows = row.keep_going(rows, range(len(row.committed) + 1, len(row.committed) + d + 2))
    # log-probabilities (when asked for) under the causal pass's distribution, as AR's (see kept_tokens)
    dist = row.info.distribution(rows, counts, row.s)
    if row.s.greedy:
        t, conf, _ = sampling.decide(rows, counts, row.s, row.generator)

        def take(host: list) -> tuple[int, str]:
            if host[-1] != OK:
                check_logits(row, host[-1], f"block {block.index}, the draft's commit")
            n = greedy_accept(drafted, host[:d])
            row.next_token = host[n]
            return kept_tokens(row, block, drafted, n, d, dist)
        return torch.cat([t, logits_health(flat, conf).reshape(1)]), take
    p = sampling.sampling_probs(rows, counts, row.s)
    q = block.q[:d] if d else p[:0]  # nothing drafted (a block of one): the causal token only
    n, row.next_token = speculative_accept(torch.tensor(drafted, device=rows.device, dtype=torch.long),
                                           q, p, row.generator)
    return None, lambda _: kept_tokens(row, block, drafted, n, d, dist)


def kept_tokens(row, block: Block, drafted: list[int], n: int, d: int, dist) -> tuple[int, str]:
    """The causal token and the ``n`` accepted drafted tokens join the row's response (up to an
    end); returns (tokens kept, why the row ends or "length"). ``dist``: the causal pass's
    distribution, whose row i chose the token at position i + 1 (drafted[i] where accepted, the
    next causal token at the first difference): each kept token's log-probability, as AR's."""
    details = row.info.chosen(dist, list(range(n + 1)), drafted[:n] + [row.next_token])
    details, row.next_details = [row.next_details] + details[:n], details[n]
    kept, reason = 0, "length"
    row.info.forget()  # the draft's unmask notes: its tokens join as the causal pass's
    for t, (lp, top) in zip([block.host[0]] + drafted[:n], details):
        row.info.add(None, lp, top)  # no denoising step unmasked it
        if row.counts is not None:
            row.counts[t] += 1
        row.committed.append(t)
        kept += 1
        reason = end_reason(row, t)
        if reason != "length" or len(row.committed) >= row.max_new:
            break
    row.follow(row.committed[len(row.committed) - kept:])
    row.stats.record_draft(d, n, block.step)
    return kept, reason


def draft_counts(row, tokens: list[int]) -> torch.Tensor | None:
    """Penalty counts [len(tokens), V] at each drafted position: the response's, then the
    draft's tokens before that position (as AR would have counted them)."""
    if row.counts is None:
        return None
    ids = torch.tensor(tokens, device=row.counts.device)
    onehot = torch.zeros(len(tokens), row.counts.shape[0], device=ids.device).scatter_(1, ids[:, None], 1.0)
    return row.counts[None] + onehot.cumsum(0)
