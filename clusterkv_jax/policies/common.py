"""Pieces shared by the selecting policies: gathering selected rows and attending over them.

Shapes: B batch, N query heads, K KV heads, G = N // K, S capacity, H head dim, M selected slots per head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from clusterkv_jax import cache
from clusterkv_jax.attention import selection_and_window_attention


def gather_rows(store: jax.Array, idx: jax.Array) -> jax.Array:
    """Rows of store [B, K, S, H] at idx [B, h, M] -> [B, h, M, H]. With h = N query heads, head n reads KV
    head n // G; with h = K each KV head reads its own rows once."""
    B, K, _, H = store.shape
    h, M = idx.shape[1], idx.shape[2]
    # [B, K, (h // K) * M]: each KV head's rows for all of its selection heads at once, with B and K as batching
    # dims of one gather (`cache.gather_rows`, which clamps out-of-range positions), so a sharded store is read
    # shard by shard.
    positions = idx.reshape(B, K, (h // K) * M)
    return cache.gather_rows(store, cache.row_index(positions)).reshape(B, h, M, H)


def attend_to_indices(
    q: jax.Array,  # [B, N, H]
    keys: jax.Array,  # [B, K, S, H]
    values: jax.Array,  # [B, K, S, H]
    idx: jax.Array,  # [B, N, M] per query head, or [B, K, M] shared by a KV head's query heads
    mask: jax.Array,  # same shape as idx: which slots hold a real token
    w_idx: jax.Array | None = None,  # [B, W] an optional window of positions every head attends
    w_mask: jax.Array | None = None,  # [B, W]
) -> jax.Array:
    """Attention of each query head over its selected tokens (and the window), one softmax -> [B, N, H]
    (float32). A per-KV-head selection and the window are gathered once per KV head, not per query head."""
    if w_idx is None:
        w_idx = jnp.zeros((q.shape[0], 0), jnp.int32)
        w_mask = jnp.zeros((q.shape[0], 0), bool)
    B, K = keys.shape[:2]
    w_rows = jnp.broadcast_to(w_idx[:, None, :], (B, K, w_idx.shape[1]))  # the same rows for every KV head
    k_win, v_win = gather_rows(keys, w_rows), gather_rows(values, w_rows)  # [B, K, W, H]
    return selection_and_window_attention(q, gather_rows(keys, idx), gather_rows(values, idx), mask,
                                          k_win, v_win, w_mask)


def recent_window(lengths: jax.Array, start: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
    """Positions [start, lengths) as `window` static slots: (idx [B, window], mask [B, window])."""
    offsets = jnp.arange(window, dtype=jnp.int32)
    idx = start[:, None] + offsets[None, :]
    return jnp.minimum(idx, jnp.maximum(lengths[:, None] - 1, 0)), idx < lengths[:, None]


def sink_slots(lengths: jax.Array, sinks: int) -> tuple[jax.Array, jax.Array]:
    """The first `sinks` positions: (idx [B, sinks], mask [B, sinks]) masked past each length."""
    idx = jnp.broadcast_to(jnp.arange(sinks, dtype=jnp.int32), (lengths.shape[0], sinks))
    return idx, idx < lengths[:, None]


def expand_heads(x: jax.Array, heads: int) -> jax.Array:
    """[B, M] -> [B, heads, M] (the same slots for every head)."""
    return jnp.broadcast_to(x[:, None, :], (x.shape[0], heads, x.shape[1]))
