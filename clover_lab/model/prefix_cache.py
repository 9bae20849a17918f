"""The prefix cache: prompts' committed prefixes kept across requests, so that a prompt sharing a
cached prefix starts after it and only its new positions run through the model (agents send the
same system prompt and tool schemas every turn).

Prompts are cut into blocks of ``block`` tokens (the model's block size) and kept as a tree of
blocks keyed by their tokens: a block's node is a child of the block before it, so a node stands
for the whole prefix up to its block's end (vLLM's chain of block hashes, SGLang's radix tree;
here the children are keyed by the block's tokens themselves, so two prefixes never collide). A
node holds its block's K,V of every attention layer. The GDN layers hold no positions: their
conv ring and recurrent state are kept as a **snapshot** on a node, the state right after its
block, and only where a prefill stopped there (SGLang keeps Mamba states the same way): at the
end of a prompt's whole blocks, and where a prompt left the cached tree (a branch point, so the
next prompt that shares the same part starts there). A prompt starts at the deepest node of its
chain that has a snapshot, at most its last whole block before its last position where the
prefill gives that position's logits (a block-diffusion row needs none: its prompt may come
whole); the rest, the partial block at its end included, runs.

Only whole blocks are cached; entries go least recently used first (a leaf block, or a snapshot
on an inner block) once the cache would hold more than ``budget`` bytes; ``budget`` 0 or None
turns it off (and empties it). An insertion builds every copy before it links any into the tree
(nothing half-inserted); one that cannot fit is not made. The cache belongs to one model: it
empties itself when the model's weights change (a parameter replaced, or written in place, as its
version counter tells: writes through ``.data`` are not seen; call :meth:`clear`).

Who uses it is the step loop's business (``engine/step_loop.py``): which rows read it, which add to it.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from clover_lab.model.cache import AttentionCache, CloverCache

# bytes: 1 GiB, about ten 2,000-token prompts of the 35B model (each a 61 MiB GDN snapshot and 64 blocks of 0.6 MiB K,V)
DEFAULT_BUDGET = 1 << 30


@dataclass(eq=False)
class Block:
    """One cached block: its ``tokens``, the block before it (``parent``; the tree's root for a
    prompt's first), its K,V per attention layer ([H_kv, block, head_dim] each) and, where a prefill
    stopped after it, the GDN ``snapshot`` per GDN layer (ring [conv_dim, K-1], state
    [H_v, d_k, d_v])."""
    tokens: tuple
    parent: "Block | None"
    depth: int  # blocks up to and including this one: its end is depth * block
    kv: dict = field(default_factory=dict)
    snapshot: dict | None = None
    children: dict = field(default_factory=dict)
    used: int = 0  # the LRU clock when a prompt last used it

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.kv.values() for t in pair)

    def snapshot_bytes(self) -> int:
        return 0 if self.snapshot is None else sum(t.numel() * t.element_size()
                                                   for pair in self.snapshot.values() for t in pair)


@dataclass
class Lookup:
    """What the cache does for one prompt: ``cached`` positions come from it (restored into the
    row's cache, a multiple of the block size); the prefill stops at each of ``stops`` to take a
    GDN snapshot there; ``write``: the prompt's whole blocks are added after its prefill."""
    prompt: list
    cached: int
    path: list  # the cached blocks the prompt's whole blocks matched, first to last
    stops: list
    write: bool
    root: Block  # the tree it was looked up in (a cache emptied since adds nothing)
    snapshots: dict = field(default_factory=dict)  # position -> {GDN layer: (ring, state)}, taken during the prefill

    def segments(self) -> list[tuple[int, int]]:
        """The prefill's parts: [cached, first stop), ..., [last stop, prompt end)."""
        ends = [s for s in self.stops if s < len(self.prompt)] + [len(self.prompt)]
        starts = [self.cached] + ends[:-1]
        return [(a, b) for a, b in zip(starts, ends) if b > a]  # none: the whole prompt came from the cache


class PrefixCache:
    def __init__(self, block: int, budget: int | None = DEFAULT_BUDGET):
        self.block = block
        self.root = Block((), None, 0)
        self._budget: int | None = None
        self.nbytes = 0  # bytes of every cached tensor (K,V blocks and snapshots)
        self.budget = budget
        self._clock = itertools.count(1)
        self._weights = None  # the model's weights it was filled with (``_fingerprint``)
        self.lookups = self.hits = self.cached_positions = self.evictions = 0

    # ---------------------------------------------------------------- settings and figures
    @property
    def budget(self) -> int | None:
        """Bytes the cache may hold; 0 or None: off."""
        return self._budget

    @budget.setter
    def budget(self, value) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"prefix_cache.budget must be None or a number of bytes >= 0, got {value!r}")
        self._budget = value
        if not value:
            self.clear()
        else:
            self._evict(0, set())

    @property
    def on(self) -> bool:
        return bool(self._budget)

    def __len__(self) -> int:
        """Blocks cached."""
        return sum(1 for _ in self._blocks())

    def snapshots(self) -> int:
        """GDN snapshots cached."""
        return sum(b.snapshot is not None for b in self._blocks())

    def __repr__(self) -> str:
        return (f"PrefixCache({len(self)} blocks of {self.block} tokens, {self.snapshots()} GDN snapshots, "
                f"{self.nbytes / 2**20:.1f} MiB of {(self._budget or 0) / 2**20:.1f} MiB; "
                f"{self.hits} hits in {self.lookups} lookups, {self.cached_positions} positions served)")

    def clear(self) -> None:
        self.root = Block((), None, 0)
        self.nbytes = 0

    # ---------------------------------------------------------------- a prompt
    def lookup(self, model, prompt: list, read: bool, write: bool, last_logits: bool = True) -> Lookup | None:
        """What the cache does for ``prompt``: None when nothing (off, or a prompt of no whole
        block to read or add). ``last_logits``: the prefill must give its last position's logits
        (so at least that position runs); without, a prompt of whole blocks may come whole."""
        if not self.on or not (read or write):
            return None
        weights = _fingerprint(model)
        if weights != self._weights:  # other weights: other states
            self.clear()
            self._weights = weights
        B = self.block
        whole = len(prompt) // B * B
        path, node = [], self.root
        for start in range(0, whole, B):
            node = node.children.get(tuple(prompt[start:start + B]))
            if node is None:
                break
            path.append(node)
        cached = 0
        if read:  # where its last position's logits are wanted, at most the last whole block before it
            self.lookups += 1
            cap = (len(prompt) - 1) // B if last_logits else len(prompt) // B
            cached = next((b.depth * B for b in reversed(path[:cap]) if b.snapshot is not None), 0)
            if cached:
                self.hits += 1
                self.cached_positions += cached
                now = next(self._clock)
                for b in path[:cached // B]:
                    b.used = now
        stops = []
        if write:
            matched = len(path) * B
            if cached < matched < whole and path[-1].snapshot is None:
                stops.append(matched)  # where the prompt leaves the tree: a branch point
            if whole > cached and (whole > matched or path[whole // B - 1].snapshot is None):
                stops.append(whole)
        if not cached and not stops:
            return None
        return Lookup(list(prompt), cached, path, stops, write, self.root)

    def restore(self, lookup: Lookup, cache: CloverCache) -> None:
        """The cached positions into ``cache`` (a row's cache of batch 1, empty): K,V of
        [0, cached) and the GDN state after them; its length becomes ``cached``."""
        n = lookup.cached
        if not n:
            return
        blocks = lookup.path[:n // self.block]
        last = blocks[-1].snapshot
        for i, layer in cache.layers.items():
            if isinstance(layer, AttentionCache):
                layer.k[0, :, :n].copy_(torch.cat([b.kv[i][0] for b in blocks], dim=1))
                layer.v[0, :, :n].copy_(torch.cat([b.kv[i][1] for b in blocks], dim=1))
            else:
                layer.ring[0].copy_(last[i][0])
                layer.state[0].copy_(last[i][1])
        cache.set_row_lengths([n])

    def snapshot(self, lookup: Lookup, cache: CloverCache, at: int) -> None:
        """The GDN state of ``cache`` (a row's, batch 1), which holds the prompt's first ``at``
        positions now, kept for :meth:`insert`."""
        lookup.snapshots[at] = {i: (layer.ring[0].clone(), layer.state[0].clone())
                                for i, layer in cache.layers.items() if not isinstance(layer, AttentionCache)}

    def insert(self, lookup: Lookup, cache: CloverCache) -> bool:
        """The prompt's whole blocks, from ``cache`` (its row's, batch 1, prefilled), with the
        snapshots taken at its stops; older entries leave to make room. Every copy is made before
        any is linked in; False (nothing added) when they cannot fit in the budget."""
        if not (lookup.write and self.on and lookup.stops) or not self._linked(lookup):
            return False
        B, prompt = self.block, lookup.prompt
        whole = len(prompt) // B * B
        new: list[Block] = []
        parent = lookup.path[-1] if lookup.path else self.root
        for start in range(len(lookup.path) * B, whole, B):
            kv = {i: (layer.k[0, :, start:start + B].clone(), layer.v[0, :, start:start + B].clone())
                  for i, layer in cache.layers.items() if isinstance(layer, AttentionCache)}
            parent = Block(tuple(prompt[start:start + B]), parent, start // B + 1, kv)
            new.append(parent)
        chain = lookup.path + new
        placed = [(chain[at // B - 1], snap) for at, snap in lookup.snapshots.items()
                  if chain[at // B - 1].snapshot is None]
        need = sum(b.kv_bytes() for b in new) + sum(
            t.numel() * t.element_size() for _, snap in placed for pair in snap.values() for t in pair)
        if not self._evict(need, set(chain)):
            return False
        now = next(self._clock)
        for b in chain:
            b.used = now
        for b, snap in placed:
            b.snapshot = snap
        for b in new:  # linked last: the tree never holds a block without its parent
            b.parent.children[b.tokens] = b
        self.nbytes += need
        return True

    # ---------------------------------------------------------------- eviction
    def _evict(self, need: int, keep: set) -> bool:
        """Room for ``need`` more bytes within the budget, least recently used entries first (a
        block without children, or an inner block's snapshot; not those in ``keep``)."""
        if not self.on or need > self._budget:
            return False
        if self.nbytes + need <= self._budget:
            return True

        def evictable(b: Block) -> bool:
            return b not in keep and b is not self.root and (not b.children or b.snapshot is not None)

        entries = [(b.used, id(b), b) for b in self._blocks() if evictable(b)]
        heapq.heapify(entries)
        while self.nbytes + need > self._budget:
            if not entries:
                return False
            b = heapq.heappop(entries)[2]
            self.evictions += 1
            if b.children:  # an inner block: only its snapshot goes
                self.nbytes -= b.snapshot_bytes()
                b.snapshot = None
            else:
                self.nbytes -= b.kv_bytes() + b.snapshot_bytes()
                del b.parent.children[b.tokens]
                if not b.parent.children and b.parent.snapshot is None and evictable(b.parent):
                    heapq.heappush(entries, (b.parent.used, id(b.parent), b.parent))  # a leaf now
        return True

    def _linked(self, lookup: Lookup) -> bool:
        """Whether the blocks ``lookup`` matched are all still in the tree (none evicted since)."""
        node = lookup.root
        if node is not self.root:
            return False
        for b in lookup.path:
            if node.children.get(b.tokens) is not b:
                return False
            node = b
        return True

    def _blocks(self):
        stack = list(self.root.children.values())
        while stack:
            b = stack.pop()
            yield b
            stack.extend(b.children.values())


def _fingerprint(model) -> tuple:
    """The model's weights as the cache saw them: each parameter's storage and version counter."""
    return (model.dtype, tuple((p.data_ptr(), p._version) for p in model.parameters()))
