"""What a load is checked against besides the checkpoint's names and shapes (``loading.py``): the
device it is asked to load onto, and the weights' values once read."""
from __future__ import annotations

import torch

from .errors import CheckpointError

# checkpoints up to this size get their weights checked for NaN / inf by default (one extra pass
# over memory: ~1 s per GB on a CPU); bigger ones only when asked
CHECK_FINITE_MAX_BYTES = 4 << 30


def resolve_device(device, allow_meta: bool = False) -> torch.device:
    """``device`` (None: the CPU) as a torch.device that can hold the weights here, or a
    CheckpointError saying why not (unknown name, no CUDA in this torch, no such GPU, meta).
    ``allow_meta``: a model of shapes only (``CloverModel.from_pretrained(device="meta")``, for
    planning); an engine refuses it."""
    try:
        dev = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError, ValueError):
        raise CheckpointError(f"device {device!r} is not a device name (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "meta" and not allow_meta:
        raise CheckpointError("device 'meta' holds shapes but no weights, so nothing could run; load onto cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(f"device {str(dev)!r}: no CUDA device is available to this torch "
                              f"({torch.__version__}); use --device cpu")
    try:
        torch.empty(1, device=dev)
    except (RuntimeError, AssertionError, ValueError) as e:
        raise CheckpointError(f"device {str(dev)!r} cannot be used here: {e}") from None
    return dev


CHECKED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool: no NaN or inf in ``t``. float8_e4m3fn (FP8 weights kept as FP8) has no inf and
    no isfinite kernel: its NaN is every exponent and mantissa bit set (0x7F / 0xFF)."""
    if t.dtype == torch.float8_e4m3fn:
        return ((t.view(torch.uint8) & 0x7F) != 0x7F).all()
    return torch.isfinite(t).all()


def refuse_nonfinite(model, files: dict, reader, plan: dict) -> None:
    """A CheckpointError naming the first stored tensor that holds NaN or inf, for a model just
    filled from ``files`` by ``plan`` (loading.py's: parameter -> stored name, or per-expert
    {(expert, part): stored name}); one host read for the whole model unless one does."""
    params = dict(model.named_parameters())
    names = [n for n in plan if n in params and params[n].dtype in CHECKED_DTYPES]
    if not names:
        return
    finite = torch.stack([all_finite(params[n]).cpu() for n in names]).tolist()  # placed: many devices
    for name, ok in zip(names, finite):
        if ok:
            continue
        source = plan[name]
        stored = [source] if isinstance(source, str) else list(source.values())
        for st in stored:  # per-expert tensors: the expert that holds them
            if not bool(all_finite(reader.get(files[st], st))):
                raise CheckpointError(f"{files[st]}: tensor {st!r} holds NaN or inf values "
                                      f"(check_finite=False loads it anyway)")
        dtype = str(params[name].dtype).removeprefix("torch.")
        raise CheckpointError(f"{files[stored[0]]}: tensor {stored[0]!r} is finite as stored but overflows to inf "
                              f"in {dtype}; load it in another dtype")


def refuse_unreadable_scales(model, files: dict, plan: dict) -> None:
    """With ``preview_reading: {"logit_scale": "multiplier"}`` every stored logit scale is the
    multiplier itself, so it must be > 0 (the preview computes with its log): a CheckpointError
    naming the first tensor that is not."""
    for name, param in model.named_parameters():
        if name.endswith("linear_attn.block_scale") and name in plan and not bool((param > 0).all()):
            stored = plan[name]
            raise CheckpointError(f"{files[stored]}: tensor {stored!r} holds values <= 0 "
                                  f"({param.min().item():.4g}), which config.json's preview_reading "
                                  f"logit_scale 'multiplier' cannot read; the 'log' reading can")
