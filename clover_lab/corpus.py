"""A corpus argument, taken as what it says it is: a path that exists (``pathlib.Path``: a file,
or a folder read recursively), a list of paths (``Path``) and texts (``str``), or token ids (a
list of ints, lists of them, or an integer tensor). A string is never guessed to be a path or a
text: a bare string is refused (``Path(s)`` or ``[s]`` say which); a string in a list is a text,
and one that reads as a path (one word naming a file or folder, holding ``/`` or ending in a text
suffix) is refused as ambiguous.
Empty, unmatched, binary and unreadable corpora are :class:`CorpusError` naming them."""
from __future__ import annotations

import numbers
import warnings
from pathlib import Path

import torch

from clover_lab.errors import CorpusError, CorpusNotFoundError

TEXT_SUFFIXES = {".py", ".pyi", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".js", ".ts", ".json", ".jsonl",
                 ".html", ".css", ".yaml", ".yml", ".toml", ".sh", ".go", ".rs", ".java"}
WHAT = "expected a path (Path) that exists, a list of paths (Path) and texts (str), or token ids"


def folder_files(folder: Path, keep) -> list[Path]:
    """The files under ``folder`` that ``keep(path)`` accepts, sorted; hidden folders and
    ``__pycache__`` are skipped (a corpus folder's ``.git`` or ``.venv`` is not its text)."""
    return [f for f in sorted(folder.rglob("*")) if f.is_file() and keep(f)
            and not any(p.startswith(".") or p == "__pycache__" for p in f.relative_to(folder).parts[:-1])]


class Documents(list):
    """A corpus already read: its texts and token-id lists, taken as they are; ``sources``: the
    (name, path) pairs it was read from, inputs no output may overwrite."""

    sources: list = []


def corpus_documents(data, name: str = "data") -> Documents:
    """``data`` as documents (texts and token-id lists); see the module's docstring."""
    if isinstance(data, Documents):
        return data
    docs = Documents(_documents(data, name))
    docs.sources = corpus_inputs(data, name)
    return docs


def corpus_inputs(data, name: str = "data") -> list[tuple[str, Path]]:
    """The files and folders ``data`` reads, as (name, path) pairs (``writes.refuse_inputs``)."""
    if isinstance(data, Documents):
        return list(data.sources)
    if isinstance(data, Path):
        return [(name, data)]
    if isinstance(data, (list, tuple)):
        return [(name, item) for item in data if isinstance(item, Path)]
    return []


def _documents(data, name: str) -> list:
    if isinstance(data, Path):
        return read_path(data, name)
    if isinstance(data, str):
        raise CorpusError(f"{name}={data!r:.80} is a bare string, which could be a path or a text: pass "
                          f"Path(...) to read a file or folder, or a list [text, ...] of texts")
    if isinstance(data, torch.Tensor):
        if data.dim() == 2 and data.shape[0]:  # [documents, T]
            return [_tensor_ids(row, f"{name}[{i}]") for i, row in enumerate(data)]
        return [_tensor_ids(data, name)]
    if not isinstance(data, (list, tuple)):
        raise CorpusError(f"{name}: {WHAT}; got {type(data).__name__} {data!r:.80}")
    if not data:
        raise CorpusError(f"{name} is empty: give at least one path, text or token-id list")
    if all(_is_id(t) for t in data):
        return [[int(t) for t in data]]
    docs = []
    for i, item in enumerate(data):
        where = f"{name}[{i}]"
        if isinstance(item, Path):
            docs += read_path(item, where)
        elif isinstance(item, str):
            docs.append(_text(item, where))
        elif isinstance(item, torch.Tensor):
            docs.append(_tensor_ids(item, where))
        elif isinstance(item, (list, tuple)) and item and all(_is_id(t) for t in item):
            docs.append([int(t) for t in item])
        else:
            raise CorpusError(f"{where}: expected a path (Path), a text (str) or a non-empty list of token ids, "
                              f"got {type(item).__name__} {item!r:.80}")
    return docs


def _is_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _tensor_ids(t: torch.Tensor, name: str) -> list[int]:
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool or t.dim() > 1:
        raise CorpusError(f"{name}: a token-id tensor must hold integers, shape [T] or [documents, T]; got "
                          f"{t.dtype} {tuple(t.shape)}")
    if not t.numel():
        raise CorpusError(f"{name}: the token-id tensor is empty")
    return t.reshape(-1).tolist()


def _text(item: str, where: str) -> str:
    if not item.strip():
        raise CorpusError(f"{where} is an empty text")
    word = item.strip()
    if len(word.split()) == 1 and (Path(word).exists() or word.endswith(("/", "\\")) or "/" in word
                                   or Path(word).suffix in TEXT_SUFFIXES):
        raise CorpusError(f"{where} = {item!r} reads as a path, but a string in a list is a text; pass "
                          f"Path({word!r}) to read the file or folder, or the text itself")
    return item


def read_path(path: Path, name: str = "data") -> list[str]:
    """The texts of a file, or of a folder's files with a text suffix (``TEXT_SUFFIXES``). A file
    named directly must be UTF-8 text; a folder's undecodable files are skipped with a warning,
    and a folder with no text is an error naming it."""
    if not path.exists():
        raise CorpusNotFoundError(f"{name}: {str(path)!r} does not exist (no such file or folder); a text goes "
                                  f"in a list: [text]")
    if path.is_dir():
        if path.resolve() == Path(path.resolve().anchor):
            raise CorpusError(f"{name}: {str(path)!r} is the filesystem root; name the folder that holds the corpus")
        files = folder_files(path, lambda f: f.suffix in TEXT_SUFFIXES)
        if not files:
            raise CorpusError(f"{name}: the folder {str(path)!r} has no text files (suffixes "
                              f"{', '.join(sorted(TEXT_SUFFIXES))}; hidden folders are skipped)")
        texts, skipped = [], []
        for f in files:
            text = _read(f)
            (skipped.append(f) if text is None else texts.append(text))
        if not texts:
            raise CorpusError(f"{name}: no file in the folder {str(path)!r} is readable UTF-8 text "
                              f"({len(skipped)} binary or unreadable, e.g. {skipped[0]})")
        if skipped:
            warnings.warn(f"{name}: {len(skipped)} of {len(files)} files in {path} are binary or unreadable and "
                          f"were skipped, e.g. {skipped[0]}", stacklevel=3)
        return texts
    text = _read(path)
    if text is None:
        raise CorpusError(f"{name}: {str(path)!r} is not readable UTF-8 text (binary, or no permission)")
    return [text]


def _read(f: Path) -> str | None:
    try:
        text = f.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return None if "\x00" in text else text
