"""Every Triton kernel of clover_kernels compiled for a GPU target on a machine without a GPU.

Triton's interpreter hides compile errors, register spills, shared-memory overflows and the
bf16 code paths; Triton's own compiler and the ``ptxas`` it ships do not need a GPU or a
driver. This module

1. **discovers** the ``@triton.jit`` functions of the package by scanning its modules (so a
   new kernel is found wherever it lives) and splits them by call graph into kernels
   (launched from Python, or called by no other jit function) and device helpers;
2. **captures** the launches the op table's kernels (``triton_ops.KERNELS``) make at the
   Clover-35B-A3B shapes: each op is called on meta tensors (no memory, no data) with a fake
   sm_90 driver, and Triton's own ``JITFunction.run`` computes the specialisation, constexprs
   and options it would compile on the GPU; autotuner config lists are enumerated whole;
3. **compiles** each distinct (kernel, dtype, config, specialisation) once for the target
   and reads registers, spills and stack from ptxas's ``-v`` log and shared memory from
   Triton's metadata.

``python bench/compile_check.py [--json FILE]`` prints one line per compiled case
and exits 1 on a compile error, a spill, shared memory over the per-block limit, a kernel or
op the call table does not reach; 77 when Triton's CUDA backend is missing (nothing to test).
``tests/kernels/test_compile_sm90.py`` and ``bench/kernel_report.py`` run it. A development tool:
it is not part of the installed ``clover_kernels`` package (whose kernels it scans).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import inspect
import io
import json
import os
import pkgutil
import re
import sys
import textwrap
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import triton
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.jit import JITFunction

try:  # under TRITON_INTERPRET=1, triton.jit returns these instead of JITFunction
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover
    InterpretedFunction = JITFunction

PACKAGE = "clover_kernels"

# Clover-35B-A3B (clover-architecture.md section 2; checked against clover_lab's preset by the test)
DIMS_35B = dict(hidden=2048, gdn_key_heads=16, gdn_value_heads=32, gdn_head_k=128, gdn_head_v=128, conv=4,
                attn_heads=16, attn_kv_heads=2, attn_head_dim=256, experts=256, top_k=8, expert_width=512,
                shared_width=512, block=32, coreset=64, max_prefill_chunk=8192, rotary_dim=64)

# Row counts swept per op: every value up to 2 x 64 (past every launcher's tile-size switch point:
# a block is 32 rows, fused commit+preview 64) and the prefill chunk sizes up to 8k with their
# neighbours (Triton specialises integer arguments on == 1 and on divisibility by 16).
_BIG_ROWS = (255, 256, 1000, 1023, 1024, 2048, 4095, 4096, 8191, 8192)
COMMIT_ROWS = tuple(range(1, 129)) + _BIG_ROWS
MOE_ROWS = tuple(range(1, 129)) + _BIG_ROWS
NORM_ROWS = (1, 32, 64, 1024, 8192)
ATTENTION_ROWS = tuple(range(1, 65))  # a static step: AR (1), a preview (up to 32), commit + preview (64)
ATTENTION_BUFFERS = (1024, 4096, 32768, 131072)  # the static cache buffer: its split counts

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# sm_90 (H100 / H200) resources
SM90 = ("cuda", 90, 32)
SMEM_PER_BLOCK_SM90 = 227 * 1024  # the opt-in maximum of dynamic shared memory per block
SMEM_PER_SM_SM90 = 228 * 1024
REGS_PER_SM = 65536
MAX_THREADS_PER_SM = 2048
MAX_BLOCKS_PER_SM = 32
SMEM_RESERVED_PER_BLOCK = 1024  # the driver keeps 1 KB per resident block on sm_80+


class CudaBackendMissing(RuntimeError):
    """Triton here has no CUDA backend (or no ptxas): nothing can be compiled for an NVIDIA GPU."""


def cuda_backend_problem() -> str | None:
    """Why Triton cannot compile for CUDA here, or None when it can."""
    try:
        from triton.backends import backends
    except ImportError as exc:  # pragma: no cover
        return f"triton.backends unavailable: {exc}"
    if "nvidia" not in backends:
        return f"Triton {triton.__version__} has no NVIDIA backend (backends: {sorted(backends)})"
    try:
        ptxas_version()
    except Exception as exc:  # noqa: BLE001 - any failure to run ptxas means no compile
        return f"Triton's CUDA backend has no usable ptxas: {type(exc).__name__}: {exc}"
    return None


def ptxas_version(arch: int = SM90[1]) -> str:
    """The release line of the ptxas Triton uses for ``arch`` (runs it: raises when it cannot)."""
    from triton.backends.nvidia.compiler import get_ptxas_version

    text = get_ptxas_version(arch)
    return next((line.strip() for line in text.splitlines() if "release" in line), text.strip())


# --------------------------------------------------------------------------------- discovery
def _unwrap(obj):
    """The JIT/interpreted function inside autotune/heuristics wrappers, or None."""
    while isinstance(obj, (Autotuner, Heuristics)):
        obj = obj.fn
    return obj if isinstance(obj, (JITFunction, InterpretedFunction)) else None


@dataclass
class Discovery:
    functions: dict = field(default_factory=dict)  # name -> JITFunction (or InterpretedFunction)
    wrappers: dict = field(default_factory=dict)   # name -> outermost object (Autotuner, ...) when wrapped
    modules: dict = field(default_factory=dict)    # name -> defining module
    calls: dict = field(default_factory=dict)      # name -> names of jit functions it calls
    launched: set = field(default_factory=set)     # names launched as fn[grid](...) from Python

    @property
    def kernels(self) -> list[str]:
        called = set().union(*self.calls.values()) if self.calls else set()
        return sorted(n for n in self.functions if n in self.launched or n not in called)

    @property
    def helpers(self) -> list[str]:
        kernels = set(self.kernels)
        return sorted(n for n in self.functions if n not in kernels)

    def reachable(self, roots) -> set:
        """Every jit function compiled when ``roots`` are (they and what they call, transitively)."""
        seen, todo = set(), list(roots)
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(self.calls.get(name, ()))
        return seen


def _package_modules(package: str) -> list:
    pkg = importlib.import_module(package)
    mods = [pkg]
    for info in pkgutil.walk_packages(pkg.__path__, prefix=package + "."):
        mods.append(importlib.import_module(info.name))
    return mods


def _load_file_module(path: str):
    name = "_compile_check_extra_" + re.sub(r"\W", "_", os.path.basename(path).removesuffix(".py"))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # triton reads the defining module's globals through sys.modules
    spec.loader.exec_module(module)
    return module


def _resolve(node, scope: dict):
    """The object a Name / dotted Attribute expression refers to in ``scope``, or None."""
    if isinstance(node, ast.Name):
        return scope.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, scope)
        return getattr(base, node.attr, None) if base is not None else None
    return None


def discover(package: str = PACKAGE, extra_modules=()) -> Discovery:
    """Scan every module of ``package`` (and ``extra_modules``, files) for Triton jit functions."""
    d = Discovery()
    modules = _package_modules(package) + [_load_file_module(p) for p in extra_modules]
    by_id = {}
    for module in modules:
        for value in vars(module).values():
            fn = _unwrap(value)
            if fn is None or fn.fn.__module__ != module.__name__:
                continue  # imported from elsewhere: counted where it is defined
            name = fn.fn.__name__
            if name in d.functions and d.functions[name] is not fn:
                raise ValueError(f"two Triton functions named {name!r} ({d.modules[name]}, {module.__name__}): "
                                 f"the coverage check names kernels by their function name; rename one")
            d.functions[name], d.modules[name] = fn, module.__name__
            if value is not fn:
                d.wrappers[name] = value
            by_id[id(fn)] = name
    for name, fn in d.functions.items():
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn.fn)))
        callees = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                target = _unwrap(_resolve(node.func, fn.fn.__globals__))
                if target is not None and id(target) in by_id and by_id[id(target)] != name:
                    callees.add(by_id[id(target)])
        d.calls[name] = callees
    for module in modules:  # fn[grid](...) anywhere in the package's Python code
        try:
            tree = ast.parse(inspect.getsource(module))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript):
                target = _unwrap(_resolve(node.value, vars(module)))
                if target is not None and id(target) in by_id:
                    d.launched.add(by_id[id(target)])
    return d


# --------------------------------------------------------------------------------- capture
@dataclass
class Launch:
    """One kernel launch as Triton would compile it for the target."""
    kernel: str
    op: str
    dtype: str
    rows: int
    signature: dict
    constexprs: dict   # {(arg index,): value}
    attrs: dict        # {(arg index,): [[attribute, value]]}
    options: dict      # the backend's parsed options (num_warps, num_stages, ...)
    args: dict         # argument name -> value, or (shape, dtype) for tensors: for cost models

    def key(self) -> str:
        """Identity of the compiled binary: kernel, signature, specialisation, options."""
        opts = {k: v for k, v in self.options.items() if k not in ("extern_libs",)}
        return json.dumps([self.kernel, self.signature, sorted((list(k), _jsonable(v)) for k, v in self.constexprs.items()),
                           sorted((list(k), v) for k, v in self.attrs.items()), sorted(opts.items())],
                          default=str, sort_keys=True)


def _jsonable(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return str(v)


class _FakeDriver:
    """Just enough of a driver for ``JITFunction.run`` to specialise for ``target`` without a GPU."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("meta")


def _describe_args(fn, args, kwargs) -> dict:
    out = {}
    for name, value in zip(fn.arg_names, args):
        out[name] = value
    out.update(kwargs)
    desc = {}
    for name, value in out.items():
        if isinstance(value, torch.Tensor):
            desc[name] = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
        elif isinstance(value, (bool, int, float, str)) or value is None:
            desc[name] = value
    return desc


@contextlib.contextmanager
def capturing(discovery: Discovery, target_tuple=SM90):
    """Within: launching a discovered kernel appends a Launch to ``launches`` (yielded with
    ``label``, the op / dtype / rows the records are tagged with) instead of compiling or
    running it. Everything patched is restored on exit."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    target = GPUTarget(*target_tuple)
    launches: list[Launch] = []
    label = {"op": None, "dtype": None, "rows": 0}
    saved, pending = [], {}
    prev_active = driver._active
    driver.set_active(_FakeDriver(target))
    try:
        for name, fn in discovery.functions.items():
            if not isinstance(fn, JITFunction):
                raise RuntimeError(f"{name} is not a compiled JITFunction (TRITON_INTERPRET=1 is set in this process)")
            saved.append((fn, dict(vars(fn))))
            fn.device_caches = defaultdict(fn.create_binder)  # a binder for the fake target only
            orig_run = fn.run

            def run(*args, _fn=fn, _name=name, _orig=orig_run, grid=None, warmup=False, **kwargs):
                pending["args"] = _describe_args(_fn, args, kwargs)
                pending["name"] = _name
                return _orig(*args, grid=grid, warmup=warmup, **kwargs)

            def do_compile(key, signature, device, constexprs, options, attrs, warmup):
                launches.append(Launch(pending["name"], label["op"], label["dtype"], label["rows"], dict(signature),
                                       dict(constexprs), dict(attrs), dict(vars(options)), pending["args"]))
                return None  # run() returns before launching

            fn.run = run
            fn._do_compile = do_compile
        for name, wrapper in discovery.wrappers.items():
            # every autotune config is a config the launcher can choose: capture them all
            layer = wrapper
            while isinstance(layer, (Autotuner, Heuristics)):
                if isinstance(layer, Autotuner):
                    saved.append((layer, dict(vars(layer))))

                    def tune_run(*args, _at=layer, **kwargs):
                        for config in _at.configs:
                            _at.fn.run(*args, **kwargs, **config.all_kwargs())

                    layer.run = tune_run
                layer = layer.fn
        yield launches, label
    finally:
        for obj, state in saved:
            for key in list(vars(obj)):
                if key not in state:
                    delattr(obj, key)
            vars(obj).update(state)
        driver._active = prev_active


# --------------------------------------------------------------------------------- call table
def _meta(*shape, dtype):
    return torch.empty(*shape, dtype=dtype, device="meta")


def clover_35b_calls(dtypes=tuple(DTYPES), dims=None, rows=None):
    """(op, dtype label, rows, (op name, args)) for every dispatched op at the 35B shapes, with
    the tensors' dtypes as the model passes them (GDN state and log-decay fp32, the rest the
    model's dtype). Batch 1: the engine's generation batch. ``rows``: {op: row counts} in place
    of the default sweeps (cost tables of chosen shapes)."""
    d = dict(DIMS_35B, **(dims or {}))
    rows = rows or {}
    norm_rows = rows.get("rms_norm", NORM_ROWS)
    gated_rows = rows.get("gated_rms_norm", NORM_ROWS)
    commit_rows = rows.get("gdn_commit", COMMIT_ROWS)
    preview_rows = rows.get("gdn_preview", range(1, d["block"] + 1))
    moe_rows = rows.get("moe_experts", MOE_ROWS)
    H, Hk, Hv, dk, dv, K = (d[k] for k in ("hidden", "gdn_key_heads", "gdn_value_heads", "gdn_head_k",
                                           "gdn_head_v", "conv"))
    E, k, I, D = d["experts"], d["top_k"], d["expert_width"], d["attn_head_dim"]
    C = 2 * Hk * dk + Hv * dv
    f32 = torch.float32
    for label in dtypes:
        dt = DTYPES[label]
        for T in norm_rows:  # decoder norms over hidden; attention q/k norms over head_dim
            yield "rms_norm", label, T, ("rms_norm", (_meta(T, H, dtype=dt), _meta(H, dtype=dt)))
            yield "rms_norm", label, T, ("rms_norm", (_meta(T, d["attn_heads"], D, dtype=dt), _meta(D, dtype=dt)))
        for T in norm_rows:  # the residual add with the norm after it; the gating ops between the GEMMs
            yield "add_rms_norm", label, T, ("add_rms_norm", (_meta(T, H, dtype=dt), _meta(T, H, dtype=dt),
                                                              _meta(H, dtype=dt)))
            yield from _gating_calls(label, dt, d, T)
        for T in gated_rows:  # the GDN output norm over dv, per value head
            yield "gated_rms_norm", label, T, ("gated_rms_norm", (_meta(T * Hv, dv, dtype=dt),
                                                                  _meta(T * Hv, dv, dtype=dt), _meta(dv, dtype=dt)))
        for T in commit_rows:  # AR step (1), a block (32), prefill chunks (up to 8k)
            yield "gdn_commit", label, T, ("gdn_commit", (
                _meta(1, T, C, dtype=dt), _meta(1, C, K - 1, dtype=dt), _meta(C, K, dtype=dt), _meta(1, T, Hv, dtype=f32),
                _meta(1, T, Hv, dtype=dt), _meta(1, Hv, dk, dv, dtype=f32), Hk, dk, dv))
        for m in preview_rows:  # a preview block: 1..32 rows
            for history in (False, True):
                yield "gdn_preview", label, m, ("gdn_preview", (
                    _meta(1, m, C, dtype=dt), _meta(1, C, K - 1, dtype=dt), _meta(C, K, dtype=dt),
                    _meta(C, K - 1, dtype=dt), _meta(1, Hv, dk, dv, dtype=f32), _meta(Hv, dtype=dt), _meta(Hv, dtype=dt),
                    _meta(Hv, dtype=dt), Hk, dk, dv, history))
        S, i64 = d["coreset"], torch.int64
        for T in moe_rows:  # the router's rule over T tokens' logits: every expert, or a coreset (mask or ids)
            yield "route", label, T, ("route", (_meta(T, E, dtype=dt), k))
            yield "route", label, T, ("route", (_meta(T, E, dtype=dt), k, _meta(E, dtype=torch.bool)))
            yield "route", label, T, ("route", (_meta(T, E, dtype=dt), k, None, _meta(S, dtype=i64)))
        for G in (1, 2, 8):  # a batch's blocks, each row its own coreset: recorded, then routed within
            T = G * d["block"]
            yield "route", label, T, ("route", (_meta(T, E, dtype=dt), k, None, None, _meta(G, S, dtype=i64)))
            yield "route", label, T, ("route", (_meta(T, E, dtype=dt), k, None, _meta(G, S, dtype=i64)))
        yield "route", label, d["block"], ("route", (_meta(d["block"], E, dtype=dt), k, None, None,
                                                     _meta(S, dtype=i64)))
        for T in moe_rows:  # routed experts of T tokens (coreset routing changes ids, not shapes)
            yield "moe_experts", label, T, ("moe_experts", (
                _meta(T, H, dtype=dt), _meta(T, k, dtype=torch.int64), _meta(T, k, dtype=dt),
                _meta(E, 2 * I, H, dtype=dt), _meta(E, H, I, dtype=dt)))
        yield from _moe_tile_calls(label, dt, d, fp8=False)
        Hq, Hkv = d["attn_heads"], d["attn_kv_heads"]
        attention_rows = rows.get("cache_attention", ATTENTION_ROWS) if label in HALF_DTYPES else ()
        for T in attention_rows:  # the static steps' attention, at every buffer size
            for L in ATTENTION_BUFFERS:
                for block_rows in {0, min(T, d["block"])} if T in (d["block"], 2 * d["block"]) else (0,):
                    yield "cache_attention", label, T, ("cache_attention", (  # a preview's or fused step's block
                        _meta(1, Hq, T, D, dtype=dt), _meta(1, Hkv, L, D, dtype=dt), _meta(1, Hkv, L, D, dtype=dt),
                        _meta(1, T, dtype=torch.int64), _meta(1, T, Hq * D, dtype=dt), block_rows))
        if label in FP8_DTYPES:  # FP8 checkpoints: FP8 weights, bf16 / fp16 activations
            yield from _fp8_calls(label, dt, d, rows)
            yield from _moe_tile_calls(label, dt, d, fp8=True)


def moe_tile_rows(d=DIMS_35B) -> dict:
    """{row-block height: a token count whose pairs per expert choose it} (moe.fused.block_m)."""
    from clover_kernels.moe.fused import BLOCK_MS

    return {bm: bm * d["experts"] // d["top_k"] for bm in BLOCK_MS}


def _moe_tile_calls(label, dt, d, fp8: bool):
    """The routed experts at one token count per tile choice (decode/block heights to prefill's)."""
    H, E, k, I = d["hidden"], d["experts"], d["top_k"], d["expert_width"]
    for T in moe_tile_rows(d).values():
        if not fp8:
            yield "moe_experts", label, T, ("moe_experts", (
                _meta(T, H, dtype=dt), _meta(T, k, dtype=torch.int64), _meta(T, k, dtype=dt),
                _meta(E, 2 * I, H, dtype=dt), _meta(E, H, I, dtype=dt)))
            continue
        f8, f32, q = torch.float8_e4m3fn, torch.float32, FP8_BLOCK
        yield "moe_experts_fp8", label, T, ("moe_experts_fp8", (
            _meta(T, H, dtype=dt), _meta(T, k, dtype=torch.int64), _meta(T, k, dtype=dt),
            _meta(E, 2 * I, H, dtype=f8), _meta(E, H, I, dtype=f8),
            _meta(E, 2 * -(-I // q), -(-H // q), dtype=f32), _meta(E, -(-H // q), -(-I // q), dtype=f32), (q, q)))


def _gating_calls(label, dt, d, T):
    """The small fused ops of one forward of T rows, their inputs the views the layers pass."""
    H, Hv, Hq, Hkv, D = d["hidden"], d["gdn_value_heads"], d["attn_heads"], d["attn_kv_heads"], d["attn_head_dim"]
    S, R = d["shared_width"], d["rotary_dim"]
    query_gate = _meta(1, T, Hq, 2 * D, dtype=dt)  # q_proj's product: query and gate per head
    yield "qk_norm_rope", label, T, ("qk_norm_rope", (
        query_gate[..., :D], _meta(1, T, Hkv, D, dtype=dt), _meta(D, dtype=dt), _meta(D, dtype=dt),
        _meta(T, dtype=torch.int64), _meta(R // 2, dtype=torch.float32)))
    kv_cache = _meta(1, Hkv, ATTENTION_BUFFERS[1], D, dtype=dt)  # a static step: K,V written into the cache
    yield "qk_norm_rope", label, T, ("qk_norm_rope", (
        query_gate[..., :D], _meta(1, T, Hkv, D, dtype=dt), _meta(D, dtype=dt), _meta(D, dtype=dt),
        _meta(1, T, dtype=torch.int64), _meta(R // 2, dtype=torch.float32), 1e-6,
        (kv_cache, kv_cache, _meta(1, T, Hkv, D, dtype=dt))))
    yield "sigmoid_gate", label, T, ("sigmoid_gate", (_meta(1, Hq, T, D, dtype=dt).transpose(1, 2), query_gate[..., D:]))
    gates = _meta(1, T, 2 * Hv, dtype=dt)  # in_proj_b and in_proj_a's columns
    yield "gdn_gates", label, T, ("gdn_gates", (gates[..., :Hv], gates[..., Hv:], _meta(Hv, dtype=dt),
                                                _meta(Hv, dtype=dt)))
    yield "silu_mul", label, T, ("silu_mul", (_meta(1, T, S, dtype=dt), _meta(1, T, S, dtype=dt)))
    rows = [_meta(1, T, H, dtype=dt) for _ in range(4)]
    yield "moe_combine", label, T, ("moe_combine", (rows[0], rows[1], rows[2], _meta(1, H, dtype=dt), rows[3]))
    yield "moe_combine", label, T, ("moe_combine", (rows[0], rows[1], rows[2], _meta(1, H, dtype=dt), rows[3],
                                                    _meta(H, dtype=dt)))  # with the next layer's input norm
    yield "moe_combine", label, T, ("moe_combine", (rows[0], rows[1]))
    slots = _meta(1, T, d["top_k"], H, dtype=torch.float32)  # the routed experts' per-slot outputs, summed here
    yield "moe_combine", label, T, ("moe_combine", (rows[0], slots, rows[2], _meta(1, H, dtype=dt), rows[3],
                                                    _meta(H, dtype=dt)))
    yield "moe_combine", label, T, ("moe_combine", (rows[0], slots))


# the 35B's quantized linears as (out, in) features: q (query + gate), k / v, o, GDN in_proj_qkv,
# in_proj_z, in_proj_a / b, out_proj, the shared expert's gate / up and down
FP8_LINEAR_SHAPES = ((8192, 2048), (512, 2048), (2048, 4096), (4096, 2048), (32, 2048), (2048, 512))
FP8_BLOCK = 128  # Qwen's and DeepSeek's weight_block_size [128, 128]
# the FP8 kernels take bf16 / fp16 activations: fp32 ones run the torch path (their tiles spill)
FP8_DTYPES = ("bf16", "fp16")
# so do the split-KV attention's (its fp32 tiles of head_dim 256 spill)
HALF_DTYPES = FP8_DTYPES
KERNEL_DTYPES = {name: set(HALF_DTYPES) for name in ("_fp8_linear_kernel", "_gate_up_fp8_kernel", "_down_fp8_kernel",
                                                     "_split_kv_kernel", "_combine_kernel")}
KERNEL_DTYPES["_align_kernel"] = {"bf16"}  # reads only expert ids: one binary for every activation dtype
KERNEL_DTYPES["_coreset_kernel"] = {"bf16"}  # reads only the fp32 router probabilities: likewise


def _fp8_calls(label, dt, d, rows):
    f8, f32, q = torch.float8_e4m3fn, torch.float32, FP8_BLOCK
    H, E, k, I = d["hidden"], d["experts"], d["top_k"], d["expert_width"]
    for T in rows.get("linear_fp8", NORM_ROWS):
        for N, K in FP8_LINEAR_SHAPES:
            yield "linear_fp8", label, T, ("linear_fp8", (
                _meta(T, K, dtype=dt), _meta(N, K, dtype=f8), _meta(-(-N // q), -(-K // q), dtype=f32), (q, q)))
    for T in rows.get("moe_experts_fp8", MOE_ROWS):
        yield "moe_experts_fp8", label, T, ("moe_experts_fp8", (
            _meta(T, H, dtype=dt), _meta(T, k, dtype=torch.int64), _meta(T, k, dtype=dt),
            _meta(E, 2 * I, H, dtype=f8), _meta(E, H, I, dtype=f8),
            _meta(E, 2 * -(-I // q), -(-H // q), dtype=f32), _meta(E, -(-H // q), -(-I // q), dtype=f32), (q, q)))
    yield from _fp8_odd_block_calls(label, dt, d)


# quantization blocks whose width is not a power of two: K steps of its largest power-of-two divisor
FP8_ODD_BLOCKS = ((128, 96), (128, 192))
FP8_ODD_ROWS = (1, 32, 4096)


def _fp8_odd_block_calls(label, dt, d):
    f8, f32 = torch.float8_e4m3fn, torch.float32
    H, E, k, I = d["hidden"], d["experts"], d["top_k"], d["expert_width"]
    for bn, bk in FP8_ODD_BLOCKS:
        for T in FP8_ODD_ROWS:
            yield "linear_fp8", label, T, ("linear_fp8", (
                _meta(T, H, dtype=dt), _meta(4096, H, dtype=f8), _meta(-(-4096 // bn), -(-H // bk), dtype=f32),
                (bn, bk)))
            yield "moe_experts_fp8", label, T, ("moe_experts_fp8", (
                _meta(T, H, dtype=dt), _meta(T, k, dtype=torch.int64), _meta(T, k, dtype=dt),
                _meta(E, 2 * I, H, dtype=f8), _meta(E, H, I, dtype=f8),
                _meta(E, 2 * -(-I // bn), -(-H // bk), dtype=f32), _meta(E, -(-H // bn), -(-I // bk), dtype=f32),
                (bn, bk)))


def capture_35b(discovery: Discovery, dtypes=tuple(DTYPES), target_tuple=SM90, rows=None):
    """(launches, ops covered by the table, ops of the dispatch the table misses)."""
    from clover_kernels import triton_ops

    if triton_ops.MISSING:
        raise RuntimeError(f"Triton ops failed to import: {triton_ops.MISSING}")
    covered = set()
    with capturing(discovery, target_tuple) as (launches, label):
        for op, dtype, rows, (name, args) in clover_35b_calls(dtypes, rows=rows):
            label.update(op=op, dtype=dtype, rows=rows)
            triton_ops.KERNELS[name](*args)
            covered.add(name)
    return launches, sorted(covered), sorted(set(triton_ops.KERNELS) - covered)


def distinct_cases(launches):
    """One case per compiled binary; ``rows`` lists every row count that launches it."""
    cases = {}
    for launch in launches:
        key = launch.key()
        if key not in cases:
            cases[key] = dict(launch=launch, rows=[], ops=set())
        cases[key]["rows"].append(launch.rows)
        cases[key]["ops"].add(launch.op)
    return list(cases.values())


# --------------------------------------------------------------------------------- compile
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas_log(log: str) -> dict:
    regs, spill = _PTXAS_REGS.findall(log), _PTXAS_SPILL.findall(log)
    if not regs or not spill:
        raise RuntimeError(f"no register/spill lines in the ptxas log:\n{log[-2000:]}")
    stack, stores, loads = (int(x) for x in spill[-1])
    return dict(regs=int(regs[-1]), stack_bytes=stack, spill_store_bytes=stores, spill_load_bytes=loads)


def occupancy(regs: int, num_warps: int, shared: int) -> dict:
    """Resident blocks and warps per SM on sm_90 (registers allocated per warp in 256s)."""
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = REGS_PER_SM // (regs_per_warp * num_warps)
    by_threads = MAX_THREADS_PER_SM // (32 * num_warps)
    by_smem = SMEM_PER_SM_SM90 // (shared + SMEM_RESERVED_PER_BLOCK)
    blocks = min(by_regs, by_threads, by_smem, MAX_BLOCKS_PER_SM)
    limiter = min((by_regs, "registers"), (by_threads, "threads"), (by_smem, "shared memory"),
                  (MAX_BLOCKS_PER_SM, "blocks"))[1]
    return dict(blocks_per_sm=blocks, warps_per_sm=blocks * num_warps,
                occupancy=blocks * num_warps / (MAX_THREADS_PER_SM // 32), limited_by=limiter)


@contextlib.contextmanager
def _fresh_triton_cache():
    """A throwaway Triton cache: the case really compiles (and ptxas prints its report), and
    nothing is kept across runs."""
    import shutil
    import tempfile

    before = os.environ.get("TRITON_CACHE_DIR")
    path = tempfile.mkdtemp(prefix="clover-compile-check-")
    os.environ["TRITON_CACHE_DIR"] = path
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = before
        shutil.rmtree(path, ignore_errors=True)


def compile_case(module: str, kernel: str, signature: dict, constexprs: list, attrs: list, options: dict,
                 target_tuple=SM90) -> dict:
    """Compile one case (arguments as produced by ``case_payload``); resources or the error."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _unwrap(getattr(importlib.import_module(module), kernel))
    options = {k: _tuples(v) for k, v in options.items()}  # JSON turned the option tuples into lists
    src = ASTSource(fn=fn, signature=signature, constexprs={tuple(k): v for k, v in constexprs},
                    attrs={tuple(k): v for k, v in attrs})
    t0 = time.perf_counter()
    log = io.StringIO()
    prev = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True  # make_cubin prints ptxas -v's report
    try:
        with _fresh_triton_cache(), contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget(*target_tuple), options=options)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return dict(error=f"{type(exc).__name__}: {exc}"[-4000:], compile_s=time.perf_counter() - t0)
    finally:
        knobs.nvidia.dump_ptxas_log = prev
    md = compiled.metadata
    res = parse_ptxas_log(log.getvalue())
    res.update(shared_bytes=int(md.shared), num_warps=int(md.num_warps), num_stages=int(md.num_stages),
               compile_s=round(time.perf_counter() - t0, 2))
    res.update(occupancy(res["regs"], res["num_warps"], res["shared_bytes"]))
    return res


def case_payload(case, discovery: Discovery) -> dict:
    """Picklable / JSON-able arguments of ``compile_case``."""
    launch = case["launch"]
    return dict(module=discovery.modules[launch.kernel], kernel=launch.kernel, signature=launch.signature,
                constexprs=[[list(k), v] for k, v in launch.constexprs.items()],
                attrs=[[list(k), v] for k, v in launch.attrs.items()], options=launch.options)


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _compile_payload(payload: dict) -> dict:
    import warnings

    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    return compile_case(**payload)


def compile_all(payloads: list[dict], jobs: int) -> list[dict]:
    if jobs <= 1 or len(payloads) <= 1:
        return [_compile_payload(p) for p in payloads]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # spawn: fresh interpreters import the kernel modules themselves (no forked torch state)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        return list(pool.map(_compile_payload, payloads))


def _constexpr_names(launch: Launch) -> dict:
    names = list(launch.signature)
    return {names[k[0]]: _jsonable(v) for k, v in launch.constexprs.items() if len(k) == 1}


def failures_of(result: dict, smem_limit: int = SMEM_PER_BLOCK_SM90) -> list[str]:
    if "error" in result:
        return [f"compile error: {result['error']}"]
    out = []
    spilled = result["spill_store_bytes"] + result["spill_load_bytes"]
    if spilled:
        out.append(f"register spills: {result['spill_store_bytes']} B stored, {result['spill_load_bytes']} B loaded "
                   f"({result['regs']} registers)")
    if result["shared_bytes"] > smem_limit:
        out.append(f"shared memory {result['shared_bytes']} B > {smem_limit} B per block")
    if result["blocks_per_sm"] < 1 and result["shared_bytes"] <= smem_limit:
        out.append(f"no block fits an SM ({result['limited_by']}: {result['regs']} registers x "
                   f"{32 * result['num_warps']} threads)")
    return out


def run_check(dtypes=tuple(DTYPES), jobs: int = 2, compile_kernels: bool = True, extra_modules=(),
              target_tuple=SM90, package: str = PACKAGE, only=()) -> dict:
    """Discover, capture at the 35B shapes, compile. Returns the whole report (JSON-able).
    ``only``: kernel names to compile (the coverage checks still see every kernel)."""
    problem = cuda_backend_problem()
    if problem:
        raise CudaBackendMissing(problem)
    t0 = time.perf_counter()
    discovery = discover(package, extra_modules)
    launches, ops_covered, ops_missing = capture_35b(discovery, dtypes, target_tuple)
    cases = distinct_cases(launches)
    launched = {case["launch"].kernel for case in cases}
    if only:
        unknown = set(only) - set(discovery.functions)
        if unknown:
            raise ValueError(f"--kernels: no Triton function named {', '.join(sorted(unknown))}")
        cases = [c for c in cases if c["launch"].kernel in only]
    report = dict(
        triton=triton.__version__, ptxas=ptxas_version(target_tuple[1]), torch=torch.__version__,
        target=list(target_tuple),
        smem_limit_bytes=SMEM_PER_BLOCK_SM90, dims=DIMS_35B, dtypes=list(dtypes),
        discovered={n: discovery.modules[n] for n in sorted(discovery.functions)},
        kernels=discovery.kernels, helpers=discovery.helpers,
        calls={n: sorted(c) for n, c in discovery.calls.items() if c},
        ops_covered=ops_covered, ops_missing=ops_missing,
        uncovered_kernels=sorted(set(discovery.kernels) - launched),
        uncovered_helpers=sorted(set(discovery.helpers) - discovery.reachable(launched)),
        launches=[dict(kernel=l.kernel, op=l.op, dtype=l.dtype, rows=l.rows, args=l.args,
                       constexprs=_constexpr_names(l), num_warps=l.options.get("num_warps"),
                       num_stages=l.options.get("num_stages")) for l in launches],
        cases=[],
    )
    payloads = [case_payload(c, discovery) for c in cases]
    results = compile_all(payloads, jobs) if compile_kernels else [None] * len(cases)
    for case, result in zip(cases, results):
        launch = case["launch"]
        row = dict(kernel=launch.kernel, dtype=launch.dtype, ops=sorted(case["ops"]),
                   config=dict(_constexpr_names(launch), num_warps=launch.options.get("num_warps"),
                               num_stages=launch.options.get("num_stages")),
                   signature=launch.signature, attrs={str(k[0]): v for k, v in launch.attrs.items() if v},
                   rows=sorted(set(case["rows"])))
        if result is not None:
            row["result"] = result
            row["failures"] = failures_of(result)
        report["cases"].append(row)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["ok"] = bool(compile_kernels) and not (report["uncovered_kernels"] or report["uncovered_helpers"]
                                                  or report["ops_missing"]
                                                  or any(r["failures"] for r in report["cases"]))
    return report


def case_label(row: dict) -> str:
    cfg = ",".join(f"{k}={v}" for k, v in row["config"].items())
    rows = row["rows"]
    span = f"{rows[0]}" if len(rows) == 1 else f"{rows[0]}..{rows[-1]} ({len(rows)})"
    return f"{row['kernel']} {row['dtype']} [{cfg}] rows {span}"


def print_report(report: dict, file=sys.stdout) -> None:
    print(f"Triton {report['triton']} -> {report['target'][0]} sm_{report['target'][1]}: "
          f"{len(report['kernels'])} kernels, {len(report['helpers'])} helpers, {len(report['cases'])} distinct "
          f"compiles in {report['seconds']} s", file=file)
    for row in report["cases"]:
        res = row.get("result")
        if res is None:
            print(f"  {case_label(row)}: not compiled", file=file)
        elif "error" in res:
            print(f"  FAIL {case_label(row)}: {res['error'].splitlines()[0][:300]}", file=file)
        else:
            flag = "FAIL" if row["failures"] else "ok  "
            print(f"  {flag} {case_label(row)}: {res['regs']} regs, spills {res['spill_store_bytes']}/"
                  f"{res['spill_load_bytes']} B, smem {res['shared_bytes']} B, occupancy {res['occupancy']:.2f}"
                  + (f"  <- {'; '.join(row['failures'])}" if row["failures"] else ""), file=file)
    for key, what in (("uncovered_kernels", "kernels no op of the 35B call table launches"),
                      ("uncovered_helpers", "helpers no covered kernel calls"),
                      ("ops_missing", "dispatch ops missing from the 35B call table")):
        if report[key]:
            print(f"FAIL {what}: {', '.join(report[key])}", file=file)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the report here")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel compiles")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, of " + ", ".join(DTYPES))
    p.add_argument("--extra-module", action="append", default=[], help="also scan this .py file (tests)")
    p.add_argument("--no-compile", action="store_true", help="discover and capture only")
    p.add_argument("--kernels", default="", help="comma-separated kernel names to compile (default: all)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: TRITON_INTERPRET is set; unset it (the interpreter replaces the compiler)")
        return 2
    try:
        report = run_check(tuple(args.dtypes.split(",")), args.jobs, not args.no_compile, args.extra_module,
                           only=tuple(k for k in args.kernels.split(",") if k))
    except CudaBackendMissing as exc:
        print(f"compile_check: skipped: {exc}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(skipped=str(exc), triton=triton.__version__), f)
        return 77
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if not args.quiet:
        print_report(report)
    failed = report["uncovered_kernels"] or report["uncovered_helpers"] or report["ops_missing"] or \
        any(r.get("failures") for r in report["cases"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
