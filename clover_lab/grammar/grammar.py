"""A grammar, compiled once per request and shared by its rows: from a JSON schema (strict: the
output is valid JSON that validates against it), from ``json_object`` (any JSON object), or from the
tool-call format for a request that must call a tool (``tool_choice`` required or a named
function). Each row follows it with its own :class:`~clover_lab.grammar.constraint.Constraint`
(:meth:`Grammar.matcher`).

A grammar the engine cannot compile is a :class:`GrammarError` naming what it was made from
(``what``: the server passes the request field, and answers 400; ``clover_lab.errors``).
"""
from __future__ import annotations

import json

import llguidance

from clover_lab.errors import GrammarError
from clover_lab.grammar import tool_calls
from clover_lab.grammar.constraint import Constraint
from clover_lab.grammar.vocabulary import Vocabulary


class Grammar:
    """A compiled grammar over a model's vocabulary; ``source``: llguidance's grammar text,
    ``what``: where it came from (named by errors)."""

    def __init__(self, source: str, vocabulary, what: str = "grammar"):
        self.vocabulary = Vocabulary.of(vocabulary)
        self.what = what
        error = llguidance.LLMatcher.validate_grammar(source, self.vocabulary.ll)
        if error:
            raise GrammarError(f"{what}: the grammar engine cannot compile it: {error}", what)
        # compiled once; each row's matcher is a copy (llguidance shares the compiled grammar)
        self._template = llguidance.LLMatcher(self.vocabulary.ll, source, log_level=0)
        if self._template.is_error():
            raise GrammarError(f"{what}: the grammar engine cannot compile it: {self._template.get_error()}", what)
        self.source = source

    @classmethod
    def json_schema(cls, schema, vocabulary, what: str = "schema") -> Grammar:
        """Valid JSON that validates against ``schema`` (a JSON schema, as a dict), written in
        json.dumps's style (``", "`` and ``": "``)."""
        if not isinstance(schema, dict):
            raise GrammarError(f"{what}: a JSON schema is a JSON object, got {type(schema).__name__} "
                               f"{json.dumps(schema)[:60] if _jsonable(schema) else repr(schema)[:60]}", what)
        try:
            source = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=tool_calls.JSON_STYLE)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{what}: the grammar engine cannot read it: {e}", what) from None
        return cls(source, vocabulary, what)

    @classmethod
    def json_object(cls, vocabulary, what: str = "json_object") -> Grammar:
        """Any JSON object."""
        return cls.json_schema({"type": "object"}, vocabulary, what)

    @classmethod
    def tool_calls(cls, functions: list[dict], vocabulary, parallel: bool = True,
                   what: str = "tools") -> Grammar:
        """One call (or, ``parallel``, one or more) of ``functions`` (OpenAI's function objects:
        ``name`` and ``parameters``) in the chat template's tool-call format (``tool_calls.py``)."""
        if not functions:
            raise GrammarError(f"{what}: a tool call needs at least one function to call", what)
        return cls(llguidance.LLMatcher.grammar_from_lark(tool_calls.calls_lark(functions, parallel)), vocabulary,
                   what)

    def matcher(self) -> Constraint:
        """A new row's :class:`~clover_lab.grammar.constraint.Constraint`, at the grammar's start."""
        return Constraint(self, self._template.deep_copy())

    def __repr__(self) -> str:
        return f"Grammar({self.what})"


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
