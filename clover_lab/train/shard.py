"""Training over several processes with torch's own engines: torchrun's environment, FSDP2
(``torch.distributed.fsdp.fully_shard``: parameters, gradients and optimizer state sharded per
decoder layer), whole-batch sums for the objective, and ``torch.distributed.checkpoint`` (DCP)
for checkpoints that any number of processes can resume.

One process (no torchrun): no process group, no sharding; the same DCP checkpoints.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass
class Shard:
    """This process's place: ``rank`` of ``world`` processes, on ``device``; ``mesh`` is the FSDP
    device mesh when the model is sharded (started by torchrun), else None."""
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    mesh: object | None = None
    owns_group: bool = False  # this module started the process group, so it ends it

    @property
    def sharded(self) -> bool:
        return self.mesh is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def rows(self, batch: int) -> slice:
        """This process's rows of a global batch of ``batch`` rows."""
        if batch % self.world:
            raise ValueError(f"the batch of {batch} rows does not split over {self.world} processes; "
                             f"use a --batch-size that {self.world} divides")
        n = batch // self.world
        return slice(self.rank * n, (self.rank + 1) * n)

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the processes (no gradient flows through it)."""
        if self.world == 1:
            return t
        t = t.detach().clone()
        dist.all_reduce(t)
        return t

    def any(self, flag: bool) -> bool:
        """Whether any process says ``flag``: so that all stop at the same step."""
        return bool(self.all_sum(torch.tensor(float(flag), device=self.device)) > 0)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.barrier()  # a rank tearing gloo down while another still talks to it aborts that one
            dist.destroy_process_group()


def from_environment(device: str | None = None) -> Shard:
    """The processes torchrun started (it sets RANK, WORLD_SIZE, LOCAL_RANK): gloo on the CPU,
    NCCL on GPUs (one per process, by LOCAL_RANK). Without torchrun: one unsharded process."""
    want_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if "RANK" not in os.environ:
        return Shard(device=torch.device(device or ("cuda" if want_cuda else "cpu")))
    from torch.distributed.device_mesh import init_device_mesh

    local = int(os.environ.get("LOCAL_RANK", 0))
    if want_cuda:
        torch.cuda.set_device(local)
    dev = torch.device("cuda", local) if want_cuda else torch.device("cpu")
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if want_cuda else "gloo")
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    return Shard(dist.get_rank(), dist.get_world_size(), dev, mesh, owns)


def shard_model(model, shard: Shard, recompute: bool = False):
    """FSDP2 over ``model``: each decoder layer its own unit (gathered for its forward and
    backward, then freed), the rest (embedding, final norm, LM head) in the root unit. The
    training forward is a method of its own, so FSDP is told to gather around it too.
    ``recompute``: activation checkpointing per decoder layer (torch's composable
    ``checkpoint``: parameter names unchanged), applied before sharding as FSDP2 expects: a layer
    keeps only its input and recomputes the rest in backward."""
    if recompute:
        from torch.distributed._composable import checkpoint

        for layer in model.model.layers:
            checkpoint(layer)
    if not shard.sharded:
        return model
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for layer in model.model.layers:
        fully_shard(layer, mesh=shard.mesh)
    fully_shard(model, mesh=shard.mesh)
    register_fsdp_forward_method(model, "training_forward")
    # training_forward returns the clean and noisy halves of one logits tensor (views); the loss
    # only reads them, so FSDP's warning about in-place ops on views does not apply
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return model


def _state(model, optimizer, names: set[str]) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": {k: v for k, v in model_sd.items() if k in names}, "optimizer": optim_sd}


def save_checkpoint(path: Path, model, optimizer, names: set[str]) -> None:
    """The parameters named in ``names`` (the trained ones: frozen weights are the init's) and the
    optimizer state, each process writing its shards (DCP). Collective: every process calls it."""
    import torch.distributed.checkpoint as dcp

    with _one_process_quiet():
        dcp.save(_state(model, optimizer, names), checkpoint_id=str(path), no_dist=not dist.is_initialized())


def load_checkpoint(path: Path, model, optimizer, names: set[str]) -> None:
    """Read what ``save_checkpoint`` wrote into this model and optimizer, resharded to however many
    processes run now."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = _state(model, optimizer, names)
    with _one_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(strict=False))


@contextlib.contextmanager
def _one_process_quiet():
    """DCP warns that it assumes one process whenever there is no process group: here that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def full_state_dict(model, shard: Shard) -> dict | None:
    """Every parameter whole, on the CPU, on the main process (None on the others)."""
    if not shard.sharded:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if shard.is_main else None
