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
from clover_lab.engine.diffusion import Block, denoise_step
from clover_lab.engine.faults import check_logits
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


def abandon(loop, rows: list) -> None:
    """A model hook stopped a forward, which changed nothing: these rows end."""
    loop.end(rows, "hook")


def accept(row, block: Block, logits: torch.Tensor) -> tuple[int, str]:
    """The row's accepted tokens of its committed draft (``logits`` [m, V]: row i the causal
    distribution at position i + 1) join its response; the causal token after them is kept
    for the next cycle. Returns (tokens kept, why the row ends or "length")."""
    d = min(block.prefix, block.end) - 1  # drafted positions 1..d
    drafted = block.host[1:d + 1]
    rows, counts = logits[:d + 1].float(), draft_counts(row, block.host[:d + 1])
    flat = collapsed(rows)
    rows = row.allowed(rows, block.host[:d + 1], skip=1)  # row i follows the block's first i + 1 tokens
    rows = row.keep_going(rows, range(len(row.committed) + 1, len(row.committed) + d + 2))
    if row.s.greedy:
        t, conf, _ = sampling.decide(rows, counts, row.s, row.generator)
        host = torch.cat([t, logits_health(flat, conf).reshape(1)]).tolist()
        if host[-1] != OK:
            check_logits(row, host[-1], f"block {block.index}, the draft's commit")
        n = greedy_accept(drafted, host[:d])
        row.next_token = host[n]
    else:
        p = sampling.sampling_probs(rows, counts, row.s)
        q = block.q[:d] if d else p[:0]  # nothing drafted (a block of one): the causal token only
        n, row.next_token = speculative_accept(torch.tensor(drafted, device=rows.device, dtype=torch.long),
                                                     q, p, row.generator)
    # log-probabilities (when asked for) under the causal pass's distribution, as AR's: row i of ``rows``
    # chose the token at position i + 1, drafted[i] where accepted, the next c0 at the first difference
    details = row.info.chosen(row.info.distribution(rows, counts, row.s), list(range(n + 1)),
                              drafted[:n] + [row.next_token])
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
