"""Your own greedy loop over the jitted `prefill` and `decode_step`, checked against `generate`.

`generate` compiles prefill and the whole decode loop into one program. When you need control between steps
(streaming tokens out, stopping on your own condition, editing the logits), drive the two jitted steps
yourself:

    cache = ckv.init_cache(config, policy, batch_size, capacity, dtype)   # capacity-padded, empty
    logits, cache = ckv.prefill(params, tokens, lengths, cache, config=config, policy=policy)
    logits, cache = ckv.decode_step(params, next_tokens, cache, config=config, policy=policy)

Both donate `cache`: its buffers are reused for the returned cache, so never touch the cache you passed in
again, always rebind the name. `config` and `policy` are static (hashable) arguments: each distinct pair
compiles once, and one compiled `decode_step` serves every step (the shapes never change, the lengths are
data). Pad the prompt to a fixed bucket so prompts of similar length share one compiled prefill.

    python examples/jit_generate.py [--policy clusterkv|full] [--max-new-tokens 32]

Environment (used by the tests): CLUSTERKV_EXAMPLE_MODEL, the converted checkpoint (default: the bundled
SmolLM2-135M-Instruct, converted once); CLUSTERKV_EXAMPLE_FAST=1, a short prompt and few tokens;
CLUSTERKV_EXAMPLE_TEXT, the text the prompt is taken from (default: a short built-in story).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import clusterkv_jax as ckv
from clusterkv_jax.steps import bucket_length, cache_capacity


def greedy_loop(model, prompt: list[int], max_new_tokens: int, policy: ckv.KVPolicy) -> tuple[list[int], float]:
    """Greedy decoding with the jitted steps; returns the new tokens and the seconds the decode steps took."""
    config, params = model.config, model.params
    # The same prompt bucket and cache capacity as `generate`, so both run the same shapes.
    bucket = bucket_length(len(prompt))
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, : len(prompt)] = prompt
    lengths = jnp.array([len(prompt)], jnp.int32)
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    cache = ckv.init_cache(config, policy, 1, cache_capacity(bucket, max_new_tokens), dtype)

    old_k = cache.groups[0].store.k  # the first layer group's keys
    logits, cache = ckv.prefill(params, jnp.asarray(tokens), lengths, cache, config=config, policy=policy)
    if old_k.is_deleted():
        print("    prefill donated the empty cache: its buffers now hold the filled cache")
    eos = set(config.eos_token_ids) | {model.tokenizer.eos_token_id}
    out = []
    nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [1]
    start = time.perf_counter()
    while True:
        out.append(int(nxt[0]))  # reading the token waits for the step; your own stopping rule goes here
        if len(out) == max_new_tokens or out[-1] in eos:
            break
        logits, cache = ckv.decode_step(params, nxt, cache, config=config, policy=policy)
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return out, time.perf_counter() - start


def main() -> None:
    from clusterkv_jax.cli import smollm2_model_dir
    from clusterkv_jax.demo_text import DEMO_DOCUMENT

    fast = os.environ.get("CLUSTERKV_EXAMPLE_FAST", "") not in ("", "0")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.environ.get("CLUSTERKV_EXAMPLE_MODEL"))
    p.add_argument("--policy", choices=["clusterkv", "full"], default="clusterkv")
    p.add_argument("--budget", type=int, default=64 if fast else 256)
    p.add_argument("--prompt-tokens", type=int, default=200 if fast else 1000)
    p.add_argument("--max-new-tokens", type=int, default=8 if fast else 32)
    args = p.parse_args()

    model = ckv.load_model(args.model or smollm2_model_dir())
    text = DEMO_DOCUMENT
    if os.environ.get("CLUSTERKV_EXAMPLE_TEXT"):
        with open(os.environ["CLUSTERKV_EXAMPLE_TEXT"], encoding="utf-8") as f:
            text = f.read(20 * args.prompt_tokens)
    prompt = model.tokenizer.encode(text, add_special_tokens=False)[: args.prompt_tokens]
    policy = ckv.ClusterKV(budget=args.budget) if args.policy == "clusterkv" else ckv.FullKV()
    print(f"policy {policy}\nprompt: {len(prompt)} tokens, {args.max_new_tokens} new tokens")

    t0 = time.perf_counter()
    ours, _ = greedy_loop(model, prompt, args.max_new_tokens, policy)  # first run compiles both steps
    print(f"    own loop, first run (compiles prefill and decode_step): {time.perf_counter() - t0:.1f}s")
    ours, decode_s = greedy_loop(model, prompt, args.max_new_tokens, policy)
    steps = len(ours) - 1
    print(f"    own loop, compiled: {steps} decode steps in {decode_s:.2f}s = {steps / decode_s:.1f} steps/s")

    ref = ckv.generate(model, prompt, args.max_new_tokens, policy=policy)  # greedy, stops at EOS like our loop
    n, run_s = len(ref.tokens[0]), ref.prefill_seconds + ref.decode_seconds  # its compile is timed apart
    print(f"    generate, compiled: {n} tokens in {run_s:.2f}s = {n / run_s:.1f} tokens/s (prefill included)")
    print(f"\nown loop: {model.tokenizer.decode(ours)!r}\ngenerate: {ref.texts[0]!r}")
    if ours != ref.tokens[0]:
        raise SystemExit(f"MISMATCH: own loop {ours} != generate {ref.tokens[0]}")
    print("identical tokens: the own loop reproduces generate")


if __name__ == "__main__":
    main()
