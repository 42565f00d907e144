"""KV stores: where one group of layers keeps its keys and values, behind one small protocol. A store holds and
reads rows; what to read is a policy's `Selection`, and attending is `clusterkv_jax.attend`'s.

A store holds the K/V of a contiguous group of layers stacked on a leading axis: [n, B, K, R, H], R rows per
(layer, sequence, KV head). For most policies row r holds position r (R = the capacity S); a policy may lay its
layers out otherwise (ClusterKV keeps each cluster's members in consecutive rows), see `policies.base`. Two
placements implement the protocol:

- `DeviceKV` (here): device memory.
- `HostKV` (`clusterkv_jax.offload`): host memory (`pinned_host`), plus device buffers for the unindexed recent
  window and for the rows selected in the last few steps.

The protocol (`layer` is the layer's index inside the group, a traced int):

    store.write_prompt(layer, k, v, start=0)    k, v [B, K, T, H] become rows [start, start + T) (start traced)
    store.write_layer(layer, k, v)              k, v [B, K, R, H] become every row of the layer
    store.write_token(layer, rows, k, v)        k, v [B, K, H] become row rows[b] of sequence b (out of range:
                                                dropped)
    store.write_rows(index, k, v)               k, v [B, K, m, H] become the rows at index [B, K, m, 2]
                                                (`ops.row_index`: layer, row; out of range: dropped)
    view = store.layer(layer)                   one layer, as attention reads it:
        view.keys(), view.values()              [B, K, R, H] every row as stored, on the device
        view.key_blocks(starts, chunk)          keys [B, K, n, chunk, H] of whole blocks from starts [B, K, n]
        view.read_all(n) -> (k, v)              rows [0, n) [B, K, n, H], each with the token it holds now (a host
                                                store's ring rows from the device ring)
        view.read(selection) -> (k, v, mask, view)
                                                rows [B, h, M, H] holding a `Selection`'s rows (h = N query heads,
                                                query head n reading KV head n // G; or h = K), mask [B, h, M] the
                                                rows that hold a selected token: the selection's own rows in its
                                                order (M = n * chunk), or, from a host store's recall cache, its
                                                slots in their order (attention does not care about the order)
        view.window(rows) -> (k, v)             rows [B, K, W, H] at rows [B, W] of the unindexed window (the
                                                same rows for every KV head)
        view.ring(W) -> (k, v)                  rows [0, W) [B, K, W, H]: a window kept as a ring (row = position
                                                % W) read as one slice
        view.commit_window(rows, dest) -> view  copies window rows [B, W] to rows dest [B, K, W] (dest out of
                                                range: nothing copied)
        view.store                              the store after the reads (HostKV keeps a recall cache)
        view.read_only, view.reads_in_place     what attention may do with the view: read it inside a branch that
                                                returns no view; read its rows in place, addressing the whole
                                                store (a device layer's `pages`, `read_pairs`, `ring_pairs`)
    store.nbytes()                              {"device": bytes, "host": bytes} actually held

A device layer also reads what the other ways of attending need: a tile of (sequence, KV head) pairs
(`read_pairs`, `ring_pairs`) and the whole store as pages for a page table (`pages`).

Every array declares its logical axes (`clusterkv_jax.axes`). Shapes: n layers in the group, B batch, K KV heads,
R rows, H head dim.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp

from clusterkv_jax import axes, kernels
from clusterkv_jax.ops import READ_MODE, gather_rows, per_kv_head, row_index, scatter_rows
from clusterkv_jax.selection import Selection

#: The dims of a store's keys and values.
KV_AXES = ("layers", "batch", "kv_heads", "rows", "head_dim")


def _gather_pair_rows(store: jax.Array, layer, pairs: jax.Array, starts: jax.Array, chunk: int,
                      aligned: bool) -> jax.Array:
    """Chunks of some (sequence, KV head) pairs: store [L, P, S, H] (a store's [L, B, K, S, H] with its B·K pairs
    as one dim: a view), pairs [p] which pairs, starts [p, n] their chunks' first rows, layer traced ->
    [p, n, chunk, H]; `chunk` and `aligned` as in `ops.gather_rows`."""
    L, P, S, H = store.shape
    p, n = starts.shape
    if aligned and chunk > 1 and S % chunk == 0:
        store, starts, rows = store.reshape(L, P, S // chunk, chunk * H), starts // chunk, 1
    else:
        rows = chunk
    index = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (p, n)),
                       jnp.broadcast_to(pairs.astype(jnp.int32)[:, None], (p, n)), starts.astype(jnp.int32)], axis=-1)
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(2, 3), collapsed_slice_dims=(0, 1), start_index_map=(0, 1, 2))
    out = jax.lax.gather(store, index, dims, slice_sizes=(1, 1, rows, store.shape[-1]), mode=READ_MODE)
    return out.reshape(p, n, chunk, H)


class KVStore:
    """What the placements share (see the module docstring for the protocol). Subclasses are flax.struct
    dataclasses whose `k` and `v` are [n, B, K, R, H]."""

    #: Whether the K/V live in host memory (then only `read`, `window`, `ring` and the writes reach them).
    on_host = False

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    def nbytes(self) -> dict[str, int]:
        """Bytes of the store's arrays, split by the memory their fields declare (also of an abstract store, from
        `jax.eval_shape`)."""
        out = {"device": 0, "host": 0}
        for x, a in zip(jax.tree_util.tree_leaves(self), jax.tree_util.tree_leaves(axes.of(self))):
            out["host" if a.host else "device"] += math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
        return out


@dataclasses.dataclass(frozen=True)
class LayerView:
    """One layer of a store, as attention reads it (a view used while tracing, never stored)."""

    store: KVStore
    index: jax.Array  # [] int32 the layer inside the store's group
    positions: int  # S, the cache's capacity in positions (the store may have more rows than positions)

    #: Whether reads leave the store as it was, so a branch of a step may read it and return the output alone (a
    #: host store's reads fill and count its recall cache).
    read_only = True
    #: Whether attention may read this layer's rows where they lie, addressing the whole store: as pages for a page
    #: table (`pages`) or a tile of (sequence, KV head) pairs at a time (`read_pairs`, `ring_pairs`). A host
    #: store's rows are reached through its recall cache (`read`) alone.
    reads_in_place = False

    def key_blocks(self, starts: jax.Array, chunk: int) -> jax.Array:
        """Keys of blocks of `chunk` rows from starts [B, K, n] (each a multiple of `chunk`; a KV head's own
        blocks) -> [B, K, n, chunk, H], on the device: what a policy that `reads_key_blocks` scores."""
        raise NotImplementedError

    def read_all(self, rows: int):
        """(k, v) [B, K, rows, H] of rows [0, rows), each with the token it holds now."""
        return self.keys()[:, :, :rows], self.values()[:, :, :rows]

    def commit_window(self, rows, dest) -> "LayerView":
        """Copies window rows [B, W] to rows dest [B, K, W] (out of range: nothing copied): a scatter of W rows per
        KV head, all dropped on a step with nothing due (m - 1 steps in m).

        On the CPU the scatter is skipped on those steps; elsewhere it always runs (`kernels.written_when`)."""
        R = self.store.k.shape[3]
        store = kernels.written_when(lambda: jnp.any(dest < R),
                                     lambda store: self.with_store(store)._scatter_window(rows, dest).store, self.store)
        return self.with_store(store)

    def _scatter_window(self, rows, dest) -> "LayerView":
        k, v = self.window(rows)  # [B, K, W, H]
        return self.with_store(self.store.write_rows(row_index(dest, self.index), k, v))

    def with_store(self, store) -> "LayerView":
        return dataclasses.replace(self, store=store)


@flax.struct.dataclass
class DeviceKV(KVStore):
    """Keys and values of a group of layers in device memory."""

    k: jax.Array = axes.field(*KV_AXES)  # [n, B, K, R, H]
    v: jax.Array = axes.field(*KV_AXES)

    @classmethod
    def create(cls, layers: int, batch: int, kv_heads: int, rows: int, head_dim: int, dtype) -> "DeviceKV":
        shape = (layers, batch, kv_heads, rows, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    def write_prompt(self, layer, k, v, start=0) -> "DeviceKV":
        at = tuple(jnp.asarray(i, jnp.int32) for i in (layer, 0, 0, start, 0))  # one index dtype, also under x64
        return self.replace(k=jax.lax.dynamic_update_slice(self.k, k[None].astype(self.k.dtype), at),
                            v=jax.lax.dynamic_update_slice(self.v, v[None].astype(self.v.dtype), at))

    def write_layer(self, layer, k, v) -> "DeviceKV":
        return self.write_prompt(layer, k, v)  # the same write, of all R rows

    def write_rows(self, index, k, v) -> "DeviceKV":
        """Rows at index [B, K, m, 2] (from `row_index`) <- k, v [B, K, m, H] (out of range: dropped). B and K are
        scatter batching dims: a sharded store is written shard by shard."""
        return self.replace(k=scatter_rows(self.k, index, k), v=scatter_rows(self.v, index, v))

    def write_token(self, layer, rows, k, v) -> "DeviceKV":
        index = row_index(jnp.broadcast_to(rows[:, None, None], k.shape[:2] + (1,)), layer)
        return self.write_rows(index, k[:, :, None], v[:, :, None])

    def layer(self, layer, positions: int | None = None) -> "DeviceLayer":
        return DeviceLayer(self, layer, self.capacity if positions is None else positions)


class DeviceLayer(LayerView):
    """One layer of a DeviceKV."""

    reads_in_place = True

    def keys(self) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(self.store.k, self.index, keepdims=False)

    def values(self) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(self.store.v, self.index, keepdims=False)

    def key_blocks(self, starts, chunk):
        # Slices of `chunk` rows, not the store viewed as blocks (`aligned`): on a TPU that view of the stacked
        # store is a relayout, a copy of every layer's keys (338 MB at 32k, 4 layers of Llama-3-8B geometry).
        return gather_rows(self.store.k, row_index(starts, self.index), chunk=chunk)

    @jax.named_scope("gather")
    def read(self, selection: Selection):
        B, h, n = selection.starts.shape
        K, H = self.store.k.shape[2], self.store.k.shape[4]
        index = row_index(per_kv_head(selection.starts, K), self.index)
        c = selection.chunk
        by_row = not selection.aligned and kernels.chunks_read_row_by_row()
        k, v = (gather_rows(x, index, chunk=c, aligned=selection.aligned, by_row=by_row).reshape(B, h, n * c, H)
                for x in (self.store.k, self.store.v))
        return k, v, selection.flat_mask(), self

    def window(self, rows):
        B, W = rows.shape
        index = row_index(jnp.broadcast_to(rows[:, None, :], (B, self.store.k.shape[2], W)), self.index)
        return gather_rows(self.store.k, index), gather_rows(self.store.v, index)

    def ring(self, window: int):
        return self.keys()[:, :, :window], self.values()[:, :, :window]

    def read_pairs(self, pairs: jax.Array, starts: jax.Array, chunk: int, aligned: bool):
        """Chunks of some (sequence, KV head) pairs, pair p = b * K + k: pairs [p], starts [p, n] their chunks' first
        rows -> k, v [p, n, chunk, H]."""
        L, B, K, R, H = self.store.k.shape
        as_pairs = lambda x: x.reshape(L, B * K, R, H)  # noqa: E731  (a view)
        return tuple(_gather_pair_rows(as_pairs(x), self.index, pairs, starts, chunk, aligned)
                     for x in (self.store.k, self.store.v))

    def ring_pairs(self, first: jax.Array, count: int, window: int):
        """Rows [0, window) of pairs [first, first + count) -> k, v [count, window, H]."""
        L, B, K, R, H = self.store.k.shape
        return tuple(jax.lax.dynamic_slice(x.reshape(L, B * K, R, H), (self.index, first, 0, 0),
                                           (1, count, window, H))[0] for x in (self.store.k, self.store.v))

    def pages(self, chunk: int):
        """The whole store as pages of `chunk` rows, k and v [n·B·K·R/chunk, chunk, H] (views: no copy), and the
        page holding row 0 of each (sequence, KV head) of this layer, [B, K]. Needs chunk to divide R."""
        L, B, K, R, H = self.store.k.shape
        per = R // chunk
        first = ((self.index * B + jnp.arange(B, dtype=jnp.int32)[:, None]) * K
                 + jnp.arange(K, dtype=jnp.int32)[None, :]) * per
        return self.store.k.reshape(L * B * K * per, chunk, H), self.store.v.reshape(L * B * K * per, chunk, H), first
