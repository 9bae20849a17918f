"""Newline+indent tokens written apart (clover_lab.train.newlines), as a prompt that ends on a newline tokenizes them."""
import pytest
import torch

from clover_lab.checkpoint.loading import default_model_dir, load_tokenizer
from clover_lab.train.loop import training_batch
from clover_lab.train.newlines import newline_splits, split_newlines
from clover_lab.train.objective import TrainSettings


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_dir())  # the specimen's byte-level BPE


@pytest.fixture(scope="module")
def splits(tok):
    return newline_splits(tok)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_prompt_that_ends_on_a_newline_ends_on_a_token_the_whole_text_never_holds(tok, splits):
    newline, table = splits
    assert ids(tok, "def f(x):\n") == ids(tok, "def f(x):") + [newline]
    whole = ids(tok, "def f(x):\n    return x\n")
    assert newline not in whole[:-1] and table[whole[len(ids(tok, "def f(x):"))]] >= 0  # "\n   " is one token


def test_every_split_is_the_same_text(tok, splits):
    newline, table = splits
    assert tok.decode([newline]) == "\n"
    kinds = (table >= 0).nonzero().flatten().tolist()
    assert len(kinds) >= 8  # newline + 1, 2, 3, ... spaces
    for i in kinds:
        assert tok.decode([newline, int(table[i])]) == tok.decode([i]), tok.decode([i])
    assert table[newline] == -1 and table[ids(tok, "def")[0]] == -1


def test_rows_split_at_the_share_keep_their_length_and_text(tok, splits):
    text = "class A:\n    def f(self, x):\n        if x:\n            return 1\n        return 2\n"
    row = torch.tensor([ids(tok, text)] * 3)
    merged = int((splits[1][row[0]] >= 0).sum())
    assert merged == 4
    all_split = split_newlines(row, splits, 1.0, torch.Generator().manual_seed(0))
    assert all_split.shape == row.shape
    assert text.startswith(tok.decode(all_split[0].tolist()))  # the same text, cut at the end
    assert int((splits[1][all_split[0]] >= 0).sum()) == 0 and all_split[0].tolist().count(splits[0]) >= merged - 1
    assert torch.equal(split_newlines(row, splits, 0.0, torch.Generator()), row)
    some = split_newlines(row.repeat(40, 1), splits, 0.5, torch.Generator().manual_seed(1))
    changed = (some != row.repeat(40, 1)).any(1).float().mean()
    assert 0.5 < changed < 1.0  # most rows hold a split, not every one (0.5 ** 4 of them none)
    assert all(text.startswith(tok.decode(r.tolist())) for r in some)


def test_a_training_batch_splits_its_rows_newlines_at_the_settings_share(tok, splits):
    text = "def f(x):\n    y = x\n    return y\n" * 20
    tokens = torch.tensor(ids(tok, text), dtype=torch.int32)
    s = TrainSettings(seq_len=32, batch_size=4)
    plain = training_batch(tokens, None, s, torch.Generator().manual_seed(0), newlines=splits)
    assert int((splits[1][plain] >= 0).sum()) > 0  # split_newlines 0: nothing split
    s.split_newlines = 1.0
    split = training_batch(tokens, None, s, torch.Generator().manual_seed(0), newlines=splits)
    assert split.shape == (4, 32) and int((splits[1][split] >= 0).sum()) == 0
    assert all(tok.decode(r.tolist()) in text for r in split)  # windows of the same text


def test_the_share_is_checked_up_front(tmp_path, capsys):
    from clover_lab.train.loop import main

    with pytest.raises(SystemExit) as info:
        main(["--out", str(tmp_path / "run"), "--split-newlines", "1.5"])
    assert info.value.code == 2 and "--split-newlines must be in [0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
