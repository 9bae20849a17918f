"""The split-KV attention over the live keys (kernels/attention/split_kv.py) against its torch
reference (attention/torch.py, the static step's SDPA over the whole buffer), under the
interpreter on a CPU. Small heads keep the interpreter quick; the lengths cross the splits' and
the key tiles' edges."""
import pytest
import torch

pytest.importorskip("triton")

from clover_kernels import dispatch, ops  # noqa: E402
from clover_kernels.attention import split_kv  # noqa: E402
from clover_kernels.attention import torch as reference  # noqa: E402


def _case(lasts, heads=(4, 2), D=16, length=None, dtype=torch.float32, device="cpu", seed=0):
    """q [B, Hq, T, D] (a view of [B, T, Hq, D], as the layer makes it), the cache k, v (length:
    the buffer, past every row's last key), last [B, T], gate [B, T, Hq * D]."""
    g = torch.Generator().manual_seed(seed)
    last = torch.tensor(lasts)
    B, T = last.shape
    HQ, HKV = heads
    L = length or int(last.max()) + 1 + 7
    q = torch.randn(B, T, HQ, D, generator=g).transpose(1, 2)
    k, v = torch.randn(B, HKV, L, D, generator=g), torch.randn(B, HKV, L, D, generator=g)
    gate = torch.randn(B, T, HQ * D, generator=g)
    return tuple(x.to(dtype).to(device) for x in (q, k, v)) + (last.to(device), gate.to(dtype).to(device))


def _expected(q, k, v, last, gate):
    return reference.cache_attention(q.float(), k.float(), v.float(), last, gate.float())


# (label, last per batch row and query row, (Hq, Hkv), head_dim)
CASES = [
    ("AR, 1 key", [[0]], (4, 2), 16),
    ("AR, 17 keys", [[16]], (4, 2), 16),
    ("AR, 64 keys", [[63]], (4, 2), 16),
    ("commit 2 + block 3 at 300", [[297, 298, 301, 301, 301]], (4, 2), 16),
    ("batch rows at 5 and 17", [[4, 7, 7], [16, 19, 19]], (4, 2), 16),
    ("no GQA, head_dim 24", [[9, 12]], (2, 2), 24),
    ("GQA 4, 1000+ keys", [[1033, 1034]], (4, 1), 16),
]


@pytest.mark.parametrize("label, lasts, heads, D", CASES, ids=[c[0] for c in CASES])
def test_split_kv_equals_the_reference(label, lasts, heads, D, dtype, device, close):
    args = _case(lasts, heads, D, dtype=dtype, device=device)
    out = split_kv.cache_attention(*args)
    assert out.dtype == dtype and out.shape == (args[3].shape[0], args[3].shape[1], heads[0] * D)
    close(out, _expected(*args), dtype, what=label)


@pytest.mark.parametrize("c, m", [(0, 5), (3, 5), (1, 1), (2, 0)], ids=str)
def test_a_block_of_rows_sees_itself_whole(c, m, dtype, device, close):
    """``block_rows``: the last m rows (a block previewed after c commit rows) see keys up to the
    block's last position, the commit rows up to their own; given the positions, the kernel picks
    each row's last key as ``block_last`` does, with no [B, T] tensor built."""
    from clover_kernels.attention.torch import block_last

    positions = [[20 + i for i in range(c + m)], [41 + i for i in range(c + m)]]
    q, k, v, pos, gate = _case(positions, dtype=dtype, device=device)
    last = block_last(pos, m)
    assert last[:, :c].tolist() == pos[:, :c].tolist() and (last[:, c:] == pos[:, -1:]).all()
    want = _expected(q, k, v, last, gate)
    torch.testing.assert_close(reference.cache_attention(q.float(), k.float(), v.float(), pos, gate.float(), m), want)
    close(split_kv.cache_attention(q, k, v, pos, gate, m), want, dtype, what="block rows")
    with pytest.raises(ValueError, match="block_rows"):
        split_kv.cache_attention(q, k, v, pos, gate, c + m + 1)


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_every_split_count_merges_to_the_same_result(splits, device, close):
    args = _case([[40, 41], [130, 131]], device=device)
    close(split_kv.cache_attention(*args, splits=splits), _expected(*args), torch.float32, what=f"{splits} splits")


def test_only_the_live_keys_are_read(device, close):
    """NaN in every key and value past each batch row's last visible key, and in a whole tail of the
    buffer: the result is the clean cache's (the kernel never loads them; a masked read of a NaN
    value would poison the row through 0 * NaN)."""
    lasts = [[20, 23, 23], [70, 73, 73]]
    q, k, v, last, gate = _case(lasts, length=256, device=device)
    want = _expected(q, k, v, last, gate)
    live = last.max(dim=1).values + 1
    past = torch.arange(k.shape[2], device=device)[None, :] >= live[:, None]  # [B, L]
    k, v = k.masked_fill(past[:, None, :, None], float("nan")), v.masked_fill(past[:, None, :, None], float("nan"))
    got = split_kv.cache_attention(q, k, v, last, gate)
    assert not got.isnan().any()
    close(got, want, torch.float32, what="NaN past the live keys")


def test_the_split_count_depends_on_shapes_only():
    """A CUDA graph keeps its grid: the count is set by the buffer and the rows, never the length."""
    assert split_kv.split_count(programs=2, length=4096, block_n=32) == split_kv.MAX_SPLITS
    assert split_kv.split_count(programs=2, length=64, block_n=32) == 2
    assert split_kv.split_count(programs=512, length=4096, block_n=32) == 1


def test_bad_shapes_are_named():
    q, k, v, last, gate = _case([[3]], heads=(3, 2))
    with pytest.raises(ValueError, match="cache_attention.*Hq a multiple of Hkv"):
        split_kv.cache_attention(q, k, v, last, gate)


def test_the_op_dispatches_to_the_kernel(device, close):
    args = _case([[5, 8]], device=device)
    dispatch.set_backend("triton")  # the conftest's fixture restores the setting
    assert dispatch.backend_for("cache_attention", args[0]) == "triton"
    close(ops.cache_attention(*args), _expected(*args), torch.float32, what="op")


def test_static_steps_through_the_kernel_equal_the_forward(tiny_model, monkeypatch):
    """The runner's static steps (AR, preview, fused commit+preview) with the attention on the split-KV
    kernel (every other op on its torch path) give the plain forward's logits."""
    from clover_lab.engine.graphs import StepGraphs

    dispatch.set_backend("triton", ops=("cache_attention",))  # the conftest's fixture restores the setting
    calls = []
    kernel = dispatch.kernel_table()["cache_attention"]
    monkeypatch.setitem(dispatch.kernel_table(), "cache_attention", lambda *a: calls.append(1) or kernel(*a))
    model = tiny_model
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 200, (1, 11), generator=g)
    eager, graphs = model.new_cache(64), StepGraphs(model, 64, capture=False)
    static = graphs.reset()
    model.prefill(eager, prompt, logits=None)
    model.prefill(static, prompt, logits=None)
    block = torch.randint(0, 200, (1, 8), generator=g)
    commit = torch.randint(0, 200, (1, 8), generator=g)
    torch.testing.assert_close(graphs.step(prompt[:, :1], 1, 0, commit_logits=True)[0],
                               model.commit(eager, prompt[:, :1]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(graphs.step(block, 0, 8)[1], model.preview(eager, block), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(graphs.step(torch.cat([commit, block], 1), 8, 8)[1],
                               model.commit_and_preview(eager, commit, block).preview_logits, rtol=1e-4, atol=1e-4)
    assert len(calls) == 3 * len(model.config.attention_layers())
