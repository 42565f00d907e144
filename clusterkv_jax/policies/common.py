"""Slot helpers shared by the policies: windows of positions, sink slots, one selection for every head.

Shapes: B batch, M slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def recent_window(lengths: jax.Array, start: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
    """Positions [start, lengths) as `window` static slots: (idx [B, window], mask [B, window])."""
    offsets = jnp.arange(window, dtype=jnp.int32)
    idx = start[:, None] + offsets[None, :]
    return jnp.minimum(idx, jnp.maximum(lengths[:, None] - 1, 0)), idx < lengths[:, None]


def last_positions(lengths: jax.Array, n: int) -> jax.Array:
    """[B, n]: each prompt's last n positions, slot j position lengths - n + j (negative: before the prompt)."""
    return lengths[:, None] - n + jnp.arange(n, dtype=jnp.int32)


def sink_slots(lengths: jax.Array, sinks: int) -> tuple[jax.Array, jax.Array]:
    """The first `sinks` positions: (idx [B, sinks], mask [B, sinks]) masked past each length."""
    idx = jnp.broadcast_to(jnp.arange(sinks, dtype=jnp.int32), (lengths.shape[0], sinks))
    return idx, idx < lengths[:, None]


def keep_observed(previous: jax.Array, queries: jax.Array, found: jax.Array) -> jax.Array:
    """`KVPolicy.observe_queries`' merge: the found slots of queries [B, N, n, H] (found [B, n]), else previous."""
    return jnp.where(found[:, None, :, None], queries, previous)


def expand_heads(x: jax.Array, heads: int) -> jax.Array:
    """[B, M] -> [B, heads, M] (the same slots for every head)."""
    return jnp.broadcast_to(x[:, None, :], (x.shape[0], heads, x.shape[1]))


def put_at_slot(a: jax.Array, x: jax.Array, slot: jax.Array, due: jax.Array) -> jax.Array:
    """a [B, K, S, ...] with x [B, K, n, ...] written at each sequence's `slot` [B] along S where `due` [B] (the
    other sequences' entries kept): in place, one dynamic slice per sequence (`KVPolicy.add_indexed`)."""
    n = x.shape[2]
    old = jax.vmap(lambda a, at: jax.lax.dynamic_slice_in_dim(a, at, n, axis=1))(a, slot)
    x = jnp.where(due.reshape((-1,) + (1,) * (x.ndim - 1)), x.astype(a.dtype), old)
    return jax.vmap(lambda a, x, at: jax.lax.dynamic_update_slice_in_dim(a, x, at, axis=1))(a, x, slot)
