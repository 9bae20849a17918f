"""The command lines' argument parser (``clover-lab``, ``python -m clover_lab.train``): a usage
error is one line naming the argument, with a pointer to ``--help``, and exit code 2, instead of
the whole usage block before it."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from clover_lab.errors import InputError


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def writable_file(path, name: str) -> Path:
    """``path`` as a file that can be written, checked before the work whose result it holds: its
    folder exists and is writable, and it is not itself a folder."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise InputError(f"{name} {str(path)!r} is a folder; give a file name")
    if not folder.is_dir():
        raise InputError(f"{name} {str(path)!r}: the folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise InputError(f"{name} {str(path)!r}: the folder {str(folder)!r} is not writable")
    return path
