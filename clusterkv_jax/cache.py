"""The KV cache: capacity-padded arrays with per-sequence lengths, plus the selection policy's state."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from clusterkv_jax.config import ModelConfig


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer, padded to a static capacity S.

    Rows at or past `lengths[b]` of sequence b are padding. Donate it to the step that consumes it.
    """

    k: jax.Array  # [L, B, K, S, H]
    v: jax.Array  # [L, B, K, S, H]
    lengths: jax.Array  # [B] int32: tokens stored (prompt + generated)
    prompt_lengths: jax.Array  # [B] int32: tokens that came from the prompt
    policy_state: Any  # the policy's pytree, every leaf with a leading [L] axis

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]


def init_cache(config: ModelConfig, policy, batch_size: int, capacity: int, dtype=jnp.bfloat16) -> KVCache:
    """An empty cache for `batch_size` sequences of up to `capacity` tokens each."""
    shape = (config.num_layers, batch_size, config.num_kv_heads, capacity, config.head_dim)
    zeros_b = jnp.zeros((batch_size,), jnp.int32)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        lengths=zeros_b,
        prompt_lengths=zeros_b,
        policy_state=policy.init_state(config, batch_size, capacity),
    )


def kv_bytes(cache: KVCache) -> int:
    """Bytes held by the key and value arrays."""
    return cache.k.nbytes + cache.v.nbytes
