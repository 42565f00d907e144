"""`clusterkv bench ...`: the benchmark subcommands, registered on the top-level parser by `register`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from clusterkv_jax.commands import (HelpFormatter, add_policy_flags, int_list, model_and_text, nonnegative_int,
                                    policy_list, policy_options, positive_int, read_text_file)


def _load_model(args):
    from clusterkv_jax import load_model

    if not args.model:
        raise ValueError("pass --model DIR (a converted checkpoint) or --synthetic NAME")
    model = load_model(args.model, dtype=args.dtype)
    if model.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json; the benchmark prompts are text")
    return model


def _bench_model(args):
    """(config, params, prompt_fn or None, label) for a real checkpoint or a synthetic geometry."""
    import jax
    import numpy as np

    if args.synthetic:
        from clusterkv_jax.config import synthetic_config
        from clusterkv_jax.model import for_device, init_params

        config = synthetic_config(args.synthetic, args.layers)
        params = for_device(init_params(config, jax.random.PRNGKey(args.seed), dtype=args.dtype), free=True)
        return config, params, None, f"{args.synthetic} geometry, {config.num_layers} layers, random weights"
    model = _load_model(args)
    need = max(args.context) * args.batch
    if args.text is None:  # the demo's generated document (everyday sentences), as long as needed
        from clusterkv_jax.demo import haystack

        text_path, text = "the generated document", haystack(model.tokenizer, need + 16).document
    else:
        text_path = args.text
        text = read_text_file(text_path)
    ids = model.tokenizer.encode(text[: 8 * need + 100_000], add_special_tokens=False)
    if len(ids) < need:
        raise ValueError(f"{text_path} has {len(ids)} tokens; --context {max(args.context)} x --batch "
                         f"{args.batch} needs {need}")

    def prompt_fn(context: int, batch: int) -> np.ndarray:
        # Different passages of the same length, one per sequence.
        return np.array([ids[i * context:(i + 1) * context] for i in range(batch)], np.int32)

    return model.config, model.params, prompt_fn, os.path.basename(os.path.normpath(args.model))


def _report(results, args, name: str, text: str, title: str) -> int:
    """Prints a benchmark's tables and, with --out, writes NAME.json / .md / .png."""
    from clusterkv_jax.bench.report import write_bench

    print(text)
    if args.out:
        paths = write_bench(results, args.out, name, text, title)
        print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    return 0


def cmd_offload(args) -> int:
    from clusterkv_jax.bench.offload import bench_offload
    from clusterkv_jax.bench.report import format_offload

    model, ids = model_and_text(args)
    results = bench_offload(model, ids, context=args.context, new_tokens=args.new_tokens, budget=args.budget,
                            recall_steps=args.recall_steps)
    print(format_offload(results))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def cmd_decode(args) -> int:
    from clusterkv_jax.bench.decode import bench_decode, make_policies
    from clusterkv_jax.bench.measure import measure_bandwidth
    from clusterkv_jax.bench.report import format_decode

    if args.compare_hf and args.synthetic:
        raise ValueError("--compare-hf needs a real --model")
    if args.layers is not None and not args.synthetic:
        raise ValueError("--layers applies to --synthetic geometries only")
    mesh = None
    if args.mesh:
        from clusterkv_jax import sharding as sh

        sh.request_host_devices(args.mesh)  # on CPU: before JAX starts its backends
        if args.model:
            sh.check_mesh_for_model(args.mesh, args.model, args.dtype)
        mesh = sh.make_mesh(args.mesh)
    policies = make_policies(args.policies, args.budgets, offload_kv=args.offload, policy_options=policy_options(args))
    config, params, prompt_fn, label = _bench_model(args)
    bandwidth = measure_bandwidth()["bandwidth_Bps"]
    hf_model = None
    if args.compare_hf:
        from clusterkv_jax.bench.hf import hf_model_from_params

        hf_model = hf_model_from_params(config, params, args.dtype)
    results = bench_decode(params, config, policies, args.context, decode=args.decode, batch=args.batch,
                           prompt_fn=prompt_fn, synthetic_seed=args.seed, bandwidth_Bps=bandwidth, hf_model=hf_model,
                           mesh=mesh, decode_loop=args.decode_loop)
    results["model"] = label
    results["offload"] = args.offload
    return _report(results, args, "decode", format_decode(results), f"decode speed: {label}, batch {args.batch}")


def cmd_prefill(args) -> int:
    from clusterkv_jax.bench.decode import make_policies
    from clusterkv_jax.bench.prefill import bench_prefill, format_prefill, plot_prefill

    if args.layers is not None and not args.synthetic:
        raise ValueError("--layers applies to --synthetic geometries only")
    if args.compare_hf:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as e:
            raise ValueError(f"HF transformers' prefill needs torch and transformers ({e}); install the test extra "
                             "(pip install -e '.[test]') or pass --no-compare-hf") from e
    policies = make_policies(args.policies, args.budgets, policy_options=policy_options(args))
    config, params, prompt_fn, label = _bench_model(args)
    hf_model = None
    if args.compare_hf:
        from clusterkv_jax.bench.hf import hf_model_from_params, same_device_as_jax

        hf_model = hf_model_from_params(config, params, args.dtype, device=same_device_as_jax())
    results = bench_prefill(params, config, policies, args.context, batch=args.batch, repeats=args.repeats,
                            prompt_fn=prompt_fn, seed=args.seed, hf_model=hf_model)
    results["model"] = label
    text, title = format_prefill(results), f"prefill: {label}, batch {args.batch}"
    print(text)
    if args.out:
        from clusterkv_jax.eval.report import write_outputs

        paths = write_outputs(results, args.out, "prefill", f"# {title}\n\n{text}\n",
                              lambda path: plot_prefill(results, path, title))
        print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    return 0


def cmd_attention(args) -> int:
    import jax.numpy as jnp

    from clusterkv_jax.bench.attention import bench_attention
    from clusterkv_jax.bench.decode import make_policies
    from clusterkv_jax.bench.report import format_attention
    from clusterkv_jax.config import ModelConfig, synthetic_config

    config = synthetic_config(args.synthetic) if args.synthetic else ModelConfig.from_dir(args.model)
    policies = make_policies(args.policies, args.budgets, policy_options=policy_options(args))
    results = bench_attention(config, policies, args.context, batch=args.batch, dtype=jnp.dtype(args.dtype),
                              repeats=args.repeats, seed=args.seed)
    label = args.synthetic or os.path.basename(os.path.normpath(args.model))
    results["model"] = label
    return _report(results, args, "attention", format_attention(results), f"one layer's decode attention: {label}")


def register(sub) -> None:
    """Adds `bench` and its subcommands to the top-level parser's subparsers `sub`."""
    bench = sub.add_parser("bench", help="benchmarks: decode, prefill, attention, offload")
    bench = bench.add_subparsers(dest="bench_command", required=True)
    o = bench.add_parser("offload", help="ClusterKV with host-offloaded KV: recall-cache hit rates, KV bytes, "
                                         "clustering share", formatter_class=HelpFormatter)
    o.add_argument("--model", required=True)
    o.add_argument("--text", required=True)
    o.add_argument("--context", type=positive_int, default=8000)
    o.add_argument("--new-tokens", type=positive_int, default=256)
    o.add_argument("--budget", type=positive_int, default=1024)
    o.add_argument("--recall-steps", type=int_list, default=[1, 2],
                   help="comma-separated: the device keeps the blocks selected in the last N steps")
    o.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    o.add_argument("--max-chars", type=nonnegative_int, default=0)
    o.add_argument("--json", default=None)
    o.set_defaults(func=cmd_offload)

    def bench_parser(name, help, func, contexts, policies):
        from clusterkv_jax.config import SYNTHETIC_GEOMETRIES

        b = bench.add_parser(name, help=help, formatter_class=HelpFormatter)
        src = b.add_mutually_exclusive_group(required=True)
        src.add_argument("--model", help="a converted checkpoint directory")
        src.add_argument("--synthetic", choices=sorted(SYNTHETIC_GEOMETRIES),
                         help="random weights with this model's geometry")
        b.add_argument("--context", type=int_list, default=contexts, help="comma-separated context lengths")
        b.add_argument("--budgets", type=int_list, default=[512, 1024])
        b.add_argument("--policies", type=policy_list, default=policy_list(policies))
        b.add_argument("--batch", type=positive_int, default=1, help="sequences decoded together")
        b.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
        b.add_argument("--seed", type=int, default=0)
        b.add_argument("--out", default=None, help="directory for NAME.json, NAME.md and NAME.png")
        add_policy_flags(b)
        b.set_defaults(func=func)
        return b

    dec = bench_parser("decode", "decode latency/throughput of each policy vs full KV, clustering share, roofline",
                       cmd_decode, [1000, 2000, 4000, 8000], "full,clusterkv,quest")
    dec.add_argument("--decode", type=positive_int, default=64, help="decode steps per policy and context")
    dec.add_argument("--layers", type=positive_int, default=None, help="--synthetic only: number of layers")
    dec.add_argument("--text", default=None, help="prompt text, a long UTF-8 file (default: a document generated as "
                     "`clusterkv demo`'s)")
    dec.add_argument("--offload", action="store_true", help="keep KV in host memory (full, clusterkv, quest)")
    dec.add_argument("--mesh", default=None, metavar="data=D,model=M", help="shard params, caches and batch "
                     "over devices (see README, Multiple devices)")
    dec.add_argument("--compare-hf", action="store_true",
                     help="also time HF transformers' full-KV decode of the same weights (needs torch)")
    dec.add_argument("--decode-loop", action="store_true",
                     help="also time generate's decode loop as one program and in the chunks that let Ctrl-C stop "
                          "it (the cost of stopping within a second)")
    pre = bench_parser("prefill", "time to first token of each policy vs full KV and HF transformers, indexing share",
                       cmd_prefill, [2000, 8000], "full,clusterkv")
    pre.add_argument("--repeats", type=positive_int, default=3, help="interleaved runs per contender (median)")
    pre.add_argument("--layers", type=positive_int, default=None, help="--synthetic only: number of layers")
    pre.add_argument("--text", default=None, help="prompt text, a long UTF-8 file (default: a document generated as "
                     "`clusterkv demo`'s)")
    pre.add_argument("--compare-hf", action=argparse.BooleanOptionalAction, default=True,
                     help="HF transformers' prefill of the same weights in the same run (needs torch)")
    att = bench_parser("attention", "one layer's decode attention alone: full vs select + gather + attend",
                       cmd_attention, [8000, 16000, 32000], "full,clusterkv,quest")
    att.add_argument("--repeats", type=positive_int, default=20)
