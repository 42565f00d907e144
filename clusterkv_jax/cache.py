"""The KV cache: capacity-padded arrays with per-sequence lengths, plus the selection policy's state."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from clusterkv_jax.config import ModelConfig


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer, padded to a static capacity S.

    Rows at or past `lengths[b]` of sequence b are padding. Donate it to the step that consumes it.
    """

    k: jax.Array  # [L, B, K, S, H]
    v: jax.Array  # [L, B, K, S, H]
    lengths: jax.Array  # [B] int32: tokens stored (prompt + generated)
    prompt_lengths: jax.Array  # [B] int32: tokens that came from the prompt
    policy_state: Any  # the policy's pytree, every leaf with a leading [L] axis
    # Offload only (policy.offload): the KV of layers >= full_layers in host memory, and device buffers.
    host_k: jax.Array | None = None  # [L - full_layers, B, K, S, H] memory kind pinned_host
    host_v: jax.Array | None = None
    offload_state: Any = None  # clusterkv_jax.offload.OffloadState, leading [L] axis

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def offloaded(self) -> bool:
        return self.host_k is not None

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]


def offloaded_layers(config: ModelConfig, policy) -> int:
    """How many layers keep their KV in host memory under this policy (0 without offload)."""
    if not getattr(policy, "offload", False):
        return 0
    return max(0, config.num_layers - policy.full_layers)


def init_cache(config: ModelConfig, policy, batch_size: int, capacity: int, dtype=jnp.bfloat16) -> KVCache:
    """An empty cache for `batch_size` sequences of up to `capacity` tokens each.

    With `policy.offload`, only the layers below `full_layers` keep device KV; the rest go to host memory.
    """
    L, B, K, H = config.num_layers, batch_size, config.num_kv_heads, config.head_dim
    zeros_b = jnp.zeros((B,), jnp.int32)
    policy_state = policy.init_state(config, B, capacity)
    offloaded = offloaded_layers(config, policy)
    # At least one device layer so indexing stays static; unused when every layer is offloaded.
    device_layers = max(L - offloaded, 1)
    cache = KVCache(
        k=jnp.zeros((device_layers, B, K, capacity, H), dtype),
        v=jnp.zeros((device_layers, B, K, capacity, H), dtype),
        lengths=zeros_b,
        prompt_lengths=zeros_b,
        policy_state=policy_state,
    )
    if not offloaded:
        return cache
    from clusterkv_jax import offload

    host_shape = (offloaded, B, K, capacity, H)
    selection = offload.selection_shape(policy, config, policy_state, B)
    return cache.replace(
        host_k=offload.host_zeros(host_shape, dtype),
        host_v=offload.host_zeros(host_shape, dtype),
        offload_state=offload.init_offload_state(policy, config, B, capacity, dtype, selection),
    )


# Row access with the sequence and KV-head dims as gather / scatter batching dims: stores are [L, B, K, S, H]
# (rows addressed by (layer, position)) or [B, K, S, H] (by position), indices [B, K, n, 2] or [B, K, n, 1].
# Nothing is reshaped across B or K, so under a mesh (B on "data", K on "model") every shard reads and
# writes its own rows without a collective, and host-memory stores need no constants on the host side.
# Gathers clamp out-of-range positions and scatters skip them (XLA's native semantics).
_IN_BOUNDS = jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS


def _row_dims(ndim: int):
    if ndim == 5:
        return dict(collapsed=(0, 3), index_map=(0, 3), batching=(1, 2))
    return dict(collapsed=(2,), index_map=(2,), batching=(0, 1))


def row_index(positions: jax.Array, layer: jax.Array | int | None = None) -> jax.Array:
    """positions [B, K, n] (and a layer, for [L, B, K, S, H] stores) -> indices [B, K, n, 2 or 1]."""
    positions = positions.astype(jnp.int32)
    if layer is None:
        return positions[..., None]
    layer = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), positions.shape)
    return jnp.stack([layer, positions], axis=-1)


def gather_rows(store: jax.Array, index: jax.Array) -> jax.Array:
    """store [L, B, K, S, H] or [B, K, S, H], index [B, K, n, .] from `row_index` -> rows [B, K, n, H]."""
    d = _row_dims(store.ndim)
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(3,), collapsed_slice_dims=d["collapsed"],
                                          start_index_map=d["index_map"], operand_batching_dims=d["batching"],
                                          start_indices_batching_dims=(0, 1))
    return jax.lax.gather(store, index, dims, slice_sizes=(1,) * (store.ndim - 1) + (store.shape[-1],),
                          mode=_IN_BOUNDS)


def scatter_rows(store: jax.Array, index: jax.Array, rows: jax.Array) -> jax.Array:
    """Writes rows [B, K, n, H] at index [B, K, n, .] (from `row_index`) into store; returns the store."""
    d = _row_dims(store.ndim)
    dims = jax.lax.ScatterDimensionNumbers(update_window_dims=(3,), inserted_window_dims=d["collapsed"],
                                           scatter_dims_to_operand_dims=d["index_map"],
                                           operand_batching_dims=d["batching"], scatter_indices_batching_dims=(0, 1))
    return jax.lax.scatter(store, index, rows.astype(store.dtype), dims, mode=_IN_BOUNDS)


def kv_bytes(cache: KVCache) -> dict[str, int]:
    """Bytes of KV held on the device (full layers, plus ring and recall cache when offloaded) and on the host."""
    device = cache.k.nbytes + cache.v.nbytes
    host = 0
    if cache.offloaded:
        ost = cache.offload_state
        device += ost.ring_k.nbytes + ost.ring_v.nbytes + ost.cache_k.nbytes + ost.cache_v.nbytes
        host = cache.host_k.nbytes + cache.host_v.nbytes
    return {"device": device, "host": host}
