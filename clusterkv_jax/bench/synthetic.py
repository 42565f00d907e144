"""Synthetic caches: random K/V of a real geometry, with keys that gather around directions as real keys do,
stored and indexed as a prefill would (`attend.write_prompt`), for contexts no small real model reaches."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from clusterkv_jax.attend import write_prompt
from clusterkv_jax.bench.measure import compiled, timed
from clusterkv_jax.cache import KVCache, init_cache
from clusterkv_jax.config import ModelConfig


def synthetic_kv(key, config: ModelConfig, batch: int, context: int, capacity: int, dtype, centers: int = 64):
    """Random K, V [L, B, K, S, H] whose keys gather around `centers` directions per head (real keys cluster;
    pure noise would not), rows >= context zero."""
    L, K, H = config.num_layers, config.num_kv_heads, config.head_dim
    kc, ka, kn, kv = jax.random.split(key, 4)
    center = jax.random.normal(kc, (L, 1, K, centers, H))
    which = jax.random.randint(ka, (L, batch, K, capacity), 0, centers)
    noise = jax.random.normal(kn, (L, batch, K, capacity, H))
    keys = jnp.take_along_axis(center, which[..., None], axis=3) + 0.5 * noise
    values = jax.random.normal(kv, (L, batch, K, capacity, H))
    valid = (jnp.arange(capacity) < context)[None, None, None, :, None]
    return jnp.where(valid, keys, 0).astype(dtype), jnp.where(valid, values, 0).astype(dtype)


def synthetic_prefill(config: ModelConfig, policy, kv, context: int, capacity: int,
                      dtype) -> tuple[KVCache, jax.Array, dict[str, float]]:
    """A cache holding synthetic KV as if `context` tokens were prefilled; 'prefill' time = the indexing."""
    keys, values = kv
    B = keys.shape[1]
    lengths = jnp.full((B,), context, jnp.int32)
    cache = init_cache(config, policy, B, capacity, dtype)
    exe, compile_s = compiled(write_prompt, cache, keys, values, lengths, policy=policy)
    cache, seconds = timed(exe, cache, keys, values, lengths)
    return cache, jnp.zeros((B,), jnp.int32), {"prefill_s": None, "prefill_compile_s": compile_s,
                                               "indexing_s": seconds}
