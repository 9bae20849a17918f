"""The logit lens per denoising step: at every forward whose logits the engine reads (each
preview of a block; each AR token), every layer's residual stream read through the final norm and
the LM head, at the rows the engine reads (a preview's still-masked positions, an AR step's last
row). It shows at which layer, and at which step, each token is decided.

    lens = clover_lab.lens.logit_lens(engine, "def parse(line):\\n", max_new_tokens=32)
    step = lens.at(block=0, step=1)
    step.top(layer=2, position=step.positions[0])   # [(token, probability), ...]
    lens.decided()                                   # position -> (step, layer)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from clover_lab.errors import InputError
from clover_lab.hooks import points as P
from clover_lab.hooks.events import ResidualEvent
from clover_lab.patching.patch import one_prompt


@dataclass
class LensStep:
    """One forward's lens. ``positions`` [N] absolute positions read; ``ids`` / ``probs``
    [layers, N, k] the top-k tokens and probabilities of each layer's residual (the last layer's
    are the model's own); ``unmasked`` the positions the engine unmasked after this step (diffusion)."""

    block: int | None
    step: int | None
    mode: str
    positions: list[int]
    ids: torch.Tensor
    probs: torch.Tensor
    unmasked: list[int] = field(default_factory=list)

    def top(self, layer: int, position: int) -> list[tuple[int, float]]:
        j = self.positions.index(position)
        return list(zip(self.ids[layer, j].tolist(), self.probs[layer, j].tolist()))

    def decided_layer(self) -> list[int]:
        """Per position: the first layer from which every later layer's top token is the last
        layer's (the model's own top token)."""
        top = self.ids[:, :, 0]  # [L, N]
        same = top == top[-1:]
        out = []
        for j in range(top.shape[1]):
            layer = top.shape[0] - 1
            while layer > 0 and bool(same[layer - 1, j]):
                layer -= 1
            out.append(layer)
        return out

    def to_dict(self) -> dict:
        return dict(block=self.block, step=self.step, mode=self.mode, positions=self.positions,
                    ids=self.ids.tolist(), probs=self.probs.tolist(), unmasked=self.unmasked)


@dataclass
class LogitLens:
    """The lens of a whole generation: ``steps`` in firing order, ``result`` the generation."""

    steps: list[LensStep]
    layers: int
    k: int
    result: object = None

    def at(self, block: int | None, step: int | None) -> LensStep:
        for s in self.steps:
            if (s.block, s.step) == (block, step):
                return s
        raise KeyError(f"the lens has no forward at block {block}, step {step}")

    def decided(self) -> dict[int, tuple[int | None, int]]:
        """Position of each generated token -> (the denoising step that unmasked it, the first
        layer from which the lens agreed with the model at that step). AR: the token at p is read
        at row p - 1 (its step None)."""
        out = {}
        for s in self.steps:
            layers = s.decided_layer()
            for j, p in enumerate(s.positions):
                if s.mode == "commit":
                    out[p + 1] = (None, layers[j])
                elif p in s.unmasked:
                    out[p] = (s.step, layers[j])
        return out


class _Reader:
    """Hooks: keep each layer's output of the current forward, read them at the final norm."""

    def __init__(self, model, k: int, mask_id: int | None):
        self.model, self.k, self.mask_id = model, k, mask_id
        self.layers = model.config.num_hidden_layers
        self.outputs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.steps: list[LensStep] = []

    def on_output(self, ev: ResidualEvent) -> None:
        self.outputs[(ev.layer, ev.mode)] = (ev.value, ev.positions)

    @torch.no_grad()  # also outside a forward: a trace replayed through the model's head
    def on_head(self, ev: ResidualEvent) -> None:
        positions = ev.positions.tolist()
        rows = []
        for layer in range(self.layers):
            value, part = self.outputs[(layer, ev.mode)]
            idx = (ev.positions - part[0]).to(value.device)  # a part's positions are consecutive
            rows.append(value[0, idx])
        h = torch.stack(rows)  # [L, N, H]
        logits = self.model.lm_head(self.model.model.norm(h)).float()
        if ev.mode == "preview" and self.mask_id is not None:
            logits[..., self.mask_id] = float("-inf")  # never a candidate
        probs, ids = logits.softmax(-1).topk(min(self.k, logits.shape[-1]), dim=-1)
        self.steps.append(LensStep(ev.block, ev.step, ev.mode, positions, ids.cpu(), probs.cpu()))

    def on_step(self, ev) -> None:
        """``denoise.step``: which of the step's read rows the engine unmasked (the rows a preview
        reads are the block's masked positions, in order)."""
        s = self.steps[-1]
        if (s.block, s.step) == (ev.block, ev.step):
            s.unmasked = [s.positions[ev.masked.index(p)] for p in ev.unmask]

    def hooks(self) -> dict:
        return {P.every_layer(P.OUTPUT): self.on_output, P.FINAL_NORM_OUTPUT: self.on_head,
                P.DENOISE_STEP: self.on_step}


def logit_lens(engine, prompt, k: int = 5, **generate) -> LogitLens:
    """Generate ``prompt`` (diffusion or ``mode="ar"``) with the lens on; returns every step's lens.
    The lens reads the residual stream as it flows, so patches attached alongside are seen."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InputError(f"logit_lens k={k!r}: expected a positive int (the top-k tokens kept per layer)")
    one_prompt(prompt, "logit_lens")
    reader = _Reader(engine.model, k, engine.mask_token_id)
    with torch.no_grad(), engine.hooks(reader.hooks()):
        result = engine.generate(prompt, **generate)
    return LogitLens(reader.steps, reader.layers, k, result)
