"""What an adaptation run (``train.adapt``) is made of: its settings and files, the model as it
starts (mask token, block size, adapters, which parameters learn), the optimizer, the encoded
data, and the Clover directory it writes."""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from clover_lab.checkpoint.loading import load_generation_config, load_tokenizer, resolve_dtype
from clover_lab.checkpoint.names import PREVIEW_PARAMS
from clover_lab.checkpoint.saving import stage_model
from clover_lab.errors import CheckpointError, InputError, count
from clover_lab.model.decoder import CloverModel
from clover_lab.train import lora as lora_
from clover_lab.train.mask_token import ensure_mask_token
from clover_lab.train.objective import TrainSettings
from clover_lab.train.loop import read_run_file, run_write
from clover_lab.train.shard import Shard
from clover_lab.train.stdlib_corpus import encode_files, split_files, text_files
from clover_lab.writes import FileSet, atomic_path

MODES = ("preview", "lora", "all")
DEFAULT_LR = {"lora": 1e-3, "all": 3e-4}  # for the init's weights (adapters); new parameters: preview_lr
EMBEDDING = "model.embed_tokens.weight"
# fields that fix what a run computes: a resumed run must be given the same
RUN_FIELDS = ("init", "train", "block_size", "reset_preview", "lora_rank", "lora_alpha", "lora_targets", "dtype",
              "preview_lr")


@dataclass
class AdaptSettings:
    init: str
    train: str = "preview"
    block_size: int | None = None  # default: the init's config
    reset_preview: bool = False  # start the preview parameters from the spec's defaults
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: list[str] = field(default_factory=lambda: list(lora_.DEFAULT_TARGETS))
    dtype: str = "float32"
    preview_lr: float = 1e-2  # the preview parameters and the mask token's row start from defaults: larger steps


class Run:
    """One adaptation run's files under ``OUT/training``."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.dir = self.out / "training"
        self.state = self.dir / "state.pt"
        self.data = self.dir / "data.pt"
        self.log = self.dir / "loss_log.jsonl"

    def checkpoint(self, step: int) -> Path:
        return self.dir / f"checkpoint-{step:07d}"

    def restart_fix(self) -> str:
        """What to do when the run cannot resume: what a restart keeps."""
        return (f"the run cannot resume from it: delete {self.state} to start the run again from step 0 (the encoded "
                f"data is kept), or give another --out")


# --------------------------------------------------------------------------- the model
def build_model(s: AdaptSettings, tokenizer, seed: int = 0) -> tuple[CloverModel, list[str], str]:
    """The init's model on the CPU (memory-mapped where the checkpoint's layout allows; FSDP moves
    it to the GPUs unit by unit) in ``s.dtype`` with a mask token, ``s.block_size`` and, for ``lora``, its
    adapters; only the parameters ``s.train`` trains require a gradient (with ``preview`` and
    ``lora`` also the embedding, of which ``keep_mask_row`` lets only the mask token's row
    change). Returns (model, the trained parameters' names, what was done about the mask token)."""
    with warnings.catch_warnings():  # an AR init has no preview weights: that is what adapt is for
        warnings.filterwarnings("ignore", message=".*the checkpoint has no Clover preview weights")
        model = CloverModel.from_pretrained(s.init, device="cpu", dtype=resolve_dtype(s.dtype))
    if s.reset_preview:
        model.reset_preview_parameters()
    _, mask_how = ensure_mask_token(tokenizer, model)
    if s.block_size is not None:
        model.config.block_size = s.block_size
        model.config.validate()
    model.train()
    if s.train == "lora":
        lora_.add_lora(model, s.lora_targets, s.lora_rank, s.lora_alpha, seed)
    for name, p in model.named_parameters():  # (peft froze everything but its adapters)
        p.requires_grad_(s.train == "all" or ".lora_" in name or is_preview(name) or name == EMBEDDING)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    return model, trained, mask_how


def keep_mask_row(model, mask_id: int, train: str) -> None:
    """With ``preview`` and ``lora``: the embedding's gradient zeroed but for the mask token's row,
    so that only the new token's embedding learns (with no weight decay on the embedding, Adam
    leaves rows that never had a gradient exactly as they were)."""
    if train == "all":
        return
    grad = dict(model.named_parameters())[EMBEDDING].grad
    if grad is None:
        return
    keep = torch.zeros(grad.shape[0], 1, dtype=grad.dtype)
    keep[mask_id] = 1
    if hasattr(grad, "device_mesh"):  # a DTensor: the mask sharded as the gradient is
        from torch.distributed.tensor import distribute_tensor

        keep = distribute_tensor(keep.to(grad.device), grad.device_mesh, grad.placements)
    grad.mul_(keep.to(grad.device))


def is_preview(name: str) -> bool:
    return name.split("layers.")[-1].split(".", 1)[-1] in PREVIEW_PARAMS


def optimizer(model, names: list[str], s: AdaptSettings, settings: TrainSettings) -> torch.optim.AdamW:
    """AdamW over the trained parameters: the init's weights at ``settings.lr`` (weight decay on
    matrices but the embedding), the new ones (preview parameters; the embedding when only its
    mask row learns) at ``s.preview_lr``. Each group's ``lr_scale`` follows the schedule."""
    params = dict(model.named_parameters())
    new = [n for n in names if is_preview(n) or (n == EMBEDDING and s.train != "all")]
    old = [n for n in names if n not in new]
    decay = [n for n in old if params[n].dim() >= 2 and "embed" not in n]
    groups = [(decay, settings.weight_decay, 1.0), ([n for n in old if n not in decay], 0.0, 1.0),
              (new, 0.0, s.preview_lr / settings.lr)]
    return torch.optim.AdamW([{"params": [params[n] for n in group], "weight_decay": wd, "lr_scale": scale}
                              for group, wd, scale in groups if group], lr=settings.lr, betas=(0.9, 0.95))


# --------------------------------------------------------------------------- data
def prepare_data(run: Run, data: list[str], pattern: str, tokenizer, shard: Shard) -> dict:
    """The token streams of ``data`` (training and held-out files), encoded once per run by the
    main process into ``OUT/training/data.pt``. Every process checks the files, so that all
    refuse the same bad input instead of waiting for the main one."""
    data = [str(d) for d in data]
    if not run.data.exists():
        train_files, held_files = split_files(text_files(data, pattern))
        if not train_files:
            raise ValueError(f"--data {' '.join(data)}: every file fell into the held-out split; give more files")
        if shard.is_main:
            print(f"data: {len(train_files)} training and {len(held_files)} held-out files", flush=True)
            tokens = {"train": encode_files(tokenizer, train_files), "heldout": encode_files(tokenizer, held_files),
                      "heldout_files": [str(f) for f in held_files], "sources": data}
            with run_write(run.data, "the encoded --data", "nothing was written: free some space and rerun"), \
                    atomic_path(run.data) as tmp:
                torch.save(tokens, tmp)
    shard.barrier()
    tokens = read_run_file(run.data, "the run's encoded --data", f"delete {run.data} and rerun: --data is encoded "
                           f"again (the same files give the same tokens)", {"train": torch.Tensor, "sources": list})
    if tokens["sources"] != data:
        raise ValueError(f"{run.data} holds --data {' '.join(tokens['sources'])}; this command gives "
                         f"--data {' '.join(data)}: give the same to resume, or another --out")
    return tokens


def init_tokenizer(s: AdaptSettings, tokenizer_dir: str | None):
    """The init's tokenizer (or ``tokenizer_dir``'s), as it was: every run and every resume
    derives the mask token from it the same way."""
    source = Path(tokenizer_dir or s.init)
    tokenizer = load_tokenizer(source)
    if tokenizer is None:
        raise ValueError(f"{source} has no tokenizer, which adapt needs to encode --data; "
                         f"name a directory holding one with --tokenizer")
    return tokenizer


def check_stops(minutes, stop_at, minutes_name: str = "minutes", stop_name: str = "stop_at") -> None:
    """A run's early stops: ``minutes`` a positive number and ``stop_at`` a step >= 1, or None (a
    0 read as "no stop" would train the whole schedule; a negative budget would export the init)."""
    if minutes is not None and (isinstance(minutes, bool) or not isinstance(minutes, (int, float))
                                or not math.isfinite(minutes) or minutes <= 0):
        raise InputError(f"{minutes_name}={minutes!r}: expected a positive number of minutes, or none for no limit")
    if stop_at is not None:
        count(stop_name, stop_at)


def check_tokenizer_fits(tokenizer, config, source) -> None:
    """Every token the tokenizer can produce indexes the init's embedding (a mask token it lacks
    is added later, growing the embedding by its row): found before training, not mid-way."""
    mask = tokenizer.mask_token_id
    text_tokens = len(tokenizer) - (mask is not None and mask >= config.vocab_size)
    if text_tokens > config.vocab_size:
        raise CheckpointError(f"the tokenizer in {source} has {text_tokens} tokens, but the init's embedding has "
                              f"{config.vocab_size} rows (vocab_size): ids {config.vocab_size} and up would index "
                              f"past it; use the init's own tokenizer, or an init with a larger vocabulary")


def write_clover_dir(out: Path, config, state: dict, tokenizer, init: str) -> None:
    """A model directory in ``out`` from a full state dict, in the dtype config.json names: its
    files put in place together (``writes.FileSet``), so that a failed export leaves the previous
    one whole."""
    dtype = resolve_dtype(config.dtype) or torch.float32
    with torch.device("meta"):
        model = CloverModel(config)
    model.load_state_dict(state, assign=True)
    generation = {"threshold": 0.9, "max_new_tokens": 128}
    if (Path(init) / "generation_config.json").is_file():
        load_generation_config(init, ())  # refuses a malformed file, naming it
        generation = {**generation, **json.loads((Path(init) / "generation_config.json").read_text())}
    with FileSet(out) as files:
        stage_model(model.to(dtype), files, out)
        files.put_written_by(lambda tmp: tokenizer.save_pretrained(str(tmp)), out)
        files.path(out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
