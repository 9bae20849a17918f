"""Functions as (head, body) pairs: the corpus that teaches the specimen to follow its prompt.

A window of a module puts a function's definition after hundreds of tokens of its module; a
newcomer types ``def is_prime(n):`` and nothing before it. Trained on windows alone, the specimen
continued every such prompt the same way (``def _get_from_name(cls, *args)``). Here every
function of the corpus is cut out with ``ast``, dedented to column 0 and split into its *head*
(the ``def`` line or lines and the docstring, if any) and its *body*; training rows start at a
head (``function_rows``), and ``prompt_gain`` measures how much a head tells the model about its
body: the body's next-token loss after a wrong head minus after its own.
"""
from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from clover_lab.train.stdlib_corpus import read_text

MIN_BODY_LINES = 2
MAX_LINES = 60


@dataclass(frozen=True)
class Function:
    head: str  # the signature and the docstring, dedented, without the newline that ends them
    body: str  # from that newline on (its first token carries the body's indent)


def functions_of(source: str) -> list[Function]:
    """Every function and method in ``source`` (decorators left out) whose body has at least
    ``MIN_BODY_LINES`` lines after its docstring and that is at most ``MAX_LINES`` long in all."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
            continue
        start, end = node.lineno - 1, node.end_lineno  # 0-based start, exclusive end
        stmts = node.body
        has_doc = (isinstance(stmts[0], ast.Expr) and isinstance(stmts[0].value, ast.Constant)
                   and isinstance(stmts[0].value.value, str))
        first_body = stmts[1] if has_doc and len(stmts) > 1 else (None if has_doc else stmts[0])
        if first_body is None or first_body.lineno - 1 <= start:  # a docstring only, or a one-line def
            continue
        head_end = stmts[0].end_lineno if has_doc else first_body.lineno - 1
        if end - head_end < MIN_BODY_LINES or end - start > MAX_LINES:
            continue
        indent = node.col_offset
        text = [line[indent:] if line[:indent].strip() == "" else line.lstrip() for line in lines[start:end]]
        split = head_end - start
        out.append(Function("\n".join(text[:split]), "\n" + "\n".join(text[split:]) + "\n"))
    return out


def arguments(prompt: str) -> list[str]:
    """The argument names (``self`` and ``cls`` aside) of the last function ``prompt`` begins (a
    head, or a prompt that ends with one)."""
    try:
        tree = ast.parse(prompt + "\n" + " " * 8 + "pass")
    except SyntaxError:
        try:
            tree = ast.parse(prompt + "\n" + " " * 4 + "pass")
        except SyntaxError:
            return []
    defs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not defs:
        return []
    a = defs[-1].args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs] + [x.arg for x in (a.vararg, a.kwarg) if x]
    return [n for n in names if n not in ("self", "cls")]


def uses_arguments(prompt: str, completion: str) -> bool | None:
    """Whether ``completion`` names one of the prompt's arguments (None: the prompt gives none)."""
    names = arguments(prompt)
    if not names:
        return None
    return any(re.search(rf"\b{re.escape(n)}\b", completion) for n in names)


def read_functions(files: list[Path]) -> list[Function]:
    """The functions of every readable file, in file order."""
    return [f for path in files if (text := read_text(path)) is not None for f in functions_of(text)]


def encode_functions(tokenizer, functions: list[Function]) -> list[tuple[torch.Tensor, int]]:
    """Each function as (its tokens, how many of them are the head). The whole text is encoded at
    once and the head's length is that of the head encoded alone (what a prompt of it gives): a
    function whose head does not tokenize as a prefix of the whole (a merge across the cut) is
    left out."""
    out = []
    for f in functions:
        head = tokenizer(f.head, add_special_tokens=False, verbose=False)["input_ids"]
        ids = tokenizer(f.head + f.body, add_special_tokens=False, verbose=False)["input_ids"]
        if ids[:len(head)] == head and len(ids) > len(head):
            out.append((torch.tensor(ids, dtype=torch.int32), len(head)))
    return out


def function_corpus(run: Path, tokenizer) -> dict:
    """The run's functions, training and held-out split as its modules are (``split_corpus``),
    encoded with its tokenizer: made once into ``run/functions.pt``, then read from it."""
    from clover_lab.train.stdlib_corpus import split_corpus
    from clover_lab.writes import atomic_path

    path = Path(run) / "functions.pt"
    if not path.is_file():
        train, held = split_corpus()
        with atomic_path(path) as tmp:
            torch.save({"train": encode_functions(tokenizer, read_functions(train)),
                        "heldout": encode_functions(tokenizer, read_functions(held))}, tmp)
    return torch.load(path)


def function_rows(functions: list[tuple[torch.Tensor, int]], count: int, seq_len: int, eos: int,
                  gen: torch.Generator) -> torch.Tensor:
    """[count, seq_len] training rows, each starting at a function's head as a prompt does and
    filled with further random functions, each followed by EOS (as the corpus ends each file)."""
    if not functions:
        raise ValueError("no functions to draw training rows from")
    rows = []
    for _ in range(count):
        row: list[torch.Tensor] = []
        size = 0
        while size < seq_len:
            ids = functions[int(torch.randint(len(functions), (1,), generator=gen))][0]
            row += [ids, torch.tensor([eos], dtype=ids.dtype)]
            size += len(ids) + 1
        rows.append(torch.cat(row)[:seq_len])
    return torch.stack(rows).long()


def head_prompts(functions: list[tuple[torch.Tensor, int]], count: int, length: int, eos: int,
                 gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """[count, length] prompts that end where a function's head ends, as a typed prompt does, so
    that what the model writes next is that function's body (``distill --functions``), and each
    head's length. Before the head, an EOS and the ends of other functions, as in
    ``function_rows``. Heads of ``length`` or more tokens are not drawn."""
    fitting = [(ids, h) for ids, h in functions if h < length]
    if not fitting:
        raise ValueError(f"no function has a head shorter than {length} tokens")
    end = torch.tensor([eos], dtype=fitting[0][0].dtype)

    def pick() -> tuple[torch.Tensor, int]:
        return fitting[int(torch.randint(len(fitting), (1,), generator=gen))]

    rows, heads = [], []
    for _ in range(count):
        ids, h = pick()
        heads.append(h)
        parts, size = [ids[:h]], h
        while size < length:
            before = pick()[0]
            parts.insert(0, torch.cat([before, end]))
            size += len(before) + 1
        rows.append(torch.cat(parts)[-length:])
    return torch.stack(rows).long(), heads


@torch.no_grad()
def prompt_gain(model, functions: list[tuple[torch.Tensor, int]], count: int = 128, body_tokens: int = 48,
                batch: int = 16) -> dict:
    """How much the head tells the model about the body, on ``count`` functions (the first ones
    with at least 8 body tokens): the mean next-token loss (nats) of each body's first
    ``body_tokens`` tokens after its own head (``own``) and after the head of the next function in
    the list (``other``), and ``gain`` = other - own (0: the head is ignored)."""
    picked = [(ids, h) for ids, h in functions if len(ids) - h >= 8][:count]
    if len(picked) < 2:
        raise ValueError(f"prompt_gain needs at least 2 functions with 8 body tokens, got {len(picked)}")
    heads = [ids[:h] for ids, h in picked]
    bodies = [ids[h:h + body_tokens] for ids, h in picked]
    own = _body_loss(model, heads, bodies, batch)
    other = _body_loss(model, heads[1:] + heads[:1], bodies, batch)
    return {"own": own, "other": other, "gain": other - own, "functions": len(picked)}


def _body_loss(model, heads: list[torch.Tensor], bodies: list[torch.Tensor], batch: int) -> float:
    """The mean next-token loss of the ``bodies``' tokens, each after its head (rows right-padded)."""
    nll, count = 0.0, 0
    pad = model.config.pad_token_id or 0
    for i in range(0, len(heads), batch):
        rows = [torch.cat([h, b]).long() for h, b in zip(heads[i:i + batch], bodies[i:i + batch])]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, :len(r)] = r
        logits = model.logits(ids.to(model.device)).float().cpu()
        for j, (h, b) in enumerate(zip(heads[i:i + batch], bodies[i:i + batch])):
            start = len(h) - 1  # the logits at the head's last token predict the body's first
            nll += float(F.cross_entropy(logits[j, start:start + len(b)], b.long(), reduction="sum"))
            count += len(b)
    return nll / max(1, count) if count else math.nan
