"""The routing lens across denoising steps: per MoE layer, how much the chosen experts change
between consecutive previews of a block and between its last preview and its commit (overlap:
the share of a token's top-k experts kept; flip rate = 1 - overlap), and the routing entropy per
step (mean over the block's tokens of the router distribution's entropy, in nats).

    lens = clover_lab.lens.routing_lens(engine, "import os\\n", max_new_tokens=64)
    lens.rows            # one dict per (layer, block, step)
    lens.by_layer()      # per layer: mean flip rate between steps, at commit, mean entropy

``routing_lens`` also reads a Capture or a saved Trace of ``layers.*.moe.route``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from clover_lab.engine.requests import is_batch
from clover_lab.errors import InputError
from clover_lab.hooks import points as P
from clover_lab.hooks.records import Record, RecordSet


def overlap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per token, the share of ``a``'s k experts also in ``b``: ids [T, k] each -> [T]."""
    return (a[:, :, None] == b[:, None, :]).any(-1).float().mean(-1)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each row of router probabilities [T, E] -> [T]."""
    p = probs.float()
    return -(p * p.clamp_min(1e-30).log()).sum(-1)


def _common(a: Record, b: Record) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert ids of the tokens both records routed, aligned by position."""
    pa, pb = a["positions"].tolist(), b["positions"].tolist()
    rows_b = {p: i for i, p in enumerate(pb)}
    keep = [(i, rows_b[p]) for i, p in enumerate(pa) if p in rows_b]
    ia = torch.tensor([i for i, _ in keep], dtype=torch.long, device=a["expert_ids"].device)
    ib = torch.tensor([j for _, j in keep], dtype=torch.long, device=b["expert_ids"].device)
    return a["expert_ids"][ia], b["expert_ids"][ib].to(a["expert_ids"].device)


def _of_row(records: list[Record], row: int | None) -> list[Record]:
    """One request row's routing: a batch's records narrowed to ``row`` (its tensors are flattened
    over the batch, row by row); a single generation's as they are (``row`` None)."""
    batched = sorted({i for r in records if r.rows is not None for i in r.rows})
    if not batched:
        if row is not None:
            raise InputError(f"routing_lens row={row!r}: the recording is of one generation, not a batch; "
                             f"leave row out")
        return records
    if row is None or isinstance(row, bool) or row not in batched:
        raise InputError(f"routing_lens row={row!r}: the recording is of a batch of rows {batched[0]}.."
                         f"{batched[-1]}, whose routing is read one row at a time; pass row=0 .. {batched[-1]}")
    out = []
    for r in records:
        if row not in r.rows:
            continue
        # the event's own narrowing: its tensors are flattened over the batch, row by row
        ev = P.rebuild(r.point, r.data, r.where).for_row(row)
        out.append(Record(r.point, r.run, r.phase, r.block, r.step,
                          {**r.data, **{k: getattr(ev, k) for k in P.DECLARED[P.MOE_ROUTE].fields}}, ev.where))
    return out


@dataclass
class RoutingLens:
    """``rows``: per (layer, block, step) of a preview: ``entropy``, and ``overlap`` / ``flip_rate``
    against the previous step of the block (None at step 0). ``commits``: per (layer, block) the
    overlap and flip rate between the block's last preview and its commit."""

    rows: list[dict] = field(default_factory=list)
    commits: list[dict] = field(default_factory=list)

    def by_layer(self) -> list[dict]:
        """Per layer: mean flip rate between consecutive steps, between last preview and commit,
        and mean routing entropy per step."""
        out = []
        for layer in sorted({r["layer"] for r in self.rows}):
            steps = [r for r in self.rows if r["layer"] == layer]
            flips = [r["flip_rate"] for r in steps if r["flip_rate"] is not None]
            commit = [c["flip_rate"] for c in self.commits if c["layer"] == layer]
            out.append(dict(layer=layer, step_flip_rate=_mean(flips), commit_flip_rate=_mean(commit),
                            entropy=_mean([r["entropy"] for r in steps])))
        return out

    def to_dict(self) -> dict:
        return dict(rows=self.rows, commits=self.commits)


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def routing_lens(source, prompt=None, row: int | None = None, **generate) -> RoutingLens:
    """The routing lens of a Capture / Trace holding ``layers.*.moe.route`` (one run: the first),
    or of a fresh generation: ``routing_lens(engine, prompt, **generate)``. A batched generation
    (a list of prompts, or a recording of one) is read one request row at a time: ``row=i``."""
    if not isinstance(source, RecordSet):
        if is_batch(prompt) != (row is not None):  # said before the generation, not after it
            raise InputError(f"routing_lens row={row!r}: " + (
                f"a batch of {len(prompt)} prompts is read one row at a time; pass row=0 .. {len(prompt) - 1}"
                if row is None else "the prompt is one generation, not a batch; leave row out"))
        with source.capture(P.every_layer(P.MOE_ROUTE)) as cap:
            source.generate(prompt, **generate)
        source = cap
    records = source[P.every_layer(P.MOE_ROUTE)]
    if not records:
        raise InputError("routing_lens: the recording holds no route events")
    records = _of_row([r for r in records if r.run == records[0].run], row)
    lens = RoutingLens()
    previews: dict[tuple[int, int], list[Record]] = {}
    commits: dict[tuple[int, int], Record] = {}
    for r in records:
        if r.phase != "decode":
            continue
        key = (r["layer"], r.block)
        if r["mode"] == "preview":
            previews.setdefault(key, []).append(r)
        else:
            commits[key] = r
    for (layer, block), steps in sorted(previews.items()):
        for i, r in enumerate(steps):
            entry = dict(layer=layer, block=block, step=r.step, entropy=float(entropy(r["router_probs"]).mean()),
                         overlap=None, flip_rate=None)
            if i:
                ov = float(overlap(*_common(steps[i - 1], r)).mean())
                entry.update(overlap=ov, flip_rate=1.0 - ov)
            lens.rows.append(entry)
        if (layer, block) in commits:
            ov = overlap(*_common(steps[-1], commits[(layer, block)]))
            if ov.numel():
                lens.commits.append(dict(layer=layer, block=block, overlap=float(ov.mean()),
                                         flip_rate=1.0 - float(ov.mean())))
    return lens
