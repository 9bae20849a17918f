"""AR with the trunk's own multi-token-prediction head (issue 53), the decoder of the step loop's
"mtp" rows: what users serve Qwen3.5/3.6 with (vLLM's and SGLang's ``speculative_config``
``{"method": "mtp", "num_speculative_tokens": k}``), on the same engine as Clover's modes.

A cycle, per row:

1. the causal token c0 at the row's next position, from the last forward's logits (the
   prompt's prefill, or the previous verify's row at the last kept token), decided as AR decides
   it (``speculative.begin_cycle``);
2. the head (``model/prediction_head.py``) drafts ``mtp_draft_tokens`` = k tokens: one head forward over the
   trunk states the last cycle kept (their slots of the head's cache) and c0 gives the first
   draft, each further head forward feeds the head's own output back (greedy rows take the
   head's argmax; sampled rows draw from its distribution q, kept for the acceptance);
3. one trunk forward commits ``[c0, d1 .. dk]`` causally (``CloverModel.commit_draft``), the
   trunk states of its rows kept (``CloverModel.keeping_hidden``) for the next cycle's head;
4. acceptance, the cache cut back, ``block.commit``, the row's end: exactly speculative mode's
   (``speculative.verify``): the first disagreement is replaced by the trunk's own choice, so
   greedy rows give AR's greedy tokens and sampled rows follow AR's distribution (exact
   rejection sampling, ``acceptance.py``).

So a cycle costs one trunk forward (and k small head forwards) and yields 1 + accepted tokens. The
head's forwards of a step's rows are one forward each (``HeadCache``: a batch row of the head's
K,V cache per row, slots = trunk positions); a row's slots hold the trunk positions whose states
it was given, the drafted slots past them being scratch, written over by the next cycle's first
head forward. The prompt's states go in at the prefill, so that a cycle's first head forward
takes at most k + 1 positions per row (the rows' pending states, padded to the longest).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from clover_lab.engine import sampling, speculative

FILLER = 0  # the id of a block's positions past a drafted EOS (committed, never kept)


@dataclass
class HeadState:
    """A row's place in the head: the trunk's states not yet given to the head ``hidden`` [P, H]
    (before the final norm), the tokens after each of them but the last ``tokens`` (P - 1; the
    last one's is the next c0), and ``slots``: the head's slots the row holds (its trunk
    positions given to the head)."""
    hidden: torch.Tensor
    tokens: list
    slots: int = 0


class HeadCache:
    """The head's K,V cache of a step loop's mtp rows (``loop.heads``), a batch row per row, in
    ``rows``' order: a step's head forwards run all its rows at once. Rows join at their prefill
    (the cache grows: a copy); rows that have left are dropped when rows next draft."""

    def __init__(self, cache, rows: list):
        self.cache, self.rows = cache, rows

    @classmethod
    def joined(cls, model, pool: "HeadCache | None", rows: list, part) -> "HeadCache":
        """``pool``'s rows going on, then ``rows``, whose slots ``part`` holds (a cache of their own)."""
        going = [] if pool is None else [row for row in pool.rows if row.live]
        if not going:
            return cls(part, list(rows))
        cache = model.mtp.new_cache(slots_needed(going + list(rows)), len(going) + len(rows), model.device,
                                    model.dtype)
        cache.put(list(range(len(going))), pool.cache.select([pool.rows.index(row) for row in going]))
        cache.put(list(range(len(going), len(going) + len(rows))), part)
        return cls(cache, going + list(rows))

    def part(self, rows: list):
        """(a cache of ``rows``' slots, in their order; a function that writes it back): the cache
        itself when they are all its rows, else a copy of theirs (rows of another cohort)."""
        if any(not row.live for row in self.rows):
            going = [i for i, row in enumerate(self.rows) if row.live]
            self.cache, self.rows = self.cache.select(going), [self.rows[i] for i in going]
        if rows == self.rows:
            return self.cache, lambda: None
        index = [self.rows.index(row) for row in rows]
        part = self.cache.select(index)
        return part, lambda: self.cache.put(index, part)


def slots_needed(rows: list) -> int:
    """The head's slots per row for these rows: a row's trunk positions, then a cycle's scratch
    (its pending states padded to the most any row has, k + 1, and k - 1 chained drafts)."""
    k = max(row.s.mtp_draft_tokens for row in rows)
    return max(len(row.prompt_ids) + row.max_new for row in rows) + 2 * k + 2


def advance(loop, rows: list) -> None:
    """One cycle of a cohort's mtp rows: the rows draft with the head (one head forward per draft
    position for all of them), then commit their drafts (one trunk forward per draft length) and
    each accepts on its own."""
    model = loop.engine.model
    for row in rows:
        speculative.begin_cycle(row, min(row.s.mtp_draft_tokens + 1, speculative.room(loop, row)), filler=FILLER)
    draft(loop, model, rows)
    groups: dict[int, list] = {}
    for row in rows:
        groups.setdefault(len(row.block), []).append(row)
    for group in groups.values():
        verify(loop, model, group)


@torch.no_grad()
def draft(loop, model, rows: list) -> None:
    """The head's drafts of the rows' blocks ``[c0, mask, ...]`` (positions ``block.masked``), one
    head forward per draft position over every row. The first gives the head each row's trunk
    states the last cycle kept, with c0 after the last (it runs even when a row drafts nothing:
    an EOS c0, a block of one); rows whose draft has ended ride along until the last has."""
    head = model.require_mtp()
    cache, write_back = loop.heads.part(rows)
    R, device = len(rows), model.input_device
    counts = [len(row.mtp.hidden) for row in rows]  # pending states per row (1 + the last accepted)
    T = max(counts)
    hidden = torch.zeros(R, T, model.config.hidden_size, device=device, dtype=rows[0].mtp.hidden.dtype)
    ids = torch.full((R, T), FILLER, device=device, dtype=torch.long)
    for i, row in enumerate(rows):  # padded past a row's own: scratch slots past its length
        hidden[i, :counts[i]] = row.mtp.hidden
        ids[i, :counts[i]] = torch.tensor(row.mtp.tokens + [row.block.host[0]], device=device)
    cache.set_row_lengths([row.mtp.slots for row in rows])
    out, logits = head(model, cache, model.model.norm(hidden), ids, 0)  # the trunk's states after its final norm
    last = torch.tensor([n - 1 for n in counts], device=device)
    out, logits = out[torch.arange(R), last][:, None], logits[torch.arange(R), last]  # [R, 1, H], [R, V]
    for row, n in zip(rows, counts):
        row.mtp.slots += n  # the trunk positions the head has been given
    cache.set_row_lengths([row.mtp.slots for row in rows])
    qs = [[] for _ in rows]
    going = [i for i, row in enumerate(rows) if row.block.masked]
    step, tokens = 0, [FILLER] * R
    while going:
        greedy = logits.argmax(-1).tolist() if any(rows[i].s.greedy for i in going) else None
        for i in going:
            row, block = rows[i], rows[i].block
            if row.s.greedy:
                t = greedy[i]
            else:
                q = sampling.sampling_probs(logits[i][None].float(), row.counts, row.s)[0]
                t = int(torch.multinomial(q, 1, generator=row.generator))
                qs[i].append(q)
            p = block.masked[step]
            block.canvas[p] = t
            block.place({p: t}, row.eos)  # past a drafted EOS nothing is drafted
            tokens[i] = t
        going = [i for i in going if step + 1 < len(rows[i].block.masked)
                 and rows[i].block.masked[step] + 1 < rows[i].block.end]
        if going:
            step += 1
            out, logits = head(model, cache, out, torch.tensor(tokens, device=device)[:, None], step)
            logits = logits[:, -1]
    write_back()
    for row, q in zip(rows, qs):
        row.block.masked = []
        row.block.step = 1
        if q:
            row.block.q = torch.stack(q)


def verify(loop, model, rows: list) -> None:
    """One trunk forward commits these rows' drafts (``speculative.verify``: acceptance, the cache
    cut back, ``block.commit``, ends), its states kept for each row's next head forward."""
    before = [len(row.committed) for row in rows]
    with model.keeping_hidden() as kept:
        speculative.verify(loop, rows)
    states = kept[0] if kept else None  # [R, m, H]: the commit's rows, in ``rows``' order
    for j, row in enumerate(rows):
        if not row.live or states is None:
            continue
        st, n = row.mtp, len(row.committed) - before[j]
        st.hidden = states[j, :n]
        st.tokens = row.committed[len(row.committed) - n + 1:]


def abandon(loop, rows: list) -> None:
    """A model hook stopped a forward, which changed nothing: these rows end."""
    loop.end(rows, "hook")


SPECULATIVE_METHODS = ("mtp", "qwen3_next_mtp", "qwen3_5_mtp")  # vLLM's names of the method (older ones too)


def speculative_config(text: str) -> int:
    """vLLM's ``--speculative-config`` JSON, ``{"method": "mtp", "num_speculative_tokens": k}``
    -> k (SGLang's ``--speculative-num-steps`` is the same k); a ValueError naming what is wrong."""
    import json

    try:
        config = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--speculative-config: not JSON ({e}); e.g. "
                         f"'{{\"method\": \"mtp\", \"num_speculative_tokens\": 3}}'") from None
    if not isinstance(config, dict):
        raise ValueError(f"--speculative-config: expected a JSON object, got {text!r}")
    unknown = sorted(set(config) - {"method", "num_speculative_tokens"})
    if unknown:
        raise ValueError(f"--speculative-config: unknown field(s) {unknown}; clover-lab reads method and "
                         f"num_speculative_tokens")
    if config.get("method") not in SPECULATIVE_METHODS:
        raise ValueError(f"--speculative-config: method {config.get('method')!r} is not served here; expected "
                         f"\"mtp\" (the model's own multi-token-prediction head)")
    k = config.get("num_speculative_tokens", 3)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer >= 1, got {k!r}")
    return k


@contextlib.contextmanager
def prefill(loop, rows: list):
    """Around the prefill of ``rows``: the mtp rows among them keep their prompts' trunk states and
    give the head all but the last (one head forward; the last waits for c0), and join the loop's
    head cache (``loop.heads``) with slots for their whole length."""
    mine = [i for i, row in enumerate(rows) if row.mode == "mtp"]
    if not mine:
        yield
        return
    model = loop.engine.model
    with model.keeping_hidden() as kept:
        yield
    states = torch.cat(kept, dim=1)[mine]  # [R, T, H] of the mtp rows, the chunks joined
    head, new = model.require_mtp(), [rows[i] for i in mine]
    part = head.new_cache(slots_needed(new), len(new), model.device, model.dtype)
    T = states.shape[1]
    if T > 1:  # the prompt's states but the last, with the tokens after them (the last waits for c0)
        part.set_row_lengths([0] * len(new))
        ids = torch.tensor([row.prompt_ids[1:] for row in new], device=model.input_device)
        with torch.no_grad():
            head(model, part, model.model.norm(states[:, :-1]), ids, 0)
    for i, row in enumerate(new):
        row.mtp = HeadState(states[i, -1:], [], T - 1)
    loop.heads = HeadCache.joined(model, loop.heads, new, part)
