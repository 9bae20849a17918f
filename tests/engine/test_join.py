"""Rows join a running batch at block boundaries (Engine.stream's join, what the server's
continuous batching uses): every row, joined early or late, gives the tokens its prompt gives
alone (greedy, float32), on the eager forward and on the static steps."""
import pytest
import torch

import clover_lab
from clover_lab.engine.requests import GenerationError

PROMPTS = ["def parse(line):\n", "import os\n", "class Stack:\n    def push(self, x):\n", "x = [", "# read\n"]


@pytest.fixture(scope="module")
def engine():
    return clover_lab.load(dtype=torch.float32)


def joining(engine, plan):
    """A join source handing over plan[k] at the k-th block boundary; records the rooms asked."""
    calls = []

    def join(room):
        calls.append(room)
        k = len(calls) - 1
        return [engine.encode(p) for p in plan[k]] if k < len(plan) else []

    return join, calls


@pytest.mark.parametrize("static", [False, True])
def test_rows_joining_at_block_boundaries_give_their_own_tokens(engine, static):
    alone = [engine.generate(p, max_new_tokens=40).token_ids for p in PROMPTS]
    engine.step_graphs = static
    try:
        join, calls = joining(engine, [[], [PROMPTS[1]], [PROMPTS[2], PROMPTS[3]], [], [PROMPTS[4]]])
        updates = list(engine.stream([engine.encode(PROMPTS[0])], max_new_tokens=40, join=join, capacity=256))
    finally:
        engine.step_graphs = None
    result = updates[-1].result
    assert [r.token_ids for r in result] == alone
    assert result.stats.rows == 5 and calls[0] >= 256 - 40  # the static path rounds its cache up
    commits = [u for u in updates if u.kind == "commit" and u.row == 4]
    assert [u.block for u in commits] == list(range(len(commits)))  # a late row counts its own blocks
    done = [u.row for u in updates if u.kind == "done"]
    assert sorted(done) == [0, 1, 2, 3, 4]


def test_join_is_refused_where_it_cannot_apply(engine):
    with pytest.raises(GenerationError, match="join"):
        engine.stream([engine.encode("x")], mode="ar", join=lambda room: [])
    with pytest.raises(GenerationError, match="join"):
        engine.stream(engine.encode("x"), join=lambda room: [])
    with pytest.raises(GenerationError, match="capacity"):
        engine.stream([engine.encode("x")], join=lambda room: [], capacity=10**9)
