"""A small recall and perplexity sweep over policies and budgets, written as JSON, markdown and PNG.

    python examples/eval_sweep.py --text book.txt --out sweep/
    python examples/eval_sweep.py --text book.txt --out sweep/ --context 4000 --budgets 128,256,512,1024

Recall (`run_recall`): on the exact full-KV trajectory, how many of the true top-B prompt tokens (by q·k) each
policy's selection holds, and how much of the attention mass. Perplexity (`run_ppl`): the policy is active
while the text after the context is teacher-forced one decode step at a time. `clusterkv eval recall|ppl`
runs the same functions with more options; docs/research_log.md has larger runs.

Environment (used by the tests): CLUSTERKV_EXAMPLE_MODEL, the converted checkpoint (default: the bundled
SmolLM2-135M-Instruct, converted once); CLUSTERKV_EXAMPLE_FAST=1, tiny contexts, budgets and step counts;
CLUSTERKV_EXAMPLE_TEXT, the default --text.
"""

from __future__ import annotations

import argparse
import os
import time

import clusterkv_jax as ckv
from clusterkv_jax.cli import smollm2_model_dir
from clusterkv_jax.eval.ppl import run_ppl
from clusterkv_jax.eval.recall import run_recall
from clusterkv_jax.eval.report import markdown_table, write_report

FAST = os.environ.get("CLUSTERKV_EXAMPLE_FAST", "") not in ("", "0")


def csv(kind):
    return lambda text: [kind(v) for v in text.split(",") if v.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.environ.get("CLUSTERKV_EXAMPLE_MODEL"),
                   help="a converted checkpoint (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--text", default=os.environ.get("CLUSTERKV_EXAMPLE_TEXT"), help="a long UTF-8 text file")
    p.add_argument("--out", default="eval_sweep_out", help="directory for recall.* and ppl.*")
    p.add_argument("--context", type=int, default=256 if FAST else 2048, help="prompt tokens")
    p.add_argument("--budgets", type=csv(int), default=[32, 64] if FAST else [128, 256, 512])
    p.add_argument("--recall-policies", type=csv(str), default=["clusterkv", "quest", "streaming", "oracle"])
    p.add_argument("--ppl-budgets", type=csv(int), default=[64] if FAST else None, help="default: --budgets")
    p.add_argument("--ppl-policies", type=csv(str),
                   default=["clusterkv"] if FAST else ["clusterkv", "quest", "streaming"])
    p.add_argument("--steps", type=int, default=2 if FAST else 16, help="decode steps scored for recall")
    p.add_argument("--eval-tokens", type=int, default=8 if FAST else 256, help="tokens scored for perplexity")
    args = p.parse_args()
    if not args.text:
        p.error("--text FILE is required (or set CLUSTERKV_EXAMPLE_TEXT)")

    model = ckv.load_model(args.model or smollm2_model_dir(), dtype="float32")
    need = args.context + max(args.steps, args.eval_tokens)
    with open(args.text, encoding="utf-8") as f:
        ids = model.tokenizer.encode(f.read(20 * need), add_special_tokens=False)  # ~4 characters a token
    print(f"text: {len(ids)} tokens read; context {args.context}")

    t0 = time.perf_counter()
    recall = run_recall(model, ids, context=args.context, steps=args.steps, budgets=args.budgets,
                        policy_names=args.recall_policies)
    tables = {"top-B token recall": recall["token_recall"], "attention-mass recall": recall["mass_recall"]}
    paths = write_report(recall, args.out, "recall", tables, f"Recall, context {args.context}, {args.steps} steps")
    print(f"\nrecall ({time.perf_counter() - t0:.1f}s)")
    for metric, table in tables.items():
        print(f"{metric}\n{markdown_table(table)}\n")

    t0 = time.perf_counter()
    ppl = run_ppl(model, ids, context=args.context, eval_tokens=args.eval_tokens,
                  budgets=args.ppl_budgets or args.budgets, policy_names=args.ppl_policies)
    tables = {"perplexity": ppl["ppl"], "perplexity - full": ppl["delta_vs_full"]}
    paths.update({f"ppl.{k}": v for k, v in write_report(
        ppl, args.out, "ppl", tables, f"Perplexity, context {args.context}, {args.eval_tokens} tokens").items()})
    print(f"perplexity ({time.perf_counter() - t0:.1f}s)")
    for metric, table in tables.items():
        print(f"{metric}\n{markdown_table(table)}\n")
    print("wrote " + ", ".join(sorted(paths.values())))


if __name__ == "__main__":
    main()
