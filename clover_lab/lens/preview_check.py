"""``clover-lab check``: does a checkpoint's preview denoise as a trained preview, and under which
reading of its four preview tensors (spec 3.2.1)?

How the release stores them is inferred (a logit scale kept as a log or as the multiplier itself,
a history coefficient on ln(m) or on m, the order of the right taps: ``PREVIEW_READINGS``), and a
wrong guess makes the preview quietly worse rather than fail. On ordinary text (given, or
held-out standard-library modules, which the embedded model's training left out by a hash of
their path) this measures, under every reading and with the untrained defaults (spec 3.2), the
masked-token accuracy and cross-entropy of one preview of each block, masked at a few exact
ratios, against its clean prefix; beside them the causal path's next-token accuracy and block
diffusion's tokens per forward at threshold 0.9. A trained preview's accuracy is far above the
untrained defaults'. The best reading is the one of lowest cross-entropy (finer than accuracy:
every masked token counts with the probability it gets, so a reading that only blurs the
preview shows too), and when it is not the config's the report names the config.json line that
selects it (``CloverConfig.preview_reading``, which the model honours).
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from clover_lab.checkpoint.names import PREVIEW_PARAMS
from clover_lab.config import PREVIEW_READINGS
from clover_lab.corpus import corpus_documents, corpus_inputs
from clover_lab.errors import CloverError
from clover_lab.lens.routing_stats import windows
from clover_lab.train.objective import masked_accuracy
from clover_lab.train.stdlib_corpus import read_text, split_corpus
from clover_lab.writes import model_inputs, refuse_inputs, write_text

RATIOS = (0.25, 0.5, 0.75)
THRESHOLD = 0.9
# a trained preview: its mean masked-token accuracy at least this many times the untrained
# defaults' and this much above them (the embedded model: 0.27 against 0.18; the untrained preview
# is no zero: the attention layers already read the prefix and the whole block)
TRAINED_FACTOR, TRAINED_MARGIN = 1.25, 0.03
SPEC = "spec"


class CheckError(CloverError, ValueError):
    """A check that cannot be run on what it was given; the message says why."""


@dataclass
class Row:
    """One way of running the preview: a reading (or the untrained defaults) and its figures."""
    label: str
    reading: dict | None  # None: the untrained defaults
    accuracy: dict = field(default_factory=dict)  # mask ratio -> masked-token accuracy
    nll: dict = field(default_factory=dict)  # mask ratio -> masked-token cross-entropy (nats)
    tokens_per_forward: float | None = None
    note: str = ""  # why it was not measured

    @property
    def mean(self) -> float | None:
        """The mean masked-token accuracy over the ratios."""
        return sum(self.accuracy.values()) / len(self.accuracy) if self.accuracy else None

    @property
    def mean_nll(self) -> float | None:
        return sum(self.nll.values()) / len(self.nll) if self.nll else None


@dataclass
class CheckReport:
    rows: list[Row]
    causal_accuracy: float
    tokens: int  # tokens of text measured
    configured: dict  # the config's preview_reading when the check ran
    inputs: list = field(default_factory=list, repr=False)  # (label, path) read: save() never writes over them

    @property
    def untrained(self) -> Row:
        return next(r for r in self.rows if r.reading is None)

    @property
    def ranked(self) -> list[Row]:
        """The measured readings, best (lowest cross-entropy) first."""
        return sorted((r for r in self.rows if r.reading is not None and r.nll), key=lambda r: r.mean_nll)

    @property
    def best(self) -> Row:
        return self.ranked[0]

    @property
    def margin(self) -> float:
        """How far the best reading is ahead of the next one: the next one's cross-entropy minus its (nats)."""
        ranked = self.ranked
        return ranked[1].mean_nll - ranked[0].mean_nll if len(ranked) > 1 else float("inf")

    @property
    def trained(self) -> bool:
        base = self.untrained.mean
        return self.best.mean >= TRAINED_FACTOR * base and self.best.mean - base >= TRAINED_MARGIN

    @property
    def config_line(self) -> str | None:
        """The config.json line that selects the best reading, or None when the config has it."""
        if self.best.reading == self.configured:
            return None
        return f'"preview_reading": {json.dumps(self.best.reading)}'

    def verdict(self) -> str:
        best = self.best
        text = (f"the preview denoises as a trained preview: {'yes' if self.trained else 'no'}, best reading "
                f"{best.label} (masked-token accuracy {best.mean:.3f} against the untrained defaults' "
                f"{self.untrained.mean:.3f}; cross-entropy {best.mean_nll:.3f} nats, {self.margin:.3f} below "
                f"the next reading's)")
        if self.config_line is not None:
            text += f"; to use it, add to config.json: {self.config_line}"
        return text

    def table(self) -> str:
        head = ["reading"] + [f"acc@{r:g}" for r in RATIOS] + ["mean acc", "mean CE", f"TPF@{THRESHOLD:g}"]
        lines = [head]
        for r in self.rows:
            if r.mean is None:
                lines.append([r.label] + ["-"] * (len(head) - 2) + [r.note])
                continue
            tpf = "-" if r.tokens_per_forward is None else f"{r.tokens_per_forward:.2f}"
            lines.append([r.label] + [f"{r.accuracy[x]:.3f}" for x in RATIOS] + [f"{r.mean:.3f}", f"{r.mean_nll:.3f}",
                                                                                 tpf])
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
        out.append(f"causal next-token accuracy: {self.causal_accuracy:.3f} ({self.tokens} tokens)")
        return "\n".join(out)

    def to_dict(self) -> dict:
        return {"rows": [{"label": r.label, "reading": r.reading,
                          "accuracy": {str(k): v for k, v in r.accuracy.items()},
                          "cross_entropy": {str(k): v for k, v in r.nll.items()}, "mean_accuracy": r.mean,
                          "mean_cross_entropy": r.mean_nll, "tokens_per_forward": r.tokens_per_forward,
                          "note": r.note} for r in self.rows],
                "causal_accuracy": self.causal_accuracy, "tokens": self.tokens, "trained": self.trained,
                "best": self.best.label, "best_reading": self.best.reading, "margin": self.margin,
                "config_line": self.config_line, "verdict": self.verdict()}

    def save(self, path) -> Path:
        """The report as JSON at ``path``, written whole or not at all."""
        refuse_inputs(path, self.inputs, "the check's report")
        return write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")


def readings() -> list[dict]:
    """Every combination of PREVIEW_READINGS, as preview_reading dicts (the spec's: {}), the spec's first."""
    keys = list(PREVIEW_READINGS)
    out = []
    for values in itertools.product(*(PREVIEW_READINGS[k] for k in keys)):
        out.append({k: v for k, v in zip(keys, values) if v != PREVIEW_READINGS[k][0]})
    return out


def label(reading: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in reading.items()) or SPEC


def builtin_sample(max_files: int = 8, max_chars: int = 6000) -> list[str]:
    """Ordinary text no embedded model was trained on: the first ``max_chars`` (whole lines) of
    up to ``max_files`` held-out standard-library modules."""
    _, held = split_corpus()
    texts = []
    for f in held:
        text = read_text(f) or ""
        if len(text) >= max_chars:
            texts.append(text[:text.rfind("\n", 0, max_chars) + 1])
        if len(texts) == max_files:
            break
    if not texts:
        raise CheckError("no held-out standard-library modules found for the built-in sample; give --data")
    return texts


def sample_windows(engine, data, count: int, seq_len: int) -> torch.Tensor:
    """``count`` windows [count, seq_len] of token ids, spread over the documents of ``data``."""
    if engine.tokenizer is None:
        raise CheckError("check needs a tokenizer in the model directory to read text")
    docs = builtin_sample() if data is None else corpus_documents(data)
    full = [w for w in windows(docs, engine.tokenizer, seq_len, engine.model.config.vocab_size) if len(w) == seq_len]
    if not full:
        raise CheckError(f"the text holds no window of {seq_len} tokens; give more text")
    step = max(1, len(full) // count)
    return torch.tensor(full[::step][:count], dtype=torch.long, device=engine.model.input_device)


@torch.no_grad()
def check_preview(engine, data=None, windows_count: int = 8, seq_len: int | None = None, prompts: int = 2,
                  prompt_len: int = 48, seed: int = 0) -> CheckReport:
    """The check on ``engine``'s model (see the module's docstring); ``data``: a corpus as
    ``clover_lab.corpus`` takes it (Paths, texts, token ids; None: the built-in sample). The model is left as it was found."""
    model = engine.model
    if engine.mask_token_id is None:
        raise CheckError("check needs a mask token (config.json's mask_token_id or the tokenizer's)")
    if getattr(model, "preview_untrained", False):  # every reading would read the same defaults
        raise CheckError(f"{getattr(model, 'checkpoint_dir', 'the checkpoint')}: the checkpoint has no Clover preview "
                         f"weights (a converter dropped them, or it is a causal-only model), so its preview runs on "
                         f"the spec's untrained defaults and there is no reading of stored weights to rank; give a "
                         f"checkpoint that holds them")
    bs = engine.block_size
    clean = sample_windows(engine, data, windows_count, seq_len or 8 * bs)
    clean = clean[:, :clean.shape[1] // bs * bs]
    starts = [w[:prompt_len].tolist() for w in clean[:prompts]]
    configured = dict(model.config.preview_reading)
    rows = [Row(label(r), r) for r in readings()] + [Row("untrained defaults", None)]
    stored = {n: p.detach().clone() for n, p in model.named_parameters() if _is_preview(n)}
    try:
        for row in rows:
            if row.reading is None:
                model.reset_preview_parameters()
            elif row.reading.get("logit_scale") == "multiplier" and not all(
                    bool((p > 0).all()) for n, p in stored.items() if n.endswith("block_scale")):
                row.note = "n/a: logit scales <= 0 are no multiplier"
                continue
            model.set_preview_reading(row.reading or {})
            for ratio in RATIOS:  # the same masks for every row
                acc, _, nll = masked_accuracy(model, clean, ratio, torch.Generator().manual_seed(seed),
                                              mask_id=engine.mask_token_id)
                row.accuracy[ratio], row.nll[ratio] = acc, nll
        best = min((r for r in rows if r.reading is not None and r.nll), key=lambda r: r.mean_nll)
        for row in rows:  # generation is the slow part: the readings that matter
            if row.reading is None or row.reading in ({}, configured, best.reading):
                if row.reading is None:
                    model.reset_preview_parameters()
                else:
                    _restore(model, stored)
                model.set_preview_reading(row.reading or {})
                row.tokens_per_forward = _tokens_per_forward(engine, starts)
        causal = _causal_accuracy(model, clean)
    finally:
        model.set_preview_reading(configured)
        _restore(model, stored)
    return CheckReport(rows, causal, clean.numel(), configured, inputs=model_inputs(model) + corpus_inputs(data))


def _restore(model, stored: dict) -> None:
    params = dict(model.named_parameters())
    for n, t in stored.items():
        params[n].copy_(t)


def _is_preview(name: str) -> bool:
    return any(name.endswith(p) for p in PREVIEW_PARAMS)


def _tokens_per_forward(engine, prompts: list[list[int]]) -> float:
    made = forwards = 0
    for ids in prompts:
        r = engine.generate(ids, max_new_tokens=2 * engine.block_size, threshold=THRESHOLD, temperature=0.0)
        made += len(r.token_ids)
        forwards += r.stats["forwards"]
    return made / max(forwards, 1)


def _causal_accuracy(model, clean: torch.Tensor, batch: int = 8) -> float:
    right = 0
    for i in range(0, clean.shape[0], batch):
        rows = clean[i:i + batch]
        right += int((model.logits(rows)[:, :-1].argmax(-1) == rows[:, 1:].to(model.device)).sum())
    return right / (clean.shape[0] * (clean.shape[1] - 1))
