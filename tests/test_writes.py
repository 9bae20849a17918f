"""Tests moved from test_reliability_writes.py."""

import numpy as np
import pytest
from injected_faults import FULL, Writes, leftovers

import clover_lab
from clover_lab.lens.routing_stats import RouteStats


# --------------------------------------------------------------------------- single files
def route_stats(scale: int) -> RouteStats:
    counts = np.full((2, 4), scale, np.int64)
    return RouteStats("commit", 16, 2, counts, np.zeros((2, 4, 4)), np.zeros((2, 4)), np.zeros(2), scale * 4)


@pytest.mark.parametrize("error", [FULL, KeyboardInterrupt()], ids=["disk-full", "interrupt"])
def test_a_failed_single_file_write_leaves_the_previous_file(tmp_path, monkeypatch, error):
    """The routes file and config.json (every single file goes through writes.atomic_path)."""
    path = route_stats(1).save(tmp_path / "routes.npz")
    clover_lab.CloverConfig.preset("clover-tiny").save(tmp_path)
    config = (tmp_path / "config.json").read_text()
    real = np.savez_compressed

    def savez(file, **arrays):
        real(file, **arrays)
        if isinstance(error, OSError):
            with open(file, "r+b") as f:
                f.truncate(100)
        raise error

    with monkeypatch.context() as m:
        m.setattr(np, "savez_compressed", savez)
        with pytest.raises(type(error)):
            route_stats(2).save(path)
        Writes(m, fail_at=1, error=error)
        with pytest.raises(type(error)):
            clover_lab.CloverConfig.preset("clover-tiny", num_hidden_layers=8).save(tmp_path)
    assert RouteStats.load(path).tokens == 4 and (tmp_path / "config.json").read_text() == config
    assert not leftovers(tmp_path)
