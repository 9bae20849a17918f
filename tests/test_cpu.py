"""CPU inference settings (clover_lab/cpu.py): one thread for a small model on the CPU, an explicit
count wins, the user's own count is left alone; glibc's malloc tuned for an engine on the CPU."""
from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

import clover_lab
from clover_lab import cpu
from clover_lab.checkpoint.loading import default_model_dir
from clover_lab.engine.sampling import SettingsError

needs_model = pytest.mark.skipif(default_model_dir() is None, reason="the embedded model is missing")


@pytest.fixture
def torch_threads(monkeypatch):
    """Two threads, as torch had them at import (nobody chose them), restored afterwards."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu, "_AT_IMPORT", 2)
    yield
    torch.set_num_threads(before)


@needs_model
def test_load_chooses_by_model_as_the_cli_does(torch_threads):
    engine = clover_lab.load()
    assert torch.get_num_threads() == 1  # the embedded model: one thread
    assert cpu.threads_for(engine.model) == 1
    torch.set_num_threads(2)
    cpu._AT_IMPORT = 2
    clover_lab.load(threads=2)  # an explicit count wins
    assert torch.get_num_threads() == 2
    # a model over the size: torch's count as it was (the CLI's and load()'s rule alike)
    assert cpu.set_threads(engine.model, small=10) == 2
    from clover_lab.cli import main as cli
    assert cli.set_threads(engine.model, None) == 1  # the CLI picks by load()'s threshold (cpu.py)


@needs_model
def test_load_leaves_the_users_own_count(torch_threads, monkeypatch):
    torch.set_num_threads(2)
    cpu._AT_IMPORT = 3  # the count changed since clover_lab was imported: the user's
    clover_lab.load()
    assert torch.get_num_threads() == 2
    cpu._AT_IMPORT = 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # chosen in the environment
    clover_lab.load()
    assert torch.get_num_threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    clover_lab.load()  # nobody chose: by model
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_thread_counts_are_refused_before_loading(bad, torch_threads):
    with pytest.raises(SettingsError, match=r"load\(threads\)"):
        clover_lab.load("/nonexistent/model", threads=bad)  # the argument's error, not the path's
    assert torch.get_num_threads() == 2


glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")


def heap() -> tuple[int, int]:
    """The process's brk heap, [start, end), from /proc/self/maps."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith("[heap]"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            return start, end
    raise AssertionError("no [heap] mapping")


@glibc
def test_a_large_block_comes_from_the_heap_and_stays_there_when_freed(monkeypatch):
    """Tuned, a 64 MB block is carved from the heap (untuned glibc maps it afresh and unmaps it on
    free, a page fault per 4 KB page every time), and freeing it does not shrink the heap.
    Whether the next block reuses those very pages depends on what else was allocated beside it
    (a fault count checked that, and failed whenever a small allocation pinned the freed block:
    every other block in a fresh process), so it is not asserted here."""
    monkeypatch.delenv("CLOVER_MALLOC", raising=False)
    assert cpu.tune_malloc()
    block = torch.empty(64 << 18, dtype=torch.float32)
    block.fill_(1.0)
    start, end = heap()
    assert start <= block.data_ptr() < end
    del block
    assert heap()[1] >= end


def test_system_malloc_is_left_alone_when_asked(monkeypatch):
    monkeypatch.setattr(cpu, "_applied", False)
    monkeypatch.setenv("CLOVER_MALLOC", "system")
    assert cpu.tune_malloc() is False


@glibc
def test_an_engine_on_the_cpu_tunes_malloc(monkeypatch, tiny_model):
    from clover_lab import Engine

    monkeypatch.delenv("CLOVER_MALLOC", raising=False)
    monkeypatch.setattr(cpu, "_applied", False)
    Engine(tiny_model)
    assert cpu._applied
