"""Low-rank adapters for adaptation, through peft.

peft's LoRA wraps any ``nn.Linear`` subclass, so it takes clover_lab's ``layers.linear.Linear``
as it is: ``inject_adapter_in_model`` replaces each chosen projection in place by a
``lora.Linear`` that calls the original module (and so ``clover_kernels.dense.linear``) and adds
``scaling * B(A(x))``; no wrapper model, so ``training_forward`` and FSDP see the same modules.
The routed experts are fused [E, ...] parameters, not Linear modules, so they take no adapter.
The export merges each adapter into its weight (``merged_state_dict``), so the written
checkpoint is a plain Clover directory.
"""
from __future__ import annotations

import torch
import torch.nn as nn

# the token mixers' projections: attention (q carries the output gate) and GDN
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj")
ADAPTER = "default"


def linear_names(model: nn.Module) -> set[str]:
    """The last name of every Linear module: what ``targets`` may name."""
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear) and name}


def add_lora(model: nn.Module, targets, rank: int, alpha: float, seed: int = 0) -> list[str]:
    """Adapters of rank ``rank`` on every Linear whose last name is in ``targets``; returns the
    names of the adapter parameters (the only ones left trainable by peft). peft draws A from
    torch's global generator: drawn here from ``seed`` (the global state left as it was), so that
    every process, and every rerun, starts from the same adapters."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ImportError("--train lora needs peft: pip install 'clover-lab[train]'") from None
    if rank < 1:
        raise ValueError(f"--lora-rank must be >= 1, got {rank}")
    unknown = sorted(set(targets) - linear_names(model))
    if unknown:
        raise ValueError(f"--lora-targets: {unknown} name no Linear module of this model; "
                         f"choose from {sorted(linear_names(model))}")
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    return [n for n, _ in model.named_parameters() if ".lora_" in n]


def merged_state_dict(state: dict, scaling: float) -> dict:
    """A state dict of the adapted model with every adapter merged, ``W + scaling * B @ A`` (in
    fp32, then the weight's dtype), under the plain model's names."""
    out = {}
    for name, value in state.items():
        if ".lora_" in name:
            continue
        if name.endswith(".base_layer.weight"):
            prefix = name[:-len(".base_layer.weight")]
            a, b = state[f"{prefix}.lora_A.{ADAPTER}.weight"], state[f"{prefix}.lora_B.{ADAPTER}.weight"]
            out[f"{prefix}.weight"] = (value.float() + scaling * (b.float() @ a.float())).to(value.dtype)
        else:
            out[name.replace(".base_layer.", ".")] = value
    return out


def lora_scaling(rank: int, alpha: float) -> float:
    """peft's scale of the low-rank update (without rsLoRA)."""
    return alpha / rank
