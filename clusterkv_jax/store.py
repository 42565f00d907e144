"""KV stores: where one group of layers keeps its keys and values, behind one small protocol.

A store holds the K/V of a contiguous group of layers stacked on a leading axis, padded to a static capacity:
[n, B, K, S, H]. Two placements implement the protocol:

- `DeviceKV` (here): device memory.
- `HostKV` (`clusterkv_jax.offload`): host memory (`pinned_host`), plus device buffers for the unindexed recent
  window and for the rows selected in the last few steps.

The protocol (`layer` is the layer's index inside the group, a traced int):

    store.write_prompt(layer, k, v)             k, v [B, K, T, H] become rows [0, T)
    store.write_token(layer, positions, k, v)   k, v [B, K, H] become row positions[b] of sequence b
    view = store.layer(layer)                   one layer, as attention reads it:
        view.keys(), view.values()              [B, K, S, H] every row, on the device
        view.read(idx, mask) -> (k, v, view)    rows [B, h, M, H] of a selection idx [B, h, M] (h = N query
                                                heads, query head n reading KV head n // G; or h = K)
        view.window(idx) -> (k, v)              rows [B, K, W, H] at positions idx [B, W] of the unindexed window
        view.store                              the store after the reads (HostKV keeps a recall cache)
    store.memory_kinds()                        the store with every array replaced by its memory kind
    store.nbytes()                              {"device": bytes, "host": bytes} actually held

Shapes: n layers in the group, B batch, K KV heads, S capacity, H head dim.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from clusterkv_jax.ops import gather_rows, per_kv_head, row_index, scatter_rows


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

    @property
    def capacity(self) -> int:
        return self.store.capacity


@flax.struct.dataclass
class DeviceKV(KVStore):
    """Keys and values of a group of layers in device memory."""

    k: jax.Array  # [n, B, K, S, H]
    v: jax.Array  # [n, B, K, S, H]

    @classmethod
    def create(cls, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype) -> "DeviceKV":
        shape = (layers, batch, kv_heads, capacity, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    def write_prompt(self, layer, k, v) -> "DeviceKV":
        start = (layer, 0, 0, 0, 0)
        return self.replace(k=jax.lax.dynamic_update_slice(self.k, k[None].astype(self.k.dtype), start),
                            v=jax.lax.dynamic_update_slice(self.v, v[None].astype(self.v.dtype), start))

    def write_token(self, layer, positions, k, v) -> "DeviceKV":
        # [B, K, 1] rows, B and K as scatter batching dims: a sharded store is written shard by shard.
        rows = row_index(jnp.broadcast_to(positions[:, None, None], k.shape[:2] + (1,)), layer)
        return self.replace(k=scatter_rows(self.k, rows, k[:, :, None]), v=scatter_rows(self.v, rows, v[:, :, None]))

    def layer(self, layer) -> "DeviceLayer":
        return DeviceLayer(self, layer)

    def memory_kinds(self) -> "DeviceKV":
        return jax.tree.map(lambda _: "device", self)


class DeviceLayer(LayerView):
    """One layer of a DeviceKV."""

    def keys(self) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(self.store.k, self.index, keepdims=False)

    def values(self) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(self.store.v, self.index, keepdims=False)

    @jax.named_scope("gather")
    def read(self, idx, mask):
        B, h, M = idx.shape
        K, H = self.store.k.shape[2], self.store.k.shape[4]
        rows = row_index(per_kv_head(idx, K), self.index)
        k, v = gather_rows(self.store.k, rows), gather_rows(self.store.v, rows)
        return k.reshape(B, h, M, H), v.reshape(B, h, M, H), self

    def window(self, idx):
        B, W = idx.shape
        rows = row_index(jnp.broadcast_to(idx[:, None, :], (B, self.store.k.shape[2], W)), self.index)
        return gather_rows(self.store.k, rows), gather_rows(self.store.v, rows)
