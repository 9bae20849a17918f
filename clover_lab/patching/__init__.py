"""Activation patching along the denoising axis: record run A, run B with chosen residual-stream
values taken from A at (point, block, step, positions), and sweep that over layers, positions
and denoising steps with a metric read off one position's logits.

    from clover_lab import patching
    clean = patching.record(engine, "def add(a, b):\\n    return a + b\\n")
    run = patching.patch(engine, "def add(a, b):\\n    return a - b\\n", clean,
                         [patching.Site("layers.2.output", block=0, step=0, positions=(14,))])
    sweep = patching.sweep_layers_positions(engine, clean_prompt, corrupt_prompt,
                                            patching.logit_diff(14, good, bad), block=0, step=0)
    res = patching.patch_pairs(engine, [patching.Pair(clean, corrupt, metric), ...], "layers.2.output",
                               block=None, step=None, positions=[-1])   # a dataset: mean and interval

Every coordinate is the one events carry: commit rows of block ``b`` are (b, None), the preview
rows of block ``b`` at denoising step ``s`` are (b, s), the prompt's prefill (None, None); an AR
run's token ``i`` is committed as block ``i``. Positions are absolute sequence positions, so the
two prompts of a sweep must have the same length.
"""
from clover_lab.patching.dataset import Pair, PairsPatch, patch_pairs
from clover_lab.patching.metrics import Metric, logit_diff, measure, probability
from clover_lab.patching.patch import PatchRun, Site, Source, patch, record, residual_points
from clover_lab.patching.sweeps import Sweep, sweep_layers_positions, sweep_steps_layers

__all__ = ["Pair", "PairsPatch", "patch_pairs", "Metric", "logit_diff", "measure", "probability", "PatchRun", "Site", "Source", "patch", "record", "residual_points",
           "Sweep", "sweep_layers_positions", "sweep_steps_layers"]
