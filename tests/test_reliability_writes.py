"""Issue 29, writes and training: nothing a user had is destroyed by a failed write, nothing
half-written loads as something else, and a training run stopped at any boundary resumes as if it
had never stopped.

Faults are injected where they can land: a full disk (OSError ENOSPC after half a file is
written) and an interrupt (KeyboardInterrupt) at every write of a save, a crash between the
renames that put a save in place, and Ctrl-C / SIGTERM delivered (or a KeyboardInterrupt raised)
inside the optimizer step, the log line and the checkpoint of a training step.
"""
import errno
import json
import os
import pathlib
import shutil
import signal

import numpy as np
import pytest
import torch

import clover_lab
from clover_lab import CheckpointError, CloverError, CloverModel, TraceError
from clover_lab.errors import OutputError
from clover_lab.hooks.records import Record
from clover_lab.hooks.trace import Trace, load_trace
from clover_lab.lens.routing_stats import RouteStats
from clover_lab.writes import MARKER, is_own_temp

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

        for module in ("clover_lab.checkpoint.saving", "clover_lab.hooks.trace"):
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


@pytest.mark.parametrize("error", [FULL, KeyboardInterrupt()], ids=["disk-full", "interrupt"])
def test_a_failed_quantization_leaves_the_previous_one(tmp_path, monkeypatch, error):
    from clover_lab.checkpoint.quantize import quantize_checkpoint

    src = tmp_path / "src"
    CloverModel.random("clover-tiny", seed=1).save_pretrained(src)
    dst = tmp_path / "fp8"
    quantize_checkpoint(src, dst, block=(32, 32), max_shard_bytes=1 << 16)
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    CloverModel.random("clover-tiny", seed=2).save_pretrained(src)
    with monkeypatch.context() as m:
        Writes(m, fail_at=3, error=error)  # the third shard
        with pytest.raises(type(error)):
            quantize_checkpoint(src, dst, block=(32, 32), max_shard_bytes=1 << 16)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before
    with pytest.raises(OutputError, match="is the input"):  # and never onto its own source
        quantize_checkpoint(src, src)


# --------------------------------------------------------------------------- traces
def small_trace(value: float) -> Trace:
    records = [Record("layers.0.output", 0, "decode", 0, s, dict(layer=0, mode="preview", positions=torch.arange(4),
                                                                  value=torch.full((1, 4, 8), value + s)))
               for s in range(3)]
    return Trace(records, ["layers.0.output"], {"prompt": "p"})


def test_a_trace_is_never_saved_over_other_files(tmp_path, monkeypatch):
    """``save('.')`` used to empty the working directory: a directory holding anything but a
    trace is refused, and left as it was."""
    (tmp_path / "notebook.ipynb").write_text("{}")
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputError, match=r"\. holds files that are not a trace's \(data, notebook\.ipynb\)"):
        small_trace(1.0).save(".")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notebook.ipynb"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="is a file"):
        small_trace(1.0).save("file")
    small_trace(1.0).save("run")  # a new directory, and then a trace replaced by another
    small_trace(2.0).save("run")
    assert float(load_trace("run")["layers.0.output"][0]["value"][0, 0, 0]) == 2.0
    assert isinstance(OutputError("x"), CloverError) and isinstance(OutputError("x"), ValueError)


@pytest.mark.parametrize("fail_at", [1, 2], ids=["tensors", "json"])
@pytest.mark.parametrize("error", [FULL, KeyboardInterrupt()], ids=["disk-full", "interrupt"])
def test_a_failed_trace_save_leaves_the_previous_trace(tmp_path, monkeypatch, fail_at, error):
    small_trace(1.0).save(tmp_path / "t")
    with monkeypatch.context() as m:
        Writes(m, fail_at=fail_at, error=error)
        with pytest.raises(type(error)):
            small_trace(2.0).save(tmp_path / "t")
    assert float(load_trace(tmp_path / "t")["layers.0.output"][0]["value"][0, 0, 0]) == 1.0
    assert not leftovers(tmp_path)
    with monkeypatch.context() as m:  # a first save that fails leaves no directory that loads
        Writes(m, fail_at=fail_at, error=error)
        with pytest.raises(type(error)):
            small_trace(2.0).save(tmp_path / "new")
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "new")


def test_an_unfinished_trace_is_refused(tmp_path, monkeypatch):
    small_trace(1.0).save(tmp_path / "t")
    real, calls = os.replace, []

    def crash(src, dst):
        calls.append(dst)
        if len(calls) == 3:  # the marker, the tensors, then the crash before trace.json
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        small_trace(2.0).save(tmp_path / "t")
    monkeypatch.undo()
    with pytest.raises(TraceError, match=r"an unfinished save: it stopped while putting tensors\.safetensors, "
                                              r"trace\.json in place"):
        load_trace(tmp_path / "t")


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


# --------------------------------------------------------------------------- adapt's outputs
from test_adapt import clover_init, data  # noqa: E402,F401 - the same small init and corpus

from clover_lab.cli.main import main as cli_main  # noqa: E402

STEPS = ["--steps", "4", "--seq-len", "32", "--batch-size", "2", "--log-every", "1", "--checkpoint-every", "2",
         "--seed", "3", "--train", "all"]


def adapt(*argv) -> int:
    return cli_main(["adapt", *map(str, argv)])


def test_adapt_refuses_to_write_over_its_init(tmp_path, clover_init, capsys):
    init = tmp_path / "init"
    shutil.copytree(clover_init, init)
    before = {p.name: p.read_bytes() for p in init.iterdir()}
    assert adapt("--init", init, "--data", "stdlib", "--out", init, *STEPS) == 2
    assert "--out (equal to --init): the output" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in init.iterdir()} == before


def test_adapt_finds_an_unwritable_out_before_the_run(tmp_path, clover_init, data, capsys):
    (tmp_path / "a-file").write_text("x")
    for out in (tmp_path / "a-file" / "out", tmp_path / "a-file"):
        assert adapt("--init", clover_init, "--data", data, "--out", out, *STEPS) == 2
        err = capsys.readouterr().err
        assert f"--out {out}: {tmp_path / 'a-file'} is a file, not a directory" in err, err
        assert "mask token" not in err  # nothing was loaded or trained


def test_the_other_commands_find_an_unwritable_output_before_the_run(tmp_path, capsys):
    """train and distill: the output checked before the model is loaded or trained (routes:
    tests/test_reliability_inputs.py)."""
    (tmp_path / "a-file").write_text("x")
    bad = tmp_path / "a-file" / "sub"
    assert cli_main(["train", "--out", str(bad), "--minutes", "1"]) == 2
    assert cli_main(["train", "--out", str(tmp_path / "run"), "--export", str(bad), "--minutes", "1"]) == 2
    assert not (tmp_path / "run").exists()
    from clover_lab.train import distill

    with pytest.raises(SystemExit):
        distill.main(["--model", str(tmp_path), "--tokens", str(tmp_path / "a-file"), "--out", str(bad / "d.pt")])
    err = capsys.readouterr().err
    assert err.count(f"--out {bad}: {tmp_path / 'a-file'} is a file") == 2 and f"--export {bad}: " in err, err


def test_a_refused_adapt_run_leaves_nothing_to_resume(tmp_path, clover_init, data, capsys):
    """A first run refused after its data was encoded (too few tokens for --seq-len) removes
    what it made, so the corrected command (other --data) starts instead of being refused as
    the resume of a run that never was."""
    out = tmp_path / "out"
    assert adapt("--init", clover_init, "--data", data, "--out", out, *STEPS[:2], "--seq-len", "1000000") == 2
    assert "fewer than one --seq-len" in capsys.readouterr().err
    assert not out.exists()
    files = sorted(map(str, data.iterdir()))
    assert adapt("--init", clover_init, "--data", *files, "--out", out, *STEPS) == 0
    assert json.loads((out / "training" / "loss_log.jsonl").read_text().splitlines()[-1])["step"] == 4


# --------------------------------------------------------------------------- training stops
def log_of(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "training" / "loss_log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "time"} for r in rows]


def trained_state(out) -> int:
    return torch.load(out / "training" / "state.pt", weights_only=False)["step"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, clover_init, data):
    out = tmp_path_factory.mktemp("uninterrupted") / "out"
    assert adapt("--init", clover_init, "--data", data, "--out", out, *STEPS) == 0
    return out


@pytest.mark.parametrize("error", [FULL, KeyboardInterrupt()], ids=["disk-full", "interrupt"])
def test_a_failed_adapt_export_leaves_the_previous_export(tmp_path, monkeypatch, clover_init, data, uninterrupted,
                                                          error):
    """At every write of the export (rerunning a finished run exports it again): the previous
    export stays whole and loadable."""
    out = tmp_path / "out"
    shutil.copytree(uninterrupted, out)
    argv = ("--init", clover_init, "--data", data, "--out", out, *STEPS)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with monkeypatch.context() as m:
        counted = Writes(m)
        assert adapt(*argv) == 0
    assert counted.calls >= 4  # config, weights, generation_config.json, the marker
    for k in range(1, counted.calls + 1):
        with monkeypatch.context() as m:
            Writes(m, fail_at=k, error=error)
            assert adapt(*argv) == (2 if isinstance(error, OSError) else 130), k
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before and not leftovers(out), k
    assert CloverModel.from_pretrained(out) is not None


def _at(n: int, action: str):
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


class _LogJson:
    """adapt's json module with a boundary at the log line of one step."""

    def __init__(self, step: int, wrap):
        self._step, self._wrapped = step, wrap(json.dumps)

    def dumps(self, obj, *a, **k):
        if isinstance(obj, dict) and obj.get("step") == self._step:
            return self._wrapped(obj, *a, **k)
        return json.dumps(obj, *a, **k)

    def __getattr__(self, name):
        return getattr(json, name)


def _patch(monkeypatch, boundary: str, wrap):
    import clover_lab.train.adapt as adapt_module

    if boundary == "optimizer step 3":
        monkeypatch.setattr(torch.optim.AdamW, "step", wrap(torch.optim.AdamW.step))
    elif boundary == "log line 3":
        monkeypatch.setattr(adapt_module, "json", _LogJson(3, wrap))
    elif boundary == "checkpoint 2 (DCP)":
        monkeypatch.setattr(adapt_module, "save_checkpoint", wrap(adapt_module.save_checkpoint))
    elif boundary == "checkpoint 4 (state)":
        real = torch.save
        wrapped = wrap(real)
        monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (wrapped if "state" in str(f) else real)(obj, f,
                                                                                                             *a, **k))
    else:
        raise AssertionError(boundary)


# (boundary, action, n-th call) -> the step the run stopped at with a checkpoint (or None: kept its last)
STOPS = [("optimizer step 3", "SIGINT", 3, 3), ("optimizer step 3", "SIGTERM", 3, 3),
         ("optimizer step 3", "raise", 3, 2),
         ("log line 3", "SIGINT", 1, 3), ("log line 3", "raise", 1, 2),
         ("checkpoint 2 (DCP)", "SIGTERM", 1, 2), ("checkpoint 2 (DCP)", "raise", 1, None),
         ("checkpoint 2 (DCP)", "disk-full", 2, 2), ("checkpoint 4 (state)", "raise", 2, 2),
         ("checkpoint 4 (state)", "disk-full", 2, 2)]


@pytest.mark.parametrize("boundary, action, n, saved", STOPS, ids=[f"{b}-{a}" for b, a, _, _ in STOPS])
def test_an_adapt_run_stopped_at_any_boundary_resumes_as_if_never_stopped(
        tmp_path, monkeypatch, capsys, clover_init, data, uninterrupted, boundary, action, n, saved):
    """Ctrl-C and SIGTERM are acted on only after the step in progress, its log line and its
    checkpoint: the run stops with a checkpoint of that whole, logged step. A KeyboardInterrupt
    raised inside a step (or a full disk in a checkpoint) saves nothing of it: the previous
    checkpoint stays whole. Either way the rerun resumes to the uninterrupted run's log and
    weights, exactly."""
    out = tmp_path / "out"
    argv = ("--init", clover_init, "--data", data, "--out", out, *STEPS)
    with monkeypatch.context() as m:
        _patch(m, boundary, _at(n, action))
        code = adapt(*argv)
    err = capsys.readouterr().err
    assert code == {"SIGINT": 0, "SIGTERM": 0, "raise": 130, "disk-full": 2}[action], err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are restored
    state = out / "training" / "state.pt"
    assert (trained_state(out) if state.exists() else None) == saved
    logged = [r["step"] for r in log_of(out)]
    if action in ("SIGINT", "SIGTERM"):  # stopped after a whole step: checkpointed, logged and exported
        assert "interrupted: saving a checkpoint to resume from" in err and logged == list(range(1, saved + 1))
        assert (out / "model.safetensors").is_file()
    if action == "raise":
        assert "nothing of it was saved; the run resumes from" in err
    assert not leftovers(out) and not list((out / "training").glob(".checkpoint-*"))
    assert adapt(*argv) == 0
    assert log_of(out) == log_of(uninterrupted)
    want, got = (load_file_dict(d / "model.safetensors") for d in (uninterrupted, out))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def load_file_dict(path):
    from safetensors.torch import load_file

    return load_file(str(path))


# --------------------------------------------------------------------------- clover-lab train's loop
SMALL_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                    shared_expert_intermediate_size=64, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16)


def _train(run, monkeypatch):
    from clover_lab import train as training

    small = [f for f in training.stdlib_files() if f.name in ("bisect.py", "heapq.py", "colorsys.py", "keyword.py")]
    monkeypatch.setattr(training.loop, "split_corpus", lambda root=None: (small[:-1], small[-1:]))
    settings = training.TrainSettings(seq_len=32, batch_size=2, lr=3e-3, warmup_steps=2, max_steps=4)
    training.train(run, minutes=10, vocab_size=300, block_size=16, settings=settings, overrides=SMALL_CONFIG,
                   log_every=1, checkpoint_every=2)


@pytest.mark.parametrize("action, saved", [("SIGINT", 3), ("raise", 2)])
def test_a_training_run_stopped_inside_a_step_resumes_as_if_never_stopped(tmp_path, monkeypatch, action, saved):
    """The same for ``clover-lab train`` (train/loop.py), whose checkpoint is the weights and
    the state put in place together."""
    _train(tmp_path / "whole", monkeypatch)
    run = tmp_path / "stopped"
    with monkeypatch.context() as m:
        m.setattr(torch.optim.AdamW, "step", _at(3, action)(torch.optim.AdamW.step))
        if action == "raise":
            with pytest.raises(KeyboardInterrupt):
                _train(run, m)
        else:
            _train(run, m)
    assert torch.load(run / "train_state.pt", weights_only=False)["step"] == saved
    _train(run, monkeypatch)
    logs = [[{k: v for k, v in json.loads(line).items() if k != "time"}
             for line in (d / "loss_log.jsonl").read_text().splitlines()] for d in (tmp_path / "whole", run)]
    assert logs[0] == logs[1] and [r["step"] for r in logs[0]] == [1, 2, 3, 4]
    assert same_weights(*(CloverModel.from_pretrained(d / "checkpoint") for d in (tmp_path / "whole", run)))


def test_signals_are_noted_and_passed_on():
    from clover_lab.signals import NotedSignals

    with NotedSignals() as noted:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)
    assert noted.names == "SIGINT, SIGTERM"
    with pytest.raises(KeyboardInterrupt), NotedSignals(second_raises=True):  # the user insists
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
    done = []
    with pytest.raises(KeyboardInterrupt), NotedSignals(redeliver=True):  # a commit's renames: after them
        signal.raise_signal(signal.SIGINT)
        done.append(True)
    assert done == [True] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job ignores Ctrl-C: still ignored
    try:
        with NotedSignals() as noted:
            signal.raise_signal(signal.SIGINT)
        assert not noted
    finally:
        signal.signal(signal.SIGINT, previous)


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
