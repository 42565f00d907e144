"""The KV cache: the model's layers in groups, each group's K/V in one store, plus the policy's state.

Each layer attends one of three ways (its `LayerKind`):

- windowed: a sliding-attention layer whose window W is shorter than the capacity keeps a ring of its last W
  positions (row = position % W): memory and step time independent of the context. It never selects.
- full: layers [0, full_layers) of the model that are not windowed attend to every cached token.
- selecting: the other layers attend to what the policy selects (in device or host memory, as it asks).

`full_layers` counts the model's layers from the first, whatever their type: a windowed layer among them keeps its
window. A budget applies to each selecting layer.

The layers of one kind share one `LayerGroup`: one store (`clusterkv_jax.store.DeviceKV` or
`clusterkv_jax.offload.HostKV`) stacked over the group's layers and, for selecting layers, the policy's state
stacked likewise (Gemma 3's five windowed layers of every six are one group, its global ones another). On a GPU,
where the model's layer loop is unrolled, each layer is a group of its own (`plan_layers`). Buffers exist only where
they are used: no policy state for full or windowed layers, no host buffers for device layers.

Everything is capacity-padded: rows at or past `lengths[b]` of sequence b are padding. Donate the cache to the
step that consumes it. Every array declares its logical axes and memory (`clusterkv_jax.axes`).
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from clusterkv_jax import axes, kernels
from clusterkv_jax.config import ModelConfig, check_size
from clusterkv_jax.offload import HostKV, host_memory_kind
from clusterkv_jax.store import DeviceKV

WINDOWED, FULL, SELECTING = "windowed", "full", "selecting"


class LayerKind(NamedTuple):
    attention: str  # WINDOWED, FULL or SELECTING
    on_host: bool


def layer_kinds(config: ModelConfig, policy, capacity: int) -> list[LayerKind]:
    """How each layer of `config` attends under `policy` in a cache of `capacity` positions."""
    kinds = []
    for layer, windowed in enumerate(config.windowed_layers(capacity)):
        if windowed:
            kinds.append(LayerKind(WINDOWED, False))
        else:
            selecting = layer >= policy.full_layers
            kinds.append(LayerKind(SELECTING if selecting else FULL, bool(policy.offloads(selecting))))
    return kinds


class GroupPlan(NamedTuple):
    layers: tuple[int, ...]  # model layers, in store order
    kind: LayerKind


def plan_layers(config: ModelConfig, policy, capacity: int) -> list[GroupPlan]:
    """The groups of a cache: one per kind of layer, in the order each kind first appears; one per layer where the
    model's layer loop is unrolled (`kernels.layer_loop`, a GPU's): XLA:GPU copies a layer's V out of a stacked
    store before the attention's split probabilities-times-V product (68 MB a layer at 32k, deviceless H100), and
    reads a store of its own in place."""
    kinds = layer_kinds(config, policy, capacity)
    if kernels.layer_loop() == "unrolled":
        return [GroupPlan((layer,), kind) for layer, kind in enumerate(kinds)]
    return [GroupPlan(tuple(layer for layer, k in enumerate(kinds) if k == kind), kind) for kind in dict.fromkeys(kinds)]


@flax.struct.dataclass
class LayerGroup:
    """Model layers `layers` of one kind and placement: their store and (selecting layers) the policy's state."""

    store: Any  # DeviceKV or HostKV, arrays [n, B, K, R, H] (a windowed group: R = W)
    state: Any = axes.stacked()  # the policy's state, every leaf with a leading [n] axis; None unless selecting
    layers: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    attention: str = flax.struct.field(pytree_node=False, default=FULL)

    @property
    def num_layers(self) -> int:
        return self.store.k.shape[0]

    @property
    def selecting(self) -> bool:
        return self.attention == SELECTING

    @property
    def windowed(self) -> bool:
        return self.attention == WINDOWED

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
    def selecting_groups(self) -> tuple[LayerGroup, ...]:
        """The groups of selecting layers, in model order (a GPU's cache has one per layer)."""
        return tuple(sorted((g for g in self.groups if g.selecting), key=lambda g: g.layers[0]))

    @property
    def selecting(self) -> LayerGroup | None:
        """The first group of selecting layers (None when every layer attends to everything)."""
        groups = self.selecting_groups
        return groups[0] if groups else None

    @property
    def policy_state(self) -> Any:
        """The policy's state of the selecting layers, leading axis [selecting layers] in model order (None without
        any): the selecting groups' states, concatenated where there are several."""
        groups = self.selecting_groups
        if len(groups) <= 1:
            return groups[0].state if groups else None
        return jax.tree.map(lambda *states: jnp.concatenate(states), *(g.state for g in groups))

    def group_of(self, layer: int) -> tuple[LayerGroup, int]:
        """(the group holding model layer `layer`, its index inside that group)."""
        for g in self.groups:
            if layer in g.layers:
                return g, g.layers.index(layer)
        raise IndexError(f"layer {layer} out of range")

    def layer_kv(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values [B, K, R, H] of every store row of model layer `layer`, on the device (tests,
        benchmarks, plots). Row r holds position r unless the policy lays its layers out otherwise (or the layer is
        windowed: row r holds the latest position p with p % W = r)."""
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
    dtype = jnp.float32 if dtype is None else jnp.dtype(dtype)
    build = functools.partial(_build_cache, config, policy, batch_size, capacity, dtype)
    check_fits(jax.eval_shape(build),
               f"a cache for {batch_size} sequence(s) of capacity {capacity} ({type(policy).__name__})")
    return build()


def _build_cache(config: ModelConfig, policy, batch_size: int, capacity: int, dtype) -> KVCache:
    B, K, H = batch_size, config.num_kv_heads, config.head_dim
    groups = []
    for plan in plan_layers(config, policy, capacity):
        n, selecting = len(plan.layers), plan.kind.attention == SELECTING
        rows = {WINDOWED: config.sliding_window, FULL: capacity, SELECTING: policy.layout.store_rows(capacity)}[
            plan.kind.attention]
        if not plan.kind.on_host:
            store = DeviceKV.create(n, B, K, rows, H, dtype)
        elif selecting:
            store = HostKV.create(n, B, K, rows, H, dtype, window=policy.window_size(capacity),
                                  selection_shape=policy.selection_shape(config, B, capacity),
                                  recall_steps=policy.recall_steps, ring_rows=policy.layout.ring_window)
        else:
            store = HostKV.create(n, B, K, rows, H, dtype)
        state = policy.init_states(config, B, capacity, plan.layers) if selecting else None
        groups.append(LayerGroup(store=store, state=state, layers=plan.layers, attention=plan.kind.attention))
    # Two arrays, not one: a donated cache must not pass the same buffer twice.
    return KVCache(groups=tuple(groups), lengths=jnp.zeros((B,), jnp.int32), prompt_lengths=jnp.zeros((B,), jnp.int32),
                   capacity=capacity)


def memory_limits() -> dict[str, int]:
    """Bytes that device memory and host memory hold at most: the local devices' `bytes_limit` summed (a sharded
    array spreads over them), host memory the machine's RAM; where devices do not report a limit (the CPU), they
    are the machine's RAM too, shared with host memory ("shared": True)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats() or {}
        except Exception:  # noqa: BLE001 -- a backend without memory statistics
            stats = {}
        limits.append(stats.get("bytes_limit"))
    if not limits or None in limits:
        return {"device": ram, "host": ram, "shared": True}
    return {"device": sum(limits), "host": ram, "shared": False}


def check_fits(abstract: Any, what: str) -> None:
    """Refuses, before anything is allocated, a pytree of arrays (or ShapeDtypeStructs) declaring logical axes
    (`axes.field`) whose bytes in device or host memory exceed what the machine holds (`memory_limits`): a size
    that could never fit is named at once instead of allocating until the machine runs out."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(abstract)
    hosted = jax.tree.leaves(jax.tree.map(lambda a: a.host, axes.of(abstract)))
    need = {"device": 0, "host": 0}
    largest = (0, "", ())
    for (path, leaf), host in zip(leaves, hosted):
        n = leaf.size * jnp.dtype(leaf.dtype).itemsize
        need["host" if host else "device"] += n
        largest = max(largest, (n, jax.tree_util.keystr(path), tuple(leaf.shape)))
    limits = memory_limits()
    checks = ([("device and host", need["device"] + need["host"], limits["device"])] if limits["shared"]
              else [("device", need["device"], limits["device"]), ("host", need["host"], limits["host"])])
    for kind, n, limit in checks:
        if n > limit:
            raise ValueError(
                f"{what} needs {n / 1e9:,.1f} GB of {kind} memory, more than the {limit / 1e9:,.1f} GB this machine "
                f"has (largest array {largest[1]} of shape {largest[2]}); lower the capacity (max_length, "
                "max_new_tokens), the batch or the policy's sizes")


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


def layer_kv_bytes(cache: KVCache) -> list[dict[str, Any]]:
    """Per model layer: how it attends ("windowed", "full", "selecting") and the bytes of KV it holds in device and
    host memory (`kv_bytes` split by layer)."""
    out: list[dict[str, Any]] = [{}] * sum(g.num_layers for g in cache.groups)
    for g in cache.groups:
        held = {kind: n // g.num_layers for kind, n in g.store.nbytes().items()}
        for layer in g.layers:
            out[layer] = {"attention": g.attention, **held}
    return out
