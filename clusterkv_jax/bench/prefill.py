"""`clusterkv bench prefill`: time to first token of every policy against full KV and HF transformers, as ratios
measured in one process.

Per context, every policy's `prefill` is compiled ahead (compile seconds reported apart), then the policies and
HF transformers' prefill of the same weights (`bench.hf`, on the same device where torch has it) run round-robin
`repeats` times, so load on the machine hits them alike; each figure is its median. Reported: prefill seconds,
prompt tokens/s, the ratio to full KV's and to HF's prefill, and the policy's indexing of the prompt (ClusterKV's
clustering, which its prefill includes) timed alone on full KV's keys, with its share of the policy's prefill.

`--synthetic` geometries get random weights (ours and, built from them, HF's) and random prompt tokens: the same
work as a real model of that geometry.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from clusterkv_jax.bench.decode import indexing_seconds, selecting_layers
from clusterkv_jax.bench.hf import hf_prefill
from clusterkv_jax.bench.measure import compiled, timed
from clusterkv_jax.bench.report import plot_contexts
from clusterkv_jax.cache import init_cache
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.steps import bucket_length, cache_capacity, prefill
from clusterkv_jax.policies import KVPolicy

#: Cache room past the prompt: what `generate` adds for the first new tokens; prefill does not depend on it.
DECODE_ROOM = 64


def bench_prefill(
    params,
    config: ModelConfig,
    policies: dict[str, KVPolicy],
    contexts: list[int],
    *,
    batch: int = 1,
    repeats: int = 3,
    prompt_fn: Callable[[int, int], np.ndarray] | None = None,
    seed: int = 0,
    hf_model: Any = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Prefill seconds of every policy (and of `hf_model`, an HF transformers model of the same weights) at every
    context (see the module docstring). prompt_fn(context, batch) -> token ids [batch, context]; without one,
    random tokens drawn with `seed`."""
    if "full" not in policies:
        raise ValueError("the policies must include 'full': every figure is a ratio to it")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    results: dict[str, Any] = {"contexts": {}, "batch": batch, "repeats": repeats, "dtype": str(jnp.dtype(dtype)),
                               "device": jax.devices()[0].device_kind, "hf": hf_model is not None}
    for context in contexts:
        if context + DECODE_ROOM > config.max_position_embeddings:
            raise ValueError(f"context {context} + {DECODE_ROOM} exceeds the model's "
                             f"{config.max_position_embeddings} positions")
        prompts = (prompt_fn(context, batch) if prompt_fn else np.random.default_rng(seed).integers(
            0, config.vocab_size, (batch, context), dtype=np.int32))
        tokens = np.zeros((batch, bucket_length(context)), np.int32)
        tokens[:, :context] = prompts
        tokens, lengths = jnp.asarray(tokens), jnp.full((batch,), context, jnp.int32)
        capacity = cache_capacity(bucket_length(context), DECODE_ROOM)
        programs, row = {}, {}
        for name, policy in tqdm(policies.items(), desc=f"context {context}: compile", disable=not progress,
                                 file=sys.stderr):
            cache = init_cache(config, policy, batch, capacity, dtype)
            programs[name], compile_s = compiled(prefill, params, tokens, lengths, cache, config=config,
                                                 policy=policy)
            row[name] = {"prefill_compile_s": compile_s, "runs_s": []}
            del cache
        if hf_model is not None:
            row["hf-full"] = {"runs_s": []}
        full_cache = None
        names = list(row)
        for r in tqdm(range(repeats), desc=f"context {context}: prefill", disable=not progress, file=sys.stderr):
            for name in names[r % len(names):] + names[: r % len(names)]:  # no contender always runs after another
                if name == "hf-full":
                    seconds, row[name]["first_token"] = hf_prefill(hf_model, prompts)
                    row[name]["runs_s"].append(seconds)
                    continue
                cache = init_cache(config, policies[name], batch, capacity, dtype)
                (logits, cache), seconds = timed(programs[name], params, tokens, lengths, cache)
                row[name]["runs_s"].append(seconds)
                row[name]["first_token"] = int(jnp.argmax(logits[0]))  # sequence 0's: what the timed run computed
                if name == "full":
                    full_cache = cache
                del cache
        for info in row.values():
            info["prefill_s"] = statistics.median(info["runs_s"])
            info["prompt_tokens_per_s"] = batch * context / info["prefill_s"]
        for name, info in row.items():
            info["vs_full"] = info["prefill_s"] / row["full"]["prefill_s"]
            if "hf-full" in row:
                info["vs_hf"] = info["prefill_s"] / row["hf-full"]["prefill_s"]
            policy = policies.get(name)
            if policy is not None and (layers := selecting_layers(config, policy, full_cache.capacity)):
                keys = jnp.stack([full_cache.layer_kv(layer)[0] for layer in layers])
                info["indexing_s"] = indexing_seconds(config, policy, keys, full_cache.lengths)
                info["indexing_share_of_prefill"] = info["indexing_s"] / info["prefill_s"]
        results["contexts"][str(context)] = row
        del full_cache, programs
        if progress:
            print(format_prefill_context(context, row), file=sys.stderr)
    return results


def format_prefill_context(context: int, row: dict[str, Any]) -> str:
    hf = "hf-full" in row
    lines = [f"context {context}",
             "| contender | prefill s | prompt tokens/s | / full KV |" + (" / HF |" if hf else "")
             + " indexing s (share) | compile s |",
             "|---|---|---|---|" + ("---|" if hf else "") + "---|---|"]
    for name, r in row.items():
        share = r.get("indexing_share_of_prefill")
        indexing = "" if r.get("indexing_s") is None else f"{r['indexing_s']:.3f} ({100 * share:.1f}%)"
        compile_s = "" if r.get("prefill_compile_s") is None else f"{r['prefill_compile_s']:.1f}"
        lines.append(f"| {name} | {r['prefill_s']:.3f} | {r['prompt_tokens_per_s']:.0f} | {r['vs_full']:.2f}x |"
                     + (f" {r['vs_hf']:.2f}x |" if hf else "") + f" {indexing} | {compile_s} |")
    return "\n".join(lines)


def format_prefill(results: dict[str, Any]) -> str:
    head = (f"prefill: batch {results['batch']}, median of {results['repeats']} interleaved runs, {results['dtype']}, "
            f"{results['device']}" + ("; HF transformers on the same weights" if results["hf"] else ""))
    return "\n\n".join([head] + [format_prefill_context(int(c), row) for c, row in results["contexts"].items()])


def plot_prefill(results: dict[str, Any], path: str, title: str) -> None:
    """Prefill seconds against context, a line per contender, and each one's ratio to full KV's prefill."""
    plot_contexts(results, path, title, [("prefill_s", "prefill seconds", True),
                                         ("vs_full", "prefill time / full KV's", False)])
