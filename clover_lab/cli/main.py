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
preview, and under which reading of its weights (``clover_lab/lens/preview_check.py``). Every user error (arguments, the model directory, the device,
the request, a failed generation) is one line on stderr and exit code 2.

This module holds the entry point and ``generate``; each other subcommand is its own module
(``serve.py``, ``routes.py``, ``check.py``; ``train`` and ``adapt`` in ``train/``), the
options they share are in ``options.py`` and the live terminal view in ``view.py``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from clover_lab.cli import check as cli_check
from clover_lab.cli import routes as cli_routes
from clover_lab.cli import serve as cli_serve
from clover_lab.cli.arguments import ArgumentParser
from clover_lab.cli.options import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    UsageError,
    add_placement_options,
    add_sampler_options,
    check_options,
    fail,
    load_engine,
    one_line_warnings,
    sampler_kwargs,
    set_block_size,
    token_ids,
)
from clover_lab.cli.view import LiveView, print_batch, print_interrupted, print_result
from clover_lab.signals import Interrupts, check_interrupted, interrupted

# Nothing above imports torch: main() runs, and takes Ctrl-C, before the heavy imports it makes.


def build_parser() -> argparse.ArgumentParser:
    from clover_lab import cpu
    from clover_lab.engine.requests import MODES

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
    src.add_argument("--prompt-ids", type=token_ids, metavar="IDS", action="append",
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
                        f"{cpu.SMALL_MODEL_PARAMETERS // 10**6}M parameters such as the embedded one, whose GEMMs are "
                        "too small to split; torch's default for a larger one)")
    g.add_argument("--compile", action="store_true",
                   help="CPU: run the steps through torch.compile (about 10 s of compilation per step shape on "
                        "first use, then 2-3x faster steps; pays off over long or repeated generations)")
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    g.add_argument("--no-live", action="store_true", help="no live view; print the result at the end")
    g.set_defaults(func=cmd_generate)

    for command in (cli_serve, cli_routes, cli_check):
        command.add_parser(sub)
    t = sub.add_parser("train", help="train a small Clover on the Python standard library",
                       add_help=False, description="See `clover-lab train --help`.")
    t.set_defaults(func=None)  # handled in main(): its own parser takes every argument after "train"
    a = sub.add_parser("adapt", help="adapt a checkpoint (AR Qwen3.5/3.6-MoE or Clover) with block diffusion",
                       add_help=False, description="See `clover-lab adapt --help`.")
    a.set_defaults(func=None)  # handled in main(), like train
    return parser

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with Interrupts():
        try:
            return _main(argv)
        except KeyboardInterrupt:  # before the generation started (imports, loading): nothing to show
            pass
        except Exception:
            if not interrupted():  # a module a Ctrl-C cut short (numpy's import inside torch's) fails later
                raise
    print("clover-lab: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


def _main(argv: list[str]) -> int:
    if argv[:1] == ["train"]:
        from clover_lab.errors import CloverError
        from clover_lab.train.loop import main as train_main

        try:
            train_main(argv[1:])
        except CloverError as e:
            return fail(str(e))
        except KeyboardInterrupt:  # inside a step: the run said what it resumes from
            return EXIT_INTERRUPTED
        return 0
    if argv[:1] == ["adapt"]:
        from clover_lab.train.adapt import main as adapt_main

        return adapt_main(argv[1:])
    parser = build_parser()  # imports torch: a Ctrl-C its import swallowed is acted on now, not after a load
    check_interrupted()
    args = parser.parse_args(argv)
    with one_line_warnings():
        return args.func(args)


# --------------------------------------------------------------------------- generate
def cmd_generate(args) -> int:
    from clover_lab.engine.requests import ignored_settings, is_batch
    from clover_lab.errors import CloverError

    try:  # what can be checked without the model, before it loads
        check_options(args)
        if args.thinking is not None and not args.chat:
            raise UsageError(f"--{'' if args.thinking else 'no-'}thinking is the chat template's enable_thinking "
                             f"switch: it applies with --chat; add --chat or leave it out")
        for names, why in ignored_settings(args.mode, sampler_kwargs(args), policy=args.policy,
                                           block_size=args.block_size):  # typed, then ignored: refused
            raise UsageError(f"{why}; leave out {', '.join('--' + n.replace('_', '-') for n in names)}, or use "
                             f"another --mode")
    except (UsageError, CloverError, ValueError, TypeError) as e:
        return fail(str(e))
    try:
        engine = load_engine(args)
    except (CloverError, FileNotFoundError, ValueError, OSError) as e:
        return fail(str(e))
    set_threads(engine.model, args.threads)
    engine.compile_steps = args.compile
    try:
        prompt = _prompt(engine, args)
        if args.block_size is not None:
            set_block_size(engine, args.block_size)
        stream = engine.stream(prompt, mode=args.mode, max_new_tokens=args.max_new_tokens, stop=args.stop,
                               policy=args.policy, thinking=args.thinking, **sampler_kwargs(args))
    except (UsageError, CloverError, ValueError, TypeError) as e:
        return fail(str(e))
    return _run_stream(engine, args, stream, batch=is_batch(prompt))


def set_threads(model, count: int | None) -> int:
    """The threads policy of clover_lab/cpu.py for the CLI's process: ``--threads``, else by model."""
    from clover_lab import cpu

    return cpu.set_threads(model, count, respect_user=False)


def _prompt(engine, args):
    """The request's prompt: text, chat messages around it, or token ids; a list of them when the
    option was repeated (a batch)."""
    if args.prompt is None:
        if args.chat:
            raise UsageError("--chat needs --prompt (text), not --prompt-ids")
        prompts = args.prompt_ids
    elif engine.tokenizer is None:
        raise UsageError(f"the model directory {args.model} has no tokenizer, so --prompt cannot be encoded; "
                          f"give token ids with --prompt-ids 1,2,3")
    elif not args.chat:
        prompts = args.prompt
    else:
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompts = [system + [{"role": "user", "content": text}] for text in args.prompt]
    return prompts[0] if len(prompts) == 1 else prompts


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
        return fail(f"generation failed: {type(e).__name__}: {e}")
    if view is not None:
        view.stop()
    if args.json:
        print(json.dumps(last.result.to_dict()))
    elif batch:
        print_batch(engine, last.result)
    else:
        print_result(engine, last.result)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
