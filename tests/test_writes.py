"""Tests moved from test_reliability_writes.py."""

import numpy as np
import pytest
from failing_writes import FULL, Writes, leftovers

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


# --------------------------------------------------------------------------- modes
@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_written_files_take_the_process_umask(tmp_path, tiny_model, tiny_engine, gen_tokenizer, mask):
    """safetensors' save_file (and tempfile) create 0600 files: an exported checkpoint's weights were
    unreadable to another user or a service account whatever the umask, while config.json was 0644.
    Every file clover_lab writes gets 0666 less the umask, as a file opened for writing would."""
    import os
    import stat

    from clover_lab.writes import FileSet

    before = os.umask(mask)
    try:
        tiny_model.save_pretrained(tmp_path / "ckpt")
        tiny_model.save_pretrained(tmp_path / "shards", max_shard_bytes=200_000)
        route_stats(1).save(tmp_path / "routes.npz")
        with tiny_engine.capture(["denoise.step"]) as cap:
            tiny_engine.generate([1, 2, 3], max_new_tokens=4)
        cap.save(tmp_path / "trace")
        with FileSet(tmp_path / "tok") as files:  # a tokenizer's save_pretrained through a temporary folder
            files.put_written_by(gen_tokenizer.save_pretrained, tmp_path / "tok")
    finally:
        os.umask(before)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(written) >= 8 and (tmp_path / "shards" / "model.safetensors.index.json").exists()
    modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in written}
    assert set(modes.values()) == {oct(0o666 & ~mask)}, modes
