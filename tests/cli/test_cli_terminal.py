"""``clover-lab generate`` in a real terminal: the CLI runs under a pseudo-terminal (so rich draws
its live view as it does for a user) and the frames it drew are read back: the prompt is shown,
the committed text runs on into the block without a space of its own, a batch has a live view of
one line per row, AR's footer counts tokens, and the statistics' parts add up. Plus the thread
count each model gets."""
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest
import torch

from clover_lab import cpu
from clover_lab.cli import main as cli
from clover_lab.cli.view import LiveView

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")


def run_in_terminal(*argv, columns: int = 100, timeout: float = 240.0) -> tuple[int, str]:
    """Run ``clover-lab`` on a pseudo-terminal ``columns`` wide; (exit code, everything it drew,
    escape sequences removed)."""
    master, slave = pty.openpty()
    env = dict(os.environ, COLUMNS=str(columns), LINES="40", TERM="xterm-256color", OMP_NUM_THREADS="1")
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-m", "clover_lab.cli.main", *map(str, argv)], stdin=slave, stdout=slave,
                            stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.time() + timeout
    try:
        while time.time() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=max(deadline - time.time(), 1))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return code, ANSI.sub("", b"".join(chunks).decode("utf-8", "replace"))


def frames(out: str, title: str) -> list[str]:
    """The live view's panels (their lines joined), by the title on their top border."""
    found, current = [], None
    # a redraw moves the cursor up (escapes removed above): its top border may follow the last bottom one
    for line in out.replace("╭", "\n╭").split("\n"):
        if title in line and line.lstrip().startswith("╭"):
            current = []
        elif current is not None:
            if line.lstrip().startswith("╰"):
                found.append("\n".join(current + [line]))
                current = None
            else:
                current.append(line.strip().strip("│").strip())
    return found


@pytest.mark.slow  # a terminal process
def test_live_view_shows_the_prompt_then_the_text_without_a_stray_space(gen_text_model_dir):
    code, out = run_in_terminal("generate", "--model", gen_text_model_dir, "--prompt", "w5 w6 w7",
                                "--max-new-tokens", 40, "--threshold", 0.95)
    assert code == 0, out[-2000:]
    live = [f for f in frames(out, "clover-lab generate") if "block" in f]
    assert live, out[-2000:]
    assert all(f.startswith("w5 w6 w7") for f in live)  # every frame starts with the prompt
    # the word-level tokenizer separates words by one space: never two, never none (w7w10)
    body = " ".join(line for f in live for line in f.split("\n")[:-1])
    assert not re.search(r"w\d+w\d+", body) and "w7  w" not in body
    # the statistics' parts add up, and say the prefill is not counted
    m = re.search(r"forwards \(after the prefill\)\s+(\d+) = (.+)", out)
    assert m, out[-2000:]
    parts = [int(n) for n in re.findall(r"(\d+) (?:previews?|fused commit\+preview|commits?)", m.group(2))]
    assert sum(parts) == int(m.group(1))
    assert "the prefill not counted" in out


@pytest.mark.slow  # a terminal process
def test_ar_footer_counts_tokens(gen_text_model_dir):
    code, out = run_in_terminal("generate", "--model", gen_text_model_dir, "--prompt", "w5 w6 w7", "--mode", "ar",
                                "--max-new-tokens", 30)
    assert code == 0, out[-2000:]
    footers = [f.split("\n")[-1] for f in frames(out, "clover-lab generate")]
    assert any("tokens committed" in f for f in footers), out[-2000:]
    assert not any("block" in f for f in footers)  # an AR token is not a block


@pytest.mark.slow  # a terminal process
def test_batch_has_a_live_view_of_one_line_per_row(gen_text_model_dir):
    code, out = run_in_terminal("generate", "--model", gen_text_model_dir, "--prompt", "w5 w6 w7", "--prompt",
                                "w8 w9", "--prompt", "w10", "--max-new-tokens", 40, "--threshold", 0.95, columns=90)
    assert code == 0, out[-2000:]
    live = frames(out, "clover-lab generate (batch)")
    assert live, out[-2000:]
    for f in live:
        lines = f.split("\n")
        rows = [line for line in lines if line.startswith("row ")]
        assert [r.split()[1] for r in rows] == ["0", "1", "2"]  # one line per row, none wrapped
        assert all(len(r) <= 90 for r in rows)
    assert any("w8 w9" in f for f in live) and any("block" in f for f in live)
    assert "row 2" in out and "batch" in out  # then each row's text and the batch's figures


def test_threads_suit_the_model(gen_model, monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cli.set_threads(gen_model, None) == 1  # a small model on the CPU: one thread
        torch.set_num_threads(2)
        monkeypatch.setattr(cpu, "SMALL_MODEL_PARAMETERS", 10)
        assert cli.set_threads(gen_model, None) == 2  # a large one: torch's default, left as it was
        assert cli.set_threads(gen_model, 3) == 3  # --threads wins
    finally:
        torch.set_num_threads(before)
    assert "--threads" in cli.build_parser()._subparsers._group_actions[0].choices["generate"].format_help()


def test_live_view_renders_token_ids_spaced(gen_model):
    """Without a tokenizer the view shows ids, one space between any two (prompt, text, block)."""
    from rich.console import Console

    import clover_lab

    engine = clover_lab.Engine(gen_model)
    view = LiveView(engine, None, [[5, 6, 7]])
    console = Console(record=True, width=400, force_terminal=False)
    for update in engine.stream([5, 6, 7], max_new_tokens=40, threshold=0.95):
        if update.kind == "step" and update.committed:
            console.print(view._render(update))
            break
    text = console.export_text()
    first = text.split("\n")[1].strip("│ ")
    assert first.startswith("5 6 7 ") and "  " not in first.rstrip()
