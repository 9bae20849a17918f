"""The op table's calls (clover_kernels.ops) at small sizes, with values: what the table-wide
kernel tests run through the dispatch, in Triton's interpreter on a CPU.

The calls are the ones the sm_90 compile gate builds at the 35B sizes (the same views, the same
optional arguments), only smaller: the row counts cross a block's and a fused step's edges, the
buffers the attention's split counts."""
import math

import torch

from clover_kernels.shapes import Sizes, Tensors

SMALL = Sizes(
    hidden=32, gdn_key_heads=1, gdn_value_heads=2, gdn_head_k=16, gdn_head_v=16, conv=4,
    attn_heads=4, attn_kv_heads=2, attn_head_dim=16, rotary_dim=8, experts=8, top_k=2, expert_width=16,
    shared_width=16, block=4, coreset=4, fp8_block=16,
    common_rows=(1, 4, 9), tile_rows=(1, 4, 9), step_rows=(1, 4, 8), batch_blocks=(1, 2),
    cache_lengths=(16, 40), cache_length=16, fp8_odd_blocks=((16, 48),), fp8_odd_rows=(1, 9),
)


class RandomTensors(Tensors):
    """``Tensors`` with values that honour each method's contract, from one seeded generator (two
    instances with one seed build equal calls: one for the kernel, one for the reference)."""

    def __init__(self, dtype: torch.dtype, device, seed: int = 0):
        super().__init__(dtype, device)
        self.generator = torch.Generator().manual_seed(seed)

    def _put(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(dtype).to(self.device)

    def __call__(self, *shape, dtype=None):
        return self._put(torch.randn(shape, generator=self.generator), dtype or self.dtype)

    def ids(self, *shape, high):
        *lead, n = shape
        rows = [torch.randperm(high, generator=self.generator)[:n] for _ in range(math.prod(lead))]
        return self._put(torch.stack(rows).reshape(shape), torch.int64)

    def offsets(self, lengths):
        from clover_kernels.varlen import offsets

        return offsets(lengths, self.device)

    def mask(self, *shape, keep):
        mask = torch.rand(shape, generator=self.generator) < 0.5
        mask[..., :keep] = True
        return self._put(mask, torch.bool)

    def positive(self, *shape, dtype=None):
        return self._put(1 - torch.rand(shape, generator=self.generator), dtype or self.dtype)

    def negative(self, *shape, dtype=None):
        return self._put(-1.5 * torch.rand(shape, generator=self.generator), dtype or self.dtype)

    def unit(self, *shape, dtype=None):
        return self._put(torch.rand(shape, generator=self.generator).clamp(1e-3, 1 - 1e-3), dtype or self.dtype)


def small_calls(op, dtype: torch.dtype, device, seed: int = 0):
    """(row count, arguments) of each of the op's calls at ``SMALL`` sizes, with values."""
    return op.calls(SMALL, RandomTensors(dtype, device, seed))
