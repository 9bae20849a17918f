"""The kernel op table: every op of clover_kernels described once.

An ``Op`` is the op's name, its torch path (the reference: CPU tensors, autograd,
``dispatch.use_backend("torch")``), its Triton implementation (``"module:function"`` under this package,
with the reference's signature and return contract), the activation dtypes that implementation is
built for on a GPU, and its calls: every way the model calls it, at any ``shapes.Sizes``. Each op
is a name of this module (``ops.rms_norm(x, w)`` dispatches, ``dispatch.py``); ``TABLE`` lists them.

What reads the table: ``triton_ops.py`` imports the implementations; bench/compile_check.py
compiles every call at the Clover-35B-A3B sizes for sm_90; tests/kernels runs every call at small
sizes through the dispatch, against the reference. A new kernel: its module, its reference, one
``Op`` here (its calls included), its test.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from . import dispatch
from .attention import torch as _attention
from .fp8 import torch as _fp8
from .gates import naive as _gates
from .gdn import torch as _gdn
from .moe import naive as _moe_naive
from .moe import torch as _moe
from .norm import naive as _norm
from .rope import naive as _rope
from .shapes import Sizes, Tensors

EVERY_DTYPE = (torch.bfloat16, torch.float16, torch.float32)
# the FP8 and attention kernels' fp32 tiles spill on sm_90 (bench/compile_check.py): fp32 activations
# on a GPU run their torch path
HALF_DTYPES = (torch.bfloat16, torch.float16)
F32 = torch.float32
FP8 = torch.float8_e4m3fn

# (sizes, tensors, rows=None) -> (row count, the reference's arguments) per call; ``rows``: row
# counts in place of the op's own sweep (the calls that need a particular count keep theirs)
Calls = Callable[..., Iterable[tuple[int, tuple]]]


@dataclass(eq=False)
class Op:
    name: str
    reference: Callable  # the torch path
    kernel: str  # "module:function" of the Triton implementation, the module relative to clover_kernels
    calls: Calls
    gpu_dtypes: tuple = EVERY_DTYPE  # activation dtypes the kernel takes on a GPU (the others: the reference)
    torch_only: tuple = ()  # arguments only the reference takes (the kernel is called without them)
    _dropped: tuple = field(init=False, default=())

    def __post_init__(self):
        params = list(inspect.signature(self.reference).parameters)
        unknown = [n for n in self.torch_only if n not in params]
        if unknown:
            where = f"{self.reference.__module__}.{self.reference.__name__}{inspect.signature(self.reference)}"
            raise ValueError(f"op {self.name!r}: torch_only names {unknown}, not parameters of {where}")
        self._dropped = tuple(params.index(n) for n in self.torch_only)
        functools.update_wrapper(self, self.reference, assigned=("__doc__", "__module__"), updated=())
        self.__signature__ = inspect.signature(self.reference)

    @property
    def module(self) -> str:
        return f"{__package__}.{self.kernel.split(':')[0]}"

    @property
    def function(self) -> str:
        return self.kernel.split(":")[1]

    def runs_kernel(self, *args, **kwargs) -> bool:
        """Whether a call with these arguments (its tensors, at least) runs the Triton kernel."""
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        # decided once per (op, device type, dtype); dispatch.use_backend forces a path
        return dispatch.backend_for(self.name, *tensors, gpu_dtypes=self.gpu_dtypes) == "triton"

    def run_kernel(self, *args, **kwargs):
        """The Triton implementation, called with the reference's arguments (those only the reference
        takes left out), whatever the dispatch would choose."""
        args = tuple(a for i, a in enumerate(args) if i not in self._dropped)
        kwargs = {k: v for k, v in kwargs.items() if k not in self.torch_only}
        return dispatch.kernel_table()[self.name](*args, **kwargs)

    def __call__(self, *args, **kwargs):
        if self.runs_kernel(*args, **kwargs):
            return self.run_kernel(*args, **kwargs)
        return self.reference(*args, **kwargs)

    def __repr__(self):
        return f"Op({self.name!r}, {self.reference.__module__}.{self.reference.__name__}, {self.kernel!r})"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------- norms
def _rms_norm_calls(d: Sizes, t: Tensors, rows=None):
    for T in rows or d.common_rows:  # the decoder norms over hidden; the attention's q/k norms over head_dim
        yield T, (t(T, d.hidden), t(d.hidden))
        yield T, (t(T, d.attn_heads, d.attn_head_dim), t(d.attn_head_dim))


rms_norm = Op("rms_norm", _norm.rms_norm, "norm.rms:rms_norm", _rms_norm_calls)


def _add_rms_norm_calls(d: Sizes, t: Tensors, rows=None):
    for T in rows or d.common_rows:
        yield T, (t(T, d.hidden), t(T, d.hidden), t(d.hidden))


# (x + delta, rms_norm(x + delta)): a residual add and the norm after it
add_rms_norm = Op("add_rms_norm", _norm.add_rms_norm, "norm.rms:add_rms_norm", _add_rms_norm_calls)


def _gated_rms_norm_calls(d: Sizes, t: Tensors, rows=None):
    Hv, dv = d.gdn_value_heads, d.gdn_head_v
    for T in rows or d.common_rows:  # the GDN output norm over dv, per value head
        yield T, (t(T * Hv, dv), t(T * Hv, dv), t(dv))


gated_rms_norm = Op("gated_rms_norm", _norm.gated_rms_norm, "norm.rms:gated_rms_norm", _gated_rms_norm_calls)


def _qk_norm_rope_calls(d: Sizes, t: Tensors, rows=None):
    Hq, Hkv, D, R = d.attn_heads, d.attn_kv_heads, d.attn_head_dim, d.rotary_dim
    for T in rows or d.common_rows:
        query = t(1, T, Hq, 2 * D)[..., :D]  # q_proj's product holds query and gate per head
        yield T, (query, t(1, T, Hkv, D), t(D), t(D), t.ids(T, high=d.cache_length), t.positive(R // 2, dtype=F32))
        query = t(1, T, Hq, 2 * D)[..., :D]
        cache = (t(1, Hkv, d.cache_length, D), t(1, Hkv, d.cache_length, D), t(1, T, Hkv, D))
        yield T, (query, t(1, T, Hkv, D), t(D), t(D), t.ids(1, T, high=d.cache_length),
                  t.positive(R // 2, dtype=F32), 1e-6, cache)  # a static step: its K,V written into the cache


# the attention's q/k norms and RoPE: q [B, T, Hq, D], k [B, T, Hkv, D] -> [B, heads, T, D] each
# (``cache``: a static step's K,V also written into the cache at the rows' positions)
qk_norm_rope = Op("qk_norm_rope", _rope.qk_norm_rope, "rope.fused:qk_norm_rope", _qk_norm_rope_calls)


# ----------------------------------------------------------------------------------- gates
def _gdn_gates_calls(d: Sizes, t: Tensors, rows=None):
    Hv = d.gdn_value_heads
    for T in rows or d.common_rows:
        gates = t(1, T, 2 * Hv)  # in_proj_b's and in_proj_a's columns of one product
        yield T, (gates[..., :Hv], gates[..., Hv:], t(Hv), t(Hv))


# in_proj_b / in_proj_a's outputs -> (log decay g fp32, beta)
gdn_gates = Op("gdn_gates", _gates.gdn_gates, "gates.fused:gdn_gates", _gdn_gates_calls)


def _sigmoid_gate_calls(d: Sizes, t: Tensors, rows=None):
    Hq, D = d.attn_heads, d.attn_head_dim
    for T in rows or d.common_rows:  # attention's output [B, T, Hq, D] view; the gate half of q_proj's product
        yield T, (t(1, Hq, T, D).transpose(1, 2), t(1, T, Hq, 2 * D)[..., D:])


sigmoid_gate = Op("sigmoid_gate", _gates.sigmoid_gate, "gates.fused:sigmoid_gate", _sigmoid_gate_calls)


def _silu_mul_calls(d: Sizes, t: Tensors, rows=None):
    for T in rows or d.common_rows:  # the shared expert's gate and up
        yield T, (t(1, T, d.shared_width), t(1, T, d.shared_width))


silu_mul = Op("silu_mul", _gates.silu_mul, "gates.fused:silu_mul", _silu_mul_calls)  # SwiGLU's activation


def _moe_combine_calls(d: Sizes, t: Tensors, rows=None):
    H = d.hidden
    for T in rows or d.common_rows:
        residual, routed, x, shared = (t(1, T, H) for _ in range(4))
        yield T, (residual, routed, x, t(1, H), shared)
        yield T, (residual, routed, x, t(1, H), shared, None, t(H))  # with the next layer's input norm
        yield T, (residual, routed)
        slots = t(1, T, d.top_k, H, dtype=F32)  # the routed experts' per-slot outputs, summed here
        yield T, (residual, slots, x, t(1, H), shared, None, t(H))
        yield T, (residual, slots)


# a MoE block's output into the residual stream (the residual may be None), the shared expert's
# sigmoid gate included, and optionally the next norm of it; gate_packed: the CPU's oneDNN layout;
# routed may be the experts' per-slot outputs [..., k, H] (summed over k in the same pass)
moe_combine = Op("moe_combine", _gates.moe_combine, "gates.fused:moe_combine", _moe_combine_calls,
                 torch_only=("gate_packed",))


# ------------------------------------------------------------------------------------- GDN
def _gdn_channels(d: Sizes) -> int:
    return 2 * d.gdn_key_heads * d.gdn_head_k + d.gdn_value_heads * d.gdn_head_v


def _gdn_commit_calls(d: Sizes, t: Tensors, rows=None):
    C, K, Hv, dk, dv = _gdn_channels(d), d.conv, d.gdn_value_heads, d.gdn_head_k, d.gdn_head_v
    for T in rows or d.tile_rows:  # an AR step (1), a block (32), prefill chunks (up to 8k)
        yield T, (t(1, T, C), t(1, C, K - 1), t(C, K), t.negative(1, T, Hv, dtype=F32), t.unit(1, T, Hv),
                  t(1, Hv, dk, dv, dtype=F32), d.gdn_key_heads, dk, dv)


gdn_commit = Op("gdn_commit", _gdn.gdn_commit, "gdn.commit:gdn_commit", _gdn_commit_calls)


def _gdn_preview_calls(d: Sizes, t: Tensors, rows=None):
    C, K, Hv, dk, dv = _gdn_channels(d), d.conv, d.gdn_value_heads, d.gdn_head_k, d.gdn_head_v
    for m in rows or range(1, d.block + 1):  # a preview block of 1..block rows
        for history in (False, True):
            yield m, (t(1, m, C), t(1, C, K - 1), t(C, K), t(C, K - 1), t(1, Hv, dk, dv, dtype=F32), t(Hv), t(Hv),
                      t.positive(Hv), d.gdn_key_heads, dk, dv, history)


gdn_preview = Op("gdn_preview", _gdn.gdn_preview, "gdn.preview:gdn_preview", _gdn_preview_calls)


# the varlen ops: rows' segments of different lengths packed on one token axis (``varlen.py``),
# each over its own row of the ring, the state, the cache; ``rows`` (a cost table's row counts):
# one segment of each count
def _segment_lengths(d: Sizes, patterns, rows=None):
    return [(T,) for T in rows] if rows else patterns


def _gdn_commit_varlen_calls(d: Sizes, t: Tensors, rows=None):
    C, K, Hv, dk, dv, B = _gdn_channels(d), d.conv, d.gdn_value_heads, d.gdn_head_k, d.gdn_head_v, d.block
    # AR rows (the token-by-token kernel); an empty segment, a token, blocks past and short of a block's rows
    for lengths in _segment_lengths(d, ((1,) * 2, (0, 1, B + 1, 2 * B - 2)), rows):
        N, T = len(lengths), sum(lengths)
        yield T, (t(1, T, C), t(N, C, K - 1), t(C, K), t.negative(1, T, Hv, dtype=F32), t.unit(1, T, Hv),
                  t(N, Hv, dk, dv, dtype=F32), d.gdn_key_heads, dk, dv, t.offsets(lengths), max(lengths))


gdn_commit_varlen = Op("gdn_commit_varlen", _gdn.gdn_commit_varlen, "gdn.commit:gdn_commit_varlen",
                       _gdn_commit_varlen_calls)


def _gdn_preview_varlen_calls(d: Sizes, t: Tensors, rows=None):
    C, K, Hv, dk, dv, B = _gdn_channels(d), d.conv, d.gdn_value_heads, d.gdn_head_k, d.gdn_head_v, d.block
    # blocks of 1 to a block's rows (longer blocks, up to preview.MAX_BLOCK, spill on sm_90: kernels.md)
    for lengths in _segment_lengths(d, ((1, B // 2 + 1, B),), rows):
        N, T = len(lengths), sum(lengths)
        for history in (False, True):
            yield T, (t(1, T, C), t(N, C, K - 1), t(C, K), t(C, K - 1), t(N, Hv, dk, dv, dtype=F32), t(Hv), t(Hv),
                      t.positive(Hv), d.gdn_key_heads, dk, dv, t.offsets(lengths), max(lengths), history)


gdn_preview_varlen = Op("gdn_preview_varlen", _gdn.gdn_preview_varlen, "gdn.preview:gdn_preview_varlen",
                        _gdn_preview_varlen_calls)


# ------------------------------------------------------------------------------------- MoE
def moe_tile_rows(d: Sizes) -> dict:
    """{row-block height: a token count whose pairs per expert choose it} (moe.fused.block_m)."""
    from .moe.fused import BLOCK_MS  # a Triton module: imported only where calls are built

    return {bm: bm * d.experts // d.top_k for bm in BLOCK_MS}


def _route_calls(d: Sizes, t: Tensors, rows=None):
    E, k, S = d.experts, d.top_k, d.coreset
    for T in rows or d.tile_rows:  # the router's rule over T tokens' logits: every expert, or a coreset (mask or ids)
        yield T, (t(T, E), k)
        yield T, (t(T, E), k, t.mask(E, keep=k))
        yield T, (t(T, E), k, None, t.ids(S, high=E))
    for G in d.batch_blocks:  # a batch's blocks, each row its own coreset: recorded, then routed within
        T = G * d.block
        yield T, (t(T, E), k, None, None, t.ids(G, S, high=E))
        yield T, (t(T, E), k, None, t.ids(G, S, high=E))
    yield d.block, (t(d.block, E), k, None, None, t.ids(S, high=E))


# the router's rule over logits [T, E]: (probs fp32 [T, E], expert ids [T, k], weights fp32 [T, k]);
# ``allowed`` [E] or [T, E] bool restricts the picks, or ``within`` a coreset's expert ids; ``record``:
# a coreset buffer the rows' coreset is written into (one more launch)
route = Op("route", _moe_naive.route, "moe.route:route", _route_calls)


def _experts(d: Sizes, t: Tensors, T: int) -> tuple:
    """A layer's routed experts for T tokens: x, expert ids, their weights."""
    return t(T, d.hidden), t.ids(T, d.top_k, high=d.experts), t(T, d.top_k)


def _moe_experts_calls(d: Sizes, t: Tensors, rows=None):
    E, H, I = d.experts, d.hidden, d.expert_width
    # T tokens (coreset routing changes ids, not shapes), then one count per tile choice
    for T in (*(rows or d.tile_rows), *moe_tile_rows(d).values()):
        yield T, (*_experts(d, t, T), t(E, 2 * I, H), t(E, H, I))


# packed: the CPU path's kept oneDNN weights (see ``dense.PackedWeight``); slots: each (token, slot)
# pair's weighted output [T, k, H] fp32, unsummed (moe_combine sums it over k)
moe_experts = Op("moe_experts", _moe.moe_experts, "moe.fused:moe_experts", _moe_experts_calls,
                 torch_only=("packed",))


# ----------------------------------------------------------------------------------- attention
def _cache_attention_calls(d: Sizes, t: Tensors, rows=None):
    Hq, Hkv, D = d.attn_heads, d.attn_kv_heads, d.attn_head_dim
    for T in rows or d.step_rows:  # the static steps' attention, at every buffer size
        for L in d.cache_lengths:  # a preview's or a fused step's block sees itself whole (block_rows)
            for block_rows in (0, d.block) if T in (d.block, 2 * d.block) else (0,):
                yield T, (t(1, Hq, T, D), t(1, Hkv, L, D), t(1, Hkv, L, D), t.ids(1, T, high=L), t(1, T, Hq * D),
                          block_rows)


# the static step's attention: over the live keys (each row's last from the device), GQA folded, gated
cache_attention = Op("cache_attention", _attention.cache_attention, "attention.split_kv:cache_attention",
                     _cache_attention_calls, gpu_dtypes=HALF_DTYPES)


def _cache_attention_varlen_calls(d: Sizes, t: Tensors, rows=None):
    Hq, Hkv, D, B = d.attn_heads, d.attn_kv_heads, d.attn_head_dim, d.block
    for L in d.cache_lengths:  # AR rows; a token, an empty segment, blocks past and at a block's rows
        for lengths in _segment_lengths(d, ((1,) * 2, (1, B + 1, 0, B)), rows):
            N, T = len(lengths), sum(lengths)
            yield T, (t(1, T, Hq, 2 * D)[..., :D].transpose(1, 2), t(N, Hkv, L, D), t(N, Hkv, L, D),
                      t.ids(1, T, high=L), t(1, T, Hq, 2 * D)[..., D:], t.offsets(lengths), max(lengths))


# cache_attention over the rows' segments packed on one token axis, segment n over cache row n
cache_attention_varlen = Op("cache_attention_varlen", _attention.cache_attention_varlen,
                            "attention.split_kv:cache_attention_varlen", _cache_attention_varlen_calls,
                            gpu_dtypes=HALF_DTYPES)


# ----------------------------------------------------------------------------------- FP8
def fp8_linear_shapes(d: Sizes) -> tuple:
    """The quantized linears as (out, in) features: q (query + gate), k / v, o, the GDN's
    in_proj_qkv, in_proj_z, in_proj_a / b, out_proj, the shared expert's gate / up and down."""
    H, Hq, D = d.hidden, d.attn_heads, d.attn_head_dim
    every = ((2 * Hq * D, H), (d.attn_kv_heads * D, H), (H, Hq * D), (_gdn_channels(d), H),
             (d.gdn_value_heads * d.gdn_head_v, H), (d.gdn_value_heads, H), (H, d.gdn_value_heads * d.gdn_head_v),
             (d.shared_width, H), (H, d.shared_width))
    return tuple(dict.fromkeys(every))  # each distinct shape once, in that order


def _linear_fp8_calls(d: Sizes, t: Tensors, rows=None):
    q = d.fp8_block
    for T in rows or d.common_rows:
        for N, K in fp8_linear_shapes(d):
            yield T, (t(T, K), t(N, K, dtype=FP8), t.positive(_cdiv(N, q), _cdiv(K, q), dtype=F32), (q, q))
    N, H = d.gdn_value_heads * d.gdn_head_v, d.hidden  # in_proj_z, in blocks whose width is not a power of two
    for bn, bk in d.fp8_odd_blocks:
        for T in d.fp8_odd_rows:
            yield T, (t(T, H), t(N, H, dtype=FP8), t.positive(_cdiv(N, bn), _cdiv(H, bk), dtype=F32), (bn, bk))


linear_fp8 = Op("linear_fp8", _fp8.linear, "fp8.gemm:linear", _linear_fp8_calls, gpu_dtypes=HALF_DTYPES)


def _moe_experts_fp8_calls(d: Sizes, t: Tensors, rows=None):
    E, H, I = d.experts, d.hidden, d.expert_width

    def experts(T, bn, bk):
        return (*_experts(d, t, T), t(E, 2 * I, H, dtype=FP8), t(E, H, I, dtype=FP8),
                t.positive(E, 2 * _cdiv(I, bn), _cdiv(H, bk), dtype=F32),
                t.positive(E, _cdiv(H, bn), _cdiv(I, bk), dtype=F32), (bn, bk))

    q = d.fp8_block
    for T in rows or d.tile_rows:
        yield T, experts(T, q, q)
    for bn, bk in d.fp8_odd_blocks:  # blocks whose width is not a power of two
        for T in d.fp8_odd_rows:
            yield T, experts(T, bn, bk)
    for T in moe_tile_rows(d).values():  # one token count per tile choice
        yield T, experts(T, q, q)


moe_experts_fp8 = Op("moe_experts_fp8", _fp8.moe_experts, "fp8.moe:moe_experts", _moe_experts_fp8_calls,
                     gpu_dtypes=HALF_DTYPES)

# every op above, in the order written
TABLE = tuple(value for value in list(globals().values()) if isinstance(value, Op))
