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


# --------------------------------------------------------------------------- outputs never over inputs
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from clover_lab.errors import OutputError  # noqa: E402
from clover_lab.writes import refuse_inputs  # noqa: E402

NAMES = ["model", "corpus", "out", "model/config.json", "model/model.safetensors", "corpus/a.py", "corpus/sub/b.py",
         "out/report.json", "model/new.json", "corpus/new.npz", "link-config", "link-model", "hard-config"]


def _tree(root):
    for d in ("model", "corpus/sub", "out"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for f in ("model/config.json", "model/model.safetensors", "corpus/a.py", "corpus/sub/b.py", "out/report.json"):
        (root / f).write_text(f)
    if not (root / "link-config").exists():
        (root / "link-config").symlink_to(root / "model" / "config.json")
        (root / "link-model").symlink_to(root / "model", target_is_directory=True)
        import os
        os.link(root / "model" / "config.json", root / "hard-config")


# what each name is (links resolved; a hard link is its file) and the folders holding it as a file
IS = {"link-config": "model/config.json", "hard-config": "model/config.json", "link-model": "model"}
IN = {"model/config.json": {"model"}, "model/model.safetensors": {"model"}, "corpus/a.py": {"corpus"},
      "corpus/sub/b.py": {"corpus", "corpus/sub"}, "out/report.json": {"out"}, "link-config": {"model"}}


def _reads(name: str, inputs: list[str]) -> bool:
    """Whether writing ``name`` would write over one of ``inputs`` (the rule, by hand)."""
    sources = {IS.get(i, i) for i in inputs}
    return IS.get(name, name) in sources or bool(IN.get(name, set()) & sources)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(out=st.sampled_from(NAMES), inputs=st.lists(st.sampled_from(NAMES[:7] + ["link-model"]), max_size=3))
def test_an_output_is_refused_exactly_when_it_would_write_over_an_input(tmp_path, out, inputs):
    """The one rule (writes.refuse_inputs) every writer applies: a file output is refused when it is
    an input (under any name: a symlink, a hard link), an input folder, or an existing file in an input
    folder; a new file beside the inputs is not."""
    _tree(tmp_path)
    expected = _reads(out, inputs)
    try:
        refuse_inputs(tmp_path / out, [(f"input {i}", tmp_path / i) for i in inputs], "--out")
    except OutputError as e:
        assert expected, f"{out} refused though no input is written over: {e}"
        assert "overwrite the input" in str(e) and "--out" in str(e)
    else:
        assert not expected, f"{out} would write over one of {inputs}"


def test_route_stats_and_views_never_save_over_the_checkpoint(tmp_path, gen_text_model_dir):
    """The APIs that write a result computed from a loaded model know what it was computed from."""
    import shutil

    from clover_lab.lens.routing_stats import route_stats

    shutil.copytree(gen_text_model_dir, tmp_path / "m")
    engine = clover_lab.load(tmp_path / "m")
    (tmp_path / "m" / "old.npz").write_bytes(b"kept")
    stats = route_stats(engine, [[1, 2, 3, 4, 5, 6, 7, 8]], seq_len=8)
    with pytest.raises(OutputError, match="is a file in the model directory"):
        stats.save(tmp_path / "m" / "old.npz")
    assert (tmp_path / "m" / "old.npz").read_bytes() == b"kept"
    assert stats.save(tmp_path / "m" / "new.npz").exists()  # a new file beside the model is fine
