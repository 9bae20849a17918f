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
        ("forwards (after the prefill)", forwards_line(st)),
        ("tokens per forward", f"{st.tokens_per_forward:.2f} (new tokens / forwards; the prefill not counted)"),
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
    rows += [("prefill", f"{st.prefill_seconds * 1e3:.1f} ms in {st.prefill_forwards} forward"
                         + ("s" if st.prefill_forwards != 1 else "")), ("decode", f"{st.decode_seconds:.3f} s")]
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
    console.print(f"{st.rows} rows, {st.new_tokens} new tokens in {st.forwards} shared forwards after the prefill "
                  f"({st.tokens_per_forward:.2f} per forward), {st.tokens_per_second:.1f} tokens/s; "
                  f"prefill {st.prefill_seconds * 1e3:.1f} ms, decode {st.decode_seconds:.3f} s", highlight=False)


def forwards_line(st) -> str:
    """The forwards after the prefill, split into parts that add up: preview-only, fused (the
    previous block's commit and a preview in one forward) and commit-only forwards."""
    split = st.forward_split
    names = {"preview": ("preview", "previews"), "fused": ("fused commit+preview",) * 2, "commit": ("commit", "commits")}
    parts = [f"{n} {names[kind][n != 1]}" for kind, n in split.items() if n]
    return f"{st.forwards} = " + " + ".join(parts) if parts else "0"


def _tail(segments: list[tuple[str, str]], width: int) -> list[tuple[str, str]]:
    """The last ``width`` characters of styled ``segments`` (text, style) on one line: newlines
    shown as ⏎, an ellipsis where the start was cut."""
    flat = [(t.replace("\n", "⏎"), style) for t, style in segments]
    total = sum(len(t) for t, _ in flat)
    cut = max(total - width, 0) + (1 if total > width else 0)
    out = [("…", "dim")] if cut else []
    for t, style in flat:
        if cut >= len(t):
            cut -= len(t)
            continue
        out.append((t[cut:], style))
        cut = 0
    return out


def _row_line(segments: list[tuple[str, str]], width: int, prompt_first: bool) -> list[tuple[str, str]]:
    """A batch row's line in ``width`` characters: with ``prompt_first`` (the first segment is the
    row's prompt) the prompt's start stays in view, in at most a quarter of the line, and the rest
    is the tail of the text."""
    if not prompt_first or sum(len(t) for t, _ in segments) <= width:
        return _tail(segments, width)
    (prompt, style), rest = segments[0], segments[1:]
    keep = min(len(prompt), width // 4)
    start = prompt[:keep].replace("\n", "⏎") + ("…" if keep < len(prompt) else "")
    return [(start, style), (" ", style)] + _tail(rest, width - len(start) - 1)


class LiveView:
    """The prompt (dim), the committed text (bold), then the current block: provisional tokens in
    colour, masks as ░. A batch: one line per row, the start of its prompt (which row it is) and
    the tail of its text, each row with where it is; the footer counts blocks and steps (block diffusion) or tokens (AR)."""

    def __init__(self, engine, args, prompts: list | None = None):
        from rich.console import Console

        self.engine = engine
        self.console = Console()
        self.live = None
        self.last_refresh = 0.0
        self.mode = getattr(args, "mode", None) or "diffusion"
        self.prompts = list(prompts or [])  # the prompt of each row as the user gave it: text, or token ids
        self._prompt_cache: dict[int, list[int]] = {}
        self.rows: dict[int, object] = {}  # a batch: row -> its latest update

    def start(self):
        from rich.live import Live

        self.live = Live(self._render(None), console=self.console, auto_refresh=False, transient=True)
        self.live.start()

    def stop(self):
        if self.live is not None:
            self.live.stop()
            self.live = None

    def show(self, update):
        if update.row is not None:
            self.rows[update.row] = update
        now = time.perf_counter()
        if update.kind not in ("done", "batch") and now - self.last_refresh < 0.05:
            return  # ~20 frames per second at most: the view must not slow generation down
        self.last_refresh = now
        self.live.update(self._render(update), refresh=True)

    # ---------------------------------------------------------------- drawing
    def _after(self, prev: list[int], ids: list[int], skip_special: bool = True) -> str:
        """The text of ``ids`` as it reads after the tokens ``prev``: with the spacing the tokenizer
        puts between them, which decoding ``ids`` alone loses (a word-level tokenizer) or keeps (a
        byte-level one); no space of its own. Without a tokenizer: the ids, space-separated."""
        tok = self.engine.tokenizer
        if tok is None:
            return (" " if prev else "") + " ".join(map(str, ids))
        if not prev:
            return tok.decode(ids, skip_special_tokens=skip_special)
        head = tok.decode(prev[-1:], skip_special_tokens=skip_special)
        full = tok.decode(prev[-1:] + ids, skip_special_tokens=skip_special)
        return full[len(head):] if full.startswith(head) else tok.decode(ids, skip_special_tokens=skip_special)

    def _prompt_ids(self, prompt) -> list[int]:
        """The prompt's tokens, for the spacing after it (the user's text encoded plainly)."""
        if prompt is None:
            return []
        if not isinstance(prompt, str):
            return list(prompt)
        if self.engine.tokenizer is None:
            return []
        return self.engine.tokenizer.encode(prompt, add_special_tokens=False)

    def _segments(self, update, row: int = 0) -> list[tuple[str, str]]:
        """(text, style) of the prompt, the committed text and the current block."""
        given = self.prompts[row] if row < len(self.prompts) else None
        if row not in self._prompt_cache:
            self._prompt_cache[row] = self._prompt_ids(given)
        prev = self._prompt_cache[row]
        out = [(given if isinstance(given, str) else self._after([], prev), "dim")] if given is not None else []
        if update.committed:
            out.append((self._after(prev, update.committed), "bold"))
            prev = update.committed
        if update.kind == "step":
            unmasked = set(update.unmasked)
            for pos, t in enumerate(update.block_tokens):
                if t is None:
                    out.append(((" " if self.engine.tokenizer is None and (out or pos) else "") + MASK_GLYPH, "dim"))
                    prev = [-1] if self.engine.tokenizer is None else []  # after a mask: no known spacing
                else:
                    out.append((self._after(prev, [t], skip_special=False),
                                "black on yellow" if pos in unmasked else "yellow"))
                    prev = [t]
        return out

    def _where(self, update) -> str:
        n = len(update.committed)
        if update.kind == "done":
            return f"done ({update.result.stop_reason}) | {n} tokens"
        if self.mode == "ar":
            return f"{n} tokens committed"
        return (f"block {update.block}" + (f" step {update.step}" if update.step is not None else "")
                + f" | {n} tokens committed")

    def _render(self, update):
        from rich.panel import Panel
        from rich.text import Text

        if update is None:
            return Panel(Text("prefilling the prompt ...", style="dim"), title="clover-lab")
        if update.row is not None or update.kind == "batch":
            return self._render_batch(update)
        text = Text()
        for piece, style in self._segments(update):
            text.append(piece, style=style)
        return Panel(text, title="clover-lab generate", subtitle=f"{self._where(update)} | {update.time:.2f} s")

    def _render_batch(self, update):
        from rich.console import Group
        from rich.panel import Panel
        from rich.text import Text

        width = max(self.console.width - 4, 20)
        lines = []
        for row in range(max(len(self.prompts), max(self.rows, default=-1) + 1)):
            u = self.rows.get(row)
            head = f"row {row} "
            given = self.prompts[row] if row < len(self.prompts) else None
            if u is None:
                shown = "" if given is None else (given if isinstance(given, str) else " ".join(map(str, given)))
                lines.append(Text(head + "prefilling " + (shown.replace("\n", "⏎") or "..."), style="dim",
                                  no_wrap=True, overflow="ellipsis"))
                continue
            where = self._where(u)
            line = Text(f"{head}[{where}] ", style="cyan", no_wrap=True, overflow="crop")
            for piece, style in _row_line(self._segments(u, row), width - len(line), given is not None):
                line.append(piece, style=style)
            lines.append(line)
        done = sum(u.kind == "done" for u in self.rows.values())
        return Panel(Group(*lines), title="clover-lab generate (batch)",
                     subtitle=f"{done}/{len(lines)} rows done | {max(u.time for u in self.rows.values()):.2f} s")
