"""The command lines' argument parser (``clover-lab``, ``python -m clover_lab.train``): a usage
error is one line naming the argument, with a pointer to ``--help``, and exit code 2, instead of
the whole usage block before it."""
from __future__ import annotations

import argparse


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
