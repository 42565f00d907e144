"""`clusterkv bench offload`: ClusterKV with host-offloaded KV: the device recall cache's hit rate for each
R = recall_steps, the rows moved per step, the device and host KV bytes, and the clustering's share of prefill
(prefill with ClusterKV minus prefill with full KV, timed interleaved in one process)."""

from __future__ import annotations

import statistics
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clusterkv_jax.bench.measure import timed
from clusterkv_jax.cache import init_cache, kv_bytes
from clusterkv_jax.generate import generate
from clusterkv_jax.steps import bucket_length, cache_capacity, prefill
from clusterkv_jax.offload import hit_rates
from clusterkv_jax.policies import ClusterKV, FullKV


def prefill_times(model, prompt_ids: list[int], policies: dict[str, Any], repeats: int = 3,
                  new_tokens: int = 0) -> dict[str, dict[str, float]]:
    """Compile time and median prefill seconds per policy, measured round-robin so noise hits all alike."""
    config, context = model.config, len(prompt_ids)
    bucket = bucket_length(context)
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :context] = prompt_ids
    tokens, lengths = jnp.asarray(tokens), jnp.array([context], jnp.int32)
    capacity = cache_capacity(bucket, max(new_tokens, 1))
    dtype = jax.tree_util.tree_leaves(model.params)[0].dtype

    def run(policy):
        cache = init_cache(config, policy, 1, capacity, dtype)
        jax.block_until_ready(cache)
        return timed(lambda: prefill(model.params, tokens, lengths, cache, config=config, policy=policy))[1]

    first = {name: run(p) for name, p in policies.items()}
    samples: dict[str, list[float]] = {name: [] for name in policies}
    for _ in range(repeats):
        for name, p in policies.items():
            samples[name].append(run(p))
    return {name: {"compile_s": first[name] - statistics.median(samples[name]),
                   "prefill_s": statistics.median(samples[name])} for name in policies}


def bench_offload(model, token_ids: list[int], *, context: int, new_tokens: int, budget: int,
                  recall_steps: list[int], progress: bool = True) -> dict[str, Any]:
    if len(token_ids) < context:
        raise ValueError(f"text has {len(token_ids)} tokens; --context {context} needs more")
    prompt = token_ids[:context]
    results: dict[str, Any] = {"context": context, "new_tokens": new_tokens, "budget": budget, "runs": {}}
    for R in recall_steps:
        policy = ClusterKV(budget=budget, offload=True, recall_steps=R)
        out = generate(model, prompt, new_tokens, policy=policy, stop_at_eos=False, return_cache=True)
        rates = [r for r in hit_rates(out.cache) if r is not None]
        recalls = [g.store.recall for g in out.cache.selecting_groups]
        fetched = sum(float(np.sum(r.fetched)) for r in recalls)
        steps = max(int(np.max(r.step)) for r in recalls)
        results["runs"][f"R={R}"] = {
            "hit_rate": float(np.mean(rates)),
            "hit_rate_per_layer": rates,
            "rows_fetched_per_step": fetched / max(steps, 1),
            "kv_bytes": kv_bytes(out.cache),
            "seconds": out.seconds,
        }
        if progress:
            print(f"R={R}: hit rate {results['runs'][f'R={R}']['hit_rate']:.3f}", file=sys.stderr)
    times = prefill_times(model, prompt, {"full": FullKV(), "clusterkv": ClusterKV(budget=budget)})
    results["prefill"] = times
    clustering = times["clusterkv"]["prefill_s"] - times["full"]["prefill_s"]
    results["clustering_s"] = clustering
    results["clustering_share_of_prefill"] = clustering / times["clusterkv"]["prefill_s"]
    return results
