"""Tests moved from test_reliability_inputs.py."""
import os

import pytest
from injected_faults import FULL, Writes, leftovers, same_weights

import clover_lab
from clover_lab import CheckpointError, CloverModel
from clover_lab.errors import InputError
from clover_lab.writes import MARKER


@pytest.mark.parametrize("value", [0, -1, 2.5, "1GB", True])
def test_max_shard_bytes_must_be_a_positive_int(tiny_model, tmp_path, value):
    with pytest.raises(InputError, match="max_shard_bytes"):
        tiny_model.save_pretrained(tmp_path / "m", max_shard_bytes=value)
    assert not (tmp_path / "m").exists()
    tiny_model.save_pretrained(tmp_path / "m", max_shard_bytes=200_000)  # a real limit: several shards
    assert len(list((tmp_path / "m").glob("model-*.safetensors"))) > 1



# --------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("shards", [1, 3], ids=["one-file", "sharded"])
@pytest.mark.parametrize("error", [FULL, KeyboardInterrupt()], ids=["disk-full", "interrupt"])
def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch, shards, error):
    """At every write of save_pretrained over an existing checkpoint: the old one still loads,
    exactly, and nothing of the failed save is left."""
    old, new = CloverModel.random("clover-tiny", seed=1), CloverModel.random("clover-tiny", seed=2)
    limit = None if shards == 1 else sum(p.numel() * 4 for p in old.parameters()) // shards + 1
    with monkeypatch.context() as m:
        counted = Writes(m)
        new.save_pretrained(tmp_path / "count", max_shard_bytes=limit)
    n = counted.calls
    weight_files = len(list((tmp_path / "count").glob("model*.safetensors")))
    assert (weight_files > 1) == (shards > 1)
    assert n == 1 + weight_files + (weight_files > 1) + 1  # config, the weights (and the index), the commit's marker
    for k in range(1, n + 1):
        d = tmp_path / f"at-{k}"
        old.save_pretrained(d, max_shard_bytes=limit)
        (d / "tokenizer.json").write_text("{}")  # a user's file beside the checkpoint
        before = sorted(p.name for p in d.iterdir())
        with monkeypatch.context() as m:
            Writes(m, fail_at=k, error=error)
            with pytest.raises(type(error)):
                new.save_pretrained(d, max_shard_bytes=limit)
        assert sorted(p.name for p in d.iterdir()) == before and not leftovers(d), k
        assert same_weights(CloverModel.from_pretrained(d), old), k
    new.save_pretrained(d, max_shard_bytes=limit)  # and the next save goes through
    assert same_weights(CloverModel.from_pretrained(d), new) and (d / "tokenizer.json").exists()


@pytest.mark.parametrize("layouts", [(None, 3), (3, None), (3, 2)], ids=["one-to-shards", "shards-to-one", "3-to-2"])
def test_a_save_stopped_between_its_renames_is_refused_until_saved_again(tmp_path, monkeypatch, layouts):
    """A crash while the new files are renamed into place (only a kill can land there: the
    renames hold Ctrl-C and SIGTERM off) leaves a directory that would load as a mix of the
    two saves: the loader refuses it, naming the save; saving again repairs it."""
    old, new = CloverModel.random("clover-tiny", seed=1), CloverModel.random("clover-tiny", seed=2)
    total = sum(p.numel() * 4 for p in old.parameters())
    limit = [None if s is None else total // s + 1 for s in layouts]
    old.save_pretrained(tmp_path, max_shard_bytes=limit[0])
    real, calls = os.replace, []

    def crash(src, dst):
        calls.append(dst)
        if len(calls) == 3:  # the marker, the first new file, then the crash
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        new.save_pretrained(tmp_path, max_shard_bytes=limit[1])
    monkeypatch.undo()
    assert (tmp_path / MARKER).exists()
    with pytest.raises(CheckpointError, match=r"an unfinished save: it stopped while putting .*config\.json.* in "
                                              r"place, so the directory may mix two saves and is incomplete"):
        CloverModel.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="an unfinished save"):
        clover_lab.load(tmp_path)
    new.save_pretrained(tmp_path, max_shard_bytes=limit[1])
    assert not (tmp_path / MARKER).exists() and not leftovers(tmp_path)
    assert same_weights(CloverModel.from_pretrained(tmp_path), new)


def test_a_save_replaces_only_the_checkpoints_own_files(tmp_path):
    """Shards of the previous save go once the new set is in; files clover_lab did not write
    (a tokenizer, notes, a user's own safetensors file) stay."""
    model = CloverModel.random("clover-tiny", seed=1)
    total = sum(p.numel() * 4 for p in model.parameters())
    model.save_pretrained(tmp_path, max_shard_bytes=total // 3 + 1)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    for name in ("tokenizer.json", "notes.txt", "model_backup.safetensors"):
        (tmp_path / name).write_text("mine")
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors",
                                                         "model_backup.safetensors", "notes.txt", "tokenizer.json"]
    assert same_weights(CloverModel.from_pretrained(tmp_path), model)


def test_an_index_naming_a_missing_shard_is_refused_as_incomplete(tmp_path):
    model = CloverModel.random("clover-tiny", seed=1)
    model.save_pretrained(tmp_path, max_shard_bytes=sum(p.numel() * 4 for p in model.parameters()) // 2 + 1)
    next(tmp_path.glob("model-00002-of-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match=r"names shard 'model-00002-of-0000\d\.safetensors' .* is missing: "
                                              r"the checkpoint is incomplete"):
        CloverModel.from_pretrained(tmp_path)


def test_a_save_removes_the_temporaries_a_killed_save_left(tmp_path):
    """A kill (no Python cleanup runs) leaves hidden temporaries, possibly a checkpoint's size:
    the next save into the directory removes those, and nothing else."""
    model = CloverModel.random("clover-tiny", seed=1)
    model.save_pretrained(tmp_path)
    killed = [tmp_path / ".model.clover-tmp-0a1b2c3d.safetensors", tmp_path / ".files.clover-tmp-x1y2"]
    killed[0].write_bytes(b"half a shard")
    killed[1].mkdir()
    (tmp_path / ".hidden-of-mine").write_text("mine")
    for p in killed:
        os.utime(p, (1, 1))
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden-of-mine", "config.json", "model.safetensors"]
