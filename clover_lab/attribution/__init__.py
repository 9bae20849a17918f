"""Attribution along the denoising axis: which layer, head or expert pushed a token to unmask at
a step (direct logit attribution), what the gated-attention heads and the GDN preview read
(attention patterns, history weights), gradient attribution beside activation patching, and
linear probes over (layer, step).

    from clover_lab import attribution
    a = attribution.logit_attribution(engine, prompt, block=0, step=2, position=17)
    a.logit, a.top(5)
"""
from clover_lab.attribution.attention import AttentionPattern, attention_patterns, history_weights
from clover_lab.attribution.gradient import attribution_patching, correlation
from clover_lab.attribution.logit import (LogitAttribution, ablated_logit, attribution_over_steps, component_names,
                                          decision_attributions, logit_attribution)

__all__ = ["AttentionPattern", "attention_patterns", "history_weights", "attribution_patching", "correlation", "LogitAttribution", "ablated_logit", "attribution_over_steps", "component_names", "decision_attributions",
           "logit_attribution"]
