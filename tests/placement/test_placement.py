"""Placement over devices (clover_lab/placement): on this CPU-only machine the "device" is the
CPU too, and the offload store stages experts from host memory onto it, so a placement whose
experts live in the store must give exactly the unplaced model's logits and tokens; planning for
GPUs runs on the meta device with the budgets given."""
import pytest
import torch

import clover_lab
from clover_lab import CheckpointError, CloverConfig, CloverModel
from clover_lab.engine.requests import settings_for_mode
from clover_lab.placement import ElsewhereExperts, Placement, meta_model, plan_placement

OFFLOADED = {"": "cpu", "model.layers.0.mlp.experts": "offload", "model.layers.2.mlp.experts": "offload"}
GiB = 1 << 30


@pytest.fixture(scope="module")
def engines(gen_model_dir):
    return clover_lab.load(gen_model_dir), clover_lab.load(gen_model_dir, device_map=OFFLOADED)


def stores(engine):
    return [layer.mlp.experts.store for layer in engine.model.model.layers if layer.mlp.experts.store is not None]


def test_the_map_puts_experts_in_the_store_and_nothing_else(engines):
    _, placed = engines
    placement = placed.model.placement
    assert placement.offloaded() == ["model.layers.0.mlp.experts", "model.layers.2.mlp.experts"]
    assert len(stores(placed)) == 2 and not placement.graph_safe
    assert placed.fast_path_off() is not None  # staging synchronises: no static steps / CUDA graphs
    assert placement.device_of("model.layers.0.mlp.experts.gate_up_proj") == torch.device("cpu")


@pytest.mark.parametrize("coreset", [None, 4])
def test_offloaded_experts_give_the_unplaced_models_logits_and_tokens(engines, gen_one_thread, coreset):
    plain, placed = engines
    ids = torch.randint(0, 500, (1, 40), generator=torch.Generator().manual_seed(1))
    logits = [e.model.forward(e.model.new_cache(64), ids[:, :24], ids[:, 24:], commit_logits="all",
                              coreset=None if coreset is None else clover_lab.model.decoder.Coreset(coreset))
              for e in (plain, placed)]
    torch.testing.assert_close(logits[1].commit_logits, logits[0].commit_logits, atol=0, rtol=0)
    torch.testing.assert_close(logits[1].preview_logits, logits[0].preview_logits, atol=0, rtol=0)
    for mode in ("diffusion", "ar"):
        results = [e.generate(ids[0].tolist(), mode=mode, max_new_tokens=40,
                                **settings_for_mode(mode, dict(threshold=0.95, coreset_size=coreset)))
                   for e in (plain, placed)]
        assert results[1].token_ids == results[0].token_ids


@pytest.mark.parametrize("coreset", [None, 4])
def test_a_batch_on_offloaded_experts_gives_the_unplaced_models_tokens(engines, gen_one_thread, coreset):
    """Rows at different lengths, each with its own coreset: the store holds their union."""
    plain, placed = engines
    prompts = [[5, 17, 33], [9, 8, 7, 6, 5, 4, 3], [300]]
    for mode in ("diffusion", "ar"):
        results = [e.generate(prompts, mode=mode, max_new_tokens=24,
                                **settings_for_mode(mode, dict(threshold=0.5, coreset_size=coreset)))
                   for e in (plain, placed)]
        assert [r.token_ids for r in results[1]] == [r.token_ids for r in results[0]]


def test_with_a_coreset_each_blocks_experts_are_fetched_once(engines, gen_one_thread):
    """The block's first forward stages its coreset; its later previews route within it and copy nothing."""
    _, placed = engines
    store = stores(placed)[0]
    seen = []
    with placed.hooks({"denoise.step": lambda e: seen.append((e.block, e.step, store.fetches))}):
        result = placed.generate(list(range(20)), max_new_tokens=48, threshold=0.99, coreset_size=4)
    steps_per_block = {}
    for block, step, fetches in seen:
        steps_per_block.setdefault(block, []).append((step, fetches))
    assert result.stats["forwards"] > 2 * result.stats["blocks"]  # several previews per block
    for block, steps in steps_per_block.items():
        later = [f for step, f in steps if step > steps[0][0]]
        assert later and all(f == steps[0][1] for f in later), f"block {block}: experts copied after its first preview"


def test_without_a_coreset_every_forward_stages_its_routed_experts(engines, gen_one_thread):
    _, placed = engines
    store = stores(placed)[0]
    store.release()  # no coreset held from an earlier generation
    before, copied = store.fetches, store.fetched
    result = placed.generate(list(range(20)), max_new_tokens=16, threshold=0.99)
    forwards = result.stats["forwards"] + result.stats["prefill_forwards"]
    assert store.fetches - before == forwards
    assert 0 < store.fetched - copied <= forwards * placed.model.config.num_experts


def test_hooks_and_capture_see_the_same_routing_on_the_placed_model(engines, gen_one_thread):
    plain, placed = engines
    out = []
    for engine in (plain, placed):
        routed = []

        def ban(event):  # an intervention the store must follow: expert 3 of layer 2 is never used
            event.ban([3])
            routed.append(event.expert_ids.clone())

        with engine.capture(["layers.*.moe.route", "denoise.step"]) as cap, engine.hooks({"layers.2.moe.route": ban}):
            r = engine.generate(list(range(12)), max_new_tokens=16, threshold=0.9, coreset_size=4)
        out.append((r.token_ids, routed, [ev["expert_ids"] for ev in cap["layers.0.moe.route"]], len(cap["denoise.step"])))
    assert out[1][0] == out[0][0] and out[1][3] == out[0][3] > 0
    for got, ref in zip(out[1][1:3], out[0][1:3]):
        assert len(got) == len(ref) > 0 and all(torch.equal(a, b) for a, b in zip(got, ref))
    assert all((ids != 3).all() for ids in out[1][1])


def test_fp8_experts_kept_in_fp8_stage_with_their_scales(source_fp8, gen_one_thread):
    placed = clover_lab.load(source_fp8, keep_fp8=True, device_map=OFFLOADED)
    plain = clover_lab.load(source_fp8, keep_fp8=True)
    assert type(placed.model.model.layers[0].mlp.experts).__name__ == "FP8Experts"
    ids = list(range(30))
    assert placed.generate(ids, max_new_tokens=24, coreset_size=4).token_ids == \
        plain.generate(ids, max_new_tokens=24, coreset_size=4).token_ids


@pytest.fixture(scope="module")
def source_fp8(gen_model_dir, tmp_path_factory):
    from clover_lab.checkpoint.quantize import quantize_checkpoint

    return quantize_checkpoint(gen_model_dir, tmp_path_factory.mktemp("fp8"), block=(16, 16))


def test_experts_on_another_device_run_there(gen_model):
    experts = gen_model.model.layers[1].mlp.experts
    g = torch.Generator().manual_seed(0)
    x, ids = torch.randn(5, 64, generator=g), torch.randint(0, 8, (5, 2), generator=g)
    w = torch.softmax(torch.randn(5, 2, generator=g), -1)
    torch.testing.assert_close(ElsewhereExperts("cpu").run(experts, x, ids, w), experts(x, ids, w))


# --------------------------------------------------------------------------- planning (meta device)
FULL = CloverConfig.preset("clover-35b-a3b")


@pytest.fixture(scope="module")
def full_bf16():
    return meta_model(CloverModel, FULL)


def test_auto_on_two_48gb_gpus_holds_the_35b_in_bf16_without_offload(full_bf16):
    placed = plan_placement(full_bf16, "auto", {0: "48GiB", 1: "48GiB", "cpu": "100GiB"}, torch.bfloat16)
    assert not placed.offloaded() and {str(d) for d in placed.devices} == {"cuda:0", "cuda:1"}
    used = placed.bytes_by_device()
    assert used["cuda:0"] <= 48 * GiB and used["cuda:1"] <= 48 * GiB and "cpu" not in used
    assert 2 * 34e9 < sum(used.values()) < 2 * 35e9  # 34.7B parameters, bf16


def test_auto_on_one_24gb_gpu_keeps_every_trunk_on_it_and_offloads_experts(full_bf16):
    budget = {0: 24 * GiB, "cpu": 200 * GiB}
    placed = plan_placement(full_bf16, "auto", budget, torch.bfloat16, coreset_size=64)
    trunks = [n for n in placed.storage if not n.endswith(".mlp.experts")]
    assert all(str(placed.storage[n]) == "cuda:0" for n in trunks)
    off = placed.offloaded()
    assert 25 < len(off) < 40 and all(str(placed.compute[n]) == "cuda:0" for n in off)
    # what lies on the GPU plus the staging room (one layer's experts, 64 experts per offloaded layer)
    expert = placed.sizes[off[0]] // FULL.num_experts
    staged = placed.sizes[off[0]] + 64 * expert * len(off)
    assert placed.bytes_by_device()["cuda:0"] + staged <= budget[0]
    fewer = plan_placement(full_bf16, "auto", budget, torch.bfloat16, coreset_size=0)
    assert len(fewer.offloaded()) < len(off)  # the coreset's room costs GPU-resident experts


def test_fp8_halves_the_experts(full_bf16):
    fp8 = plan_placement(meta_model(CloverModel, FULL, fp8_block=(128, 128)), "auto", {0: "48GiB", "cpu": "100GiB"},
                         torch.bfloat16)
    assert not fp8.offloaded() and 34e9 < fp8.bytes_by_device()["cuda:0"] < 37e9  # bf16: 69.3e9


def test_a_dict_map_places_by_longest_prefix(full_bf16):
    placed = plan_placement(full_bf16, {"": 0, "model.layers.39": 1, "model.layers.39.mlp.experts": "cpu",
                                        "lm_head": 1}, None, torch.bfloat16)
    assert str(placed.storage["model.layers.3"]) == "cuda:0" and str(placed.storage["model.layers.39"]) == "cuda:1"
    assert placed.offloaded() == ["model.layers.39.mlp.experts"]
    assert str(placed.compute["model.layers.39.mlp.experts"]) == "cuda:1"


@pytest.mark.parametrize("device_map,match", [
    ({"": 0, "model.layers.3.self_attn": 1}, "splits a unit"),
    ({"": 0, "model.blocks.3": 1}, "names no module"),
    ({"": "disk"}, "'disk' is not supported"),
    ({"": "cpu", "model.layers.2": "offload"}, "only a layer's experts"),
    ({"model.layers.0": 0}, "nothing places 'model.embed_tokens'"),
    (["auto"], "expected 'auto' or a dict"),
])
def test_a_bad_device_map_is_named(full_bf16, device_map, match):
    with pytest.raises(CheckpointError, match=match):
        plan_placement(full_bf16, device_map, None, torch.bfloat16)


def test_bad_max_memory_and_arguments_are_named(full_bf16, gen_model_dir):
    with pytest.raises(CheckpointError, match="max_memory: device 'gpu0'"):
        plan_placement(full_bf16, "auto", {"gpu0": "10GiB"}, torch.bfloat16)
    with pytest.raises(CheckpointError, match="fits on no device"):
        plan_placement(full_bf16, "auto", {0: "1GiB", "cpu": "1GiB"}, torch.bfloat16)
    with pytest.raises(ValueError, match="not both"):
        clover_lab.load(gen_model_dir, device="cpu", device_map="auto")


def test_a_placement_round_trips_as_a_device_map(full_bf16):
    placed = plan_placement(full_bf16, {"": 0, "model.layers.5.mlp.experts": "offload"}, None, torch.bfloat16)
    again = Placement.from_map(full_bf16, placed.device_map())
    assert again.storage == placed.storage and again.offloaded() == ["model.layers.5.mlp.experts"]


PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch without CUDA")
def test_a_gpu_placement_without_cuda_is_one_line(gen_model_dir, capsys):
    for kwargs in (dict(device_map={"": 0}), dict(device_map="auto", max_memory={0: "1GiB", "cpu": "4GiB"}),
                   dict(device_map={"": "cuda:0"})):
        with pytest.raises(clover_lab.CheckpointError, match="no CUDA device is available"):
            clover_lab.load(gen_model_dir, **kwargs)
    from clover_lab.cli.main import main

    assert main(["generate", "--model", str(gen_model_dir), "--prompt-ids", "1,2", "--device-map", "auto",
                 "--max-memory", "0=1GiB", "--no-live"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no CUDA device is available" in err and len(err.splitlines()) == 1


def test_max_memory_none_with_auto_plans_on_what_is_free(gen_model_dir):
    engine = clover_lab.load(gen_model_dir, device_map="auto", max_memory=None)
    assert len(engine.generate(PROMPT, max_new_tokens=4).token_ids) == 4


@pytest.mark.parametrize("size", [None, -1, 0, True, "lots", "-1GB", 1.5])
def test_a_max_memory_that_is_no_size_is_named_before_loading(gen_model_dir, size):
    """max_memory={"cpu": None} was a TypeError from inside accelerate's planner."""
    with pytest.raises(CheckpointError, match=rf"max_memory\['cpu'\]={size!r}: expected a size"):
        clover_lab.load(gen_model_dir, device_map="auto", max_memory={"cpu": size})
