"""The language the op table (``ops.py``) describes each op's calls in: the sizes of a model and
the row counts it runs (``Sizes``), and the tensors the calls are built from (``Tensors``).

One description serves two readers. The sm_90 compile gate (bench/compile_check.py) builds the
calls at ``CLOVER_35B`` on meta tensors: shapes, dtypes and strides are all a compiler specialises
on. The kernel tests build the same calls at small sizes with values (tests/kernels/small_calls.py),
to run each kernel against its reference. So an argument is described by what its values must be
for the op to be meaningful (expert ids, a mask, a decay), not only by its shape.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# every row count up to 2 x 64 (past each launcher's tile-size switch: a block is 32 rows, a fused
# commit + preview 64) and the prefill chunks up to 8k with their neighbours (Triton specialises
# integer arguments on == 1 and on divisibility by 16)
_TILE_ROWS_35B = tuple(range(1, 129)) + (255, 256, 1000, 1023, 1024, 2048, 4095, 4096, 8191, 8192)


@dataclass(frozen=True)
class Sizes:
    """A model's sizes and the row counts its ops are called at."""
    hidden: int
    gdn_key_heads: int
    gdn_value_heads: int
    gdn_head_k: int
    gdn_head_v: int
    conv: int  # the GDN's causal conv kernel
    attn_heads: int
    attn_kv_heads: int
    attn_head_dim: int
    rotary_dim: int
    experts: int
    top_k: int
    expert_width: int  # moe_intermediate
    shared_width: int  # the shared expert's intermediate
    block: int  # rows of a diffusion block
    coreset: int  # experts of a block's coreset
    fp8_block: int  # the FP8 checkpoints' weight_block_size (square)
    # the row counts
    common_rows: tuple  # a step, a block, commit + preview, prefill chunks
    tile_rows: tuple  # every count around the launchers' tile choices
    step_rows: tuple  # a static step: AR, a preview, commit + preview
    batch_blocks: tuple  # blocks of a batch, each with its own coreset
    # the static cache buffers a step's attention reads (each its own split count) and writes into
    cache_lengths: tuple
    cache_length: int
    # FP8 blocks whose width is not a power of two (the K step is its largest power-of-two
    # divisor), and the row counts they are checked at
    fp8_odd_blocks: tuple
    fp8_odd_rows: tuple


# Clover-35B-A3B (clover-architecture.md section 2; tests/kernels/test_kernel_table.py holds it to
# clover_lab's preset)
CLOVER_35B = Sizes(
    hidden=2048, gdn_key_heads=16, gdn_value_heads=32, gdn_head_k=128, gdn_head_v=128, conv=4,
    attn_heads=16, attn_kv_heads=2, attn_head_dim=256, rotary_dim=64, experts=256, top_k=8, expert_width=512,
    shared_width=512, block=32, coreset=64, fp8_block=128,  # Qwen's and DeepSeek's weight_block_size
    common_rows=(1, 32, 64, 1024, 8192), tile_rows=_TILE_ROWS_35B, step_rows=tuple(range(1, 65)),
    batch_blocks=(1, 2, 8), cache_lengths=(1024, 4096, 32768, 131072), cache_length=4096,
    fp8_odd_blocks=((128, 96), (128, 192)), fp8_odd_rows=(1, 32, 4096),
)


class Tensors:
    """Builds an op's arguments in one activation dtype. ``t(*shape)`` is a tensor of that dtype
    (``dtype=``: another); the other methods name arguments whose values the op depends on.

    This class builds them on ``device="meta"``: no memory, no values, which is all a compiler needs.
    The kernel tests subclass it to fill in values that honour each method's contract."""

    def __init__(self, dtype: torch.dtype, device: str | torch.device = "meta"):
        self.dtype, self.device = dtype, torch.device(device)

    def _empty(self, shape, dtype):
        return torch.empty(*shape, dtype=dtype, device=self.device)

    def __call__(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Any values (activations, weights, states)."""
        return self._empty(shape, dtype or self.dtype)

    def ids(self, *shape: int, high: int) -> torch.Tensor:
        """int64 in [0, high), distinct along the last dim: expert ids, a coreset, positions."""
        return self._empty(shape, torch.int64)

    def offsets(self, lengths) -> torch.Tensor:
        """int32 [N + 1]: a varlen call's cu_seqlens, 0 and the running sums of the segments'
        ``lengths`` (``clover_kernels.varlen``)."""
        return self._empty((len(lengths) + 1,), torch.int32)

    def mask(self, *shape: int, keep: int) -> torch.Tensor:
        """bool, at least ``keep`` True along the last dim: the experts a row may route to."""
        return self._empty(shape, torch.bool)

    def positive(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Values in (0, 1]: scales, frequencies."""
        return self._empty(shape, dtype or self.dtype)

    def negative(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Values <= 0: a log-decay."""
        return self._empty(shape, dtype or self.dtype)

    def unit(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Values in (0, 1): a gate already through its sigmoid."""
        return self._empty(shape, dtype or self.dtype)
