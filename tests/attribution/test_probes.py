"""Linear probes over (layer, step) with a shuffled-label control (issue 51)."""
import pytest
import torch

from clover_lab import attribution
from clover_lab.attribution.probes import ProbeRow, ProbeRows
from clover_lab.errors import InputError

pytestmark = pytest.mark.usefixtures("gen_one_thread")


def _planted(n_prompts=12, per=24, H=16, seed=0):
    """Rows whose label layer 1 carries linearly (plus noise) and layer 0 does not carry at all."""
    g = torch.Generator().manual_seed(seed)
    rows, x0, x1 = [], [], []
    for k in range(n_prompts):
        for j in range(per):
            step = j % 2
            label = int(torch.rand(1, generator=g) < 0.5)
            rows.append(ProbeRow(k, 0, step, 10 + j, step + label, 3))
            x0.append(torch.randn(H, generator=g))
            x1.append(torch.randn(H, generator=g) + 2.0 * (2 * label - 1) * torch.eye(H)[0])
    return ProbeRows(rows, {0: torch.stack(x0), 1: torch.stack(x1)}, "output", n_prompts)


def test_a_planted_label_is_found_and_the_control_stays_at_chance():
    pm = attribution.probe_map(_planted(), attribution.unmasks_next_step)
    assert pm.layers == [0, 1] and pm.steps == [0, 1] and all(c > 50 for c in pm.counts)
    assert (pm.accuracy[1] > 0.9).all()  # the planted direction, held out by prompt
    assert (pm.accuracy[0] < pm.chance + 0.15).all()  # noise reads nothing
    assert (pm.control < pm.chance + 0.15).all()  # shuffled labels: no better than chance
    assert pm.best()[:2] in [(1, 0), (1, 1)]
    assert len(pm.train_prompts) == 6


def test_rows_of_real_generations(tiny_engine):
    prompts = [[5, 17, 33, 100], [9, 77, 301, 12], [64, 2, 8, 90]]
    data = attribution.probe_rows(tiny_engine, prompts, max_new_tokens=16, threshold=0.9)
    assert {r.prompt for r in data.rows} == {0, 1, 2}
    assert all(r.unmask_step >= r.step and 4 <= r.position < 20 for r in data.rows)
    assert set(data.values) == {0, 1, 2, 3} and data.values[0].shape == (len(data.rows), 64)
    # every position is read at each step up to the one that unmasks it
    for k in range(3):
        mine = [r for r in data.rows if r.prompt == k]
        assert len(mine) == sum(r.unmask_step + 1 for r in mine if r.step == 0)
    with pytest.raises(InputError, match="at least two prompts"):
        attribution.probe_rows(tiny_engine, [5, 17], max_new_tokens=4)
    with pytest.raises(InputError, match="expected an int >= 0 or None"):
        attribution.probe_map(data, lambda r: "yes")
