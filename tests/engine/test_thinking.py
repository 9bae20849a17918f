"""Thinking mode on a tokenizer of Qwen3.5/3.6's format (tokenizer.json byte-level BPE,
tokenizer_config.json with a chat template that knows enable_thinking, <think> / </think> as
added tokens): prompts with and without thinking, reasoning and answer apart in results and
streams, penalties over the response only, and a stop on </think> when thinking is off."""
import pytest
import torch
from qwen_format import qwen_tokenizer

import clover_lab
from clover_lab import GenerationError
from clover_lab.engine.results import Thinking
from clover_lab.errors import InputError


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, gen_model):
    """clover-tiny (vocab 512, mask 511) with the Qwen-format tokenizer, saved and loaded as a user would."""
    d = tmp_path_factory.mktemp("qwen_format")
    gen_model.save_pretrained(d)
    tok = qwen_tokenizer()
    assert len(tok) < 511  # every token id below the mask
    tok.save_pretrained(str(d))
    assert (d / "tokenizer.json").exists() and (d / "tokenizer_config.json").exists()
    return d


@pytest.fixture(scope="module")
def engine(qwen_dir):
    return clover_lab.load(qwen_dir)


MESSAGES = [{"role": "user", "content": "What is the answer?"}]


def ids_of(engine, text):
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def scripted(engine, script):
    """A denoise.step hook that writes ``script`` (token ids) into the response, filler after it."""
    filler = ids_of(engine, " the")[0]
    bs = engine.block_size

    def write(ev):
        for p in list(ev.masked):
            i = ev.block * bs + p
            ev.set_token(p, script[i] if i < len(script) else filler)

    return write


def test_chat_prompts_with_and_without_thinking(engine):
    tok = engine.tokenizer
    on = tok.decode(engine.encode(MESSAGES, thinking=True))
    off = tok.decode(engine.encode(MESSAGES, thinking=False))
    default = tok.decode(engine.encode(MESSAGES))
    assert on.endswith("<|im_start|>assistant\n<think>\n") and default == on  # Qwen3.5/3.6: thinking by default
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert Thinking.of(tok, engine.encode(MESSAGES, thinking=True)).open
    assert not Thinking.of(tok, engine.encode(MESSAGES, thinking=False)).open


def test_reasoning_and_answer_apart_in_result_and_stream(engine):
    tok = engine.tokenizer
    end, eos = tok.convert_tokens_to_ids("</think>"), tok.eos_token_id
    script = ids_of(engine, "Let me think step by step.") + [end] + ids_of(engine, "\n\nThe answer is main.") + [eos]
    with engine.hooks({"denoise.step": scripted(engine, script)}):
        r = engine.generate(MESSAGES, thinking=True, max_new_tokens=64)
        updates = list(engine.stream(MESSAGES, thinking=True, max_new_tokens=64))
    assert r.token_ids == script and r.stop_reason == "eos"
    assert r.reasoning == "Let me think step by step." and r.answer == "The answer is main."
    assert r.to_dict()["reasoning"] == r.reasoning and r.to_dict()["answer"] == r.answer
    done = updates[-1]
    assert done.kind == "done" and done.result.reasoning == r.reasoning
    k = script.index(end)
    assert done.committed_parts() == ["reasoning"] * (k + 1) + ["answer"] * (len(script) - k - 1)
    assert done.committed_texts() == (r.reasoning, r.answer)
    steps = [u for u in updates if u.kind == "step" and u.block == 0]
    parts = steps[0].block_parts()  # the first block: reasoning up to </think>, then answer
    assert parts[:k + 1] == ["reasoning"] * (k + 1) and set(parts[k + 1:]) <= {"answer"}


def test_no_reasoning_without_thinking_tokens(tiny_text_engine):
    r = tiny_text_engine.generate([5, 6, 7], max_new_tokens=16)
    assert r.reasoning is None and r.answer == r.text.strip("\n")


def test_stop_on_think_end_when_thinking_is_off(engine):
    tok = engine.tokenizer
    end = tok.convert_tokens_to_ids("</think>")
    script = ids_of(engine, "Sure.") + [end] + ids_of(engine, " more text after it")
    with engine.hooks({"denoise.step": scripted(engine, script)}):
        off = engine.generate(MESSAGES, thinking=False, max_new_tokens=32)
        on = engine.generate(MESSAGES, thinking=True, max_new_tokens=32)
        ar_off = engine.generate(MESSAGES, thinking=False, max_new_tokens=32, mode="ar")
    assert off.token_ids == script[:script.index(end) + 1] and off.stop_reason == "eos"
    assert off.reasoning is None and off.answer == "Sure.</think>"  # thinking off: nothing is reasoning
    assert len(on.token_ids) == 32 and on.stop_reason == "length"  # thinking on: </think> ends the reasoning only
    assert on.reasoning == "Sure." and on.answer.startswith(" more text after it")
    assert ar_off.stop_reason in ("length", "eos") and end not in ar_off.token_ids[:-1]


def test_penalties_count_the_response_only(engine, gen_one_thread):
    """A chat prompt with thinking whose greedy first token is one of the prompt's own tokens
    (the template's included): a huge presence penalty leaves that first token as it is."""
    tok = engine.tokenizer
    by_length = {}  # user messages of one token each, grouped so that one forward runs a group
    for i in range(len(tok)):
        prompt = engine.encode([{"role": "user", "content": tok.decode([i])}], thinking=True)
        by_length.setdefault(len(prompt), []).append(prompt)
    found = []
    for group in by_length.values():
        nxt = engine.model.logits(torch.tensor(group))[:, -1].argmax(-1).tolist()
        found += [(p, t) for p, t in zip(group, nxt) if t in p]
    assert found, "no prompt found whose greedy next token is in it"
    prompt, first = found[0]
    assert engine.generate(prompt, mode="ar", max_new_tokens=1).token_ids == [first]
    penalised = engine.generate(prompt, mode="ar", max_new_tokens=4, presence_penalty=1e4).token_ids
    assert penalised[0] == first and len(set(penalised)) == 4  # the response's own tokens do count
    diffusion = engine.generate(prompt, max_new_tokens=16, presence_penalty=1e4, max_tokens_per_step=1)
    assert len(set(diffusion.token_ids)) == 16


def test_a_model_that_opens_its_own_think():
    t = Thinking(start=1, end=2, open=False)
    assert t.split([1, 5, 6, 2, 7]) == ([5, 6], [7])
    assert t.split([5, 1, 6]) == (None, [5, 1, 6])  # a <think> later on is text of the answer
    assert t.split([1, 5]) == ([5], [])  # still thinking
    assert t.parts([1, 5, None, 2, 7]) == ["reasoning", "reasoning", None, "reasoning", "answer"]
    assert Thinking(1, 2, open=True).split([5, 2, 7]) == ([5], [7])


def test_thinking_is_for_chat_messages_and_a_boolean(tiny_text_engine):
    for prompt in ("w1 w2", [1, 2, 3]):
        with pytest.raises(GenerationError, match="thinking=True applies to chat messages"):
            tiny_text_engine.generate(prompt, thinking=True, max_new_tokens=4)
    with pytest.raises(InputError, match="thinking='false'"):
        tiny_text_engine.generate([{"role": "user", "content": "w1"}], thinking="false", max_new_tokens=4)
    # thinking=True on a tokenizer without <think> tokens answered as a plain chat, without a word
    with pytest.raises(GenerationError, match="no <think> / </think> tokens of its own") as e:
        tiny_text_engine.encode([{"role": "user", "content": "w1"}], thinking=True)
    assert e.value.field == "thinking"
    off = tiny_text_engine.encode([{"role": "user", "content": "w1"}], thinking=False)
    assert off[-1] == 5  # the template's "thinking off" (w5)
