"""Projections of one input as one GEMM (layers.linear.FusedProjections): the same numbers as the
parts, no second copy of the weights, the parts' names kept, and the parts alone whenever the
fused weight no longer stands for them."""
import torch

from clover_lab import CloverModel


def _forward(model, ids):
    return model.forward(model.new_cache(64), ids[:, :9], ids[:, 9:], commit_logits="all")


def test_fused_projections_equal_the_parts_and_share_their_storage():
    model = CloverModel.random("clover-tiny", seed=1)
    groups = list(model.projection_groups())
    assert len(groups) == 2 * model.config.num_hidden_layers and all(g.weight is not None for _, g in groups)
    for module, group in groups:  # each part's weight is a view of the fused one: no second copy
        for m in group.modules(module):
            assert m.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
    ids = torch.randint(0, 500, (1, 25), generator=torch.Generator().manual_seed(0))
    fused = _forward(model, ids)
    plain = CloverModel.random("clover-tiny", seed=1)
    for module, group in plain.projection_groups():
        group.weight = None  # the parts one by one
    want = _forward(plain, ids)
    # the GEMM's columns are the parts' to the bit (below); the ops after it read strided views of
    # one product instead of separate tensors, and vectorise differently: fp32's last bit (~2e-7 here)
    torch.testing.assert_close(fused.commit_logits, want.commit_logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused.preview_logits, want.preview_logits, rtol=1e-6, atol=1e-6)
    for module, group in model.projection_groups():
        x = torch.randn(2, 7, group.weight.shape[1])
        for got, m in zip(group(module, x), group.modules(module)):
            assert torch.equal(got, torch.nn.functional.linear(x, m.weight))
    assert set(model.state_dict()) == set(plain.state_dict())


@torch.no_grad()  # as the inference forward runs
def test_the_parts_run_alone_when_the_fused_weight_no_longer_stands_for_them():
    model = CloverModel.random("clover-tiny", seed=2)
    layer = model.model.layers[0].linear_attn
    x = torch.randn(1, 3, model.config.hidden_size)
    want = [torch.nn.functional.linear(x, m.weight) for m in layer.in_proj.modules(layer)]
    assert layer.in_proj.active(layer, x)
    handle = layer.in_proj_z.register_forward_hook(lambda m, i, o: o * 0)  # a module hook must run
    assert not layer.in_proj.active(layer, x) and layer.in_proj(layer, x)[1].abs().max() == 0
    handle.remove()
    with torch.enable_grad():  # autograd needs the parts (the weights require gradients)
        assert not layer.in_proj.active(layer, x)
    layer.in_proj_z.weight = torch.nn.Parameter(layer.in_proj_z.weight.clone())  # replaced: not a view any more
    assert not layer.in_proj.active(layer, x) and layer.in_proj.weight is None
    for got, ref in zip(layer.in_proj(layer, x), want):
        torch.testing.assert_close(got, ref)
    model.to(torch.float64)  # a cast re-fuses every group
    assert layer.in_proj.weight is not None and layer.in_proj.weight.dtype == torch.float64
    assert layer.in_proj.active(layer, x.double())
