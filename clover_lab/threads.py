"""How many torch threads a model runs with on the CPU: one policy for ``clover_lab.load()`` and
the CLI (``--threads``).

A small model's matrix products are too small to split: the embedded 16M model ran 76-123
tokens/s with one thread and 1.3-5.6 with two on a busy two-core machine. So a model under
:data:`SMALL_MODEL_PARAMETERS` whose weights are all on the CPU gets one thread; a larger one (or
one on a GPU) keeps torch's default. An explicit count always wins.

The automatic choice never overrides the user's own: it leaves torch alone when
``OMP_NUM_THREADS`` is set in the environment, or when the count differs from the one torch had
when clover_lab was imported (the user called ``torch.set_num_threads`` since).
"""
from __future__ import annotations

import os

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
    from .sampling import SettingsError

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
