"""A request and its check: :class:`Request` carries a prompt (or a list of prompts) and every
setting that is per generation (mode, length, stop strings, thinking, sampler settings, decoding
policy, block size, ``n``); :func:`check` turns it into a :class:`Plan` before anything runs: the
prompts as token ids, the settings resolved over the engine's, the context and the memory its
rows need. Whatever is wrong is a GenerationError naming the field (``error.field``)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from clover_lab.engine.sampling import SamplerSettings, SettingsError
from clover_lab.errors import CloverError, flag
from clover_lab.model.cache import cache_bytes

MODES = ("diffusion", "ar", "speculative", "mtp")
MAX_PROMPT_LOGPROBS = 20
# sampler settings that only block diffusion reads: an AR request given one would ignore it
DIFFUSION_SETTINGS = ("threshold", "confidence", "max_tokens_per_step", "max_steps_per_block", "coreset_size")


class GenerationError(CloverError, ValueError):
    """A request the engine refuses up front (context overflow, bad prompt, missing mask token), or a
    generation that cannot give a correct result (non-finite logits); the message says which, and
    ``field`` the request's field it is about (None when it is no field's)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def plain_int(value):
    """numpy integers and the like as Python ints; anything else as it is (checked by the caller)."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


class Request:
    """One request to the engine: ``Request(prompt, mode="ar", max_new_tokens=64, temperature=0.8,
    seed=1)``. ``prompt``: a string, token ids, chat messages, or a list of those (a batch: one row
    each). Per request: ``mode`` ("diffusion", "ar" or "speculative"), ``max_new_tokens`` (default
    the engine's), ``stop`` strings, ``thinking`` (the chat template's switch), ``settings`` (a
    SamplerSettings the keyword sampler settings override; default the engine's), ``policy`` (a
    DecodingPolicy or its name, default the engine's), ``block_size`` (default the engine's), ``n``
    (rows per prompt; sampled with a seed, row i takes seed + i) and ``grammar`` (a
    ``clover_lab.grammar.Grammar`` the response must follow, in every mode: block diffusion through
    ``GrammarPolicy`` around the request's policy, AR and speculative decoding by masking the
    causal choice with the row's ``Constraint``) and ``prompt_logprobs`` (k: the result scores every
    prompt token, its log-probability and k alternatives'; with it, ``max_new_tokens=0`` scores the
    prompt alone) and ``skip_reading_prefix_cache`` (vLLM's name: True runs the whole prompt even
    where the engine's prefix cache holds a prefix of it; None, the default, reads it except for
    rows whose prompt is scored, mtp rows and requests with a hook inside the model; False reads
    it for those hooks too: their prefill events then see only the positions that run, and
    ``where.cached`` says how many came from the cache). Requests with different
    settings share the engine's forwards; each row's tokens are the ones it gives alone."""

    FIELDS = ("mode", "max_new_tokens", "stop", "thinking", "settings", "policy", "block_size", "n", "grammar",
              "prompt_logprobs", "skip_reading_prefix_cache")

    def __init__(self, prompt, *, mode: str = "diffusion", max_new_tokens: int | None = None, stop=None,
                 thinking: bool | None = None, settings=None, policy=None, block_size: int | None = None,
                 n: int = 1, grammar=None, prompt_logprobs: int | None = None,
                 skip_reading_prefix_cache: bool | None = None, **sampler):
        self.prompt, self.mode, self.max_new_tokens, self.stop, self.thinking = prompt, mode, max_new_tokens, stop, \
            thinking
        self.settings, self.policy, self.block_size, self.n, self.sampler = settings, policy, block_size, n, sampler
        self.grammar, self.prompt_logprobs = grammar, prompt_logprobs
        self.skip_reading_prefix_cache = skip_reading_prefix_cache

    def __repr__(self) -> str:
        defaults = {"mode": "diffusion", "n": 1}  # not shown at these values
        given = {k: v for k in self.FIELDS if (v := getattr(self, k)) is not None and v != defaults.get(k, None)}
        given.update(self.sampler)
        return f"Request({self.prompt!r:.60}, {', '.join(f'{k}={v!r}' for k, v in given.items())})"


@dataclass
class Plan:
    """A checked request: its rows' prompts as token ids (a prompt's ``n`` rows in a row), the
    settings each row runs with, and whether it was a batch (its result is then a BatchResult)."""

    prompts: list[list[int]]
    mode: str
    max_new_tokens: int
    stop: list[str]
    settings: list  # SamplerSettings per row
    policy: object  # a DecodingPolicy (``Engine.check`` makes one of a name), or None for the engine's
    block_size: int
    thinking: bool | None
    batched: bool
    sources: list[int] = field(default_factory=list)  # row -> the prompt it answers
    grammar: object = None  # a clover_lab.grammar.Grammar the rows follow, or None
    prompt_logprobs: int | None = None  # alternatives per scored prompt token (None: the prompt is not scored)
    skip_reading_prefix_cache: bool | None = None  # Request's: None reads the prefix cache where it can


def encode_prompt(prompt, tokenizer, vocab_size: int, thinking: bool | None = None) -> list[int]:
    """A prompt as token ids: a string (needs a tokenizer), token ids, or chat messages."""
    V = vocab_size
    thinking = flag("thinking", thinking)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise GenerationError("a text prompt needs a tokenizer, and this engine has none; "
                                  "pass token ids instead (a list of ints)")
        check_text(prompt, "prompt")
        ids = list(tokenizer(prompt)["input_ids"])
    elif isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1 or prompt.dtype not in (torch.int64, torch.int32):
            raise GenerationError(f"prompt tensor: expected integer token ids of shape [T], got "
                                  f"{tuple(prompt.shape)} {prompt.dtype}")
        ids = prompt.tolist()
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        if tokenizer is None:
            raise GenerationError("chat messages need a tokenizer with a chat template; this engine has none")
        for i, msg in enumerate(prompt):
            if "role" not in msg or "content" not in msg:
                raise GenerationError(f"chat message {i}: expected keys 'role' and 'content', got {sorted(msg)}")
            for key, value in msg.items():
                if isinstance(value, str):
                    check_text(value, f"chat message {i}'s {key}")
        ids = chat_ids(tokenizer, prompt, thinking)
        if thinking is True and not has_think_tokens(tokenizer) and chat_ids(tokenizer, prompt, False) != ids:
            raise IgnoredSettingError("thinking", "thinking=True: this tokenizer has no <think> / </think> tokens of "
                                      "its own, so a reasoning could not be told apart from the answer (the response "
                                      "would come back as one plain text, as a plain chat); leave thinking out, or "
                                      "thinking=False")
        if thinking is not None and not has_think_tokens(tokenizer) and chat_ids(tokenizer, prompt,
                                                                                  not thinking) == ids:
            raise IgnoredSettingError("thinking", f"thinking={thinking}: this tokenizer has no thinking mode: it has "
                                      f"no <think> / </think> tokens and its chat template does not read "
                                      f"enable_thinking (the prompt is the same either way); leave thinking out")
    elif isinstance(prompt, (list, tuple)):
        odd = [(i, t) for i, t in enumerate(prompt) if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if odd and any(isinstance(t, (str, list, tuple, torch.Tensor)) for t in prompt):
            i, t = next((i, t) for i, t in enumerate(prompt) if not isinstance(t, (str, list, tuple, torch.Tensor)))
            raise GenerationError(f"prompt {i} of the batch is {type(t).__name__} {t!r:.60}: a batch is a list of "
                                  f"prompts (strings, token-id lists, tensors or conversations)")
        if odd:
            i, t = odd[0]
            raise GenerationError(f"prompt: expected a string, a list of token ids (ints) or chat messages "
                                  f"(dicts with 'role' and 'content'); item {i} is {type(t).__name__} {t!r:.60}")
        ids = list(prompt)
    else:
        raise GenerationError(f"prompt: expected a string, token ids or chat messages, got {type(prompt).__name__}")
    if thinking is not None and not (isinstance(prompt, (list, tuple)) and prompt
                                     and all(isinstance(m, dict) for m in prompt)):
        raise GenerationError(f"thinking={thinking!r} applies to chat messages (the chat template's "
                              f"enable_thinking), and this prompt is {type(prompt).__name__}; pass "
                              f"[{{'role': 'user', 'content': ...}}] or leave thinking out")
    if not ids:
        raise GenerationError("prompt is empty; give at least one token")
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise GenerationError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {V})")
    return [int(t) for t in ids]


def check_text(text: str, what: str) -> None:
    """A GenerationError when ``text`` is no Unicode text: a lone surrogate (half of a UTF-16 pair,
    as JSON's "\\ud800" decodes to) reached the tokenizer as a TypeError (a server's 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GenerationError(f"{what}: the text holds a lone surrogate {text[e.start]!r} at character {e.start}, "
                              f"half of a UTF-16 pair, which is no character; send the text as UTF-8 (or the "
                              f"surrogate with its pair)") from None


def chat_ids(tokenizer, messages, thinking: bool | None) -> list[int]:
    """The chat template applied to ``messages`` (``thinking``: its enable_thinking flag), as ids."""
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    try:
        out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised with what was asked
        raise GenerationError(f"the tokenizer cannot apply a chat template to these messages ({e})") from e
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if isinstance(out, torch.Tensor):
        out = out.reshape(-1).tolist()
    if out and isinstance(out[0], (list, tuple)):
        out = out[0]
    return list(out)


def has_think_tokens(tokenizer) -> bool:
    """Whether ``tokenizer`` has ``<think>`` and ``</think>`` as tokens of their own (``results.py``)."""
    from clover_lab.engine.results import Thinking

    return Thinking.of(tokenizer, []) is not None


def check_request(model, mask_token_id: int | None, prompt_len: int, max_new_tokens: int, mode: str,
                  memory: bool = True) -> None:
    """Refuse up front what cannot run: unknown mode, no mask token, context or memory overflow
    (``memory=False``: a batch checks its whole cache once, :func:`check_memory`)."""
    if mode not in MODES:
        raise GenerationError(f"mode={mode!r}: expected one of {', '.join(MODES)}", "mode")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens={max_new_tokens!r}: expected a positive integer", "max_new_tokens")
    if mode in ("diffusion", "speculative") and mask_token_id is None:
        raise GenerationError(f"{mode} decoding needs a mask token, and none was found: not in config.json or "
                              "generation_config.json (mask_token_id), not in the tokenizer, and the embedding has "
                              "no row past the tokenizer's vocabulary; set engine.mask_token_id, add mask_token_id "
                              "to generation_config.json, or use mode='ar'", "mode")
    if mode == "mtp" and getattr(model, "mtp", None) is None:
        raise GenerationError(f"mode='mtp' needs the model's multi-token-prediction head (mtp.fc, "
                              f"mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.0.*, mtp.norm), and "
                              f"this checkpoint{checkpoint_named(model)} has none; use mode='ar' or 'speculative'",
                              "mode")
    ctx = model.config.max_position_embeddings
    if prompt_len + max_new_tokens > ctx:
        raise GenerationError(f"the prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) is "
                              f"{prompt_len + max_new_tokens} positions, over the context length "
                              f"max_position_embeddings={ctx}; shorten the prompt or lower max_new_tokens",
                              "prompt" if prompt_len >= ctx else "max_new_tokens")
    if memory:
        check_memory(model, prompt_len + max_new_tokens)


def checkpoint_named(model) -> str:
    where = getattr(model, "checkpoint_dir", None)
    return f" ({where})" if where is not None else ""


class IgnoredSettingError(GenerationError):
    """A setting given to a request that could have no effect: one its mode does not read (a
    decoding policy with mode "ar", ``draft_passes`` outside speculative mode: :func:`ignored_settings`)
    or ``thinking`` on a tokenizer without a thinking mode; ``setting`` names it."""

    def __init__(self, setting: str, message: str):
        super().__init__(message, setting)
        self.setting = setting


# what each mode's decoder never reads (beside the other modes' own settings, below)
SPECULATIVE_IGNORES = ("coreset_size", "max_steps_per_block")  # draft_passes is its step limit
ONE_PASS_IGNORES = ("threshold", "max_tokens_per_step")  # a one-pass draft unmasks every position at once


def ignored_settings(mode: str, sampler: dict, policy=None, block_size=None,
                     draft_passes: int | None = None) -> list[tuple[list[str], str]]:
    """The settings given to a ``mode`` request that it does not read, as (names, why) groups:
    block-diffusion settings, a decoding policy and a block size in AR and in mode "mtp"; a
    coreset or a step limit in speculative mode, a threshold or a cap per step where its draft
    takes one pass (``draft_passes``: the request's resolved value; None: the given one, or 1);
    ``draft_passes`` outside speculative mode, ``mtp_draft_tokens`` outside mode "mtp". One list
    for the API (:func:`refuse_ignored`), the command line (a usage error) and the server (a 400
    naming the field)."""
    out = []
    given = [name for name in DIFFUSION_SETTINGS if sampler.get(name) is not None]
    given += ["policy"] if policy is not None else []
    given += ["block_size"] if block_size is not None else []
    if mode == "ar" and given:
        out.append((given, f"mode='ar' decodes one token per forward and ignores the block-diffusion setting(s) "
                           f"{', '.join(given)}: they have no effect on this run"))
    if mode == "mtp" and given:
        out.append((given, f"mode='mtp' drafts with the MTP head (mtp_draft_tokens tokens per verify) and ignores "
                           f"the block-diffusion setting(s) {', '.join(given)}: they have no effect on this run"))
    if mode == "speculative":
        one_pass = (sampler.get("draft_passes") if draft_passes is None else draft_passes) in (None, 1)
        why = {"coreset_size": "it drafts without an expert coreset",
               "max_steps_per_block": "draft_passes sets its steps per block",
               "threshold": "a one-pass draft (draft_passes=1) unmasks every position at once",
               "max_tokens_per_step": "a one-pass draft (draft_passes=1) unmasks every position at once"}
        names = [n for n in SPECULATIVE_IGNORES if sampler.get(n)]
        names += [n for n in ONE_PASS_IGNORES if sampler.get(n) is not None and one_pass]
        if names:
            reasons = "; ".join(dict.fromkeys(why[n] for n in names))
            out.append((names, f"mode='speculative' ignores {', '.join(names)} ({reasons}): "
                               f"{'they have' if len(names) > 1 else 'it has'} no effect on this run"))
    if mode != "mtp" and sampler.get("mtp_draft_tokens") is not None:
        out.append((["mtp_draft_tokens"], f"mtp_draft_tokens sets the MTP head's drafts in mode='mtp'; mode={mode!r} "
                                          f"ignores it: it has no effect on this run"))
    if mode != "speculative" and sampler.get("draft_passes") is not None:
        out.append((["draft_passes"], f"draft_passes drafts blocks in mode='speculative'; mode={mode!r} ignores it: "
                                      f"it has no effect on this run"))
    return out


def refuse_ignored(mode: str, sampler: dict, policy=None, block_size=None, draft_passes: int | None = None) -> None:
    """An :class:`IgnoredSettingError` naming the first setting ``mode`` would ignore and the mode
    (:func:`ignored_settings`): a setting given is meant to act, so one that could not is refused
    (it was a warning in process, which a notebook or a script's log easily loses)."""
    for names, why in ignored_settings(mode, sampler, policy, block_size, draft_passes):
        raise IgnoredSettingError(names[0], f"{why}; leave {'them' if len(names) > 1 else 'it'} out, or use a mode "
                                            f"that reads {'them' if len(names) > 1 else 'it'}")


def settings_for_mode(mode: str, sampler: dict) -> dict:
    """``sampler`` without the settings ``mode`` ignores (:func:`ignored_settings`; ``policy`` and
    ``block_size`` among them when ``sampler`` holds them): for callers (a view comparing modes, a
    dashboard's sliders) that hold one set of settings for any mode."""
    drop = {n for names, _ in ignored_settings(mode, sampler, sampler.get("policy"), sampler.get("block_size"))
            for n in names}
    return {k: v for k, v in sampler.items() if k not in drop}


def is_batch(prompt) -> bool:
    """A list of prompts (strings, tensors, token-id lists or chat conversations), not one prompt
    (token ids, or one conversation of message dicts)."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(p, (str, list, tuple, torch.Tensor)) for p in prompt))


def check_memory(model, length: int, rows: int = 1) -> None:
    """Refuse a cache of ``rows`` x ``length`` positions that does not fit in free memory."""
    need = cache_bytes(model.config, length, rows, dtype=model.dtype)
    free = available_bytes(model.device)
    if free is not None and need > free:
        what, fix = ((f"{length} positions", "lower max_new_tokens or shorten the prompt") if rows == 1 else
                     (f"{rows} rows of {length} positions",
                      "batch fewer prompts, lower max_new_tokens or shorten the prompts"))
        raise GenerationError(f"the cache for {what} needs {need / 2**30:.2f} GiB, but only {free / 2**30:.2f} GiB "
                              f"is free on {model.device}; {fix}", "max_new_tokens")


def check_coreset(config, size: int | None) -> None:
    """A coreset must leave the router its top-k and restrict something: None or 0 (off), or
    ``num_experts_per_tok`` <= size < ``num_experts``."""
    if not size:
        return
    k, E = config.num_experts_per_tok, config.num_experts
    if size < k:
        raise GenerationError(f"coreset_size={size}: a coreset needs at least num_experts_per_tok={k} experts "
                              f"(each token routes to {k})")
    if size >= E:
        raise GenerationError(f"coreset_size={size}: the model has {E} experts, so a coreset of {size} would "
                              f"restrict nothing; use a size below {E}, or None / 0 for no coreset")


def check_join(config, batched: bool, mode: str, coreset_size, capacity) -> None:
    """Rows join a batch in block diffusion without a coreset (a coreset is shared by the rows of
    a block), within a cache of ``capacity`` positions per row."""
    if not batched:
        raise GenerationError("join: rows join a batch; pass the prompts as a list")
    if mode != "diffusion" or coreset_size:
        raise GenerationError(f"join: rows join block-diffusion batches without an expert coreset, not mode={mode!r} "
                              f"coreset_size={coreset_size!r}")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                 or not 1 <= capacity <= config.max_position_embeddings):
        raise GenerationError(f"capacity={capacity!r}: expected positions per row in [1, "
                              f"max_position_embeddings={config.max_position_embeddings}]")


def stop_list(stop, tokenizer) -> list[str]:
    """``stop`` (None, a string or strings) as a list of non-empty strings; they need a tokenizer."""
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif isinstance(stop, (list, tuple, set, frozenset)):
        stop = list(stop)
    else:
        raise GenerationError(f"stop: expected a string or a list of strings, got {type(stop).__name__} {stop!r}")
    if stop:
        if not all(isinstance(x, str) and x for x in stop):
            raise GenerationError(f"stop: expected non-empty strings, got {stop!r}")
        for i, x in enumerate(stop):
            check_text(x, f"stop[{i}]")
        if tokenizer is None:
            raise GenerationError("stop strings need a tokenizer, and this engine has none; "
                                  "use eos token ids (engine.eos_token_ids) instead")
    return stop


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` for a new cache, or None when unknown."""
    try:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free)
        if device.type == "cpu":
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
    except (OSError, RuntimeError, ValueError):
        return None
    return None


class StopStrings:
    """Finds the first stop string in the decoded response; knows how many tokens it takes."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.longest = max(len(s) for s in stops)
        self.clean = 0  # this many leading tokens are known to decode to stop-free text

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def find(self, ids: list[int]) -> int | None:
        """Smallest k such that decode(ids[:k]) contains a stop string, or None."""
        if len(ids) <= self.clean:
            return None
        text = self.decode(ids)
        if not any(s in text for s in self.stops):
            self.clean = len(ids)
            return None
        for k in range(self.clean + 1, len(ids) + 1):
            t = self.decode(ids[:k])
            if any(s in t for s in self.stops):
                return k
        return len(ids)

    def cut(self, text: str) -> str:
        hits = [text.find(s) for s in self.stops if s in text]
        return text[:min(hits)] if hits else text


def check_combination(engine, grammar, s: SamplerSettings, stop: list[str]) -> None:
    """Whether settings that are each fine can run together: the one place a request's
    combination is judged before it is queued (for the API, the command line and the server). A
    grammar (``response_format``, a required tool call) ends the response where it is complete,
    with EOS, and allows only its own tokens: EOS ignored (``ignore_eos``), held back
    (``min_tokens``) or banned (``logit_bias`` -100), another token banned (perhaps the only one the
    grammar allows next) or a stop string (which cuts its text short, leaving it unparsable) could
    only make it fail or break its promise mid-run. The error names the setting and the grammar."""
    if grammar is None:
        return
    vocab = getattr(grammar, "vocabulary", None)
    V = engine.model.config.vocab_size
    if vocab is not None and (vocab.size != V or vocab.eos not in engine.eos_token_ids or engine.tokenizer is None
                              or len(vocab.tokenizer) != len(engine.tokenizer)):
        raise GenerationError(f"grammar ({grammar.what}): made for another vocabulary ({vocab.size} tokens, EOS "
                              f"{vocab.eos}) than this engine's ({V} tokens, EOS {engine.eos_token_ids}, its "
                              f"tokenizer's); make it with this engine: Grammar.json_schema(schema, engine)", "grammar")
    what = f"the response follows a grammar ({grammar.what})"
    if s.ignore_eos:
        raise GenerationError(f"ignore_eos: {what}, which ends the response with EOS where it is complete; with EOS "
                              f"ignored it would have to go on past its end. Leave out ignore_eos or the grammar",
                              "ignore_eos")
    if s.min_tokens:
        raise GenerationError(f"min_tokens={s.min_tokens}: {what}, which decides where the response ends (a complete "
                              f"value may be shorter); leave out min_tokens or the grammar", "min_tokens")
    banned = sorted(t for t, b in (s.logit_bias or {}).items() if b <= -100)
    if banned:
        raise GenerationError(f"logit_bias bans token(s) {banned[:5]} (-100), and {what}: a ban can leave it no "
                              f"token to choose (a token it requires next, or EOS once it is complete); give a bias "
                              f"above -100 (such as -30), which the grammar can still overrule, or leave out one",
                              "logit_bias")
    if stop:
        raise GenerationError(f"stop: {what}; a stop string would cut its text short of the end the grammar "
                              f"promises (unparsable); leave out stop or the grammar", "stop")


def plan(engine, request: Request) -> Plan:
    """``request`` checked against ``engine`` (``Engine.check``): every refusal before anything
    runs, a GenerationError naming the field (a sampler setting's SettingsError names it too)."""
    if not isinstance(request, Request):
        raise GenerationError(f"expected a clover_lab.Request, got {type(request).__name__}")
    mode, n = request.mode, request.n
    if mode not in MODES:
        raise GenerationError(f"mode={mode!r}: expected one of {', '.join(MODES)}", "mode")
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise GenerationError(f"n={n!r}: expected a positive integer (rows per prompt)", "n")
    try:
        s = SamplerSettings.from_kwargs(engine.settings if request.settings is None else request.settings,
                                        **request.sampler)
    except SettingsError as e:  # it names the setting, and ``field`` where it is one
        e.field = e.field or "settings"
        raise
    if mode == "speculative" and not s.greedy and s.draft_passes != 1:
        raise GenerationError(f"sampled speculative decoding takes draft_passes=1 (got {s.draft_passes}): the "
                              f"acceptance rule needs each drafted token's own distribution, which only a one-pass "
                              f"draft gives", "draft_passes")
    if mode != "ar" and s.penalty_window is not None:
        raise GenerationError(f"penalty_window applies to mode='ar' (block diffusion resolves positions out of "
                              f"order, so 'the last N tokens' has no meaning there); mode={mode!r}", "penalty_window")
    bad = [t for t in (s.logit_bias or {}) if t >= engine.model.config.vocab_size]
    if bad:
        raise GenerationError(f"logit_bias: token ids {bad[:5]} are outside the vocabulary [0, "
                              f"{engine.model.config.vocab_size})", "logit_bias")
    try:
        check_coreset(engine.model.config, s.coreset_size)
    except GenerationError as e:
        raise GenerationError(str(e), "coreset_size") from None
    refuse_ignored(mode, request.sampler, request.policy, request.block_size, s.draft_passes)
    try:
        stop = stop_list(request.stop, engine.tokenizer)
    except GenerationError as e:
        raise GenerationError(str(e), "stop") from None
    max_new = engine.max_new_tokens if request.max_new_tokens is None else request.max_new_tokens
    max_new = plain_int(max_new)
    k = plain_int(request.prompt_logprobs)
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_PROMPT_LOGPROBS):
        raise GenerationError(f"prompt_logprobs={request.prompt_logprobs!r}: expected None or alternatives per "
                              f"token in [0, {MAX_PROMPT_LOGPROBS}]", "prompt_logprobs")
    least = 0 if k is not None else 1  # a scored prompt may take no response
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < least:
        raise GenerationError(f"max_new_tokens={max_new!r}: expected a positive integer"
                              + (" (or 0 to score the prompt)" if least == 0 else ""), "max_new_tokens")
    block_size = engine.block_size if request.block_size is None else plain_int(request.block_size)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise GenerationError(f"block_size={request.block_size!r}: expected a positive integer", "block_size")
    if request.grammar is not None and not callable(getattr(request.grammar, "matcher", None)):
        raise GenerationError(f"grammar={request.grammar!r:.80}: expected a clover_lab.grammar.Grammar "
                              f"(Grammar.json_schema(schema, engine), ...)", "grammar")
    if s.min_tokens and s.min_tokens > max_new:
        raise GenerationError(f"min_tokens={s.min_tokens} is more than max_new_tokens={max_new}: the response could "
                              f"never have them; lower min_tokens or raise max_new_tokens", "min_tokens")
    check_combination(engine, request.grammar, s, stop)
    skip = request.skip_reading_prefix_cache
    if skip is not None and not isinstance(skip, bool):
        raise GenerationError(f"skip_reading_prefix_cache={skip!r}: expected True, False or None",
                              "skip_reading_prefix_cache")
    if skip is False and (mode == "mtp" or k is not None):
        why = "mtp rows' head reads the trunk states of the whole prompt" if mode == "mtp" else \
            "prompt_logprobs needs the logits of every prompt position"
        raise GenerationError(f"skip_reading_prefix_cache=False: {why}, so the prompt runs whole; "
                              f"leave it None", "skip_reading_prefix_cache")
    batched = is_batch(request.prompt)
    prompts = request.prompt if batched else [request.prompt]
    ids = []
    for r, one in enumerate(prompts):
        try:
            ids.append(encode_prompt(one, engine.tokenizer, engine.model.config.vocab_size, request.thinking))
            check_request(engine.model, engine.mask_token_id, len(ids[-1]), max(max_new, 1), mode, memory=False)
        except GenerationError as e:
            if e.field is None:  # what encoding the prompt refused
                e.field = "prompt"
            if batched:
                e.args = (f"prompt {r} of the batch: {e}",)
            raise
    rows = [p for p in ids for _ in range(n)]
    check_memory(engine.model, max(map(len, rows)) + max_new, len(rows))
    settings = []
    for i in range(len(rows)):
        seeded = s.seed is not None and n > 1 and not s.greedy
        settings.append(SamplerSettings.from_kwargs(s, seed=(s.seed + i % n) % (2**64)) if seeded else s)
    return Plan(rows, mode, max_new, stop, settings, request.policy, block_size, request.thinking, batched or n > 1,
                [p for p in range(len(ids)) for _ in range(n)], request.grammar, k, skip)
