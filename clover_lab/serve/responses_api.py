"""OpenAI's Responses API (``POST /v1/responses``), as a chat completion underneath: the request's
``instructions`` and ``input`` items (messages, the model's earlier function calls and their
outputs) become chat messages, its function tools, ``tool_choice``, ``text.format`` and
``max_output_tokens`` the chat request's fields (:func:`chat_request`); the chat answer becomes a
response object (:func:`response`) and its stream the Responses API's events (:func:`events`).

Nothing is stored: ``store`` is accepted and answered false, and a ``previous_response_id`` (a
stored response to continue) is refused by name; a client sends the whole conversation as ``input``
(the Agents SDK does). The fields that change nothing here (``include``, ``reasoning``,
``truncation``, ``metadata``, ...) are listed in docs/serving-agents.md.
"""
from __future__ import annotations

import json
import secrets
import time
from typing import Any, Literal, Union

from pydantic import ConfigDict, Field, ValidationError

from clover_lab.serve import schemas
from clover_lab.serve.jobs import RequestError
from clover_lab.serve.schemas import Strict


# --------------------------------------------------------------------------- the request
class Item(Strict):
    """An input item. Unlike the rest of a request it ignores fields it does not know: clients send
    their earlier output items back as their version of OpenAI's types dumps them (``caller``,
    ``namespace``, ``async_``: null), and what an item means here is in the fields below."""

    model_config = ConfigDict(strict=True, extra="ignore")


class InputText(Item):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list | None = None  # an output_text sent back
    logprobs: list | None = None


class InputMessage(Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None  # an output message sent back
    status: str | None = None


class FunctionCallItem(Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


class ReasoningItem(Item):
    """A reasoning item sent back: accepted, and left out of the prompt (as the chat template drops
    an earlier turn's reasoning)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list = Field(default_factory=list)
    content: list | None = None
    encrypted_content: str | None = None
    status: str | None = None


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema's
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # no-op


class Reasoning(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # no-op
    summary: Literal["auto", "concise", "detailed"] | None = None  # no-op
    generate_summary: str | None = None


class ResponsesRequest(Strict):
    model: str | None = None  # none: the served model (as vLLM takes it; its own tests send none)
    input: str | list[Union[InputMessage, FunctionCallItem, FunctionCallOutput, ReasoningItem]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextOptions | None = None
    seed: int | None = Field(default=None, ge=0)  # as chat's (vLLM's responses take it too)
    chat_template_kwargs: schemas.ChatTemplateKwargs | None = None  # the thinking switch, as chat's
    # accepted, changing nothing here (docs/serving-agents.md)
    store: bool | None = None  # nothing is stored: answered false
    previous_response_id: str | None = None  # refused: nothing is stored to continue
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["disabled", "auto"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    background: Literal[False] | None = None
    stream_options: dict[str, bool] | None = None  # include_obfuscation: there is none
    top_logprobs: int | None = Field(default=None, ge=0)  # alternatives per token, as chat's (checked there)
    clover: schemas.CloverOptions = Field(default_factory=schemas.CloverOptions)


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


LOGPROBS = "message.output_text.logprobs"  # what ``include`` names to have the text's log-probabilities


def chat_request(body: ResponsesRequest) -> schemas.ChatRequest:
    """The chat completion that answers ``body``: its instructions a system message first, its input
    items as turns (an assistant's function calls with the message before them, each output a tool
    message), its tools, tool choice, text format and length as the chat request's."""
    if body.previous_response_id is not None:
        raise RequestError(f"previous_response_id {body.previous_response_id!r}: this server stores no response "
                           f"(store is answered false); send the whole conversation as input",
                           "previous_response_id", code="not_stored")
    messages: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                          "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    if not messages:
        raise RequestError("input: give at least one message", "input")
    chat = {"model": body.model, "messages": messages, "stream": body.stream, "clover": body.clover}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    for name in ("temperature", "top_p", "parallel_tool_calls", "seed", "chat_template_kwargs"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.top_logprobs or LOGPROBS in (body.include or []):  # the text's log-probabilities, as chat's
        chat["logprobs"], chat["top_logprobs"] = True, body.top_logprobs or 0
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in body.tools]
    if body.tool_choice is not None:
        choice = body.tool_choice
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                       "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None:
        if fmt.type == "json_schema":
            if fmt.name is None or fmt.schema_ is None:
                raise RequestError("text.format: json_schema needs a name and a schema", "text.format")
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_, **({"strict": fmt.strict} if fmt.strict is not None else {}),
                **({"description": fmt.description} if fmt.description is not None else {})}}
        else:
            chat["response_format"] = {"type": fmt.type}
    try:
        return schemas.ChatRequest.model_validate(chat, strict=False)
    except ValidationError as e:  # an input item that is no chat turn (a function call's id, say)
        err = e.errors()[0]
        raise RequestError(f"input: {err['msg']} (as a chat message: {'.'.join(map(str, err['loc']))})",
                           "input") from None


# --------------------------------------------------------------------------- the answer
def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def message_item(text: str, status: str = "completed", item_id: str | None = None, logprobs=None) -> dict:
    """An output message; ``logprobs``: its tokens' (chat's ``logprobs.content``: the Responses API's shape too)."""
    return {"id": item_id or _id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def call_item(call: dict, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or _id("fc"), "type": "function_call", "status": status, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def reasoning_item(text: str) -> dict:
    return {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                                              "text": text}]}


def _usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _object(body: ResponsesRequest, rid: str, output: list, finish: str | None, usage: dict | None,
            status: str | None = None) -> dict:
    """A response object; ``finish``: the chat's finish reason ("length": incomplete, cut by
    max_output_tokens), None while it runs."""
    if status is None:
        status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    choice = body.tool_choice if body.tool_choice is None or isinstance(body.tool_choice, str) else \
        body.tool_choice.model_dump()
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice or ("auto" if body.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []], "truncation": "disabled",
            "usage": _usage(usage), "user": body.user, "metadata": body.metadata or {}}


def response_id(chat_id: str) -> str:
    return "resp_" + chat_id.split("-", 1)[-1]


def response(chat: dict, body: ResponsesRequest, chat_id: str) -> dict:
    """The response object of a chat completion: its reasoning, text and function calls as output items."""
    choice = chat["choices"][0]
    msg, output = choice["message"], []
    if msg.get("reasoning_content"):
        output.append(reasoning_item(msg["reasoning_content"]))
    if msg.get("content") or not msg.get("tool_calls"):
        output.append(message_item(msg.get("content") or "", logprobs=(choice.get("logprobs") or {}).get("content")))
    output += [call_item(c) for c in msg.get("tool_calls") or []]
    return _object(body, response_id(chat_id), output, choice["finish_reason"], chat["usage"])


class _Events:
    """The Responses API's events of one streamed response, numbered in order."""

    def __init__(self, body: ResponsesRequest, rid: str):
        self.body, self.rid, self.n = body, rid, 0
        self.output: list[dict] = []  # the items, as they are when done
        self.text: dict | None = None  # the open message item
        self.calls: dict[int, dict] = {}  # chat tool-call index -> its item
        self.reasoning = ""

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    def open_text(self) -> list[bytes]:
        self.text = message_item("", status="in_progress")
        self.text["content"][0]["text"] = ""
        at = len(self.output)
        self.output.append(self.text)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item = dict(self.text, content=[])
        return [self.event("response.output_item.added", output_index=at, item=item),
                self.event("response.content_part.added", item_id=self.text["id"], output_index=at, content_index=0,
                           part=part)]

    def close_text(self) -> list[bytes]:
        if self.text is None:
            return []
        item, at = self.text, self.output.index(self.text)
        self.text = None
        item["status"] = "completed"
        part = item["content"][0]
        return [self.event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                           text=part["text"], logprobs=part["logprobs"]),
                self.event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=at, item=item)]

    def flush_reasoning(self) -> list[bytes]:
        if not self.reasoning:
            return []
        item, at = reasoning_item(self.reasoning), len(self.output)
        self.reasoning = ""
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=at, item=dict(item, content=[])),
                self.event("response.output_item.done", output_index=at, item=item)]

    def chunk(self, chunk: dict) -> list[bytes]:
        out = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            self.reasoning += delta.get("reasoning_content") or ""
            if delta.get("content"):
                out += self.flush_reasoning()
                if self.text is None:
                    out += self.open_text()
                part = self.text["content"][0]
                part["text"] += delta["content"]
                scored = (choice.get("logprobs") or {}).get("content") or []  # the chunk's tokens'
                part["logprobs"] += scored
                out.append(self.event("response.output_text.delta", item_id=self.text["id"],
                                      output_index=self.output.index(self.text), content_index=0,
                                      delta=delta["content"], logprobs=scored))
            for d in delta.get("tool_calls") or []:
                out += self.flush_reasoning() + self.close_text()
                item = self.calls.get(d["index"])
                if item is None:
                    call = {"id": d["id"], "function": {"name": d["function"]["name"], "arguments": ""}}
                    item = self.calls[d["index"]] = call_item(call, status="in_progress")
                    self.output.append(item)
                    out.append(self.event("response.output_item.added", output_index=self.output.index(item),
                                          item=dict(item)))
                piece = (d.get("function") or {}).get("arguments") or ""
                if piece:
                    item["arguments"] += piece
                    out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self.output.index(item), delta=piece))
        return out

    def finish(self) -> list[bytes]:
        out = self.flush_reasoning()
        if not self.output:  # nothing written: an empty message, as the response object has
            out += self.open_text()
        out += self.close_text()
        for item in self.calls.values():
            item["status"] = "completed"
            at = self.output.index(item)
            out += [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                               name=item["name"], arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=at, item=item)]
        return out


async def events(chunks, body: ResponsesRequest, chat_id: str):
    """The Responses API's events of a streamed chat completion's chunks (server-sent events of
    ``app._stream``): created, in progress, each output item added, its deltas and done, and
    completed (or incomplete, cut by max_output_tokens) with the whole response and its usage."""
    ev, rid = _Events(body, response_id(chat_id)), response_id(chat_id)
    finish, usage = None, None
    try:
        yield ev.event("response.created", response=_object(body, rid, [], None, None))
        yield ev.event("response.in_progress", response=_object(body, rid, [], None, None))
        async for raw in chunks:
            data = raw.decode()[len("data: "):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                err = chunk["error"]
                yield ev.event("error", code=err.get("code"), message=err["message"], param=err.get("param"))
                yield ev.event("response.failed", response=dict(_object(body, rid, ev.output, "stop", None,
                                                                        status="failed"), error=err))
                return
            for piece in ev.chunk(chunk):
                yield piece
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
        for piece in ev.finish():
            yield piece
        final = _object(body, rid, ev.output, finish or "stop", usage)
        yield ev.event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                       response=final)
    finally:
        await chunks.aclose()  # its end frees the rows (a client gone mid-stream)
