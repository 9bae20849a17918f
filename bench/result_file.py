"""A benchmark's JSON file: named and written one way for every script under bench/.

    from result_file import RESULTS, write_result     # bench/ is on sys.path for a script run from it
    write_result(args.out, f"coreset-{model}-cpu", dict(settings=vars(args), rows=rows))
    # writes and prints bench/results/coreset-default-cpu-20261201-193705.json

The name is ``<stem>-<stamp>.json``, the stamp the UTC time (``TIME``) or day (``DATE``); a stem
that holds its own date (``fmt=None``) is used as it is. Every file, a user's ``--json`` path too
(``write_json``), is written through ``clover_lab.writes.atomic_path``: a payload that cannot be
written (not JSON-serialisable, a full disk, an interrupt) raises and leaves no file of that name
half written, and an older file under it stays as it was. clover_lab (and with it torch) is
imported only when a file is written: scripts that import this first set TRITON_INTERPRET and
CLOVER_KERNELS before torch and triton load.
"""
from __future__ import annotations

import datetime as dt
import json
import platform
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"  # the scripts' default --out: committed figures
TIME, DATE = "%Y%m%d-%H%M%S", "%Y-%m-%d"


def stamp(fmt: str = TIME) -> str:
    """The current UTC time in ``fmt``."""
    return dt.datetime.now(dt.timezone.utc).strftime(fmt)


def slug(name: str) -> str:
    """A device's name as a part of a file name: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def run_fields(benchmark: str, device: str) -> dict:
    """What ran where, the head of a payload: the benchmark, the local date and time, the device
    and its name (the GPU's, or the CPU's), torch and its threads."""
    import torch

    name = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"
    return {"benchmark": benchmark, "date": dt.datetime.now().isoformat(timespec="seconds"), "device": device,
            "device_name": name, "torch": torch.__version__, "threads": torch.get_num_threads()}


def result_path(out_dir, stem: str, fmt: str | None = TIME) -> Path:
    """``out_dir/<stem>-<stamp>.json``; ``out_dir/<stem>.json`` where ``fmt`` is None."""
    return Path(out_dir) / (f"{stem}.json" if fmt is None else f"{stem}-{stamp(fmt)}.json")


def write_json(path, payload, indent: int | None = 1, default=None) -> Path:
    """``payload`` as JSON (and a newline) in the file ``path``, whole or not at all; its folder is
    made. An OutputError naming the path and what was wrong when it cannot be serialised or
    written."""
    from clover_lab.errors import OutputError
    from clover_lab.writes import atomic_path

    path = Path(path)
    try:
        with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=indent, default=default)  # streamed: a failure leaves half a temp,
            f.write("\n")                                          # which atomic_path removes
    except (TypeError, ValueError) as e:  # what json raises for an object it cannot write, a cycle
        raise OutputError(f"{path}: the result is not JSON ({e}); nothing was written") from e
    except OSError as e:  # a folder that cannot be made, a full disk
        raise OutputError(f"{path}: cannot write the result ({e.strerror or e}); nothing was written") from e
    return path


def write_result(out_dir, stem: str, payload, fmt: str | None = TIME, indent: int | None = 1) -> Path:
    """``payload`` in ``result_path(out_dir, stem, fmt)`` (``write_json``); prints "wrote <path>"."""
    path = write_json(result_path(out_dir, stem, fmt), payload, indent=indent)
    print(f"wrote {path}")
    return path
