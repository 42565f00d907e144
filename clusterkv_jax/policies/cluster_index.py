"""What ClusterKV keeps for one layer (`ClusterIndex`): its clusters (centroids, sizes, where each one's
members start in the store) and the layout of its store's rows; built from the prompt's keys at prefill
(`index_prompt`) and extended by each window of generated tokens (`cluster_window`, then `add_window` where due).
How ClusterKV ranks and reads the clusters is `clusterkv_jax.policies.cluster_select`'s; the row arithmetic of
the layout is `clusterkv_jax.policies.cluster_blocks`'.

Shapes: B batch, K KV heads, C cluster slots, R store rows, H head dim, W = decode_interval, bs = block_size.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from clusterkv_jax import axes, kernels
from clusterkv_jax.kmeans import cosine_kmeans, problem_keys
from clusterkv_jax.policies.common import put_at_slot
from pallas_kernels import centroid_update_reference


def _segment_means(x: jax.Array, segments: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """Mean of x [..., m, H] (float32) per segment [..., m] (outside [0, n): none) -> [..., n, H] (0 for an empty
    segment) and the counts [..., n]."""
    sums, counts = centroid_update_reference(x.astype(jnp.float32), segments, n)
    return sums / jnp.maximum(counts, 1)[..., None].astype(jnp.float32), counts


def member_variances(keys: jax.Array, labels: jax.Array, centroids: jax.Array, sizes: jax.Array) -> jax.Array:
    """Per-channel variance of each cluster's member keys: keys [..., n, H], labels [..., n] (>= C: no cluster),
    centroids [..., C, H] (the members' mean), sizes [..., C] -> [..., C, H] float32 (0 for an empty cluster)."""
    x = keys.astype(jnp.float32)
    mean_square, _ = _segment_means(x * x, labels, centroids.shape[-2])
    return jnp.where(sizes[..., None] > 0, jnp.maximum(mean_square - centroids * centroids, 0.0), 0.0)


@flax.struct.dataclass
class ClusterIndex:
    """One layer's clusters and the layout of its store."""

    # [B, K, C, H] float32 mean of member keys
    centroids: jax.Array = axes.field("batch", "kv_heads", "clusters", "head_dim")
    sizes: jax.Array = axes.field("batch", "kv_heads", "clusters")  # [B, K, C] int32 members (0: unused slot)
    # [B, K, C] int32 the cluster's first block (rows block_start * bs ...)
    block_start: jax.Array = axes.field("batch", "kv_heads", "clusters")
    # [B, K, R] int32 the position each store row holds (-1: empty)
    row_positions: jax.Array = axes.field("batch", "kv_heads", "rows")
    next_block: jax.Array = axes.field("batch", "kv_heads")  # [B, K] int32 first block not used yet
    # [B, K, W] int32 rows the last clustered window moved to (by offset in the window)
    recent_rows: jax.Array = axes.field("batch", "kv_heads", "window")
    # [B] int32 positions < this are sinks or clustered; the rest are the window
    clustered_upto: jax.Array = axes.field("batch")
    num_prompt_clusters: jax.Array = axes.field("batch")  # [B] int32 C0 of each sequence (decode-time clusters follow)
    # [B, K, C, H] float32 per-channel variance of member keys ([B, K, 0, H]: score "dot")
    variances: jax.Array = axes.field("batch", "kv_heads", "clusters", "head_dim")
    # [B, K, R // bs, H] float32 mean key of each store block's rows ([B, K, 0, H]: no refine)
    block_means: jax.Array = axes.field("batch", "kv_heads", "blocks", "head_dim")


def _block_means(block_means, keys, rows, block_size: int):
    """block_means [B, K, nb, H] with the blocks holding `rows` [B, K, n] (-1: none) set to the mean of their
    rows' keys [B, K, n, H] (the other blocks kept)."""
    nb = block_means.shape[-2]
    means, counts = _segment_means(keys, jnp.where(rows >= 0, rows // block_size, nb), nb)
    return jnp.where(counts[..., None] > 0, means, block_means)


def empty_index(policy, config, batch_size: int, capacity: int) -> "ClusterIndex":
    """One layer's index before prefill: no clusters, every store row empty."""
    B, K, H = batch_size, config.num_kv_heads, config.head_dim
    C, R = policy.layout.cluster_slots(capacity), policy.layout.store_rows(capacity)
    zi = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    return ClusterIndex(
        centroids=jnp.zeros((B, K, C, H), jnp.float32),
        sizes=zi(B, K, C),
        block_start=zi(B, K, C),
        row_positions=jnp.full((B, K, R), -1, jnp.int32),
        next_block=zi(B, K),
        recent_rows=jnp.full((B, K, policy.decode_interval), R, jnp.int32),
        clustered_upto=zi(B),
        num_prompt_clusters=zi(B),
        variances=jnp.zeros((B, K, C if policy.score != "dot" else 0, H), jnp.float32),
        block_means=jnp.zeros((B, K, R // policy.block_size if policy.block_refine > 1 else 0, H), jnp.float32),
    )


def index_prompt(policy, state: "ClusterIndex", keys, lengths) -> "ClusterIndex":
    """The index of a prompt: its keys [B, K, S, H] past the sinks clustered (C0 per sequence, from its length)
    and laid out in blocks after the sinks' (`ClusterBlocks.place`)."""
    B, K, S, H = keys.shape
    bs, C0 = policy.block_size, policy.prompt_cluster_slots(S)
    pos = jnp.arange(S)
    # [B, S] tokens to cluster: past the sinks, inside the prompt.
    valid = (pos[None, :] >= policy.sinks) & (pos[None, :] < lengths[:, None])
    num_clusters = jnp.clip((lengths - policy.sinks) // policy.tokens_per_cluster, 1, C0).astype(jnp.int32)
    result = cluster_keys(policy, keys, jnp.broadcast_to(valid[:, None], (B, K, S)),
                          jnp.broadcast_to(num_clusters[:, None], (B, K)), C0, salt=0)
    sizes, layout = result.sizes, policy.layout  # [B, K, C0]
    first = layout.first_block() + layout.sink_blocks()
    block_start, order, rows, used = layout.place(result.labels, sizes, first)
    variances = state.variances
    if policy.score != "dot":
        variances = variances.at[:, :, :C0].set(member_variances(keys, result.labels, result.centroids, sizes))
    block_means = state.block_means
    if policy.block_refine > 1:
        block_means = _block_means(block_means, jnp.take_along_axis(keys, order[..., None], axis=-2), rows, bs)
    return state.replace(
        variances=variances,
        block_means=block_means,
        centroids=state.centroids.at[:, :, :C0].set(result.centroids),
        sizes=state.sizes.at[:, :, :C0].set(sizes),
        block_start=state.block_start.at[:, :, :C0].set(block_start),
        row_positions=layout.prompt_positions(state.row_positions, order, rows, lengths),
        next_block=first + used,
        clustered_upto=lengths.astype(jnp.int32),
        num_prompt_clusters=num_clusters,
    )


def cluster_keys(policy, keys, valid, num_clusters, max_clusters: int, salt: int):
    """Cosine K-means of keys [B, K, n, H] (valid [B, K, n]) into num_clusters [B, K] clusters, one problem per
    (sequence, KV head), kept as [B, K] leading dims (not merged: see kmeans). The initialisation's PRNG keys
    depend on the KV head and `salt` only: a sequence clusters alike alone or in a batch."""
    B, K = keys.shape[:2]
    per_head = problem_keys(jax.random.fold_in(jax.random.PRNGKey(policy.seed), salt), K)
    with jax.named_scope("kmeans"):
        return cosine_kmeans(keys, valid, num_clusters, jnp.broadcast_to(per_head[None], (B,) + per_head.shape),
                             max_clusters=max_clusters, max_iters=policy.max_iters, init=policy.init,
                             impl=kernels.resolve(policy.kernels, "centroid_update"), tol=policy.kmeans_tol,
                             assign_impl=kernels.resolve(policy.kernels, "kmeans_assign"))


def cluster_window(policy, state: "ClusterIndex", recent_keys, due, prompt_lengths) -> dict:
    """Clusters the `decode_interval` tokens past `clustered_upto` (their keys: `recent_keys()` [B, K, W, H])
    into `decode_clusters` new clusters and lays their members out in new blocks. Returns only what that adds
    (`add_window` writes it in where due): the new clusters, where they go, and their rows."""
    recent = recent_keys()
    B, K, W, H = recent.shape
    Cp, bs = policy.decode_clusters, policy.block_size
    result = cluster_keys(policy, recent, jnp.ones((B, K, W), bool), jnp.full((B, K), Cp, jnp.int32), Cp, salt=1)
    sizes = result.sizes  # [B, K, Cp]
    block_start, order, rows, used = policy.layout.place(result.labels, sizes, state.next_block)
    added = {
        "centroids": result.centroids, "sizes": sizes, "block_start": block_start, "order": order, "rows": rows,
        "blocks": used,
        # Where the new clusters go: after the prompt's clusters and earlier decode groups.
        "slot": state.num_prompt_clusters + (state.clustered_upto - prompt_lengths) // W * Cp,  # [B]
    }
    if policy.score != "dot":
        added["variances"] = member_variances(recent, result.labels, result.centroids, sizes)
    if policy.block_refine > 1:  # the new blocks' mean keys: at most W // bs + Cp blocks from next_block on
        new_blocks = W // bs + Cp
        local = rows // bs - state.next_block[..., None]
        added["block_means"], added["block_counts"] = _segment_means(
            jnp.take_along_axis(recent, order[..., None], axis=-2),
            jnp.where((local >= 0) & (local < new_blocks), local, new_blocks), new_blocks)
    return added


def add_window(policy, state: "ClusterIndex", added: dict, due) -> "ClusterIndex":
    """The new clusters of each due sequence appended after its clusters so far, their members' rows in the
    layout (`ClusterBlocks.recent_moves` says which rows move). In place: slices of the cluster arrays and a
    scatter of W rows."""
    W = added["order"].shape[-1]
    start, slot, is_due = state.clustered_upto, added["slot"], due[:, None, None]

    def put(a, x):  # a [B, K, C, ...] with x [B, K, Cp, ...] at each due sequence's slot (the others' kept)
        return put_at_slot(a, x, slot, due)

    block_means = state.block_means
    if "block_means" in added:  # blocks next_block + j that hold a new row, where due
        n, nb = added["block_counts"].shape[-1], block_means.shape[-2]
        ids = state.next_block[..., None] + jnp.arange(n, dtype=jnp.int32)  # [B, K, n]
        ids = jnp.where((added["block_counts"] > 0) & is_due & (ids < nb), ids, nb)
        block_means = jax.vmap(jax.vmap(lambda a, i, v: a.at[i].set(v, mode="drop")))(
            block_means, ids, added["block_means"])
    return state.replace(
        variances=put(state.variances, added["variances"]) if "variances" in added else state.variances,
        block_means=block_means,
        centroids=put(state.centroids, added["centroids"]),
        sizes=put(state.sizes, added["sizes"]),
        block_start=put(state.block_start, added["block_start"]),
        **policy.layout.add_window(state, added["order"], added["rows"], added["blocks"], due),
        clustered_upto=jnp.where(due, start + W, start),
    )

