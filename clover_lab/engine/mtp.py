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
head's K,V cache is the row's own (a batch of one, slots = trunk positions); after the verify it is
cut back to the trunk positions whose states it was given, the drafted slots being written over
by the next cycle's first head forward.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from clover_lab.engine import sampling, speculative

FILLER = 0  # the id of a block's positions past a drafted EOS (committed, never kept)


@dataclass
class HeadState:
    """A row's place in its head: ``cache`` (slots 0..n-1 hold trunk positions), the trunk's
    states not yet given to the head ``hidden`` [P, H] (before the final norm), and the tokens
    after each of them but the last ``tokens`` (P - 1; the last one's is the next c0)."""
    cache: object
    hidden: torch.Tensor
    tokens: list
    slots: int = 0  # the head's cache length once this cycle's trunk states are in it


def advance(loop, rows: list) -> None:
    """One cycle of a cohort's mtp rows: each row drafts with the head, then the rows commit their
    drafts (one trunk forward per draft length) and each accepts on its own."""
    longest = max(len(row.prompt_ids) + len(row.committed) for row in rows)
    room = loop.runner.cache.max_len - longest
    model = loop.engine.model
    for row in rows:
        k = row.s.mtp_draft_tokens
        speculative.begin_cycle(row, max(1, min(k + 1, room)), filler=FILLER)
        draft(model, row)
    groups: dict[int, list] = {}
    for row in rows:
        groups.setdefault(len(row.block), []).append(row)
    for group in groups.values():
        verify(loop, model, group)


@torch.no_grad()
def draft(model, row) -> None:
    """The head's draft of the row's block ``[c0, mask, ...]`` (positions ``block.masked``). The
    first head forward also gives the head the trunk states the last cycle kept (it runs even
    when nothing is drafted: an EOS c0, a block of one)."""
    block, st = row.block, row.mtp
    head = model.require_mtp()
    ids = torch.tensor([st.tokens + [block.host[0]]], device=model.input_device)
    hidden = model.model.norm(st.hidden[None])  # the trunk's states after its final norm
    out, logits = head(model, st.cache, hidden, ids, 0)
    st.slots = st.cache.length  # the trunk positions the head has been given
    qs, t = [], None
    for step, p in enumerate(block.masked):
        if step:
            out, logits = head(model, st.cache, out[:, -1:], torch.tensor([[t]], device=model.input_device), step)
        last = logits[0, -1].float()
        if row.s.greedy:
            t = int(last.argmax())
        else:
            q = sampling.sampling_probs(last[None], row.counts, row.s)[0]
            t = int(torch.multinomial(q, 1, generator=row.generator))
            qs.append(q)
        block.canvas[p] = t
        block.place({p: t}, row.eos)  # past a drafted EOS nothing is drafted
        if p + 1 >= block.end:
            break
    block.masked = []
    block.step = 1
    if qs:
        block.q = torch.stack(qs)


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
        st.cache.set_row_lengths([st.slots])  # the drafted slots are written over next cycle
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
    """Around the prefill of ``rows``: the mtp rows among them keep their prompts' trunk states,
    the head's first input (the head's cache is allocated here, for the row's whole length)."""
    mine = [i for i, row in enumerate(rows) if row.mode == "mtp"]
    if not mine:
        yield
        return
    model = loop.engine.model
    with model.keeping_hidden() as kept:
        yield
    states = torch.cat(kept, dim=1)  # [R, T, H], the chunks joined
    head = model.require_mtp()
    for i in mine:
        row = rows[i]
        length = len(row.prompt_ids) + row.max_new + row.s.mtp_draft_tokens + 2
        row.mtp = HeadState(head.new_cache(length, 1, model.device, model.dtype), states[i], list(row.prompt_ids[1:]))
