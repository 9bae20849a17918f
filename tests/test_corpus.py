"""Tests moved from test_reliability_inputs.py."""
from pathlib import Path

import pytest
import torch

from clover_lab.errors import CorpusError, CorpusNotFoundError


# --------------------------------------------------------------------------- 1. corpora
@pytest.mark.parametrize("data,match", [
    ("nosuch.py", "bare string"), ("some text", "bare string"), (".", "bare string"), ("/", "bare string"),
    (Path("/"), "filesystem root"), (["nosuch.py"], r"reads as a path.*Path\('nosuch.py'\)"),
    (["docs/"], "reads as a path"), ([], "empty"), (None, "NoneType"), (5, "int 5"), ([""], "empty text"),
    ([[]], "non-empty list of token ids"), (torch.tensor([1.0]), "integers"), ([[1, 2], [3, 99999]], "vocabulary"),
    (torch.zeros(0, dtype=torch.long), "empty"),
])
def test_a_corpus_is_what_it_says(tiny_engine, data, match):
    from clover_lab.lens.routing_stats import route_stats

    with pytest.raises(CorpusError, match=match):
        route_stats(tiny_engine, data, seq_len=32)


def test_empty_unmatched_binary_and_missing_corpora_are_named(tiny_text_engine, tmp_path):
    from clover_lab.lens.routing_stats import route_stats

    (tmp_path / "empty").mkdir()
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(b"\x89PNG")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.txt").write_bytes(b"\x00\xff\xfe\x00")
    (tmp_path / "blank.txt").write_text("")
    for data, match in [(tmp_path / "empty", "no text files"), (tmp_path / "images", "no text files"),
                        (tmp_path / "bin", "no file in the folder .* is readable"),
                        (tmp_path / "bin" / "a.txt", "not readable UTF-8"), (tmp_path / "blank.txt", "no tokens"),
                        ([tmp_path / "nowhere"], "nowhere.*does not exist")]:
        with pytest.raises(CorpusError, match=match):
            route_stats(tiny_text_engine, data, seq_len=32)
    with pytest.raises(CorpusNotFoundError):  # still a FileNotFoundError
        route_stats(tiny_text_engine, tmp_path / "nowhere")
    # a folder's binary file is skipped with a warning; hidden folders are not read
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("w1 w2 w3")
    (tmp_path / "mixed" / "b.txt").write_bytes(b"\x00\x01")
    (tmp_path / "mixed" / ".venv").mkdir()
    (tmp_path / "mixed" / ".venv" / "c.txt").write_text("w4 " * 50)
    with pytest.warns(UserWarning, match="1 of 2 files"):
        stats = route_stats(tiny_text_engine, tmp_path / "mixed", seq_len=32)
    assert stats.tokens == 3
    # texts and paths side by side, each what it says
    both = route_stats(tiny_text_engine, [tmp_path / "mixed" / "a.txt", "w5 w6"], seq_len=32)
    assert both.tokens == 5
