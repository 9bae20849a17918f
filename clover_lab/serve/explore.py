"""Exploration over HTTP: what a request may ask to see of its own decoding, in the ``clover``
object (off by default; nothing is recorded or computed for a request that does not ask).

``clover.step_map``: per committed token, the denoising step of its block that unmasked it
(``GenerationResult.unmask_steps``; 0 for every AR token). ``clover.experts``: per committed token,
the experts it was routed to in each MoE layer, as the commit forward that wrote it to the cache
routed it: uint8 [tokens, layers, top_k], row-major, base64 (:func:`pack`; ``NOT_ROUTED`` where no
commit forward has seen the token). Routes are read by an observer hook on ``layers.*.moe.route``
scoped to the one request (:class:`ExpertRecorder`), as ``clover.trace`` records its points.
"""
from __future__ import annotations

import base64

import torch

from clover_lab.hooks import points
from clover_lab.hooks.registry import observer

NOT_ROUTED = 255  # a token no commit forward has routed (uint8: the model must have at most 255 experts)
ROUTES = points.every_layer(points.MOE_ROUTE)


def pack(ids: torch.Tensor) -> dict:
    """Expert ids uint8 [T, L, k] as the wire carries them: dtype, shape and base64 of the bytes."""
    return {"dtype": "uint8", "shape": list(ids.shape), "data": base64.b64encode(ids.numpy().tobytes()).decode()}


def unpack(wire: dict) -> torch.Tensor:
    """:func:`pack`'s inverse (what a client does, with numpy: ``np.frombuffer(b64decode(data),
    np.uint8).reshape(shape)``)."""
    raw = bytearray(base64.b64decode(wire["data"]))
    return torch.frombuffer(raw, dtype=torch.uint8).reshape(wire["shape"]) if raw else torch.zeros(
        wire["shape"], dtype=torch.uint8)


class ExpertRecorder:
    """The experts of one request's response tokens, from the commit forwards of its (one) row:
    ``recorder.hooks()`` are opened in the request's own context before it is submitted, so
    only its forwards fire them (a request with a hook inside the model runs its forwards alone).
    Events are kept on the device and moved to the host when read (``experts``)."""

    def __init__(self, config, prompt_len: int, max_new_tokens: int):
        self.prompt_len, self.layers, self.top_k = prompt_len, config.num_hidden_layers, config.num_experts_per_tok
        self.ids = torch.full((max_new_tokens, self.layers, self.top_k), NOT_ROUTED, dtype=torch.uint8)
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (layer, positions, expert ids) on device

    def hooks(self) -> dict:
        @observer
        def route(ev):
            if ev.mode == "commit":  # the prompt's prefill too: its positions are dropped when read
                self._pending.append((ev.layer, ev.positions, ev.expert_ids.to(torch.uint8)))

        return {ROUTES: route}

    def experts(self, lo: int, hi: int) -> torch.Tensor:
        """uint8 [hi - lo, layers, top_k]: the experts of response tokens lo..hi-1 (the latest
        commit forward at each position wins: a rejected speculative draft is written over)."""
        pending, self._pending = self._pending, []
        for layer, positions, ids in pending:
            pos, ids = positions.cpu() - self.prompt_len, ids.cpu()
            keep = (pos >= 0) & (pos < self.ids.shape[0])
            self.ids[pos[keep], layer] = ids[keep]
        return self.ids[lo:hi].clone()


class Probe:
    """What one job reports beside its tokens: its step map and its experts (either may be off).
    ``frame(row, lo, hi)`` reads them for response tokens lo..hi-1 in the worker thread, as the
    tokens commit (a streamed chunk's); ``summary(result)`` for a whole response."""

    def __init__(self, step_map: bool, experts: ExpertRecorder | None):
        self.step_map, self.recorder = step_map, experts

    def frame(self, steps: list, lo: int, hi: int) -> dict:
        out = {}
        if self.step_map:
            out["step_map"] = list(steps[lo:hi])
        if self.recorder is not None:
            out["experts"] = pack(self.recorder.experts(lo, hi))
        return out

    def summary(self, result) -> dict:
        return self.frame(result.unmask_steps, 0, len(result.token_ids))
