"""Hooks inside the model on the fast path (issue 24): observers keep the whole static step (they
read what it recorded, after it), other hooks run live in their own layers while the layers
between stay compiled, and the stats say which path ran. A hook cannot tell the paths apart: its
events are the eager forward's."""
import pytest
import torch

from clover_lab import Engine
from clover_lab.hooks import HookError
from clover_lab.hooks.registry import observer

PROMPTS = [[5, 17, 33], [5, 17, 33, 100, 2, 9, 77, 301, 12, 64], [400, 3, 250, 7, 88, 19]]
KW = dict(max_new_tokens=24, threshold=0.3)


def _route_log(seen: list):
    def hook(ev):
        seen.append((ev.layer, ev.mode, ev.where.phase, ev.where.rows, ev.positions.tolist(), ev.expert_ids.tolist(),
                     ev.weights.shape, ev.router_probs.shape,
                     None if ev.selectable is None else tuple(ev.selectable.shape)))
    return hook


def _generate(engine, prompts, hooks, **kw):
    with engine.hooks(hooks):
        out = engine.generate(prompts, **kw)
    return out


def _tokens(out):
    return [r.token_ids for r in out] if isinstance(out, list) else out.token_ids


@pytest.mark.parametrize("prompts, coreset", [(PROMPTS[1], None), (PROMPTS, None), (PROMPTS[1], 4)])
def test_route_observers_keep_the_whole_static_step(gen_model, prompts, coreset):
    """A batch whose rows finish one by one (padding rows, rows sitting out) and a coreset: the
    observers see the eager forward's events, in its order, and the step stays static."""
    plain, fast = Engine(gen_model), Engine(gen_model)
    plain.step_graphs, fast.step_graphs = False, True
    want, got = [], []
    a = _generate(plain, prompts, {"layers.*.moe.route": observer(_route_log(want))}, coreset_size=coreset, **KW)
    b = _generate(fast, prompts, {"layers.*.moe.route": observer(_route_log(got))}, coreset_size=coreset, **KW)
    assert _tokens(b) == _tokens(a) and b.stats.forwards == a.stats.forwards
    assert got == want and len(got) >= 24
    assert b.stats.path == ("static (observers read after each step: layers.0.moe.route, layers.1.moe.route, "
                            "layers.2.moe.route and 1 more points)")


def test_an_observer_that_raises_leaves_the_cache_and_the_engine_usable(gen_model):
    fast = Engine(gen_model)
    fast.step_graphs = True
    want = fast.generate(PROMPTS[1], **KW).token_ids

    @observer
    def broken(ev):
        if ev.mode == "preview":
            raise ValueError("broken observer")

    with fast.hooks({"layers.1.moe.route": broken}), pytest.raises(HookError, match="layers.1.moe.route"):
        fast.generate(PROMPTS[1], **KW)
    graphs = fast.fast_path.graphs
    assert graphs.cache.length == len(PROMPTS[1])  # the failed preview step neither advanced nor published
    assert fast.generate(PROMPTS[1], **KW).token_ids == want


@pytest.mark.slow  # torch.compile
def test_an_intervening_hook_splits_the_compiled_step_at_its_layer(gen_model):
    """A route hook that bans experts and a residual hook that replaces its value, both in layer 2:
    the eager tokens with those hooks, the same events, and layers 0-1 and 3 stay compiled.
    (The split itself is layout-independent: the block-diffusion steps run the same code.)"""
    seen_plain, seen_fast = [], []

    def hooks(seen):
        def ban(ev):
            seen.append((ev.mode, ev.positions.tolist(), ev.where.rows))
            ev.ban([0, 1])

        def scale(ev):
            seen.append((ev.mode, tuple(ev.positions.shape), tuple(ev.value.shape)))
            ev.value = ev.value * 0.5

        return {"layers.2.moe.route": ban, "layers.2.moe.output": scale}

    plain, fast = Engine(gen_model), Engine(gen_model)
    plain.step_graphs, fast.compile_steps = False, True  # AR: one step shape, two compiled segments
    a = _generate(plain, PROMPTS[1], hooks(seen_plain), mode="ar", max_new_tokens=8)
    b = _generate(fast, PROMPTS[1], hooks(seen_fast), mode="ar", max_new_tokens=8)
    assert b.token_ids == a.token_ids and b.stats.forwards == a.stats.forwards
    assert seen_fast == seen_plain and len(seen_plain) >= 10
    assert b.stats.path == "compiled, layer 2 eager: a hook on layers.2.moe.output, layers.2.moe.route"
    graphs = fast.fast_path.graphs
    assert graphs.compile_failed is None
    assert {(k[3], k[4]) for k in graphs.shapes['segments']} == {(0, 2), (3, gen_model.config.num_hidden_layers)}


def test_expert_view_keeps_the_static_path(view_engine):
    """The Dashboard's ExpertView (observers on every router) no longer turns generations eager."""
    from clover_lab.widgets import ExpertView

    runs = {}
    for fast in (False, True):
        view_engine.step_graphs = fast
        view = ExpertView(view_engine, fps=1000)
        try:
            result = view_engine.generate("w5 w17 w33", max_new_tokens=16, threshold=0.3)
            view.flush()
            runs[fast] = (result.token_ids, result.stats.path, view.usage("all"))
        finally:
            view.close()
    view_engine.step_graphs = None
    assert runs[True][0] == runs[False][0]
    assert runs[False][1] == "eager: engine.step_graphs is False"
    assert runs[True][1].startswith("static (observers read after each step: layers.0.moe.route")
    assert (runs[True][2] == runs[False][2]).all() and runs[True][2].sum() > 0


# --------------------------------------------------------------------------- MemoryView's GDN points
def _memory_log(seen: list):
    """What a GDN state or preview observer sees: the event's host fields and copies of its tensors."""
    def hook(ev):
        host = {k: getattr(ev, k) for k in ("layer", "length", "row_lengths", "positions") if hasattr(ev, k)}
        host = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in host.items()}
        tensors = {k: getattr(ev, k).clone() for k in ("state", "ring", "history_weights", "history_reads")
                   if hasattr(ev, k)}
        seen.append((type(ev).__name__, ev.where, host, tensors))
    return observer(hook)


def _memory_hooks(seen: list) -> dict:
    return {"layers.*.gdn.state": _memory_log(seen), "layers.*.gdn.preview": _memory_log(seen)}


@pytest.mark.parametrize("prompts, mode", [(PROMPTS[1], "diffusion"), (PROMPTS, "diffusion"), (PROMPTS, "ar")])
def test_gdn_observers_keep_the_whole_static_step(gen_model, prompts, mode):
    """MemoryView's points (the GDN state after each commit, the preview's history weights and
    reads) are recorded by the static step like the routers' decisions: the observers see the
    eager forward's events, in its order, with its lengths and positions (a batch whose rows
    finish one by one: padding and rows sitting out left out), and the step stays static."""
    plain, fast = Engine(gen_model), Engine(gen_model)
    plain.step_graphs, fast.step_graphs = False, True
    want, got = [], []
    kw = KW if mode == "diffusion" else dict(mode="ar", max_new_tokens=12)
    a = _generate(plain, prompts, _memory_hooks(want), **kw)
    b = _generate(fast, prompts, _memory_hooks(got), **kw)
    assert _tokens(b) == _tokens(a) and b.stats.forwards == a.stats.forwards
    assert [e[:3] for e in got] == [e[:3] for e in want]
    kinds = {"GDNStateEvent", "GDNPreviewEvent"} if mode == "diffusion" else {"GDNStateEvent"}
    assert {e[0] for e in got} == kinds and {e[1].phase for e in got} >= {"decode"}
    assert len([e for e in got if e[1].phase == "decode"]) >= 12
    single = not isinstance(prompts[0], list)  # a batch's GEMMs run over its bucket's padding rows
    for (_, _, _, x), (_, _, _, y) in zip(got, want):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].shape == y[k].shape and x[k].dtype == y[k].dtype
            assert torch.equal(x[k], y[k]) if single else torch.allclose(x[k], y[k], rtol=1e-4, atol=1e-5)
    gdn = gen_model.config.gdn_layers()
    assert b.stats.path == (f"static (observers read after each step: layers.{gdn[0]}.gdn.preview, "
                            f"layers.{gdn[0]}.gdn.state, layers.{gdn[1]}.gdn.preview and "
                            f"{2 * len(gdn) - 3} more points)")


def test_a_gdn_state_observer_that_raises_leaves_the_cache_unchanged(gen_model):
    """An observer raising at the first decode commit: the static step neither advanced nor
    published its GDN writes (the cache holds the prefill's states), and the engine goes on."""
    fast = Engine(gen_model)
    fast.step_graphs = True
    want = fast.generate(PROMPTS[1], **KW).token_ids
    prefill = {}

    @observer
    def broken(ev):
        if ev.where.phase == "prefill":
            prefill[ev.layer] = (ev.state.clone(), ev.ring.clone())
        else:
            raise ValueError("broken observer")

    with fast.hooks({"layers.*.gdn.state": broken}), pytest.raises(HookError, match=r"layers\.\d\.gdn\.state"):
        fast.generate(PROMPTS[1], **KW)
    cache = fast.fast_path.graphs.cache
    assert cache.length == len(PROMPTS[1]) and set(prefill) == set(gen_model.config.gdn_layers())
    for layer, (state, ring) in prefill.items():
        assert torch.equal(cache.layers[layer].state, state) and torch.equal(cache.layers[layer].ring, ring)
    assert fast.generate(PROMPTS[1], **KW).token_ids == want


def test_a_gdn_state_hook_that_is_no_observer_leaves_the_static_step(gen_model):
    """A hook that may change the state (any hook not marked an observer) runs live: on the
    uncompiled static path that is the eager forward, and the stats say so."""
    def damp(ev):
        ev.state.mul_(0.5)

    plain, fast = Engine(gen_model), Engine(gen_model)
    plain.step_graphs, fast.step_graphs = False, True
    a = _generate(plain, PROMPTS[1], {"layers.0.gdn.state": damp}, **KW)
    b = _generate(fast, PROMPTS[1], {"layers.0.gdn.state": damp}, **KW)
    assert b.token_ids == a.token_ids
    assert b.stats.path == "eager: a hook on layers.0.gdn.state"
