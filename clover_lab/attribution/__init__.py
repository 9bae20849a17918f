"""Attribution along the denoising axis: which layer, head or expert pushed a token to unmask at
a step (direct logit attribution), what the gated-attention heads and the GDN preview read
(attention patterns, history weights), gradient attribution beside activation patching, and
linear probes over (layer, step).

    from clover_lab import attribution
    a = attribution.logit_attribution(engine, prompt, block=0, step=2, position=17)
    a.logit, a.top(5)
"""
from clover_lab.attribution.patterns import AttentionPattern, attention_patterns, history_weights
from clover_lab.attribution.gradient import attribution_patching, correlation
from clover_lab.attribution.decomposition import (LogitAttribution, ablated_logit, attribution_over_steps, component_names,
                                          decision_attributions, logit_attribution)
from clover_lab.attribution.probes import (ProbeMap, ProbeRow, ProbeRows, probe_map, probe_rows, unmasks_next_step,
                                           unmasks_this_step)

__all__ = ["AttentionPattern", "LogitAttribution", "ProbeMap", "ProbeRow", "ProbeRows", "ablated_logit",
           "attention_patterns", "attribution_over_steps", "attribution_patching", "component_names", "correlation",
           "decision_attributions", "history_weights", "logit_attribution", "probe_map", "probe_rows",
           "unmasks_next_step", "unmasks_this_step"]
