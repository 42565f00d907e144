"""Small array ops written so that XLA's SPMD partitioner keeps sharded leading dims local."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_k_indices(x: jax.Array, k: int) -> jax.Array:
    """Indices of the k largest entries along the last axis, largest first, ties to the lower index: the
    indices `jax.lax.top_k` returns. A stable sort rather than `lax.top_k`, because the partitioner gathers
    a top_k's whole operand when its leading (batch / head) dims are sharded, while a sort stays per shard."""
    return jnp.argsort(-x, axis=-1, stable=True)[..., :k].astype(jnp.int32)
