"""Host-offloaded KV for the compressed layers, and a device cache of recently recalled rows.

With `policy.offload`, the full K/V of every layer >= full_layers lives in host memory (memory kind
`pinned_host`); the device keeps the cluster index, a ring of the last W generated tokens (the unindexed
window) and the rows selected in the last R = `cache_steps` steps. Each decode step:

  1. writes the new token's K/V into the host store and the ring (explicit host computation),
  2. lets the policy index the window (decode-time clustering reads its keys from the ring),
  3. selects on the device, looks the selection up in the R-step cache, and fetches only the misses from
     the host: the miss positions move to the host, the host gathers them, the rows move back. The
     transfer is bucketed (M/8, M/4, M/2, M rows) so it stays a static shape yet shrinks with the misses,
  4. attends over [selected rows; window rows] in the same order as the on-device path, so results match.

Device bytes for the compressed layers' KV are fixed by (budget, R, W), not by the context length.
Shapes: B batch, K KV heads, h selection heads (N or K), M budgeted slots, W window, H head dim.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from clusterkv_jax.attention import selection_and_window_attention
from clusterkv_jax.cache import gather_rows, row_index, scatter_rows
from clusterkv_jax.policies.common import recent_window


@functools.lru_cache(maxsize=None)
def host_memory_kind() -> str | None:
    """The host memory kind of the default device: pinned_host, else unpinned_host, else None (then the
    'host' store stays in device memory, which is correct but saves nothing; we say so once)."""
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            if kind != "pinned_host":
                warnings.warn(f"{jax.devices()[0].platform} has no pinned_host memory; offloading to {kind}")
            return kind
    warnings.warn(f"{jax.devices()[0].platform} has no host memory kind; offloaded KV stays in device memory")
    return None


def _sharding(kind: str | None):
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind or "device")


def _memory(kind: str | None):
    """Where `device_put` sends an array to reach memory `kind`. pinned_host and device are memory spaces
    (`jax.memory.Space`): the transfer keeps the array's sharding, so it works on one device and on a mesh
    alike, in and out of jit. unpinned_host has no space; it goes to the first device (single device only)."""
    if kind == "pinned_host":
        return jax.memory.Space.Host
    if kind in (None, "device"):
        return jax.memory.Space.Device
    return _sharding(kind)


def to_host(x):
    kind = host_memory_kind()
    return x if kind is None else jax.device_put(x, _memory(kind))


def to_device(x):
    return x if host_memory_kind() is None else jax.device_put(x, _memory("device"))


def _on_host(fn, *args):
    """Runs fn on the host when a host memory kind exists (its operands already moved there)."""
    if host_memory_kind() is None:
        return fn(*args)
    with compute_on("device_host"):
        return fn(*args)


def host_zeros(shape, dtype):
    """A zero array created directly in host memory (no device-sized temporary); works in and out of jit."""
    kind = host_memory_kind()
    if kind is None:
        return jnp.zeros(shape, dtype)
    if isinstance(jnp.zeros(()), jax.core.Tracer):  # inside jit: a staged transfer keeps the host type
        return jax.device_put(jnp.zeros(shape, dtype), _memory(kind))
    return jax.device_put(np.zeros(shape, dtype), _sharding(kind))  # eager: straight from host memory


@flax.struct.dataclass
class OffloadState:
    """One layer's device-side buffers (the cache stacks a leading [L] axis)."""

    ring_k: jax.Array  # [B, K, W, H] last W generated tokens, slot = position % W
    ring_v: jax.Array  # [B, K, W, H]
    cache_ids: jax.Array  # [B, h, R, M] int32 positions selected in the last R steps (-1: empty)
    cache_k: jax.Array  # [B, h, R, M, H]
    cache_v: jax.Array  # [B, h, R, M, H]
    step: jax.Array  # [] int32 decode steps seen
    hits: jax.Array  # [] float32 selected rows served from the cache, summed over steps
    selected: jax.Array  # [] float32 selected rows, summed over steps
    fetched: jax.Array  # [] float32 rows moved host -> device (bucketed transfer size), summed


def init_offload_state(policy, config, batch_size: int, capacity: int, dtype, selection_shape) -> OffloadState:
    """Device buffers for every layer; selection_shape is the policy's (B, h, M) budgeted selection."""
    L, B, K, H = config.num_layers, batch_size, config.num_kv_heads, config.head_dim
    _, h, M = selection_shape
    W = max(policy.window_size(), 1) if hasattr(policy, "window_size") else 1
    R = policy.cache_steps
    return OffloadState(
        ring_k=jnp.zeros((L, B, K, W, H), dtype),
        ring_v=jnp.zeros((L, B, K, W, H), dtype),
        cache_ids=jnp.full((L, B, h, R, M), -1, jnp.int32),
        cache_k=jnp.zeros((L, B, h, R, M, H), dtype),
        cache_v=jnp.zeros((L, B, h, R, M, H), dtype),
        step=jnp.zeros((L,), jnp.int32),
        hits=jnp.zeros((L,), jnp.float32),
        selected=jnp.zeros((L,), jnp.float32),
        fetched=jnp.zeros((L,), jnp.float32),
    )


def write_prefill(host_k, host_v, host_layer, k_bkth, v_bkth):
    """Stores one layer's prompt K/V [B, K, T, H] at rows 0..T of host layer `host_layer`."""
    k_h, v_h, layer_h = to_host(k_bkth[None]), to_host(v_bkth[None]), to_host(host_layer)

    def write(store, rows, layer):
        return jax.lax.dynamic_update_slice(store, rows, (layer, 0, 0, 0, 0))

    return _on_host(write, host_k, k_h, layer_h), _on_host(write, host_v, v_h, layer_h)


# Host rows are addressed per (sequence, KV head) with `cache.gather_rows` / `scatter_rows`, which treat B and
# K as batching dimensions: the host store is never reshaped across B or K, so under a mesh each shard reads
# and writes its own rows (no collective), and the host computation sees only a gather or scatter whose
# operands are all in host memory already (the index arithmetic stays on the device).


def _write_token(host_k, host_v, host_layer, positions, k_new, v_new):
    """Stores one token per sequence, k_new/v_new [B, K, H], at rows `positions` [B] of the host layer."""
    _, B, K, _, _ = host_k.shape
    index = to_host(row_index(jnp.broadcast_to(positions[:, None, None], (B, K, 1)), host_layer))
    k_h, v_h = to_host(k_new[:, :, None]), to_host(v_new[:, :, None])  # [B, K, 1, H]

    def write(store, new):
        return scatter_rows(store, index, new)

    return _on_host(write, host_k, k_h), _on_host(write, host_v, v_h)


def host_gather(host_k, host_v, host_layer, ids):
    """Rows of the host layer at ids [B, h, n] (head n reads KV head n // (h // K)) -> device [B, h, n, H]."""
    B, h, n = ids.shape
    _, _, K, _, H = host_k.shape
    index = to_host(row_index(ids.reshape(B, K, (h // K) * n), host_layer))

    def gather(store):
        return gather_rows(store, index)

    k = to_device(_on_host(gather, host_k))
    v = to_device(_on_host(gather, host_v))
    return k.reshape(B, h, n, H), v.reshape(B, h, n, H)


def _miss_buckets(M: int) -> list[int]:
    return sorted({max(1, M // 8), max(1, M // 4), max(1, M // 2), M})


def recall_rows(ost: OffloadState, idx, mask, host_k, host_v, host_layer, R: int):
    """Rows for the selection idx/mask [B, h, M]: cache hits from the device, misses fetched from the host."""
    B, h, M = idx.shape
    H = host_k.shape[4]
    if R == 0:  # no cache: every selected row crosses
        k, v = host_gather(host_k, host_v, host_layer, idx)
        return k, v, ost.replace(step=ost.step + 1, selected=ost.selected + jnp.sum(mask),
                                 fetched=ost.fetched + B * h * M)
    # Look each slot up among the R·M cached positions: sort once, then binary search.
    cached = ost.cache_ids.reshape(B, h, R * M)
    order = jnp.argsort(cached, axis=-1)
    sorted_ids = jnp.take_along_axis(cached, order, axis=-1)
    pos = jax.vmap(jax.vmap(lambda s, q: jnp.searchsorted(s, q)))(sorted_ids, idx)
    pos = jnp.minimum(pos, R * M - 1)
    hit = (jnp.take_along_axis(sorted_ids, pos, axis=-1) == idx) & mask  # [B, h, M]
    where_cached = jnp.take_along_axis(order, pos, axis=-1)
    cached_k = jnp.take_along_axis(ost.cache_k.reshape(B, h, R * M, H), where_cached[..., None], axis=2)
    cached_v = jnp.take_along_axis(ost.cache_v.reshape(B, h, R * M, H), where_cached[..., None], axis=2)

    # Misses first (stable), then fetch only as many rows as the fullest head needs, rounded up to a bucket.
    miss = mask & ~hit
    miss_first = jnp.argsort(~miss, axis=-1, stable=True)  # [B, h, M]
    miss_ids = jnp.take_along_axis(idx, miss_first, axis=-1)
    buckets = _miss_buckets(M)
    most = jnp.max(jnp.sum(miss, axis=-1))
    bucket = jnp.sum(jnp.array(buckets[:-1]) < most)  # index of the smallest bucket holding `most`

    def fetch(n):
        def run(_):
            k, v = host_gather(host_k, host_v, host_layer, miss_ids[..., :n])  # [B, h, n, H]
            dest = miss_first[..., :n]
            put = jax.vmap(jax.vmap(lambda z, d, r: z.at[d].set(r)))
            zeros = jnp.zeros((B, h, M, H), k.dtype)
            return put(zeros, dest, k), put(zeros, dest, v), jnp.float32(B * h * n)
        return run

    fetched_k, fetched_v, moved = jax.lax.switch(bucket, [fetch(n) for n in buckets], None)
    k = jnp.where(hit[..., None], cached_k.astype(fetched_k.dtype), fetched_k)
    v = jnp.where(hit[..., None], cached_v.astype(fetched_v.dtype), fetched_v)
    slot = ost.step % R
    ost = ost.replace(
        cache_ids=ost.cache_ids.at[:, :, slot].set(jnp.where(mask, idx, -1)),
        cache_k=ost.cache_k.at[:, :, slot].set(k.astype(ost.cache_k.dtype)),
        cache_v=ost.cache_v.at[:, :, slot].set(v.astype(ost.cache_v.dtype)),
        step=ost.step + 1,
        hits=ost.hits + jnp.sum(hit),
        selected=ost.selected + jnp.sum(mask),
        fetched=ost.fetched + moved,
    )
    return k, v, ost


def decode_layer(policy, state: Any, ost: OffloadState, q, k_new, v_new, host_k, host_v, host_layer,
                 old_lengths, lengths, prompt_lengths):
    """One compressed layer's decode attention with the KV in host memory. Returns (out [B, N, H], state,
    ost, host_k, host_v)."""
    from clusterkv_jax.attention import decode_attention
    from clusterkv_jax.policies.full import FullKV

    B = q.shape[0]
    W = ost.ring_k.shape[2]
    host_k, host_v = _write_token(host_k, host_v, host_layer, old_lengths, k_new, v_new)
    if isinstance(policy, FullKV):  # stream the whole layer to the device
        S = host_k.shape[3]
        k_all, v_all = host_gather(host_k, host_v, host_layer, jnp.broadcast_to(jnp.arange(S), (B, host_k.shape[2], S)))
        moved = jnp.float32(B * host_k.shape[2] * S)
        ost = ost.replace(step=ost.step + 1, fetched=ost.fetched + moved)
        return decode_attention(q, k_all, v_all, lengths), state, ost, host_k, host_v
    K = k_new.shape[1]
    slot = row_index(jnp.broadcast_to((old_lengths % W)[:, None, None], (B, K, 1)))
    ost = ost.replace(ring_k=scatter_rows(ost.ring_k, slot, k_new[:, :, None]),
                      ring_v=scatter_rows(ost.ring_v, slot, v_new[:, :, None]))

    def recent_keys():
        pos = policy.indexed_upto(state)[:, None] + jnp.arange(W)  # [B, W]
        return jnp.take_along_axis(ost.ring_k, (pos % W)[:, None, :, None], axis=2)

    state = policy.index_recent(state, recent_keys, lengths, prompt_lengths)
    idx, mask = policy.select(state, q, None, lengths, prompt_lengths)  # [B, h, M]
    k_sel, v_sel, ost = recall_rows(ost, idx, mask, host_k, host_v, host_layer, policy.cache_steps)
    w_idx, w_mask = recent_window(lengths, policy.indexed_upto(state), W)  # [B, W]
    ring_slots = (w_idx % W)[:, None, :, None]
    k_win = jnp.take_along_axis(ost.ring_k, ring_slots, axis=2)  # [B, K, W, H]
    v_win = jnp.take_along_axis(ost.ring_v, ring_slots, axis=2)
    out = selection_and_window_attention(q, k_sel, v_sel, mask, k_win, v_win, w_mask)
    return out, state, ost, host_k, host_v


def hit_rates(cache) -> list[float | None]:
    """Per layer: fraction of selected rows served from the device cache (None where nothing was selected)."""
    ost = cache.offload_state
    hits, selected = jax.device_get((ost.hits, ost.selected))
    return [float(h / s) if s else None for h, s in zip(hits, selected)]


def selection_shape(policy, config, policy_state, batch_size: int) -> tuple[int, int, int]:
    """(B, h, M) of the policy's budgeted selection, found by tracing `select` on one layer's state."""
    from clusterkv_jax.policies.full import FullKV

    layer_state = jax.tree.map(lambda x: x[0], policy_state)
    if isinstance(policy, FullKV):  # streams whole layers; no selection, no cache
        return (batch_size, config.num_kv_heads, 1)
    q = jax.ShapeDtypeStruct((batch_size, config.num_heads, config.head_dim), jnp.float32)
    lengths = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
    idx, _ = jax.eval_shape(lambda s, q, n: policy.select(s, q, None, n, n), layer_state, q, lengths)
    return idx.shape
