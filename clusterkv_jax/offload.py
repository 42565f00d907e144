"""`HostKV`: a group of layers whose keys and values live in host memory, behind the store protocol of
`clusterkv_jax.store`.

The full K/V stay in host memory (memory kind `pinned_host`, via `jax.device_put` with memory-kind shardings;
where a backend lacks it we fall back and warn once). For a group of selecting layers the device keeps

- a ring of the last W tokens written (slot = position % W): the policy's unindexed window, read every step
  and clustered from when it is due, without a host round trip;
- a recall cache (`RecallCache`): device slots holding the chunks (rows, ClusterKV's blocks, Quest's pages)
  selected in the last R = `recall_steps` steps, looked up by their first row, kept by KV head (its selection
  heads' slots side by side) so a KV head's misses are fetched together.

Each decode step of such a layer: the new token's K/V go to the ring, and to the host store unless the policy's
window is the ring itself (ClusterKV: `ring_rows`, the window's tokens reach the host when they are clustered,
as whole blocks); the policy selects on the device; `read` finds the selected chunks in the recall cache, fetches only the missing ones from
the host into free slots (their first rows move to the host, the host gathers the chunks inside the same jit
via `compute_on`, they move back; the misses of a KV head's selection heads packed together, `fetch_size(G·c)`
chunks a round, as many rounds as the most missing KV head needs, none when everything hits), and attention
reads the slots. The hits never move. Results equal the on-device path exactly. A group of full layers
(`FullKV(offload=True)`) has neither buffer: each step streams the whole layer to the device.

Rows are written into host memory without a host computation that returns the store (`_write_rows`): on a GPU
and a TPU such a computation's result is converted in device memory, which would stage the whole store there.

Device bytes of an offloaded selecting group depend on (budget, R, W), not on the context length.
Shapes: n layers, B batch, K KV heads, h selection heads (N or K), G = h // K, c chunks of `chunk` rows, W window,
H head dim.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import compute_on as _compute_on

from clusterkv_jax import axes, kernels
from clusterkv_jax.ops import gather_rows, per_kv_head, row_index, scatter_entries, scatter_rows
from clusterkv_jax.selection import Selection
from clusterkv_jax.store import KV_AXES, KVStore, LayerView


@functools.lru_cache(maxsize=None)
def host_memory_kind() -> str | None:
    """The host memory kind of the default device: pinned_host, else unpinned_host, else None (then the
    'host' store stays in device memory, which is correct but saves nothing; we say so once)."""
    kinds = {m.kind for m in jax.local_devices()[0].addressable_memories()}
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            if kind != "pinned_host":
                warnings.warn(f"{jax.local_devices()[0].platform} has no pinned_host memory; offloading to {kind}")
            return kind
    warnings.warn(f"{jax.local_devices()[0].platform} has no host memory kind; offloaded KV stays in device memory")
    return None


def _sharding(kind: str | None):
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0], memory_kind=kind or "device")


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


#: jax 0.11 made `compute_on` a function transformation, `compute_on(f, *, compute_type, out_memory_spaces)` (jax
#: 0.10's `compute_on2`); jax 0.10's `compute_on(compute_type)` is a context manager whose results stay in host
#: memory, as `out_memory_spaces=Host` says.
_HOST_COMPUTE = (_compute_on.compute_on if "out_memory_spaces" in inspect.signature(_compute_on.compute_on).parameters
                 else None)


def _on_host(fn, *args):
    """Runs fn on the host when a host memory kind exists (its operands already moved there); its results stay in
    host memory."""
    if host_memory_kind() is None:
        return fn(*args)
    if _HOST_COMPUTE is not None:
        return _HOST_COMPUTE(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(*args)
    with _compute_on.compute_on("device_host"):
        return fn(*args)


def _write_rows(store, layer, rows, values):
    """store [n, B, K, R, H] in host memory with values [B, K, m, H] written at rows [B, K, m] of layer `layer`
    (out of range: dropped). On the CPU, and under a multi-device mesh, a host computation scatters them. On a
    GPU and a TPU a host computation that returns the store comes back in the host's layout, and XLA converts it in
    device memory, staging the whole store there (docs/research_log.md, "Offloaded decode's device memory"); so there the
    rows move by dynamic-update-slices into host memory, which XLA turns into DMAs: one per row on a GPU, and on a
    TPU, which moves whole tiles only and slices one dim, one per (sequence, KV head) of whole [R, H] planes read,
    updated on the device and written back. Either loop runs once per row (plane) that is written, so a write with
    every row out of range moves nothing."""
    def on_host(store, layer, rows, values):
        index = to_host(row_index(rows, layer))
        return _on_host(lambda s, i, x: scatter_rows(s, i, x), store, index, to_host(values.astype(store.dtype)))

    if host_memory_kind() is None or kernels.on_a_mesh():
        return on_host(store, layer, rows, values)
    return kernels.by_platform(store, layer, rows, values, cpu=on_host, tpu=_rewrite_planes, default=_update_rows)


def _update_rows(store, layer, rows, values):
    """`_write_rows` as one dynamic-update-slice into host memory per row in range."""
    n, B, K, R, H = store.shape
    flat, values = rows.reshape(-1), values.reshape(-1, H).astype(store.dtype)  # entry e = (b * K + k) * m + i
    m = rows.shape[-1]
    order, count = _in_range_first((flat >= 0) & (flat < R))

    def write(j, store):
        e = order[j]
        at = (jnp.asarray(layer, jnp.int32), e // (K * m), e // m % K, flat[e], jnp.int32(0))
        return jax.lax.dynamic_update_slice(store, to_host(values[e][None, None, None, None]), at)

    return jax.lax.fori_loop(0, count, write, store)


def _rewrite_planes(store, layer, rows, values):
    """`_write_rows` as whole [R, H] planes of the (sequence, KV head) pairs with a row in range: each read into
    device memory, updated there, and written back (the store seen as [n·B·K, R, H]: one sliced dim)."""
    n, B, K, R, H = store.shape
    planes = store.reshape(n * B * K, R, H)
    rows, values = rows.reshape(B * K, -1), values.reshape(B * K, -1, H).astype(store.dtype)
    order, count = _in_range_first(jnp.any((rows >= 0) & (rows < R), axis=-1))

    def rewrite(j, planes):
        e = order[j]
        at = (jnp.asarray(layer, jnp.int32) * B * K + e, jnp.int32(0), jnp.int32(0))
        # The barrier keeps XLA from folding the read, update and write into one update of a row: XLA:TPU moves
        # whole tiles sliced in one dim only.
        plane = jax.lax.optimization_barrier(to_device(jax.lax.dynamic_slice(planes, at, (1, R, H)))[0])
        plane = plane.at[rows[e]].set(values[e], mode="drop")
        return jax.lax.dynamic_update_slice(planes, to_host(plane[None]), at)

    return jax.lax.fori_loop(0, count, rewrite, planes).reshape(store.shape)


def _in_range_first(valid):
    """(entries [E] with the valid ones first, how many are valid) for a loop over the valid entries of valid [E]."""
    return jnp.argsort(~valid, stable=True).astype(jnp.int32), jnp.sum(valid, dtype=jnp.int32)


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
    """Device slots for chunks read from the host, per layer of the group and selection head: R·c slots of one
    chunk each (c chunks a selection, R = `recall_steps`), each holding the chunk that starts at its id.

    A chunk selected in one of the last R steps is still in its slot (a hit); a chunk that misses is fetched from
    the host into a slot no chunk of this step uses, the least recently used first, so only misses move and the
    hits stay where they are. Chunks never change once a policy can select them (ClusterKV's blocks are written
    once, when their cluster is laid out; Quest selects only whole pages), so a slot's copy stays exact."""

    ids: jax.Array = axes.field("layers", "batch", "heads", "slots")  # [n, B, h, S] int32 first row of the chunk
    #                                                                  in each slot (-1: empty); S = R·c slots
    last_used: jax.Array = axes.field("layers", "batch", "heads", "slots")  # [n, B, h, S] int32 the step that last
    #                                                                        selected the slot's chunk
    # Slot s of selection head h = k·G + g at [k, g·S + s]: a KV head's selection heads side by side, the same
    # memory as [n, B, h, S, ...] (a layer's slots read as [B, h, S·chunk, H] by a reshape), so the fetch writes a
    # KV head's packed misses with one scatter per round (stored this way, not reshaped per step: a reshape of
    # the carried slots inside the fetch loop made XLA:CPU copy them whole).
    k: jax.Array = axes.field("layers", "batch", "kv_heads", "slots", "chunk")  # [n, B, K, G·S, chunk * H]
    v: jax.Array = axes.field("layers", "batch", "kv_heads", "slots", "chunk")  # [n, B, K, G·S, chunk * H]
    step: jax.Array = axes.field("layers")  # [n] int32 decode steps seen
    hits: jax.Array = axes.field("layers")  # [n] float32 selected rows served from the cache, summed over steps
    selected: jax.Array = axes.field("layers")  # [n] float32 selected rows, summed over steps
    fetched: jax.Array = axes.field("layers")  # [n] float32 rows moved host -> device, summed
    steps: int = flax.struct.field(pytree_node=False, default=0)  # R

    @classmethod
    def create(cls, layers: int, selection_shape: tuple[int, int, int, int], steps: int, head_dim: int, dtype,
               kv_heads: int):
        """selection_shape: (B, h, c chunks, chunk rows) of the policy's selection; h a multiple of kv_heads."""
        B, h, c, chunk = selection_shape
        if h % kv_heads:
            raise ValueError(f"{h} selection heads do not group into {kv_heads} KV heads")
        slots = (layers, B, h, steps * c)
        rows = (layers, B, kv_heads, h // kv_heads * steps * c, chunk * head_dim)
        zeros = lambda: jnp.zeros((layers,), jnp.float32)  # a buffer each: the cache is donated
        return cls(ids=jnp.full(slots, -1, jnp.int32), last_used=jnp.full(slots, -1, jnp.int32),
                   k=jnp.zeros(rows, dtype), v=jnp.zeros(rows, dtype),
                   step=jnp.zeros((layers,), jnp.int32), hits=zeros(), selected=zeros(), fetched=zeros(),
                   steps=steps)

    def place(self, layer, starts, chunks, chunk: int, blocks: int = 0):
        """Where this step's chunks go, for one layer: starts [B, h, c] first rows of chunks of `chunk` rows,
        chunks [B, h, c] whether a chunk holds a selected row; blocks: the store's rows in chunks when every start
        is a multiple of `chunk` (`Selection.aligned`), else 0. Returns (slot [B, h, c] of each chunk (S for
        none), hit [B, h, c], miss [B, h, c], miss_number [B, h, c]: a miss's number among the head's misses in
        selection order, from 0).

        A chunk hits when a slot holds it and selected it in the last R steps; the k-th miss (in selection order)
        takes the k-th free slot (no hit of this step in it), least recently used first (R = 1: in slot order, as
        every free slot is then outside the last step). Small scatters and running counts (a product with a
        triangular matrix): on a CPU several times cheaper than sorts or argmaxes of these small arrays, and
        cheaper than [c, S] comparison matrices (docs/research_log.md)."""
        at = lambda x: jax.lax.dynamic_index_in_dim(x, layer, keepdims=False)  # noqa: E731
        ids, last_used, now = at(self.ids), at(self.last_used), at(self.step)
        S = ids.shape[-1]
        slots = jnp.arange(S, dtype=jnp.int32)
        recent = (last_used >= now - self.steps) & (ids >= 0)  # [B, h, S] slots a chunk may hit

        def listed(size, fill, where, values):  # [B, h, size]: each head's values at its entries `where` (else fill)
            put = lambda w, x: jnp.full((size,), fill, x.dtype).at[w].set(x, mode="drop")  # noqa: E731
            return jax.vmap(jax.vmap(put))(where, jnp.broadcast_to(values, where.shape))

        if blocks:
            # Aligned: a table of the slot holding each block (S: none), looked up by each chunk's block. A block
            # sits in at most one recent slot (it hits there while recent, so it is never fetched twice).
            held = jnp.where(recent, ids // chunk, blocks)
            table = listed(blocks, S, held, slots)
            looked_up = jnp.take_along_axis(table, jnp.clip(starts // chunk, 0, blocks - 1), axis=-1)
            hit_slot = jnp.where(chunks, looked_up, S)
        else:  # a chunk may start at any row: compare every chunk with every slot, [B, h, c, S]
            same = (starts[..., :, None] == ids[..., None, :]) & recent[..., None, :] & chunks[..., None]
            hit_slot = jnp.min(jnp.where(same, slots, S), axis=-1)
        hit = hit_slot < S
        taken = listed(S, False, hit_slot, True)  # [B, h, S]
        if self.steps == 1:
            rank = running_count(~taken) - 1  # free slot s is free number rank[s]
        else:  # ordered by (last use, slot)
            key = jnp.where(taken, jnp.iinfo(jnp.int32).max, last_used)
            before = (key[..., None, :] < key[..., :, None]) | ((key[..., None, :] == key[..., :, None])
                                                                 & (slots[None, :] < slots[:, None]))
            rank = jnp.sum(before, axis=-1, dtype=jnp.int32)
        rank = jnp.where(taken, S, rank)
        miss = chunks & ~hit
        miss_number = running_count(miss) - 1
        # The free slot whose rank is the miss's number among the misses: the free slots listed in rank order.
        free = listed(S, S, rank, slots)
        miss_slot = jnp.take_along_axis(free, jnp.clip(miss_number, 0, S - 1), axis=-1)
        return jnp.where(hit, hit_slot, jnp.where(miss, miss_slot, S)).astype(jnp.int32), hit, miss, miss_number


def running_count(x: jax.Array) -> jax.Array:
    """Inclusive running count of the True entries of bool x [..., m] along the last axis, int32: as a product with
    a triangular matrix (XLA:CPU's cumsum is a reduce-window several times slower at these sizes; exact to 2^24)."""
    m = x.shape[-1]
    upper = jnp.arange(m)[:, None] <= jnp.arange(m)[None, :]
    return jnp.einsum("...i,ij->...j", x.astype(jnp.float32), upper.astype(jnp.float32)).astype(jnp.int32)


@flax.struct.dataclass
class HostKV(KVStore):
    """Keys and values of a group of layers in host memory (see the module docstring)."""

    k: jax.Array = axes.field(*KV_AXES, host=True)  # [n, B, K, R, H] memory kind pinned_host
    v: jax.Array = axes.field(*KV_AXES, host=True)
    # Device: the last W tokens written, slot = row % W ([n, B, K, W, H]).
    ring_k: jax.Array | None = axes.field("layers", "batch", "kv_heads", "window", "head_dim", default=None)
    ring_v: jax.Array | None = axes.field("layers", "batch", "kv_heads", "window", "head_dim", default=None)
    recall: RecallCache | None = None  # device: chunks selected in the last R steps
    #: Rows [0, W) are the ring's (a policy whose window is a ring, `RowLayout.ring_window`): a token written there
    #: stays in the device ring only, until `commit_window` moves it to its row in host memory.
    ring_rows: bool = flax.struct.field(pytree_node=False, default=False)

    on_host = True

    @classmethod
    def create(cls, layers: int, batch: int, kv_heads: int, rows: int, head_dim: int, dtype, *, window: int = 0,
               selection_shape: tuple[int, int, int, int] | None = None, recall_steps: int = 0,
               ring_rows: bool = False):
        """window > 0 keeps a device ring of that many recent tokens (`ring_rows`: rows [0, window) live there only);
        selection_shape (B, h, c, chunk) adds the recall cache of `recall_steps` steps (a group of selecting layers);
        without it the group streams whole layers."""
        shape = (layers, batch, kv_heads, rows, head_dim)
        store = cls(k=host_zeros(shape, dtype), v=host_zeros(shape, dtype), ring_rows=bool(ring_rows and window))
        if window:
            ring = (layers, batch, kv_heads, window, head_dim)
            store = store.replace(ring_k=jnp.zeros(ring, dtype), ring_v=jnp.zeros(ring, dtype))
        if selection_shape is not None:
            store = store.replace(recall=RecallCache.create(layers, selection_shape, recall_steps, head_dim, dtype,
                                                            kv_heads))
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
        """Host rows at index [B, K, m, 2] (from row_index; one layer) <- k, v [B, K, m, H] (out of range:
        dropped)."""
        layer, rows = index[0, 0, 0, 0], index[..., 1]
        return self.replace(k=_write_rows(self.k, layer, rows, k), v=_write_rows(self.v, layer, rows, v))

    def write_token(self, layer, rows, k, v) -> "HostKV":
        B, K = k.shape[:2]
        store = self
        if not self.ring_rows:
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

    def nbytes(self) -> dict[str, int]:
        out = super().nbytes()
        if host_memory_kind() is None:  # the fallback keeps the "host" arrays in device memory
            return {"device": out["device"] + out["host"], "host": 0}
        return out


def fetch_size(c: int) -> int:
    """Chunks a KV head fetches from the host per round, of the c its selection heads select together: a quarter
    (at R = 1 about one chunk in five misses), so most steps move one round and a first step, all misses, four.
    Packed by KV head because the most missing head sets the number of rounds for all: packing a KV head's
    selection heads together takes fewer rounds and moves fewer chunks than rounds per selection head
    (docs/research_log.md, "Host offload")."""
    return max(1, -(-c // 4))


def pack_misses(starts, slot, miss, miss_number, kv_heads: int, slots: int, n: int):
    """A layer-step's misses packed by KV head, for fetch rounds of n chunks: starts, slot [B, h, c] (S = `slots`:
    in no slot), miss [B, h, c], miss_number [B, h, c] (a miss's number among its selection head's misses, from
    `RecallCache.place`). Returns kv_slot [B, K, G·c] (each chunk's row in its KV head's G·S cache rows; G·S: none),
    miss_starts and miss_slots [B, K, P] (a KV head's i-th miss, in (selection head, selection) order, at entry i;
    past the last miss start 0 and slot G·S, whose write is dropped; P = G·c rounded up to rounds of n) and
    kv_misses [B, K] (misses per KV head).

    One scatter: the misses' numbers within a KV head are distinct (on XLA:CPU cheaper than a [G·c, P]
    comparison matrix; docs/research_log.md)."""
    B, h, c = starts.shape
    K, S = kv_heads, slots
    G = h // K
    head_rows = (jnp.arange(h, dtype=jnp.int32) % G)[:, None] * S  # where a selection head's slots start
    kv_slot = per_kv_head(jnp.where(slot < S, slot + head_rows, G * S), K)
    head_misses = jnp.sum(miss, axis=-1, dtype=jnp.int32).reshape(B, K, G)
    earlier = (jnp.cumsum(head_misses, axis=-1) - head_misses).reshape(B, h, 1)  # misses of earlier heads
    P = -(-G * c // n) * n
    entry = jnp.where(per_kv_head(miss, K), per_kv_head(miss_number + earlier, K), P)  # [B, K, G·c] (P: dropped)
    empty = jnp.broadcast_to(jnp.array([0, G * S], jnp.int32), (P, 2))
    pack = lambda e, x: empty.at[e].set(x, mode="drop")  # noqa: E731
    both = jnp.stack([per_kv_head(starts, K), kv_slot], axis=-1).astype(jnp.int32)  # [B, K, G·c, 2]
    packed = jax.vmap(jax.vmap(pack))(entry, both)
    return kv_slot, packed[..., 0], packed[..., 1], jnp.sum(head_misses, axis=-1)


class HostLayer(LayerView):
    """One layer of a HostKV."""

    read_only = False  # `read` fills and counts the recall cache

    def _stream(self, store):
        """The whole layer, sliced on the host and moved to the device: [B, K, R, H]."""
        at = to_host(self.index)
        return to_device(_on_host(lambda s, i: jax.lax.dynamic_index_in_dim(s, i, keepdims=False), store, at))

    def keys(self):
        return self._stream(self.store.k)

    def values(self):
        return self._stream(self.store.v)

    def read_all(self, rows: int):
        if not self.store.ring_rows:
            return super().read_all(rows)
        # Rows [0, W) are the ring's: their tokens are in the device ring, not yet in host memory.
        at = lambda ring: jax.lax.dynamic_index_in_dim(ring, self.index, keepdims=False)  # noqa: E731
        W = self.store.ring_k.shape[3]
        return tuple(x[:, :, :rows].at[:, :, :W].set(at(ring)) if rows > W else at(ring)[:, :, :rows]
                     for x, ring in ((self.keys(), self.store.ring_k), (self.values(), self.store.ring_v)))

    def key_blocks(self, starts, chunk):
        # The blocks a policy scores lie past the device ring's rows (a ClusterKV window is never a candidate).
        B, K, n = starts.shape
        safe = jnp.clip(starts, 0, self.store.capacity - chunk)
        index = to_host(row_index(safe, self.index))
        keys = _on_host(lambda store: gather_rows(store, index, mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
                                                  chunk=chunk, aligned=True), self.store.k)
        return to_device(keys)

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
        """The selected chunks [B, h, c * chunk, H]: through the recall cache (`RecallCache`: hits stay in their
        device slots, misses are fetched from the host into free slots, a KV head's packed together,
        `fetch_size(G·c)` chunks a round), then read from the slots; without a cache (R = 0), every chunk straight
        from the host."""
        rc, at = self.store.recall, self.index
        starts, chunks = selection.starts, jnp.any(selection.mask, axis=-1)  # [B, h, c]: chunks holding a token
        B, h, c = starts.shape
        chunk, H = selection.chunk, self.store.k.shape[4]
        count = lambda a, x: a.at[at].add(x)  # noqa: E731
        selected = jnp.sum(selection.mask)
        if rc.steps == 0:
            k, v = (x.reshape(B, h, c * chunk, H) for x in self.host_gather(starts, chunk, selection.aligned))
            rc = rc.replace(step=count(rc.step, 1), selected=count(rc.selected, selected),
                            fetched=count(rc.fetched, float(B * h * c * chunk)))
            return k, v, selection.flat_mask(), HostLayer(self.store.replace(recall=rc), at, self.positions)

        blocks = -(-self.store.capacity // chunk) if selection.aligned else 0
        slot, hit, miss, miss_number = rc.place(at, starts, chunks, chunk, blocks)
        S, K = rc.ids.shape[-1], rc.k.shape[2]
        n = fetch_size(h // K * c)
        kv_slot, miss_starts, miss_slots, kv_misses = pack_misses(starts, slot, miss, miss_number, K, S, n)

        def fetch_round(r, kv):  # round r: misses [r * n, (r + 1) * n) of every KV head, host -> their slots
            k_slots, v_slots = kv
            round_of = lambda x: jax.lax.dynamic_slice_in_dim(x, r * n, n, axis=-1)  # noqa: E731
            k, v = self.host_gather(round_of(miss_starts), chunk, selection.aligned)  # [B, K, n, chunk, H]
            where = row_index(round_of(miss_slots), at)
            return (scatter_rows(k_slots, where, k.reshape(B, K, n, chunk * H)),
                    scatter_rows(v_slots, where, v.reshape(B, K, n, chunk * H)))

        # As many rounds as the KV head with the most misses needs (none when everything hits); a while loop, so
        # the slots are written in place.
        needed = -(-jnp.max(kv_misses) // n)
        k_slots, v_slots = jax.lax.fori_loop(0, needed, fetch_round, (rc.k, rc.v))
        new = slot < S  # [B, h, c] chunks that now sit in a slot
        where = row_index(slot, at)
        now = jax.lax.dynamic_index_in_dim(rc.step, at)
        rc = rc.replace(
            k=k_slots, v=v_slots,
            ids=scatter_entries(rc.ids, where, jnp.where(new, starts, -1)),
            last_used=scatter_entries(rc.last_used, where, jnp.broadcast_to(now, slot.shape)),
            step=count(rc.step, 1), selected=count(rc.selected, selected),
            hits=count(rc.hits, jnp.sum(jnp.where(hit[..., None], selection.mask, False))),
            fetched=count(rc.fetched, (needed * B * K * n * chunk).astype(jnp.float32)),
        )
        view = HostLayer(self.store.replace(recall=rc), at, self.positions)
        layer_of = lambda x: jax.lax.dynamic_index_in_dim(x, at, keepdims=False)  # noqa: E731
        if rc.steps == 1:
            # The slots hold exactly this step's chunks (c slots): read them whole, in slot order, one contiguous
            # slice each instead of a gather, with the selection's row mask moved to the slots.
            to_slots = lambda m, i: jnp.zeros_like(m).at[i].set(m, mode="drop")  # noqa: E731
            mask = jax.vmap(jax.vmap(to_slots))(selection.mask, slot)  # [B, h, S, chunk]
            k, v = (layer_of(x).reshape(B, h, S * chunk, H) for x in (k_slots, v_slots))
            return k, v, mask.reshape(B, h, S * chunk), view
        # R > 1: the selected slots, in selection order (an unselected chunk reads a clamped slot: masked).
        kv_where = row_index(kv_slot, at)
        k, v = (gather_rows(x, kv_where).reshape(B, h, c * chunk, H) for x in (k_slots, v_slots))
        return k, v, selection.flat_mask(), view


def hit_rates(cache) -> list[float | None]:
    """Per model layer: the fraction of selected rows served from the device recall cache (None for layers
    that select nothing or keep their KV on the device)."""
    rates: list[float | None] = [None] * sum(g.num_layers for g in cache.groups)
    for group in cache.groups:
        recall = getattr(group.store, "recall", None)
        if recall is None:
            continue
        hits, selected = jax.device_get((recall.hits, recall.selected))
        for layer, h, s in zip(group.layers, hits, selected):
            rates[layer] = float(h / s) if s else None
    return rates
