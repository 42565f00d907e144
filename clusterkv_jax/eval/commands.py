"""`clusterkv eval ...`: the evaluation subcommands, registered on the top-level parser by `register`."""

from __future__ import annotations

import argparse
import os
import sys

from clusterkv_jax.commands import (HelpFormatter, add_mesh_flags, add_policy_flags, int_list, model_and_text,
                                    nonnegative_int, policy_list, policy_options, positive_int, prepare_mesh)


def _load_eval_model(args):
    from clusterkv_jax import load_model

    model = load_model(args.model, dtype=args.dtype)
    if model.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json; this evaluation reads text")
    return model


def _finish(results, args, name, tables, title, fmt="{:.3f}") -> int:
    from clusterkv_jax.eval.report import markdown_table, write_report

    for metric, table in tables.items():
        print(f"{metric}\n{markdown_table(table, fmt)}\n")
    if getattr(args, "distributed", False):
        import jax

        if jax.process_index() != 0:  # every process has the same results; one writes them (a shared disk)
            if args.out or getattr(args, "json", None):
                print(f"process {jax.process_index()}: process 0 writes the files", file=sys.stderr)
            return 0
    if args.out:
        paths = write_report(results, args.out, name, tables, title, fmt)
        print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    if getattr(args, "json", None):
        from clusterkv_jax.eval.recall import write_json

        write_json(results, args.json)
    return 0


def _append_markdown(args, name: str, heading: str, table: str) -> None:
    print(f"{heading}\n{table}\n")
    if args.out:
        with open(os.path.join(args.out, f"{name}.md"), "a", encoding="utf-8") as f:
            f.write(f"## {heading}\n\n{table}\n")


def cmd_recall(args) -> int:
    from clusterkv_jax.eval.recall import run_recall

    model, ids = model_and_text(args)
    options = policy_options(args)
    results = run_recall(model, ids, context=args.context, steps=args.steps, budgets=args.budgets,
                         policy_names=args.policies, policy_options=options)
    results["policy_options"] = options
    return _finish(results, args, "recall", {"top-B token recall": results["token_recall"],
                                             "attention-mass recall": results["mass_recall"]},
                   f"Recall, context {args.context}, {args.steps} steps")


def cmd_ppl(args) -> int:
    from clusterkv_jax.eval.ppl import run_ppl

    prepare_mesh(args)
    model, ids = model_and_text(args)
    if args.mesh:  # each process holds its shards, not the whole
        from clusterkv_jax.distributed import describe_share

        print(describe_share("the parameters", model.params), file=sys.stderr)
    results = run_ppl(model, ids, context=args.context, eval_tokens=args.eval_tokens, budgets=args.budgets,
                      policy_names=args.policies, windows=args.windows, policy_options=policy_options(args))
    return _finish(results, args, "ppl", {"perplexity": results["ppl"], "perplexity - full": results["delta_vs_full"],
                                          "next-token top-1 agreement with full KV": results["top1_agreement"],
                                          "KL(full || policy) per token, nats": results["kl_vs_full"]},
                   f"Perplexity, context {args.context}, {args.eval_tokens} tokens x {args.windows} windows",
                   fmt="{:.4f}")


def cmd_agreement(args) -> int:
    from clusterkv_jax.eval.agreement import run_agreement

    model, ids = model_and_text(args)
    results = run_agreement(model, ids, context=args.context, new_tokens=args.new_tokens, samples=args.samples,
                            budgets=args.budgets, policy_names=args.policies, policy_options=policy_options(args))
    return _finish(results, args, "agreement", {"token agreement": results["token_agreement"],
                                                "sequence agreement": results["sequence_agreement"]},
                   f"Greedy agreement with full KV, context {args.context}, {args.new_tokens} new tokens")


def _longbench_tasks(text: str) -> list[str]:
    from clusterkv_jax.eval.longbench import parse_tasks

    try:
        return parse_tasks(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def _synthetic_tasks(text: str) -> list[str]:
    from clusterkv_jax.eval.synthetic import parse_tasks

    try:
        return parse_tasks(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def cmd_longbench(args) -> int:
    from clusterkv_jax.eval.longbench import LONGBENCH_TASKS, run_longbench, task_table

    model = _load_eval_model(args)
    tasks = args.tasks or list(LONGBENCH_TASKS)
    results = run_longbench(model, args.data_dir, tasks, args.max_length, args.budgets, args.policies,
                            policy_options(args), limit=args.limit, batch_size=args.batch_size,
                            max_new_tokens=args.max_new_tokens)
    rc = _finish(results, args, "longbench", {"LongBench average score": results["average"]},
                 f"LongBench, {len(tasks)} tasks, max length {args.max_length}", fmt="{:.2f}")
    _append_markdown(args, "longbench", "per-task scores", task_table(results))
    return rc


def cmd_synthetic(args) -> int:
    from clusterkv_jax.eval.synthetic import SYNTHETIC_TASKS, run_synthetic, task_table

    model = _load_eval_model(args)
    tasks = args.tasks or list(SYNTHETIC_TASKS)
    results = run_synthetic(model, args.context, args.samples, args.budgets, args.policies, policy_options(args),
                            seed=args.seed, tasks=tasks, batch_size=args.batch_size,
                            max_new_tokens=args.max_new_tokens)
    tables = {f"accuracy (%), context {c}": results["accuracy"][str(c)] for c in args.context}
    rc = _finish(results, args, "synthetic", tables,
                 f"Synthetic retrieval, {len(tasks)} task{'s' * (len(tasks) > 1)} x {args.samples} samples",
                 fmt="{:.1f}")
    _append_markdown(args, "synthetic", "per-task accuracy (%)", task_table(results))
    return rc


def register(sub) -> None:
    """Adds `eval` and its subcommands to the top-level parser's subparsers `sub`."""
    ev = sub.add_parser("eval", help="scripted evaluations: recall, ppl, agreement, longbench, synthetic")
    ev = ev.add_subparsers(dest="eval_command", required=True)

    def eval_parser(name, help, func, policies, needs_text=True):
        e = ev.add_parser(name, help=help, formatter_class=HelpFormatter)
        e.add_argument("--model", required=True, help="a converted checkpoint directory")
        if needs_text:
            e.add_argument("--text", required=True, help="a long UTF-8 text file")
        e.add_argument("--budgets", type=int_list, default=[256, 512, 1024, 2048])
        e.add_argument("--policies", type=policy_list, default=policy_list(policies))
        e.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
        e.add_argument("--out", default=None, help="directory for NAME.json, NAME.md and NAME.png")
        if needs_text:
            e.add_argument("--max-chars", type=nonnegative_int, default=0, help="read only this much of the text (0: all)")
        add_policy_flags(e)
        e.set_defaults(func=func)
        return e

    r = eval_parser("recall", "top-B token recall and attention-mass recall of each policy", cmd_recall,
                    "clusterkv,quest,streaming,snapkv,infinigen,oracle")
    r.add_argument("--context", type=positive_int, default=8000)
    r.add_argument("--steps", type=positive_int, default=8)
    r.add_argument("--json", default=None, help="also write the results to this JSON file")
    p = eval_parser("ppl", "perplexity with the policy active during teacher-forced decoding", cmd_ppl,
                    "clusterkv,quest,streaming,snapkv,infinigen")
    p.add_argument("--context", type=positive_int, default=8000)
    p.add_argument("--eval-tokens", type=positive_int, default=1024)
    p.add_argument("--windows", type=positive_int, default=1)
    add_mesh_flags(p)
    a = eval_parser("agreement", "greedy continuations under each policy vs full KV", cmd_agreement,
                    "clusterkv,quest,streaming")
    a.add_argument("--context", type=positive_int, default=8000)
    a.add_argument("--new-tokens", type=positive_int, default=64)
    a.add_argument("--samples", type=positive_int, default=4)
    lb = eval_parser("longbench", "LongBench scores (the paper's 8 English datasets) of each policy",
                     cmd_longbench, "clusterkv,quest,streaming", needs_text=False)
    lb.add_argument("--data-dir", required=True, help="directory of LongBench's DATASET.jsonl files")
    lb.add_argument("--tasks", type=_longbench_tasks, default=None,
                    help="comma-separated datasets (default: all 8 of the paper)")
    lb.add_argument("--max-length", type=positive_int, default=8000, help="prompt tokens kept (truncated in the middle)")
    lb.add_argument("--limit", type=positive_int, default=None, help="use only the first N samples of each dataset")
    lb.add_argument("--batch-size", type=positive_int, default=1, help="prompts generated together")
    lb.add_argument("--max-new-tokens", type=positive_int, default=None,
                    help="override LongBench's per-dataset generation lengths (quick runs only)")
    sy = eval_parser("synthetic", "RULER-style needle / key-value retrieval accuracy of each policy",
                     cmd_synthetic, "clusterkv,quest,streaming", needs_text=False)
    sy.add_argument("--context", type=int_list, default=[4000, 8000], help="comma-separated prompt lengths")
    sy.add_argument("--samples", type=positive_int, default=20, help="samples per task and context")
    sy.add_argument("--tasks", type=_synthetic_tasks, default=None,
                    help="comma-separated, of niah_single, niah_multikey, kv_retrieval (RULER's, the default) and "
                         "demo_needle (`clusterkv demo`'s question for seeds --seed, --seed + 1, ...; its context "
                         "counts the document's tokens)")
    sy.add_argument("--seed", type=int, default=0)
    sy.add_argument("--batch-size", type=positive_int, default=1, help="prompts generated together")
    sy.add_argument("--max-new-tokens", type=positive_int, default=48)
