"""ClusterKV's row layout: each cluster's members in consecutive rows of a layer's store, in whole blocks of
`block_size` rows (a cluster's last block partly filled), so a selection reads a few dozen contiguous blocks:

    rows [0, W)                     the window: generated tokens not clustered yet, row = position % W
    blocks from ceil(W / bs)        the sinks, then each cluster's members in position order, cluster after
                                    cluster (prompt clusters, then each decode-time group)

A selection is at most `block_slots()` blocks: the budget's blocks plus one per cluster of average size it could
take plus 4 (measured against what the rule selects in docs/research_log.md); if the clusters ever needed more, the
last ones would be dropped and the budget left unfilled. The store holds ~1.2x the rows of a position-ordered one
(each cluster's last block is partly empty).

The layout's part of ClusterKV's index (`clusterkv_jax.policies.clusterkv.ClusterIndex`): `block_start` (each
cluster's first block), `row_positions` (the position each row holds, -1: empty; it maps rows back to positions
for the recall evaluation and the tests), `next_block` (the first block not used yet), `recent_rows` (where the
last clustered window's tokens went) and `clustered_upto` (the window's first position).

Shapes: B batch, K KV heads, n tokens placed, C clusters, R store rows, W window rows, bs = block_size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from clusterkv_jax.policies.layout import RowLayout
from clusterkv_jax.selection import Selection


def exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x, axis=-1, dtype=x.dtype) - x  # dtype kept (int32 sums widen under x64)


_SORT_KEY_LIMIT = 2**31  # label·n + offset must fit an int32 for the one-key sort of `_layout_rows`


def _layout_rows(labels, sizes, block_start, block_size: int, num_clusters: int):
    """Store rows of clustered tokens: labels [B, K, n] (>= num_clusters: not clustered), sizes and block_start
    [B, K, num_clusters] -> (order [B, K, n] token offsets grouped by cluster, in position order within a
    cluster; rows [B, K, n] the row of token order[..., i], -1 where it is not clustered)."""
    n = labels.shape[-1]
    labels = jnp.minimum(labels, num_clusters)
    if (num_clusters + 1) * n < _SORT_KEY_LIMIT:
        # One sort of label·n + offset (distinct int32 keys): on XLA:CPU several times faster than the stable
        # argsort's sort of (label, offset) pairs (docs/research_log.md).
        key = jnp.sort(labels * n + jnp.arange(n, dtype=labels.dtype), axis=-1)
        order, sorted_labels = key % n, key // n
    else:
        order = jnp.argsort(labels, axis=-1, stable=True)
        sorted_labels = jnp.take_along_axis(labels, order, axis=-1)
    label = jnp.minimum(sorted_labels, num_clusters - 1)
    rank = jnp.arange(labels.shape[-1]) - jnp.take_along_axis(exclusive_cumsum(sizes), label, axis=-1)
    rows = jnp.take_along_axis(block_start, label, axis=-1) * block_size + rank
    return order, jnp.where(sorted_labels < num_clusters, rows, -1)


def ring_window_mask(lengths: jax.Array, start: jax.Array, window: int, capacity: int) -> jax.Array:
    """[B, window]: which slots of a ring (slot = position % window) hold a position of [start, lengths) inside
    the capacity. Slot r holds start + ((r - start) mod window): the window never holds more than `window`."""
    slots = jnp.arange(window, dtype=jnp.int32)
    positions = start[:, None] + jnp.remainder(slots[None, :] - start[:, None], window)
    return (positions < lengths[:, None]) & (positions < capacity)


def scatter_last(x, index, values):
    """x [B, K, m].at[index [B, K, n]].set(values), negative or out-of-range indices dropped."""
    index = jnp.where(index < 0, x.shape[-1], index)
    return jax.vmap(jax.vmap(lambda a, i, v: a.at[i].set(v, mode="drop")))(x, index, values)


@dataclasses.dataclass(frozen=True)
class ClusterBlocks(RowLayout):
    """The layout of `ClusterKV`'s layers (see the module docstring), sized by the policy's settings."""

    block_size: int
    sinks: int
    window: int  # the ring's rows: generated tokens attended in full until clustered (decode_interval)
    tokens_per_cluster: int
    decode_clusters: int
    budget: int
    ring_window = True

    # ---- Static sizes, from the capacity S -----------------------------------------------------------------

    def cluster_slots(self, capacity: int) -> int:
        """Prompt clusters plus decode-time groups never exceed 1 + S x max(1 / tokens_per_cluster,
        decode_clusters / window): the prompt and the generated tokens share the capacity."""
        per_token = max(capacity // self.tokens_per_cluster, capacity * self.decode_clusters // self.window)
        return 1 + per_token + self.decode_clusters

    def block_slots(self, tokens: int | None = None) -> int:
        """The blocks a selection of `tokens` (default: the budget past the sinks) may read."""
        tokens = self.budget - self.sinks if tokens is None else tokens
        return -(-tokens // self.block_size) + -(-tokens // self.tokens_per_cluster) + 4

    def first_block(self) -> int:
        """The sinks' first block, after the window's rows."""
        return -(-self.window // self.block_size)

    def sink_blocks(self) -> int:
        return -(-self.sinks // self.block_size)

    def store_rows(self, capacity: int) -> int:
        bs = self.block_size
        blocks = self.first_block() + self.sink_blocks() + -(-max(capacity - self.sinks, 0) // bs)
        return bs * (blocks + self.cluster_slots(capacity))  # each cluster's last block may be partly empty

    def covered_rows(self, capacity: int) -> int:
        # Clusters take consecutive blocks after the window's rows and the sinks' blocks; when every cluster fits
        # the block slots, so do the blocks they fill.
        return min(self.store_rows(capacity), (self.first_block() + self.sink_blocks() + self.block_slots())
                   * self.block_size)

    # ---- Placing clustered tokens ------------------------------------------------------------------------------

    def place(self, labels, sizes, first_block):
        """Consecutive blocks from `first_block` ([B, K] or a number) for clusters of `sizes` [B, K, C], each
        token of labels [B, K, n] (>= C: not clustered) in its cluster's rows -> (block_start [B, K, C], order
        [B, K, n] token offsets grouped by cluster, rows [B, K, n] the row of token order[..., i] (-1: not
        clustered), used [B, K] the blocks they take)."""
        blocks = -(-sizes // self.block_size)
        block_start = jnp.asarray(first_block, jnp.int32)[..., None] + exclusive_cumsum(blocks)
        order, rows = _layout_rows(labels, sizes, block_start, self.block_size, sizes.shape[-1])
        return block_start, order, rows, jnp.sum(blocks, axis=-1, dtype=jnp.int32)

    def prompt_positions(self, row_positions, order, rows, lengths):
        """row_positions [B, K, R] with the prompt's clustered tokens (`place`'s order and rows) and its sinks,
        positions [0, min(sinks, length)) in the sink blocks' rows (lengths [B])."""
        B, K = order.shape[:2]
        row_positions = scatter_last(row_positions, rows, order.astype(jnp.int32))
        sink_pos = jnp.arange(self.sinks, dtype=jnp.int32)
        sink_rows = jnp.where(sink_pos[None, :] < lengths[:, None], self.first_block() * self.block_size + sink_pos,
                              -1)
        return scatter_last(row_positions, jnp.broadcast_to(sink_rows[:, None], (B, K, self.sinks)),
                            jnp.broadcast_to(sink_pos, (B, K, self.sinks)))

    def add_window(self, state, order, rows, used, due) -> dict:
        """The layout's fields of `state` once the window [clustered_upto, + W) is placed where due [B] (`place`'s
        order, rows and blocks used for it): its rows' positions, the next free block, and where its rows moved."""
        B, K, W = order.shape
        R, is_due = state.row_positions.shape[-1], due[:, None, None]
        return dict(
            row_positions=scatter_last(state.row_positions, jnp.where(is_due, rows, -1),
                                       (state.clustered_upto[:, None, None] + order).astype(jnp.int32)),
            next_block=jnp.where(due[:, None], state.next_block + used, state.next_block),
            recent_rows=jnp.where(is_due, scatter_last(jnp.full((B, K, W), R, jnp.int32), order, rows), R),
        )

    # ---- The layout's answers to attend.py ----------------------------------------------------------------

    def prompt_rows(self, state):
        return state.row_positions

    def token_rows(self, state, positions, capacity):
        R = state.row_positions.shape[-1]
        return jnp.where(positions < capacity, positions % self.window, R)  # the ring; past the capacity: dropped

    def recent_moves(self, old_state, new_state):
        """The window's rows of the sequences just clustered go to their new blocks (a sequence not due moves
        nothing: its destinations are out of range)."""
        due = new_state.clustered_upto != old_state.clustered_upto  # [B]
        W, R = self.window, old_state.row_positions.shape[-1]
        rows = (old_state.clustered_upto[:, None] + jnp.arange(W)) % W  # [B, W] the window's rows
        return rows, jnp.where(due[:, None, None], new_state.recent_rows, R)

    def ring_mask(self, state, lengths, capacity):
        """The window [clustered_upto, lengths) in the ring of rows [0, W)."""
        return ring_window_mask(lengths, state.clustered_upto, self.window, capacity)

    def held_rows(self, state, lengths, capacity: int):
        """Sinks and clustered tokens where `row_positions` says, the window's tokens in the ring of rows [0, W)."""
        R = state.row_positions.shape[-1]
        in_ring = jnp.pad(self.ring_mask(state, lengths, capacity), ((0, 0), (0, R - self.window)))[:, None, :]
        return (state.row_positions >= 0) | in_ring

    def positions(self, state, selection: Selection):
        B, h, n = selection.starts.shape
        K = state.row_positions.shape[1]
        rows = selection.rows().reshape(B, K, -1)  # a KV head's rows for all its selection heads
        R = state.row_positions.shape[-1]
        positions = jnp.take_along_axis(state.row_positions, jnp.clip(rows, 0, R - 1), axis=-1)
        return positions.reshape(B, h, n * selection.chunk)
