"""Small array ops written so that XLA's SPMD partitioner keeps sharded leading dims local."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_k_indices(x: jax.Array, k: int) -> jax.Array:
    """Indices of the k largest entries along the last axis, largest first, ties to the lower index.

    `jax.lax.top_k`, except while tracing under a multi-device mesh (`clusterkv_jax.generate` enters the
    abstract mesh of its sharding rules): there the partitioner would gather a top_k's whole operand when
    its leading (batch / head) dims are sharded, so a stable sort, which picks the same indices and stays
    per shard, runs instead. Without a mesh top_k is kept: on CPU it is ~15x faster than the full sort
    (2,002 page scores x 32 heads: 0.6 vs 10 ms).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return jax.lax.top_k(x, k)[1].astype(jnp.int32)
    return jnp.argsort(-x, axis=-1, stable=True)[..., :k].astype(jnp.int32)


def map_leading(fn, n: int):
    """fn vmapped over n leading dims: batched without merging them into one, so dims on different mesh
    axes (batch, heads) stay where they are."""
    for _ in range(n):
        fn = jax.vmap(fn)
    return fn
