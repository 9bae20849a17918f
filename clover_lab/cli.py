"""``clover-lab``: the command line.

    clover-lab generate --model DIR --prompt "..." [--mode ar|speculative] [--max-new-tokens N] [--threshold X]
                        [--temperature T] [--top-p P] [--top-k K] [--confidence RULE] [--seed S]
                        [--coreset-size M] [--json]

    clover-lab check [--model DIR] [--data FILES] [--json OUT]

``generate`` shows the current block unmasking live (rich), then the text and the statistics;
``--json`` prints one JSON object instead. A repeated ``--prompt`` (or ``--prompt-ids``) is a
batch: the rows share every forward, and each row's text and statistics are printed at the end. A model directory without a tokenizer takes
``--prompt-ids 1,2,3`` and prints token ids. Ctrl-C stops cleanly: what was generated so far is
printed and the exit code is 130. ``check`` measures whether the preview denoises as a trained
preview, and under which reading of its weights (``clover_lab/check.py``). Every user error (arguments, the model directory, the device,
the request, a failed generation) is one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from .arguments import ArgumentParser, writable_file
from .cli_view import LiveView, print_batch, print_interrupted, print_result
from .engine.requests import MODES

EXIT_OK, EXIT_ERROR, EXIT_INTERRUPTED = 0, 2, 130
# below this many parameters a CPU model runs fastest on one thread: its GEMMs are too small to split,
# and on a busy machine a second thread waits for a core (the embedded model: 76-123 tokens/s on one
# thread, 1.3-5.6 on two, on a loaded 2-core machine)
SMALL_MODEL_PARAMETERS = 100_000_000


def _ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="clover-lab", description="Run, watch and take apart the Clover "
                                     "block-diffusion language model.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    g = sub.add_parser("generate", help="generate a response, watching the blocks unmask",
                       description="Generate a response with block diffusion (or AR) and show it live: the "
                                   "prompt, the committed text and the current block (a batch: one line per "
                                   "row). The statistics count forwards after the prompt's prefill: tokens per "
                                   "forward is new tokens over those forwards, the prefill not counted.")
    g.add_argument("--model", metavar="DIR", help="Hugging Face model directory (default: the embedded model)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append",
                     help="the prompt text (needs a tokenizer in the model directory); repeated: a batch")
    src.add_argument("--prompt-ids", type=_ids, metavar="IDS", action="append",
                     help="the prompt as token ids: 1,2,3; repeated: a batch")
    g.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    g.add_argument("--system", help="a system message (with --chat)")
    g.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="the chat template's enable_thinking flag (with --chat)")
    g.add_argument("--mode", choices=MODES, default="diffusion",
                   help="speculative: AR's answer, each block drafted by previews and checked by one causal commit")
    g.add_argument("--policy", default=None, metavar="NAME[:K=V,...]",
                   help="the decoding rule: threshold (default), eb:gamma=0.1 (EB-sampler), topk:k=2 or topk:k=1/2/4, "
                        "lookahead:start=0.5,threshold=0.9 (multi-block)")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: the model's generation_config.json, else 256")
    g.add_argument("--block-size", type=int, default=None, help="default: the model config's block_size")
    add_sampler_options(g)
    g.add_argument("--stop", action="append", default=None, metavar="TEXT", help="a stop string (repeatable)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cpu)")
    g.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    add_placement_options(g)
    g.add_argument("--check-finite", action=argparse.BooleanOptionalAction, default=None,
                   help="refuse weights holding NaN or inf (default: for checkpoints up to 4 GiB)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads on the CPU (default: 1 for a model under "
                        f"{SMALL_MODEL_PARAMETERS // 10**6}M parameters such as the embedded one, whose GEMMs are "
                        "too small to split; torch's default for a larger one)")
    g.add_argument("--compile", action="store_true",
                   help="CPU: run the steps through torch.compile (about 10 s of compilation per step shape on "
                        "first use, then 2-3x faster steps; pays off over long or repeated generations)")
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    g.add_argument("--no-live", action="store_true", help="no live view; print the result at the end")
    g.set_defaults(func=cmd_generate)

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

    c = sub.add_parser("check", help="does the preview denoise as a trained preview, under which reading?",
                       description="Masked-token accuracy of the preview on ordinary text under every plausible "
                                   "reading of the checkpoint's preview weights (spec 3.2.1) and with untrained "
                                   "defaults, the causal next-token accuracy and the tokens per forward at "
                                   "threshold 0.9; a table, a verdict and the config.json line for the best "
                                   "reading when the config lacks it.")
    c.add_argument("--model", metavar="DIR", help="Hugging Face model directory (default: the embedded model)")
    c.add_argument("--data", nargs="+", metavar="DIR_OR_FILE",
                   help="files or folders of text (default: held-out standard-library modules)")
    c.add_argument("--json", metavar="OUT", help="also write the figures and the verdict as JSON to OUT")
    c.add_argument("--windows", type=int, default=8, help="text windows measured (default 8)")
    c.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cpu)")
    c.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    c.set_defaults(func=cmd_check)

    t = sub.add_parser("train", help="train a small Clover on the Python standard library",
                       add_help=False, description="See `clover-lab train --help`.")
    t.set_defaults(func=None)  # handled in main(): its own parser takes every argument after "train"
    a = sub.add_parser("adapt", help="adapt a checkpoint (AR Qwen3.5/3.6-MoE or Clover) with block diffusion",
                       add_help=False, description="See `clover-lab adapt --help`.")
    a.set_defaults(func=None)  # handled in main(), like train
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        from .errors import CloverError
        from .train.loop import main as train_main

        try:
            train_main(argv[1:])
        except CloverError as e:
            return _fail(str(e))
        except KeyboardInterrupt:  # inside a step: the run said what it resumes from
            return EXIT_INTERRUPTED
        return 0
    if argv[:1] == ["adapt"]:
        from .train.adapt import main as adapt_main

        return adapt_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # before the generation started (loading): nothing to show
        print("clover-lab: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


# --------------------------------------------------------------------------- generate
def _fail(message: str) -> int:
    message = " ".join(message.split())  # one line, however the message was wrapped
    print(f"clover-lab: error: {message}", file=sys.stderr)
    return EXIT_ERROR


def add_sampler_options(parser: argparse.ArgumentParser) -> None:
    """One ``--option`` per SamplerSettings field, defaulting to None: what is not given keeps the
    engine's settings (the model's generation_config.json, else SamplerSettings' defaults)."""
    from .sampling import SamplerSettings

    types = {"float": float, "int": int, "str": str}
    for f in dataclasses.fields(SamplerSettings):
        kind = types[str(f.type).split(" |")[0]]
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None,
                            help=f"{f.metadata.get('help', '')} (default: {f.default})")


def _sampler_kwargs(args) -> dict:
    from .sampling import SamplerSettings

    return {name: getattr(args, name) for name in SamplerSettings.names() if getattr(args, name) is not None}


def load_engine(args):
    """The engine for ``args`` (a seam for tests)."""
    from .engine import load

    placed = {name: getattr(args, name, None) for name in ("device_map", "max_memory", "keep_fp8", "coreset_size",
                                                            "progress", "check_finite")}  # absent options: defaults
    return load(args.model, device=args.device, dtype=args.dtype, pin_memory=getattr(args, "pin_memory", False),
                **placed)


def add_placement_options(parser: argparse.ArgumentParser) -> None:
    """Where the weights go: --device-map, --max-memory, --pin-memory, --keep-fp8, --progress."""
    parser.add_argument("--device-map", type=_device_map, default=None, metavar="MAP",
                        help="auto (planned by accelerate within --max-memory), or a JSON object / file of module "
                             "name -> device, e.g. '{\"\": 0, \"model.layers.39.mlp.experts\": \"cpu\"}'; "
                             "experts that do not fit a GPU stay in host memory and are staged when routed")
    parser.add_argument("--max-memory", type=_max_memory, default=None, metavar="DEV=SIZE,...",
                        help="memory per device for --device-map auto, e.g. 0=22GiB,1=22GiB,cpu=120GiB")
    parser.add_argument("--pin-memory", action="store_true", help="offloaded experts in page-locked host memory "
                        "(faster staging; pins their size in RAM)")
    parser.add_argument("--keep-fp8", action=argparse.BooleanOptionalAction, default=None,
                        help="an FP8 checkpoint's weights stay FP8 (default: on CUDA) or are dequantized")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar while loading (default: for checkpoints over 1 GB)")


def _device_map(text: str):
    if text == "auto":
        return text
    source = Path(text).read_text() if not text.lstrip().startswith("{") and Path(text).is_file() else text
    try:
        value = json.loads(source)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected 'auto', a JSON object or a JSON file, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of module name -> device, got {text!r}")
    return value


def _max_memory(text: str) -> dict:
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        device, sep, size = item.partition("=")
        if not sep or not size:
            raise argparse.ArgumentTypeError(f"expected DEVICE=SIZE pairs like 0=22GiB,cpu=100GiB, got {item!r}")
        out[int(device) if device.isdigit() else device] = int(size) if size.isdigit() else size
    return out


class _UsageError(Exception):
    """A request the command line refuses; the message is printed as one line, exit code 2."""


def cmd_generate(args) -> int:
    from .engine.requests import is_batch
    from .errors import CloverError

    if args.threads is not None and args.threads < 1:
        return _fail(f"--threads must be >= 1, got {args.threads}")
    try:
        engine = load_engine(args)
    except (CloverError, FileNotFoundError, ValueError, OSError) as e:
        return _fail(str(e))
    set_threads(engine.model, args.threads)
    engine.compile_steps = args.compile
    try:
        prompt = _prompt(engine, args)
        if args.block_size is not None:
            _set_block_size(engine, args.block_size)
        stream = engine.stream(prompt, mode=args.mode, max_new_tokens=args.max_new_tokens, stop=args.stop,
                               policy=args.policy, thinking=args.thinking, **_sampler_kwargs(args))
    except (_UsageError, CloverError, ValueError, TypeError) as e:
        return _fail(str(e))
    return _run_stream(engine, args, stream, batch=is_batch(prompt))


def set_threads(model, threads: int | None) -> int:
    """torch's intra-op threads for ``model``: ``threads`` when given, else one for a small model
    on the CPU, else torch's default (left as it is). Returns the count in effect."""
    import torch

    if threads is None:
        on_cpu = all(p.device.type == "cpu" for p in model.parameters())
        if on_cpu and sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMETERS:
            threads = 1
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def _prompt(engine, args):
    """The request's prompt: text, chat messages around it, or token ids; a list of them when the
    option was repeated (a batch)."""
    if args.prompt is None:
        if args.chat:
            raise _UsageError("--chat needs --prompt (text), not --prompt-ids")
        prompts = args.prompt_ids
    elif engine.tokenizer is None:
        raise _UsageError(f"the model directory {args.model} has no tokenizer, so --prompt cannot be encoded; "
                          f"give token ids with --prompt-ids 1,2,3")
    elif not args.chat:
        prompts = args.prompt
    else:
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompts = [system + [{"role": "user", "content": text}] for text in args.prompt]
    return prompts[0] if len(prompts) == 1 else prompts


def _set_block_size(engine, value: int) -> None:
    try:
        engine.block_size = value
    except ValueError as e:
        raise _UsageError(f"--block-size: {e}") from None


def _run_stream(engine, args, stream, batch: bool = False) -> int:
    """Drive the generation, live (a batch: one line per row) or not; Ctrl-C prints what was committed so far
    (exit 130)."""
    prompts = args.prompt if args.prompt is not None else args.prompt_ids
    view = None if (args.json or args.no_live) else LiveView(engine, args, prompts)
    committed: dict[int | None, list[int]] = {}  # row (None: a single generation) -> tokens so far
    last = None
    t0 = time.perf_counter()
    try:
        if view is not None:
            view.start()
        for update in stream:
            last = update
            if update.kind != "batch":
                committed[update.row] = list(update.committed)
            if view is not None:
                view.show(update)
    except KeyboardInterrupt:
        stream.close()
        if view is not None:
            view.stop()
        print_interrupted(engine, args, committed, time.perf_counter() - t0)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - a failed generation is reported, not a traceback
        if view is not None:
            view.stop()
        return _fail(f"generation failed: {type(e).__name__}: {e}")
    if view is not None:
        view.stop()
    if args.json:
        print(json.dumps(last.result.to_dict()))
    elif batch:
        print_batch(engine, last.result)
    else:
        print_result(engine, last.result)
    return EXIT_OK


def cmd_serve(args) -> int:
    """``clover-lab serve``: the engine, its defaults from the options, then uvicorn until SIGTERM."""
    from pathlib import Path

    from .errors import CloverError
    from .sampling import SamplerSettings

    for name in ("threads", "max_batch", "max_queue", "port"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        engine = load_engine(args)
        engine.compile_steps = args.compile
        engine.settings = SamplerSettings.from_kwargs(engine.settings, **_sampler_kwargs(args))
        if args.max_new_tokens is not None:
            engine.max_new_tokens = args.max_new_tokens
        if args.block_size is not None:
            _set_block_size(engine, args.block_size)
        from .serve.server import serve

        name = args.served_model_name or (Path(args.model).name if args.model else "clover-stdlib")
        serve(engine, args.host, args.port, name, args.max_batch, args.max_queue, args.graceful)
    except (_UsageError, CloverError, FileNotFoundError, ValueError, OSError) as e:
        return _fail(str(e))
    return EXIT_OK


def cmd_check(args) -> int:
    """``clover-lab check``: the table and the verdict (exit 0 whatever the verdict)."""
    from .check import check_preview
    from .corpus import corpus_documents
    from .errors import CloverError

    if args.windows < 1:
        return _fail(f"--windows must be >= 1, got {args.windows}")
    try:  # the corpus and the output checked before the model loads
        data = None if args.data is None else corpus_documents([Path(d) for d in args.data], "--data")
        out = None if args.json is None else writable_file(args.json, "--json")
        engine = load_engine(args)
        report = check_preview(engine, data=data, windows_count=args.windows)
        if out is not None:
            report.save(out)
    except (CloverError, FileNotFoundError, ValueError, TypeError, OSError) as e:
        return _fail(str(e))
    print(report.table())
    print(report.verdict())
    return EXIT_OK


def cmd_routes(args) -> int:
    """``clover-lab routes``: one process, or one rank of a torchrun job (gloo on CPUs, NCCL on GPUs)."""
    import os

    import torch.distributed as dist

    from .analysis import route_stats
    from .corpus import corpus_documents
    from .errors import CloverError
    from .load_checks import resolve_device

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
        engine = load_engine(args)
        stats = route_stats(engine, data, mode=args.mode, batch_size=args.batch_size, seq_len=args.seq_len)
        if world > 1:  # every rank done with gloo before any tears it down (a peer gone aborts the other)
            dist.barrier()
    except (CloverError, FileNotFoundError, ValueError, TypeError, OSError) as e:
        return _fail(str(e))
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


if __name__ == "__main__":
    sys.exit(main())
