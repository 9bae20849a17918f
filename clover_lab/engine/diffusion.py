"""Block diffusion (spec section 4), the decoder of the step loop's diffusion rows: after the
prompt's prefill, each block starts as mask tokens and is resolved by previews, one denoising step each, until
no position is masked. The first preview of a block is fused with the commit of the previous
block (one forward); a row's last block is committed on its own, so the cache ends up holding
the whole response.

Cost discipline: one device-to-host transfer per denoising step and row (the unmask decision,
the candidates, which the decoder needs to know what is left to do, and whether the step's logits
were finite: NaN or inf logits end the run with a GenerationError naming block, step and
source, never a garbage token); ``denoise.step`` events are built only when a hook is
attached, and never add a transfer.

Ending early: ``event.stop()`` or StopGeneration in a ``denoise.step`` hook keeps the block's
resolved contiguous prefix, commits it and fires ``block.commit``; in a ``block.commit`` hook it
ends the row after that block. StopGeneration raised inside a forward (a model hook) abandons
that forward, which changed nothing, and ends every row (their shared forward did not happen);
a finished block whose fused commit was abandoned is still returned, and
``stats.cache_complete`` is then False. Raised during the prefill, it ends the rows with no
tokens (``stop_reason`` "hook").

Looking ahead (a policy's ``look_ahead``, ``policies.py``): the next block, made early
(``row.ahead``), is previewed in the current block's forward on one canvas and takes a
look-ahead step after the block's (``denoise_step(..., ahead_of=block)``); it begins with those
tokens, and one resolved entirely still takes the fused forward that commits the block before it.
"""
from __future__ import annotations

import torch

from clover_lab.engine.faults import check_logits
from clover_lab.engine.policies import blame_confidences, check_proposal_values, checked_proposal, policy_flag
from clover_lab.engine.requests import GenerationError
from clover_lab.engine.runner import Part, Reader
from clover_lab.engine.sampling import NONFINITE, OK, apply_penalties, collapsed, logits_health
from clover_lab.hooks import points
from clover_lab.hooks.events import StepEvent
from clover_lab.hooks.registry import HookError, StopGeneration


class Block:
    """One block being resolved: the canvas on the device, and the host's copy of it (None where
    still masked). Positions at or past ``end`` are dropped (after an EOS, a stop string or a
    stopping hook)."""

    def __init__(self, index: int, length: int, mask_id: int, device, max_steps: int | None):
        self.index = index
        self.canvas = torch.full((length,), mask_id, dtype=torch.long, device=device)
        self.host: list[int | None] = [None] * length
        self.masked = list(range(length))
        self.end, self.end_reason = length, None
        self.prefix = 0  # length of the resolved contiguous prefix
        self.step = 0
        # without hooks a block never needs more than its length in steps (each unmasks >= 1)
        self.limit = min(max_steps or length, length)
        self.memo = None  # the decoding policy's own, per row and block (DecodingPolicy.begin_block)

    def __len__(self) -> int:
        return len(self.host)

    def masked_index(self) -> torch.Tensor | None:
        """The still-masked positions as a device index, or None while all are masked."""
        return None if len(self.masked) == len(self) else torch.tensor(self.masked, device=self.canvas.device)

    def place(self, tokens: dict[int, int], eos: set[int]) -> None:
        """Host side of a step: tokens placed, an EOS ends the block after itself."""
        for p, t in tokens.items():
            self.host[p] = t
            if t in eos and p < self.end:
                self.end, self.end_reason = p + 1, "eos"
        while self.prefix < len(self) and self.host[self.prefix] is not None:
            self.prefix += 1

    def cut(self, end: int, reason: str) -> None:
        if end < self.end or reason == "hook":
            self.end, self.end_reason = min(end, self.end), reason

    def next_step(self) -> None:
        self.masked = [p for p in self.masked if self.host[p] is None and p < self.end]
        self.step += 1

    def tokens(self) -> list[int]:
        return self.host[:self.end]


# --------------------------------------------------------------------------- the decoder
JOIN_STEPS = 2  # rows in step: one that arrives begins at once while the others are this few steps into their blocks


def advance(loop, rows: list) -> None:
    """One step of a cohort's block-diffusion rows (``step_loop.py``), first done, first out: a
    row whose block is resolved does not wait for the others. One that ends (EOS, a stop string,
    its length, a hook) commits its last block at once and leaves; the others begin their next
    block at the next step, whose first preview commits the finished one in the same forward,
    packed beside the other rows' previews (``Runner.preview``'s ``committing``: one forward per
    block length and look-ahead whatever the rows' phases; on the static steps, or with a hook
    inside the model, the rows that commit take a forward of their own). Each row decides its own
    unmasking from its own logits and gives the tokens it gives alone.

    Where a commit cannot be packed beside others' previews (the static steps commit every row of
    their cache; a hook inside the model would see the padding rows), and for a request with an
    expert coreset (one set of experts per block for the rows of the step), the rows keep in step:
    they begin their blocks together once none is resolving one, and a row that arrives begins at
    once while the others are at most ``JOIN_STEPS`` steps into their blocks (else it waits for
    their next boundary). ``loop.in_step`` keeps them in step everywhere (what
    ``bench/bench_step_loop.py`` compares with).

    Why no waves otherwise: rows that began a block together used to begin the next one together,
    so a short request beside a long one waited for the long one's blocks (a 16-token request ended
    at step 15 instead of 4). With the commit packed beside the previews, not waiting costs no
    forward."""
    lockstep = loop.in_step or loop.runner.coreset is not None or not loop.runner.packs_commits(rows[0].hooks)
    if not lockstep:
        for row in rows:
            begin_block(row)
    elif not any(resolving(row) for row in rows):  # a boundary for every row
        for row in rows:
            begin_block(row)
        if loop.runner.coreset is not None:
            loop.runner.coreset.reset()
    elif loop.runner.coreset is None and max(row.block.step for row in rows if resolving(row)) <= JOIN_STEPS:
        for row in rows:
            if row.block is None and row.pending is None:  # arrived: joins the young blocks
                begin_block(row)
    groups: dict[tuple, list] = {}
    for row in rows:
        if resolving(row):
            # on the static steps rows that commit take a forward of their own; with a hook inside the
            # model, so do rows at another block or step (its events name one of each)
            apart = not loop.runner.packs_commits(row.hooks)
            fused = len(row.pending[0]) if row.pending is not None else 0
            seen = (row.block.index, row.block.step) if row.hooks.model_hooks_attached() else None
            groups.setdefault((len(row.block), looks_ahead(row), fused if apart else None, seen), []).append(row)
    decided = []  # every row's decision of this step, read by the host at once
    for (_, ahead, _, _), group in groups.items():
        for part in by_commit_length(group):
            part = [row for row in part if row.live]  # a commit hook may have ended a row
            if part:
                decided += preview(loop, part, bool(ahead))
    settle(decided)
    if lockstep and any(resolving(row) for row in rows if row.live):
        return  # rows in step end their blocks together
    end_blocks(loop, [row for row in rows if row.live and row.block is not None and not resolving(row)])


def schedule(loop, rows: list) -> list:
    """A packed step (``StepLoop._step_packed``): each row's segment of the step's one forward,
    first done, first out: a row that ends commits its last block (and leaves, :func:`closed`);
    the others preview their block (and the next one, looking ahead), committing the finished
    block before it in the same segment on the block's first step (a block the look-ahead
    resolved entirely only commits that one)."""
    parts = []
    for row in rows:
        if row.closing is not None:
            tokens = row.pending[0]
            parts.append(Part(row, torch.tensor(tokens, device=row.device), len(tokens), 0, [], "commit",
                              lambda logits, row=row: closed(loop, row)))
            continue
        begin_block(row)
        if not resolving(row):
            continue
        block = row.block
        ahead = looks_ahead(row)
        commit = row.pending[0] if row.pending is not None else []
        if not block.masked:  # resolved by the look-ahead: only the finished block's commit is left
            canvas, want = block.canvas[:0], []
        elif ahead:
            canvas = torch.cat([block.canvas, row.ahead.canvas])
            want = block.masked + [len(block) + p for p in row.ahead.masked]
        else:
            canvas, want = block.canvas, list(block.masked)
        ids = torch.cat([torch.tensor(commit, device=row.device, dtype=torch.long), canvas]) if commit else canvas
        parts.append(Part(row, ids, len(commit), canvas.shape[0], [len(commit) + p for p in want], "preview" if want else "commit",
                          lambda logits, row=row, ahead=bool(ahead): previewed(loop, row, logits, ahead),
                          fused=bool(commit) and bool(want)))
    return parts


def previewed(loop, row, logits: torch.Tensor, ahead: bool) -> list:
    """A packed step's preview of the row's block (``logits`` [N, V] at its masked positions, then
    its next block's when looking ahead): the finished block it committed joins the response,
    and the row's policy decides on the device; returns what the host reads (:func:`schedule`)."""
    if row.pending is not None:
        publish_pending(loop, [row])
    block = row.block
    if not row.live or not block.masked:
        return []
    n = len(block.masked)
    after = look_ahead_step(row, logits[None, n:], True) if ahead else None
    d = decide(row, block, logits[None, :n], block.masked_index())

    def read(values):
        unmask, _ = take(d, values)
        row.update("step", block.index, block.step - 1, block.host, unmask)
        if after is not None:
            after()
    return [(d.host, Reader(row, read))]


def closed(loop, row) -> list:
    """A packed step committed the row's last block: it joins the response, ``block.commit``
    fires, and the row leaves."""
    (tokens, steps), row.pending = row.pending, None
    reason, row.closing = row.closing, None
    index, start = row.stats.blocks, len(row.prompt_ids) + len(row.committed)
    row.record_block(tokens, steps)
    row.fire_commit(index, tokens, steps, start)  # the row ends anyway
    row.update("commit", index, None)
    loop.end([row], reason)
    return []


def finish(loop, rows: list) -> None:
    """After a packed step's reads: the rows whose blocks are resolved end them; one that ends
    commits its last block in the next step's forward (:func:`end_blocks`, ``defer``)."""
    end_blocks(loop, [row for row in rows if row.live and row.closing is None and row.block is not None
                      and not resolving(row)], defer=True)


def by_commit_length(rows: list) -> list[list]:
    """Rows that share a preview forward, by the length of the finished block they commit in it:
    rows with none go with the first (they pad theirs)."""
    parts: dict[int, list] = {}
    for row in rows:
        parts.setdefault(len(row.pending[0]) if row.pending is not None else 0, []).append(row)
    plain = parts.pop(0, [])
    if not parts:
        return [plain]
    out = list(parts.values())
    out[0] = sorted(plain + out[0], key=rows.index)
    return out


def resolving(row) -> bool:
    """The row has a block with masked positions, or one waiting for the fused forward that commits
    the block before it (a block the look-ahead resolved entirely)."""
    return row.block is not None and (bool(row.block.masked) or row.pending is not None)


def begin_block(row) -> None:
    """The row's next block: begun by the look-ahead, or new (a row that joined: its first)."""
    if row.block is not None:
        return
    row.produced = len(row.committed) + len(row.pending[0] if row.pending else ())
    if row.ahead is not None:
        row.block, row.ahead = row.ahead, None
    else:
        row.block = new_block(row, row.stats.blocks + (row.pending is not None), row.max_new - row.produced)


def new_block(row, index: int, room: int) -> Block:
    block = Block(index, min(row.block_size, room), row.engine.mask_token_id, row.device, row.s.max_steps_per_block)
    block.memo = row.policy.begin_block(row, block)
    return block


def looks_ahead(row) -> int:
    """The length of the row's next block (made here when new) if this step previews it too (its
    policy asks, and the row has one: this block does not end it), else 0."""
    block = row.block
    room = row.max_new - row.produced - len(block)
    if not block.masked or block.end_reason is not None or room <= 0 or not policy_flag(
            row.policy, "look_ahead", row.policy.look_ahead(row, block), f"block {block.index}, step {block.step}"):
        return 0
    if row.ahead is None:
        row.ahead = new_block(row, block.index + 1, room)
    return len(row.ahead) if row.ahead.masked else 0


def preview(loop, rows: list, ahead: bool = False) -> list:
    """One denoising step of these rows' blocks, in one forward (fused with the commit of the
    finished blocks of the rows that have one, on a block's first step: all of the same length;
    ``ahead``: their next blocks previewed after them, on one canvas, and taking a look-ahead step).
    Returns the rows' decisions, for :func:`settle` to read and take."""
    m = len(rows[0].block)
    canvas = torch.stack([torch.cat([row.block.canvas, row.ahead.canvas]) if ahead else row.block.canvas
                          for row in rows])
    first = rows[0]
    one = None if len(rows) > 1 else first.block.masked_index() if not ahead else torch.tensor(
        first.block.masked + [m + p for p in first.ahead.masked], device=first.device)  # one row: where masked
    at = first.block
    committing = [row.pending is not None for row in rows]
    fused = [row for row in rows if row.pending is not None]
    pending = None
    if fused:
        pad = [first.engine.mask_token_id] * len(fused[0].pending[0])  # a row without a finished block pads
        pending = torch.tensor([row.pending[0] if row.pending is not None else pad for row in rows],
                               device=first.device)
    where = loop.where(rows, "decode", at.index, at.step, commit_block=at.index - 1 if all(committing) else None)
    with loop.forward("preview", rows, fused={row.key for row in fused}):
        logits = loop.runner.use(first.hooks).preview([row.key for row in rows], canvas, where, pending, one,
                                                      committing if fused and not all(committing) else None)
    if fused:
        publish_pending(loop, fused)
    decided = []
    for i, row in enumerate(rows):
        block = row.block
        if not row.live or not block.masked:  # a commit hook ended the row; a block resolved ahead
            continue
        n, idx = len(block.masked), block.masked_index()
        mine = logits[i:i + 1, :n] if one is not None else logits[i:i + 1, :m]
        after = None
        if ahead:  # the next block's look-ahead step, once the block's own is taken
            after = look_ahead_step(row, logits[i:i + 1, n:] if one is not None else logits[i:i + 1, m:], one)
        decided.append((row, decide(row, block, mine if idx is None or one is not None else mine[:, idx], idx), after))
    return decided


def look_ahead_step(row, logits: torch.Tensor, one):
    """The look-ahead step of the row's next block from its ``logits``, taken after the block's own
    step (it reads where that left the block): not streamed, the next block has not begun."""
    def step():
        block, nxt = row.block, row.ahead
        if block.end_reason is None:
            idx = nxt.masked_index()
            denoise_step(row, nxt, logits if idx is None or one is not None else logits[:, idx], idx, ahead_of=block)
    return step


def settle(decided: list) -> None:
    """The step's decisions, read by the host in one transfer for every row (a synchronisation on
    a GPU), then taken row by row: checks, ``denoise.step`` hooks, the canvases, a "step" update."""
    if not decided:
        return
    values = torch.cat([d.host for _, d, _ in decided]).tolist()
    at = 0
    for row, d, after in decided:
        n, at = d.host.shape[0], at + d.host.shape[0]
        if not row.live:  # a hook of an earlier row's step ended it
            continue
        unmask, _ = take(d, values[at - n:at])
        row.update("step", d.block.index, d.block.step - 1, d.block.host, unmask)
        if after is not None:
            after()


def publish_pending(loop, rows: list) -> None:
    """The fused forward committed each row's previous block: it joins the row's response and
    fires ``block.commit``; a row whose hook asks to stop ends here."""
    stopped = []
    for row in rows:
        (tokens, steps), row.pending = row.pending, None
        start, index = len(row.prompt_ids) + len(row.committed), row.stats.blocks
        row.record_block(tokens, steps)
        if row.fire_commit(index, tokens, steps, start):
            stopped.append(row)
        row.update("commit", index, None)
    loop.end(stopped, "hook")


def end_blocks(loop, rows: list, defer: bool = False) -> None:
    """These rows' blocks are resolved: the rows that end commit their last blocks and leave, the
    others' blocks wait for their fused commit (the next step's first preview). ``defer``: a
    packed step: the rows that end commit their last blocks in the next step's forward
    (``row.closing``: why they end), beside the other rows' segments."""
    leaving = []
    for row in rows:
        block, row.block = row.block, None
        if block is None:
            continue
        tokens = block.tokens()
        if block.end_reason is not None or row.produced + len(tokens) >= row.max_new:
            if defer and tokens:
                row.pending, row.closing = (tokens, block.step), block.end_reason or "length"
                continue
            leaving.append((row, tokens, block))
        else:
            row.pending = (tokens, block.step)
    commit_last(loop, leaving)


def commit_last(loop, leaving: list[tuple]) -> None:
    """The last blocks of the rows that end now, committed on their own (rows whose blocks are
    as long share a forward), so that the cache holds each row's whole response."""
    by_length: dict[int, list[tuple]] = {}
    for item in leaving:
        by_length.setdefault(len(item[1]), []).append(item)
    reasons = {}
    for length, group in by_length.items():
        rows = [row for row, _, _ in group]
        reasons.update({row.key: block.end_reason or "length" for row, _, block in group})
        if not length:
            continue
        starts = {row.key: len(row.prompt_ids) + len(row.committed) for row in rows}
        ids = torch.tensor([tokens for _, tokens, _ in group], device=rows[0].device)
        try:
            with loop.forward("commit", rows):
                loop.runner.use(rows[0].hooks).commit([row.key for row in rows], ids,
                                                      loop.where(rows, "decode", commit_block=group[0][2].index))
        except StopGeneration:  # a model hook stopped it: the blocks are the rows' last, not cached
            for row, tokens, block in group:
                row.record_block(tokens, block.step)
                reasons[row.key] = "hook"
            loop.end(rows, reasons, cache_complete=False)
            continue
        for row, tokens, block in group:
            row.record_block(tokens, block.step)
            row.fire_commit(block.index, tokens, block.step, starts[row.key])  # the row ends anyway
            row.update("commit", block.index, None)
    loop.end([row for row, _, _ in leaving], reasons)


def abandon(loop, rows: list) -> None:
    """A model hook stopped a shared forward: these rows end; a finished block that was waiting
    for its fused commit is part of its row's response, but not in the cache."""
    for row in rows:
        row.keep_pending()
    loop.end(rows, "hook")


# --------------------------------------------------------------------------- one denoising step
def denoise_step(run, block: Block, logits: torch.Tensor, idx: torch.Tensor | None,
                 ahead_of: Block | None = None) -> tuple[list[int], bool]:
    """The row's policy decides, ``denoise.step`` hooks may change the decision, and it is
    applied to the canvas and the host copy. ``run``: the row; ``logits`` [1, N, V] at the
    masked positions ``idx`` (None: all). ``ahead_of``: a look-ahead step of the next block beside
    the row's block ``ahead_of`` (propose_ahead decides, maybe nothing; stop strings wait for the
    block's own steps). Returns (the positions unmasked, whether a hook asked to stop). One row's
    step: :func:`decide` on the device, the host reads its ``host`` tensor, :func:`take`."""
    decision = decide(run, block, logits, idx, ahead_of)
    return take(decision, decision.host.tolist())


class Decision:
    """A row's denoising step decided on the device (:func:`decide`), before the host has read it:
    ``host`` the 1-D tensor it needs read (the unmask flags, the candidates, the logits' health),
    which the rows of a step read in one transfer."""

    __slots__ = ("run", "block", "logits", "idx", "ahead_of", "finish", "cand", "conf", "flags", "logp", "host",
                 "rule")

    def __init__(self, **fields):
        for k, v in fields.items():
            setattr(self, k, v)


def decide(run, block: Block, logits: torch.Tensor, idx: torch.Tensor | None, ahead_of: Block | None = None) -> Decision:
    """The device half of :func:`denoise_step`: the row's policy proposes from ``logits``; nothing
    is read back to the host."""
    mask_id = run.engine.mask_token_id
    logits = logits[0].float()  # [N, V]
    flat = collapsed(logits)  # before the mask column is -inf
    logits[:, mask_id] = float("-inf")  # the mask token is never a candidate
    start = run.produced + (len(ahead_of) if ahead_of is not None else 0)  # the block's first response position
    run.keep_going(logits, [start + p for p in block.masked])  # no end before min_tokens
    N, where, ahead = len(block.masked), f"block {block.index}, step {block.step}", ahead_of is not None
    rule = where if run.row is None else f"row {run.row}, {where}"  # where a rule's word is faulted
    if ahead_of is None:
        finish = policy_flag(run.policy, "finishes_block", run.policy.finishes_block(run, block), rule)
        proposal = run.policy.propose(run, block, logits, finish)  # the decoding rule (policies.py)
    else:
        finish, proposal = False, run.policy.propose_ahead(run, ahead_of, block, logits)
        block.limit += run.s.max_steps_per_block is None  # the block's own steps keep the limit of its length
    cand, conf, flags = checked_proposal(run.policy, proposal, N, logits.device, rule, ahead)
    logp = run.info.distribution(logits, run.counts, run.s)  # None unless log-probabilities are asked for
    # what the host reads: decision, candidates, and whether the logits could be used (NaN or inf
    # logits make their row's confidence NaN, equal ones carry no answer: argmax would pick token 0
    # either way)
    host = torch.cat([flags.long(), cand, logits_health(flat, conf).reshape(1)])
    return Decision(run=run, block=block, logits=logits, idx=idx, ahead_of=ahead_of, finish=finish, cand=cand,
                    conf=conf, flags=flags, logp=logp, host=host, rule=rule)


def take(d: Decision, host: list) -> tuple[list[int], bool]:
    """The host half of :func:`denoise_step`, from ``host``, the values of ``d.host``: checks,
    ``denoise.step`` hooks, the decision applied to the canvas and the host copy."""
    run, block, logits, idx, ahead_of, finish = d.run, d.block, d.logits, d.idx, d.ahead_of, d.finish
    cand, conf, flags, logp, rule = d.cand, d.conf, d.flags, d.logp, d.rule
    mask_id = run.engine.mask_token_id
    N, where, ahead = len(block.masked), f"block {block.index}, step {block.step}", ahead_of is not None
    flags_host, cand_host = host[:N], host[N:2 * N]
    if host[2 * N] == NONFINITE:  # the rule's confidences, or the model's logits?
        blame_confidences(run.policy, logits, mask_id, rule, ahead)
    if host[2 * N] != OK:
        check_logits(run, host[2 * N], where, block.canvas)
    check_proposal_values(run.policy, cand_host, run.model.config.vocab_size, mask_id, rule, ahead)
    if finish and not all(flags_host) or not any(flags_host) and ahead_of is None:
        raise GenerationError(f"{type(run.policy).__name__}.propose: block {block.index}, step {block.step}: "
                              f"{'the last step must unmask every' if finish else 'a step must unmask at least one'} "
                              f"masked position ({sum(map(bool, flags_host))} of {N})")
    unmask = [block.masked[i] for i, f in enumerate(flags_host) if f]
    chosen = dict(zip(block.masked, cand_host))
    overrides: dict[int, int] = {}
    stop_now = False
    if run.hooks.active(points.DENOISE_STEP):
        chosen_unmask = unmask
        decided = apply_penalties(logits, run.counts, run.s) if run.counts is not None else logits
        unmask, overrides, stop_now = fire_step(run, block, cand, conf, unmask, decided)
        if overrides or unmask != chosen_unmask:
            _place_on_device(run, block, {p: overrides.get(p, chosen[p]) for p in unmask})
        else:
            _apply_decision(run, block, flags, cand, idx)
    else:
        _apply_decision(run, block, flags, cand, idx)
    placed = {p: overrides.get(p, chosen[p]) for p in unmask}
    block.place(placed, run.eos)
    run.info.note(block, block.step, placed,
                  run.info.chosen(logp, [block.masked.index(p) for p in placed], list(placed.values())))
    if run.stop_strings is not None and block.prefix and ahead_of is None:
        k = run.stop_strings.find(run.committed + block.host[:min(block.prefix, block.end)])
        if k is not None:
            block.cut(k - len(run.committed), "stop_string")
    if stop_now:
        block.cut(block.prefix, "hook")
    block.next_step()
    return unmask, stop_now


def _apply_decision(run, block: Block, flags: torch.Tensor, cand: torch.Tensor, idx: torch.Tensor | None) -> None:
    """The rule's decision as it stands, on the device, without a host round trip."""
    sel = block.canvas[idx] if idx is not None else block.canvas
    new = torch.where(flags, cand, sel)
    if idx is None:
        block.canvas.copy_(new)
    else:
        block.canvas[idx] = new
    if run.counts is not None:
        run.counts.index_add_(0, cand, flags.to(run.counts.dtype))


def _place_on_device(run, block: Block, tokens: dict[int, int]) -> None:
    """A decision a hook changed: exactly these tokens at these positions."""
    if not tokens:
        return
    pos_t = torch.tensor(list(tokens), device=run.device)
    tok_t = torch.tensor(list(tokens.values()), device=run.device)
    block.canvas[pos_t] = tok_t
    if run.counts is not None:
        run.counts.index_add_(0, tok_t, torch.ones_like(tok_t, dtype=run.counts.dtype))


def fire_step(run, block: Block, cand, conf, unmask: list[int], logits) -> tuple[list[int], dict[int, int], bool]:
    """``denoise.step`` hooks on this step's decision (``logits`` [N, V]: what it decided from,
    after the row's penalties); returns it (validated) as (positions to unmask, tokens overriding
    candidates, stop)."""
    # copies: the decision is taken, so edits of the event's tensors could only make the device
    # canvas and the returned tokens disagree; changes go through unmask / set_token
    event = StepEvent(block.index, block.step, block.canvas.clone(), list(block.masked), cand.clone(), conf.clone(),
                      list(unmask), run.now(), logits=logits, where=run.where("decode", block.index, block.step))
    try:
        run.hooks.fire(points.DENOISE_STEP, event)
    except StopGeneration:
        event.stopped = True
    except Exception as e:  # noqa: BLE001 - a HookError ends this row's request only, not its forward's others
        run.handle.fail(e)
        event.stopped = True
    unmask, overrides = checked_decision(event, block.masked, run.model.config.vocab_size, run.engine.mask_token_id)
    bound = len(block)  # the block's real length, not engine.block_size: a short block is bounded as tightly
    if block.step + 1 > block.limit + bound and unmask != block.masked:
        row = "" if getattr(run, "row", None) is None else f"row {run.row}, "
        raise HookError(points.DENOISE_STEP, RuntimeError(
            f"{row}block {block.index}: hooks kept positions masked {bound} steps past the step limit"))
    return unmask, overrides, event.stopped


def checked_decision(event: StepEvent, masked: list[int], vocab: int,
                     mask_id: int | None = None) -> tuple[list[int], dict[int, int]]:
    """The step hook's decision, validated: positions must be masked, tokens in the vocabulary and
    not the mask token (a mask in the result would be hidden by the text but kept in token_ids)."""
    allowed = set(masked)
    try:
        unmask = sorted({int(p) for p in (event.unmask.tolist() if isinstance(event.unmask, torch.Tensor)
                                           else event.unmask)})
        tokens = {int(p): int(t) for p, t in event.tokens.items()}
    except (TypeError, ValueError, AttributeError) as e:
        raise HookError(points.DENOISE_STEP, TypeError(f"unmask must be block positions and tokens a dict "
                                                       f"position -> token id ({e})")) from e
    bad = [p for p in unmask if p not in allowed]
    if bad:
        raise HookError(points.DENOISE_STEP, ValueError(f"positions {bad} cannot be unmasked: not masked "
                                                        f"(still masked: {masked})"))
    bad_tok = {p: t for p, t in tokens.items() if not 0 <= t < vocab}
    if bad_tok:
        raise HookError(points.DENOISE_STEP, ValueError(f"tokens {bad_tok} are outside the vocabulary [0, {vocab})"))
    masks = [p for p, t in tokens.items() if t == mask_id]
    if masks:
        raise HookError(points.DENOISE_STEP, ValueError(f"positions {masks} set to the mask token {mask_id}: an "
                                                        f"unmasked position needs a real token"))
    missing = [p for p in tokens if p not in unmask]
    if missing:
        raise HookError(points.DENOISE_STEP, ValueError(f"tokens set for positions {missing} that are not unmasked"))
    return unmask, tokens
