"""lm-eval's loglikelihood (multiple-choice) requests over `clover-lab serve`, through lm-eval's own
OpenAI-completions client (``LocalCompletionsAPI``: token-id prompts, ``echo: true``, ``logprobs:
1``), on a few hand-written code questions (lm-eval's tasks need their datasets; these need none),
each choice's log-likelihood beside the engine's own scoring of the same tokens
(``Request(prompt_logprobs=...)``).

    clover-lab serve &                       # the embedded model on 127.0.0.1:8000
    pip install lm-eval
    python examples/lm_eval_loglikelihood.py [--base-url http://127.0.0.1:8000/v1] [--model clover-stdlib]

A full task runs the same way: ``lm_eval --model local-completions --model_args
model=clover-stdlib,base_url=http://127.0.0.1:8000/v1/completions,tokenizer=<model dir> --tasks ...``.
"""
from __future__ import annotations

import argparse

QUESTIONS = [  # (context, choices, the right one)
    ("import os\nfiles = os.", ["listdir(path)", "banana(path)", "ZZZ"], 0),
    ("def add(a, b):\n    return a", [" + b", " ** banana", " ]"], 0),
    ("for i in range(", ["10):", "}}}", "lambda"], 0),
    ("with open(path) as f:\n    text = f.", ["read()", "swim()", "("], 0),
]


def run(base_url: str, model: str, tokenizer: str) -> list[dict]:
    """Per question: lm-eval's log-likelihood of each choice, whether it is greedy, and its pick."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=f"{base_url}/completions", model=model, tokenizer_backend="huggingface",
                             tokenizer=tokenizer, max_retries=1)
    rows = []
    for q, (context, choices, right) in enumerate(QUESTIONS):
        requests = [Instance("loglikelihood", {}, (context, choice), idx=k) for k, choice in enumerate(choices)]
        scores = lm.loglikelihood(requests, disable_tqdm=True)
        pick = max(range(len(choices)), key=lambda k: scores[k][0])
        rows.append({"context": context, "choices": choices, "loglikelihood": [s for s, _ in scores],
                     "greedy": [g for _, g in scores], "pick": pick, "right": right})
    return rows


def main() -> None:
    from clover_lab.checkpoint.loading import model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="clover-stdlib")
    p.add_argument("--tokenizer", default=None, help="the served model's directory (default: the embedded model)")
    args = p.parse_args()
    rows = run(args.base_url, args.model, args.tokenizer or str(model_path()))
    print("| context | choice | log-likelihood | greedy |")
    print("|---|---|---|---|")
    for r in rows:
        for k, choice in enumerate(r["choices"]):
            mark = " (picked)" if k == r["pick"] else ""
            print(f"| {r['context']!r} | {choice!r}{mark} | {r['loglikelihood'][k]:.3f} | {r['greedy'][k]} |")
    right = sum(r["pick"] == r["right"] for r in rows)
    print(f"\naccuracy: {right}/{len(rows)}")


if __name__ == "__main__":
    main()
