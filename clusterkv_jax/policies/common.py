"""Pieces shared by the selecting policies: gathering selected rows and attending over them.

Shapes: B batch, N query heads, K KV heads, G = N // K, S capacity, H head dim, M selected slots per head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from clusterkv_jax.attention import selected_attention, selection_and_window_attention


def gather_rows(store: jax.Array, idx: jax.Array) -> jax.Array:
    """Rows of store [B, K, S, H] at idx [B, N, M] (query head n reads KV head n // G) -> [B, N, M, H].

    idx may also be [B, K, M] (one selection shared by a KV head's query heads): it is then broadcast.
    """
    B, K, S, H = store.shape
    N, M = idx.shape[1], idx.shape[2]
    G = N // K
    # [B, K, G*M, 1]: each KV head's rows for all of its query heads at once.
    flat = idx.reshape(B, K, G * M, 1)
    rows = jnp.take_along_axis(store, flat, axis=2, mode="clip")  # [B, K, G*M, H]
    return rows.reshape(B, N, M, H)


def attend_to_indices(
    q: jax.Array,  # [B, N, H]
    keys: jax.Array,  # [B, K, S, H]
    values: jax.Array,  # [B, K, S, H]
    idx: jax.Array,  # [B, N, M] or [B, K, M] token positions
    mask: jax.Array,  # same shape as idx: which slots hold a real token
) -> jax.Array:
    """Attention of each query head over its selected tokens -> [B, N, H] (float32)."""
    B, N, _ = q.shape
    K = keys.shape[1]
    if idx.shape[1] != N:  # a per-KV-head selection: every query head of the group uses it
        G = N // K
        idx = jnp.repeat(idx, G, axis=1)
        mask = jnp.repeat(mask, G, axis=1)
    return selected_attention(q, gather_rows(keys, idx), gather_rows(values, idx), mask)


def attend_to_indices_and_window(
    q: jax.Array,  # [B, N, H]
    keys: jax.Array,  # [B, K, S, H]
    values: jax.Array,  # [B, K, S, H]
    idx: jax.Array,  # [B, N, M] or [B, K, M] selected token positions
    mask: jax.Array,  # same shape as idx
    w_idx: jax.Array,  # [B, W] window positions, attended by every head
    w_mask: jax.Array,  # [B, W]
) -> jax.Array:
    """Attention over each head's selection plus a window shared by all heads -> [B, N, H] (float32). Equals
    `attend_to_indices` on the concatenated slots, but gathers a per-KV-head selection and the window once per
    KV head instead of once per query head."""
    rows = w_idx[:, None, :, None]  # [B, 1, W, 1]: the same rows for every KV head
    k_win = jnp.take_along_axis(keys, rows, axis=2, mode="clip")  # [B, K, W, H]
    v_win = jnp.take_along_axis(values, rows, axis=2, mode="clip")
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
