"""The KV cache: the model's layers in groups, each group's K/V in one store, plus the policy's state.

Layers [0, full_layers) attend to every cached token; layers [full_layers, L) attend to what the policy selects.
Each run of layers that agree on that and on placement (device or host memory, as the policy asks) is one
`LayerGroup`: one store (`clusterkv_jax.store.DeviceKV` or `clusterkv_jax.offload.HostKV`) stacked over the
group's layers and, for selecting layers, the policy's state stacked likewise. The model runs one `lax.scan`
per group, so buffers exist only where they are used: no policy state for full layers, no host buffers for
device layers.

Everything is capacity-padded: rows at or past `lengths[b]` of sequence b are padding. Donate the cache to the
step that consumes it. Every array declares its logical axes and memory (`clusterkv_jax.axes`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from clusterkv_jax import axes
from clusterkv_jax.config import ModelConfig, check_size
from clusterkv_jax.offload import HostKV, host_memory_kind
from clusterkv_jax.store import DeviceKV


class GroupPlan(NamedTuple):
    start: int
    stop: int
    selecting: bool
    on_host: bool


def layer_groups(config: ModelConfig, policy) -> list[GroupPlan]:
    """The policy's layers as contiguous groups of (selecting or not) x (device or host memory)."""
    L = config.num_layers
    first_selecting = min(max(policy.full_layers, 0), L)
    plans = []
    for start, stop, selecting in ((0, first_selecting, False), (first_selecting, L, True)):
        if stop > start:
            plans.append(GroupPlan(start, stop, selecting, bool(policy.offloads(selecting))))
    return plans


@flax.struct.dataclass
class LayerGroup:
    """Layers [start, start + n) with one placement: their store and (selecting layers) the policy's state."""

    store: Any  # DeviceKV or HostKV, arrays [n, B, K, S, H]
    state: Any = axes.stacked()  # the policy's state, every leaf with a leading [n] axis; None for full layers
    start: int = flax.struct.field(pytree_node=False)
    selecting: bool = flax.struct.field(pytree_node=False)

    @property
    def num_layers(self) -> int:
        return self.store.k.shape[0]

    @property
    def on_host(self) -> bool:
        return isinstance(self.store, HostKV)


@flax.struct.dataclass
class KVCache:
    """The model's KV, grouped (see the module docstring), and per-sequence lengths."""

    groups: tuple[LayerGroup, ...]
    lengths: jax.Array = axes.field("batch")  # [B] int32: tokens stored (prompt + generated)
    prompt_lengths: jax.Array = axes.field("batch")  # [B] int32: tokens that came from the prompt
    capacity: int = flax.struct.field(pytree_node=False, default=0)  # S: positions each sequence can hold

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def dtype(self):
        return jnp.dtype(self.groups[0].store.k.dtype)

    @property
    def offloaded(self) -> bool:
        return any(g.on_host for g in self.groups)

    @property
    def selecting(self) -> LayerGroup | None:
        """The group of selecting layers (None when every layer attends to everything)."""
        return next((g for g in self.groups if g.selecting), None)

    @property
    def policy_state(self) -> Any:
        """The policy's state of the selecting layers, leading axis [L - full_layers] (None without any)."""
        group = self.selecting
        return None if group is None else group.state

    def group_of(self, layer: int) -> tuple[LayerGroup, int]:
        """(the group holding model layer `layer`, its index inside that group)."""
        for g in self.groups:
            if g.start <= layer < g.start + g.num_layers:
                return g, layer - g.start
        raise IndexError(f"layer {layer} out of range")

    def layer_kv(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values [B, K, R, H] of every store row of model layer `layer`, on the device (tests,
        benchmarks, plots). Row r holds position r unless the policy lays its layers out otherwise."""
        return _layer_kv(self, layer)


@functools.partial(jax.jit, static_argnums=1)
def _layer_kv(cache: KVCache, layer: int):
    group, i = cache.group_of(layer)
    return group.store.layer(jnp.int32(i), cache.capacity).read_all(group.store.capacity)


def init_cache(config: ModelConfig, policy, batch_size: int, capacity: int, dtype=None) -> KVCache:
    """An empty cache for `batch_size` sequences of up to `capacity` tokens each, laid out for `policy`. K/V
    are stored in `dtype` (default float32, what attention computes in; pass the parameters' dtype to match
    `generate`, or bfloat16 to halve the memory)."""
    check_size(batch_size, "batch_size")
    check_size(capacity, "capacity")
    if config.sliding_window is not None and capacity > config.sliding_window:
        raise ValueError(f"capacity {capacity} exceeds the model's sliding_window={config.sliding_window}: past it "
                         "attention would be windowed, which is not implemented")
    dtype = jnp.float32 if dtype is None else jnp.dtype(dtype)
    B, K, H = batch_size, config.num_kv_heads, config.head_dim
    groups = []
    for plan in layer_groups(config, policy):
        n = plan.stop - plan.start
        rows = policy.store_rows(capacity) if plan.selecting else capacity
        if not plan.on_host:
            store = DeviceKV.create(n, B, K, rows, H, dtype)
        elif plan.selecting:
            store = HostKV.create(n, B, K, rows, H, dtype, window=policy.window_size(capacity),
                                  selection_shape=policy.selection_shape(config, B, capacity),
                                  recall_steps=policy.recall_steps, ring_rows=policy.ring_window)
        else:
            store = HostKV.create(n, B, K, rows, H, dtype)
        state = policy.init_states(config, B, capacity, range(plan.start, plan.stop)) if plan.selecting else None
        groups.append(LayerGroup(store=store, state=state, start=plan.start, selecting=plan.selecting))
    # Two arrays, not one: a donated cache must not pass the same buffer twice.
    return KVCache(groups=tuple(groups), lengths=jnp.zeros((B,), jnp.int32), prompt_lengths=jnp.zeros((B,), jnp.int32),
                   capacity=capacity)


def memory_kinds(cache: KVCache) -> KVCache:
    """The cache with every array replaced by its memory kind: "device", or the host kind for arrays declared in
    host memory (where the backend has one)."""
    host = host_memory_kind() or "device"
    return jax.tree.map(lambda a: host if a.host else "device", axes.of(cache))


def kv_bytes(cache: KVCache) -> dict[str, int]:
    """Bytes of KV held in device memory (device stores, and the ring and recall cache of host stores) and in
    host memory. The policy's index (centroids, pages) is not KV and is not counted."""
    total = {"device": 0, "host": 0}
    for g in cache.groups:
        for kind, n in g.store.nbytes().items():
            total[kind] += n
    return total
