"""How ClusterKV ranks its clusters and selects what a decode step reads, from one layer's `ClusterIndex`
(`clusterkv_jax.policies.cluster_index`): clusters scored by q·μ (or the `density` score), taken whole in that
order until the budget (`select_blocks`, the paper's rule; the last one trimmed), optionally refined to their best
blocks (`block_refine`) or to the best tokens of more candidates (`select_tokens`, `token_refine`).

Shapes: B batch, N query heads, K KV heads, G = N // K, C cluster slots, H head dim, bs = block_size, Mb block
slots, ns sink blocks; g = G per query head, 1 for gqa "shared".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from clusterkv_jax import kernels
from clusterkv_jax.ops import top_k_indices, top_mask
from clusterkv_jax.policies.cluster_index import ClusterIndex
from clusterkv_jax.selection import Selection


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


def cluster_scores(policy, state: ClusterIndex, q):
    """Every cluster's score (`score`): [B, K, G, C] per query head, or [B, K, 1, C] for the sum over a KV
    head's queries (what `gqa="shared"` ranks by: summing the queries first is one matrix-vector product per
    KV head; the variance term sums q_h² over the heads, likewise)."""
    H, K = q.shape[-1], state.centroids.shape[1]
    # Centroids as the left operand: a [C, H] x [H, G] product per KV head.
    per_cluster = lambda table, queries: jnp.swapaxes(  # noqa: E731
        jnp.einsum("BKCH,BKGH->BKCG", table, queries), -1, -2)
    dot = per_cluster(state.centroids, grouped_queries(policy, q, K, lambda x: x))
    if policy.score == "dot":
        return dot
    spread = per_cluster(state.variances, grouped_queries(policy, q, K, lambda x: x * x))
    return dot / H ** 0.5 + 0.5 * spread / H


def grouped_queries(policy, q, K: int, f):
    """f(q) [B, N, H] as [B, K, G, H] float32 by KV head, or [B, K, 1, H] summed over a KV head's query heads
    (gqa "shared")."""
    B, N, H = q.shape
    x = f(q.reshape(B, K, N // K, H).astype(jnp.float32))
    return jnp.sum(x, axis=2, keepdims=True) if policy.gqa == "shared" else x


def select_blocks(policy, state: ClusterIndex, q, lengths, prompt_lengths) -> Selection:
    """Sink blocks, then the blocks of the top clusters: starts [B, h, ns + Mb], mask [B, h, ns + Mb, bs],
    h = N (gqa "per_head"; query head n ranks the clusters of KV head n // G) or K (gqa "shared"). With
    `block_refine`, the best blocks of the clusters up to that many times the budget (`refine_blocks`)."""
    B = q.shape[0]
    bs, ns, Mb = policy.block_size, policy.layout.sink_blocks(), policy.layout.block_slots()
    scores = cluster_scores(policy, state, q)  # [B, K, g, C]
    K, g = scores.shape[1], scores.shape[2]
    ranked = lambda x: jnp.broadcast_to(x[:, :, None], scores.shape)  # noqa: E731
    tokens = policy.budget - policy.sinks
    wanted = tokens * policy.block_refine  # the clusters' tokens to take (refined to `tokens` below)
    # Usually ~wanted / tokens_per_cluster clusters fill it: rank twice that many first.
    first = 2 * -(-wanted // policy.tokens_per_cluster) + 4
    blocks, rows = rank_and_index(scores, ranked(state.sizes), ranked(state.block_start), wanted,  # [B, K, g, *]
                                  policy.layout.block_slots(wanted), bs, first=first,
                                  impl=kernels.resolve(policy.kernels, "cluster_to_block_index"))
    if policy.block_refine > 1:
        blocks, rows = refine_blocks(policy, state, q, blocks, rows, tokens, Mb)  # [B, K, g, Mb]
    offsets = jnp.arange(bs, dtype=jnp.int32)
    mask = offsets < rows[..., None]  # [B, K, g, Mb, bs]
    # The sinks: positions i * bs + r of sink block i, while inside the prompt (and the sequence).
    sink = jnp.arange(ns, dtype=jnp.int32)[:, None] * bs + offsets  # [ns, bs]
    sink_mask = (sink < policy.sinks) & (sink < jnp.minimum(lengths, prompt_lengths)[:, None, None])  # [B, ns, bs]
    sink_starts = (policy.layout.first_block() + jnp.arange(ns, dtype=jnp.int32)) * bs
    starts = jnp.concatenate([jnp.broadcast_to(sink_starts, (B, K, g, ns)), blocks * bs], axis=-1)
    mask = jnp.concatenate([jnp.broadcast_to(sink_mask[:, None, None], (B, K, g, ns, bs)), mask], axis=-2)
    return Selection(starts=starts.reshape(B, K * g, ns + Mb), mask=mask.reshape(B, K * g, ns + Mb, bs),
                     chunk=bs, aligned=True)


def select_tokens(policy, state: ClusterIndex, q, key_blocks, lengths, prompt_lengths) -> Selection:
    """The sinks' rows, then the best `budget - sinks` tokens by q·k of the candidate clusters: those ranked
    first for the KV head (`candidate_scores`), taken until `token_refine` x that many tokens. Their keys are
    read block by block (`key_blocks`, [B, K, n, bs, H]) and scored per query head (gqa "shared": by the summed
    queries, one selection per KV head). Rows [B, h, budget] and their mask."""
    B, N, H = q.shape
    K, bs = state.centroids.shape[1], policy.block_size
    tokens = policy.budget - policy.sinks
    wanted = tokens * policy.token_refine
    blocks, rows = rank_and_index(candidate_scores(policy, state, q), state.sizes[:, :, None],
                                  state.block_start[:, :, None], wanted,
                                  policy.layout.block_slots(wanted), bs,
                                  first=2 * -(-wanted // policy.tokens_per_cluster) + 4,
                                  impl=kernels.resolve(policy.kernels, "cluster_to_block_index"))
    blocks, rows = blocks[:, :, 0], rows[:, :, 0]  # [B, K, n]
    n = blocks.shape[-1]
    keys = key_blocks(blocks * bs, bs).reshape(B, K, n * bs, H)
    queries = grouped_queries(policy, q, K, lambda x: x)  # [B, K, g, H]
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
    sink = jnp.arange(policy.sinks, dtype=jnp.int32)
    sink_rows = jnp.broadcast_to(policy.layout.first_block() * bs + sink, (B, K, g, policy.sinks))
    sink_mask = jnp.broadcast_to((sink < jnp.minimum(lengths, prompt_lengths)[:, None])[:, None, None],
                                 (B, K, g, policy.sinks))
    return Selection.of_rows(jnp.concatenate([sink_rows, packed], -1).reshape(B, K * g, policy.budget),
                             jnp.concatenate([sink_mask, filled], -1).reshape(B, K * g, policy.budget))


def candidate_scores(policy, state: ClusterIndex, q):
    """What `token_refine` ranks a KV head's candidate clusters by, [B, K, 1, C]: per_head, the best of its
    query heads' scores, so a cluster one query head ranks high is read for it even where the others rank it
    low (the demo's needle: a sum drowned the one head that needed it, docs/research_log.md); shared, the
    summed queries' score, as the selection itself."""
    if policy.gqa == "shared":
        return cluster_scores(policy, state, q)
    return jnp.max(cluster_scores(policy, state, q), axis=2, keepdims=True)


def refine_blocks(policy, state: ClusterIndex, q, blocks, rows, tokens: int, slots: int):
    """The best blocks of the candidate clusters' blocks [B, K, g, M] (rows used in each: rows), by q·(block
    mean key), taken until `tokens` rows (the last trimmed) -> blocks, rows [B, K, g, slots]."""
    B, _, H = q.shape
    K, g, M = blocks.shape[1], blocks.shape[2], blocks.shape[3]
    qg = grouped_queries(policy, q, K, lambda x: x)
    means = jnp.take_along_axis(state.block_means, blocks.reshape(B, K, g * M)[..., None], axis=-2)
    block_scores = jnp.einsum("BKgMH,BKgH->BKgM", means.reshape(B, K, g, M, H), qg)
    return rank_and_index(block_scores, rows, blocks, tokens, slots, policy.block_size,
                          impl=kernels.resolve(policy.kernels, "cluster_to_block_index"))

