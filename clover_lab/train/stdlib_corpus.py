"""The training corpus of the embedded default model: the Python standard library's modules,
split into training and held-out files by a hash of their path, and its byte-level BPE tokenizer."""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch

from clover_lab.corpus import folder_files
from clover_lab.writes import FileSet

SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo"}


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The running interpreter's standard-library .py files, without test suites or site-packages."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS & set(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        files.append(path)
    return files


def is_heldout(path: Path, root: Path, fraction: int = 20) -> bool:
    """Deterministic split by module: one module in ``fraction`` is held out."""
    digest = hashlib.sha1(str(path.relative_to(root)).encode()).digest()
    return digest[0] % fraction == 0


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def split_corpus(root: str | Path | None = None) -> tuple[list[Path], list[Path]]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    held = [f for f in files if is_heldout(f, root)]
    train = [f for f in files if not is_heldout(f, root)]
    return train, held


def train_tokenizer(files: list[Path], vocab_size: int, out_dir: Path):
    """Byte-level BPE on the training split, saved so that transformers' AutoTokenizer loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = (t for f in files if (t := read_text(f)) is not None)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                   mask_token="<|mask|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 8192
    with FileSet(out_dir) as files:
        files.put_written_by(lambda tmp: fast.save_pretrained(str(tmp)), out_dir)
    return fast


def encode_files(tokenizer, files: list[Path]) -> torch.Tensor:
    """All files as one stream of token ids, each file followed by EOS."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for f in files:
        text = read_text(f)
        if text:
            # a module encoded whole is longer than the model's context on purpose: no warning about model inputs
            ids.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def text_files(paths, pattern: str = "*.py") -> list[tuple[Path, Path]]:
    """(file, the root its held-out hash is taken against) for every file named in ``paths``:
    a file as it is, a directory as its files matching ``pattern`` (hidden folders and
    ``__pycache__`` skipped). The word ``stdlib`` stands for the embedded model's corpus
    (``stdlib_files``), hashed against the stdlib root so that the split is the same as its."""
    out = []
    for given in paths:
        if str(given) == "stdlib":
            root = Path(sysconfig.get_paths()["stdlib"])
            out += [(f, root) for f in stdlib_files(root)]
            continue
        path = Path(given)
        if path.is_file():
            out.append((path, path.parent))
        elif path.is_dir():
            found = folder_files(path, lambda f: f.match(pattern))
            if not found:
                raise ValueError(f"--data: the directory {path} has no files matching {pattern!r}")
            out += [(f, path) for f in found]
        else:
            raise ValueError(f"--data: {path} is neither a file nor a directory")
    return out


def split_files(files: list[tuple[Path, Path]]) -> tuple[list[Path], list[Path]]:
    """(training, held-out) files: one module in 20 held out by a hash of its path (``is_heldout``)."""
    held = [f for f, root in files if is_heldout(f, root)]
    train = [f for f, root in files if not is_heldout(f, root)]
    return train, held
