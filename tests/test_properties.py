"""Property-based tests (hypothesis) for issue 16: over sampler settings, prompts and hook actions,
valid and not, every outcome is a result without mask tokens or one of clover_lab's own errors
(CloverError), and the engine gives the same greedy tokens afterwards.

Bounded to seconds: few examples, tiny generations, derandomized so CI sees the same cases every
run (``CLOVER_HYPOTHESIS_EXAMPLES=500`` explores more locally, with fresh randomness).
"""
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clover_lab import CloverError, Engine, SamplerSettings, StopGeneration
from clover_lab.engine.requests import settings_for_mode

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]
GREEDY = dict(max_new_tokens=8, threshold=0.3)
V, MASK = 512, 511
_MORE = int(os.environ.get("CLOVER_HYPOTHESIS_EXAMPLES", "0"))


def bounded(examples: int):
    return settings(max_examples=_MORE or examples, deadline=None, derandomize=not _MORE, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


# --------------------------------------------------------------------------- strategies
odd_numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**70, 2**70),
                        st.sampled_from([True, "0.5", None, [1]]))


def setting(*typical):
    """Mostly sensible values of a setting, one time in ten anything at all (so that about half
    the requests are valid and run)."""
    return st.integers(0, 9).flatmap(lambda i: odd_numbers if i == 0 else st.sampled_from(typical))


sampler_kwargs = st.fixed_dictionaries({}, optional={
    "threshold": setting(0.05, 0.3, 0.9, 1.0),
    "temperature": setting(0.0, 0.0, 0.7, 1.5, 1e-3),
    "top_p": setting(1.0, 0.9, 0.5),
    "top_k": setting(0, 1, 5, 600),
    "confidence": st.sampled_from(["probability", "margin", "entropy", "loudness", 3]),
    "max_tokens_per_step": setting(None, 1, 3),
    "max_steps_per_block": setting(None, 1, 4),
    "repetition_penalty": setting(1.0, 1.3, 0.5, 1e4),
    "presence_penalty": setting(0.0, 0.5, -1.0, 1e4, 1e39),
    "frequency_penalty": setting(0.0, 0.3, -1e4),
    "coreset_size": setting(None, 0, 1, 2, 4, 7, 8),
    "seed": setting(None, 0, 7, 2**64 - 1, 2**64, -1),
})

prompts = st.one_of(
    st.lists(st.integers(0, V - 1), min_size=1, max_size=12),
    st.lists(st.integers(0, V - 1), min_size=1, max_size=12),
    st.lists(st.integers(-3, V + 3), max_size=12),
    st.text(alphabet="w0123456789 x<|>", max_size=16),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=8)}),
             min_size=1, max_size=2),
    st.sampled_from([None, 3, torch.tensor([[5, 17, 33]]), torch.tensor([1.5]), [[1, 2]], [[1, 2], []]]),
    st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=8), min_size=1, max_size=3),  # a batch
)

step_actions = st.one_of(
    st.tuples(st.just("veto"), st.integers(0, 40)),  # veto everything for the first n steps of a block
    st.tuples(st.just("add_all")),
    st.tuples(st.just("set_token"), st.integers(-1, 20), st.integers(-2, V + 2)),  # position index, token
    st.tuples(st.just("unmask"), st.integers(-2, 20)),  # a block position, masked or not
    st.tuples(st.just("stop"), st.integers(0, 2), st.integers(0, 3)),  # at block, step
    st.tuples(st.just("raise")),
)
route_actions = st.one_of(
    st.tuples(st.just("ban"), st.lists(st.integers(-1, 9), max_size=8)),
    st.tuples(st.just("force"), st.lists(st.integers(-1, 8), min_size=1, max_size=3),
              st.one_of(st.none(), st.none(), st.lists(st.floats(-2, 2), min_size=1, max_size=3))),
    st.tuples(st.just("assign_ids"), st.sampled_from([-1, 99, None, "x"])),
    st.tuples(st.just("scale_weights"), st.sampled_from([0.0, 0.5, 2.0, -1.0, math.inf, math.nan])),
    st.tuples(st.just("stop_in_prefill")),
)
state_actions = st.one_of(
    st.tuples(st.just("scale"), st.sampled_from([0.0, 0.5, 10.0, 1e30, math.inf, math.nan])),
    st.tuples(st.just("assign"), st.sampled_from(["none", "half", "clone", "int"])),
)
commit_actions = st.tuples(st.just("stop_after"), st.integers(0, 3))


def step_hook(action):
    kind = action[0]

    def hook(ev):
        if kind == "veto" and ev.step < action[1]:
            ev.unmask = []
        elif kind == "add_all":
            ev.add(ev.masked)
        elif kind == "set_token" and ev.masked:
            ev.set_token(ev.masked[action[1] % len(ev.masked)] if action[1] >= 0 else -1, action[2])
        elif kind == "unmask":
            ev.unmask.append(action[1])
        elif kind == "stop" and (ev.block, ev.step) == action[1:]:
            ev.stop()
        elif kind == "raise":
            raise RuntimeError("a hook failed")
    return hook


def route_hook(action):
    kind = action[0]

    def hook(ev):
        if kind == "ban":
            ev.ban(action[1])
        elif kind == "force":
            ev.force(action[1], weights=action[2])
        elif kind == "assign_ids":
            ev.expert_ids = action[1]
        elif kind == "scale_weights":
            ev.weights.mul_(action[1])
        elif kind == "stop_in_prefill" and ev.phase == "prefill":
            raise StopGeneration
    return hook


def state_hook(action):
    kind, arg = action

    def hook(ev):
        if kind == "scale":
            ev.state.mul_(arg)
        elif arg == "none":
            ev.state = None
        elif arg == "half":
            ev.state = ev.state[:, : max(1, ev.state.shape[1] // 2)]
        elif arg == "clone":
            ev.state = ev.state.clone()
        else:
            ev.state = ev.state.long()
    return hook


hook_plans = st.fixed_dictionaries({}, optional={
    "denoise.step": step_actions, "layers.*.moe.route": route_actions, "layers.*.gdn.state": state_actions,
    "block.commit": commit_actions,
})


def build_hooks(plan: dict) -> dict:
    makers = {"denoise.step": step_hook, "layers.*.moe.route": route_hook, "layers.*.gdn.state": state_hook}
    hooks = {point: makers[point](action) for point, action in plan.items() if point in makers}
    if "block.commit" in plan:
        after = plan["block.commit"][1]
        hooks["block.commit"] = lambda ev: ev.stop() if ev.block >= after else None
    return hooks


# --------------------------------------------------------------------------- the properties
@pytest.fixture(scope="module")
def engine_and_base(gen_model, gen_tokenizer):
    engine = Engine(gen_model, gen_tokenizer)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests run (gen_one_thread): the same sums in the same order
    try:
        return engine, engine.generate(PROMPT, **GREEDY).token_ids
    finally:
        torch.set_num_threads(before)


def check_outcome(engine, base, run) -> None:
    """``run()`` gives a result (a batch: one per row) without mask tokens, or raises a CloverError; the engine's greedy
    tokens are unchanged afterwards and no hook is left behind."""
    try:
        result = run()
    except CloverError:
        pass
    else:
        for one in result if isinstance(result, list) else [result]:  # a batch: every row's result
            assert MASK not in one.token_ids and all(0 <= t < V for t in one.token_ids)
            assert one.stop_reason in ("length", "eos", "stop_string", "hook")
            assert one.stats.new_tokens == len(one.token_ids)
    assert not engine.model.hooks.attached()
    assert engine.generate(PROMPT, **GREEDY).token_ids == base


@bounded(300)
@given(sampler_kwargs)
def test_sampler_settings_are_valid_or_a_settings_error(kwargs):
    try:
        s = SamplerSettings(**kwargs)
    except CloverError as e:
        assert any(name in str(e) for name in kwargs)
    else:
        s.validate()


@bounded(30)
@given(prompt=prompts, kwargs=sampler_kwargs, mode=st.sampled_from(["diffusion", "diffusion", "ar", "beam"]),
       max_new=st.integers(0, 19).flatmap(lambda i: st.sampled_from([-1, 0, "4", 2.0]) if i == 0
                                          else st.integers(1, 10)))
def test_requests_end_in_a_result_or_a_clover_error(engine_and_base, prompt, kwargs, mode, max_new):
    engine, base = engine_and_base
    check_outcome(engine, base, lambda: engine.generate(prompt, mode=mode, max_new_tokens=max_new, **kwargs))


@bounded(30)
@given(plan=hook_plans, mode=st.sampled_from(["diffusion", "diffusion", "ar"]),
       threshold=st.sampled_from([0.3, 0.9]), coreset=st.sampled_from([None, 2, 4]), stop=st.booleans())
def test_hook_actions_end_in_a_result_or_a_clover_error(engine_and_base, plan, mode, threshold, coreset, stop):
    engine, base = engine_and_base
    extra = {"stop": ["w1"]} if stop else {}

    def run():
        with engine.hooks(build_hooks(plan)):
            return engine.generate(PROMPT, mode=mode, max_new_tokens=10, **extra,  # AR reads neither setting
                                   **settings_for_mode(mode, dict(threshold=threshold, coreset_size=coreset)))

    check_outcome(engine, base, run)


# --------------------------------------------------------------------------- issue 41: hooks in the newer modes
NEWER_MODES = [dict(mode="speculative"), dict(mode="speculative", draft_passes=2),
               dict(policy="lookahead:start=0.0,threshold=0.5"), dict(policy="eb:gamma=0.5"),
               dict(policy="topk:k=1/2"), dict(logprobs=2), dict(min_p=0.5, temperature=0.7, seed=3)]


@bounded(30)
@given(plan=hook_plans, how=st.sampled_from(NEWER_MODES), batch=st.booleans(), stop=st.booleans())
def test_hook_actions_in_the_newer_modes_end_in_a_result_or_a_clover_error(engine_and_base, plan, how, batch, stop):
    """The hook actions above in speculative mode, under look-ahead and other policies, with
    log-probabilities and min-p sampling, one prompt or a batch."""
    engine, base = engine_and_base
    extra = {"stop": ["w1"]} if stop else {}

    def run():
        with engine.hooks(build_hooks(plan)):
            return engine.generate([PROMPT, PROMPT[:4]] if batch else PROMPT, max_new_tokens=10, **extra,
                                   **settings_for_mode(how.get("mode", "diffusion"), dict(threshold=0.3, **how)))

    check_outcome(engine, base, run)


# --------------------------------------------------------------------------- issue 29: corpora and sites
corpus_items = st.one_of(
    st.lists(st.integers(-2, V + 2), max_size=6), st.sampled_from(["w1 w2 w3", "", "a.py", "docs/", ".", "w4"]),
    st.sampled_from([None, 3, 2.5, b"bytes", {"a": 1}]), st.builds(lambda n: torch.arange(n), st.integers(0, 5)),
    st.sampled_from(["<here>", "<nowhere>"]))
corpora = st.one_of(corpus_items, st.lists(corpus_items, max_size=4))


def _paths(data, here):
    """Stand-ins "<here>" / "<nowhere>" as Paths to an existing text file and to nothing."""
    if isinstance(data, list):
        return [_paths(d, here) for d in data]
    return {"<here>": here, "<nowhere>": here.parent / "nowhere.txt"}.get(data, data) if isinstance(data, str) else data


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("corpus") / "a.txt"
    f.write_text("w1 w2 w3 w4 w5")
    return f


@bounded(40)
@given(data=corpora)
def test_a_corpus_gives_statistics_of_real_tokens_or_a_clover_error(engine_and_base, corpus_file, data):
    from clover_lab.lens.routing_stats import route_stats

    engine, _ = engine_and_base
    try:
        stats = route_stats(engine, _paths(data, corpus_file), seq_len=32)
    except CloverError:
        return
    assert stats.tokens > 0 and (stats.counts.sum(1) == stats.tokens * engine.model.config.num_experts_per_tok).all()


@bounded(20)
@given(block=st.sampled_from([None, 0, 1, 5, -1]), step=st.sampled_from([None, 0, 1, 40]),
       positions=st.sampled_from([None, (11,), (10, 12), (3000,), (), 5]))
def test_a_patch_site_is_applied_or_refused_never_a_silent_no_effect(engine_and_base, block, step, positions):
    from clover_lab import patching

    engine, base = engine_and_base
    source = patching.record(engine, PROMPT, points="layers.1.output", max_new_tokens=20, threshold=0.3)

    def run():
        site = patching.Site("layers.1.output", block, step, positions=positions)
        return patching.patch(engine, PROMPT, source, [site], max_new_tokens=20, threshold=0.3)

    try:
        patched = run()
    except CloverError:
        return
    assert patched.applied  # run B is run A until the site: it is reached, and patched
    assert engine.generate(PROMPT, **GREEDY).token_ids == base
