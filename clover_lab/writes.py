"""Writes that are whole or not at all: every file clover_lab puts in a user's directory.

    with atomic_path("runs/a/routes.npz") as tmp:     # one file: written to tmp, renamed when whole
        np.savez_compressed(tmp, ...)

    with FileSet("ckpt") as files:                      # files that belong together (a checkpoint)
        save_file(tensors, files.path(Path("ckpt/model.safetensors")))
        files.path(Path("ckpt/config.json")).write_text(text)
        files.remove(Path("ckpt/model-00001-of-00002.safetensors"))   # stale: removed once the new are in

A file is written to a hidden temporary name beside where it goes (same directory, so the rename
is atomic) and renamed onto it only once complete; on an error or an interrupt the temporary is
removed and what was there stays as it was. A set is renamed into place under a marker file that
loaders refuse (``refuse_unfinished``): a save stopped in the middle of its renames (a crash: the
renames themselves hold off Ctrl-C and SIGTERM) never loads as a mix of two saves. An error in the
middle of the renames (an I/O error) puts the previous files back (each kept aside, as a hard
link, until the set is in): the set is replaced in one step, or not at all.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from clover_lab.errors import CheckpointError, OutputError
from clover_lab.signals import NotedSignals

MARKER = ".clover-save-incomplete"
TMP_TAG = ".clover-tmp-"


def is_own_temp(path: Path) -> bool:
    """A temporary file or the marker of a write (by this module), not a user's file."""
    return path.name == MARKER or (path.name.startswith(".") and TMP_TAG in path.name)


def temp_beside(final: Path) -> Path:
    """A fresh hidden name in ``final``'s directory that keeps its suffix (numpy and matplotlib
    choose the format by it)."""
    return final.with_name(f".{final.stem}{TMP_TAG}{secrets.token_hex(4)}{final.suffix}")


def umask() -> int:
    """The process's umask, read without changing it (Linux: /proc/self/status), else by setting
    and restoring it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _as_created(path: Path) -> None:
    """A written temporary file given the mode a file created here gets (0666 less the umask):
    writers that go through temporary files of their own (safetensors' ``save_file``, tempfile)
    leave them 0600, so that a checkpoint's weights were unreadable to anyone else."""
    try:
        if path.is_file():
            os.chmod(path, 0o666 & ~umask())
    except OSError:  # a filesystem without modes: the file is as its writer left it
        pass


def _fsync(path: Path) -> None:
    """The file's (or directory's) data on disk before a rename makes it the real one."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot sync a directory
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(final):
    """A temporary path beside ``final`` to write; renamed onto ``final`` when the block ends
    without an error, removed otherwise (``final`` then stays as it was)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_beside(final)
    try:
        yield tmp
        _as_created(tmp)
        _fsync(tmp)
        with NotedSignals(redeliver=True):
            os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def naming(final):
    """A write's failure as an OSError that names ``final`` (the file the user asked for, not a
    temporary): a full disk's OSError comes without a file name, and safetensors reports one as
    its own SafetensorError ("Error while serializing: IoError ...") naming nothing."""
    from safetensors import SafetensorError

    try:
        yield
    except OSError as e:
        if e.filename is not None and str(final) in str(e.filename):
            raise
        raise OSError(e.errno, f"cannot write {final}: {e.strerror or e}", str(final)) from e
    except SafetensorError as e:
        raise OSError(errno.EIO, f"cannot write {final}: {e}", str(final)) from e


def write_text(final, text: str, encoding: str = "utf-8") -> Path:
    """``text`` in the file ``final``, whole or not at all."""
    with atomic_path(final) as tmp:
        tmp.write_text(text, encoding=encoding)
    return Path(final)


class FileSet:
    """Files that belong together (weights, config and index; a trace's two files), written under
    temporary names beside where they go and put in place together by ``commit`` (the end of a
    ``with`` block that raised nothing): renamed in the order given under the marker in
    ``directory``, then the stale files removed, then the marker. ``discard`` (an error, an
    interrupt) removes the temporaries and leaves every existing file as it was."""

    def __init__(self, directory):
        self.directory = Path(directory)
        self._started = time.time()
        self._temps: list[Path] = []
        self._moves: list[tuple[Path, Path]] = []
        self._stale: list[Path] = []

    def __enter__(self) -> "FileSet":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()

    def temp(self, hint: Path) -> Path:
        """A temporary file beside ``hint``, not yet bound to a final name (see ``put``)."""
        hint.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_beside(hint)
        self._temps.append(tmp)
        return tmp

    def put_written_by(self, write, directory: Path) -> None:
        """The files ``write(tmp_dir)`` puts in a directory (a tokenizer's ``save_pretrained``)
        as members of this set, bound for ``directory``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".files{TMP_TAG}", dir=self.directory))
        self._temps.append(tmp)
        write(tmp)
        for f in sorted(p for p in tmp.iterdir() if p.is_file()):
            self.put(f, Path(directory) / f.name)

    def put(self, written: Path, final: Path) -> None:
        """``written`` (a temporary of this set) becomes ``final`` at the commit."""
        self._moves.append((Path(written), Path(final)))

    def path(self, final: Path) -> Path:
        """A temporary path to write, renamed onto ``final`` at the commit."""
        tmp = self.temp(Path(final))
        self.put(tmp, final)
        return tmp

    def remove(self, stale: Path) -> None:
        """``stale`` is removed at the commit, after the new files are in (unless one of them)."""
        self._stale.append(Path(stale))

    def commit(self) -> None:
        finals = {final for _, final in self._moves}
        marker = self.directory / MARKER
        kept: list[tuple[Path, Path | None]] = []  # (final, its previous file kept aside; None: it had none)
        try:
            for written, _ in self._moves:
                _as_created(written)
                _fsync(written)
            with NotedSignals(redeliver=True):  # the renames are not cut in two by Ctrl-C or SIGTERM
                write_text(marker, json.dumps({"writing": [_rel(f, self.directory) for _, f in self._moves],
                                               "removing": [_rel(f, self.directory) for f in self._stale]}) + "\n")
                try:
                    for written, final in self._moves:
                        kept.append((final, _keep_aside(final)))
                        os.replace(written, final)
                except Exception:  # an I/O error (a crash, which cannot get here, leaves the marker)
                    _put_back(kept)  # the previous set whole again (or the marker stays: it is not)
                    marker.unlink()
                    _fsync(self.directory)
                    raise
                for stale in self._stale:
                    if stale not in finals:
                        stale.unlink(missing_ok=True)
                _fsync(self.directory)
                marker.unlink()  # a failure before this leaves the marker: the set is incomplete
                _fsync(self.directory)
        finally:
            if not marker.exists():  # in place, or put back: what was kept aside is no longer needed
                for _, aside in kept:
                    if aside is not None:
                        aside.unlink(missing_ok=True)
            self.discard()  # the temporaries not moved, temporary directories with the rest
        self._remove_killed_saves_temps()

    def _remove_killed_saves_temps(self) -> None:
        """Temporaries that a save killed before it could remove them left here (they can hold a
        whole checkpoint's size): those untouched since before this set began."""
        for p in self.directory.iterdir():
            if p.name != MARKER and is_own_temp(p) and p.stat().st_mtime < self._started:
                _remove(p)

    def discard(self) -> None:
        for tmp in self._temps:
            _remove(tmp)
        self._temps, self._moves, self._stale = [], [], []


def _keep_aside(final: Path) -> Path | None:
    """A second name (a hard link, no copy) for the file ``final`` before a set replaces it, so
    that a failed set can put it back; None when there is no file there. A file system without
    hard links raises: the set is then not replaced at all."""
    if not final.is_file():
        return None
    aside = temp_beside(final)
    os.link(final, aside)
    return aside


def _put_back(kept: list[tuple[Path, Path | None]]) -> None:
    """Undo a set's renames, last first: each final gets its previous file back (or none)."""
    for final, aside in reversed(kept):
        if aside is None:
            final.unlink(missing_ok=True)
        else:
            os.replace(aside, final)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _rel(path: Path, directory: Path) -> str:
    try:
        return str(path.relative_to(directory))
    except ValueError:
        return str(path)


def refuse_unfinished(directory, error=CheckpointError) -> None:
    """An ``error`` naming what an unfinished save (its marker still there) was writing."""
    marker = Path(directory) / MARKER
    if not marker.exists():
        return
    try:
        doc = json.loads(marker.read_text())
        files = ", ".join(doc["writing"]) or "nothing"
    except (OSError, ValueError, KeyError, TypeError):
        files = "its files"
    raise error(f"{directory}: an unfinished save: it stopped while putting {files} in place, so the "
                f"directory may mix two saves and is incomplete; save it again (or, to load it as it is, "
                f"delete {marker})")


def refuse_foreign(directory: Path, ours: set[str], what: str) -> None:
    """An OutputError when ``directory`` holds anything but the files named in ``ours`` (and this
    module's temporaries): writing there would replace or mix with files clover_lab did not write."""
    if not directory.exists():
        return
    if not directory.is_dir():
        raise OutputError(f"{directory} is a file; {what} is a directory: give a new or empty directory")
    foreign = sorted(p.name for p in directory.iterdir() if p.name not in ours and not is_own_temp(p))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise OutputError(f"{directory} holds files that are not {what}'s ({shown}); nothing was written: "
                          f"give a new or empty directory")


def refuse_same(out, source, what: str) -> None:
    """An OutputError when the output ``out`` is the input ``source`` (it would overwrite it)."""
    refuse_inputs(out, [("the input", source)], what, folder=True)


def _same(a: Path, b: Path) -> bool:
    """One file or folder under two names (symlinks and hard links included)."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _under(path: Path, folder: Path) -> bool:
    try:
        return path.resolve().is_relative_to(folder.resolve())
    except OSError:
        return False


def refuse_inputs(output, inputs, what: str, folder: bool = False) -> None:
    """The one rule every writer applies before it writes (or loads anything): an OutputError when
    writing ``output`` would overwrite what the work reads. ``inputs``: (label, path) pairs, each
    a file read or a folder read (a model directory, a corpus folder: every file in it is an
    input). A file output is refused when it is an input file or folder, or an existing file in
    an input folder (``check --json M/config.json`` would replace the checkpoint's config); a
    folder output (``folder``: a checkpoint, a run) when it is an input file or folder. Writing a
    new file into an input folder (a report beside the model) is not refused."""
    out = Path(output)
    for label, source in inputs:
        if source is None:
            continue
        source = Path(source)
        clash = _same(out, source) or (not folder and source.is_dir() and out.is_file() and _under(out, source))
        if clash:
            where = "is" if _same(out, source) else "is a file in"
            raise OutputError(f"{what}: the output {out} {where} {label} {source}, which is read: writing it would "
                              f"overwrite the input; nothing was written: give another "
                              f"{'directory' if folder else 'file'}")


def model_inputs(model) -> list[tuple[str, Path]]:
    """The checkpoint directory ``model`` was loaded from (``CloverModel.checkpoint_dir``), as the
    input of whatever is computed with it."""
    source = getattr(model, "checkpoint_dir", None)
    return [] if source is None else [("the model directory", Path(source))]


def check_writable(*directories, what: str = "output") -> None:
    """An OutputError now, before any work, when a file cannot be created in each of
    ``directories`` (or, for one that does not exist yet, in the directory that would hold it)."""
    for directory in map(Path, directories):
        probe_in = directory
        while not probe_in.exists() and probe_in != probe_in.parent:
            probe_in = probe_in.parent
        if not probe_in.is_dir():
            raise OutputError(f"{what} {directory}: {probe_in} is a file, not a directory")
        try:
            fd, name = tempfile.mkstemp(prefix=f".probe{TMP_TAG}", dir=probe_in)
            os.close(fd)
            os.unlink(name)
        except OSError as e:
            raise OutputError(f"{what} {directory}: cannot write in {probe_in} ({e.strerror or e})") from None
