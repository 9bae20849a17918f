"""Every Triton kernel of clover_kernels compiled for a GPU target on a machine without a GPU.

Triton's interpreter hides compile errors, register spills, shared-memory overflows and the
bf16 code paths; Triton's own compiler and the ``ptxas`` it ships do not need a GPU or a
driver. This module

1. **discovers** the ``@triton.jit`` functions of the package by scanning its modules (so a
   new kernel is found wherever it lives) and splits them by call graph into kernels
   (launched from Python, or called by no other jit function) and device helpers;
2. **captures** the launches of every call the op table (``clover_kernels.ops``) describes,
   at the Clover-35B-A3B sizes (``clover_kernels.shapes.CLOVER_35B``), in each dtype the op's
   kernel is built for: each op's Triton implementation is called on meta tensors (no memory,
   no data) with a fake sm_90 driver, and Triton's own ``JITFunction.run`` computes the
   specialisation, constexprs and options it would compile on the GPU; autotuner config lists
   are enumerated whole;
3. **compiles** each distinct (kernel, dtype, config, specialisation) once for the target
   and reads registers, spills and stack from ptxas's ``-v`` log and shared memory from
   Triton's metadata.

The shapes are the table's; what is here is about compiling.
``python bench/compile_check.py [--json FILE] [--ops rms_norm,route]`` prints one line per
compiled case and exits 1 on a compile error, a spill, shared memory over the per-block limit,
a kernel no op of the table launches or an op that launches nothing; 77 when Triton's CUDA
backend is missing (nothing to test).
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
from dataclasses import asdict, dataclass, field

import torch
import triton
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.jit import JITFunction

from clover_kernels.ops import TABLE
from clover_kernels.shapes import CLOVER_35B, Tensors

try:  # under TRITON_INTERPRET=1, triton.jit returns these instead of JITFunction
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover
    InterpretedFunction = JITFunction

PACKAGE = "clover_kernels"

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


# --------------------------------------------------------------------------------- the op table's calls
# kernels whose binary does not depend on the activation dtype: one compile (labelled bf16) serves all
ONE_BINARY_FOR_EVERY_DTYPE = {
    "_align_kernel": "reads only expert ids",
    "_coreset_kernel": "reads only the fp32 router probabilities",
}


def op_dtypes(op, dtypes=tuple(DTYPES)) -> tuple:
    """The labels of ``dtypes`` the op's kernel is built for on a GPU (its activation dtypes)."""
    return tuple(label for label in dtypes if DTYPES[label] in op.gpu_dtypes)


def capture_35b(discovery: Discovery, dtypes=tuple(DTYPES), target_tuple=SM90, rows=None):
    """Every call of every op of the table (``clover_kernels.ops``) at the Clover-35B-A3B sizes, on
    meta tensors, in each of ``dtypes`` the op's kernel is built for, through the op's Triton
    implementation. Batch 1: the engine's generation batch. ``rows``: {op name: row counts} in place
    of that op's sweep (cost tables of chosen shapes).

    Returns (launches, ops that launched, ops of the table that launched nothing)."""
    from clover_kernels import triton_ops  # the kernels: imported here, after any TRITON_INTERPRET check

    if triton_ops.MISSING:
        raise RuntimeError(f"Triton ops failed to import: {triton_ops.MISSING}")
    rows = rows or {}
    covered = set()
    with capturing(discovery, target_tuple) as (launches, label):
        for op in TABLE:
            for dtype in op_dtypes(op, dtypes):
                for count, args in op.calls(CLOVER_35B, Tensors(DTYPES[dtype]), rows.get(op.name)):
                    label.update(op=op.name, dtype=dtype, rows=count)
                    op.run_kernel(*args)  # meta tensors: the dispatch would choose the reference
                    covered.add(op.name)
    return launches, sorted(covered), sorted({op.name for op in TABLE} - covered)


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
              target_tuple=SM90, package: str = PACKAGE, only=(), ops=()) -> dict:
    """Discover, capture at the 35B shapes, compile. Returns the whole report (JSON-able).
    ``only``: kernel names to compile; ``ops``: compile only the cases these ops (names) launch.
    Either way every op is captured: the coverage checks still see every kernel."""
    unknown = set(dtypes) - set(DTYPES)
    if unknown:
        raise ValueError(f"--dtypes: {', '.join(sorted(unknown))} is not one of {', '.join(DTYPES)}")
    unknown = set(ops) - {op.name for op in TABLE}
    if unknown:
        raise ValueError(f"--ops: {', '.join(sorted(unknown))} is not an op of clover_kernels.ops.TABLE "
                         f"({', '.join(op.name for op in TABLE)})")
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
    if ops:
        cases = [c for c in cases if c["ops"] & set(ops)]
    report = dict(
        triton=triton.__version__, ptxas=ptxas_version(target_tuple[1]), torch=torch.__version__,
        target=list(target_tuple),
        smem_limit_bytes=SMEM_PER_BLOCK_SM90, dims=asdict(CLOVER_35B), dtypes=list(dtypes), ops_compiled=list(ops),
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
    for key, what in (("uncovered_kernels", "kernels no call of the op table launches"),
                      ("uncovered_helpers", "helpers no covered kernel calls"),
                      ("ops_missing", "ops of the table whose calls launch nothing")):
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
    p.add_argument("--ops", default="", help="comma-separated op names (clover_kernels.ops): compile only "
                                             "the cases their calls launch (default: all)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: TRITON_INTERPRET is set; unset it (the interpreter replaces the compiler)")
        return 2
    try:
        report = run_check(tuple(args.dtypes.split(",")), args.jobs, not args.no_compile, args.extra_module,
                           only=tuple(k for k in args.kernels.split(",") if k),
                           ops=tuple(o for o in args.ops.split(",") if o))
    except ValueError as exc:
        p.error(str(exc))
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
