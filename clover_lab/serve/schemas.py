"""The request bodies the server accepts, as OpenAI's API defines them (the fields a client of
``/v1/completions`` and ``/v1/chat/completions`` sends), plus Clover's own settings in the extra
field ``clover``. Every model is strict (a string is not a number) and closed (an unknown field is
refused, naming it); the values are then checked by the engine's own rules (``SamplerSettings``,
``requests.check_request``) in ``jobs.py``.
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from clover_lab.hooks import points

# the engine points a trace records unless the request names others
TRACE_POINTS = (points.DENOISE_STEP, points.BLOCK_COMMIT)
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_TOP_LOGPROBS = 20
MAX_N = 128  # choices per request


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class CloverOptions(Strict):
    """``"clover": {...}``: the engine's settings a request may change, and what it streams."""

    mode: Literal["diffusion", "ar"] | None = None
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


class StreamOptions(Strict):
    include_usage: bool = False


class Common(Strict):
    """What completions and chat share."""

    model: str
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
    clover: CloverOptions = Field(default_factory=CloverOptions)


TokenIds = list[int]


class CompletionRequest(Common):
    prompt: Union[str, TokenIds, list[str], list[TokenIds]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Literal[False] = False
    best_of: Literal[1] | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None


class ChatTemplateKwargs(Strict):
    enable_thinking: bool | None = None


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: ChatTemplateKwargs | None = None


def chat_messages(request: ChatRequest) -> list[dict]:
    """The messages as the chat template takes them (text parts joined)."""
    out = []
    for m in request.messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
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
