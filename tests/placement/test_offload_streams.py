"""Offload that streams (clover_lab/placement/staging.py, offload.py): a forward's experts gathered
into one staging buffer and copied in one copy per layer, the next offloaded layer prefetched, the
offloaded experts held once in host memory. On this CPU-only machine the "device" is the CPU: the
gather, the single copy and the prefetch run as on a GPU, synchronously (the tokens are checked
against the unplaced model in tests/test_placement.py, whose placement chains a prefetch too)."""
import pytest
import torch

import clover_lab
from clover_lab.config import CloverConfig
from clover_lab.model.layers.moe import Experts
from clover_lab.placement import ExpertStore
from clover_lab.placement.staging import ALIGN, Staging, expert_bytes, layout, pin_in_place

ALL_OFFLOADED = {"": "cpu", **{f"model.layers.{i}.mlp.experts": "offload" for i in range(3)}}


def host_tensors(E=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"gate_up_proj": torch.randn(E, 6, 5, generator=g), "down_proj": torch.randn(E, 5, 3, generator=g).half(),
            "down_proj_scale_inv": torch.randn(E, 2, generator=g).to(torch.float8_e4m3fn)}


def test_a_gather_is_one_copy_of_the_packed_rows():
    host = host_tensors()
    staging = Staging("cpu")
    got = staging.stage(host, [6, 1, 3])
    parts, total = layout(host, 3)
    assert staging.copies == 1 and staging.bytes_copied == total == got.nbytes
    assert all(offset % ALIGN == 0 for _, offset, _ in parts)
    assert total >= 3 * expert_bytes(host)
    for name, t in host.items():
        staged = got.tensors[name]
        assert staged.dtype == t.dtype and staged.is_contiguous()
        assert torch.equal(staged.view(torch.uint8), t[[6, 1, 3]].view(torch.uint8))
    # every tensor is a view of the one copied buffer
    assert len({v.untyped_storage().data_ptr() for v in got.tensors.values()}) == 1


def test_two_host_buffers_take_turns_and_are_reused():
    host = host_tensors()
    staging = Staging("cpu")
    first, second = staging.stage(host, [0, 1]), staging.stage(host, [2, 3])
    size = staging.host_bytes
    assert size == first.nbytes + second.nbytes  # two buffers: the prefetch never overwrites a copy in flight
    again = staging.stage(host, [4, 5])
    assert staging.host_bytes == size and torch.equal(again.tensors["gate_up_proj"], host["gate_up_proj"][[4, 5]])
    assert torch.equal(first.tensors["gate_up_proj"], host["gate_up_proj"][[0, 1]])  # staged sets own their copy


def test_pinning_in_place_keeps_one_host_copy():
    """pin_memory pins the offloaded experts themselves (no second, pinned copy of every layer):
    the module keeps its parameters and buffers, their old pageable storage is freed. Pinning needs
    CUDA, so a plain copy stands in for Tensor.pin_memory here."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from clover_lab.model.layers.fp8_linear import FP8Experts

    config = CloverConfig.preset("clover-tiny")
    for experts in (Experts(config), FP8Experts(config, (16, 16))):
        for t in experts.expert_tensors().values():
            t.data.copy_(torch.randn(t.shape).to(t.dtype))
        before = experts.expert_tensors()
        values = {n: t.detach().clone() for n, t in before.items()}
        old = {n: StorageWeakRef(t.untyped_storage()) for n, t in before.items()}
        size = sum(t.numel() * t.element_size() for t in before.values())
        params = {n: t for n, t in before.items() if n in experts._parameters}
        del before, t  # only the module holds the tensors now
        assert pin_in_place(experts, list(values), pin=lambda t: t.clone()) == size
        for n, t in experts.expert_tensors().items():
            assert old[n].expired(), f"{n}: the pageable copy is still held"
            assert t.view(torch.uint8).equal(values[n].view(torch.uint8))
            assert n not in params or t is params[n]  # the same Parameter, its data replaced


@pytest.fixture(scope="module")
def placed(gen_model_dir):
    return clover_lab.load(gen_model_dir, device_map=ALL_OFFLOADED)


def stores(engine):
    return [layer.mlp.experts.store for layer in engine.model.model.layers if layer.mlp.experts.store is not None]


def test_one_staging_per_device_and_each_store_prefetches_the_next(placed):
    chain = stores(placed)
    assert len(chain) == 3 and len({id(s.staging) for s in chain}) == 1
    assert [s.next for s in chain] == [chain[1], chain[2], None]
    assert all(isinstance(s, ExpertStore) for s in chain)


def test_each_layer_copies_once_per_forward_and_uses_its_prefetch(placed, gen_one_thread, monkeypatch):
    """Without a coreset, every forward of every layer issues at most one copy of its own (the
    prefetch of the next layer is the other), and the previews of a block, which route alike,
    find most of their experts prefetched."""
    chain = stores(placed)
    for s in chain:
        s.release()
    calls = []  # (store, what) per copy
    for s in chain:
        stage, prefetch = s._stage, s.prefetch
        monkeypatch.setattr(s, "_stage", lambda host, ids, _s=s, _stage=stage: calls.append((_s, "copy")) or
                            _stage(host, ids))
        monkeypatch.setattr(s, "prefetch", lambda room, _s=s, _p=prefetch: calls.append((_s, "prefetch")) or _p(room))
    runs = []
    for s in chain:
        run = s.run

        def counted(*args, _s=s, _run=run, **kwargs):
            start = len(calls)
            out = _run(*args, **kwargs)
            own = [c for c in calls[start:] if c[0] is _s]
            runs.append((_s, sum(what == "copy" for _, what in own)))
            return out
        monkeypatch.setattr(s, "run", counted)
    before = [(s.prefetched, s.prefetch_used) for s in chain]
    result = placed.generate(list(range(20)), max_new_tokens=48, threshold=0.99)
    assert result.stats["forwards"] > 2 * result.stats["blocks"]
    assert runs and all(copies <= 1 for _, copies in runs), "more than one copy in a layer's forward"
    copies = placed.model.model.layers[0].mlp.experts.store.staging.copies
    assert copies > 0
    used = [(s.prefetched - p, s.prefetch_used - u) for s, (p, u) in zip(chain, before)]
    assert used[0] == (0, 0)  # the first offloaded layer has none before it
    for prefetched, hits in used[1:]:
        assert prefetched > 0 and 0 < hits <= prefetched
