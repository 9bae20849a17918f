"""Packed weights for CPU inference: every GEMM weight of a CloverModel also kept in oneDNN's
blocked layout (``pack_weights``), the part of the class that manages those copies (``model.py``
holds the rest)."""
from __future__ import annotations

import clover_kernels as ops

from .errors import flag
from .layers.linear import Linear
from .layers.moe import Experts, Router


class PackedWeights:
    """CloverModel's packed weight copies (a base of CloverModel)."""

    def pack_weights(self, enabled: bool = True) -> int:
        """CPU inference: keep every GEMM weight (projections, router, each expert, LM head) also in
        oneDNN's blocked layout, so products stop reordering it on every call: prefill and block
        previews get faster (``bench/compare_transformers.py``), at the price of a second copy of
        the weights in memory. A weight changed in place or replaced is repacked on its next use;
        writes through ``.data`` are not seen (call ``pack_weights()`` again). Returns the bytes
        packed; ``pack_weights(False)`` drops the copies."""
        enabled = flag("pack_weights enabled", enabled, none=False)
        if enabled and not ops.can_pack(self.model.embed_tokens.weight):
            raise ValueError(f"pack_weights: packed weights are for fp32 models (bf16 where the CPU has oneDNN's bf16 "
                             f"GEMM) on an x86 CPU with oneDNN; "
                             f"this model is {str(self.dtype).removeprefix('torch.')} on {self.device}")

        def pack(weight) -> ops.PackedWeight:
            packed = ops.PackedWeight()
            packed.get(weight)
            return packed

        fused = set()  # parts of a fused GEMM: its one weight is packed instead
        for module, group in self.projection_groups():
            if group.weight is not None:
                group.packed = pack(group.weight) if enabled and ops.can_pack(group.weight) else None
                fused.update(id(m) for m in group.modules(module))
        for module in self.modules():  # FP8 weights and offloaded experts are not packed
            if id(module) in fused:
                module.packed = None
            elif isinstance(module, (Linear, Router)) and ops.can_pack(module.weight):
                module.packed = pack(module.weight) if enabled else None
            elif isinstance(module, Experts) and module.store is None and ops.can_pack(module.gate_up_proj):
                module.packed = ([pack(w) for w in module.gate_up_proj],
                                 [pack(w) for w in module.down_proj]) if enabled else None
        return sum(p.nbytes for p in self._packs())

    def _packs(self):
        for _, group in self.projection_groups():
            if group.packed is not None:
                yield group.packed
        for module in self.modules():
            if isinstance(module, (Linear, Router)) and module.packed is not None:
                yield module.packed
            elif isinstance(module, Experts) and module.packed is not None:
                yield from (p for group in module.packed for p in group)

    @property
    def packed_weights(self) -> bool:
        """Whether ``pack_weights`` is on."""
        return self.lm_head.packed is not None
