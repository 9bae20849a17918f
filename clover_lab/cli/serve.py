"""``clover-lab serve``: an OpenAI-compatible HTTP server over one engine (``clover_lab/serve/``)."""
from __future__ import annotations

import argparse

from clover_lab.cli.options import (
    EXIT_OK,
    UsageError,
    add_placement_options,
    add_sampler_options,
    fail,
    load_engine,
    sampler_kwargs,
    set_block_size,
)


def add_parser(sub) -> None:
    """The ``serve`` subcommand and its options."""
    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, block-aware streams)",
                       description="Serve the model over OpenAI's HTTP API: /v1/completions, /v1/chat/completions, "
                                   "/v1/models, /health, /metrics; requests that can share a batch share it.")
    v.add_argument("--model", metavar="DIR", help="Hugging Face model directory (default: the embedded model)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--served-model-name", default=None, help="the model's id in the API (default: the directory name)")
    v.add_argument("--max-batch", type=int, default=32, help="rows per batch")
    v.add_argument("--max-queue", type=int, default=256, help="prompts waiting before requests get 429")
    v.add_argument("--graceful", type=float, default=60.0, help="seconds SIGTERM lets streams in flight finish")
    v.add_argument("--max-new-tokens", type=int, default=None,
                   help="a response's length when the request names none (default: generation_config.json, else 256)")
    v.add_argument("--block-size", type=int, default=None, help="default: the model config's block_size")
    add_sampler_options(v)
    v.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cpu)")
    v.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    add_placement_options(v)
    v.add_argument("--check-finite", action=argparse.BooleanOptionalAction, default=None,
                   help="refuse weights holding NaN or inf (default: for checkpoints up to 4 GiB)")
    v.add_argument("--threads", type=int, default=None, help="torch intra-op threads on the CPU")
    v.add_argument("--compile", action="store_true", help="CPU: run the steps through torch.compile")
    v.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    """``clover-lab serve``: the engine, its defaults from the options, then uvicorn until SIGTERM."""
    from pathlib import Path

    from clover_lab.engine.sampling import SamplerSettings
    from clover_lab.errors import CloverError

    for name in ("threads", "max_batch", "max_queue", "port"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        engine = load_engine(args)
        engine.compile_steps = args.compile
        engine.settings = SamplerSettings.from_kwargs(engine.settings, **sampler_kwargs(args))
        if args.max_new_tokens is not None:
            engine.max_new_tokens = args.max_new_tokens
        if args.block_size is not None:
            set_block_size(engine, args.block_size)
        from clover_lab.serve.server import serve

        name = args.served_model_name or (Path(args.model).name if args.model else "clover-stdlib")
        serve(engine, args.host, args.port, name, args.max_batch, args.max_queue, args.graceful)
    except (UsageError, CloverError, FileNotFoundError, ValueError, OSError) as e:
        return fail(str(e))
    return EXIT_OK
