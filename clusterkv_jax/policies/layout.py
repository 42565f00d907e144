"""Where a selecting layer's store keeps each token: the row layout a policy names (`KVPolicy.layout`).

A policy chooses tokens; its layout says which store rows hold them. `clusterkv_jax.attend` and the cache ask the
layout, never the policy, where the prompt's rows go, where a new token's row is, which rows move once a window is
indexed and what attending to everything reads. `RowLayout` is that protocol, and its defaults are the plain
layout: row r holds position r. ClusterKV's layout keeps each cluster's members in consecutive rows
(`clusterkv_jax.policies.cluster_blocks`).

A layout's methods read the policy's state (a layout keeps no arrays of its own): `state` is one layer's state, as
the policy's hooks see it.

Shapes: B batch, K KV heads, R store rows, W window slots, h selection heads, n chunks of a selection.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from clusterkv_jax.selection import Selection


class RowLayout:
    """The protocol of a row layout, with the plain layout's answers: row r holds position r."""

    #: Whether the window of tokens the policy has not indexed yet is the ring of rows [0, W) (row = position % W),
    #: which a decode step reads where it lies; otherwise it is read row by row (`token_rows`).
    ring_window: ClassVar[bool] = False

    def store_rows(self, capacity: int) -> int:
        """Rows of a selecting layer's store for a capacity of `capacity` positions."""
        return capacity

    def prompt_rows(self, state: Any) -> jax.Array | None:
        """After the policy indexed the prompt: the position each store row holds, [B, K, R] (-1: empty), or None
        for row = position."""
        return None

    def token_rows(self, state: Any, positions: jax.Array, capacity: int) -> jax.Array:
        """The store rows of tokens at positions [B, ...] (same shape; a position past `capacity` maps out of
        range, so its write is dropped)."""
        return positions

    def recent_moves(self, old_state: Any, new_state: Any) -> tuple[jax.Array, jax.Array] | None:
        """After indexing a window changed the state: the window rows [B, W] whose tokens move, and the rows they go
        to, [B, K, W] (out of range: no move), or None when the layout never moves rows."""
        return None

    def ring_mask(self, state: Any, lengths: jax.Array, capacity: int) -> jax.Array:
        """[B, W]: which rows of the ring [0, W) hold a token of the window (a layout whose `ring_window` is True;
        slot r holds the window's position congruent to r mod W, if any, inside the capacity)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no ring window")

    def held_rows(self, state: Any, lengths: jax.Array, capacity: int) -> jax.Array:
        """[B, 1 or K, R] the store rows holding a token, window included (what attending to everything reads)."""
        R = self.store_rows(capacity)
        return (jnp.arange(R, dtype=jnp.int32)[None, :] < lengths[:, None])[:, None]

    def covered_rows(self, capacity: int) -> int:
        """n: whenever the selection holds every token (`KVPolicy.covers`, `covers_now`), rows [0, n) hold them
        all, so attending to everything reads those rows only (default: every row)."""
        return self.store_rows(capacity)

    def positions(self, state: Any, selection: Selection) -> jax.Array:
        """The positions [B, h, n * chunk] of a selection's rows (the recall evaluation compares positions)."""
        return selection.rows()


@dataclasses.dataclass(frozen=True)
class Positions(RowLayout):
    """Row r holds position r, in a store of whole `unit`s of rows (Quest's pages: a page never reads past the
    store's end)."""

    unit: int = 1

    def store_rows(self, capacity: int) -> int:
        return -(-capacity // self.unit) * self.unit
