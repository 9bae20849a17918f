"""``clover-lab routes``: routing statistics of a corpus (``clover_lab/lens/routing_stats.py``), in one
process or one rank of a torchrun job."""
from __future__ import annotations

import argparse
from pathlib import Path

from clover_lab.cli.arguments import writable_file
from clover_lab.cli.options import EXIT_OK, data_inputs, fail, load_engine


def add_parser(sub) -> None:
    """The ``routes`` subcommand and its options."""
    r = sub.add_parser("routes", help="routing statistics of a corpus, saved as .npz",
                       description="Expert counts, co-activation, routing entropy, load balance and counts by "
                                   "token id over a corpus. Under torchrun the corpus is split across ranks "
                                   "and the sums are all-reduced; rank 0 writes the file.")
    r.add_argument("--model", metavar="DIR", help="Hugging Face model directory (default: the embedded model)")
    r.add_argument("--data", nargs="+", required=True, metavar="DIR_OR_FILE", help="files or folders of text")
    r.add_argument("--out", required=True, metavar="FILE.npz")
    r.add_argument("--mode", choices=("commit", "preview"), default="commit",
                   help="commit: the corpus run causally; preview: every block previewed fully masked")
    r.add_argument("--batch-size", type=int, default=8, help="windows per forward")
    r.add_argument("--seq-len", type=int, default=None, help="tokens per window (default 512)")
    r.add_argument("--device", default=None, help="cpu, cuda ... (under torchrun: cuda means cuda:LOCAL_RANK)")
    r.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar while loading (default: for checkpoints over 1 GB)")
    r.add_argument("--check-finite", action=argparse.BooleanOptionalAction, default=None,
                   help="refuse weights holding NaN or inf (default: for checkpoints up to 4 GiB)")
    r.set_defaults(func=cmd_routes)


def cmd_routes(args) -> int:
    """``clover-lab routes``: one process, or one rank of a torchrun job (gloo on CPUs, NCCL on GPUs)."""
    import os

    import torch.distributed as dist

    from clover_lab.checkpoint.loading import model_path, resolve_device
    from clover_lab.corpus import corpus_documents
    from clover_lab.errors import CloverError
    from clover_lab.lens.routing_stats import route_stats, stats_path
    from clover_lab.writes import refuse_inputs

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        gpu = (args.device or "cpu").startswith("cuda")
        if gpu:
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        dist.init_process_group("nccl" if gpu else "gloo")
    try:  # the device, the corpus and the output checked before the model loads
        if getattr(args, "device_map", None) is None:
            resolve_device(args.device)
        data = corpus_documents([Path(d) for d in args.data], "--data")
        writable_file(args.out, "--out")
        refuse_inputs(stats_path(args.out), [("the model directory", model_path(args.model))] + data_inputs(args),
                      "--out")
        engine = load_engine(args)
        stats = route_stats(engine, data, mode=args.mode, batch_size=args.batch_size, seq_len=args.seq_len)
        if world > 1:  # every rank done with gloo before any tears it down (a peer gone aborts the other)
            dist.barrier()
    except (CloverError, FileNotFoundError, ValueError, TypeError, OSError) as e:
        return fail(str(e))
    finally:
        if world > 1 and dist.is_initialized():
            rank = dist.get_rank()
            dist.destroy_process_group()
    if world == 1 or rank == 0:
        path = stats.save(args.out)
        print(f"{stats.tokens} tokens routed ({args.mode}) over {stats.num_layers} layers x {stats.num_experts} "
              f"experts; mean load entropy {stats.load_entropy().mean():.3f}, max/mean load "
              f"{stats.load_balance().max():.2f}: {path}")
    return EXIT_OK
