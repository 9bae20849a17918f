"""Self-distillation data for confident parallel decoding.

A small model trained on real code predicts a masked block with little confidence: the text it
was trained on is far less predictable than the model is sure of. Its own greedy continuations
are different: every token of one is a deterministic function of the prefix, so a block of them
can be learned with high confidence and unmasked in few passes. Following the self-distillation
recipes of dParallel / d3LLM ("certainty forcing"), this module writes a corpus of the model's
own continuations of real training prefixes; ``python -m clover_lab.train --distill FILE`` then mixes it
into the block-diffusion objective (with the confidence term) alongside real text.

    python -m clover_lab.train.distill --run runs/stdlib --sequences 2048

A stopped distillation resumes where it stopped when run again (the rows made so far are kept in
OUT's ``.partial.pt`` beside it, after every batch). Corpora of different prefixes (windows, and
``--functions``' bodies) are mixed into one, rows in the order given, for a stage that trains on both:

    python -m clover_lab.train.distill --merge runs/s/bodies.pt runs/s/windows.pt --out runs/s/both.pt

Continuations are greedy causal decoding (the model's strongest predictor) with a repetition
penalty over the continuation so far, so that the corpus does not teach the model to loop.
"""
from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

import torch

from clover_lab.cpu import set_threads
from clover_lab.engine.engine import Engine
from clover_lab.engine.requests import Request
from clover_lab.engine.sampling import SamplerSettings
from clover_lab.errors import CheckpointError
from clover_lab.model.decoder import CloverModel
from clover_lab.train.functions import head_prompts, uses_arguments
from clover_lab.writes import OutputError, atomic_path, check_writable, refuse_inputs


def greedy_continuations(model: CloverModel, prompts: torch.Tensor, new_tokens: int,
                         repetition_penalty: float = 1.2, window: int = 64) -> torch.Tensor:
    """Greedy causal continuations of a batch of equal-length prompts [B, P] -> [B, new_tokens]:
    the engine's AR decoding (one request of B rows), with the repetition penalty over each row's
    last ``window`` generated tokens; EOS, the mask and the pad token are banned (``logit_bias``),
    so that every row is ``new_tokens`` long."""
    if prompts.dim() != 2 or prompts.shape[1] == 0:
        raise ValueError(f"prompts must be [B, P] with P > 0, got {tuple(prompts.shape)}")
    SamplerSettings(repetition_penalty=repetition_penalty)  # validates it, naming it
    cfg = model.config
    banned = {t: -100 for t in (cfg.eos_token_id, cfg.mask_token_id, cfg.pad_token_id) if t is not None}
    engine = Engine(model)
    engine.eos_token_ids = []
    out = engine.generate(Request([row.tolist() for row in prompts], mode="ar", max_new_tokens=new_tokens,
                                  temperature=0.0, repetition_penalty=repetition_penalty, penalty_window=window,
                                  logit_bias=banned or None))
    return torch.tensor([r.token_ids for r in out], dtype=torch.long, device=model.device)


def distinct_ngrams(ids: torch.Tensor, n: int = 4) -> float:
    """Share of distinct n-grams in a 1-D sequence: near 1 for varied text, low for loops."""
    grams = ids.unfold(0, n, 1)
    if len(grams) == 0:
        return 1.0
    return len(torch.unique(grams, dim=0)) / len(grams)


def make_corpus(model: CloverModel, tokens: torch.Tensor, sequences: int, seq_len: int = 256,
                prompt_lens: tuple[int, ...] = (32, 48, 64, 96, 128), batch_size: int = 256,
                repetition_penalty: float = 1.2, min_distinct: float = 0.6, seed: int = 0,
                progress: bool = True, partial: str | Path | None = None, functions: list | None = None,
                tokenizer=None) -> dict:
    """``sequences`` rows of ``seq_len`` tokens: a real prefix from ``tokens`` (its length one of
    ``prompt_lens``, each a multiple of the block size so that the continuation starts a block)
    followed by the model's greedy continuation. Continuations whose share of distinct 4-grams is
    below ``min_distinct`` (the model looping) are dropped and replaced. Every batch is a whole
    ``batch_size`` (the surplus of the last one is dropped): a step of the cache path costs nearly
    the same for 7 rows as for 64, so a small refill batch would cost as much as a full one.

    ``partial``: a file the rows made so far are saved to after every batch, and resumed from
    when it exists (made by the same model with the same settings, else a CheckpointError): a
    stopped distillation loses at most its batch in progress, and a larger ``sequences`` extends it.

    ``functions`` (``train.functions``: (tokens, head length) pairs): each prefix ends where a
    function's head ends instead (``head_prompts``), so that the continuations are the model's
    own bodies for those heads: the corpus that keeps a prompt-following model confident. With a
    ``tokenizer`` to read the heads, a body that names none of its head's arguments (``self`` and
    ``cls`` aside; ``uses_arguments``) is dropped too, as a loop is: the corpus keeps the bodies
    that follow their prompt."""
    from tqdm.auto import tqdm

    bs = model.config.block_size
    if any(p % bs or p >= seq_len for p in prompt_lens):
        raise ValueError(f"prompt lengths {prompt_lens} must be multiples of the block size {bs} below {seq_len}")
    settings = {"seq_len": seq_len, "prompt_lens": list(prompt_lens), "min_distinct": min_distinct,
                "repetition_penalty": repetition_penalty, "seed": seed,
                "prefixes": ("function heads" + (", bodies that use their arguments" if tokenizer else "")
                             if functions else "windows")}
    gen = torch.Generator().manual_seed(seed)
    rows, prompt_of, dropped = [], [], 0
    if partial is not None:
        resumed = {**settings, "batch_size": batch_size, "model": model_fingerprint(model)}
        state = resume_partial(Path(partial), resumed)
        if state is not None:
            rows, prompt_of, dropped = list(state["sequences"].unbind(0)), state["prompt_lens"].tolist(), state["dropped"]
            gen.set_state(state["generator"])
    bar = tqdm(total=sequences, initial=min(len(rows), sequences), desc="self-distillation", unit="seq",
               disable=not progress)
    while len(rows) < sequences:
        n = batch_size
        P = prompt_lens[int(torch.randint(len(prompt_lens), (1,), generator=gen))]
        heads = None
        if functions:
            prompts, heads = head_prompts(functions, n, P, model.config.eos_token_id, gen)
        else:
            starts = torch.randint(0, len(tokens) - P, (n,), generator=gen)
            prompts = torch.stack([tokens[s:s + P] for s in starts.tolist()]).long()
        cont = greedy_continuations(model, prompts, seq_len - P, repetition_penalty).cpu()
        keep = [i for i in range(n) if distinct_ngrams(cont[i]) >= min_distinct]
        if heads is not None and tokenizer is not None:
            keep = [i for i in keep if uses_arguments(tokenizer.decode(prompts[i, P - heads[i]:].tolist()),
                                                      tokenizer.decode(cont[i].tolist())) is not False]
        dropped += n - len(keep)
        if dropped > 4 * sequences + batch_size:
            raise RuntimeError(f"self-distillation: {dropped} of {dropped + len(rows)} continuations dropped "
                               f"(loops: distinct 4-grams < {min_distinct}, or bodies that ignore their head); "
                               f"lower min_distinct or train the model further")
        rows.extend(torch.cat([prompts[keep], cont[keep]], dim=1).to(torch.int32).unbind(0))
        prompt_of.extend([P] * len(keep))
        bar.update(len(keep))
        if partial is not None:
            with atomic_path(partial) as tmp:
                torch.save({"sequences": torch.stack(rows), "prompt_lens": torch.tensor(prompt_of, dtype=torch.int32),
                            "dropped": dropped, "generator": gen.get_state(), "settings": resumed}, tmp)
    bar.close()
    rows, prompt_of = rows[:sequences], prompt_of[:sequences]
    return {"sequences": torch.stack(rows), "prompt_lens": torch.tensor(prompt_of, dtype=torch.int32),
            "dropped": dropped, "settings": settings}


def merge_corpora(corpora: list[dict], names: list[str] | None = None) -> dict:
    """One corpus of the rows of ``corpora`` (``make_corpus``'s), in the order given: its
    ``settings`` keep each part's (under ``parts``, with its row count), ``dropped`` their sum.
    The rows must be as long as each other (a ValueError names the part that is not)."""
    if not corpora:
        raise ValueError("nothing to merge")
    names = names or [f"corpus {i}" for i in range(len(corpora))]
    length = corpora[0]["sequences"].shape[1]
    for name, c in zip(names, corpora):
        if c["sequences"].shape[1] != length:
            raise ValueError(f"{name}: rows of {c['sequences'].shape[1]} tokens, {names[0]}'s are {length}")
    return {"sequences": torch.cat([c["sequences"] for c in corpora]),
            "prompt_lens": torch.cat([c["prompt_lens"] for c in corpora]),
            "dropped": sum(c["dropped"] for c in corpora),
            "settings": {"seq_len": length, "parts": [{**c["settings"], "rows": len(c["sequences"]), "file": name}
                                                      for name, c in zip(names, corpora)]}}


def model_fingerprint(model: CloverModel) -> str:
    """A hash of the model's weights: a partial corpus resumes only with the model that began it."""
    h = hashlib.sha1()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def resume_partial(partial: Path, settings: dict) -> dict | None:
    """The partial corpus saved in ``partial`` (None when there is none), if ``settings`` made it."""
    if not partial.is_file():
        return None
    state = torch.load(partial, weights_only=False)
    differ = sorted(k for k in settings.keys() | state["settings"].keys()
                    if settings.get(k) != state["settings"].get(k))
    if differ:
        raise CheckpointError(f"{partial}: a partial corpus of {len(state['sequences'])} sequences made with other "
                              f"{', '.join(differ)} (the weights, when 'model'); give those settings again, "
                              f"or delete it to start afresh")
    print(f"resuming {partial}: {len(state['sequences'])} sequences made", flush=True)
    return state


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m clover_lab.train.distill",
                                 description="Write a run's self-distillation corpus: its own greedy continuations")
    ap.add_argument("--run", help="training run directory (its checkpoint/ and data.pt)")
    ap.add_argument("--model", help="instead of a run: a model directory (e.g. a clover-lab adapt --out) ...")
    ap.add_argument("--tokens", help="... and the token streams to take prefixes from (e.g. OUT/training/data.pt)")
    ap.add_argument("--out", help="corpus file (default RUN/distill.pt)")
    ap.add_argument("--sequences", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--repetition-penalty", type=float, default=1.2)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: one for a small model on the CPU, torch's default otherwise: "
                         "at nice 19 on a busy 2-core machine the embedded model made 3.6 sequences/s with one "
                         "thread and under 0.3 with two)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--functions", action="store_true",
                    help="prefixes that end at a function's head (the run's functions.pt, train.functions) "
                         "instead of windows: the model's own bodies for them")
    ap.add_argument("--merge", nargs="+", metavar="CORPUS",
                    help="instead of distilling: write the rows of these corpora, in this order, as one (--out)")
    args = ap.parse_args(argv)
    if args.merge:
        return _merge(ap, args)
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be a positive integer, got {args.threads}")
    model_dir, tokens_file, out = _sources(ap, args)
    try:  # found now, not after the generation
        refuse_inputs(out, [("the model directory", model_dir), ("--tokens", tokens_file)], "--out")
        check_writable(out.parent, what="--out")
    except OutputError as e:
        ap.error(str(e))
    model = CloverModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    set_threads(model, args.threads, respect_user=False)  # a process of its own, as the CLI
    tokens = torch.load(tokens_file)["train"]
    functions = tokenizer = None
    if args.functions:
        if not (tokens_file.parent / "functions.pt").is_file():
            ap.error(f"--functions: {tokens_file.parent / 'functions.pt'} is missing (a run trained with "
                     f"--functions-share makes it)")
        functions = torch.load(tokens_file.parent / "functions.pt")["train"]
        from clover_lab.checkpoint.loading import load_tokenizer

        tokenizer = load_tokenizer(model_dir) or load_tokenizer(tokens_file.parent / "tokenizer")  # a run's
    t0 = time.monotonic()
    partial = partial_path(out)
    try:
        corpus = make_corpus(model, tokens, args.sequences, args.seq_len, batch_size=args.batch_size,
                             repetition_penalty=args.repetition_penalty, seed=args.seed, partial=partial,
                             functions=functions, tokenizer=tokenizer)
    except CheckpointError as e:
        ap.error(str(e))
    with atomic_path(out) as tmp:
        torch.save(corpus, tmp)
    partial.unlink(missing_ok=True)
    print(f"{out}: {len(corpus['sequences'])} sequences of {args.seq_len} tokens in {time.monotonic() - t0:.0f} s "
          f"({corpus['dropped']} continuations dropped: loops" + (", bodies that ignore their head" if functions else "")
          + ")")


def _merge(ap, args) -> None:
    if not args.out:
        ap.error("--merge needs --out")
    out, parts = Path(args.out), [Path(p) for p in args.merge]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        ap.error(f"--merge: no such corpus: {', '.join(missing)}")
    try:
        refuse_inputs(out, [("--merge", p) for p in parts], "--out")
        check_writable(out.parent, what="--out")
        corpus = merge_corpora([torch.load(p, weights_only=False) for p in parts], [str(p) for p in parts])
    except KeyError as e:
        ap.error(f"--merge: not a distillation corpus (no {e})")
    except (OutputError, ValueError) as e:
        ap.error(f"--merge: {e}")
    with atomic_path(out) as tmp:
        torch.save(corpus, tmp)
    print(f"{out}: {len(corpus['sequences'])} sequences of {corpus['settings']['seq_len']} tokens from "
          + ", ".join(f"{p['rows']} of {p['file']}" for p in corpus["settings"]["parts"]))


def partial_path(out: Path) -> Path:
    """Where the corpus ``out`` keeps its rows while it is made (distill1.pt: distill1.partial.pt)."""
    return out.with_name(out.stem + ".partial" + out.suffix)


def _sources(ap, args) -> tuple[Path, Path, Path]:
    """(model directory, token streams, corpus file) from --run, or from --model and --tokens."""
    if args.run:
        run = Path(args.run)
        if not (run / "checkpoint").is_dir() or not (run / "data.pt").is_file():
            ap.error(f"--run {run}: not a training run (needs checkpoint/ and data.pt)")
        return run / "checkpoint", run / "data.pt", Path(args.out or run / "distill.pt")
    if not (args.model and args.tokens and args.out):
        ap.error("give --run, or --model, --tokens and --out")
    if not Path(args.tokens).is_file():
        ap.error(f"--tokens: {args.tokens} is not a file")
    return Path(args.model), Path(args.tokens), Path(args.out)


if __name__ == "__main__":
    main()
