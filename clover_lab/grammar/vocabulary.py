"""The model's vocabulary as the grammar engine reads it: the tokenizer's token bytes, the
model's vocabulary size (which may exceed the tokenizer's: the extra ids are never allowed) and
the EOS token a complete grammar allows.

The grammar engine is llguidance (Microsoft's, behind vLLM's ``guidance`` backend and llama.cpp's
grammars), not xgrammar. Both install and run on a CPU here with torch 2.13 and Python 3.11, and
both read our tokenizer; llguidance was chosen because:

- it is one dependency-free wheel for every Python from 3.10 (abi3): xgrammar requires torch,
  transformers, triton and apache-tvm-ffi, is built per Python version, and would tie the
  project's torch to its own; the GPU machine is offline with torch, triton and transformers
  preinstalled, and a single wheel is what can be carried there;
- its matcher checks a drafted path without consuming it (``validate_tokens``) and rolls back
  (``rollback``): the two things block diffusion and speculative verification need (a step
  proposes many positions at once, and the grammar accepts the longest prefix of them);
- one Lark grammar embeds JSON schemas (``%json``), so the tool-call format (text around a
  JSON object) is a grammar of three lines, not a structural tag;
- schema errors come back as messages (``validate_grammar``), which the server names in a 400.

Its masks cost about 40 microseconds per position on the embedded model's 4,096 tokens (a forward
costs milliseconds), measured with bench/bench_grammar.py.
"""
from __future__ import annotations

import weakref

import llguidance
import llguidance.hf


class Vocabulary:
    """``tokenizer`` (a Hugging Face fast tokenizer) over ``size`` token ids (the model's
    vocabulary), with ``eos`` the token that ends a complete grammar."""

    def __init__(self, tokenizer, size: int, eos: int):
        if tokenizer is None:
            raise ValueError("a grammar needs the model's tokenizer (it reads each token's bytes); this engine "
                             "has none")
        if not isinstance(eos, int) or not 0 <= eos < size:
            raise ValueError(f"eos={eos!r}: expected a token id in [0, {size})")
        self.size, self.eos = int(size), int(eos)
        self.tokenizer = tokenizer
        self.ll = _ll_tokenizer(tokenizer, self.size, self.eos)

    @classmethod
    def of(cls, source) -> Vocabulary:
        """A Vocabulary itself, or an engine's (its tokenizer, the model's vocabulary size, its first EOS)."""
        if isinstance(source, Vocabulary):
            return source
        engine = source
        if not getattr(engine, "eos_token_ids", None):
            raise ValueError("a grammar needs an EOS token (what a complete grammar allows next); the engine has "
                             "none: set engine.eos_token_ids")
        return cls(engine.tokenizer, engine.model.config.vocab_size, engine.eos_token_ids[0])


# an llguidance tokenizer reads every token of the vocabulary once (tens of milliseconds for Qwen's
# 150k): made once per tokenizer, size and EOS, and kept as long as the tokenizer lives
_made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _ll_tokenizer(tokenizer, size: int, eos: int):
    per = _made.setdefault(tokenizer, {})
    if (size, eos) not in per:
        per[(size, eos)] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=size, eos_token=eos)
    return per[(size, eos)]
