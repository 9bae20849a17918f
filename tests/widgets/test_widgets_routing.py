"""ExpertView shows the routing the forwards used: after the coreset and after the hooks' bans and
forcing, whatever the order in which the view and the intervening hooks were attached; the
router's proposal (its own top-k over all experts) is the separate "without coreset" series."""
import numpy as np
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from clover_lab.widgets import ExpertView  # noqa: E402

PROMPT = [5, 17, 99, 3, 42, 8, 8, 123]
GEN = dict(max_new_tokens=24, threshold=0.3, temperature=0.0)
BANNED = [0, 1]


def _post_hook_counts(engine, intervene):
    """Run a generation with ``intervene`` on every route event; return, per phase, the counts of
    the expert ids each event held after ``intervene`` (what the layer computed with) and of the
    router's top-k over all experts."""
    c = engine.model.config
    L, E, k = c.num_hidden_layers, c.num_experts, c.num_experts_per_tok
    used = {p: np.zeros((L, E)) for p in ("prefill", "commit", "preview")}
    proposal = {p: np.zeros((L, E)) for p in used}

    def hook(ev):
        intervene(ev)
        phase = "prefill" if ev.where.phase == "prefill" else ev.mode
        used[phase][ev.layer] += np.bincount(ev.expert_ids.reshape(-1).cpu().numpy(), minlength=E)
        top = ev.router_probs.topk(k, -1).indices.reshape(-1).cpu().numpy()
        proposal[phase][ev.layer] += np.bincount(top, minlength=E)

    with engine.hooks({"layers.*.moe.route": hook}):
        engine.generate(PROMPT, **GEN)
    return used, proposal


@pytest.mark.parametrize("what", ["ban", "force"])
def test_expert_view_counts_the_post_intervention_routing(view_engine, what):
    k = view_engine.model.config.num_experts_per_tok
    forced = [2, 3, 4, 5, 6, 7, 8, 9][:k]
    intervene = (lambda ev: ev.ban(BANNED)) if what == "ban" else (lambda ev: ev.force(forced))
    # the view attached (permanently) before the intervening hook (scoped, registered later)
    view = ExpertView(view_engine, fps=1000)
    try:
        used, proposal = _post_hook_counts(view_engine, intervene)
        view.flush()
        for phase in used:
            np.testing.assert_array_equal(view.usage(phase), used[phase])
            np.testing.assert_array_equal(view.usage(phase, routing="without coreset"), proposal[phase])
        everything = view.usage("all")
        if what == "ban":
            assert everything[:, BANNED].sum() == 0  # no use of a banned expert is shown as used
            assert view.usage("all", routing="without coreset")[:, BANNED].sum() > 0  # the router wanted them
        else:
            assert set(np.flatnonzero(everything.sum(0))) == set(forced)
        assert "router's proposal" in view.routing_tb.options[1][0]
        with pytest.raises(ValueError, match="routing"):
            view.usage("all", routing="pre-ban")
    finally:
        view.close()


def test_hooks_that_only_read_run_after_those_that_intervene(view_engine):
    """The registry's observers (what views attach) see a route event after a ban registered later."""
    from clover_lab.hooks.registry import observer

    seen = []
    reader = observer(lambda ev: seen.append(ev.expert_ids.clone()))
    handle = view_engine.model.hooks.add("layers.0.moe.route", reader)
    try:
        with view_engine.hooks({"layers.0.moe.route": lambda ev: ev.ban(BANNED)}):
            view_engine.generate(PROMPT, max_new_tokens=4, threshold=0.3, temperature=0.0)
    finally:
        handle.remove()
    assert seen and all(not np.isin(ids.numpy(), BANNED).any() for ids in seen)
