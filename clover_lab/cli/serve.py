"""``clover-lab serve``: an OpenAI-compatible HTTP server over one engine (``clover_lab/serve/``)."""
from __future__ import annotations

import argparse
import errno

from clover_lab.cli.options import (
    EXIT_OK,
    UsageError,
    add_placement_options,
    add_sampler_options,
    check_options,
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
    v.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM\'s switch: \'{"method": "mtp", "num_speculative_tokens": 3}\' serves requests that name '
                        'no clover.mode in mode "mtp" (the model\'s MTP head drafts that many tokens per verify)')
    add_sampler_options(v)
    v.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cpu)")
    v.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    add_placement_options(v)
    v.add_argument("--check-finite", action=argparse.BooleanOptionalAction, default=None,
                   help="refuse weights holding NaN or inf (default: for checkpoints up to 4 GiB)")
    v.add_argument("--threads", type=int, default=None, help="torch intra-op threads on the CPU")
    v.add_argument("--compile", action="store_true", help="CPU: run the steps through torch.compile")
    v.add_argument("--open-schemas", action="store_true",
                   help="read JSON schemas as written: an object silent about additionalProperties takes other keys "
                        "(default: closed, as vLLM's and SGLang's default backend reads them)")
    v.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    """``clover-lab serve``: the engine, its defaults from the options, then uvicorn until SIGTERM."""
    from pathlib import Path

    from clover_lab.engine import mtp
    from clover_lab.engine.sampling import SamplerSettings
    from clover_lab.errors import CloverError

    for name in ("threads", "max_batch", "max_queue"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.graceful >= 0:
        return fail(f"--graceful must be a number of seconds >= 0, got {args.graceful}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        return fail("--served-model-name must not be empty")
    try:  # everything that can fail without the model fails before it loads (a 70 GB load takes minutes)
        from clover_lab.serve.server import serve  # the [serve] extra: fastapi, uvicorn

        check_options(args)
        speculative = mtp.speculative_config(args.speculative_config) if args.speculative_config else None
        sock = listening_socket(args.host, args.port)
    except ImportError as e:
        return fail(f"clover-lab serve needs the [serve] extra (pip install 'clover-lab[serve]'): {e}")
    except (UsageError, CloverError, ValueError, TypeError) as e:
        return fail(str(e))
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
        if speculative is not None:
            engine.model.require_mtp()
            engine.settings = SamplerSettings.from_kwargs(engine.settings, mtp_draft_tokens=speculative)
            engine.default_mode = "mtp"
        name = args.served_model_name or (Path(args.model).name if args.model else "clover-stdlib")
        serve(engine, args.host, args.port, name, args.max_batch, args.max_queue, args.graceful, sock=sock,
              open_schemas=args.open_schemas)
    except (UsageError, CloverError, FileNotFoundError, ValueError, OSError) as e:
        return fail(str(e))
    finally:
        sock.close()
    return EXIT_OK


def listening_socket(host: str, port: int):
    """The server's socket, bound now, before the model loads: a port out of range, an address
    this machine does not have, or a port another server holds is a usage error in a second
    rather than uvicorn's log lines after the load. uvicorn serves on it as it is."""
    import socket

    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise UsageError(f"--port must be a TCP port in [1, 65535], got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError(f"--host {host!r}: not an address to listen on ({getattr(e, 'strerror', None) or e})") \
            from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses the port at once
        sock.bind(address)
    except OSError as e:
        sock.close()
        why = "another process is listening there; stop it or choose another --port" if e.errno == errno.EADDRINUSE \
            else e.strerror or str(e)
        raise UsageError(f"--host {host} --port {port}: cannot listen there: {why}") from None
    return sock
