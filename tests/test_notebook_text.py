"""A notebook's prose states no measured figure its cells do not produce.

Text drifts from outputs: 04 said erasing the memory "changes 42 of the 48 tokens" while its cell
printed 29. So a markdown cell (and a code comment) may state settings ("48 tokens", "threshold
0.9") but no *measured* figure: a rate (tokens/s, tokens per forward, ms, x faster), a percentage,
or a count out of a total ("42 of 48"). Such a figure belongs in a cell's output; in text it must
say "about" (and why it moves), or be listed in ALLOWED with the reason it is not this lab's
measurement (a vendor's published figure).

Words state results too: 06 said patching layer 0 "makes the run the clean one" where its map read
0.94, 05 that a no-op hook is "nearly free" where the runs spread by 33%. So a sentence that compares
("faster", "cheaper", "better", "nearly free", "the clean one", "wins", "drifts", ...) is a result and
belongs in a cell's output, computed from the numbers it compares; in text it may only define how to
read an axis ("higher is faster") or be listed in ALLOWED_CLAIMS with the reason it is not a result
of this notebook's cells.
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


# comparisons and verdicts: each states how two measurements relate, which only a cell can know
CLAIMS = re.compile(
    r"\b(?:faster|slower|quicker|cheaper|costlier|dearer|better|worse|wins?|loses|beats|outperforms?|drifts?"
    r"|negligible|(?:nearly|almost|practically|essentially|virtually) (?:free|nothing|identical|the same|uniform(?:ly)?)"
    r"|(?:for|is|are|comes?|come) free|the clean one|much (?:more|less|fewer|faster|slower|better|worse))\b",
    re.IGNORECASE)
# how to read an axis or a setting, not a result: "TPF (higher is faster)"
DEFINITION = re.compile(r"\b(?:higher|lower|more|fewer|larger|smaller) (?:is|means) (?:faster|slower|better|worse|cheaper)\b",
                        re.IGNORECASE)

# (notebook stem, the claim's word as the text states it): why it may stand in prose
ALLOWED_CLAIMS = {
    ("01_quickstart", "cheaper"): "defines the prompt gain (how much cheaper, in nats per token), which the cell measures",
    ("05_speed", "wins"): "the condition under which block diffusion is faster (a mechanism), not a measured result",
    ("05_speed", "faster"): "the README's measurement of compiled steps, said as such; the cell prints its own",
    ("03_expert_routing", "almost uniformly"): "a remark on checkpoints early in training, not on this notebook's run",
    ("03_expert_routing", "drift"): "a property of the design (commits route over every expert), not a measurement",
}


def claims(text: str) -> list[str]:
    """The comparisons ``text`` states as results (not definitions of an axis)."""
    found = []
    for sentence in re.split(r"(?<=[.;:!?])\s+|\n\s*\n", text):
        sentence = DEFINITION.sub("", sentence)
        found += [m.group() for m in CLAIMS.finditer(sentence)]
    return found


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


def test_the_check_finds_claims():
    # what the notebooks said before, each a result no cell computed
    assert claims("Layer 0's input at the differing position is the token itself: patched, the run is the clean one") \
        == ["the clean one"]
    assert claims("An attached hook costs what it does: a no-op is nearly free; a view copies its numbers.") \
        == ["nearly free"]
    assert claims("the response drifts once it needs what only the GDN memory held") == ["drifts"]
    assert claims("then the steps are about 2-3x faster") == ["faster"]  # "about" excuses a figure, not a verdict
    # how to read an axis, settings and definitions are prose
    assert claims("tokens per forward (TPF, higher is faster), mean steps per block") == []
    assert claims("a coreset holds the top-k to one expert fewer than the model has") == []


def test_notebook_text_states_no_claim_a_cell_does_not_compute():
    stray = []
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        for i, cell in enumerate(cells):
            for claim in claims(prose(cell)):
                if (path.stem, claim.lower()) not in ALLOWED_CLAIMS:
                    stray.append(f"{path.name} cell {i}: {claim!r}")
    assert not stray, ("comparisons stated in notebook text (compute them in a cell and print the sentence, or "
                       "list them in ALLOWED_CLAIMS with why they are not a result): " + "; ".join(stray))


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
