"""The no-hook fast path: static-shape steps (CUDA graphs on CUDA) equal the ordinary forward."""
import gc
from types import SimpleNamespace

import pytest
import torch

from clover_lab import Engine
from clover_lab.engine.graphs import StepGraphs
from clover_lab.engine.requests import settings_for_mode
from clover_lab.model.decoder import Coreset

PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64, 8, 400, 23]


def _states(cache):
    return [t.clone() for layer in cache.layers.values() if hasattr(layer, "state") for t in (layer.ring, layer.state)]


def test_static_steps_equal_the_forward(gen_model):
    """AR steps, previews and fused commit+preview on a preallocated buffer (attention over all of it
    with a mask) give the logits and the cache of the plain forward."""
    model = gen_model
    eager = model.new_cache(64)
    graphs = StepGraphs(model, 128)
    static = graphs.reset()
    prompt = torch.tensor([PROMPT])
    model.prefill(eager, prompt, logits=None)
    model.prefill(static, prompt, logits=None)
    g = torch.Generator().manual_seed(0)
    block = torch.randint(0, 500, (1, 16), generator=g)
    block[0, ::3] = 511
    steps = [("ar", torch.tensor([[7]])), ("ar", torch.tensor([[300]])), ("preview", block),
             ("fused", (torch.randint(0, 500, (1, 16), generator=g), block)), ("preview", block[:, :5]),
             ("fused", (torch.randint(0, 500, (1, 5), generator=g), block[:, :7]))]
    for kind, ids in steps:
        if kind == "ar":
            want = model.commit(eager, ids)
            got = graphs.step(ids, 1, 0, commit_logits=True)[0]
        elif kind == "preview":
            want = model.preview(eager, ids)
            got = graphs.step(ids, 0, ids.shape[1])[1]
        else:
            commit, blk = ids
            want = model.commit_and_preview(eager, commit, blk).preview_logits
            got = graphs.step(torch.cat([commit, blk], 1), commit.shape[1], blk.shape[1])[1]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert static.length == eager.length
        for a, b in zip(_states(static), _states(eager)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        n = eager.length
        for i, layer in eager.layers.items():
            if hasattr(layer, "k"):
                torch.testing.assert_close(static.layers[i].k[:, :, :n], layer.k[:, :, :n])


def test_static_steps_read_a_span_of_keys_that_grows_with_the_rows(gen_model):
    """Off a CUDA graph a static step's attention reads ``key_span`` cache rows (a power of two at
    least 256, not the whole buffer): steps on either side of a span's edge, batch rows at
    different lengths, give the plain forward's logits."""
    from clover_lab.engine.graphs import key_span

    model = gen_model
    graphs = StepGraphs(model, 1024)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 500, (1, n), generator=g) for n in (240, 200)]
    eager = [model.new_cache(1024) for _ in prompts]
    for cache, prompt in zip(eager, prompts):
        model.prefill(cache, prompt, logits=None)
    part = model.new_cache(1024, 2)
    for r, prompt in enumerate(prompts):
        model.prefill(part.row(r), prompt, logits=None)
    part.set_row_lengths([240, 200])
    static = graphs.adopt(part, 2)
    spans = []
    for c in (0, 16, 16):  # a preview ending at key 255, then two fused commits + previews past it
        commit = torch.randint(0, 500, (2, c), generator=g)
        block = torch.randint(0, 500, (2, 16), generator=g)
        spans.append(key_span(static, c + 16))
        got = graphs.step(torch.cat([commit, block], 1), c, 16)[1]
        for r, cache in enumerate(eager):
            want = (model.commit_and_preview(cache, commit[r:r + 1], block[r:r + 1]).preview_logits if c
                    else model.preview(cache, block[r:r + 1]))
            torch.testing.assert_close(got[r:r + 1], want, rtol=1e-5, atol=1e-5)
    assert spans == [256, 512, 512]
    rows_at = [SimpleNamespace(length=n, max_len=1024) for n in (0, 255, 256, 1000)]
    assert [key_span(cache, 1) for cache in rows_at] == [256, 256, 512, 1024]


def test_static_step_refuses_what_it_cannot_do(gen_model):
    graphs = StepGraphs(gen_model, 32)
    graphs.reset()
    with gen_model.hooks.scoped({"layers.0.moe.route": lambda e: None}):
        with pytest.raises(RuntimeError, match="hooks"):
            graphs.step(torch.tensor([[1]]), 1, 0)
    with pytest.raises(ValueError, match="c \\+ m"):
        graphs.step(torch.tensor([[1, 2]]), 1, 0)
    with pytest.raises(ValueError, match="exceed"):  # 40 positions of a 32-row buffer
        graphs.step(torch.zeros(1, 40, dtype=torch.long), 0, 40)
    assert graphs.cache.length == 0
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            StepGraphs(gen_model, 32, capture=True)


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_engine_fast_path_generates_the_same(gen_model, mode):
    plain = Engine(gen_model)
    plain.step_graphs = False
    fast = Engine(gen_model)
    fast.step_graphs = True
    for max_new in (37, 16):
        a = plain.generate(PROMPT, mode=mode, max_new_tokens=max_new, **settings_for_mode(mode, {"threshold": 0.3}))
        b = fast.generate(PROMPT, mode=mode, max_new_tokens=max_new, **settings_for_mode(mode, {"threshold": 0.3}))
        assert b.token_ids == a.token_ids
        assert b.stats.forwards == a.stats.forwards
    assert fast.fast_path.graphs is not None and fast.fast_path.graphs.cache.length == len(PROMPT) + 16
    assert plain.fast_path.graphs is None


def test_engine_fast_path_steps_aside_for_hooks_and_interleaved_streams(gen_model):
    plain = Engine(gen_model)
    plain.step_graphs = False
    want = plain.generate(PROMPT, max_new_tokens=40, threshold=0.3).token_ids
    fast = Engine(gen_model)
    fast.step_graphs = True
    seen = []  # a model hook attached mid-generation: from then on the plain forward
    out = []
    for u in fast.stream(PROMPT, max_new_tokens=40, threshold=0.3):
        if u.kind == "commit" and not seen:
            seen.append(fast.add_hook("layers.*.moe.route", lambda e: seen.append(e.layer)))
        if u.kind == "done":
            out = u.result.token_ids
    seen[0].remove()
    assert out == want and len(seen) > 1  # the hook fired on the rest of the run
    # two streams consumed alternately: the second cannot share the first one's cache
    s1 = fast.stream(PROMPT, max_new_tokens=40, threshold=0.3)
    s2 = fast.stream(PROMPT, max_new_tokens=40, threshold=0.3)
    r1 = r2 = None
    for u1, u2 in zip(s1, s2):
        r1, r2 = u1.result or r1, u2.result or r2
    assert r1.token_ids == want and r2.token_ids == want
    # an abandoned stream frees the fast path for the next generation
    s3 = fast.stream(PROMPT, max_new_tokens=40, threshold=0.3)
    next(s3)
    del s3
    gc.collect()
    assert not fast.fast_path.held
    s4 = fast.stream(PROMPT, max_new_tokens=40, threshold=0.3)
    assert fast.fast_path.held  # the new generation holds them
    assert list(s4)[-1].result.token_ids == want


def test_interrupted_and_failed_runs_leave_the_fast_path_usable(gen_model):
    from clover_lab.hooks import HookError

    plain, fast = Engine(gen_model), Engine(gen_model)
    plain.step_graphs, fast.step_graphs = False, True
    want = plain.generate(PROMPT, max_new_tokens=40, threshold=0.3).token_ids

    def interrupt(ev):
        if ev.block == 1 and ev.step == 1:
            raise KeyboardInterrupt

    with fast.hooks({"denoise.step": interrupt}), pytest.raises(KeyboardInterrupt):
        fast.generate(PROMPT, max_new_tokens=40, threshold=0.3)

    def broken(ev):
        if ev.mode == "preview":
            raise ValueError("broken hook")

    with fast.hooks({"layers.2.moe.route": broken}), pytest.raises(HookError, match="layers.2.moe.route"):
        fast.generate(PROMPT, max_new_tokens=40, threshold=0.3)
    assert fast.generate(PROMPT, max_new_tokens=40, threshold=0.3).token_ids == want
    assert not fast.fast_path.held


def test_coreset_runs_on_the_fast_path(gen_model):
    fast = Engine(gen_model)
    fast.step_graphs = True
    plain = Engine(gen_model)
    plain.step_graphs = False
    for size in (3, 5):
        a = plain.generate(PROMPT, max_new_tokens=40, threshold=0.3, coreset_size=size)
        b = fast.generate(PROMPT, max_new_tokens=40, threshold=0.3, coreset_size=size)
        assert a.token_ids == b.token_ids and a.stats.forwards == b.stats.forwards
    core = fast.fast_path.graphs.coreset(3)
    assert core.experts == {} and len(core.buffers(1)) == gen_model.config.num_hidden_layers
    with pytest.raises(ValueError, match="coreset"):
        fast.fast_path.graphs.step(torch.full((1, 4), 511), 0, 4, coreset=Coreset(3))


@pytest.mark.slow  # torch.compile
def test_compiled_steps_equal_the_forward_and_generate_the_same(gen_model):
    """torch.compile of the static steps on a CPU (the engine's compile_steps): the experts hit are
    contracted in one traced expression instead of a loop with a host sync; same numbers."""
    eager = gen_model.new_cache(64)
    graphs = StepGraphs(gen_model, 128, compile=True)
    gen_model.prefill(eager, torch.tensor([PROMPT]), logits=None)
    gen_model.prefill(graphs.reset(), torch.tensor([PROMPT]), logits=None)
    block = torch.full((1, 16), 511)
    for _ in range(2):
        want = gen_model.commit(eager, torch.tensor([[42]]))
        got = graphs.step(torch.tensor([[42]]), 1, 0, commit_logits=True)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # the model's parameters need gradients, but a compiled step records no autograd history
        assert any(p.requires_grad for p in gen_model.parameters()) and got.grad_fn is None
        torch.testing.assert_close(graphs.step(block, 0, 16)[1], gen_model.preview(eager, block), rtol=1e-5, atol=1e-5)
    assert graphs.compile_failed is None and len(graphs.shapes['compiled']) == 2
    plain, fast = Engine(gen_model), Engine(gen_model)
    plain.step_graphs, fast.compile_steps = False, True
    for mode, coreset in (("ar", None), ("diffusion", None), ("diffusion", 3)):
        kw = {} if mode == "ar" else dict(threshold=0.3, coreset_size=coreset)  # AR reads neither
        a = plain.generate(PROMPT, mode=mode, max_new_tokens=32, **settings_for_mode(mode, kw))
        b = fast.generate(PROMPT, mode=mode, max_new_tokens=32, **settings_for_mode(mode, kw))
        assert a.token_ids == b.token_ids
    assert fast.fast_path.graphs.compile and fast.fast_path.graphs.compile_failed is None
    assert len(fast.fast_path.graphs.coreset(3).buffers(1)) == gen_model.config.num_hidden_layers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_equal_eager(gen_model):
    model = gen_model.to("cuda")
    try:
        captured, eager = StepGraphs(model, 256), StepGraphs(model, 256, capture=False)
        for graphs in (captured, eager):
            graphs.reset()
            model.prefill(graphs.cache, torch.tensor([PROMPT], device="cuda"), logits=None)
        block = torch.full((1, 16), 511, device="cuda")
        for _ in range(3):  # the first call captures, the next ones replay
            a = captured.step(block, 0, 16)[1]
            b = eager.step(block, 0, 16)[1]
            torch.testing.assert_close(a, b)
            a = captured.step(torch.tensor([[7]], device="cuda"), 1, 0, commit_logits=True)[0]
            b = eager.step(torch.tensor([[7]], device="cuda"), 1, 0, commit_logits=True)[0]
            torch.testing.assert_close(a, b)
            ca, cb = captured.coreset(3), eager.coreset(3)
            for _ in range(2):  # records the coreset, then routes within it
                a = captured.step(block, 0, 16, coreset=ca)[1]
                b = eager.step(block, 0, 16, coreset=cb)[1]
                torch.testing.assert_close(a, b)
                assert ca.experts.keys() == cb.experts.keys()
                for layer in ca.experts:
                    assert torch.equal(ca.experts[layer], cb.experts[layer])
        assert captured.disabled is None and len(captured.shapes['captured']) == 4
    finally:
        gen_model.to("cpu")


def test_a_step_about_to_compile_asks_which_form_its_experts_take(gen_model, monkeypatch):
    """Before a step shape compiles on the CPU, StepGraphs asks ``calibrate`` (clover_kernels.moe)
    whether its experts trace the contraction or call the grouped GEMMs: for the step's tokens
    (rows x (c + m)), on every MoE layer's weights. Offloaded experts are not measured."""
    from clover_lab.model.layers import moe as moe_module

    asked = []
    monkeypatch.setattr(moe_module, "calibrate", lambda T, k, experts: asked.append((T, k, experts)))
    graphs = StepGraphs(gen_model, 128, compile=True)
    monkeypatch.setattr(graphs, "_through_compile", lambda *args: None)  # the eager static step, no compilation
    cache = graphs.reset(2)
    gen_model.prefill(cache, torch.tensor([PROMPT, PROMPT[::-1]]), logits=None)
    graphs.step(torch.full((2, 16), 511), 0, 16)
    ((tokens, k, weights),) = asked
    assert (tokens, k) == (2 * 16, gen_model.config.num_experts_per_tok)
    layers = [layer.mlp.experts for layer in gen_model.model.layers]
    assert [(up.data_ptr(), down.data_ptr()) for up, down in weights] == \
        [(e.gate_up_proj.data_ptr(), e.down_proj.data_ptr()) for e in layers]
    experts = layers[1]
    monkeypatch.setattr(experts, "store", object())  # an offload store stages the experts a step routes to
    graphs._calibrate_experts(2 * 17)
    assert len(asked) == 1
