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


def ring_window_mask(lengths: jax.Array, start: jax.Array, window: int, capacity: int) -> jax.Array:
    """[B, window]: which slots of a ring (slot = position % window) hold a position of [start, lengths) inside
    the capacity. Slot r holds start + ((r - start) mod window): the window never holds more than `window`."""
    slots = jnp.arange(window, dtype=jnp.int32)
    positions = start[:, None] + jnp.remainder(slots[None, :] - start[:, None], window)
    return (positions < lengths[:, None]) & (positions < capacity)


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
