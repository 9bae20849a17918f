"""Steering along the denoising axis: a direction added to the residual stream at chosen layers,
block positions and denoising steps, as data (``Steer``, ``Schedule``: saved, listed, replayed),
applied in ``engine.hooks(...)`` or per request, and its effect on the tokens measured.

    d = steering.contrast(engine, pairs, layer=2)                  # difference of means, one call
    plan = steering.Schedule([steering.Steer(d, 4.0, layers=2, steps="0:2")])   # steps 0-1 of each block
    run = steering.steer(engine, prompt, plan, max_new_tokens=64)
    steering.compare(engine.generate(prompt, max_new_tokens=64), run.result, tokenizer=engine.tokenizer)
    steering.ablate(sae, 117, steps="3:")       # a feature removed from step 3 on (steering.clamp: set to a value)
"""
from clover_lab.steering.clamp import FeatureClamp, ablate, clamp
from clover_lab.steering.directions import Direction, contrast, feature, prompt_means
from clover_lab.steering.effects import Effect, TokenChange, compare
from clover_lab.steering.schedule import PARTS, POSITIONS, Schedule, ScheduleError, Span, Steer
from clover_lab.steering.steer import Applied, SteeredRun, Steering, hooks, steer

__all__ = ["FeatureClamp", "ablate", "clamp", "Direction", "contrast", "feature", "prompt_means", "Effect", "TokenChange", "compare", "PARTS",
           "POSITIONS", "Schedule", "ScheduleError", "Span", "Steer", "Applied", "SteeredRun", "Steering", "hooks",
           "steer"]
