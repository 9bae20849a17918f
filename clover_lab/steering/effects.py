"""What a steer did to the tokens: a steered generation against the same request unsteered,
position by position.

    base = engine.generate(prompt, max_new_tokens=64)
    late = steering.steer(engine, prompt, plan, max_new_tokens=64)
    fx = steering.compare(base, late.result, from_step=3, tokenizer=engine.tokenizer)
    fx.changed            # TokenChange per response position that differs
    fx.kept_before        # (unchanged, total): tokens the unsteered run unmasked before step 3, in the
                          # blocks up to the first one that differs

Block diffusion commits a block before the next one starts, so a change in block b changes what
every later block reads: beyond the first block that differs, a difference says little about the
steer at that block. Within it (and before it), a steer that starts at step k cannot change a
token unmasked before step k: the previews before step k saw the same prefix and the same canvas,
unsteered. ``kept_before`` counts those tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from clover_lab.errors import InputError


@dataclass(frozen=True)
class TokenChange:
    """Response position ``index`` (block, position within it) differs: ``before`` (unsteered) and
    ``after`` (steered) token ids, None past a response's end; the steps that unmasked them (0 in
    AR, None past the end)."""

    index: int
    block: int
    position: int
    before: int | None
    after: int | None
    step_before: int | None
    step_after: int | None


@dataclass
class Effect:
    """A steered generation against the unsteered one (see the module's docstring)."""

    name: str
    compared: int
    changed: list[TokenChange] = field(default_factory=list)
    first_block: int | None = None
    from_step: int | None = None
    kept_before: tuple[int, int] | None = None
    text_before: str = ""
    text_after: str = ""
    pieces: dict = field(default_factory=dict, repr=False)  # token id -> its text

    @property
    def n_changed(self) -> int:
        return len(self.changed)

    @property
    def share_changed(self) -> float:
        return self.n_changed / self.compared if self.compared else 0.0

    def in_first_block(self) -> list[TokenChange]:
        return [c for c in self.changed if c.block == self.first_block]

    def summary(self) -> dict:
        """One row of a comparison table."""
        first = self.in_first_block()
        row = dict(schedule=self.name, compared=self.compared, changed=self.n_changed,
                   share=round(self.share_changed, 3), first_block=self.first_block,
                   changed_in_first_block=len(first),
                   first_changed_at_step=min((c.step_before for c in first if c.step_before is not None), default=None))
        if self.kept_before is not None:
            row["unmasked_before_k_kept"] = f"{self.kept_before[0]}/{self.kept_before[1]}"
        return row

    def describe(self, limit: int = 8) -> str:
        """The first changes in words: position, unsteered -> steered token, the steps that unmasked them."""
        out = []
        for c in self.changed[:limit]:
            b = "—" if c.before is None else repr(self.pieces.get(c.before, c.before))
            a = "—" if c.after is None else repr(self.pieces.get(c.after, c.after))
            out.append(f"block {c.block} pos {c.position}: {b} (step {c.step_before}) -> {a} (step {c.step_after})")
        more = f" ... and {self.n_changed - limit} more" if self.n_changed > limit else ""
        return "; ".join(out) + more if out else "no token changed"


def compare(base, steered, *, from_step: int | None = None, block_size: int | None = None, name: str = "",
            tokenizer=None) -> Effect:
    """The steered generation ``steered`` against ``base`` (GenerationResults of the same request).
    ``from_step``: the first step the steer added at (for ``kept_before``); ``block_size``: the
    generation's (default its stats'; AR: 1, a token per block)."""
    for what, r in (("base", base), ("steered", steered)):
        if not hasattr(r, "token_ids") or not hasattr(r, "unmask_steps"):
            raise InputError(f"compare: {what} must be a GenerationResult (engine.generate(...) or "
                             f"steering.steer(...).result), got {type(r).__name__}")
    if base.prompt_ids != steered.prompt_ids:
        raise InputError("compare: the two generations answer different prompts")
    if block_size is None:
        block_size = getattr(base.stats, "block_size", None) or 1
    a, b = base.token_ids, steered.token_ids
    n = max(len(a), len(b))
    changed = []
    for t in range(n):
        x = a[t] if t < len(a) else None
        y = b[t] if t < len(b) else None
        if x != y:
            changed.append(TokenChange(t, t // block_size, t % block_size, x, y,
                                       base.unmask_steps[t] if t < len(a) else None,
                                       steered.unmask_steps[t] if t < len(b) else None))
    first = changed[0].block if changed else None
    kept = None
    if from_step is not None:
        upto = (first + 1) * block_size if first is not None else len(a)
        early = [t for t in range(min(upto, len(a))) if base.unmask_steps[t] < from_step]
        kept = (sum(1 for t in early if t < len(b) and a[t] == b[t]), len(early))
    pieces = {}
    if tokenizer is not None:
        for t in {c.before for c in changed} | {c.after for c in changed}:
            if t is not None:
                pieces[t] = tokenizer.decode([t])
    return Effect(name, n, changed, first, from_step, kept, getattr(base, "text", None) or "",
                  getattr(steered, "text", None) or "",
                  pieces)
