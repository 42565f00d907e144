"""ClusterKV: recallable KV selection at the granularity of semantic clusters of keys.

After prefill, per layer >= full_layers, sequence and KV head, the post-RoPE keys of tokens [sinks, L) are
clustered with cosine K-means into C0 = max(1, (L - sinks) // tokens_per_cluster) clusters; every
`decode_interval` generated tokens, those tokens alone are clustered into `decode_clusters` more, appended to the
index. Each cluster's stored centroid is the mean of its member keys. At decode, clusters are ranked by q·μ and
taken in that order until the budget is filled (the last one trimmed); the sinks are always attended; generated
tokens not clustered yet are attended in full (the window, reported outside the budget).

Layout of this policy's layers (`ClusterKV.layout`, `clusterkv_jax.policies.cluster_blocks`): the store keeps
each cluster's members in consecutive rows, in whole blocks, after a ring of rows for the window, so a selection
reads a few dozen contiguous blocks.

Shapes: B batch, N query heads, K KV heads, G = N // K, S capacity (positions), R store rows, H head dim,
C cluster slots, W = decode_interval, bs = block_size, Mb block slots, ns sink blocks.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from clusterkv_jax import axes, kernels
from clusterkv_jax.kmeans import cosine_kmeans, problem_keys
from clusterkv_jax.ops import gather_rows, row_index, top_k_indices, top_mask
from clusterkv_jax.policies.base import FULL_LAYERS_HELP, KVPolicy, option
from clusterkv_jax.policies.cluster_blocks import ClusterBlocks, exclusive_cumsum, scatter_last
from clusterkv_jax.policies.common import put_at_slot
from clusterkv_jax.selection import Selection
from pallas_kernels import centroid_update_reference

SCORES = ("dot", "density")


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


def rank_and_index(
    scores: jax.Array,  # [..., C] float32 cluster scores
    sizes: jax.Array,  # [..., C] int32
    block_start: jax.Array,  # [..., C] int32
    tokens: int,
    slots: int,
    block_size: int,
    impl: str = "reference",
    first: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Clusters in descending score order (ties to the lower index), members taken until `tokens` tokens or
    `slots` blocks (the last cluster trimmed to fit both). Returns the selected blocks [..., slots] and the rows
    selected in each [..., slots] (its first rows; 0 for an unused slot).

    The top `slots` clusters come from `lax.top_k` (no cluster beyond them can be taken: each takes a block).
    With `first`, the top `first` only, when they already fill the tokens or the slots of every problem (then
    nothing ranked below them is taken: the same result), else the top `slots` (`lax.cond`): on XLA:CPU a top_k
    costs about its k (docs/research_log.md). Not where a branch waits for the host (a GPU:
    `kernels.branches_wait_for_host`). The block indexing is `kernels.cluster_to_block_index` with implementation
    `impl`.
    """
    scores = jnp.where(sizes > 0, scores, -jnp.inf)

    def ranked(k):  # [..., k] best first
        top = top_k_indices(scores, k)
        return jnp.take_along_axis(sizes, top, axis=-1), jnp.take_along_axis(block_start, top, axis=-1)

    def index(ranked_sizes, ranked_starts):
        return kernels.cluster_to_block_index(ranked_sizes, ranked_starts, tokens=tokens, slots=slots,
                                              block_size=block_size, impl=impl)

    every = min(slots, scores.shape[-1])
    if first is None or first >= every or kernels.branches_wait_for_host():  # a GPU: no branch (a host wait)
        return index(*ranked(every))
    top_sizes, top_starts = ranked(first)
    fills = ((jnp.sum(top_sizes, axis=-1) >= tokens)
             | (jnp.sum(-(-top_sizes // block_size), axis=-1) >= slots))
    return jax.lax.cond(jnp.all(fills), lambda: index(top_sizes, top_starts), lambda: index(*ranked(every)))


def _block_means(block_means, keys, rows, block_size: int):
    """block_means [B, K, nb, H] with the blocks holding `rows` [B, K, n] (-1: none) set to the mean of their
    rows' keys [B, K, n, H] (the other blocks kept)."""
    nb = block_means.shape[-2]
    means, counts = _segment_means(keys, jnp.where(rows >= 0, rows // block_size, nb), nb)
    return jnp.where(counts[..., None] > 0, means, block_means)


@dataclasses.dataclass(frozen=True)
class ClusterKV(KVPolicy):
    """ClusterKV (see the module docstring). `gqa="per_head"` ranks clusters per query head; `"shared"` sums
    the scores over a KV head's query heads and makes one selection per KV head."""

    name = "clusterkv"
    budget: int = option(1024, "tokens attended per step from the prompt and clustered generated tokens, sinks "
                               "included", least=1)
    sinks: int = option(16, "first tokens always attended (attention sinks), never clustered", least=0)
    tokens_per_cluster: int = option(80, "prompt clusters per layer and KV head: (prompt - sinks) / this", least=1)
    decode_interval: int = option(320, "generated tokens attended in full until this many are clustered together",
                                  least=1)
    decode_clusters: int = option(4, "clusters made of each decode_interval generated tokens", least=1)
    full_layers: int = option(2, FULL_LAYERS_HELP, least=0)
    max_iters: int = option(11, "K-means iterations at most", least=1, flag="kmeans-iters")
    kmeans_tol: float = option(0.0, "K-means stops once at most this fraction of keys changed cluster (0: none "
                                    "moved)", least=0.0)
    init: str = option("random", "K-means initialisation", choices=("random", "kmeans++"))
    gqa: str = option("per_head", "per_head: a selection per query head; shared: one per KV head, by the sum "
                                  "of its query heads' scores", choices=("per_head", "shared"))
    seed: int = option(0, "seed of the K-means initialisation", least=0, flag="kmeans-seed")
    offload: bool = option(False, "keep the selecting layers' K/V in host memory")
    recall_steps: int = option(1, "offload: the device keeps the blocks selected in the last N steps", least=0)
    score: str = option("dot", "cluster ranking: dot = q·mu (the paper); density = q·mu/sqrt(H) + "
                               "sum(q^2 var)/2H, by the members' key variance", choices=SCORES)
    block_refine: int = option(1, "1: whole clusters (the paper); F: clusters up to F x the budget, then their "
                                  "best blocks by q·(block mean key)", least=1)
    token_refine: int = option(1, "1: whole clusters (the paper); F: clusters up to F x the budget, ranked for each "
                                  "KV head by the best of its query heads' scores (shared: by their sum), then each "
                                  "query head's best of their tokens by q·k", least=1)
    block_size: int = option(16, "rows per store block: the unit a selection reads", least=1)
    kernels: str = option("auto", "auto: Pallas kernels on CUDA sm80+ (Mosaic on TPU), pure JAX elsewhere; "
                                  "pallas; reference; interpret (slow, tests)", choices=kernels.MODES)

    def __post_init__(self):
        super().__post_init__()
        if self.budget < self.sinks:
            raise ValueError(f"budget={self.budget} must be >= sinks={self.sinks}")
        if self.decode_clusters > self.decode_interval:
            raise ValueError(
                f"decode_clusters={self.decode_clusters} must be in [1, decode_interval={self.decode_interval}]"
            )
        if self.kmeans_tol >= 1.0:
            raise ValueError(f"kmeans_tol must be in [0, 1), got {self.kmeans_tol}")
        if self.token_refine > 1 and self.block_refine > 1:
            raise ValueError(f"token_refine={self.token_refine} and block_refine={self.block_refine}: refine by "
                             "tokens or by blocks, not both (set one of them to 1)")

    @property
    def reads_key_blocks(self) -> bool:
        return self.token_refine > 1  # its candidates' keys, block by block

    # ---- Static sizes, from the capacity S -----------------------------------------------------------------

    @property
    def layout(self) -> ClusterBlocks:
        return ClusterBlocks(block_size=self.block_size, sinks=self.sinks, window=self.decode_interval,
                             tokens_per_cluster=self.tokens_per_cluster, decode_clusters=self.decode_clusters,
                             budget=self.budget)

    def prompt_cluster_slots(self, capacity: int) -> int:
        return max(1, (capacity - self.sinks) // self.tokens_per_cluster)

    def selection_shape(self, config, batch_size, capacity):
        heads = config.num_heads if self.gqa == "per_head" else config.num_kv_heads
        if self.token_refine > 1:  # rows: the sinks, then the tokens
            return (batch_size, heads, self.budget, 1)
        return (batch_size, heads, self.layout.sink_blocks() + self.layout.block_slots(), self.block_size)

    def metadata_bytes(self, config, context):
        clusters = max(1, (context - self.sinks) // self.tokens_per_cluster)
        per_cluster = 2 if self.score != "dot" else 1  # float32 centroids (and variances)
        blocks = -(-self.layout.store_rows(context) // self.block_size) if self.block_refine > 1 else 0  # block means
        return config.num_kv_heads * (clusters * per_cluster + blocks) * config.head_dim * 4

    def window_size(self, capacity: int) -> int:
        return self.decode_interval

    # ---- Prefill ---------------------------------------------------------------------------------------------

    def init_state(self, config, batch_size, capacity):
        B, K, H = batch_size, config.num_kv_heads, config.head_dim
        C, R = self.layout.cluster_slots(capacity), self.layout.store_rows(capacity)
        zi = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
        return ClusterIndex(
            centroids=jnp.zeros((B, K, C, H), jnp.float32),
            sizes=zi(B, K, C),
            block_start=zi(B, K, C),
            row_positions=jnp.full((B, K, R), -1, jnp.int32),
            next_block=zi(B, K),
            recent_rows=jnp.full((B, K, self.decode_interval), R, jnp.int32),
            clustered_upto=zi(B),
            num_prompt_clusters=zi(B),
            variances=jnp.zeros((B, K, C if self.score != "dot" else 0, H), jnp.float32),
            block_means=jnp.zeros((B, K, R // self.block_size if self.block_refine > 1 else 0, H), jnp.float32),
        )

    def after_prefill(self, state: ClusterIndex, keys, lengths):
        B, K, S, H = keys.shape
        bs, C0 = self.block_size, self.prompt_cluster_slots(S)
        pos = jnp.arange(S)
        # [B, S] tokens to cluster: past the sinks, inside the prompt.
        valid = (pos[None, :] >= self.sinks) & (pos[None, :] < lengths[:, None])
        num_clusters = jnp.clip((lengths - self.sinks) // self.tokens_per_cluster, 1, C0).astype(jnp.int32)
        result = self._kmeans(keys, jnp.broadcast_to(valid[:, None], (B, K, S)),
                              jnp.broadcast_to(num_clusters[:, None], (B, K)), C0, salt=0)
        sizes, layout = result.sizes, self.layout  # [B, K, C0]
        first = layout.first_block() + layout.sink_blocks()
        block_start, order, rows, used = layout.place(result.labels, sizes, first)
        variances = state.variances
        if self.score != "dot":
            variances = variances.at[:, :, :C0].set(member_variances(keys, result.labels, result.centroids, sizes))
        block_means = state.block_means
        if self.block_refine > 1:
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

    def _kmeans(self, keys, valid, num_clusters, max_clusters: int, salt: int):
        """Cosine K-means of keys [B, K, n, H] (valid [B, K, n]) into num_clusters [B, K] clusters, one problem per
        (sequence, KV head), kept as [B, K] leading dims (not merged: see kmeans). The initialisation's PRNG keys
        depend on the KV head and `salt` only: a sequence clusters alike alone or in a batch."""
        B, K = keys.shape[:2]
        per_head = problem_keys(jax.random.fold_in(jax.random.PRNGKey(self.seed), salt), K)
        with jax.named_scope("kmeans"):
            return cosine_kmeans(keys, valid, num_clusters, jnp.broadcast_to(per_head[None], (B,) + per_head.shape),
                                 max_clusters=max_clusters, max_iters=self.max_iters, init=self.init,
                                 impl=kernels.resolve(self.kernels, "centroid_update"), tol=self.kmeans_tol,
                                 assign_impl=kernels.resolve(self.kernels, "kmeans_assign"))

    # ---- Decode ----------------------------------------------------------------------------------------------

    def window_start(self, state: ClusterIndex, lengths, prompt_lengths):
        return state.clustered_upto

    def recent_due(self, state: ClusterIndex, lengths):
        return lengths - state.clustered_upto >= self.decode_interval  # [B]

    def index_due(self, state: ClusterIndex, recent_keys, due, prompt_lengths):
        """Clusters the `decode_interval` tokens past `clustered_upto` (their keys: `recent_keys()` [B, K, W, H])
        into `decode_clusters` new clusters and lays their members out in new blocks. Returns only what that adds
        (`add_indexed` writes it in where due): the new clusters, where they go, and their rows."""
        recent = recent_keys()
        B, K, W, H = recent.shape
        Cp, bs = self.decode_clusters, self.block_size
        result = self._kmeans(recent, jnp.ones((B, K, W), bool), jnp.full((B, K), Cp, jnp.int32), Cp, salt=1)
        sizes = result.sizes  # [B, K, Cp]
        block_start, order, rows, used = self.layout.place(result.labels, sizes, state.next_block)
        added = {
            "centroids": result.centroids, "sizes": sizes, "block_start": block_start, "order": order, "rows": rows,
            "blocks": used,
            # Where the new clusters go: after the prompt's clusters and earlier decode groups.
            "slot": state.num_prompt_clusters + (state.clustered_upto - prompt_lengths) // W * Cp,  # [B]
        }
        if self.score != "dot":
            added["variances"] = member_variances(recent, result.labels, result.centroids, sizes)
        if self.block_refine > 1:  # the new blocks' mean keys: at most W // bs + Cp blocks from next_block on
            new_blocks = W // bs + Cp
            local = rows // bs - state.next_block[..., None]
            added["block_means"], added["block_counts"] = _segment_means(
                jnp.take_along_axis(recent, order[..., None], axis=-2),
                jnp.where((local >= 0) & (local < new_blocks), local, new_blocks), new_blocks)
        return added

    def add_indexed(self, state: ClusterIndex, added, due):
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
            **self.layout.add_window(state, added["order"], added["rows"], added["blocks"], due),
            clustered_upto=jnp.where(due, start + W, start),
        )

    def decode_changed_state(self, old_state: ClusterIndex, new_state: ClusterIndex):
        # Only clustering a window changes the index (`index_due`), and that runs before the layers.
        return jnp.any(new_state.clustered_upto != old_state.clustered_upto)

    def covers(self, capacity: int) -> bool:
        # Every cluster fits the budget's tokens and its block slots, whatever the clustering: at most all
        # positions past the sinks, in at most one partial block per cluster slot.
        most_blocks = -(-max(capacity - self.sinks, 0) // self.block_size) + self.layout.cluster_slots(capacity)
        return capacity <= self.budget and most_blocks <= self.layout.block_slots()

    def covers_now(self, state: ClusterIndex, lengths, prompt_lengths):
        # The ranking takes every cluster untrimmed when all of them fit the tokens and the block slots.
        tokens = jnp.sum(state.sizes, axis=-1)  # [B, K]
        blocks = jnp.sum(-(-state.sizes // self.block_size), axis=-1)
        return (tokens <= self.budget - self.sinks) & (blocks <= self.layout.block_slots())  # [B, K]

    def _scores(self, state: ClusterIndex, q):
        """Every cluster's score (`score`): [B, K, G, C] per query head, or [B, K, 1, C] for the sum over a KV
        head's queries (what `gqa="shared"` ranks by: summing the queries first is one matrix-vector product per
        KV head; the variance term sums q_h² over the heads, likewise)."""
        H, K = q.shape[-1], state.centroids.shape[1]
        # Centroids as the left operand: a [C, H] x [H, G] product per KV head.
        per_cluster = lambda table, queries: jnp.swapaxes(  # noqa: E731
            jnp.einsum("BKCH,BKGH->BKCG", table, queries), -1, -2)
        dot = per_cluster(state.centroids, self._grouped(q, K, lambda x: x))
        if self.score == "dot":
            return dot
        spread = per_cluster(state.variances, self._grouped(q, K, lambda x: x * x))
        return dot / H ** 0.5 + 0.5 * spread / H

    def _grouped(self, q, K: int, f):
        """f(q) [B, N, H] as [B, K, G, H] float32 by KV head, or [B, K, 1, H] summed over a KV head's query heads
        (gqa "shared")."""
        B, N, H = q.shape
        x = f(q.reshape(B, K, N // K, H).astype(jnp.float32))
        return jnp.sum(x, axis=2, keepdims=True) if self.gqa == "shared" else x

    def select(self, state: ClusterIndex, q, keys, lengths, prompt_lengths) -> Selection:
        """Sink blocks, then the blocks of the top clusters: starts [B, h, ns + Mb], mask [B, h, ns + Mb, bs],
        h = N (gqa "per_head"; query head n ranks the clusters of KV head n // G) or K (gqa "shared").
        With `token_refine`, rows (`_select_tokens`)."""
        if self.token_refine > 1:
            return self._select_tokens(state, q, keys, lengths, prompt_lengths)
        B = q.shape[0]
        bs, ns, Mb = self.block_size, self.layout.sink_blocks(), self.layout.block_slots()
        scores = self._scores(state, q)  # [B, K, g, C]
        K, g = scores.shape[1], scores.shape[2]
        ranked = lambda x: jnp.broadcast_to(x[:, :, None], scores.shape)  # noqa: E731
        tokens = self.budget - self.sinks
        wanted = tokens * self.block_refine  # the clusters' tokens to take (refined to `tokens` below)
        # Usually ~wanted / tokens_per_cluster clusters fill it: rank twice that many first.
        first = 2 * -(-wanted // self.tokens_per_cluster) + 4
        blocks, rows = rank_and_index(scores, ranked(state.sizes), ranked(state.block_start), wanted,  # [B, K, g, *]
                                      self.layout.block_slots(wanted), bs, first=first,
                                      impl=kernels.resolve(self.kernels, "cluster_to_block_index"))
        if self.block_refine > 1:
            blocks, rows = self._refine(state, q, blocks, rows, tokens, Mb)  # [B, K, g, Mb]
        offsets = jnp.arange(bs, dtype=jnp.int32)
        mask = offsets < rows[..., None]  # [B, K, g, Mb, bs]
        # The sinks: positions i * bs + r of sink block i, while inside the prompt (and the sequence).
        sink = jnp.arange(ns, dtype=jnp.int32)[:, None] * bs + offsets  # [ns, bs]
        sink_mask = (sink < self.sinks) & (sink < jnp.minimum(lengths, prompt_lengths)[:, None, None])  # [B, ns, bs]
        sink_starts = (self.layout.first_block() + jnp.arange(ns, dtype=jnp.int32)) * bs
        starts = jnp.concatenate([jnp.broadcast_to(sink_starts, (B, K, g, ns)), blocks * bs], axis=-1)
        mask = jnp.concatenate([jnp.broadcast_to(sink_mask[:, None, None], (B, K, g, ns, bs)), mask], axis=-2)
        return Selection(starts=starts.reshape(B, K * g, ns + Mb), mask=mask.reshape(B, K * g, ns + Mb, bs),
                         chunk=bs, aligned=True)

    def _select_tokens(self, state: ClusterIndex, q, key_blocks, lengths, prompt_lengths) -> Selection:
        """The sinks' rows, then the best `budget - sinks` tokens by q·k of the candidate clusters: those ranked
        first for the KV head (`_candidate_scores`), taken until `token_refine` x that many tokens. Their keys are
        read block by block (`key_blocks`, [B, K, n, bs, H]) and scored per query head (gqa "shared": by the summed
        queries, one selection per KV head). Rows [B, h, budget] and their mask."""
        B, N, H = q.shape
        K, bs = state.centroids.shape[1], self.block_size
        tokens = self.budget - self.sinks
        wanted = tokens * self.token_refine
        blocks, rows = rank_and_index(self._candidate_scores(state, q), state.sizes[:, :, None],
                                      state.block_start[:, :, None], wanted,
                                      self.layout.block_slots(wanted), bs,
                                      first=2 * -(-wanted // self.tokens_per_cluster) + 4,
                                      impl=kernels.resolve(self.kernels, "cluster_to_block_index"))
        blocks, rows = blocks[:, :, 0], rows[:, :, 0]  # [B, K, n]
        n = blocks.shape[-1]
        keys = key_blocks(blocks * bs, bs).reshape(B, K, n * bs, H)
        queries = self._grouped(q, K, lambda x: x)  # [B, K, g, H]
        scores = jnp.einsum("BKTH,BKgH->BKgT", keys, queries.astype(keys.dtype), preferred_element_type=jnp.float32)
        offsets = jnp.arange(bs, dtype=jnp.int32)
        candidate = (offsets < rows[..., None]).reshape(B, K, 1, n * bs)
        keep = top_mask(jnp.where(candidate, scores, -jnp.inf), tokens)  # [B, K, g, n * bs]
        # The kept candidates' rows, in candidate order, packed into `tokens` slots.
        slot = jnp.where(keep, jnp.cumsum(keep, axis=-1, dtype=jnp.int32) - 1, tokens)
        candidate_rows = jnp.broadcast_to((blocks[..., None] * bs + offsets).reshape(B, K, 1, n * bs), slot.shape)
        g = slot.shape[2]
        pack = lambda rows, at: jnp.zeros((tokens,), jnp.int32).at[at].set(rows, mode="drop")  # noqa: E731
        packed = jax.vmap(jax.vmap(jax.vmap(pack)))(candidate_rows, slot)  # [B, K, g, tokens]
        filled = jnp.arange(tokens) < jnp.sum(keep, axis=-1, dtype=jnp.int32)[..., None]
        sink = jnp.arange(self.sinks, dtype=jnp.int32)
        sink_rows = jnp.broadcast_to(self.layout.first_block() * bs + sink, (B, K, g, self.sinks))
        sink_mask = jnp.broadcast_to((sink < jnp.minimum(lengths, prompt_lengths)[:, None])[:, None, None],
                                     (B, K, g, self.sinks))
        return Selection.of_rows(jnp.concatenate([sink_rows, packed], -1).reshape(B, K * g, self.budget),
                                 jnp.concatenate([sink_mask, filled], -1).reshape(B, K * g, self.budget))

    def _candidate_scores(self, state: ClusterIndex, q):
        """What `token_refine` ranks a KV head's candidate clusters by, [B, K, 1, C]: per_head, the best of its
        query heads' scores, so a cluster one query head ranks high is read for it even where the others rank it
        low (the demo's needle: a sum drowned the one head that needed it, docs/research_log.md); shared, the
        summed queries' score, as the selection itself."""
        if self.gqa == "shared":
            return self._scores(state, q)
        return jnp.max(self._scores(state, q), axis=2, keepdims=True)

    def _refine(self, state: ClusterIndex, q, blocks, rows, tokens: int, slots: int):
        """The best blocks of the candidate clusters' blocks [B, K, g, M] (rows used in each: rows), by q·(block
        mean key), taken until `tokens` rows (the last trimmed) -> blocks, rows [B, K, g, slots]."""
        B, _, H = q.shape
        K, g, M = blocks.shape[1], blocks.shape[2], blocks.shape[3]
        qg = self._grouped(q, K, lambda x: x)
        means = jnp.take_along_axis(state.block_means, blocks.reshape(B, K, g * M)[..., None], axis=-2)
        block_scores = jnp.einsum("BKgMH,BKgH->BKgM", means.reshape(B, K, g, M, H), qg)
        return rank_and_index(block_scores, rows, blocks, tokens, slots, self.block_size,
                              impl=kernels.resolve(self.kernels, "cluster_to_block_index"))

    def selected_positions(self, state: ClusterIndex, q, keys, lengths, prompt_lengths):
        if self.reads_key_blocks:  # keys [B, K, S, H] by position (the evaluation's store): read by row here
            by_row = jnp.take_along_axis(keys, jnp.maximum(state.row_positions, 0)[..., None], axis=-2)
            keys = lambda starts, chunk: gather_rows(by_row, row_index(starts), chunk=chunk, aligned=True)  # noqa: E731
        return super().selected_positions(state, q, keys, lengths, prompt_lengths)


#: The selection rule of the ClusterKV paper (Liu et al., 2024): 16 sinks, C0 = (L - 16) / 80 prompt clusters, 4
#: clusters of every 320 generated tokens, clusters ranked by q·μ and taken whole until the budget, the last one
#: trimmed to its first members in position order. `ClusterKVPaper` holds these values (and the paper's 2 full
#: layers by default).
PAPER_RULE = {"sinks": 16, "tokens_per_cluster": 80, "decode_interval": 320, "decode_clusters": 4, "score": "dot",
              "block_refine": 1, "token_refine": 1}


@dataclasses.dataclass(frozen=True)
class ClusterKVPaper(ClusterKV):
    """ClusterKV as the paper selects (`PAPER_RULE`), whatever `ClusterKV`'s defaults are: for reproduction, and
    to set the paper's rule beside the default in one run (`--policies clusterkv,clusterkv-paper`). The rule's
    fields take no other value (they make no flags); the budget, the full layers (the paper's 2 by default; a
    one-layer benchmark sets 0), offloading, kernels, GQA mode and K-means' own settings are free."""

    name = "clusterkv-paper"
    sinks: int = PAPER_RULE["sinks"]
    tokens_per_cluster: int = PAPER_RULE["tokens_per_cluster"]
    decode_interval: int = PAPER_RULE["decode_interval"]
    decode_clusters: int = PAPER_RULE["decode_clusters"]
    full_layers: int = option(2, FULL_LAYERS_HELP, least=0)
    score: str = PAPER_RULE["score"]
    block_refine: int = PAPER_RULE["block_refine"]
    token_refine: int = PAPER_RULE["token_refine"]

    def __post_init__(self):
        super().__post_init__()
        changed = {f: getattr(self, f) for f, value in PAPER_RULE.items() if getattr(self, f) != value}
        if changed:
            listed = lambda values: ", ".join(f"{f}={v!r}" for f, v in values.items())  # noqa: E731
            raise ValueError(f"{self.name} is the paper's rule ({listed(PAPER_RULE)}); it was given {listed(changed)}: "
                             "use ClusterKV (--policies clusterkv) for another rule")
