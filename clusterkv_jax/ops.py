"""Small array ops written so that XLA's SPMD partitioner keeps sharded leading dims local.

Everything here treats the leading (batch, head) dims of its operands as independent problems: row gathers and
scatters use them as batching dims, `map_leading` vmaps over them, and `per_shard` runs a function (a Pallas
kernel, which the partitioner cannot split) on each device's shard of them under `shard_map`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.dispatch import map_leading  # noqa: F401  (re-exported: vmap over batch and heads)


@dataclasses.dataclass(frozen=True)
class ShardAxes:
    """The mesh a program is traced for, and the mesh axis (or None: replicated) of its batch and head dims."""

    mesh: object  # jax.sharding.Mesh or AbstractMesh
    batch: str | None
    heads: str | None


_SHARD_AXES: contextvars.ContextVar[ShardAxes | None] = contextvars.ContextVar("shard_axes", default=None)


@contextlib.contextmanager
def sharded_trace(axes: ShardAxes | None):
    """While tracing under `axes` (set by `clusterkv_jax.steps.in_mesh_scope` from its sharding rules), mesh-aware
    ops pick their per-shard forms. With None, nothing changes."""
    if axes is None:
        yield
        return
    token = _SHARD_AXES.set(axes)
    try:
        with jax.sharding.use_abstract_mesh(axes.mesh.abstract_mesh if hasattr(axes.mesh, "abstract_mesh")
                                            else axes.mesh):
            yield
    finally:
        _SHARD_AXES.reset(token)


def multi_device_axes() -> ShardAxes | None:
    """The mesh axes of B and heads while tracing under a multi-device mesh (`shard_axes`), else None."""
    axes = _SHARD_AXES.get()
    if axes is None or axes.mesh.size == 1:
        return None
    return axes


def per_shard(fn, *args):
    """fn(*args) where every operand and result has leading dims [B, heads, ...]: under a multi-device mesh,
    run once per device on its shard of B and heads (`shard_map`), so a Pallas kernel stays a local custom call
    instead of being gathered onto every device; otherwise fn(*args)."""
    axes = multi_device_axes()
    if axes is None:
        return fn(*args)
    spec = P(axes.batch, axes.heads)
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=spec, out_specs=spec,
                         check_vma=False)(*args)


def top_k_indices(x: jax.Array, k: int) -> jax.Array:
    """Indices of the k largest entries along the last axis, largest first, ties to the lower index.

    `jax.lax.top_k`, except while tracing under a multi-device mesh: there the partitioner would gather a
    top_k's whole operand when its leading (batch / head) dims are sharded, so a stable sort, which picks the
    same indices and stays per shard, runs instead. Without a mesh top_k is kept: on CPU it is much faster than
    the full sort (docs/research_log.md).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return jax.lax.top_k(x, k)[1].astype(jnp.int32)
    return jnp.argsort(-x, axis=-1, stable=True)[..., :k].astype(jnp.int32)


#: Bisection steps of `top_mask`: the threshold's interval shrinks to 2^-16 of the scores' range.
TOP_MASK_STEPS = 16


def top_mask(x: jax.Array, k: int, steps: int = TOP_MASK_STEPS) -> jax.Array:
    """A mask of about the k largest finite entries along the last axis: those at or above a threshold found by
    bisection between the row's smallest and largest finite entry (`steps` halvings), the lowest threshold seen
    with at least k entries at or above it. All finite entries where a row has at most k; otherwise at least k,
    the ones past k within 2^-steps of the range below the k-th largest (a caller packing them into k slots drops
    those). A few passes of compare-and-count: on XLA:CPU a top_k of half a row costs several times more, and a
    mask needs no order (docs/research_log.md)."""
    finite = jnp.isfinite(x)
    lo = jnp.min(jnp.where(finite, x, jnp.inf), axis=-1, keepdims=True)
    hi = jnp.max(jnp.where(finite, x, -jnp.inf), axis=-1, keepdims=True)

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) / 2
        enough = jnp.sum(x >= mid, axis=-1, keepdims=True) >= k
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    lo, _ = jax.lax.fori_loop(0, steps, halve, (lo, hi))
    return finite & (x >= lo)


# --------------------------------------------------------------------------------------------------------
# Rows of a KV store: [L, B, K, S, H] (addressed by layer and position) or [B, K, S, H] (by position), with
# B and K as gather / scatter batching dims. Nothing is reshaped across B or K, so under a mesh (B on "data",
# K on "model") every shard reads and writes its own rows without a collective.
# --------------------------------------------------------------------------------------------------------

#: Reads clamp an out-of-range position into [0, S) (the row is masked by the caller anyway).
READ_MODE = jax.lax.GatherScatterMode.CLIP
#: Writes drop a row whose position is out of range (a full cache stores nothing more).
WRITE_MODE = jax.lax.GatherScatterMode.FILL_OR_DROP


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


def gather_rows(store: jax.Array, index: jax.Array, mode=READ_MODE, chunk: int = 1,
                aligned: bool = False, by_row: bool = False) -> jax.Array:
    """store [L, B, K, S, H] or [B, K, S, H], index [B, K, n, .] from `row_index` -> rows [B, K, n, H]; with
    `chunk` > 1 each index is the first of `chunk` consecutive rows: -> [B, K, n, chunk, H] (one contiguous slice
    per index, so XLA copies chunks instead of computing an address per row).

    `aligned`: every first row is a multiple of `chunk`; where `chunk` also divides S the store is read as blocks,
    [..., S / chunk, chunk * H], one row of chunk * H per index: XLA:CPU's gather then copies faster
    (docs/research_log.md).

    `by_row`: each chunk read as `chunk` rows of one index each (`kernels.chunks_read_row_by_row`)."""
    if by_row and chunk > 1:
        starts = index[..., -1]  # [B, K, n]
        rows = (starts[..., None] + jnp.arange(chunk, dtype=starts.dtype)).reshape(*starts.shape[:2], -1)
        lead = jnp.repeat(index[..., :-1], chunk, axis=2)  # the layer, where the store has one: [B, K, n*chunk, .]
        out = gather_rows(store, jnp.concatenate([lead, rows[..., None]], axis=-1), mode)
        return out.reshape(*starts.shape, chunk, store.shape[-1])
    if aligned and chunk > 1 and store.shape[-2] % chunk == 0:
        *lead, S, H = store.shape
        blocks = store.reshape(*lead, S // chunk, chunk * H)
        block_index = jnp.concatenate([index[..., :-1], index[..., -1:] // chunk], axis=-1)
        rows = gather_rows(blocks, block_index, mode)  # [B, K, n, chunk * H]
        return rows.reshape(*rows.shape[:-1], chunk, H)
    d = _row_dims(store.ndim)
    if chunk == 1:
        dims = jax.lax.GatherDimensionNumbers(offset_dims=(3,), collapsed_slice_dims=d["collapsed"],
                                              start_index_map=d["index_map"], operand_batching_dims=d["batching"],
                                              start_indices_batching_dims=(0, 1))
        return jax.lax.gather(store, index, dims, slice_sizes=(1,) * (store.ndim - 1) + (store.shape[-1],),
                              mode=mode)
    layer = (0,) if store.ndim == 5 else ()
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(3, 4), collapsed_slice_dims=layer,
                                          start_index_map=d["index_map"], operand_batching_dims=d["batching"],
                                          start_indices_batching_dims=(0, 1))
    sizes = (1,) * (store.ndim - 2) + (chunk, store.shape[-1])
    return jax.lax.gather(store, index, dims, slice_sizes=sizes, mode=mode)


def scatter_rows(store: jax.Array, index: jax.Array, rows: jax.Array, mode=WRITE_MODE) -> jax.Array:
    """Writes rows [B, K, n, H] at index [B, K, n, .] (from `row_index`) into store; returns the store."""
    d = _row_dims(store.ndim)
    dims = jax.lax.ScatterDimensionNumbers(update_window_dims=(3,), inserted_window_dims=d["collapsed"],
                                           scatter_dims_to_operand_dims=d["index_map"],
                                           operand_batching_dims=d["batching"], scatter_indices_batching_dims=(0, 1))
    return jax.lax.scatter(store, index, rows.astype(store.dtype), dims, mode=mode)


def scatter_entries(table: jax.Array, index: jax.Array, values: jax.Array, mode=WRITE_MODE) -> jax.Array:
    """Writes values [B, K, n] at index [B, K, n, 2] (from `row_index` with a layer) into table [L, B, K, S]; returns
    the table. `scatter_rows` for a store without its row axis H (not `scatter_rows` of table[..., None]: that
    reshape made XLA:CPU copy the whole table)."""
    d = _row_dims(table.ndim + 1)  # addressed as an [L, B, K, S, H] store
    dims = jax.lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=d["collapsed"],
                                           scatter_dims_to_operand_dims=d["index_map"],
                                           operand_batching_dims=d["batching"], scatter_indices_batching_dims=(0, 1))
    return jax.lax.scatter(table, index, values.astype(table.dtype), dims, mode=mode)


def per_kv_head(idx: jax.Array, num_kv_heads: int) -> jax.Array:
    """A selection idx [B, h, M] (h = query heads, or KV heads) as [B, K, (h // K) * M]: each KV head's rows for
    all of its selection heads, so one gather per KV head reads them."""
    B, h, M = idx.shape
    return idx.reshape(B, num_kv_heads, (h // num_kv_heads) * M)
