"""A compiled static step is one traced graph, and the host checks it trusts still hold after it."""
import pytest
import torch
import torch.nn as nn

from clover_lab.engine.graphs import StepGraphs, static_body

PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64, 8, 400, 23]


@pytest.mark.slow  # dynamo traces a step three times (11 s of a fast tier at its 10-minute budget)
def test_a_static_step_traces_without_graph_breaks(gen_model):
    """A graph break inside the layer loop makes dynamo skip the loop and compile each layer's
    pieces apart (a step then pays dozens of guard checks): a fused projection's data-pointer
    check and the context's default ``where`` did; they stay outside the trace."""
    graphs = StepGraphs(gen_model, 128)
    cache = graphs.reset(2)
    gen_model.prefill(cache, torch.tensor([PROMPT, PROMPT[::-1]]), logits=None)
    n = torch.full((2,), len(PROMPT))
    gen_model.check_projections()
    assert all(group.weight is not None for _, group in gen_model.projection_groups())
    for c, m in ((0, 16), (16, 16), (1, 0)):
        snapshot = cache.clone()
        explained = torch._dynamo.explain(static_body)(gen_model, cache, torch.full((2, c + m), 511), n, c, m,
                                                       c == 1, None)
        cache.restore(snapshot)
        assert explained.graph_break_count == 0, explained.break_reasons
        assert explained.graph_count == 1


@pytest.mark.slow  # two compilations of a step
def test_a_compiled_step_follows_a_replaced_projection_weight(new_gen_model):
    """The compiled step's traced code trusts the fused weights; replacing a part's weight after
    a step has compiled drops the stale fused weight before the next step, whose logits follow the
    new weight (the eager forward's)."""
    model = new_gen_model()
    eager = model.new_cache(64)
    graphs = StepGraphs(model, 128, compile=True)
    model.prefill(eager, torch.tensor([PROMPT]), logits=None)
    model.prefill(graphs.reset(), torch.tensor([PROMPT]), logits=None)
    block = torch.full((1, 16), 511)
    torch.testing.assert_close(graphs.step(block, 0, 16)[1], model.preview(eager, block), rtol=1e-5, atol=1e-5)
    owner, group = next(iter(model.projection_groups()))
    part = group.modules(owner)[0]
    with torch.no_grad():
        part.weight = nn.Parameter(part.weight.detach() * 1.5, requires_grad=part.weight.requires_grad)
    got = graphs.step(block, 0, 16)[1]
    assert group.weight is None and graphs.compile_failed is None
    torch.testing.assert_close(got, model.preview(eager, block), rtol=1e-5, atol=1e-5)
