"""What the server answers, in OpenAI's shapes: a completion or chat completion, the chunks of
its stream (server-sent events), usage and finish reasons, with Clover's own in ``clover``: each
chunk says whether it is ``provisional`` (a denoising step's canvas, which may still change) or
``committed`` (a block that is final), the response its stats and trace id."""
from __future__ import annotations

import json
import time

from clover_lab.grammar import tool_calls
from clover_lab.serve.tools import openai_calls

FINISH = {"length": "length"}  # every other stop reason (eos, stop string) is OpenAI's "stop"


def finish_reason(stop_reason: str) -> str:
    return FINISH.get(stop_reason, "stop")


def sse(data) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


DONE = sse("[DONE]")


class TextStream:
    """The response text as blocks commit, in pieces whose concatenation is the final text: a
    trailing partial UTF-8 character, or a tail that may begin a stop string, waits for the next
    block; text from a stop string on is never sent."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops, self.sent = tokenizer, stops, ""

    def visible(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        hits = [text.find(s) for s in self.stops if s in text]
        if hits:
            return text[:min(hits)]
        text = text.rstrip("\ufffd")
        held = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return text[:len(text) - held]

    def delta(self, ids: list[int], hold_calls: bool = False, part: bool = False) -> str:
        """The new text of the committed ``ids``; ``hold_calls``: none from where a tool call
        begins (or may begin), which the last chunk sends as a call; ``part``: the ids are a
        reasoning or an answer, whose text is without the newlines at its ends (as a result's)."""
        text = self.visible(ids)
        text = text.strip("\n") if part else text
        at = tool_calls.opens_call(text) if hold_calls else -1
        return self._advance(text if at < 0 else text[:at])

    def final(self, text: str) -> str:
        return self._advance(text)

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):  # cannot happen with the hold-backs above; never resend
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece


class Shape:
    """The response shapes of one endpoint: ``chat`` (chat.completion) or not (text_completion)."""

    def __init__(self, chat: bool, rid: str, model: str, tokenizer=None, parse_calls: bool = False, n: int = 1):
        self.chat, self.id, self.model, self.created = chat, rid, model, int(time.time())
        self.n = n  # choices per prompt (usage counts each prompt once)
        self.tokenizer = tokenizer  # names the tokens of log-probabilities
        self.parse_calls = parse_calls  # the request has tools: the model's tool calls become message.tool_calls

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, index: int, text: str, finish: str | None = None, clover: dict | None = None,
              first: bool = False, logprobs: dict | None = None, calls: list[dict] | None = None,
              reasoning: str = "") -> dict:
        """A stream chunk; ``logprobs``: its tokens' (:meth:`scored`), if asked;
        ``calls``: tool-call deltas (``call_stream.py``: each with its call's ``index``); ``reasoning``:
        new text of the reasoning (``delta.reasoning_content``, as vLLM, SGLang and DeepSeek send it)."""
        lp = logprobs
        if self.chat:
            # content is a string in every chunk (as vLLM and SGLang send it, and their tests read it) but one that
            # carries only reasoning or tool calls
            delta = {"role": "assistant"} if first else {}
            if text or not (reasoning or calls):
                delta["content"] = text
            if reasoning:
                delta["reasoning_content"] = reasoning
            if calls:
                delta["tool_calls"] = calls
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if clover is not None:
            out["clover"] = clover
        return out

    def usage_chunk(self, results) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(results, self.n)}

    def response(self, results, texts: list[str], trace: bool, probes: list | None = None,
                 echoes: list | None = None) -> dict:
        """The whole response; ``probes``: each choice's :class:`~clover_lab.serve.explore.Probe` (or None);
        ``echoes``: each completion's echoed prompt text (or None)."""
        choices = []
        echoes = echoes or [None] * len(results)
        for i, (r, text, echo) in enumerate(zip(results, texts, echoes)):
            c = {"index": i, "logprobs": self.logprobs(r, echo is not None),
                 "finish_reason": finish_reason(r.stop_reason)}
            if self.chat:
                c["message"], c["finish_reason"] = self.message(r, text)
            else:
                c["text"] = (echo or "") + text
            choices.append(c)
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": usage(results, self.n), "clover": clover_summary(self.id, results, trace, probes)}


    def message(self, result, text: str) -> tuple[dict, str]:
        """The assistant message and its finish reason: its text, its reasoning apart
        (``reasoning_content``, when the chat has thinking), its tool calls parsed out of the text
        (when the request has tools; :meth:`split_calls`)."""
        if result.reasoning is not None:
            text = result.answer
        content, calls, finish = self.split_calls(text, result.stop_reason)
        msg = {"role": "assistant", "content": content}
        if result.reasoning is not None:
            msg["reasoning_content"] = result.reasoning
        if calls or content != text:
            msg.update(content=content or None)
        if calls:
            msg["tool_calls"] = calls
        return msg, finish

    def split_calls(self, text: str, stop_reason: str) -> tuple[str, list[dict], str]:
        """(the text outside the tool calls, the calls, the finish reason) of a response's text. A
        call its length cut (``max_tokens``) is no call and not content either: the response ends
        "length" without it (a client would otherwise run half a call, or show it as the answer);
        complete calls end "tool_calls"."""
        finish = finish_reason(stop_reason)
        if not self.parse_calls:
            return text, [], finish
        content, calls = tool_calls.parse(text)
        content = content if calls else text
        at = tool_calls.opens_call(content) if stop_reason == "length" else -1
        if at >= 0:
            return content[:at], openai_calls(calls), "length"
        return content, openai_calls(calls), "tool_calls" if calls else finish

    def logprobs(self, result, echo: bool = False) -> dict | None:
        """The response tokens' log-probabilities (``GenerationResult.logprobs``: under the
        distribution each was chosen from) in OpenAI's shape for the endpoint; None unless asked.
        ``echo`` (completions): the prompt's tokens first, as the prompt scored them (the first has
        none: null)."""
        if result.logprobs is None:
            return None
        ids, lps, tops = result.token_ids, result.logprobs, result.top_logprobs or [None] * len(result.token_ids)
        if echo and result.prompt_logprobs is not None:
            ids, lps = result.prompt_ids + ids, result.prompt_logprobs + lps
            tops = (result.prompt_top_logprobs or [None] * len(result.prompt_ids)) + tops
        return self.scored(ids, lps, tops)[0]

    def scored(self, ids: list[int], lps: list, tops: list | None, at: int = 0) -> tuple[dict, int]:
        """Tokens with their log-probabilities and alternatives ((token id, log-probability) pairs, or
        None) in OpenAI's shape for the endpoint, and where the text after them begins (completions'
        ``text_offset`` counts from ``at``: a stream's chunks continue their response's offsets)."""
        piece = lambda t: self.tokenizer.decode([t])  # noqa: E731
        tokens = [piece(t) for t in ids]
        # each token's alternatives hold the token itself (as vLLM's), also where it ranked below the k asked
        # for; top_logprobs: 0 (chat) asks for none: []; a token with no log-probability (an echoed prompt's
        # first) has no alternatives: null
        tops = [None if lp is None else [] if top is None and self.chat else list(top or []) + (
            [] if any(t == tid for t, _ in top or []) else [(tid, lp)])
            for top, tid, lp in zip(tops or [None] * len(ids), ids, lps)]
        if self.chat:
            def entry(text, lp):
                return {"token": text, "logprob": lp, "bytes": list(text.encode())}
            return {"content": [{**entry(text, lp), "top_logprobs": [entry(piece(t), v) for t, v in top]}
                                for text, lp, top in zip(tokens, lps, tops)]}, at
        offsets = []
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {"tokens": tokens, "token_logprobs": list(lps),
                "top_logprobs": [None if top is None else {piece(t): v for t, v in top} for top in tops],
                "text_offset": offsets}, at


def usage(results, n: int = 1) -> dict:
    """Tokens of a response, as OpenAI counts them: each prompt once, however many choices (``n``)
    answer it (``results``: a prompt's ``n`` choices in a row), and every choice's tokens."""
    prompt = sum(len(r.prompt_ids) for r in results[::n])
    completion = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def clover_summary(rid: str, results, trace: bool, probes: list | None = None) -> dict:
    """Per choice its stats and, where asked, its step map and experts (lists in the choices' order)."""
    out = {"stats": [r.stats.to_dict() for r in results]}
    if trace:
        out["trace_id"] = rid
    if probes and probes[0] is not None:  # a request's choices all ask alike
        frames = [p.summary(r) for p, r in zip(probes, results)]
        out.update({key: [f[key] for f in frames] for key in frames[0]})
    return out


def provisional(update) -> dict:
    """A denoising step: the block's canvas (None where still masked) and what this step unmasked."""
    return {"kind": "provisional", "block": update.block, "step": update.step, "tokens": update.block_tokens,
            "pieces": update.block_pieces(), "unmasked": update.unmasked}


def committed(update, tokens: list[int], frame: dict | None = None) -> dict:
    """A committed block: its tokens and, where asked, their step map and experts (``frame``)."""
    return {"kind": "committed", "block": update.block, "tokens": tokens, **(frame or {})}
