"""glibc malloc settings for CPU inference: large activations served from the heap and reused.

torch's CPU tensors come from ``malloc``. glibc serves blocks above its mmap threshold (128 KB,
raised on the fly up to 32 MB as mapped blocks are freed) with fresh pages from the kernel and
unmaps them on ``free``, so every new activation of that size pays a page fault per 4 KB page.
A 1024-token prefill of the medium model of ``bench/compare_transformers.py`` allocates and frees
tens of MB per layer: measured on the project's 2-core machine, ~170,000 page faults per prefill,
600 ms against 420 ms once they are gone; and since the threshold moves with the allocation
history, the same prefill also swings between those two speeds from run to run.

``tune()`` sets the mmap threshold to 1 GB (heap blocks for everything short of that) and the trim
threshold to 2 GB (freed heap memory is kept for the next allocation instead of being handed back).
The price: the process keeps the heap it has grown to, so its resident memory does not shrink
after a long prompt; the peak is unchanged (``bench/memory.py``). ``Engine`` calls it for models on
the CPU; ``CLOVER_MALLOC=system`` leaves glibc's defaults alone. Elsewhere than glibc it does nothing.
"""
from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1
FALLBACK_MMAP_THRESHOLD = 32 << 20  # glibc builds that cap the threshold at HEAP_MAX_SIZE / 2

_applied = False


def tune() -> bool:
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
