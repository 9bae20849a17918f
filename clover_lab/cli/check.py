"""``clover-lab check``: does the preview denoise as a trained preview, and under which reading
of its weights (``clover_lab/lens/preview_check.py``)."""
from __future__ import annotations

from pathlib import Path

from clover_lab.cli.arguments import writable_file
from clover_lab.cli.options import EXIT_OK, check_options, data_inputs, fail, load_engine


def add_parser(sub) -> None:
    """The ``check`` subcommand and its options."""
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


def cmd_check(args) -> int:
    """``clover-lab check``: the table and the verdict (exit 0 whatever the verdict)."""
    from clover_lab.checkpoint.loading import model_path
    from clover_lab.corpus import corpus_documents
    from clover_lab.errors import CloverError
    from clover_lab.lens.preview_check import check_preview
    from clover_lab.writes import refuse_inputs

    if args.windows < 1:
        return fail(f"--windows must be >= 1, got {args.windows}")
    try:  # the options, the corpus and the output checked before the model loads
        check_options(args)
        data = None if args.data is None else corpus_documents([Path(d) for d in args.data], "--data")
        out = None if args.json is None else writable_file(args.json, "--json")
        if out is not None:  # never over the checkpoint or the text it reads
            refuse_inputs(out, [("the model directory", model_path(args.model))] + data_inputs(args), "--json")
        engine = load_engine(args)
        report = check_preview(engine, data=data, windows_count=args.windows)
        if out is not None:
            report.save(out)
    except (CloverError, FileNotFoundError, ValueError, TypeError, OSError) as e:
        return fail(str(e))
    print(report.table())
    print(report.verdict())
    return EXIT_OK
