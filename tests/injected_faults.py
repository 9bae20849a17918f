"""Faults injected where they can land, for the tests that a failed or interrupted write leaves
what a user had (checkpoints, FP8 copies, traces, single files, adapt's exports) and that a
training run stopped at any boundary resumes as if never stopped: a full disk (OSError ENOSPC
after half a file is written) or an interrupt (KeyboardInterrupt) at the n-th write
(``Writes``), and a signal, an interrupt or a full disk at the n-th call of a boundary
(``at_call``)."""
import errno
import os
import pathlib
import signal

import torch

from clover_lab import CloverModel
from clover_lab.writes import is_own_temp

FULL = OSError(errno.ENOSPC, "No space left on device")


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in pathlib.Path(directory).rglob("*") if is_own_temp(p))


class Writes:
    """Counts the writes of a save (each safetensors file and each text file) and fails the
    ``fail_at``-th with ``error``; a full disk writes half the file first."""

    def __init__(self, monkeypatch, fail_at: int | None = None, error: BaseException = FULL):
        import safetensors.torch

        self.calls, self.fail_at, self.error = 0, fail_at, error
        real_save, real_text = safetensors.torch.save_file, pathlib.Path.write_text

        def save_file(tensors, filename, metadata=None):
            self._write(lambda: real_save(tensors, filename, metadata=metadata), filename)

        def write_text(path, data, *a, **k):
            return self._write(lambda: real_text(path, data, *a, **k), path)

        for module in ("clover_lab.checkpoint.saving", "clover_lab.hooks.trace", "clover_lab.steering.schedule",
                       "clover_lab.features.saelens"):
            monkeypatch.setattr(f"{module}.save_file", save_file)
        monkeypatch.setattr(pathlib.Path, "write_text", write_text)

    def _write(self, write, filename):
        self.calls += 1
        if self.calls != self.fail_at:
            return write()
        if isinstance(self.error, OSError):  # the disk filled up halfway through the file
            write()
            size = os.path.getsize(filename)
            with open(filename, "r+b") as f:
                f.truncate(size // 2)
        raise self.error


def same_weights(a: CloverModel, b: CloverModel) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def at_call(n: int, action: str):
    """What happens at the n-th call of a boundary: a signal delivered there (noted, acted on
    after the step), a KeyboardInterrupt raised after the real call (a step applied but not
    counted: the worst place), or a full disk before it."""
    calls = []

    def wrap(real):
        def wrapper(*a, **k):
            calls.append(1)
            if len(calls) == n and action in ("SIGINT", "SIGTERM"):
                signal.raise_signal(getattr(signal, action))
            if len(calls) == n and action == "disk-full":
                raise OSError(errno.ENOSPC, "No space left on device")
            out = real(*a, **k)
            if len(calls) == n and action == "raise":
                raise KeyboardInterrupt
            return out
        return wrapper

    return wrap
