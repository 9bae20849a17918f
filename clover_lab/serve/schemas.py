"""The request bodies the server accepts, as OpenAI's API defines them (the fields a client of
``/v1/completions`` and ``/v1/chat/completions`` sends), plus Clover's own settings in the extra
field ``clover``. Every model is strict (a string is not a number) and closed (an unknown field is
refused, naming it); the values are then checked by the engine's own rules (``SamplerSettings``,
``requests.check_request``) in ``jobs.py``.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from clover_lab.hooks import points

# fields whose value is one of several shapes: pydantic names the shape it tried after the field
# (messages.0.user.content, response_format.json_schema.json_schema.name); errors leave it out
UNION_FIELDS = ("messages.*", "response_format", "tool_choice")
# the engine points a trace records unless the request names others
TRACE_POINTS = (points.DENOISE_STEP, points.BLOCK_COMMIT)
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_TOP_LOGPROBS = 20
MAX_N = 128  # choices per request


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class CloverOptions(Strict):
    """``"clover": {...}``: the engine's settings a request may change, and what it streams."""

    mode: Literal["diffusion", "ar", "speculative", "mtp"] | None = None
    threshold: float | None = None
    block_size: int | None = Field(default=None, ge=1)
    coreset_size: int | None = None
    confidence: str | None = None
    top_k: int | None = None
    max_tokens_per_step: int | None = None
    max_steps_per_block: int | None = None
    repetition_penalty: float | None = None
    stream_provisional: bool = False  # stream each denoising step's canvas too, marked provisional
    trace: bool | list[str] = False  # record the request's trace (true: TRACE_POINTS), fetched by id
    thinking: bool | None = None  # the chat template's enable_thinking
    policy: str | None = None  # the decoding policy by name ("eb:gamma=0.5", "topk:k=2"; engine/policies.py)
    step_map: bool = False  # per committed token the denoising step that unmasked it (serve/explore.py)
    experts: bool = False  # per committed token its routed experts, uint8 [tokens, layers, top_k] base64
    open_schemas: bool | None = None  # JSON schemas read as written (open where silent); default: the server's


class StreamOptions(Strict):
    include_usage: bool = False


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs``: one constraint of the response (a JSON schema, a regular
    expression, a choice among strings, an EBNF grammar, any JSON object), through the same grammar
    engine as ``response_format``."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # a schema, or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_additional_properties: bool | None = None  # true: closed objects (the server's default)
    disable_any_whitespace: bool | None = None  # no-op: JSON is written without free whitespace already
    disable_fallback: bool | None = None  # no-op: there is one grammar engine, and no fallback


class Common(Strict):
    """What completions and chat share: OpenAI's fields, vLLM's and SGLang's sampling and
    structured-output extras, and the fields clients send that change nothing here (documented
    no-ops, docs/serving-agents.md)."""

    model: str | None = None  # none: the served model (as vLLM takes it)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)  # rows of one request (sampled with a seed, row k takes seed + k)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key: a string) -> bias in [-100, 100]
    ignore_eos: bool | None = None  # as vLLM and SGLang take them (benchmark clients send both)
    min_tokens: int | None = Field(default=None, ge=0)
    # vLLM's sampling extras (its extra_body), mapped to the engine's settings (jobs.py)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None  # each must be an end token of the model (it ends the response)
    skip_reading_prefix_cache: bool | None = None  # true: the whole prompt runs (engine/requests.py's Request)
    include_stop_str_in_output: Literal[False] | None = None  # the stop string is never in the text
    skip_special_tokens: Literal[True] | None = None  # the text never holds special tokens
    spaces_between_special_tokens: bool | None = None  # no-op: no special token is in the text
    # structured output in vLLM's spelling and SGLang's (regex, ebnf)
    structured_outputs: StructuredOutputs | None = None
    regex: str | None = None
    ebnf: str | None = None
    # OpenAI's fields that change nothing here: nothing is stored, there is one service tier
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    clover: CloverOptions = Field(default_factory=CloverOptions)


TokenIds = list[int]


class CompletionRequest(Common):
    prompt: Union[str, TokenIds, list[str], list[TokenIds]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0 with echo: the prompt scored alone (lm-eval's loglikelihood)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False  # the prompt before the completion, in its text and (with logprobs) its log-probabilities
    best_of: Literal[1] | None = None
    response_format: Union[TextFormat, JSONObjectFormat, JSONSchemaResponseFormat] | None = Field(
        default=None, discriminator="type")  # as vLLM's completions take it


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "user", "developer"]
    content: str | list[TextPart]
    name: str | None = None


class CalledFunction(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(Strict):
    """An assistant turn sent back as history, as OpenAI's client dumps it (``refusal``,
    ``tool_calls`` and the rest may be null)."""

    role: Literal["assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: None = None
    audio: None = None
    annotations: list | None = None
    reasoning_content: str | None = None


class ToolMessage(Strict):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str
    name: str | None = None  # the function's name, as some clients send it (the call's id says which)


class FunctionSpec(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextFormat(Strict):
    type: Literal["text"]


class JSONObjectFormat(Strict):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


class ChatTemplateKwargs(Strict):
    enable_thinking: bool | None = None


class ChatRequest(Common):
    messages: list[Annotated[Union[Message, AssistantMessage, ToolMessage], Field(discriminator="role")]] = Field(
        min_length=1)
    response_format: Union[TextFormat, JSONObjectFormat, JSONSchemaResponseFormat] | None = Field(
        default=None, discriminator="type")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: ChatTemplateKwargs | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # no-op: see thinking
    prediction: None = None  # predicted outputs: only null (nothing to predict from)


def chat_messages(request: ChatRequest) -> list[dict]:
    """The messages as the chat template takes them (text parts joined; an assistant's tool calls
    with their arguments as objects, a tool's result with the id of the call it answers)."""
    out = []
    for m in request.messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(
            p.text for p in m.content)
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if isinstance(m, AssistantMessage) and m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments}} for c in m.tool_calls]
        if isinstance(m, ToolMessage):
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def thinking(request: ChatRequest) -> bool | None:
    """The thinking switch: ``chat_template_kwargs.enable_thinking`` (as Qwen servers take it) or
    ``clover.thinking``."""
    kw = request.chat_template_kwargs
    return request.clover.thinking if kw is None or kw.enable_thinking is None else kw.enable_thinking


def thinking_param(request: ChatRequest) -> str:
    """The field :func:`thinking` read the switch from."""
    kw = request.chat_template_kwargs
    return "clover.thinking" if kw is None or kw.enable_thinking is None else "chat_template_kwargs.enable_thinking"


class TokenizePrompt(Strict):
    """vLLM's ``/tokenize`` of a text prompt (as completions encode it)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChat(Strict):
    """vLLM's ``/tokenize`` of chat messages (as chat completions encode them, tools and thinking switch
    included, by default; the chat template's switches as vLLM takes them)."""

    model: str | None = None
    messages: list[Annotated[Union[Message, AssistantMessage, ToolMessage], Field(discriminator="role")]] = Field(
        min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template writes the special tokens itself
    return_token_strs: bool | None = False
    tools: list[Tool] | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    clover: CloverOptions = Field(default_factory=CloverOptions)  # its thinking switch


TokenizeRequest = Union[TokenizeChat, TokenizePrompt]


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]
