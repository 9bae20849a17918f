"""A grammar, compiled once per request and shared by its rows: from a JSON schema (strict: the
output is valid JSON that validates against it), from ``json_object`` (any JSON object), from the
tool-call format for a request that must call a tool (``tool_choice`` required or a named
function), from a regular expression, an EBNF (GBNF's ``root ::= ...``) or Lark grammar, or a
choice among strings.

A JSON schema's objects are closed where the schema is silent (:func:`close`): an object that
lists its ``properties`` and says nothing of ``additionalProperties`` takes no other key, as vLLM's
and SGLang's default backend (xgrammar, ``strict_mode``) reads it, and as the clients written against
them expect (a model left free to invent keys may never close the object). ``closed=False`` reads the
schema as JSON Schema does (open). Each row follows it with its own :class:`~clover_lab.grammar.constraint.Constraint`
(:meth:`Grammar.matcher`).

A grammar the engine cannot compile is a :class:`GrammarError` naming what it was made from
(``what``: the server passes the request field, and answers 400; ``clover_lab.errors``). So is
one that compiles but could not run: over :data:`MAX_SOURCE_CHARS` (its compile time grows
faster than its size: a 10,000-property schema took 20 s), past the grammar engine's run-time
limits in its first tokens (hundreds of optional properties, a tool whose parameters are only
``{"$ref": "#"}``: :meth:`Grammar._probe` walks them), or allowing only an empty response
(``{"$ref": "#"}`` alone).
"""
from __future__ import annotations

import json

import llguidance

from clover_lab.errors import GrammarError
from clover_lab.grammar import tool_calls
from clover_lab.grammar.constraint import Constraint
from clover_lab.grammar.vocabulary import Vocabulary

MAX_SOURCE_CHARS = 100_000  # a grammar's text (a JSON schema's, as the grammar engine reads it) at most
PROBE_DEPTH, PROBE_BRANCH = 3, 4  # the first tokens a new grammar is walked through, and tokens tried per position


class Grammar:
    """A compiled grammar over a model's vocabulary; ``source``: llguidance's grammar text,
    ``what``: where it came from (named by errors)."""

    def __init__(self, source: str, vocabulary, what: str = "grammar"):
        self.vocabulary = Vocabulary.of(vocabulary)
        self.what = what
        if len(source) > MAX_SOURCE_CHARS:
            raise GrammarError(f"{what}: the grammar is {len(source):,} characters, over the {MAX_SOURCE_CHARS:,} the "
                               f"engine compiles (its compile time grows faster than its size); make it smaller",
                               what)
        error = llguidance.LLMatcher.validate_grammar(source, self.vocabulary.ll)
        if error:
            raise GrammarError(f"{what}: the grammar engine cannot compile it: {error}", what)
        # compiled once; each row's matcher is a copy (llguidance shares the compiled grammar)
        self._template = llguidance.LLMatcher(self.vocabulary.ll, source, log_level=0)
        if self._template.is_error():
            raise GrammarError(f"{what}: the grammar engine cannot compile it: {self._template.get_error()}", what)
        self.source = source
        self._probe()

    def _probe(self) -> None:
        """Walk the grammar's first :data:`PROBE_DEPTH` tokens (a few of those allowed at each
        position): a grammar the engine compiles but cannot run, or that allows only an empty
        response, is refused now (a GrammarError naming ``what``), not at a request's first token."""
        c, eos, what = self.matcher(), self.vocabulary.eos, self.what
        start = c.masks([])[0]
        if not bool(start.any()):
            raise GrammarError(f"{what}: the grammar allows no token at all", what)
        if int(start.sum()) == 1 and bool(start[eos]):
            raise GrammarError(f"{what}: the grammar allows only an empty response (no value matches it: a schema "
                               f"that is only a reference to itself, {{\"$ref\": \"#\"}}, has no base case); give "
                               f"it a value a response can write", what)
        paths = [[]]
        try:
            for _ in range(PROBE_DEPTH):
                walked = []
                for path in paths:
                    allowed = [t for t in c.masks(path)[-1].nonzero().flatten().tolist() if t != eos]
                    picks = allowed[:PROBE_BRANCH // 2] + allowed[len(allowed) - PROBE_BRANCH // 2:]
                    walked += [path + [t] for t in dict.fromkeys(picks)]
                paths = walked
            for path in paths:
                c.masks(path)
        except GrammarError as e:
            raise GrammarError(f"{what}: the grammar compiles but passes the grammar engine's limits in its first "
                               f"tokens (too many alternatives at one point: hundreds of optional properties, or a "
                               f"schema that refers to itself without a base case); simplify it. The engine said: "
                               f"{str(e).split('(', 1)[-1][:300]}", what) from None

    @classmethod
    def json_schema(cls, schema, vocabulary, what: str = "schema", closed: bool = True) -> Grammar:
        """Valid JSON that validates against ``schema`` (a JSON schema, as a dict), written in
        json.dumps's style (``", "`` and ``": "``); ``closed``: its objects closed where it is silent
        (:func:`close`)."""
        if not isinstance(schema, dict):
            raise GrammarError(f"{what}: a JSON schema is a JSON object, got {type(schema).__name__} "
                               f"{json.dumps(schema)[:60] if _jsonable(schema) else repr(schema)[:60]}", what)
        try:
            source = llguidance.LLMatcher.grammar_from_json_schema(close(schema) if closed else schema,
                                                                   defaults=tool_calls.JSON_STYLE)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{what}: the grammar engine cannot read it: {e}", what) from None
        return cls(source, vocabulary, what)

    @classmethod
    def json_object(cls, vocabulary, what: str = "json_object") -> Grammar:
        """Any JSON object."""
        return cls.json_schema({"type": "object"}, vocabulary, what)

    @classmethod
    def tool_calls(cls, functions: list[dict], vocabulary, parallel: bool = True,
                   what: str = "tools", closed: bool = True) -> Grammar:
        """One call (or, ``parallel``, one or more) of ``functions`` (OpenAI's function objects:
        ``name`` and ``parameters``) in the chat template's tool-call format (``tool_calls.py``);
        ``closed``: their parameters' objects closed where they are silent (:func:`close`)."""
        if not functions:
            raise GrammarError(f"{what}: a tool call needs at least one function to call", what)
        if closed:
            functions = [dict(f, parameters=close(f["parameters"])) if f.get("parameters") else f for f in functions]
        return cls(llguidance.LLMatcher.grammar_from_lark(tool_calls.calls_lark(functions, parallel)), vocabulary,
                   what)

    @classmethod
    def regex(cls, pattern: str, vocabulary, what: str = "regex") -> Grammar:
        """Text the regular expression ``pattern`` matches whole (Rust's regex syntax, as vLLM's and
        SGLang's backends take it: no look-around, no back-references)."""
        if not isinstance(pattern, str):
            raise GrammarError(f"{what}: a regular expression is a string, got {type(pattern).__name__}", what)
        return cls(llguidance.LLMatcher.grammar_from_regex(pattern), vocabulary, what)

    @classmethod
    def ebnf(cls, text: str, vocabulary, what: str = "grammar") -> Grammar:
        """Text of a context-free grammar: EBNF as vLLM's and SGLang's backends take it (GBNF,
        ``root ::= ...``) or Lark (``start: ...``, llguidance's dialect)."""
        if not isinstance(text, str):
            raise GrammarError(f"{what}: a grammar is text, got {type(text).__name__}", what)
        try:
            source = llguidance.grammar_from("grammar", text)
        except ValueError as e:
            raise GrammarError(f"{what}: the grammar engine cannot read it: {e}", what) from None
        return cls(source, vocabulary, what)

    @classmethod
    def choice(cls, options: list[str], vocabulary, what: str = "choice") -> Grammar:
        """Exactly one of the strings ``options``."""
        if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError(f"{what}: expected a list of one or more non-empty strings, got "
                               f"{json.dumps(options)[:60] if _jsonable(options) else repr(options)[:60]}", what)
        return cls(llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, options))),
                   vocabulary, what)

    def matcher(self) -> Constraint:
        """A new row's :class:`~clover_lab.grammar.constraint.Constraint`, at the grammar's start."""
        return Constraint(self, self._template.deep_copy())

    def __repr__(self) -> str:
        return f"Grammar({self.what})"


# keywords whose value is a schema, or a list of schemas, or (the first set) a map of names to schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMAS = ("items", "additionalItems", "prefixItems", "anyOf", "oneOf", "not", "if", "then", "else", "contains",
            "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems")


def close(schema, _merged: bool = False):
    """``schema`` with every object that lists ``properties`` and says nothing of
    ``additionalProperties`` (nor ``unevaluatedProperties``) closed: ``"additionalProperties": false``
    (xgrammar's ``strict_mode``, vLLM's and SGLang's default). An object without ``properties``
    (``{"type": "object"}``: any object) stays open, and so do the parts of an ``allOf``, whose
    properties add up. The schema given is not changed."""
    if isinstance(schema, list):
        return [close(s, _merged) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: close(sub) for name, sub in value.items()}
        elif key in _SCHEMAS:
            out[key] = close(value)
        elif key == "allOf":
            out[key] = close(value, _merged=True)
        else:  # const, enum, default, examples, ...: values, not schemas
            out[key] = value
    if ("properties" in out and not _merged and "additionalProperties" not in out
            and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
