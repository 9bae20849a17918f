"""Placing a model over devices: ``plan.py`` (where each unit goes, planned by accelerate's
``infer_auto_device_map`` or read from a device_map) and ``offload.py`` (routed experts kept in
host memory, staged onto their layer's device when routed)."""
from clover_lab.placement.offload import ElsewhereExperts, ExpertStore
from clover_lab.placement.plan import Placement, meta_model, plan_placement

__all__ = ["Placement", "plan_placement", "meta_model", "ExpertStore", "ElsewhereExperts"]
