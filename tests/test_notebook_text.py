"""A notebook's prose states no measured figure its cells do not produce.

Text drifts from outputs: 04 said erasing the memory "changes 42 of the 48 tokens" while its cell
printed 29. So a markdown cell (and a code comment) may state settings ("48 tokens", "threshold
0.9") but no *measured* figure: a rate (tokens/s, tokens per forward, ms, x faster), a percentage,
or a count out of a total ("42 of 48"). Such a figure belongs in a cell's output; in text it must
say "about" (and why it moves), or be listed in ALLOWED with the reason it is not this lab's
measurement (a vendor's published figure).
"""
import json
import re
from pathlib import Path

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))

_NUMBER = r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:\s*-\s*\d+(?:\.\d+)?)?"
MEASURED = [
    re.compile(_NUMBER + r"\s*(?:%|x\b|×|tokens?/s\b|tok/s\b|ms\b|s\b|MB\b|GB\b|tokens? per (?:forward|preview)\b)"),
    re.compile(r"(?<![\w.])\d+(?:\.\d+)? (?:of|out of) (?:the |its )?\d+(?:\.\d+)?\b"),
]
APPROXIMATE = re.compile(r"\babout\b|~|\broughly\b", re.IGNORECASE)

# (notebook stem, the figure as the text states it): why it may stand in prose
ALLOWED = {
    ("05_speed", "515 tokens/s"): "the vendor's published figure for the 35B model on an H200, not measured here",
    ("05_speed", "2.23 ms"): "SGLang's published TPOT of Qwen3.6-35B-A3B with MTP on an H200 (BF16), not measured here",
    ("05_speed", "1.98 ms"): "SGLang's published TPOT of Qwen3.6-35B-A3B with MTP on an H200 (FP8), not measured here",
}


def measured_figures(text: str) -> list[str]:
    """The measured figures ``text`` states outside a sentence that says "about"."""
    found = []
    for sentence in re.split(r"(?<=[.;:!?])\s+|\n\s*\n", text):
        if APPROXIMATE.search(sentence):
            continue
        for pattern in MEASURED:
            found += [m.group().strip() for m in pattern.finditer(sentence)]
    return found


def prose(cell) -> str:
    """A markdown cell's text, or a code cell's comments."""
    source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    if cell["cell_type"] == "markdown":
        return re.sub(r"`[^`]*`", "", source)  # code spans name things; they measure nothing
    return "\n".join(line.split("#", 1)[1] for line in source.splitlines() if "#" in line and "'#'" not in line)


def test_the_check_finds_measured_figures():
    # what the notebooks said before, each a figure a cell had stopped producing
    assert measured_figures("erasing the memory at every commit changes 42 of the 48 tokens") == ["42 of the 48"]
    assert measured_figures("The AR line ran at 14 tok/s.") == ["14 tok/s"]
    assert measured_figures("hook costs: -9 % and -22 %") == ["-9 %", "-22 %"]
    assert measured_figures("then the steps are 2-3x faster.") == ["2-3x"]
    assert measured_figures("it makes 1.91 tokens per forward at threshold 0.9") == ["1.91 tokens per forward"]
    # settings, definitions and approximations with their reason are prose
    assert measured_figures("48 new tokens at threshold 0.9, block size 16, layer 2") == []
    assert measured_figures("about 2 tokens per forward on this prompt (it varies with the prompt)") == []


def test_notebook_text_states_no_measured_figure():
    stray = []
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        for i, cell in enumerate(cells):
            for figure in measured_figures(prose(cell)):
                if (path.stem, figure) not in ALLOWED:
                    stray.append(f"{path.name} cell {i}: {figure!r}")
    assert not stray, ("measured figures in notebook text (print them from a cell, or say 'about' and why): "
                       + "; ".join(stray))
