"""`HostKV`: a group of layers whose keys and values live in host memory, behind the store protocol of
`clusterkv_jax.store`.

The full K/V stay in host memory (memory kind `pinned_host`, via `jax.device_put` with memory-kind shardings;
where a backend lacks it we fall back and warn once). For a group of selecting layers the device keeps

- a ring of the last W tokens written (slot = position % W): the policy's unindexed window, read every step
  and clustered from when it is due, without a host round trip;
- a recall cache: the chunks (rows, ClusterKV's blocks, Quest's pages) selected in the last R = `cache_steps`
  steps, looked up by their first row.

Each decode step of such a layer: the new token's K/V go to the host store and to the ring; the policy
selects on the device; `read` looks the selected chunks up in the recall cache and fetches only the missing
chunks from the host (their first rows move to the host, the host gathers the chunks inside the same jit via
`compute_on`, they move back), in transfers bucketed to c/8, c/4, c/2 or c chunks so shapes stay static yet
shrink with the misses. Results equal the on-device path exactly. A group of full layers (`FullKV(offload=True)`) has neither
buffer: each step streams the whole layer to the device.

Device bytes of an offloaded selecting group depend on (budget, R, W), not on the context length.
Shapes: n layers, B batch, K KV heads, h selection heads (N or K), c chunks of `chunk` rows, W window, H head dim.
"""

from __future__ import annotations

import functools
import warnings

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from clusterkv_jax.ops import gather_rows, per_kv_head, row_index, scatter_rows
from clusterkv_jax.store import KVStore, LayerView, Selection


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
class RecallCache:
    """The chunks each selection head selected in the last R steps (by their first row), per layer of the group,
    with their rows, and counters."""

    ids: jax.Array  # [n, B, h, R, c] int32 first row of each cached chunk (-1: empty)
    k: jax.Array  # [n, B, h, R, c, chunk, H]
    v: jax.Array  # [n, B, h, R, c, chunk, H]
    step: jax.Array  # [n] int32 decode steps seen
    hits: jax.Array  # [n] float32 selected rows served from the cache, summed over steps
    selected: jax.Array  # [n] float32 selected rows, summed over steps
    fetched: jax.Array  # [n] float32 rows moved host -> device (bucketed transfer sizes), summed

    @classmethod
    def create(cls, layers: int, selection_shape: tuple[int, int, int, int], steps: int, head_dim: int, dtype):
        """selection_shape: (B, h, c chunks, chunk rows) of the policy's selection."""
        B, h, c, chunk = selection_shape
        zeros = lambda: jnp.zeros((layers,), jnp.float32)  # a buffer each: the cache is donated
        return cls(ids=jnp.full((layers, B, h, steps, c), -1, jnp.int32),
                   k=jnp.zeros((layers, B, h, steps, c, chunk, head_dim), dtype),
                   v=jnp.zeros((layers, B, h, steps, c, chunk, head_dim), dtype),
                   step=jnp.zeros((layers,), jnp.int32), hits=zeros(), selected=zeros(), fetched=zeros())

    @property
    def steps(self) -> int:
        return self.ids.shape[3]


@flax.struct.dataclass
class HostKV(KVStore):
    """Keys and values of a group of layers in host memory (see the module docstring)."""

    k: jax.Array  # [n, B, K, R, H] memory kind pinned_host
    v: jax.Array  # [n, B, K, R, H]
    ring_k: jax.Array | None = None  # [n, B, K, W, H] device: the last W tokens written, slot = row % W
    ring_v: jax.Array | None = None
    recall: RecallCache | None = None  # device: chunks selected in the last R steps

    @classmethod
    def create(cls, layers: int, batch: int, kv_heads: int, rows: int, head_dim: int, dtype, *, window: int = 0,
               selection_shape: tuple[int, int, int, int] | None = None, cache_steps: int = 0):
        """window > 0 keeps a device ring of that many recent tokens; selection_shape (B, h, c, chunk) adds the
        recall cache of `cache_steps` steps (a group of selecting layers); without it the group streams whole
        layers."""
        shape = (layers, batch, kv_heads, rows, head_dim)
        store = cls(k=host_zeros(shape, dtype), v=host_zeros(shape, dtype))
        if window:
            ring = (layers, batch, kv_heads, window, head_dim)
            store = store.replace(ring_k=jnp.zeros(ring, dtype), ring_v=jnp.zeros(ring, dtype))
        if selection_shape is not None:
            store = store.replace(recall=RecallCache.create(layers, selection_shape, cache_steps, head_dim, dtype))
        return store

    def write_prompt(self, layer, k, v, start=0) -> "HostKV":
        def write(store, rows, at, row):
            index = tuple(jnp.asarray(i, jnp.int32) for i in (at, 0, 0, row, 0))  # one index dtype, also under x64
            return jax.lax.dynamic_update_slice(store, rows, index)

        k_h, v_h = to_host(k[None].astype(self.k.dtype)), to_host(v[None].astype(self.v.dtype))
        at, row = to_host(jnp.asarray(layer, jnp.int32)), to_host(jnp.asarray(start, jnp.int32))
        return self.replace(k=_on_host(write, self.k, k_h, at, row), v=_on_host(write, self.v, v_h, at, row))

    def write_layer(self, layer, k, v) -> "HostKV":
        return self.write_prompt(layer, k, v)  # the same write, of all R rows

    def write_rows(self, index, k, v) -> "HostKV":
        """Host rows at index [B, K, m, 2] (from row_index) <- k, v [B, K, m, H] (out of range: dropped)."""
        index = to_host(index)
        k_h, v_h = to_host(k.astype(self.k.dtype)), to_host(v.astype(self.v.dtype))

        def write(store, new):
            return scatter_rows(store, index, new)

        return self.replace(k=_on_host(write, self.k, k_h), v=_on_host(write, self.v, v_h))

    def write_token(self, layer, rows, k, v) -> "HostKV":
        B, K = k.shape[:2]
        store = self.write_rows(row_index(jnp.broadcast_to(rows[:, None, None], (B, K, 1)), layer),
                                 k[:, :, None], v[:, :, None])
        if self.ring_k is None:
            return store
        W = self.ring_k.shape[3]
        # A row out of range (a token past the capacity) is dropped from the ring as from the host store.
        slot = jnp.where((rows >= 0) & (rows < self.capacity), rows % W, W)
        slots = row_index(jnp.broadcast_to(slot[:, None, None], (B, K, 1)), layer)
        return store.replace(ring_k=scatter_rows(self.ring_k, slots, k[:, :, None]),
                             ring_v=scatter_rows(self.ring_v, slots, v[:, :, None]))

    def layer(self, layer, positions: int | None = None) -> "HostLayer":
        return HostLayer(self, layer, self.capacity if positions is None else positions)

    def memory_kinds(self) -> "HostKV":
        host = host_memory_kind() or "device"
        return jax.tree.map(lambda _: "device", self).replace(k=host, v=host)


def _miss_buckets(c: int) -> list[int]:
    return sorted({max(1, c // 8), max(1, c // 4), max(1, c // 2), c})


class HostLayer(LayerView):
    """One layer of a HostKV."""

    def _stream(self, store):
        """The whole layer, sliced on the host and moved to the device: [B, K, R, H]."""
        at = to_host(self.index)
        return to_device(_on_host(lambda s, i: jax.lax.dynamic_index_in_dim(s, i, keepdims=False), store, at))

    def keys(self):
        return self._stream(self.store.k)

    def values(self):
        return self._stream(self.store.v)

    def host_gather(self, starts, chunk: int, aligned: bool = False):
        """Host chunks of `chunk` rows from starts [B, h, n] (head n reads KV head n // (h // K); `aligned`: as
        `Selection.aligned`) -> device [B, h, n, chunk, H]."""
        B, h, n = starts.shape
        K, H = self.store.k.shape[2], self.store.k.shape[4]
        # In range by construction (clamped on the device), so the host computation is a plain gather.
        safe = jnp.clip(per_kv_head(starts, K), 0, self.store.capacity - chunk)
        index = to_host(row_index(safe, self.index))

        def gather(store):
            return gather_rows(store, index, mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS, chunk=chunk,
                               aligned=aligned)

        k = to_device(_on_host(gather, self.store.k))
        v = to_device(_on_host(gather, self.store.v))
        return k.reshape(B, h, n, chunk, H), v.reshape(B, h, n, chunk, H)

    def commit_window(self, rows, dest):
        """Under the `lax.cond` on every platform, not only the CPU (`commit_window_if_due`): it skips the host
        round trip on steps with nothing due (every m-th step does one). Compiled for an H100 the offloaded step
        copies the host store either way (4 copies per step at 2 layers x 32k; `clusterkv_jax.aot`): not yet
        solved."""
        return self.commit_window_if_due(rows, dest)

    def window(self, rows):
        B, W = rows.shape
        K = self.store.ring_k.shape[2]
        slots = row_index(jnp.broadcast_to((rows % self.store.ring_k.shape[3])[:, None, :], (B, K, W)), self.index)
        return gather_rows(self.store.ring_k, slots), gather_rows(self.store.ring_v, slots)

    def ring(self, window: int):
        # The device ring holds row r at slot r % W: rows [0, W) are the ring itself, in order.
        assert window == self.store.ring_k.shape[3], (window, self.store.ring_k.shape)
        at = lambda x: jax.lax.dynamic_index_in_dim(x, self.index, keepdims=False)  # noqa: E731
        return at(self.store.ring_k), at(self.store.ring_v)

    @jax.named_scope("recall")
    def read(self, selection: Selection):
        """The selected chunks: recall-cache hits from the device, misses fetched from the host."""
        rc = self.store.recall
        at = self.index
        starts, mask = selection.starts, jnp.any(selection.mask, axis=-1)  # [B, h, c]: chunks holding a token
        B, h, c = starts.shape
        chunk, H = selection.chunk, self.store.k.shape[4]
        R = rc.steps
        count = lambda a, x: a.at[at].add(x)
        flat = lambda x: x.reshape(B, h, c * chunk, H)
        rows_selected = jnp.sum(selection.mask)
        if R == 0:  # no cache: every selected chunk crosses
            k, v = self.host_gather(starts, chunk, selection.aligned)
            rc = rc.replace(step=count(rc.step, 1), selected=count(rc.selected, rows_selected),
                            fetched=count(rc.fetched, float(B * h * c * chunk)))
            return flat(k), flat(v), HostLayer(self.store.replace(recall=rc), at, self.positions)
        layer_of = lambda x: jax.lax.dynamic_index_in_dim(x, at, keepdims=False)
        # Look each chunk up among the R·c cached ones: one comparison matrix [B, h, c, R·c] (a few thousand
        # compares per head; cheaper on a CPU than a sort and a binary search).
        cached = layer_of(rc.ids).reshape(B, h, R * c)
        same = starts[..., :, None] == cached[..., None, :]
        hit = jnp.any(same, axis=-1) & mask  # [B, h, c]
        where_cached = jnp.argmax(same, axis=-1)  # its place in the cache (0 when missed)
        # Whole chunks per index (a per-element take_along_axis is several times slower on XLA:CPU).
        take = jax.vmap(jax.vmap(lambda a, i: jnp.take(a, i, axis=0, mode="clip")))
        cached_k = take(layer_of(rc.k).reshape(B, h, R * c, chunk, H), where_cached)
        cached_v = take(layer_of(rc.v).reshape(B, h, R * c, chunk, H), where_cached)

        # Misses first (stable), then fetch only as many chunks as the fullest head needs, rounded up to a bucket;
        # each missed slot takes its fetched chunk, every other slot its cached one.
        miss = mask & ~hit
        miss_first = jnp.argsort(~miss, axis=-1, stable=True)  # [B, h, c]
        miss_starts = jnp.take_along_axis(starts, miss_first, axis=-1)
        buckets = _miss_buckets(c)
        most = jnp.max(jnp.sum(miss, axis=-1))
        bucket = jnp.sum(jnp.array(buckets[:-1]) < most)  # index of the smallest bucket holding `most`

        # Slot j's place among the misses (fetched in slot order): its rows come from there when j missed.
        miss_rank = jnp.cumsum(miss, axis=-1, dtype=jnp.int32) - 1  # [B, h, c]

        def fetch(n):
            def run(kv):
                k, v = self.host_gather(miss_starts[..., :n], chunk, selection.aligned)  # [B, h, n, chunk, H]
                # A select between two chunk gathers, not an in-place scatter into the cached rows (the switch's
                # operands): XLA:CPU copies operands a branch updates, and scatters element by element.
                source = jnp.clip(miss_rank, 0, n - 1)
                fill = lambda cached, got: jnp.where(  # noqa: E731
                    miss[..., None, None], take(got.astype(cached.dtype), source), cached)
                return fill(kv[0], k), fill(kv[1], v), jnp.float32(B * h * n * chunk)
            return run

        k, v, moved = jax.lax.switch(bucket, [fetch(n) for n in buckets], (cached_k, cached_v))
        slot = layer_of(rc.step) % R

        def put(a, x):  # this layer's slot `slot` of the cache <- x, one in-place update
            index = tuple(jnp.asarray(i, jnp.int32) for i in (at, 0, 0, slot) + (0,) * (a.ndim - 4))
            return jax.lax.dynamic_update_slice(a, x.astype(a.dtype)[None, :, :, None], index)

        hit_rows = jnp.sum(jnp.where(hit[..., None], selection.mask, False))
        rc = rc.replace(
            ids=put(rc.ids, jnp.where(mask, starts, -1)), k=put(rc.k, k), v=put(rc.v, v),
            step=count(rc.step, 1), hits=count(rc.hits, hit_rows), selected=count(rc.selected, rows_selected),
            fetched=count(rc.fetched, moved),
        )
        return flat(k), flat(v), HostLayer(self.store.replace(recall=rc), at, self.positions)


def hit_rates(cache) -> list[float | None]:
    """Per model layer: the fraction of selected rows served from the device recall cache (None for layers
    that select nothing or keep their KV on the device)."""
    rates: list[float | None] = []
    for group in cache.groups:
        recall = getattr(group.store, "recall", None)
        if recall is None:
            rates += [None] * group.num_layers
            continue
        hits, selected = jax.device_get((recall.hits, recall.selected))
        rates += [float(h / s) if s else None for h, s in zip(hits, selected)]
    return rates
