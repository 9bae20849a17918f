"""What the command line's subcommands share: exit codes, the one-line error, the sampler and
placement options, the engine an ``args`` names, and the option types (token ids, device maps,
memory sizes)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import warnings
from pathlib import Path

from clover_lab.signals import check_interrupted

EXIT_OK, EXIT_ERROR, EXIT_INTERRUPTED = 0, 2, 130


class UsageError(Exception):
    """A request the command line refuses; the message is printed as one line, exit code 2."""


def fail(message: str) -> int:
    # an error after a Ctrl-C a library swallowed (a tensor read of the load cut short, reported as a
    # damaged checkpoint) is the Ctrl-C's consequence: "interrupted" and exit 130, not a false error
    check_interrupted()
    message = " ".join(message.split())  # one line, however the message was wrapped
    print(f"clover-lab: error: {message}", file=sys.stderr)
    return EXIT_ERROR


@contextlib.contextmanager
def one_line_warnings():
    """Warnings (a setting the mode ignores, an untrained preview, a release's code not run) as one
    line on stderr, ``clover-lab: warning: ...``, like the errors: not Python's file:line and source."""
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"clover-lab: warning: {' '.join(str(message).split())}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def token_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def add_sampler_options(parser: argparse.ArgumentParser) -> None:
    """One ``--option`` per SamplerSettings field, defaulting to None: what is not given keeps the
    engine's settings (the model's generation_config.json, else SamplerSettings' defaults)."""
    from clover_lab.engine.sampling import SamplerSettings

    types = {"float": float, "int": int, "str": str}
    for f in dataclasses.fields(SamplerSettings):
        if f.metadata.get("cli") is False:  # not a single value (logit_bias: the API's and the server's)
            continue
        help = f"{f.metadata.get('help', '')} (default: {f.default})"
        if str(f.type) == "bool":
            parser.add_argument("--" + f.name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=None,
                                help=help)
            continue
        kind = types[str(f.type).split(" |")[0]]
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None, help=help)


def sampler_kwargs(args) -> dict:
    from clover_lab.engine.sampling import SamplerSettings

    return {name: getattr(args, name) for name in SamplerSettings.names() if getattr(args, name, None) is not None}


def check_options(args) -> None:
    """Every option that can be checked without the model, checked before it loads (a usage error
    after a 70 GB load is minutes lost): the sampler settings, the decoding policy, the lengths,
    and what config.json says of the coreset size and the prompt's token ids (read alone, cheaply)."""
    from clover_lab.checkpoint.loading import load_config, model_path
    from clover_lab.engine.policies import make_policy
    from clover_lab.engine.requests import GenerationError, check_coreset
    from clover_lab.engine.sampling import SamplerSettings

    sampler = sampler_kwargs(args)
    SamplerSettings.from_kwargs(None, **sampler)  # a SettingsError naming the setting
    for name in ("max_new_tokens", "block_size", "threads"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if getattr(args, "policy", None) is not None:
        make_policy(args.policy)
    path = model_path(args.model)
    if path is None or not (path / "config.json").is_file():
        return  # the load says what is missing
    config = load_config(path)
    try:
        check_coreset(config, sampler.get("coreset_size"))
    except GenerationError as e:
        raise UsageError(f"--coreset-size: {e}") from None
    for ids in getattr(args, "prompt_ids", None) or []:
        bad = [t for t in ids if not 0 <= t < config.vocab_size]
        if bad:
            raise UsageError(f"--prompt-ids: token ids {bad[:5]} are outside the vocabulary [0, {config.vocab_size}) "
                             f"of {path}")


def data_inputs(args) -> list[tuple[str, Path]]:
    """``--data``'s files and folders, as inputs no output may overwrite (``writes.refuse_inputs``)."""
    return [("--data", Path(d)) for d in (getattr(args, "data", None) or [])]


def load_engine(args):
    """The engine for ``args``. A seam for tests: ``generate`` calls ``clover_lab.cli.main.load_engine``,
    which a test may replace."""
    from clover_lab.engine import load

    check_interrupted()  # one swallowed by the imports: before a load that may take minutes
    placed = {name: getattr(args, name, None) for name in ("device_map", "max_memory", "keep_fp8", "coreset_size",
                                                            "progress", "check_finite")}  # absent options: defaults
    engine = load(args.model, device=args.device, dtype=args.dtype, pin_memory=getattr(args, "pin_memory", False),
                  **placed)
    check_interrupted()  # a Ctrl-C that a library swallowed while loading: the command stops here
    return engine


def add_placement_options(parser: argparse.ArgumentParser) -> None:
    """Where the weights go: --device-map, --max-memory, --pin-memory, --keep-fp8, --progress."""
    parser.add_argument("--device-map", type=_device_map, default=None, metavar="MAP",
                        help="auto (planned by accelerate within --max-memory), or a JSON object / file of module "
                             "name -> device, e.g. '{\"\": 0, \"model.layers.39.mlp.experts\": \"cpu\"}'; "
                             "experts that do not fit a GPU stay in host memory and are staged when routed")
    parser.add_argument("--max-memory", type=_max_memory, default=None, metavar="DEV=SIZE,...",
                        help="memory per device for --device-map auto, e.g. 0=22GiB,1=22GiB,cpu=120GiB")
    parser.add_argument("--pin-memory", action="store_true", help="offloaded experts page-locked in place "
                        "(asynchronous staging; no second copy, their size stays pinned in RAM)")
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


def set_block_size(engine, value: int) -> None:
    try:
        engine.block_size = value
    except ValueError as e:
        raise UsageError(f"--block-size: {e}") from None
