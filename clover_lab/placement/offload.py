"""Routed experts whose weights are not on the device their layer runs on.

``ExpertStore``: the experts lie in host memory. Each forward, the experts its tokens are routed
to are copied onto the layer's device (one expert at a time, no host-side gather) and the
experts op runs on them, with the routed ids renumbered into the staged set; experts nobody
picked are never copied. With an expert coreset (spec 3.3) a block's experts are known after its
first preview: the store then stages the coreset once and keeps it for the block, so the later
previews of the block, which route only within it, copy nothing. Reading which experts are hit
synchronises with the host once per layer and forward: stores are for memory, not for CUDA
graphs (the engine's static steps step aside for them).

``ElsewhereExperts``: the experts lie on another GPU; the activations go there and back.
"""
from __future__ import annotations

import torch


class ExpertStore:
    """One layer's routed experts in host memory, staged onto ``device`` when routed.

    ``fetched``: experts copied so far; ``fetches``: forwards that copied any (counters for the
    tests and the widgets)."""

    def __init__(self, device, pin_memory: bool = False):
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self.fetched = 0
        self.fetches = 0
        self._held: tuple | None = None  # (coreset ids, staged tensors, {expert: slot}) for the current block
        self._pinned: dict | None = None

    def host_tensors(self, experts) -> dict[str, torch.Tensor]:
        tensors = experts.expert_tensors()
        if not self.pin_memory or self.device.type != "cuda":
            return tensors
        if self._pinned is None:  # a copy in page-locked memory: faster, asynchronous copies
            self._pinned = {name: t.pin_memory() for name, t in tensors.items()}
        return self._pinned

    def run(self, experts, x, expert_ids, weights, coreset: torch.Tensor | None = None) -> torch.Tensor:
        host = self.host_tensors(experts)
        before = self.fetched
        if coreset is not None:
            self._hold(host, sorted(coreset.tolist()))
        hit = torch.unique(expert_ids).tolist()
        held = self._held[2] if self._held is not None else {}
        missing = [e for e in hit if e not in held]
        if not missing:
            tensors, slots = self._held[1], held
        else:
            staged = self._stage(host, missing)
            slots = {e: j for j, e in enumerate(missing)}
            if any(e in held for e in hit):  # the held coreset and the rest side by side
                tensors = {n: torch.cat([self._held[1][n], staged[n]]) for n in staged}
                slots = {**held, **{e: len(held) + j for e, j in slots.items()}}
            else:
                tensors = staged
        lookup = torch.full((host["down_proj"].shape[0],), -1, dtype=torch.long)
        lookup[list(slots)] = torch.tensor(list(slots.values()))
        local = lookup.to(self.device)[expert_ids.to(self.device)]
        y = experts.compute(x.to(self.device), local, weights.to(self.device), tensors)
        self.fetches += self.fetched > before
        return y.to(x.device)

    def _hold(self, host: dict, coreset: list[int]) -> None:
        """Stage the block's coreset once: a new coreset (a new block) replaces the held one."""
        if self._held is not None and self._held[0] == coreset:
            return
        self._held = None  # the old block's experts go before the new ones are copied
        self._held = (coreset, self._stage(host, coreset), {e: j for j, e in enumerate(coreset)})

    def _stage(self, host: dict, ids: list[int]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in host.items():
            staged = torch.empty((len(ids), *t.shape[1:]), dtype=t.dtype, device=self.device)
            for j, e in enumerate(ids):
                staged[j].copy_(t[e], non_blocking=self._pinned is not None)
            out[name] = staged
        self.fetched += len(ids)
        return out

    def release(self) -> None:
        """Drop the held coreset (its device memory), e.g. between generations."""
        self._held = None


class ElsewhereExperts:
    """A layer's experts on another GPU than the layer: the activations go there and back."""

    def __init__(self, device):
        self.device = torch.device(device)

    def run(self, experts, x, expert_ids, weights, coreset=None) -> torch.Tensor:
        d = self.device
        y = experts.compute(x.to(d), expert_ids.to(d), weights.to(d), experts.expert_tensors(), experts.packed)
        return y.to(x.device)
