"""clover_lab.cpu: with the settings applied, a large freed block is reused without faulting
its pages in again (glibc's default unmaps blocks over 32 MB on free and faults them back)."""
import platform
import resource

import pytest
import torch

from clover_lab import cpu

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")


def faults_of_a_fresh_block(mb: int = 64) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.empty(mb << 18, dtype=torch.float32)  # mb MB
    block.fill_(1.0)
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@glibc
def test_a_large_block_is_reused_without_page_faults(monkeypatch):
    monkeypatch.delenv("CLOVER_MALLOC", raising=False)
    assert cpu.tune_malloc()
    faults_of_a_fresh_block()  # the first one may grow the heap
    assert faults_of_a_fresh_block() < 1000  # 64 MB is 16384 pages: none faulted again


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
