"""Functions as (head, body) pairs (clover_lab.train.functions): the prompt-following corpus and its measure."""
import textwrap

import pytest
import torch

from clover_lab.train import functions as fn
from clover_lab.train.functions import arguments, uses_arguments
from clover_lab.train.loop import training_batch
from clover_lab.train.objective import TrainSettings

SOURCE = textwrap.dedent('''
    import os


    class Store:
        @property
        def size(self):
            """How many items.

            Counted now."""
            n = len(self.items)
            return n

        def one_liner(self): return 1

        def only_doc(self):
            """Nothing else."""

        def add(self, key,
                value):
            self.items[key] = value
            return value


    def walk(root):
        for name in os.listdir(root):
            yield name
''')


def test_functions_are_cut_into_dedented_heads_and_bodies():
    found = {f.head.splitlines()[0]: f for f in fn.functions_of(SOURCE)}
    assert set(found) == {"def size(self):", "def add(self, key,", "def walk(root):"}  # no one-liner, no doc-only
    size = found["def size(self):"]
    assert size.head == 'def size(self):\n    """How many items.\n\n    Counted now."""'  # decorator left out
    assert size.body == "\n    n = len(self.items)\n    return n\n"
    assert found["def add(self, key,"].head == "def add(self, key,\n        value):"  # a signature over two lines
    assert found["def walk(root):"].body == "\n    for name in os.listdir(root):\n        yield name\n"
    assert fn.functions_of("def broken(:\n") == []


def test_a_head_encodes_as_the_prefix_of_its_function():
    from clover_lab.checkpoint.loading import default_model_dir, load_tokenizer

    tok = load_tokenizer(default_model_dir())  # the specimen's byte-level BPE
    encoded = fn.encode_functions(tok, fn.functions_of(SOURCE))
    assert len(encoded) == 3
    for (ids, head), f in zip(encoded, fn.functions_of(SOURCE)):
        assert tok.decode(ids[:head].tolist()) == f.head and tok.decode(ids.tolist()) == f.head + f.body
        assert tok(f.head)["input_ids"] == ids[:head].tolist()  # what a prompt of the head gives


def test_function_rows_start_at_a_head_and_end_each_function_with_eos():
    a, b = torch.tensor([5, 6, 7], dtype=torch.int32), torch.tensor([8, 9], dtype=torch.int32)
    rows = fn.function_rows([(a, 1), (b, 1)], 20, 16, eos=0, gen=torch.Generator().manual_seed(0))
    assert rows.shape == (20, 16) and rows.dtype == torch.long
    for row in rows.tolist():
        assert row[0] in (5, 8)
        pieces = [p for p in " ".join(map(str, row)).split(" 0") if p.strip()]
        assert all(p.split() in (["5", "6", "7"], ["8", "9"]) for p in pieces[:-1])  # whole functions between EOS
    with pytest.raises(ValueError, match="no functions"):
        fn.function_rows([], 1, 16, 0, torch.Generator())


def test_a_training_batch_mixes_windows_and_function_rows():
    tokens = torch.arange(100, 1100, dtype=torch.int32)
    funcs = [(torch.tensor([1, 2, 3], dtype=torch.int32), 1)]
    s = TrainSettings(seq_len=16, batch_size=8, functions_share=0.25)
    batch = training_batch(tokens, None, s, torch.Generator().manual_seed(0), funcs, eos=0)
    assert batch.shape == (8, 16)
    assert [int(r[0]) >= 100 for r in batch] == [True] * 6 + [False] * 2  # 6 windows, 2 function rows
    assert batch[-1, :4].tolist() == [1, 2, 3, 0]
    s.distill_share = 0.9
    with pytest.raises(ValueError, match="exceed the batch"):
        training_batch(tokens, torch.zeros(4, 16, dtype=torch.int32), s, torch.Generator(), funcs)


def test_prompt_gain_is_the_bodys_loss_after_another_head_minus_after_its_own(gen_model):
    g = torch.Generator().manual_seed(1)
    funcs = [(torch.randint(3, 500, (int(n),), generator=g, dtype=torch.int32), int(h))
             for n, h in ((30, 5), (25, 9), (40, 3), (4, 2))]  # the last has too short a body
    figures = fn.prompt_gain(gen_model, funcs, body_tokens=12, batch=2)
    assert figures["functions"] == 3
    usable = funcs[:3]

    def loss(head, body):  # one row alone, no padding
        logits = gen_model.logits(torch.cat([head, body]).long()[None]).float()[0]
        return torch.nn.functional.cross_entropy(logits[len(head) - 1:len(head) - 1 + len(body)], body.long(),
                                                 reduction="sum").item(), len(body)

    bodies = [ids[h:h + 12] for ids, h in usable]
    heads = [ids[:h] for ids, h in usable]
    own = [loss(h, b) for h, b in zip(heads, bodies)]
    other = [loss(h, b) for h, b in zip(heads[1:] + heads[:1], bodies)]
    mean = lambda xs: sum(x for x, _ in xs) / sum(n for _, n in xs)  # noqa: E731
    assert figures["own"] == pytest.approx(mean(own), rel=1e-4)
    assert figures["other"] == pytest.approx(mean(other), rel=1e-4)
    assert figures["gain"] == pytest.approx(mean(other) - mean(own), abs=1e-4)


def test_argument_use_names_the_prompts_arguments():
    assert arguments("def f(a, b=1, *rest, key, **extra):") == ["a", "b", "key", "rest", "extra"]
    assert arguments("class Matrix:\n    def __init__(self, rows):") == ["rows"]
    assert arguments("class A:\n    def __init__(self):") == [] and arguments("x = (") == []
    assert uses_arguments("def is_prime(n):", "\n    if n < 2:\n        return False") is True
    assert uses_arguments("def is_prime(n):", "\n    return self._get_name()") is False  # 'n' only inside words
    assert uses_arguments("class A:\n    def __init__(self):", "\n        self.x = 1") is None


def test_head_prompts_end_where_a_head_ends_after_an_eos():
    a, b = torch.tensor([5, 6, 7, 8], dtype=torch.int32), torch.tensor([20, 21, 22, 23, 24, 25, 26], dtype=torch.int32)
    prompts, heads = fn.head_prompts([(a, 2), (b, 3)], 30, 8, eos=0, gen=torch.Generator().manual_seed(0))
    assert prompts.shape == (30, 8)
    for row, h in zip(prompts.tolist(), heads):
        head = [5, 6] if h == 2 else [20, 21, 22]
        assert row[-len(head) - 1:] == [0] + head  # the head follows an EOS, as in function_rows
    assert {tuple(r[-2:]) for r in prompts.tolist()} == {(5, 6), (21, 22)}  # both heads drawn
    with pytest.raises(ValueError, match="shorter than 2"):
        fn.head_prompts([(b, 3)], 1, 2, 0, torch.Generator())


def test_the_measures_function_prompts_are_heads_that_take_arguments():
    from clover_lab.checkpoint.loading import default_model_dir, load_tokenizer
    from clover_lab.train.measure import function_prompts

    tok = load_tokenizer(default_model_dir())
    encoded = fn.encode_functions(tok, fn.functions_of(SOURCE))
    heads = sorted(tok.decode(p) for p in function_prompts(tok, encoded))
    assert heads == ["def add(self, key,\n        value):", "def walk(root):"]  # not size(self)
    assert len(function_prompts(tok, encoded, count=1)) == 1
