"""Routing statistics over a corpus (clover_lab.lens.routing_stats): against a direct count from route
hooks, batched against one window at a time, the file, and data-parallel over 2 gloo ranks."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from clover_lab.engine import Engine
from clover_lab.lens.routing_stats import RouteStats, route_stats
from clover_lab.model.context import ForwardContext


def corpus(n_docs=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 509, (int(torch.randint(20, 70, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n_docs)]


def direct_counts(model, docs, mode, seq_len, block):
    """Expert counts and tokens from a route hook, window by window, without clover_lab.lens.routing_stats:
    commit windows through ``model.logits``; preview windows padded to whole blocks and previewed
    fully masked, counting only their real rows."""
    c = model.config
    counts = np.zeros((c.num_hidden_layers, c.num_experts), np.int64)
    tokens = 0
    for doc in docs:
        for i in range(0, len(doc), seq_len):
            w = torch.tensor([doc[i:i + seq_len]])
            rows = w.shape[1]
            tokens += rows

            def count(ev, rows=rows):
                if ev.mode == mode:
                    np.add.at(counts[ev.layer], ev.expert_ids[:rows].reshape(-1).numpy(), 1)

            with torch.no_grad(), model.hooks.scoped({"layers.*.moe.route": count}):
                if mode == "commit":
                    model.logits(w)
                else:
                    w = torch.cat([w, torch.zeros(1, (-rows) % block, dtype=torch.long)], dim=1)
                    ctx = ForwardContext.training(w.shape[1], block, model.device)
                    model.hidden_states(torch.cat([w, torch.full_like(w, c.mask_token_id)], dim=1), ctx)
    return counts, tokens


@pytest.mark.parametrize("mode", ["commit", "preview"])
def test_counts_equal_a_direct_count_of_route_events(gen_model, mode):
    docs = corpus()
    engine = Engine(gen_model)
    stats = route_stats(engine, docs, mode=mode, batch_size=1, seq_len=32)
    want, tokens = direct_counts(gen_model, docs, mode, 32, engine.block_size)
    np.testing.assert_array_equal(stats.counts, want)
    k = gen_model.config.num_experts_per_tok
    assert stats.tokens == tokens == sum(map(len, docs))
    assert stats.counts.sum(1).tolist() == [tokens * k] * gen_model.config.num_hidden_layers
    np.testing.assert_array_equal(np.diagonal(stats.coactivation, axis1=1, axis2=2), stats.counts)
    assert (stats.coactivation == stats.coactivation.transpose(0, 2, 1)).all()
    # counts by token id add up to the counts
    by_token = sum(stats.by_token(t) for t in {t for d in docs for t in d})
    np.testing.assert_array_equal(by_token, stats.counts)
    assert (0 < stats.entropy()).all() and (stats.entropy() <= np.log2(gen_model.config.num_experts)).all()
    assert ((0 < stats.load_entropy()) & (stats.load_entropy() <= 1)).all() and (stats.load_balance() >= 1).all()


def test_batched_windows_route_as_one_at_a_time(gen_model):
    """Windows of different lengths padded into batches: the padding is never counted."""
    docs = corpus(7, seed=1)
    one = route_stats(Engine(gen_model), docs, batch_size=1, seq_len=24)
    many = route_stats(Engine(gen_model), docs, batch_size=4, seq_len=24)
    assert many.tokens == one.tokens
    # a batched GEMM may round differently: allow a near-tie to flip in a handful of slots
    assert np.abs(many.counts - one.counts).sum() <= 0.01 * one.counts.sum()
    np.testing.assert_allclose(many.entropy(), one.entropy(), rtol=1e-4)


def test_the_file_round_trips_and_merges(gen_model, tmp_path):
    docs = corpus()
    a = route_stats(Engine(gen_model), docs[:2], batch_size=2, seq_len=32)
    b = route_stats(Engine(gen_model), docs[2:], batch_size=2, seq_len=32)
    both = route_stats(Engine(gen_model), docs, batch_size=2, seq_len=32)
    merged = a.merge(b)
    assert merged.tokens == both.tokens
    path = merged.save(tmp_path / "routes.npz")
    back = RouteStats.load(path)
    for name in ("counts", "coactivation", "token_keys", "token_slots", "entropy_sum"):
        np.testing.assert_array_equal(getattr(back, name), getattr(merged, name))
    with np.load(path) as f:
        L, E = gen_model.config.num_hidden_layers, gen_model.config.num_experts
        assert f["counts"].shape == (L, E) and f["coactivation"].shape == (L, E, E)
    with pytest.raises(ValueError, match="merge"):
        a.merge(route_stats(Engine(gen_model), docs[:1], mode="preview", seq_len=32))
    (tmp_path / "junk.npz").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="route statistics"):
        RouteStats.load(tmp_path / "junk.npz")


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="both"), "mode"), (dict(batch_size=0), "batch_size"), (dict(seq_len=0), "seq_len"),
    (dict(mode="preview", seq_len=3), "block"),
])
def test_bad_arguments_are_named(gen_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        route_stats(Engine(gen_model), corpus(1), **kwargs)


def test_bad_data_is_named(gen_model, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        route_stats(Engine(gen_model), [tmp_path / "nowhere"])
    with pytest.raises(ValueError, match="tokenizer"):
        route_stats(Engine(gen_model), ["some text"])
    with pytest.raises(ValueError, match="vocabulary"):
        route_stats(Engine(gen_model), [[1, 2, 99999]])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_corpus(folder):
    folder.mkdir()
    g = torch.Generator().manual_seed(3)
    for i in range(5):
        words = torch.randint(0, 509, (int(40 + 13 * i),), generator=g).tolist()
        (folder / f"doc{i}.txt").write_text(" ".join(f"w{t}" for t in words))


@pytest.mark.slow  # torchrun, two ranks
def test_cli_routes_over_two_gloo_ranks_equals_one_process(gen_text_model_dir, tmp_path):
    """``torchrun --nproc-per-node 2 -m clover_lab.cli.main routes``: each rank takes every other
    window, the sums are all-reduced and rank 0 writes a file equal to one process's."""
    _write_corpus(tmp_path / "data")
    args = ["routes", "--model", str(gen_text_model_dir), "--data", str(tmp_path / "data"), "--batch-size", "1",
            "--seq-len", "32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    one = subprocess.run([sys.executable, "-m", "clover_lab.cli.main", *args, "--out", str(tmp_path / "one.npz")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(_free_port()),
                          "-m", "clover_lab.cli.main", *args, "--out", str(tmp_path / "two.npz")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = RouteStats.load(tmp_path / "one.npz"), RouteStats.load(tmp_path / "two.npz")
    assert a.tokens == b.tokens > 0
    for name in ("counts", "coactivation", "token_keys", "token_slots"):
        np.testing.assert_array_equal(getattr(b, name), getattr(a, name))
    np.testing.assert_allclose(b.entropy_sum, a.entropy_sum, rtol=1e-12)


def test_expert_view_opens_a_stats_file(gen_model, tmp_path):
    pytest.importorskip("ipywidgets")
    from clover_lab.widgets import ExpertView

    stats = route_stats(Engine(gen_model), corpus(), batch_size=2, seq_len=32)
    view = ExpertView.from_stats(stats.save(tmp_path / "routes.npz"))
    np.testing.assert_array_equal(view.usage("commit"), stats.counts)
    np.testing.assert_allclose(view.usage("commit", metric="router mass"), stats.mass)
    np.testing.assert_array_equal(view.coactivation(1, "commit"), stats.coactivation[1])
    np.testing.assert_array_equal(np.array(view.fig_usage.data[0].z), stats.counts)  # what is drawn
    rows = view.load_stats("commit")
    assert rows[0]["max/mean (actual)"] == pytest.approx(stats.load_balance()[0])
    assert view.frame_labels == [f"corpus: {stats.tokens} tokens (commit)"]
    view.close()
