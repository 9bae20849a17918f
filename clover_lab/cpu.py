"""CPU inference settings: torch's thread count and glibc's allocator.

**Threads.** How many torch threads a model runs with on the CPU: one policy for ``clover_lab.load()`` and
the CLI (``--threads``).

A small model's matrix products are too small to split: the embedded 16M model ran 76-123
tokens/s with one thread and 1.3-5.6 with two on a busy two-core machine. So a model under
:data:`SMALL_MODEL_PARAMETERS` whose weights are all on the CPU gets one thread; a larger one (or
one on a GPU) keeps torch's default. An explicit count always wins.

The automatic choice never overrides the user's own: it leaves torch alone when
``OMP_NUM_THREADS`` is set in the environment, or when the count differs from the one torch had
when clover_lab was imported (the user called ``torch.set_num_threads`` since).


**Allocator.** glibc malloc settings for CPU inference: large activations served from the heap and reused.

torch's CPU tensors come from ``malloc``. glibc serves blocks above its mmap threshold (128 KB,
raised on the fly up to 32 MB as mapped blocks are freed) with fresh pages from the kernel and
unmaps them on ``free``, so every new activation of that size pays a page fault per 4 KB page.
A 1024-token prefill of the medium model of ``bench/compare_transformers.py`` allocates and frees
tens of MB per layer: measured on the project's 2-core machine, ~170,000 page faults per prefill,
600 ms against 420 ms once they are gone; and since the threshold moves with the allocation
history, the same prefill also swings between those two speeds from run to run.

``tune_malloc()`` sets the mmap threshold to 1 GB (heap blocks for everything short of that) and the trim
threshold to 2 GB (freed heap memory is kept for the next allocation instead of being handed back).
The price: the process keeps the heap it has grown to, so its resident memory does not shrink
after a long prompt; the peak is unchanged (``bench/memory.py``). ``Engine`` calls it for models on
the CPU; ``CLOVER_MALLOC=system`` leaves glibc's defaults alone. Elsewhere than glibc it does nothing.
"""
from __future__ import annotations

import ctypes
import os
import platform

import torch

SMALL_MODEL_PARAMETERS = 100_000_000
_AT_IMPORT = torch.get_num_threads()  # torch's count when clover_lab was imported


def user_chose_threads() -> bool:
    """Whether the thread count is the user's: ``OMP_NUM_THREADS`` set, or the count changed
    since clover_lab was imported."""
    return bool(os.environ.get("OMP_NUM_THREADS")) or torch.get_num_threads() != _AT_IMPORT


def threads_for(model, small: int | None = None) -> int | None:
    """One thread for a model under ``small`` parameters (default :data:`SMALL_MODEL_PARAMETERS`)
    on the CPU; None (torch's default) otherwise."""
    small = SMALL_MODEL_PARAMETERS if small is None else small
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    return 1 if on_cpu and sum(p.numel() for p in model.parameters()) < small else None


def check_threads(threads, where: str = "threads") -> int | None:
    """``threads`` as a count >= 1 or None, else a SettingsError naming it."""
    from clover_lab.engine.sampling import SettingsError

    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise SettingsError(f"{where}={threads!r}: expected an int >= 1, or None to choose by model")
    return threads


def set_threads(model, threads: int | None = None, *, respect_user: bool = True, small: int | None = None) -> int:
    """Apply the policy: ``threads`` when given; else one for a small CPU model, unless
    ``respect_user`` and the user chose a count (:func:`user_chose_threads`); else torch's as it
    is. Returns the count in effect. (The CLI is a process of its own: its user's choice is
    ``--threads``, so it passes ``respect_user=False``.)"""
    global _AT_IMPORT
    threads = check_threads(threads)
    if threads is None and not (respect_user and user_chose_threads()):
        threads = threads_for(model, small)
    if threads is not None:
        torch.set_num_threads(threads)
        _AT_IMPORT = torch.get_num_threads()  # ours, not the user's: a later load() may choose again
    return torch.get_num_threads()


M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1
FALLBACK_MMAP_THRESHOLD = 32 << 20  # glibc builds that cap the threshold at HEAP_MAX_SIZE / 2

_applied = False


def tune_malloc() -> bool:
    """Apply the settings once per process; True when they are in effect."""
    global _applied
    if _applied:
        return True
    if os.environ.get("CLOVER_MALLOC", "").strip().lower() == "system":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) or libc.mallopt(M_MMAP_THRESHOLD, FALLBACK_MMAP_THRESHOLD)):
        return False
    libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    _applied = True
    return True
