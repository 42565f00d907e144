"""Convert a checkpoint, then answer a question about a long document with full KV and with ClusterKV.

    python examples/convert_and_generate.py                        # the bundled SmolLM2-135M-Instruct
    python examples/convert_and_generate.py --gguf model.gguf      # a llama.cpp GGUF (llama / qwen2)
    python examples/convert_and_generate.py --hf path/to/hf_dir    # an HF safetensors directory
    python examples/convert_and_generate.py --document book.txt --context 4000 --budget 512

The converted checkpoint is written once (to `--out`, default under $CLUSTERKV_CACHE or
~/.cache/clusterkv_jax) and reused on later runs. Both policies decode greedily from the same prompt; each is
run twice and the second, already-compiled call gives the tokens/s.

Environment (used by the tests): CLUSTERKV_EXAMPLE_MODEL, a converted checkpoint directory used instead of
converting; CLUSTERKV_EXAMPLE_FAST=1, tiny context, budget and generation length; CLUSTERKV_EXAMPLE_TEXT,
the default document.
"""

from __future__ import annotations

import argparse
import os
import time

import clusterkv_jax as ckv
from clusterkv_jax.cli import cache_dir, smollm2_model_dir
from clusterkv_jax.demo_text import DEMO_DOCUMENT

FAST = os.environ.get("CLUSTERKV_EXAMPLE_FAST", "") not in ("", "0")


def converted_model_dir(args) -> str:
    """The converted checkpoint: --gguf / --hf converted once into --out, else $CLUSTERKV_EXAMPLE_MODEL, else
    the bundled SmolLM2-135M-Instruct."""
    if args.gguf or args.hf:
        from checkpoints_convert import convert_gguf, convert_hf

        src = os.path.abspath(args.gguf or args.hf)
        name = os.path.splitext(os.path.basename(src.rstrip(os.sep)))[0]
        dst = args.out or os.path.join(cache_dir(), f"{name}-{args.dtype}")
        if os.path.isdir(os.path.join(dst, "params")):
            print(f"using the checkpoint converted earlier: {dst}")
            return dst
        t0 = time.perf_counter()
        convert = convert_gguf if args.gguf else convert_hf
        convert(src, dst, dtype=args.dtype, overwrite=True)
        print(f"converted {src} -> {dst} in {time.perf_counter() - t0:.1f}s")
        return dst
    return os.environ.get("CLUSTERKV_EXAMPLE_MODEL") or smollm2_model_dir()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--gguf", help="a llama.cpp GGUF file to convert")
    src.add_argument("--hf", help="an HF safetensors checkpoint directory to convert")
    p.add_argument("--out", help="where to write the converted checkpoint")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--document", default=os.environ.get("CLUSTERKV_EXAMPLE_TEXT"),
                   help="a text file to ask about (default: a short built-in story)")
    p.add_argument("--question", default="Who is the author of this text, and what is its title?")
    p.add_argument("--context", type=int, default=200 if FAST else 2000, help="document tokens to keep")
    p.add_argument("--budget", type=int, default=64 if FAST else 256, help="ClusterKV token budget")
    p.add_argument("--max-new-tokens", type=int, default=8 if FAST else 48)
    args = p.parse_args()

    path = converted_model_dir(args)
    model = ckv.load_model(path)
    print(f"model: {path} ({model.config.num_layers} layers, {model.config.num_kv_heads} KV heads)")
    if args.document:
        with open(args.document, encoding="utf-8") as f:
            document = f.read(40 * args.context)  # plenty of characters for `context` tokens
    else:
        document = DEMO_DOCUMENT

    tok = model.tokenizer
    doc_ids = tok.encode(document, add_special_tokens=False)[: args.context]
    excerpt = tok.decode(doc_ids, skip_special_tokens=False)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"{excerpt}\n\n{args.question}"}]),
                        add_special_tokens=False)
    print(f"prompt: {len(prompt)} tokens ({len(doc_ids)} from the document); question: {args.question}\n")

    policies = [("full KV", ckv.FullKV()), (f"ClusterKV B={args.budget}", ckv.ClusterKV(budget=args.budget))]
    outputs = {}
    for label, policy in policies:
        # generate compiles its prefill and decode programs first and times each compiled run apart
        result = ckv.generate(model, prompt, args.max_new_tokens, policy=policy)
        n = len(result.tokens[0])
        outputs[label] = result.tokens[0]
        print(f"[{label}] {result.texts[0].strip()!r}")
        print(f"    prefill {result.prefill_seconds:.2f}s; {n} new tokens, decode "
              f"{result.decode_tokens_per_second:.1f} tokens/s (compiling took {result.compile_seconds:.1f}s more)")
    (a, full), (b, clustered) = outputs.items()
    same = sum(x == y for x, y in zip(full, clustered))
    print(f"\n{b} agrees with {a} on {same} of the first {min(len(full), len(clustered))} tokens")


if __name__ == "__main__":
    main()
