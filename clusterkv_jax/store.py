"""KV stores: where one group of layers keeps its keys and values, behind one small protocol.

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
        view.keys(), view.values()              [B, K, R, H] every row, on the device
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
                                                range: nothing copied; on the CPU skipped under a cond when
                                                nothing is in range, HostKV everywhere)
        view.store                              the store after the reads (HostKV keeps a recall cache)
    store.memory_kinds()                        the store with every array replaced by its memory kind
    store.nbytes()                              {"device": bytes, "host": bytes} actually held

Shapes: n layers in the group, B batch, K KV heads, R rows, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp

from clusterkv_jax.attention import selection_and_window_attention
from clusterkv_jax.ops import gather_pair_rows, gather_rows, per_kv_head, row_index, scatter_rows
from pallas_kernels.selected_attention import selected_attention
from pallas_kernels.selected_attention_tpu import selected_attention_tpu


#: A tile of `DeviceLayer.attend_tiled`: the K and V rows gathered at once, kept well inside a CPU's last-level cache
#: (measured on a 32 MB L3: 4 and 8 MB tiles gain alike, 12-16 MB ones lose; RESULTS.md).
GATHER_TILE_BYTES = 8 << 20


@flax.struct.dataclass
class Selection:
    """The rows one decode step attends, per selection head: n chunks of `chunk` consecutive store rows.

    chunk = 1 is a plain list of rows; ClusterKV selects whole blocks of a cluster's members, Quest whole pages.
    A chunk's first row identifies it (the recall cache of host offload looks chunks up by it)."""

    starts: jax.Array  # [B, h, n] int32 first row of each chunk
    mask: jax.Array  # [B, h, n, chunk] bool rows holding a selected token
    chunk: int = flax.struct.field(pytree_node=False, default=1)
    #: Every start is a multiple of `chunk` (chunks are whole blocks of the store, as ClusterKV's are; Quest's
    #: pages of generated tokens start anywhere): a store whose rows are whole chunks reads them as blocks.
    aligned: bool = flax.struct.field(pytree_node=False, default=False)

    @classmethod
    def of_rows(cls, rows: jax.Array, mask: jax.Array) -> "Selection":
        """A selection of single rows [B, h, M] (as most policies make it)."""
        return cls(starts=rows.astype(jnp.int32), mask=mask[..., None], chunk=1)

    def rows(self) -> jax.Array:
        """[B, h, n * chunk] every selected row, chunk after chunk."""
        B, h, n = self.starts.shape
        return (self.starts[..., None] + jnp.arange(self.chunk, dtype=jnp.int32)).reshape(B, h, n * self.chunk)

    def flat_mask(self) -> jax.Array:
        """[B, h, n * chunk]"""
        B, h, n = self.starts.shape
        return self.mask.reshape(B, h, n * self.chunk)


def as_selection(selected) -> Selection:
    """A policy's `select` result as a Selection (a pair (rows, mask) [B, h, M] is a selection of single rows)."""
    return selected if isinstance(selected, Selection) else Selection.of_rows(*selected)


class KVStore:
    """What the placements share (see the module docstring for the protocol). Subclasses are flax.struct
    dataclasses whose `k` and `v` are [n, B, K, S, H]."""

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def nbytes(self) -> dict[str, int]:
        """Bytes of the store's arrays, split by where `memory_kinds()` says they live."""
        out = {"device": 0, "host": 0}
        for x, kind in zip(jax.tree_util.tree_leaves(self), jax.tree_util.tree_leaves(self.memory_kinds())):
            out["device" if kind == "device" else "host"] += x.nbytes
        return out


@dataclasses.dataclass(frozen=True)
class LayerView:
    """One layer of a store, as the attention code reads it (a view used while tracing, never stored)."""

    store: KVStore
    index: jax.Array  # [] int32 the layer inside the store's group
    positions: int  # S, the cache's capacity in positions (the store may have more rows than positions)

    def commit_window(self, rows, dest) -> "LayerView":
        """Copies window rows [B, W] to rows dest [B, K, W] (out of range: nothing copied): a scatter of W rows per
        KV head, all dropped on a step with nothing due (m - 1 steps in m).

        On the CPU the scatter runs under a `lax.cond` that skips it on those steps (`commit_window_if_due`):
        XLA:CPU updates the store in place under the cond, and the unconditional scatter, with its gather of the
        window's rows, cost ~0.5 ms of a 3 ms `gqa="shared"` layer step at Llama-3-8B geometry (8k). Elsewhere it
        always runs: a conditional that returns the store made XLA:GPU copy the layer group's whole store on every
        layer of every decode step (6 copies of a 2-layer 32k store per step; found compiling for an H100,
        `clusterkv_jax.aot`). `lax.platform_dependent` picks at lowering: the compiler never sees both."""
        store = jax.lax.platform_dependent(
            self.store,
            cpu=lambda store: self.with_store(store).commit_window_if_due(rows, dest).store,
            default=lambda store: self.with_store(store)._scatter_window(rows, dest).store)
        return self.with_store(store)

    def commit_window_if_due(self, rows, dest) -> "LayerView":
        """`commit_window`'s scatter under a `lax.cond` that skips it when no destination is in range."""
        R = self.store.k.shape[3]
        store = jax.lax.cond(jnp.any(dest < R), lambda store: self.with_store(store)._scatter_window(rows, dest).store,
                             lambda store: store, self.store)
        return self.with_store(store)

    def _scatter_window(self, rows, dest) -> "LayerView":
        k, v = self.window(rows)  # [B, K, W, H]
        return self.with_store(self.store.write_rows(row_index(dest, self.index), k, v))

    def with_store(self, store) -> "LayerView":
        return dataclasses.replace(self, store=store)


@flax.struct.dataclass
class DeviceKV(KVStore):
    """Keys and values of a group of layers in device memory."""

    k: jax.Array  # [n, B, K, S, H]
    v: jax.Array  # [n, B, K, S, H]

    @classmethod
    def create(cls, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype) -> "DeviceKV":
        shape = (layers, batch, kv_heads, capacity, head_dim)
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

    def memory_kinds(self) -> "DeviceKV":
        return jax.tree.map(lambda _: "device", self)


class DeviceLayer(LayerView):
    """One layer of a DeviceKV."""

    def keys(self) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(self.store.k, self.index, keepdims=False)

    def values(self) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(self.store.v, self.index, keepdims=False)

    @jax.named_scope("gather")
    def read(self, selection: Selection):
        B, h, n = selection.starts.shape
        K, H = self.store.k.shape[2], self.store.k.shape[4]
        index = row_index(per_kv_head(selection.starts, K), self.index)
        c = selection.chunk
        k, v = (gather_rows(x, index, chunk=c, aligned=selection.aligned).reshape(B, h, n * c, H)
                for x in (self.store.k, self.store.v))
        return k, v, selection.flat_mask(), self

    def window(self, rows):
        B, W = rows.shape
        index = row_index(jnp.broadcast_to(rows[:, None, :], (B, self.store.k.shape[2], W)), self.index)
        return gather_rows(self.store.k, index), gather_rows(self.store.v, index)

    def ring(self, window: int):
        return self.keys()[:, :, :window], self.values()[:, :, :window]

    def tiles_for(self, selection: Selection) -> int:
        """How many tiles of (sequence, KV head) pairs `attend_tiled` splits a selection's rows into: 1 while the
        gathered K and V fit in two tiles (`GATHER_TILE_BYTES`: there the loop costs more than it saves), else the
        fewest (a divisor of B·K) that keep a tile within one."""
        L, B, K, R, H = self.store.k.shape
        rows = selection.starts.shape[1] * selection.starts.shape[2] * selection.chunk  # per sequence
        total = 2 * B * rows * H * self.store.k.dtype.itemsize
        if total <= 2 * GATHER_TILE_BYTES:
            return 1
        return next(d for d in range(1, B * K + 1) if (B * K) % d == 0 and (total <= d * GATHER_TILE_BYTES
                                                                            or d == B * K))

    def attend_tiled(self, q, selection: Selection, window: int, window_mask):
        """`attention.selection_and_window_attention` over `read` and `ring`, a tile of (sequence, KV head) pairs at
        a time (`tiles_for`, a `lax.map`): q [B, N, H] -> [B, N, H] float32. XLA:CPU cannot read gathered rows
        inside the score product: `read` writes them out and the product reads them back. All heads' rows at once
        (Llama-3-8B geometry, per query head, 8k: 44 MB) make that round trip through memory; a tile's stay in
        the cache between the two (one layer's step 3.3 -> 2.5 ms; RESULTS.md)."""
        L, B, K, R, H = self.store.k.shape
        N, h, c = q.shape[1], selection.starts.shape[1], selection.chunk
        tiles = self.tiles_for(selection)
        p = B * K // tiles  # pairs a tile
        tiled = lambda x: x.reshape((tiles, p, -1) + x.shape[2:])  # noqa: E731  [tiles, p, h/K (or G), ...]
        qs, starts, mask = tiled(q), tiled(selection.starts), tiled(selection.flat_mask())
        w_masks = jnp.repeat(window_mask, K, axis=0).reshape(tiles, p, -1) if window else jnp.zeros((tiles, p, 0), bool)
        as_pairs = lambda x: x.reshape(L, B * K, R, H)  # noqa: E731  (a view)

        def one_tile(args):
            t, q_t, starts_t, mask_t, w_mask = args  # [p, G, H], [p, h/K, n], [p, h/K, n * c], [p, W]
            pairs = t * p + jnp.arange(p, dtype=jnp.int32)
            rows = lambda x: gather_pair_rows(  # noqa: E731
                as_pairs(x), self.index, pairs, starts_t.reshape(p, -1), c, selection.aligned).reshape(p, h // K, -1, H)
            ring = lambda x: jax.lax.dynamic_slice(  # noqa: E731
                as_pairs(x), (self.index, t * p, 0, 0), (1, p, window, H))[0][:, None]  # [p, 1, W, H]
            k_win, v_win = (ring(self.store.k), ring(self.store.v)) if window else (None, None)
            return selection_and_window_attention(q_t, rows(self.store.k), rows(self.store.v), mask_t, k_win, v_win,
                                                  w_mask if window else None)

        with jax.named_scope("attend_tiled"):
            out = jax.lax.map(one_tile, (jnp.arange(tiles, dtype=jnp.int32), qs, starts, mask, w_masks))
        return out.reshape(B, N, H)

    def attend_in_place(self, q, selection: Selection, window: int, window_mask, *, kernel: str):
        """One softmax over each head's selection and (window > 0) the ring of rows [0, window), read where they
        lie through a page table (`pallas_kernels.selected_attention`, no gathered copy; kernel "pallas", "tpu"
        for its Mosaic version, or "interpret"): q [B, N, H] ->
        [B, N, H] float32, as `attention.selection_and_window_attention` over `read` and `ring` gives it. Pages
        are chunks of `selection.chunk` rows; the store's rows and the window are whole pages (`can_attend_in_place`)."""
        L, B, K, R, H = self.store.k.shape
        c, h = selection.chunk, selection.starts.shape[1]
        per = R // c  # pages per (layer, sequence, KV head)
        kv_head = jnp.arange(h, dtype=jnp.int32) // (h // K)  # selection head -> its KV head
        first = ((self.index * B + jnp.arange(B, dtype=jnp.int32)[:, None]) * K + kv_head[None, :]) * per  # [B, h]
        pages = first[..., None] + selection.starts // c  # [B, h, n]
        mask = selection.mask  # [B, h, n, c]
        if window:
            pages = jnp.concatenate([pages, first[..., None] + jnp.arange(window // c, dtype=jnp.int32)], axis=-1)
            ring = jnp.broadcast_to(window_mask.reshape(B, 1, window // c, c), (B, h, window // c, c))
            mask = jnp.concatenate([mask, ring], axis=2)
        pages_of = lambda x: x.reshape(L * B * K * per, c, H)  # noqa: E731  (a view: no copy)
        attend = (selected_attention_tpu if kernel == "tpu"
                  else functools.partial(selected_attention, interpret=kernel == "interpret"))
        out = attend(q.reshape(B, h, q.shape[1] // h, H), pages_of(self.store.k), pages_of(self.store.v), pages, mask)
        return out.reshape(q.shape)

    def can_attend_in_place(self, selection: Selection, window: int) -> bool:
        """Whether `attend_in_place` applies: pages of a power-of-two number of rows (> 1) that tile the store and
        the window, and a power-of-two head dim."""
        c, R, H = selection.chunk, self.store.k.shape[3], self.store.k.shape[4]
        pow2 = lambda x: x & (x - 1) == 0  # noqa: E731
        return c > 1 and pow2(c) and pow2(H) and R % c == 0 and window % c == 0
