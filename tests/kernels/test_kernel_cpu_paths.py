"""The CPU inference paths against their definitions: ``linear`` (oneDNN's fp32 GEMM, and on a
kept packed weight) against ``F.linear``, the CPU routed-experts paths against a token-by-token
float64 loop, and the chunked gated delta rule against the recurrence."""
import pytest
import torch
import torch.nn.functional as F

from clover_kernels import dense
from clover_kernels.dense import PackedWeight, linear, uses_onednn
from clover_kernels.moe import naive
from clover_kernels.moe import torch as moe_torch


@pytest.mark.parametrize("shape", [(4, 64), (32, 512), (2, 7, 96), (300, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(48, shape[-1], generator=g)
    b = torch.randn(48, generator=g) if bias else None
    with torch.inference_mode():
        expected = F.linear(x.double(), w.double(), None if b is None else b.double())
        torch.testing.assert_close(linear(x, w, b).double(), expected, atol=1e-4, rtol=1e-5)  # fp32 rounding
        # a strided view of the rows gives the same result as its contiguous copy
        torch.testing.assert_close(linear(x[..., ::2, :], w, b), linear(x[..., ::2, :].contiguous(), w, b))


def test_linear_takes_onednn_only_where_it_is_meant_to():
    w = torch.randn(16, 32)
    rows = torch.randn(8, 32)
    if not dense._ONEDNN:
        pytest.skip("torch has no oneDNN linear on this machine")
    with torch.inference_mode():
        assert uses_onednn(rows, w)
        assert not uses_onednn(rows[:1], w)  # one row (decode): F.linear is the faster kernel there
        assert not uses_onednn(rows.bfloat16(), w.bfloat16())  # bf16 F.linear is oneDNN already
    p = torch.nn.Parameter(w.clone())
    assert not uses_onednn(rows, p)  # a weight that needs a gradient: autograd's F.linear
    out = linear(rows, p)
    out.sum().backward()
    torch.testing.assert_close(p.grad, rows.sum(0)[None].expand_as(w))


needs_onednn = pytest.mark.skipif(not dense._ONEDNN, reason="torch has no oneDNN linear on this machine")


@needs_onednn
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 64), (37, 96), (2, 9, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_on_a_packed_weight_equals_f_linear(dt, shape, bias):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g).to(dt)
    w = torch.randn(40, shape[-1], generator=g).to(dt)
    b = torch.randn(40, generator=g).to(dt) if bias else None
    packed = PackedWeight()
    if dt == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # an AVX2-only CPU: oneDNN would refuse to pack bf16, so nothing offers to
        assert not dense.can_pack(w) and not packed.applies(x, w)
        pytest.skip("this CPU has no oneDNN bf16 GEMM")
    with torch.inference_mode():
        assert packed.applies(x, w)
        out = linear(x, w, b, packed=packed)
        assert packed.nbytes > 0  # it packed, and the product ran on the packed copy
        expected = F.linear(x.double(), w.double(), None if b is None else b.double())
        tol = dict(atol=1e-4, rtol=1e-5) if dt == torch.float32 else dict(atol=0.1, rtol=2e-2)  # bf16 output
        torch.testing.assert_close(out.double(), expected, **tol)
        torch.testing.assert_close(out, F.linear(x, w, b), **tol)


@needs_onednn
def test_a_packed_weight_follows_its_weight():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 32, generator=g)
    w = torch.randn(16, 32, generator=g)
    packed = PackedWeight()
    with torch.inference_mode():
        first = linear(x, w, packed=packed)
        copy = packed.get(w)
        assert packed.get(w) is copy  # unchanged weight: the same copy, no repacking
    with torch.no_grad():
        w[3] = 0.0  # an in-place edit bumps the version counter
    with torch.inference_mode():
        edited = linear(x, w, packed=packed)
        assert packed.get(w) is not copy
        torch.testing.assert_close(edited, F.linear(x, w))
        assert (edited[:, 3] == 0).all() and not (first[:, 3] == 0).all()
        other = torch.randn(16, 32, generator=g)  # another weight (another tensor) used with it
        torch.testing.assert_close(linear(x, other, packed=packed), F.linear(x, other), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(linear(x, w, packed=packed), F.linear(x, w), atol=1e-5, rtol=1e-5)
        w.data[0] = 5.0  # .data bypasses the version counter: clear() is the documented way back
        packed.clear()
        torch.testing.assert_close(linear(x, w, packed=packed), F.linear(x, w), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_a_packed_weight_steps_aside_where_it_does_not_apply():
    w = torch.randn(16, 32)
    packed = PackedWeight()
    with torch.inference_mode():
        assert not packed.applies(torch.randn(1, 32), w)  # one row: F.linear
        assert not packed.applies(torch.randn(8, 32).half(), w.half())  # fp16: not packed
        assert not packed.applies(torch.randn(8, 32).bfloat16(), w)  # mixed dtypes: F.linear's error
    p = torch.nn.Parameter(w.clone())
    rows = torch.randn(8, 32)
    out = linear(rows, p, packed=packed)  # a weight that needs a gradient: autograd's F.linear
    assert packed.nbytes == 0
    out.sum().backward()
    torch.testing.assert_close(p.grad, rows.sum(0)[None].expand_as(w))


def expert_loop(x, ids, weights, gate_up, down):
    """The routed experts by definition (``moe/naive.py``), in float64."""
    return naive.moe_experts(x.double(), ids, weights.double(), gate_up.double(), down.double())


# below and past as many (token, slot) pairs as experts (the loop, grouped_mm; 6 x 3 leaves experts idle)
@pytest.mark.parametrize("T,k,E", [(1, 1, 4), (1, 8, 16), (9, 2, 1), (6, 3, 16), (33, 4, 16), (64, 8, 64)])
@pytest.mark.parametrize("path", ["eager", "traced", "packed"])
def test_cpu_experts_equal_the_loop(T, k, E, path):
    g = torch.Generator().manual_seed(T * 100 + E)
    H, I = 32, 24
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if E >= k \
        else torch.zeros(T, k, dtype=torch.long)
    weights = torch.softmax(torch.randn(T, k, generator=g), -1)
    gate_up = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5
    down = torch.randn(E, H, I, generator=g) * I ** -0.5
    if path == "packed" and not dense._ONEDNN:
        pytest.skip("torch has no oneDNN linear on this machine")
    with torch.inference_mode():
        if path == "traced":
            out = moe_torch._moe_experts_traced(x, ids, weights, gate_up, down)
        else:
            packed = ([PackedWeight() for _ in range(E)], [PackedWeight() for _ in range(E)]) if path == "packed" else None
            out = moe_torch._moe_experts_cpu(x, ids, weights, gate_up, down, packed)
    torch.testing.assert_close(out.double(), expert_loop(x, ids, weights, gate_up, down), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("B,T,H,dk,dv,chunk", [(1, 256, 8, 64, 64, 64), (2, 100, 4, 32, 16, 64),
                                               (1, 1, 2, 8, 8, 64), (3, 70, 2, 16, 24, 32)])
def test_chunked_delta_rule_equals_the_recurrence(B, T, H, dk, dv, chunk):
    """The chunked gated delta rule (the reference for prefill and training) against the
    token-by-token recurrence, from a non-zero state, with the state before every chunk."""
    from clover_kernels.gdn.naive import l2norm, recurrent_gated_delta_rule
    from clover_kernels.gdn.torch import chunk_gated_delta_rule

    g = torch.Generator().manual_seed(T)
    q, k = (l2norm(torch.randn(B, T, H, dk, generator=g)) for _ in range(2))
    v = torch.randn(B, T, H, dv, generator=g)
    log_decay = -torch.rand(B, T, H, generator=g) * 0.5
    beta = torch.rand(B, T, H, generator=g)
    state = torch.randn(B, H, dk, dv, generator=g)
    o, final, before = chunk_gated_delta_rule(q, k, v, log_decay, beta, state, chunk_size=chunk,
                                              return_chunk_states=True)
    o_ref, final_ref = recurrent_gated_delta_rule(q, k, v, log_decay, beta, state)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, final_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(before[:, 0], state)
    for i in range(1, before.shape[1]):
        start = i * chunk
        _, at_start = recurrent_gated_delta_rule(q[:, :start], k[:, :start], v[:, :start], log_decay[:, :start],
                                                 beta[:, :start], state)
        torch.testing.assert_close(before[:, i], at_start, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # inductor compiles C++ for the step
def test_compiled_experts_take_the_grouped_op_past_a_few_pairs_per_expert():
    """Under torch.compile: few (token, slot) pairs per expert trace the contraction, many (a batch
    of blocks) call the grouped GEMMs as an opaque op; both equal the loop."""
    E, H, I, k = 4, 32, 24, 2
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5
    down = torch.randn(E, H, I, generator=g) * I ** -0.5
    step = torch.compile(moe_torch.moe_experts, dynamic=False)
    for T in (3, moe_torch.TRACED_PAIRS_PER_EXPERT * E):  # 6 pairs traced; 4 per expert (past 2) grouped
        x = torch.randn(T, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        weights = torch.softmax(torch.randn(T, k, generator=g), -1)
        with torch.inference_mode():
            out = step(x, ids, weights, gate_up, down)
        torch.testing.assert_close(out.double(), expert_loop(x, ids, weights, gate_up, down), atol=2e-5, rtol=2e-5)


def test_compiled_experts_take_the_form_calibrate_measured_the_faster(monkeypatch):
    """Past 2 (token, slot) pairs per expert a compiled step's experts take the form that
    ``calibrate`` timed the faster on this machine: the traced contraction or the grouped op. It
    times once per number of pairs; a step compiled with one form keeps it (no guard, no
    recompilation) when a later measurement says otherwise; a contraction that does not compile
    leaves the grouped op. Every form equals the loop."""
    E, H, I, k = 4, 32, 24, 2
    g = torch.Generator().manual_seed(6)
    gate_up = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5
    down = torch.randn(E, H, I, generator=g) * I ** -0.5
    layers = [(gate_up, down)]
    monkeypatch.setattr(moe_torch, "_TRACED_FASTER", {})
    timed = []  # (traced, grouped) seconds handed out, in calibrate's order

    def best_seconds(run, repeats):
        timed.append(run)
        t = seconds.pop(0)
        if isinstance(t, Exception):
            raise t
        return t

    monkeypatch.setattr(moe_torch, "_best_seconds", best_seconds)
    seconds = [1.0, 2.0]  # 8 tokens: the contraction faster
    assert moe_torch.calibrate(8, k, layers) and moe_torch.calibrate(8, k, layers)
    seconds = [2.0, 1.0]  # 10 tokens: the grouped GEMMs faster
    assert not moe_torch.calibrate(10, k, layers)
    assert len(timed) == 4 and moe_torch.calibrate(3, k, layers) and len(timed) == 4  # 6 pairs: traced, untimed
    seconds = [RuntimeError("the contraction does not compile"), 1.0]  # 12 tokens: the grouped op
    assert not moe_torch.calibrate(12, k, layers) and not seconds

    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def grouped_op_in(gm) -> bool:
        return any("moe_experts_grouped" in str(node.target) for node in gm.graph.nodes)

    def rows(T):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        return torch.randn(T, H, generator=g), ids, torch.softmax(torch.randn(T, k, generator=g), -1)

    step = torch.compile(moe_torch.moe_experts, backend=keep_graph, dynamic=False)
    for T, grouped in ((8, False), (10, True)):
        x, ids, weights = rows(T)
        with torch.inference_mode():
            out = step(x, ids, weights, gate_up, down)
        assert grouped_op_in(graphs[-1]) is grouped
        torch.testing.assert_close(out.double(), expert_loop(x, ids, weights, gate_up, down), atol=2e-5, rtol=2e-5)
    moe_torch._TRACED_FASTER[next(key for key in moe_torch._TRACED_FASTER if key[0] == 16)] = False
    x, ids, weights = rows(8)  # 8 tokens now measured grouped: their compiled step stays traced
    with torch.inference_mode():
        out = step(x, ids, weights, gate_up, down)
    assert len(graphs) == 2
    torch.testing.assert_close(out.double(), expert_loop(x, ids, weights, gate_up, down), atol=2e-5, rtol=2e-5)
