"""clover_lab.grammar: the Constraint's masks against the matcher stepped token by token, a
vocabulary larger than the tokenizer's, schemas that cannot compile named, the tool-call format
written and read back, and GrammarPolicy's block diffusion on the embedded model: every output
validates against its schema, greedy and sampled, whatever the inner rule proposes."""
import json
import random

import jsonschema
import pytest
import torch

import clover_lab
from clover_lab.engine.policies import DecodingPolicy, Proposal
from clover_lab.errors import GrammarError
from clover_lab.grammar import Grammar, GrammarPolicy, tool_calls
from clover_lab.grammar.vocabulary import Vocabulary

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ITEMS = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
                                          "ok": {"type": "boolean"}},
         "required": ["items", "ok"], "additionalProperties": False}
CHOICE = {"type": "object", "properties": {"kind": {"enum": ["list", "dict", "set"]},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "note": {"type": ["string", "null"], "maxLength": 16}},
          "required": ["kind", "size", "note"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["C", "F"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                                                     "maxLength": 12}},
                                           "required": ["zone"], "additionalProperties": False}}
PROMPTS = ["def parse(line):\n", "import os\n", [{"role": "user", "content": "give me the answer as JSON"}]]


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return clover_lab.load(dtype=torch.float32)


@pytest.fixture(scope="module")
def person(engine):
    return Grammar.json_schema(PERSON, engine)


def test_masks_are_the_matcher_stepped_token_by_token_and_leave_the_state(engine, person):
    tok = engine.tokenizer
    c = person.matcher()
    path = tok.encode('{"name": "Ada", "age": 36}')
    masks = c.masks(path)
    assert masks.shape == (len(path) + 1, engine.model.config.vocab_size) and masks.dtype == torch.bool
    assert c.accepted == [] and torch.equal(c.masks([])[0], masks[0])  # masks([]) did not move
    step = person.matcher()
    for i, t in enumerate(path):
        assert torch.equal(step.masks([])[0], masks[i]), i
        assert masks[i, t], f"token {i} of a valid JSON text is refused"
        step.accept([t])
    assert masks[-1].nonzero().flatten().tolist() == [engine.eos_token_ids[0]]  # complete: only EOS
    assert step.terminated and not c.terminated
    assert torch.equal(c.masks(path[:3])[3], person.matcher().masks(path[:3])[3])


def test_masks_after_a_refused_token_allow_nothing_and_accept_refuses_by_name(engine, person):
    tok = engine.tokenizer
    c = person.matcher()
    good, bad = tok.encode('{"name"'), tok.encode("x")[0]
    masks = c.masks(good + [bad] + good)
    assert masks[: len(good) + 1].any(-1).all()
    assert not masks[len(good) + 1:].any(), "rows past a refused token must allow nothing"
    assert c.allows(good + [bad]) == len(good)
    c.accept(good)
    with pytest.raises(GrammarError, match="not allowed by the grammar") as e:
        c.accept([bad])
    assert e.value.what == "schema" and c.accepted == good  # nothing accepted from the refused list


def test_a_model_vocabulary_larger_than_the_tokenizers_is_never_allowed(engine):
    V = engine.model.config.vocab_size + 40
    g = Grammar.json_object(Vocabulary(engine.tokenizer, V, engine.eos_token_ids[0]))
    m = g.matcher().masks(engine.tokenizer.encode('{"a": '))
    assert m.shape[-1] == V and not m[:, engine.model.config.vocab_size:].any() and m[0].any()


@pytest.mark.parametrize("schema,fragment", [({"type": "object", "properties": {"a": {"type": "strang"}}}, "strang"),
                                             ([1, 2], "a JSON object"),
                                             ({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, "nope")])
def test_a_schema_that_cannot_compile_is_named(engine, schema, fragment):
    with pytest.raises(GrammarError, match=fragment) as e:
        Grammar.json_schema(schema, engine, what="response_format.json_schema.schema")
    assert e.value.what == "response_format.json_schema.schema"
    assert str(e.value).startswith("response_format.json_schema.schema: ")


def test_the_tool_call_format_is_written_and_read_back(engine):
    g = Grammar.tool_calls([WEATHER, TIME], engine)
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    ids = engine.tokenizer.encode(text)
    assert g.matcher().allows(ids) == len(ids)
    c = g.matcher()
    c.accept(ids)
    assert c.masks([])[0][engine.eos_token_ids[0]]
    one = Grammar.tool_calls([WEATHER], engine, parallel=False)
    assert one.matcher().allows(ids) < len(ids)  # get_time is not among its functions
    wrong = engine.tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}')
    assert g.matcher().allows(wrong) < len(wrong)
    content, calls = tool_calls.parse("Let me look.\n" + text)
    assert content == "Let me look." and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"}), ("get_time", {"zone": "CET"})]
    assert tool_calls.parse("<tool_call>\nnot json\n</tool_call>")[1] == []
    assert tool_calls.opens_call("abc <tool") == 4 and tool_calls.opens_call("abc") == -1


@pytest.mark.parametrize("schema", [PERSON, ITEMS, CHOICE], ids=["person", "items", "choice"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_block_diffusion_output_validates_every_time(engine, schema, sampled):
    grammar = Grammar.json_schema(schema, engine)
    for i, prompt in enumerate(PROMPTS):
        kw = {"temperature": 1.0, "seed": i} if sampled else {}
        r = engine.generate(prompt, policy=GrammarPolicy(grammar), max_new_tokens=96, **kw)
        assert r.stop_reason == "eos", (prompt, r.text)
        jsonschema.validate(json.loads(r.text), schema)


def test_a_batch_shares_the_policy_and_each_row_keeps_its_own_constraint(engine, person):
    policy = GrammarPolicy(person)
    out = engine.generate(["import os\n", "class Stack:\n", "x = ["], policy=policy, max_new_tokens=64,
                          temperature=1.0, seed=2)
    for r in out:
        jsonschema.validate(json.loads(r.text), PERSON)


class Garbage(DecodingPolicy):
    """An inner rule that proposes random tokens and unmasks everything: the grammar must still hold."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def propose(self, row, block, logits, finish):
        n, V = logits.shape
        tokens = torch.tensor([self.rng.randrange(5, V) for _ in range(n)])
        return Proposal(tokens, torch.ones(n), torch.ones(n, dtype=torch.bool))


@pytest.mark.parametrize("seed", range(3))
def test_the_grammar_holds_whatever_the_inner_rule_proposes(engine, seed):
    for schema in (PERSON, CHOICE):
        grammar = Grammar.json_schema(schema, engine)
        r = engine.generate(PROMPTS[seed], policy=GrammarPolicy(grammar, inner=Garbage(seed)), max_new_tokens=96)
        jsonschema.validate(json.loads(r.text), schema)


def test_a_step_limit_that_finishes_blocks_early_still_validates(engine):
    """max_steps_per_block=2: most blocks end with a finishing step that must fill many positions at once."""
    grammar = Grammar.json_schema(ITEMS, engine)
    for prompt in PROMPTS:
        r = engine.generate(prompt, policy=GrammarPolicy(grammar), max_new_tokens=96, max_steps_per_block=2)
        jsonschema.validate(json.loads(r.text), ITEMS)


def test_a_named_tool_call_validates_its_arguments(engine):
    grammar = Grammar.tool_calls([WEATHER], engine, parallel=False)
    for prompt in PROMPTS:
        r = engine.generate(prompt, policy=GrammarPolicy(grammar), max_new_tokens=96, temperature=0.7, seed=1)
        content, calls = tool_calls.parse(r.text)
        assert content == "" and len(calls) == 1 and calls[0].name == "get_weather", r.text
        jsonschema.validate(calls[0].arguments, WEATHER["parameters"])


def test_grammar_policy_checks_its_arguments(person):
    with pytest.raises(TypeError, match="expected a Grammar"):
        GrammarPolicy(PERSON)
    with pytest.raises(TypeError, match="DecodingPolicy"):
        GrammarPolicy(person, inner="eb")


@pytest.mark.parametrize("mode", ["ar", "speculative"])
def test_every_mode_follows_the_grammar(engine, mode):
    """A Request's grammar constrains AR decoding (each token's logits masked) and speculative
    decoding (the causal choice at every drafted position masked): outputs validate, greedy and
    sampled, and speculative's greedy answer is AR's under the grammar too."""
    grammar = Grammar.json_schema(PERSON, engine)
    for prompt in PROMPTS[:2]:
        for kw in ({}, {"temperature": 0.8, "seed": 3}):
            r = engine.generate(clover_lab.Request(prompt, mode=mode, grammar=grammar, max_new_tokens=96, **kw))
            assert r.stop_reason == "eos", r
            jsonschema.validate(json.loads(r.text), PERSON)
        if mode == "speculative":
            ar = engine.generate(clover_lab.Request(prompt, mode="ar", grammar=grammar, max_new_tokens=96))
            assert engine.generate(clover_lab.Request(prompt, mode=mode, grammar=grammar,
                                                      max_new_tokens=96)).token_ids == ar.token_ids


def test_mtp_rows_follow_the_grammar_as_ar_rows(engine):
    """Mode "mtp" checks the head's drafts against the trunk's masked choice: greedy, AR's answer under
    the grammar (drafts accepted among it); sampled, a valid value."""
    grammar = Grammar.json_schema(PERSON, engine)
    ar = engine.generate(clover_lab.Request(PROMPTS[0], mode="ar", grammar=grammar, max_new_tokens=96))
    got = engine.generate(clover_lab.Request(PROMPTS[0], mode="mtp", grammar=grammar, max_new_tokens=96))
    assert got.token_ids == ar.token_ids and got.stop_reason == "eos" and sum(got.stats.accepted) > 0
    sampled = engine.generate(clover_lab.Request(PROMPTS[1], mode="mtp", grammar=grammar, max_new_tokens=96,
                                                 temperature=0.8, seed=3))
    assert sampled.stop_reason == "eos"
    jsonschema.validate(json.loads(sampled.text), PERSON)


# --------------------------------------------------------------------------- grammars that could not run
@pytest.mark.parametrize("make,fragment", [
    (lambda e: Grammar.json_schema({"$ref": "#"}, e, what="response_format"), "only an empty response"),
    (lambda e: Grammar.json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                                     for i in range(500)}}, e,
                                   what="response_format", closed=False), "limits in its first tokens"),
    (lambda e: Grammar.tool_calls([{"name": "tree", "parameters": {"$ref": "#"}}], e, what="tools"),
     "limits in its first tokens"),
    (lambda e: Grammar.json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                                     for i in range(4000)}}, e,
                                   what="response_format"), "over the 100,000"),
], ids=["self-reference", "500-optional-properties", "recursive-tool", "too-large"])
def test_a_grammar_that_compiles_but_could_not_run_is_refused_when_made(engine, make, fragment):
    """These compiled, then answered "" with "stop" or failed at a request's first tokens (a 500)."""
    with pytest.raises(GrammarError, match=fragment) as e:
        make(engine)
    assert e.value.what in ("response_format", "tools") and e.value.what in str(e.value)


def test_closed_500_optional_properties_pass_the_first_tokens_probe(engine):
    """Open, this schema trips the grammar engine's limits (above); closed by default, it runs."""
    g = Grammar.json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}},
                            engine, what="response_format")
    assert g is not None


@pytest.mark.parametrize("setting,value", [("ignore_eos", True), ("min_tokens", 3), ("logit_bias", {0: -100}),
                                           ("stop", ["}"])])
def test_a_grammar_with_a_setting_it_cannot_honour_is_refused_before_it_runs(engine, person, setting, value):
    """A grammar with ignore_eos or min_tokens failed mid-run (AR: "logits are not finite"), or
    min_tokens was silently dropped (diffusion); a ban on the token the schema requires failed
    mid-run; a stop string cut the JSON short. Each is refused by Engine.check, naming the setting."""
    from clover_lab.engine.requests import GenerationError

    for mode in ("diffusion", "ar"):
        with pytest.raises(GenerationError, match=setting) as e:
            engine.check(clover_lab.Request("x", mode=mode, max_new_tokens=8, grammar=person, **{setting: value}))
        assert e.value.field == setting and "grammar" in str(e.value)
    if setting == "logit_bias":  # a bias the grammar overrules runs, and the JSON is whole
        softer = engine.generate(clover_lab.Request(PROMPTS[0], mode="ar", max_new_tokens=40, grammar=person,
                                                    logit_bias={engine.tokenizer.encode("{")[0]: -30}))
        json.loads(softer.text)


def test_a_grammar_for_another_vocabulary_is_named(engine):
    """A Grammar made over another vocabulary failed inside the grammar engine mid-run."""
    from clover_lab.engine.requests import GenerationError

    other = Grammar.json_object(Vocabulary(engine.tokenizer, engine.model.config.vocab_size + 40,
                                           engine.eos_token_ids[0]))
    with pytest.raises(GenerationError, match="another vocabulary") as e:
        engine.check(clover_lab.Request("x", grammar=other))
    assert e.value.field == "grammar"


# ----------------------------------------------------------------------------- closed schemas, regex, EBNF, choice
def accepts(grammar: Grammar, text: str, engine) -> bool:
    """Whether ``text``'s tokens, then EOS, are all the grammar's."""
    ids = engine.tokenizer(text)["input_ids"] + [grammar.vocabulary.eos]
    return grammar.matcher().allows(ids) == len(ids)


OPEN = {"type": "object", "properties": {"city": {"type": "string"},
                                         "where": {"type": "object", "properties": {"lat": {"type": "number"}}}},
        "required": ["city"]}


def test_a_schema_silent_about_other_keys_is_closed_unless_asked_open(engine):
    closed, open_ = Grammar.json_schema(OPEN, engine), Grammar.json_schema(OPEN, engine, closed=False)
    for text in ['{"city": "Oslo", "extra": 1}', '{"city": "Oslo", "where": {"lat": 1, "lon": 2}}']:
        assert not accepts(closed, text, engine) and accepts(open_, text, engine)
    assert accepts(closed, '{"city": "Oslo", "where": {"lat": 1}}', engine)
    calls = Grammar.tool_calls([{"name": "f", "parameters": OPEN}], engine, parallel=False)
    text = '<tool_call>\n{"name": "f", "arguments": {"city": "Oslo", "x": 1}}\n</tool_call>'
    assert not accepts(calls, text, engine)
    assert accepts(Grammar.tool_calls([{"name": "f", "parameters": OPEN}], engine, parallel=False, closed=False),
                   text, engine)


def test_tool_parameters_that_refer_to_their_own_definitions_compile_and_validate(engine):
    """vLLM's responses test_function_call sends a tool whose parameters say "$ref": "#/$defs/..."
    (as pydantic writes nested models): inside the call's schema the pointer named the wrong root, and the
    grammar engine refused the tool (a 400)."""
    options = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "additionalProperties": False}
    params = {"type": "object", "properties": {"city": {"type": "string"}, "options": {"$ref": "#/$defs/Options"},
                                               "other": {"$ref": "#/definitions/Options"}},
              "required": ["city"], "$defs": {"Options": options}, "definitions": {"Options": options}}
    twin = dict(params, properties=dict(params["properties"], city={"type": "integer"}))  # same names, other schema
    g = Grammar.tool_calls([{"name": "f", "parameters": params}, {"name": "g", "parameters": twin}], engine,
                           parallel=False)
    call = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'.format
    assert accepts(g, call("f", '{"city": "Oslo", "options": {"unit": "C"}}'), engine)
    assert accepts(g, call("g", '{"city": 3, "other": {"unit": "F"}}'), engine)
    assert not accepts(g, call("f", '{"city": "Oslo", "options": {"unit": "K"}}'), engine)
    assert not accepts(g, call("f", '{"city": "Oslo", "options": {"unit": "C", "x": 1}}'), engine)


def test_close_leaves_what_the_schema_says_and_any_object_open():
    from clover_lab.grammar.grammar import close

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                               "properties": {"type": "object", "additionalProperties": True},
                                               "any": {"type": "object"}},
              "$defs": {"D": {"properties": {"x": {}}}}, "allOf": [{"properties": {"y": {}}}],
              "enum": [{"properties": {}}]}
    before = json.dumps(schema)
    out = close(schema)
    assert json.dumps(schema) == before  # not changed in place
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is True  # said: kept
    assert "additionalProperties" not in out["properties"]["any"]  # any object
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in out["allOf"][0]  # its parts' properties add up
    assert out["enum"] == [{"properties": {}}]  # a value, not a schema


def test_regex_ebnf_lark_and_choice(engine):
    assert accepts(Grammar.regex(r"[0-9]{3}-[a-z]+", engine), "123-abc", engine)
    assert not accepts(Grammar.regex(r"[0-9]{3}-[a-z]+", engine), "12-abc", engine)
    for source in ['root ::= "x = " ("1" | "2")', 'start: "x = " ("1" | "2")']:
        g = Grammar.ebnf(source, engine)
        assert accepts(g, "x = 2", engine) and not accepts(g, "x = 3", engine)
    g = Grammar.choice(["yes", "no way"], engine)
    assert accepts(g, "no way", engine) and not accepts(g, "no", engine)
    for make, bad, fragment in [(Grammar.regex, "[a-", "regex"), (Grammar.ebnf, "root ::= (", "grammar"),
                                (Grammar.choice, [], "choice")]:
        with pytest.raises(GrammarError, match=fragment):
            make(bad, engine)
