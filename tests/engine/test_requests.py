"""Tests moved from test_reliability.py."""
import copy
import json
import shutil
import warnings

import pytest
import torch

import clover_lab
from clover_lab import (
    CheckpointError,
    CloverModel,
    Coreset,
    Engine,
    GenerationError,
    HookError,
    SettingsError,
)

PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]


KW = dict(max_new_tokens=20, threshold=0.3)


# --------------------------------------------------------------------------- 2. coreset size
def test_coreset_size_must_leave_top_k_and_restrict_something(tiny_engine):
    k, E = tiny_engine.model.config.num_experts_per_tok, tiny_engine.model.config.num_experts
    with pytest.raises(GenerationError, match=f"coreset_size=1: .*num_experts_per_tok={k}"):
        tiny_engine.generate(PROMPT, coreset_size=1)
    with pytest.raises(GenerationError, match=f"coreset_size={E}: the model has {E} experts"):
        tiny_engine.generate(PROMPT, coreset_size=E)
    cap_points = ["layers.*.moe.route"]
    with tiny_engine.capture(cap_points) as cap:  # the smallest valid coreset routes correctly
        r = tiny_engine.generate(PROMPT, max_new_tokens=16, threshold=0.9, coreset_size=k)
    assert r.stats.coreset_size == k
    for rec in cap["layers.*.moe.route"]:
        assert (rec["weights"] >= 0).all() and torch.allclose(rec["weights"].sum(-1), torch.ones(1))
    cache = tiny_engine.model.new_cache(64)
    tiny_engine.model.commit(cache, PROMPT)
    with pytest.raises(ValueError, match="coreset size 1 is below num_experts_per_tok"):  # the model itself too
        tiny_engine.model.preview(cache, [511] * 4, coreset=Coreset(1))


def test_confusing_arguments_get_clear_errors(tiny_engine):
    with pytest.raises(GenerationError, match="stop: expected a string or a list of strings, got int 123"):
        tiny_engine.generate(PROMPT, stop=123)
    with pytest.raises(SettingsError, match="seed"):
        tiny_engine.generate(PROMPT, seed=2**70)
    with pytest.raises(SettingsError, match="settings: expected a SamplerSettings, got str 'fast'"):
        tiny_engine.generate(PROMPT, settings="fast")
    with pytest.raises(CheckpointError, match="meta"):
        clover_lab.load("/nonexistent", device="meta")
    with torch.device("meta"):
        on_meta = CloverModel(clover_lab.CloverConfig.preset("clover-tiny"))
    with pytest.raises(ValueError, match="meta device"):
        Engine(on_meta)


def test_lower_level_arguments_are_checked(tiny_engine, gen_model_dir, tmp_path):
    with pytest.raises(ValueError, match="capture: to='bogus' is not a device"):
        tiny_engine.capture("denoise.step", to="bogus")
    with pytest.raises(ValueError, match="cache max_len must be a positive integer"):
        tiny_engine.model.new_cache(-1)
    with pytest.raises(ValueError, match="Coreset size must be a positive integer"):
        Coreset("a")
    with tiny_engine.hooks({"denoise.step": lambda ev: ev.candidate(99)}):
        with pytest.raises(HookError, match="block position 99 is not masked"):
            tiny_engine.generate(PROMPT, **KW)
    import numpy as np  # numpy scalars are numbers like any other

    r = tiny_engine.generate(PROMPT, max_new_tokens=np.int64(8), threshold=np.float32(0.3), top_k=np.int64(5))
    assert len(r.token_ids) == 8
    shutil.copytree(gen_model_dir, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"coreset_size": 1}))
    with pytest.raises(CheckpointError, match="generation_config.json: coreset_size=1"):
        clover_lab.load(tmp_path / "m")


OTHER = [7, 8, 9, 200, 300]


# --------------------------------------------------------------------------- 5. the first harness's remainder
def test_diffusion_settings_in_an_ar_request_are_refused_naming_both(tiny_engine):
    """They were a warning and the run went on without them; now an error naming the settings and
    the mode (``field`` the first setting), and the engine runs the next request as before."""
    with pytest.raises(IgnoredSettingError, match="mode='ar' .*threshold, coreset_size") as e:
        tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=4, threshold=0.5, coreset_size=4)
    assert e.value.field == "threshold" and e.value.setting == "threshold"
    with pytest.raises(IgnoredSettingError, match="threshold"):
        tiny_engine.generate([PROMPT, OTHER], mode="ar", max_new_tokens=4, threshold=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # settings AR reads, or diffusion with its own: not a word
        assert tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=4, temperature=0).stats.mode == "ar"
        assert tiny_engine.generate(PROMPT, max_new_tokens=4, coreset_size=4).stats.coreset_size == 4


# --------------------------------------------------------------------------- 6. obscure errors named
def test_a_batch_rows_no_progress_limit_names_the_row(tiny_engine):
    def veto(ev):
        ev.unmask = []

    with tiny_engine.hooks({"denoise.step": veto}):
        with pytest.raises(clover_lab.HookError, match=r"row 0, block 0: hooks kept positions masked"):
            tiny_engine.generate([PROMPT, OTHER], max_new_tokens=4)


@pytest.mark.parametrize("prompt,match", [
    (["w1 w2", None], "prompt 1 of the batch is NoneType"), ([[1, 2], 5], "prompt 1 of the batch is int"),
    ([1, 2, None], "item 2 is NoneType"), ([1, "a"], "prompt 0 of the batch is int"),
])
def test_a_list_that_is_neither_a_prompt_nor_a_batch_names_its_item(tiny_text_engine, prompt, match):
    with pytest.raises(GenerationError, match=match):
        tiny_text_engine.generate(prompt, max_new_tokens=4)


# --------------------------------------------------------------------------- settings a mode or tokenizer ignores
from clover_lab.engine.requests import IgnoredSettingError, settings_for_mode  # noqa: E402

# (mode, settings given, the setting the error names): each a setting the mode's decoder never reads
IGNORED = [("ar", dict(policy="topk:k=2"), "policy"), ("ar", dict(block_size=4), "block_size"),
           ("diffusion", dict(draft_passes=2), "draft_passes"), ("ar", dict(draft_passes=2), "draft_passes"),
           ("diffusion", dict(mtp_draft_tokens=2), "mtp_draft_tokens"),
           ("speculative", dict(max_steps_per_block=2, draft_passes=2), "max_steps_per_block"),
           ("speculative", dict(threshold=0.5), "threshold"), ("speculative", dict(coreset_size=4), "coreset_size"),
           ("mtp", dict(policy="topk:k=2"), "policy"), ("mtp", dict(block_size=4), "block_size")]


@pytest.mark.parametrize("mode,given,name", IGNORED, ids=[f"{m}-{n}" for m, _, n in IGNORED])
def test_a_setting_the_mode_ignores_is_refused_naming_both(tiny_engine, mode, given, name):
    """A top-k policy with mode "ar" and draft_passes with mode "diffusion" were accepted with a
    warning and ignored (the command line and the server refused them): refused in process too,
    before anything runs, naming the setting and the mode."""
    kw = {k: v for k, v in given.items() if k not in ("policy", "block_size")}
    with pytest.raises(IgnoredSettingError, match=f"mode={mode!r}") as e:
        tiny_engine.check(clover_lab.Request(PROMPT, mode=mode, max_new_tokens=4, policy=given.get("policy"),
                                             block_size=given.get("block_size"), **kw))
    assert e.value.field == name and name in str(e.value)
    assert name not in settings_for_mode(mode, given)  # what a view holding one set for every mode drops


def test_settings_a_mode_reads_are_not_refused(tiny_engine):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiny_engine.generate(PROMPT, mode="speculative", max_new_tokens=4, draft_passes=2, policy="topk:k=2",
                             threshold=0.5)  # two passes: the threshold decides the first
        tiny_engine.generate(PROMPT, max_new_tokens=4, policy="eb:gamma=0.5", block_size=4)
    assert settings_for_mode("speculative", dict(threshold=0.5, draft_passes=2)) == dict(threshold=0.5, draft_passes=2)


def no_thinking_tokenizer(gen_tokenizer, template_reads_it: bool):
    """A copy of the fixture's tokenizer (it has no <think> tokens) whose chat template reads
    enable_thinking (w4 / w5 at the end), or does not."""
    tok = copy.deepcopy(gen_tokenizer)
    if not template_reads_it:
        tok.chat_template = tok.chat_template.split("{% if add_generation_prompt %}")[0] + \
            "{% if add_generation_prompt %}w3 {% endif %}"
    return tok


@pytest.mark.parametrize("thinking", [True, False])
def test_thinking_on_a_tokenizer_without_a_thinking_mode_is_refused(gen_model, gen_tokenizer, thinking):
    """thinking=True on a tokenizer without <think> whose template does not read enable_thinking changed
    nothing, silently. A template that reads it (the fixture's: w4 / w5) takes thinking=False; thinking=True
    is refused all the same: without <think> tokens the reasoning could not be told apart from the answer."""
    deaf = Engine(gen_model, no_thinking_tokenizer(gen_tokenizer, False))
    msgs = [{"role": "user", "content": "w8 w9"}]
    with pytest.raises(IgnoredSettingError, match=f"thinking={thinking}: this tokenizer has no thinking mode"):
        deaf.generate(msgs, thinking=thinking, max_new_tokens=4)
    assert deaf.generate(msgs, max_new_tokens=4).prompt_ids == [1, 8, 9, 3]  # the engine as it was
    listening = Engine(gen_model, no_thinking_tokenizer(gen_tokenizer, True))
    if thinking:
        with pytest.raises(IgnoredSettingError, match="no <think> / </think> tokens of its own"):
            listening.generate(msgs, thinking=thinking, max_new_tokens=4)
    else:
        assert listening.generate(msgs, thinking=thinking, max_new_tokens=4).prompt_ids[-1] == 5


def test_a_policy_naming_a_setting_twice_is_refused():
    from clover_lab.engine.policies import make_policy

    for spec in ("topk:k=2,k=4", "eb:gamma=0.1,gamma=0.5", "lookahead:start=0.5,threshold=0.9,start=0.1"):
        with pytest.raises(SettingsError, match="given twice"):
            make_policy(spec)


def test_text_holding_a_lone_surrogate_is_named(tiny_text_engine):
    """A lone surrogate reached the tokenizer as a TypeError."""
    for prompt, where in [("w5 \ud800 w6", "prompt"), ([{"role": "user", "content": "w5\udfff"}], "chat message 0's content")]:
        with pytest.raises(GenerationError, match=f"{where}: the text holds a lone surrogate"):
            tiny_text_engine.generate(prompt, max_new_tokens=2)
    with pytest.raises(GenerationError, match=r"stop\[1\]: the text holds a lone surrogate"):
        tiny_text_engine.generate("w5", stop=["w6", "\ud800"], max_new_tokens=2)
    assert tiny_text_engine.generate("w5 \U0001F600 w6", max_new_tokens=2).token_ids  # a real pair is text
