"""The prefix cache (model/prefix_cache.py): a prompt sharing a cached prefix runs only its new
positions through the model (counted by a forward pre-hook on the first decoder layer) and gives
the tokens it gives without the cache, in every mode that prefills; LRU under a byte budget;
a request can opt out; a prefill hook sees how many positions came from the cache; an error
leaves nothing half-inserted."""
import itertools

import pytest
import torch

import clover_lab
from clover_lab import Request
from clover_lab.engine.requests import GenerationError


@pytest.fixture
def engine(tiny_engine):
    """An engine over the shared tiny model, the positions each forward pushes through its first
    decoder layer counted (a forward pre-hook)."""
    e = tiny_engine
    e.positions = []
    handle = e.model.model.layers[0].register_forward_pre_hook(
        lambda m, a: e.positions.append(a[0].shape[0] * a[0].shape[1]))
    yield e
    handle.remove()


@pytest.fixture(scope="module")
def stdlib():
    """The embedded model (it has an MTP head)."""
    return clover_lab.load(dtype=torch.float32)


@pytest.fixture
def cache(engine):
    return engine.prefix_cache


def run(engine, request):
    """The request's result and the positions its forwards pushed."""
    engine.positions.clear()
    out = engine.generate(request)
    return out, sum(engine.positions)


def words(n: int, seed: int) -> list[int]:
    """``n`` token ids of the tiny model's vocabulary, drawn with ``seed`` (never its EOS or mask)."""
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prompt(shared: list[int], seed: int, n: int = 40) -> list[int]:
    return shared + words(n, seed)


def same_tokens_from_the_cache(engine, cache, mode: str, prefix: list[int], new: int) -> None:
    """A prompt of ``prefix`` and more, whose prefix is cached (a request of the prefix alone put
    it there): its prefix's whole blocks come from the cache, only its other positions run, and
    it gives the tokens it gives with the cache off."""
    ids = prefix + words(23, 1)
    cache.budget = 0  # off: the reference
    off, pushed_off = run(engine, Request(ids, mode=mode, max_new_tokens=new))
    cache.budget = 1 << 30
    engine.generate(Request(prefix, mode=mode, max_new_tokens=1))  # the prefix into the cache
    on, pushed_on = run(engine, Request(ids, mode=mode, max_new_tokens=new))
    whole = len(prefix) // 16 * 16
    assert on.token_ids == off.token_ids and on.stop_reason == off.stop_reason
    assert on.stats.cached_positions == whole  # the prefix's whole blocks
    assert pushed_on == pushed_off - whole  # only the new positions ran


@pytest.mark.parametrize("mode", ["diffusion", "ar", "speculative"])
def test_a_prompt_sharing_a_cached_prefix_runs_only_its_new_positions_and_gives_the_same_tokens(engine, cache, mode):
    same_tokens_from_the_cache(engine, cache, mode, words(95, 0), 8)  # 5 whole blocks of 16 and 15 positions


def test_the_static_steps_start_after_the_cached_prefix_too(engine, cache):
    """On the fast path's static steps (eager static steps on a CPU), a row beside another, both
    from the cache."""
    engine.step_graphs = True
    same_tokens_from_the_cache(engine, cache, "diffusion", words(95, 0), 8)
    alone = engine.generate(Request(words(95, 0) + words(9, 2), max_new_tokens=8, skip_reading_prefix_cache=True))
    rows = [engine.submit(Request(words(95, 0) + words(n, 2), max_new_tokens=8), emit=False) for n in (9, 23)]
    while not all(h.done for h in rows):  # (both share alone's 104 first tokens: its 6 whole blocks were added)
        engine.step()
    assert [h.result.stats.cached_positions for h in rows] == [96, 96] and rows[0].result.token_ids == alone.token_ids
    assert "static" in rows[0].result.stats.path


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_a_prompt_sharing_a_1024_token_cached_prefix_runs_only_its_new_positions(stdlib, mode):
    """On the embedded model, a prefix of 1,024 tokens of code."""
    code = "def parse(line):\n    return [int(x) for x in line.split(',')]\n\n"
    prefix = stdlib.encode(code * 80)[:1024]
    assert len(prefix) == 1024
    stdlib.positions = []
    handle = stdlib.model.model.layers[0].register_forward_pre_hook(
        lambda m, a: stdlib.positions.append(a[0].shape[0] * a[0].shape[1]))
    try:
        same_tokens_from_the_cache(stdlib, stdlib.prefix_cache, mode, prefix, 16)
    finally:
        handle.remove()


@pytest.mark.parametrize("mode,length", [("diffusion", 64), ("ar", 70)])
def test_rows_of_one_prompt_run_it_once(engine, cache, mode, length):
    """A request of n rows of one prompt: the first row's prefill adds it, the others start from
    it (a block-diffusion row needs no logits of its prompt: a prompt of whole blocks comes whole)."""
    ids = words(length, 4)
    cache.budget = 0
    off, pushed_off = run(engine, Request(ids, mode=mode, n=3, max_new_tokens=4))
    cache.budget = 1 << 30
    on, pushed = run(engine, Request(ids, mode=mode, n=3, max_new_tokens=4))
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert [r.stats.cached_positions for r in on] == [0, 64, 64] and pushed == pushed_off - 128


def test_a_second_prompt_leaving_the_cached_chain_leaves_a_snapshot_where_it_left(engine, cache):
    """Prompts sharing a system prompt and differing after it: the first that leaves the cached
    chain at a block with no GDN snapshot runs whole and keeps one there; the next ones start there."""
    shared = words(40, 0)  # 2 whole blocks and 8 positions in common
    a, b, c = (prompt(shared, seed) for seed in (1, 2, 3))
    cache.budget = 0
    alone, pushed_alone = run(engine, Request(c, max_new_tokens=8))  # the reference: no cache
    cache.budget = 1 << 30
    engine.generate(Request(a, max_new_tokens=2))
    first, _ = run(engine, Request(b, max_new_tokens=2))
    assert first.stats.cached_positions == 0 and cache.snapshots() == 3  # a's end, b's end, the branch point
    hit, pushed = run(engine, Request(c, max_new_tokens=8))
    assert hit.stats.cached_positions == 32 and hit.token_ids == alone.token_ids
    assert pushed == pushed_alone - 32


def test_scored_prompts_run_whole_and_a_request_can_opt_out(engine, cache):
    prefix = words(95, 0)
    ids = prefix + words(10, 1)
    engine.generate(Request(prefix, max_new_tokens=1))
    for request in (Request(ids, max_new_tokens=2, skip_reading_prefix_cache=True),
                    Request(ids, max_new_tokens=0, prompt_logprobs=0)):
        out, _ = run(engine, request)
        ran = list(itertools.accumulate(engine.positions))
        assert out.stats.cached_positions == 0 and len(ids) in ran, request  # the prompt ran whole
    for request, why in ((Request(ids, prompt_logprobs=1, skip_reading_prefix_cache=False), "prompt_logprobs"),
                         (Request(ids, skip_reading_prefix_cache=1), "True, False or None")):
        with pytest.raises(GenerationError, match=why) as e:
            engine.generate(request)
        assert e.value.field == "skip_reading_prefix_cache"


@pytest.mark.slow
def test_mtp_rows_run_their_whole_prompt(stdlib):
    """An mtp row's head reads the trunk states of its whole prompt: it never starts from the cache."""
    prefix = stdlib.encode("import os\n" * 40)
    ids = prefix + stdlib.encode("import sys\n")
    stdlib.generate(Request(prefix, max_new_tokens=2))
    assert stdlib.prefix_cache.lookup(stdlib.model, ids, read=True, write=False).cached
    out = stdlib.generate(Request(ids, mode="mtp", max_new_tokens=4))
    assert out.stats.cached_positions == 0 and out.stats.prefill_forwards == 1
    with pytest.raises(GenerationError, match="mtp") as e:
        stdlib.generate(Request(ids, mode="mtp", skip_reading_prefix_cache=False))
    assert e.value.field == "skip_reading_prefix_cache"


def test_a_prefill_hook_sees_how_many_positions_came_from_the_cache(engine, cache):
    """A request with a hook inside the model sees real forwards: by default it runs its whole
    prompt (and adds nothing: its hooks may change the states); asking for the cache, its prefill
    events hold only the positions that ran, and ``where.cached`` says how many came before."""
    prefix = words(95, 0)
    ids = prefix + words(10, 1)
    engine.generate(Request(prefix, max_new_tokens=1))
    seen = []

    def hook(ev):
        if ev.where.phase == "prefill":
            seen.append((ev.where.cached, ev.positions.reshape(-1).tolist()))

    blocks = len(cache)
    with engine.hooks({"layers.0.input": hook}):
        whole = engine.generate(Request(ids, max_new_tokens=4))
        assert [c for c, _ in seen] == [0] and seen[0][1] == list(range(len(ids)))
        assert whole.stats.cached_positions == 0 and len(cache) == blocks
        seen.clear()
        part = engine.generate(Request(ids, max_new_tokens=4, skip_reading_prefix_cache=False))
    assert part.stats.cached_positions == 80 and part.token_ids == whole.token_ids
    assert {c for c, _ in seen} == {80} and [p for _, ps in seen for p in ps] == list(range(80, len(ids)))


def test_least_recently_used_prompts_leave_first_within_the_budget(engine, cache):
    prompts = [words(60, seed) for seed in range(3)]  # no block in common
    engine.generate(Request(prompts[0], max_new_tokens=1))
    one = cache.nbytes
    assert one > 0 and len(cache) == 60 // 16
    cache.budget = int(2.5 * one)  # room for two prompts' blocks and snapshots
    engine.generate(Request(prompts[1], max_new_tokens=1))
    assert run(engine, Request(prompts[0] + [5], max_new_tokens=1))[0].stats.cached_positions  # prompt 0: used again
    engine.generate(Request(prompts[2], max_new_tokens=1))  # prompt 1 (least recently used) makes room
    assert cache.nbytes <= cache.budget and cache.evictions
    hits = [cache.lookup(engine.model, p + [5], read=True, write=False) for p in prompts]  # (a lookup adds nothing)
    assert hits[0] and hits[0].cached == hits[2].cached == 48 and hits[1] is None
    cache.budget = one // 2  # smaller than a prompt: the rest leaves, and a new prompt is not added
    assert cache.nbytes <= one // 2
    engine.generate(Request(prompts[1], max_new_tokens=1))
    assert cache.nbytes <= one // 2
    cache.budget = 0  # off: empty, and nothing is added
    engine.generate(Request(prompts[1], max_new_tokens=1))
    assert cache.nbytes == 0 and len(cache) == 0
    with pytest.raises(ValueError, match="prefix_cache.budget"):
        cache.budget = -1


def test_an_error_during_the_prefill_adds_nothing_and_the_engine_goes_on(engine, cache, monkeypatch):
    ids = words(70, 0)
    from clover_lab.engine import runner

    real = runner.Runner.prefill_part

    def fails(self, row, start, part, *args):
        if start + len(part) == len(ids):  # the last part: after the snapshot at the whole blocks' end
            raise RuntimeError("injected")
        return real(self, row, start, part, *args)

    monkeypatch.setattr(runner.Runner, "prefill_part", fails)
    with pytest.raises(Exception, match="injected"):
        engine.generate(Request(ids, max_new_tokens=2))
    assert len(cache) == 0 and cache.nbytes == 0 and cache.snapshots() == 0
    monkeypatch.undo()
    out = engine.generate(Request(ids, max_new_tokens=2))
    assert out.stats.cached_positions == 0 and len(cache) == 70 // 16


def test_weights_changed_in_place_empty_the_cache(engine, cache):
    ids = words(70, 0)
    engine.generate(Request(ids, max_new_tokens=1))
    assert engine.prefix_cache.lookup(engine.model, ids, read=True, write=False).cached == 64
    with torch.no_grad():
        engine.model.model.norm.weight.mul_(1.0)  # the same values, a new version: the cache cannot tell
    out = engine.generate(Request(ids, max_new_tokens=1))
    assert out.stats.cached_positions == 0


@pytest.mark.slow
def test_a_long_prompt_prefilled_a_chunk_a_step_starts_after_its_cached_prefix(engine, cache):
    prefix = words(95, 0)
    ids = prefix + words(40, 1)
    cache.budget = 0
    alone = engine.generate(Request(ids, max_new_tokens=16))
    cache.budget = 1 << 30
    engine.generate(Request(prefix, max_new_tokens=1))
    engine.loop.prefill_budget = 16
    other = engine.submit(Request(words(10, 2), max_new_tokens=48), emit=False)
    engine.step()
    long = engine.submit(Request(ids, max_new_tokens=16), emit=False)
    while not (other.done and long.done):
        engine.step()
    assert long.result.stats.cached_positions == 80 and long.result.token_ids == alone.token_ids
