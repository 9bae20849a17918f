"""The engine as a scheduler of rows (engine/step_loop.py): requests with their own settings share
forwards, join at any step, leave on their own and can be cancelled; each row gives the tokens
it gives alone (greedy, and sampled with a seed), on the eager forward and on the static steps."""
import sys
import threading
from pathlib import Path

import pytest
import torch

import clover_lab
from clover_lab import Request
from clover_lab.engine.requests import GenerationError
from clover_lab.engine.runner import Runner
from clover_lab.engine.sampling import SettingsError

PROMPTS = ["def parse(line):\n", "import os\n", "class Stack:\n    def push(self, x):\n", "import os\nimport sys\n",
           "# read\n"]
STOP = "\n\n"


@pytest.fixture(scope="module")
def engine():
    return clover_lab.load(dtype=torch.float32)


def mixed(engine):
    """Five requests that differ in everything a request sets."""
    return [Request(PROMPTS[0], max_new_tokens=40, temperature=0.8, seed=7),
            Request(PROMPTS[1], mode="ar", max_new_tokens=24),
            Request(PROMPTS[2], max_new_tokens=40, policy="topk:k=2"),
            Request(PROMPTS[3], max_new_tokens=48, stop=STOP),
            Request(PROMPTS[4], mode="speculative", max_new_tokens=40)]


def run_all(engine, handles) -> None:
    for _ in range(10_000):
        if all(h.done for h in handles):
            return
        engine.step()
    raise AssertionError("the requests did not end")


@pytest.mark.parametrize("path", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
def test_a_mixed_batch_gives_each_row_its_alone_tokens_in_fewer_forwards(engine, path):
    alone = [engine.generate(r) for r in mixed(engine)]
    assert alone[3].stop_reason in ("stop_string", "length")
    engine.compile_steps = path == "compiled"
    try:
        before = engine.loop.forwards
        handles = [engine.submit(r, emit=False) for r in mixed(engine)]
        run_all(engine, handles)
        shared = engine.loop.forwards - before
    finally:
        engine.compile_steps = False
    for h, a in zip(handles, alone):
        assert h.error is None and h.result.token_ids == a.token_ids, h
        assert h.result.stop_reason == a.stop_reason
    assert shared < sum(a.stats.forwards for a in alone)
    if path == "compiled":
        assert any("compiled" in (h.result.stats.path or "") for h in handles)


@pytest.mark.parametrize("static", [False, True])
def test_rows_join_at_any_step_and_give_their_own_tokens(engine, static):
    alone = [engine.generate(p, max_new_tokens=40).token_ids for p in PROMPTS]
    engine.step_graphs = static
    try:
        handles = [engine.submit(Request(PROMPTS[0], max_new_tokens=40))]
        joins = {1: [1], 3: [2, 3], 7: [4]}  # step -> prompts submitted before it
        stepped = []
        for k in range(10_000):
            for p in joins.get(k, []):
                handles.append(engine.submit(Request(PROMPTS[p], max_new_tokens=40)))
            if k > max(joins) and all(h.done for h in handles):
                break
            stepped += engine.step()
    finally:
        engine.step_graphs = None
    assert [h.result.token_ids for h in handles] == alone
    commits = [u for u in handles[4].updates() if u.kind == "commit"]
    assert [u.block for u in commits] == list(range(len(commits)))  # a late row counts its own blocks
    assert [u for u in stepped if u.kind == "commit" and u.committed == commits[-1].committed]  # step() returns them


def steps_to_end(engine, handles, watch) -> tuple[int, list[int]]:
    """Steps until ``watch`` is done (the others go on), and the forwards of each step until all are."""
    at, per_step = None, []
    for k in range(1, 10_000):
        before = engine.loop.forwards
        engine.step()
        per_step.append(engine.loop.forwards - before)
        if at is None and watch.done:
            at = k
        if all(h.done for h in handles):
            return at, per_step
    raise AssertionError("the requests did not end")


def test_first_done_first_out_a_fast_request_does_not_wait_for_a_slower_one(engine):
    """No waves: a 32-token request beside a 64-token one ends within 1.15x the steps it takes
    alone; a row whose block is done commits it in its next forward, packed beside the other row's
    preview (one forward per step but where a row ends: its last block's commit); each row gives
    its alone tokens."""
    fast, slow = Request(PROMPTS[0], max_new_tokens=32), Request(PROMPTS[1], max_new_tokens=64)
    alone = [engine.generate(r) for r in (fast, slow)]
    h = engine.submit(fast)
    alone_steps, _ = steps_to_end(engine, [h], h)
    handles = [engine.submit(fast), engine.submit(slow)]
    steps, per_step = steps_to_end(engine, handles, handles[0])
    assert [x.result.token_ids for x in handles] == [a.token_ids for a in alone]
    assert steps <= 1.15 * alone_steps, (steps, alone_steps)
    assert max(per_step) <= 2 and sum(n == 2 for n in per_step) <= 2, per_step  # each row's last commit
    assert handles[0].result.stats.fused_forwards >= 1 and handles[1].result.stats.fused_forwards >= 1


def test_a_row_that_arrives_begins_its_block_in_the_running_forward(engine):
    """A diffusion row that arrives mid-block begins its first block at once: its preview shares
    the forward of the rows going on (one forward per step), and every row gives its alone tokens."""
    one = dict(max_new_tokens=32, max_tokens_per_step=1)  # a block of 16 takes 16 steps
    alone = [engine.generate(p, **one).token_ids for p in PROMPTS[:2]]
    first = engine.submit(Request(PROMPTS[0], **one))
    for _ in range(5):
        engine.step()
    late = engine.submit(Request(PROMPTS[1], **one))
    before = engine.loop.forwards
    engine.step()
    row = next(r for r in engine.loop.rows if r.handle is late)
    assert row.block is not None and row.block.step == 1 and engine.loop.forwards - before == 1
    run_all(engine, [first, late])
    assert [h.result.token_ids for h in (first, late)] == alone


def test_a_longer_row_joining_grows_the_cache(engine):
    want = [engine.generate(PROMPTS[0], max_new_tokens=16).token_ids, engine.generate(PROMPTS[1],
                                                                                      max_new_tokens=300).token_ids]
    short = engine.submit(Request(PROMPTS[0], max_new_tokens=16))
    engine.step()
    length = engine.loop.runner.cache.max_len
    long = engine.submit(Request(PROMPTS[1], max_new_tokens=300))  # more positions than the cache has
    run_all(engine, [short, long])
    assert length < 300 and [short.result.token_ids, long.result.token_ids] == want


def test_cancel_ends_that_row_only_with_its_partial_result(engine):
    alone = [engine.generate(p, max_new_tokens=64).token_ids for p in PROMPTS[:3]]
    handles = [engine.submit(Request(p, max_new_tokens=64)) for p in PROMPTS[:3]]
    queued = engine.submit(Request(PROMPTS[3], max_new_tokens=64))
    queued.cancel()  # still queued: it ends with no tokens
    while not any(u.kind == "commit" for u in handles[1].updates()):  # a block of it is final
        engine.step()
    threading.Thread(target=handles[1].cancel).start()  # from another thread
    run_all(engine, handles + [queued])
    assert [handles[0].result.token_ids, handles[2].result.token_ids] == [alone[0], alone[2]]
    cut = handles[1].result
    assert cut.stop_reason == "cancelled" and 0 < len(cut.token_ids) < len(alone[1])
    assert cut.token_ids == alone[1][:len(cut.token_ids)]
    assert queued.result.stop_reason == "cancelled" and queued.result.token_ids == []
    assert not engine.loop.busy and engine.loop.runner is None  # the cache went with the last row


def test_an_abandoned_stream_is_cancelled(engine):
    stream = engine.stream(PROMPTS[0], max_new_tokens=64)
    next(stream)
    stream.close()
    assert not engine.loop.busy
    engine.step()
    assert engine.loop.runner is None


def test_n_rows_of_one_request_take_seed_plus_i(engine):
    want = [engine.generate(PROMPTS[0], max_new_tokens=24, temperature=0.8, seed=5 + i).token_ids for i in range(3)]
    out = engine.generate(Request(PROMPTS[0], max_new_tokens=24, temperature=0.8, seed=5, n=3))
    assert [r.token_ids for r in out] == want and out.stats.rows == 3
    greedy = engine.generate(Request(PROMPTS[1], max_new_tokens=16, n=2))
    assert greedy[0].token_ids == greedy[1].token_ids


def test_the_request_check_names_the_field(engine):
    cases = [(Request("x", mode="fast"), "mode"), (Request("x", n=0), "n"), (Request("x", max_new_tokens=0),
                                                                             "max_new_tokens"),
             (Request("x", stop=[""]), "stop"), (Request("x", block_size=-1), "block_size"),
             (Request("x", coreset_size=1), "coreset_size"),
             (Request("x", max_new_tokens=10**9), "max_new_tokens"), (Request([1, 10**9]), "prompt")]
    for request, field in cases:
        with pytest.raises(GenerationError) as e:
            engine.check(request)
        assert e.value.field == field, (request, e.value)
    for request, field in [(Request("x", temperature=-1), "temperature"), (Request("x", policy="nope"), "policy")]:
        with pytest.raises(SettingsError) as e:  # a setting's own error, naming the field too
            engine.check(request)
        assert e.value.field == field
    with pytest.raises(TypeError, match="Request carries its own settings"):
        engine.generate(Request("x"), max_new_tokens=3)


def test_one_diffusion_generate_passes_through_at_most_nine_engine_files(engine):
    """The flow is submit -> step -> runner -> decoders -> updates; the rest of engine/ (the fast
    path, faults, speculative decoding, ...) is entered only where it applies."""
    root = str(Path(clover_lab.engine.__file__).parent)
    seen = set()

    def calls(frame, event, arg):
        if frame.f_code.co_filename.startswith(root):
            seen.add(Path(frame.f_code.co_filename).name)

    engine.generate(PROMPTS[0], max_new_tokens=8)  # imports done
    sys.setprofile(calls)
    try:
        engine.generate(PROMPTS[0], max_new_tokens=40)
    finally:
        sys.setprofile(None)
    assert "step_loop.py" in seen and "diffusion.py" in seen and len(seen) <= 9, sorted(seen)


@pytest.mark.parametrize("mode", ["diffusion", "ar", "speculative"])
def test_min_tokens_and_ignore_eos(engine, mode):
    eos = engine.eos_token_ids[0]
    pushed = {"logit_bias": {eos: 100}, "max_new_tokens": 24, "mode": mode}  # EOS all but forced
    first = engine.generate(Request(PROMPTS[0], **pushed))
    assert first.stop_reason == "eos" and len(first.token_ids) == 1
    late = engine.generate(Request(PROMPTS[0], min_tokens=6, **pushed))
    assert late.stop_reason == "eos" and len(late.token_ids) == 7 and eos not in late.token_ids[:6]
    on = engine.generate(Request(PROMPTS[0], ignore_eos=True, **pushed))
    assert on.stop_reason == "length" and len(on.token_ids) == 24 and eos in on.token_ids


def test_prompt_logprobs_score_the_prompt_as_ar_scores_its_tokens(engine):
    ids = engine.encode(PROMPTS[2] + "        self.items.append(x)\n")
    scored = engine.generate(Request(ids, max_new_tokens=0, prompt_logprobs=3))
    assert scored.token_ids == [] and scored.stop_reason == "length"
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(ids)
    agreed = 0
    for k in range(1, len(ids)):  # where AR's greedy token is the prompt's next one, its log-probability is the score
        ar = engine.generate(Request(ids[:k], mode="ar", max_new_tokens=1, logprobs=3))
        top = scored.prompt_top_logprobs[k]
        assert [t for t, _ in top] == [t for t, _ in ar.top_logprobs[0]]
        if ar.token_ids == [ids[k]]:
            agreed += 1
            assert abs(ar.logprobs[0] - scored.prompt_logprobs[k]) < 1e-4
    assert agreed
    with pytest.raises(GenerationError) as e:
        engine.check(Request(ids, max_new_tokens=0))
    assert e.value.field == "max_new_tokens"


def test_streamed_updates_carry_the_committed_tokens_logprobs(engine):
    updates = [u for u in engine.stream(Request(PROMPTS[1], mode="ar", max_new_tokens=6, logprobs=2))
               if u.kind == "commit"]
    assert [len(u.logprobs) for u in updates] == [1, 2, 3, 4, 5, 6]
    assert updates[-1].logprobs == updates[-1].logprobs[:6] and len(updates[-1].top_logprobs[0]) >= 2


# --------------------------------------------------------------------------- errors inside a step
class Refused(Exception):
    pass


def test_a_listeners_error_ends_its_own_request_and_no_other(engine):
    """A listener raising on a commit failed every request that only shared its forward."""
    alone = engine.generate(PROMPTS[1], max_new_tokens=8).token_ids

    def refuse(update):
        if update.kind == "commit":
            raise Refused("the listener refused a commit")

    bad = engine.submit(Request(PROMPTS[0], max_new_tokens=8), listener=refuse)
    good = engine.submit(Request(PROMPTS[1], max_new_tokens=8))
    run_all(engine, [bad, good])
    assert isinstance(bad.error, Refused) and good.error is None and good.result.token_ids == alone
    assert engine.loop.idle and engine.loop.runner is None  # the failed request's rows left too


@pytest.mark.parametrize("case", ["cancelled", "scored"])
def test_a_listener_raising_on_done_does_not_escape_the_step(engine, case):
    """A listener raising on the "done" of a cancelled request or of a prompt-only scoring escaped
    engine.step(): the handle never ended and its row stayed in the loop."""
    def refuse(update):
        if update.kind == "done":
            raise Refused("the listener refused done")

    request = (Request(PROMPTS[0], max_new_tokens=8) if case == "cancelled"
               else Request(PROMPTS[0], max_new_tokens=0, prompt_logprobs=0))
    handle = engine.submit(request, listener=refuse)
    if case == "cancelled":
        engine.step()
        handle.cancel()
    run_all(engine, [handle])  # engine.step() raised here before
    assert isinstance(handle.error, Refused) and engine.loop.idle
    with pytest.raises(Refused):
        engine.wait(handle)


def test_a_request_submitted_from_a_listener_or_hook_runs_on_the_engines_loop(engine):
    """It went on a private loop that engine.step() never ran: its handle never ended."""
    want = engine.generate(PROMPTS[1], max_new_tokens=8).token_ids
    later = []

    def listener(update):
        if update.kind == "commit" and not later:
            later.append(engine.submit(Request(PROMPTS[1], max_new_tokens=8)))

    first = engine.submit(Request(PROMPTS[0], max_new_tokens=8), listener=listener)
    hooked = []

    def hook(event):
        if not hooked:
            hooked.append(engine.submit(Request(PROMPTS[1], max_new_tokens=8)))

    handle = engine.add_hook("block.commit", hook)
    try:
        run_all(engine, [first])
    finally:
        handle.remove()
    later += hooked
    run_all(engine, later)
    assert len(later) == 2 and [h.result.token_ids for h in later] == [want, want]
    assert all(h.loop is engine.loop for h in later)


@pytest.mark.slow  # 3 s: two hook points, two requests each
def test_a_hooks_error_on_one_row_ends_that_request_only(engine):
    """Rows sharing a forward share their hooks; a hook raising for one request failed them all."""
    from clover_lab.hooks.registry import HookError

    alone = engine.generate(PROMPTS[1], max_new_tokens=8).token_ids
    bad = good = None

    def hook(event):
        if event.where.run == bad.number:
            raise Refused("not this request")

    for point in ("block.commit", "denoise.step"):
        handle = engine.add_hook(point, hook)
        try:
            bad = engine.submit(Request(PROMPTS[0], max_new_tokens=8))
            good = engine.submit(Request(PROMPTS[1], max_new_tokens=8))
            run_all(engine, [bad, good])
        finally:
            handle.remove()
        assert isinstance(bad.error, HookError) and point in str(bad.error), point
        assert good.error is None and good.result.token_ids == alone, point
        assert engine.loop.idle


@pytest.mark.parametrize("rows", [1, pytest.param(8, marks=pytest.mark.slow), pytest.param(32, marks=pytest.mark.slow)])
def test_a_step_reads_every_rows_decision_in_one_host_transfer(engine, rows):
    """The rows' policies and samplers decide on the device and the host reads all their decisions
    at once, diffusion rows' and AR rows' together: one tensor-to-host read per step from the
    engine at 1, 8 and 32 rows (the model's range check of token ids reads only ids on the CPU,
    none on an accelerator); the last step, which only commits the rows' last blocks, reads none."""
    from clover_kernels.launches import HostReads

    handles = [engine.submit(Request(PROMPTS[i % len(PROMPTS)], max_new_tokens=12, seed=i, temperature=0.7,
                                     mode="ar" if i % 3 == 1 else "diffusion"))
               for i in range(rows)]
    per_step = []
    while not all(h.done for h in handles):
        with HostReads() as reads:
            engine.step()
        per_step.append([w for w in reads.where if w.startswith("engine/")])
    assert len(per_step) > 2 and all(len(w) == 1 for w in per_step[:-1]) and len(per_step[-1]) <= 1, per_step


@pytest.mark.parametrize("prompt_tokens,budget,rows", [(120, 40, 2), pytest.param(2048, 512, 8, marks=pytest.mark.slow)])
def test_a_long_prompt_arriving_beside_decoding_rows_is_prefilled_a_chunk_a_step(engine, prompt_tokens, budget, rows):
    """Chunked prefill: a long prompt that arrives while rows decode takes at most
    ``prefill_budget`` prompt positions a step (counted at the first decoder layer), and the rows
    decoding beside it end at the step they end without it; every request gives its alone tokens."""
    ids = engine.tokenizer(PROMPTS[2] * 400)["input_ids"][:prompt_tokens]
    assert len(ids) == prompt_tokens
    short = [Request(PROMPTS[i % len(PROMPTS)], max_new_tokens=16) for i in range(rows)]
    long = Request(ids, max_new_tokens=8)
    alone = [engine.generate(r).token_ids for r in short + [long]]

    def steps_of(with_long: bool):
        handles = [engine.submit(r) for r in short]
        engine.step()  # the short rows are decoding
        late = engine.submit(long) if with_long else None
        tokens, ends, k, forwards = [], {}, 1, []
        layer = engine.model.model.layers[0]
        handle = layer.register_forward_pre_hook(lambda mod, args: forwards.append(k))
        run = Runner.run

        def counted(runner, parts):  # the prompt's chunk in each step's one forward (its last with its first block)
            tokens.extend((k, p.commit) for p in parts if p.row.key in engine.loop.filling)
            return run(runner, parts)
        Runner.run = counted
        try:
            while not all(h.done for h in handles + [late] if h is not None):
                k += 1
                engine.step()
                ends.update({i: k for i, h in enumerate(handles) if h.done and i not in ends})
        finally:
            handle.remove()
            Runner.run = run
        assert len(forwards) == len(set(forwards)), forwards  # one forward per step, the prompt's chunk in it
        return handles, late, ends, tokens

    engine.loop.prefill_budget = budget
    engine.prefix_cache.budget = 0  # the long prompt ran alone above: it would start from the cache
    try:
        base, _, base_ends, _ = steps_of(False)
        handles, late, ends, tokens = steps_of(True)
    finally:
        engine.loop.prefill_budget = 512
        engine.prefix_cache.budget = 1 << 30
    assert [h.result.token_ids for h in handles + [late]] == alone
    assert all(ends[i] <= base_ends[i] + 1 for i in range(rows)), (ends, base_ends)
    prefill = [n for _, n in tokens]
    assert sum(prefill) == prompt_tokens and max(prefill) <= budget, prefill
    assert late.result.stats.prefill_forwards == -(-prompt_tokens // budget)


def test_rows_in_four_phases_run_one_model_forward_per_step(engine):
    """A diffusion row mid-block, an AR row, a speculative row and a prompt arriving (sampled, with
    a seed) run ONE model forward per step (counted with a forward pre-hook on the first decoder
    layer): their segments packed, each row decided from its own logits; each gives its alone
    tokens."""
    reqs = [Request(PROMPTS[0], max_new_tokens=20), Request(PROMPTS[1], mode="ar", max_new_tokens=8),
            Request(PROMPTS[2], mode="speculative", max_new_tokens=12),
            Request(PROMPTS[3] * 3, max_new_tokens=8, temperature=0.8, seed=3)]
    alone = [engine.generate(r).token_ids for r in reqs]
    handles = [engine.submit(r) for r in reqs[:3]]
    for _ in range(3):  # admitted and prefilled, then previews, AR tokens, draft passes
        engine.step()
    diffusing = next(r for r in engine.loop.rows if r.handle is handles[0])
    assert diffusing.block is not None and diffusing.block.step > 0  # mid-block
    handles.append(engine.submit(reqs[3]))
    forwards, k = [], 0
    hook = engine.model.model.layers[0].register_forward_pre_hook(lambda mod, args: forwards.append(k))
    try:
        while not all(h.done for h in handles):
            k += 1
            engine.step()
    finally:
        hook.remove()
    assert forwards == list(range(1, k + 1)), forwards  # one forward in every step, the prompt's prefill in it
    assert [h.result.token_ids for h in handles] == alone
