"""What ``clover-lab generate`` prints: the live view of the current block, the result with its
statistics (one table per row for a batch), and what was committed when Ctrl-C interrupted."""
from __future__ import annotations

import json
import time

MASK_GLYPH = "░"


def text_of(engine, ids: list[int]) -> str:
    if engine.tokenizer is None:
        return " ".join(map(str, ids))
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def print_interrupted(engine, args, committed: dict, seconds: float) -> None:
    """``committed``: row -> the tokens it had committed (row None: a single generation)."""
    if args.json:
        def entry(ids):
            text = None if engine.tokenizer is None else text_of(engine, ids)
            return {"text": text, "token_ids": ids, "interrupted": True,
                    "stats": {"new_tokens": len(ids), "seconds": seconds}}

        if None in committed or not committed:
            print(json.dumps(entry(committed.get(None, []))))
        else:
            print(json.dumps({"results": [entry(committed[r]) for r in sorted(committed)], "interrupted": True}))
        return
    from rich.console import Console

    console = Console()
    for row, ids in sorted(committed.items(), key=lambda kv: -1 if kv[0] is None else kv[0]) or [(None, [])]:
        label = "" if row is None else f"row {row}: "
        console.print(f"[bold yellow]interrupted[/] {label}after {len(ids)} committed tokens ({seconds:.2f} s):")
        console.print(text_of(engine, ids), markup=False, highlight=False)


def print_result(engine, result) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if result.text is not None:
        console.print(result.text, markup=False, highlight=False)
    else:
        console.print("token ids: " + " ".join(map(str, result.token_ids)), markup=False, highlight=False)
    st = result.stats
    table = Table(title="statistics", show_header=False, box=None, padding=(0, 2))
    rows = [
        ("mode", st.mode), ("stop reason", st.stop_reason),
        ("prompt / new tokens", f"{st.prompt_tokens} / {st.new_tokens}"),
        ("forwards", f"{st.forwards} ({st.preview_forwards} previews, {st.fused_forwards} fused, "
                     f"{st.commit_forwards} commits)"),
        ("tokens per forward", f"{st.tokens_per_forward:.2f}"),
        ("tokens per second", f"{st.tokens_per_second:.1f}"),
    ]
    if st.mode == "diffusion":
        rows.append(("blocks / mean steps per block", f"{st.blocks} / {st.mean_steps_per_block or 0:.2f}"))
    if st.mode == "speculative":
        rows.append(("blocks / drafted / accepted / rejected",
                     f"{st.blocks} / {sum(st.drafted)} / {sum(st.accepted)} / {sum(st.rejected)} "
                     f"({st.mean_accepted or 0:.2f} accepted per block)"))
    if st.seconds_per_preview is not None:
        rows.append(("time per preview", f"{st.seconds_per_preview * 1e3:.2f} ms"))
    if st.seconds_per_commit is not None:
        rows.append(("time per commit", f"{st.seconds_per_commit * 1e3:.2f} ms"))
    rows += [("prefill", f"{st.prefill_seconds * 1e3:.1f} ms"), ("decode", f"{st.decode_seconds:.3f} s")]
    if st.seed is not None:
        rows.append(("seed", str(st.seed)))
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)


def print_batch(engine, results) -> None:
    """Each row's text and statistics, then the batch's."""
    from rich.console import Console
    from rich.rule import Rule

    console = Console()
    for row, result in enumerate(results):
        console.print(Rule(f"row {row}"))
        print_result(engine, result)
    st = results.stats
    console.print(Rule("batch"))
    console.print(f"{st.rows} rows, {st.new_tokens} new tokens in {st.forwards} shared forwards "
                  f"({st.tokens_per_forward:.2f} per forward), {st.tokens_per_second:.1f} tokens/s; "
                  f"prefill {st.prefill_seconds * 1e3:.1f} ms, decode {st.decode_seconds:.3f} s", highlight=False)


class LiveView:
    """The committed text, then the current block: provisional tokens in colour, masks as ░."""

    def __init__(self, engine, args):
        from rich.console import Console

        self.engine = engine
        self.console = Console()
        self.live = None
        self.last_refresh = 0.0
        self.blocks = 0

    def start(self):
        from rich.live import Live

        self.live = Live(self._render(None), console=self.console, auto_refresh=False, transient=True)
        self.live.start()

    def stop(self):
        if self.live is not None:
            self.live.stop()
            self.live = None

    def show(self, update):
        now = time.perf_counter()
        if update.kind == "step" and now - self.last_refresh < 0.05:
            return  # ~20 frames per second at most: the view must not slow generation down
        self.last_refresh = now
        self.live.update(self._render(update), refresh=True)

    def _render(self, update):
        from rich.panel import Panel
        from rich.text import Text

        text = Text()
        if update is None:
            return Panel(Text("prefilling the prompt ...", style="dim"), title="clover-lab")
        text.append(text_of(self.engine, update.committed), style="bold")
        if update.kind == "step":
            if update.committed:
                text.append(" ")
            unmasked = set(update.unmasked)
            for pos, piece in enumerate(update.block_pieces()):
                if piece is None:
                    text.append(MASK_GLYPH, style="dim")
                else:
                    text.append(piece if self.engine.tokenizer is not None else piece + " ",
                                style="black on yellow" if pos in unmasked else "yellow")
        footer = f"block {update.block}" + (f" step {update.step}" if update.step is not None else "") + \
                 f" | {len(update.committed)} tokens committed | {update.time:.2f} s"
        return Panel(text, title="clover-lab generate", subtitle=footer)
