"""Tools and structured output on the chat endpoint: what a request's ``tools``, ``tool_choice``,
``parallel_tool_calls`` and ``response_format`` ask of a generation (:func:`plan`), the prompt with
its tools (:func:`chat_ids`), and the response's tool calls in OpenAI's shape (:func:`openai_calls`).

The tools reach the model through its chat template (``apply_chat_template(..., tools=...)``). A
template that does not read ``tools`` (the embedded model's) gets them as Qwen3.5/3.6's template
writes them: a ``# Tools`` section in the system message, each result of a call as a user turn in
``<tool_response>`` tags, an assistant's calls after its text in ``<tool_call>`` tags
(``clover_lab/grammar/tool_calls.py``: the format, written and read).

``tool_choice`` ``auto`` (the default with tools) lets the model write calls or text; ``none`` leaves
the tools out of the prompt; ``required`` and a named function, like ``response_format``
``json_object`` and ``json_schema``, constrain the response with a grammar
(``clover_lab.grammar.GrammarPolicy``), so its calls parse and their arguments validate.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import secrets
from dataclasses import dataclass, field

from clover_lab.engine.requests import GenerationError, check_text
from clover_lab.errors import GrammarError
from clover_lab.grammar import Grammar, tool_calls
from clover_lab.serve import schemas
from clover_lab.serve.jobs import RequestError


@dataclass
class Plan:
    grammar: Grammar | None = None
    grammar_param: str | None = None  # the field that asked for it
    functions: list[dict] = field(default_factory=list)  # the tools the prompt shows (OpenAI's function objects)
    parse_calls: bool = False  # read tool calls out of the response


def plan(engine, body: schemas.ChatRequest, open_schemas: bool = False) -> Plan:
    """What the request's tools and response format ask; a bad one is a RequestError naming its field.
    ``open_schemas``: the server reads schemas as written (open where silent) unless the request says
    otherwise (:func:`closes`)."""
    closed = closes(body, open_schemas)
    functions = [t.function.model_dump(exclude_none=True) for t in body.tools or []]
    names = [f["name"] for f in functions]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise RequestError(f"tools: function {dup[0]!r} is given more than once; names must be unique", "tools")
    if body.tools is not None and not functions:
        raise RequestError("tools: give at least one tool, or leave tools out", "tools")
    for i, f in enumerate(functions):  # a schema that cannot compile is the request's fault, whatever the choice
        if "parameters" in f:
            _grammar(lambda f=f, i=i: Grammar.json_schema(f["parameters"], engine, closed=closed,
                                                          what=f"tools.{i}.function.parameters"))
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if functions else "none")
    if choice != "none" and not functions:
        raise RequestError(f"tool_choice: {_choice_name(choice)} needs tools; give tools or leave tool_choice out",
                           "tool_choice")
    out = Plan(functions=[] if choice == "none" else functions, parse_calls=choice != "none")
    grammar, param = constraint(engine, body, closed)
    if grammar is not None:
        if choice == "required" or isinstance(choice, schemas.NamedToolChoice):
            raise RequestError(f"{param} and tool_choice {_choice_name(choice)} both constrain the response; ask "
                               f"for one", param)
        out.grammar, out.grammar_param = grammar, param
    elif choice == "required":
        out.grammar = _grammar(lambda: Grammar.tool_calls(functions, engine, parallel=body.parallel_tool_calls
                                                          is not False, what="tools", closed=closed))
        out.grammar_param = "tool_choice"
    elif isinstance(choice, schemas.NamedToolChoice):
        named = [f for f in functions if f["name"] == choice.function.name]
        if not named:
            raise RequestError(f"tool_choice.function.name: {choice.function.name!r} is not among the tools "
                               f"({', '.join(names)})", "tool_choice.function.name")
        out.grammar = _grammar(lambda: Grammar.tool_calls(named, engine, parallel=False, what="tools", closed=closed))
        out.grammar_param = "tool_choice"
    return out


def closes(body, open_schemas: bool = False) -> bool:
    """Whether the request's JSON schemas are closed where they are silent (``grammar.close``): yes
    unless the server reads them open (``--open-schemas``) or the request asks for open ones
    (``clover.open_schemas: true``); ``clover.open_schemas: false`` or vLLM's
    ``structured_outputs.disable_additional_properties: true`` close them on an open server."""
    so = getattr(body, "structured_outputs", None)
    if so is not None and so.disable_additional_properties:
        return True
    asked = body.clover.open_schemas
    return not (open_schemas if asked is None else asked)


STRUCTURED = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's structured_outputs, one of
# the fields that constrain a whole response: OpenAI's, vLLM's, SGLang's two; a request sets one at most
CONSTRAINING = ("response_format", "structured_outputs", "regex", "ebnf")


def constraining(body) -> list[str]:
    """The fields of :data:`CONSTRAINING` the request sets (a ``response_format`` of type text sets none)."""
    return [name for name in CONSTRAINING if getattr(body, name, None) is not None
            and not (name == "response_format" and body.response_format.type == "text")]


def constraint_field(body) -> str:
    """The field a request constrains its response with (what a compile that takes too long is named
    by): the first it sets (:func:`constraining`), else ``response_format``."""
    return next(iter(constraining(body)), "response_format")


def constraint(engine, body, closed: bool = True) -> tuple[Grammar | None, str | None]:
    """The grammar the request's structured-output field asks for, and that field: OpenAI's
    ``response_format``, vLLM's ``structured_outputs`` (json, regex, choice, grammar, json_object) or
    SGLang's ``regex`` and ``ebnf``; (None, None) where none does. Two at once are a 400: each
    constrains the whole response."""
    asks = constraining(body)
    if len(asks) > 1:
        raise RequestError(f"{asks[0]} and {asks[1]} both constrain the response; ask for one", asks[1])
    if not asks:
        return None, None
    param = asks[0]
    if param == "response_format":
        return format_grammar(engine, body.response_format, closed), param
    if param == "regex":
        return _grammar(lambda: Grammar.regex(body.regex, engine, what="regex")), param
    if param == "ebnf":
        return _grammar(lambda: Grammar.ebnf(body.ebnf, engine, what="ebnf")), param
    so = body.structured_outputs
    given = [k for k in STRUCTURED if getattr(so, "json_" if k == "json" else k) not in (None, False)]
    if len(given) != 1:
        raise RequestError(f"structured_outputs: give exactly one of {', '.join(STRUCTURED)}; got "
                           f"{', '.join(given) or 'none'}", "structured_outputs")
    kind, where = given[0], f"structured_outputs.{given[0]}"
    return _grammar({
        "json": lambda: Grammar.json_schema(_schema(so.json_, where), engine, what=where, closed=closed),
        "regex": lambda: Grammar.regex(so.regex, engine, what=where),
        "choice": lambda: Grammar.choice(so.choice, engine, what=where),
        "grammar": lambda: Grammar.ebnf(so.grammar, engine, what=where),
        "json_object": lambda: Grammar.json_object(engine, what=where)}[kind]), where


def _schema(value, where: str) -> dict:
    """A JSON schema given as an object or as its JSON text (vLLM takes both)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            raise RequestError(f"{where}: a JSON schema's text must be JSON: {e}", where,
                               code="invalid_schema") from None
    return value


def format_grammar(engine, fmt, closed: bool = True) -> Grammar | None:
    """The grammar of a ``response_format`` (None for text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _grammar(lambda: Grammar.json_object(engine, what="response_format"))
    schema = fmt.json_schema.schema_
    if schema is None:
        raise RequestError("response_format.json_schema.schema: a JSON schema is required",
                           "response_format.json_schema.schema")
    return _grammar(lambda: Grammar.json_schema(schema, engine, what="response_format.json_schema.schema",
                                                closed=closed))


GRAMMAR_SECONDS = 10.0  # the most a request's grammars may take to compile before it is refused
_compiling = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="clover-serve-grammar")


async def off_loop(make, what: str):
    """``make()`` (a request's grammar compiles: ``plan``, ``format_grammar``) in a thread of its
    own, never on the event loop: a large schema froze ``/health`` and every stream while it
    compiled. Over :data:`GRAMMAR_SECONDS` the request is refused (400 naming ``what``)."""
    future = asyncio.get_running_loop().run_in_executor(_compiling, make)
    try:
        return await asyncio.wait_for(future, GRAMMAR_SECONDS)
    except asyncio.TimeoutError:
        raise RequestError(f"{what}: its grammar took over {GRAMMAR_SECONDS:g} s to compile; simplify the schema "
                           f"(fewer properties, alternatives or nesting)", what, code="invalid_schema") from None


def _choice_name(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def _grammar(make) -> Grammar:
    try:
        return make()
    except GrammarError as e:
        raise RequestError(str(e), e.what, code="invalid_schema") from None


# --------------------------------------------------------------------------- the prompt
def reads_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` itself."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def chat_ids(engine, messages: list[dict], functions: list[dict], thinking: bool | None,
             rendering: tuple[bool, bool, bool] = (True, False, False)) -> list[int]:
    """The chat template over ``messages`` with the tools ``functions`` (none: as without tools).
    ``rendering``: vLLM's ``/tokenize`` switches (add_generation_prompt, continue_final_message,
    add_special_tokens); a chat completion's prompt is the default."""
    tokenizer = engine.tokenizer
    if not reads_tools(tokenizer):
        messages, functions = written_out(messages, functions), []
        if rendering == (True, False, False):
            return engine.encode(messages, thinking)
    tools = [{"type": "function", "function": f} for f in functions] or None
    for i, m in enumerate(messages):
        check_text(m["content"], f"chat message {i}'s content")
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    history = [dict(m, tool_calls=[dict(c, function=dict(c["function"], arguments=_arguments(c)))
                                   for c in m["tool_calls"]]) if m.get("tool_calls") else m for m in messages]
    generation_prompt, continue_final, special_tokens = rendering
    try:
        text = tokenizer.apply_chat_template(history, tools=tools, add_generation_prompt=generation_prompt,
                                             continue_final_message=continue_final, tokenize=False, **kwargs)
    except Exception as e:
        raise GenerationError(f"the tokenizer cannot apply its chat template to these messages and tools ({e})") from e
    return engine.encode(list(tokenizer(text, add_special_tokens=special_tokens)["input_ids"]))


def _arguments(call: dict):
    """A history call's arguments as the template takes them: an object (OpenAI sends JSON text)."""
    try:
        return json.loads(call["function"]["arguments"])
    except ValueError:
        return call["function"]["arguments"]


TOOLS_SECTION = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                 "with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor "
                 "each function call, return a json object with function name and arguments within "
                 "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}}\n</tool_call>")


def written_out(messages: list[dict], functions: list[dict]) -> list[dict]:
    """The messages as Qwen3.5/3.6's template writes tools, for a template that does not read them:
    plain system / user / assistant turns."""
    out = []
    if functions:
        section = TOOLS_SECTION.format(tools="\n".join(json.dumps({"type": "function", "function": f})
                                                       for f in functions))
        if messages[0]["role"] == "system":
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + section})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": section})
    for m in messages:
        if m["role"] == "tool":
            piece = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_responses"):  # a run of results is one user turn
                out[-1]["content"] += "\n" + piece
            else:
                out.append({"role": "user", "content": piece, "tool_responses": True})
        elif m.get("tool_calls"):
            calls = [f"{tool_calls.OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': _arguments(c)})}"
                     f"\n{tool_calls.CLOSE}" for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([m["content"]] if m["content"] else []) + calls)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return [{"role": m["role"], "content": m["content"]} for m in out]


# --------------------------------------------------------------------------- the response
def openai_calls(calls: list[tool_calls.ToolCall]) -> list[dict]:
    """The calls as OpenAI's ``message.tool_calls`` (arguments as JSON text, ids ``call_...``)."""
    return [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]
