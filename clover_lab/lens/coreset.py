"""The coreset explorer: a sweep of expert-coreset sizes (spec 3.3) over a set of prompts, measuring
what the coreset costs in output (tokens equal to the run without one) and what it buys (tokens
per forward, seconds per denoising step).

    rows = clover_lab.lens.coreset_sweep(engine, prompts, sizes=[2, 4, 8], max_new_tokens=64)
"""
from __future__ import annotations

import numbers
import time

from clover_lab.engine.requests import is_batch
from clover_lab.errors import InputError, count


def _same_tokens(a: list[int], b: list[int]) -> int:
    return sum(x == y for x, y in zip(a, b))


def coreset_sweep(engine, prompts, sizes, repeat: int = 1, **generate) -> list[dict]:
    """One row per size (``0`` or None first: no coreset, the reference): ``tokens_equal`` the share
    of generated tokens equal, position by position, to the reference run's; ``tokens_per_forward``
    and ``seconds_per_step`` (preview seconds over previews, best of ``repeat`` passes, the passes
    interleaved across the sizes), over all prompts."""
    if generate.get("mode", "diffusion") != "diffusion":
        raise InputError(f"coreset_sweep mode={generate['mode']!r}: a coreset restricts the experts of a block's "
                         f"denoising steps, so only block diffusion has one (mode='diffusion')")
    repeat = count("coreset_sweep repeat", repeat)  # -3 or 0 was read as 1: a setting silently ignored
    E, k = engine.model.config.num_experts, engine.model.config.num_experts_per_tok
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, (list, tuple, range)):
        raise InputError(f"coreset_sweep sizes={sizes!r}: expected a list of coreset sizes (ints)")
    wrong = [s for s in sizes if s is not None and (isinstance(s, bool) or not isinstance(s, numbers.Integral))]
    if wrong:
        raise InputError(f"coreset_sweep sizes: expected ints (or None / 0 for no coreset), got {wrong}")
    sizes = [0] + [int(s) for s in sizes if s]
    bad = [s for s in sizes[1:] if not k <= s < E]
    if bad:  # the engine's own rule: a coreset holds at least the top-k and fewer than every expert
        raise InputError(f"coreset sizes must be in [{k}, {E - 1}] (top-k to one below the model's {E} experts), "
                         f"got {bad}")
    prompts = list(prompts) if is_batch(prompts) else [prompts]  # one prompt, or several
    if not prompts or prompts == [[]]:
        raise InputError("coreset_sweep: give at least one prompt")
    # the repeats interleaved (each pass runs every size, no coreset first): a machine that gets
    # busier or quieter during the sweep moves every size alike, where running the sizes one after
    # another timed the first (the reference) on a colder or busier machine than the rest
    best: dict[tuple[int, int], object] = {}
    wall = {size: 0.0 for size in sizes}
    for _ in range(repeat):
        for size in sizes:
            start = time.perf_counter()
            for i, prompt in enumerate(prompts):
                r = engine.generate(prompt, coreset_size=size or None, **generate)
                if (size, i) not in best or r.stats.preview_seconds < best[size, i].stats.preview_seconds:
                    best[size, i] = r
            wall[size] += time.perf_counter() - start
    reference = [best[0, i].token_ids for i in range(len(prompts))]
    rows = []
    for size in sizes:
        runs = [best[size, i] for i in range(len(prompts))]
        equal = sum(_same_tokens(r.token_ids, ref) for r, ref in zip(runs, reference))
        total = sum(max(len(ref), len(r.token_ids)) for r, ref in zip(runs, reference))
        tokens, forwards = sum(r.stats.new_tokens for r in runs), sum(r.stats.forwards for r in runs)
        step_time, previews = sum(r.stats.preview_seconds for r in runs), sum(r.stats.preview_forwards for r in runs)
        rows.append(dict(coreset_size=size or None, tokens_equal=equal / total if total else 1.0,
                         tokens_per_forward=tokens / forwards if forwards else 0.0,
                         seconds_per_step=step_time / previews if previews else None,
                         prompts=len(prompts), seconds=wall[size]))
    return rows
