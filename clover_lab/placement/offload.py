"""Routed experts whose weights are not on the device their layer runs on.

``ExpertStore``: the experts lie in host memory (page-locked in place at load with
``pin_memory``: one host copy, ``staging.pin_in_place``). Each forward, the experts its tokens are
routed to are gathered into the device's staging buffer and copied onto the layer's device in one
asynchronous copy on a side stream (``staging.py``), and the experts op runs on them, with the
routed ids renumbered into the staged set; experts nobody picked are never copied. While a layer
runs, the next offloaded layer's experts are prefetched: those its last two forwards were both
routed to (consecutive previews of a block route alike), when they fit the one layer's staging
room the plan reserves; the next layer then copies only what the prefetch missed. With an expert
coreset (spec 3.3) a block's experts are known after its first preview: the store then stages
the coreset once and keeps it for the block, so the later previews of the block, which route only
within it, copy nothing. Reading which experts are hit synchronises with the host once per layer
and forward: stores are for memory, not for CUDA graphs (the engine's static steps step aside for
them).

``ElsewhereExperts``: the experts lie on another GPU; the activations go there and back.
"""
from __future__ import annotations

import torch

from clover_lab.placement.staging import Staged, Staging


class ExpertStore:
    """One layer's routed experts in host memory, staged onto ``device`` when routed.

    ``staging``: the device's ``Staging`` (shared by the layers that stage onto it); ``next``: the
    next offloaded layer's store on the same device, prefetched while this one runs. Counters for
    the tests and the widgets: ``fetched`` (experts copied so far, prefetches included),
    ``fetches`` (forwards that copied any, or used a prefetch), ``prefetched`` / ``prefetch_used``
    (experts copied ahead, and those a forward then used)."""

    def __init__(self, device, pin_memory: bool = False, staging: Staging | None = None):
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self.staging = staging if staging is not None else Staging(self.device, pin_memory)
        self.next: ExpertStore | None = None
        self.fetched = self.fetches = self.prefetched = self.prefetch_used = 0
        self._experts = None  # the module, once it ran (what a prefetch reads)
        self._held: tuple | None = None  # (coreset ids, Staged) for the current block
        self._prefetch: Staged | None = None
        self._hits: tuple[list[int], list[int]] = ([], [])  # the last two forwards' experts (beyond the coreset)
        self._last: list[int] = []  # the prediction: experts both of them were routed to
        self._coreset_key, self._coreset_list = None, []

    def run(self, experts, x, expert_ids, weights, coreset: torch.Tensor | None = None) -> torch.Tensor:
        self._experts = experts
        host = experts.expert_tensors()
        num_experts = host["down_proj"].shape[0]
        pre, self._prefetch = self._prefetch, None
        if coreset is not None:
            coreset = self._coreset_ids(coreset)
            if self._held is not None and self._held[0] != coreset:
                self._held = None  # a new block: the old block's experts go before the new ones are copied
        hit = torch.unique(expert_ids).tolist()
        held = self._held[1] if self._held is not None else None
        have = set(held.ids if held else ()) | set(pre.ids if pre else ())
        new = [e for e in hit if e not in have]
        if coreset is not None and held is None:  # the coreset and this forward's other experts: one copy
            new = coreset + [e for e in new if e not in set(coreset)]
        staged = self._stage(host, new) if new else None
        if coreset is not None and held is None:
            self._held, held, staged = (coreset, staged), staged, None
        parts = [p for p in (held, pre, staged) if p is not None and any(e in set(p.ids) for e in hit)]
        if pre is not None and pre in parts:
            self.prefetch_used += sum(e in set(hit) for e in pre.ids)
        self.fetches += bool(new) or (pre is not None and pre in parts)
        beyond = [e for e in hit if not (self._held and e in set(self._held[1].ids))]
        self._hits = (self._hits[1], beyond)
        self._last = [e for e in beyond if e in set(self._hits[0])]
        ids, tensors = _joined(parts or [self._stage(host, [])])
        pinned = self.staging.pinned  # page-locked: the ids' copy does not wait for the host
        lookup = torch.full((num_experts,), -1, dtype=torch.long, pin_memory=pinned)
        lookup[ids] = torch.arange(len(ids))
        local = lookup.to(self.device, non_blocking=pinned)[expert_ids.to(self.device)]
        y = experts.compute(x.to(self.device), local, weights.to(self.device), tensors)
        if self.next is not None:  # enqueued after this layer's compute, the next layer's copy overlaps it
            self.next.prefetch(room=num_experts - (len(staged.ids) if staged else 0))
        return y.to(x.device)

    def _coreset_ids(self, coreset: torch.Tensor) -> list[int]:
        """The coreset's ids, read from the device once per coreset tensor (a block's previews
        pass the same one): no second host sync per layer."""
        key = (coreset, coreset._version)
        if self._coreset_key is None or self._coreset_key[0] is not key[0] or self._coreset_key[1] != key[1]:
            self._coreset_key, self._coreset_list = key, sorted(coreset.tolist())
        return self._coreset_list

    def prefetch(self, room: int) -> None:
        """Copy ahead the experts this layer's last two forwards were both routed to (not the held
        coreset: experts routed to twice in a row are the likely ones), when there are at most
        ``room`` of them and none are prefetched yet."""
        if self._experts is None or self._prefetch is not None or not self._last or len(self._last) > room:
            return
        self._prefetch = self._stage(self._experts.expert_tensors(), self._last)
        self.prefetched += len(self._last)

    def _stage(self, host: dict, ids: list[int]) -> Staged:
        self.fetched += len(ids)
        return self.staging.stage(host, ids)

    def release(self) -> None:
        """Drop the held coreset and any prefetch (their device memory), e.g. between generations."""
        self._held = self._prefetch = self._coreset_key = None
        self._last, self._hits = [], ([], [])


def _joined(parts: list[Staged]) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The staged sets a forward uses as one: (ids, tensors), slot j holding expert ids[j]."""
    for part in parts:
        part.ready()
    if len(parts) == 1:
        return parts[0].ids, parts[0].tensors
    return ([e for p in parts for e in p.ids],
            {name: torch.cat([p.tensors[name] for p in parts]) for name in parts[0].tensors})


class ElsewhereExperts:
    """A layer's experts on another GPU than the layer: the activations go there and back."""

    def __init__(self, device):
        self.device = torch.device(device)

    def run(self, experts, x, expert_ids, weights, coreset=None) -> torch.Tensor:
        d = self.device
        y = experts.compute(x.to(d), expert_ids.to(d), weights.to(d), experts.expert_tensors(), experts.packed)
        return y.to(x.device)
