"""ClusterKV: recallable KV selection at the granularity of semantic clusters of keys.

After prefill, per layer >= full_layers, sequence and KV head, the post-RoPE keys of tokens [sinks, L) are
clustered with cosine K-means into C0 = max(1, (L - sinks) // tokens_per_cluster) clusters. Per cluster we
store its centroid (mean of member keys), its size, and its start offset into the token positions sorted by
cluster label. At decode, clusters are ranked by q·μ and taken in that order until the budget is filled (the
last one trimmed); the sinks are always attended. Every `decode_interval` generated tokens, those tokens
alone are clustered into `decode_clusters` new clusters appended to the index; until then they are attended
in full (the recent window, reported outside the budget).

Shapes: B batch, N query heads, K KV heads, G = N // K, S capacity, H head dim, C cluster slots,
M budgeted slots (budget - sinks), W = decode_interval.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp

from clusterkv_jax.kmeans import cosine_kmeans, problem_keys
from clusterkv_jax.ops import per_shard
from clusterkv_jax.policies.base import KVPolicy
from clusterkv_jax.policies.common import expand_heads, sink_slots
from pallas_kernels import cluster_to_token_index, cluster_to_token_index_reference, use_kernels


@flax.struct.dataclass
class ClusterIndex:
    """One layer's cluster metadata."""

    centroids: jax.Array  # [B, K, C, H] float32 mean of member keys
    sizes: jax.Array  # [B, K, C] int32 (0: unused slot)
    starts: jax.Array  # [B, K, C] int32 offset of each cluster's first member in `sorted_tokens`
    sorted_tokens: jax.Array  # [B, K, S] int32 positions of clustered tokens, grouped by cluster
    clustered_upto: jax.Array  # [B] int32 positions < this are sinks or clustered; the rest are recent
    num_prompt_clusters: jax.Array  # [B] int32 C0 of each sequence


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x, axis=-1) - x


def rank_and_index(
    scores: jax.Array,  # [..., C] float32 cluster scores
    sizes: jax.Array,  # [..., C] int32
    starts: jax.Array,  # [..., C] int32
    sorted_tokens: jax.Array,  # [..., S] int32 (leading dims: a prefix of the scores': a shared token list)
    slots: int,
    kernel: str = "reference",
) -> tuple[jax.Array, jax.Array]:
    """Clusters in descending score order, members taken until `slots` tokens (the last cluster trimmed).

    Returns token positions [..., slots] and a mask [..., slots] (False where fewer tokens exist). The
    ranking is an argsort in XLA; the slot -> token indexing is `pallas_kernels.cluster_to_token_index`: the
    Pallas kernel (kernel "pallas" / "interpret", per device shard under a mesh) or its reference.
    """
    scores = jnp.where(sizes > 0, scores, -jnp.inf)
    order = jnp.argsort(-scores, axis=-1)  # [..., C] best first
    ranked_sizes = jnp.take_along_axis(sizes, order, axis=-1)
    ranked_starts = jnp.take_along_axis(starts, order, axis=-1)
    if kernel == "reference":
        return cluster_to_token_index_reference(ranked_sizes, ranked_starts, sorted_tokens, slots)
    run = functools.partial(cluster_to_token_index, slots=slots, interpret=kernel == "interpret")
    return per_shard(lambda s, st, t: run(s, st, t), ranked_sizes, ranked_starts, sorted_tokens)


@dataclasses.dataclass(frozen=True)
class ClusterKV(KVPolicy):
    """ClusterKV (see the module docstring). `gqa="per_head"` ranks clusters per query head; `"shared"` sums
    the scores over a KV head's query heads and makes one selection per KV head."""

    budget: int = 1024
    sinks: int = 16
    tokens_per_cluster: int = 80
    decode_interval: int = 320
    decode_clusters: int = 4
    full_layers: int = 2
    max_iters: int = 20
    init: str = "random"
    gqa: str = "per_head"
    seed: int = 0
    offload: bool = False
    cache_steps: int = 1
    #: "auto" (Pallas kernels on CUDA sm80+, pure JAX elsewhere), "pallas", "reference", or "interpret"
    #: (the Pallas kernels in interpret mode, on any device: slow, for tests).
    kernels: str = "auto"

    def __post_init__(self):
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
        if self.budget < max(self.sinks, 1):
            raise ValueError(f"budget={self.budget} must be >= sinks={self.sinks} and >= 1")
        if self.tokens_per_cluster <= 0:
            raise ValueError(f"tokens_per_cluster must be > 0, got {self.tokens_per_cluster}")
        if self.decode_interval <= 0:
            raise ValueError(f"decode_interval must be > 0, got {self.decode_interval}")
        if not 0 < self.decode_clusters <= self.decode_interval:
            raise ValueError(
                f"decode_clusters={self.decode_clusters} must be in [1, decode_interval={self.decode_interval}]"
            )
        if self.full_layers < 0:
            raise ValueError(f"full_layers must be >= 0, got {self.full_layers}")
        if self.max_iters < 1:
            raise ValueError(f"max_iters must be >= 1, got {self.max_iters}")
        if self.init not in ("random", "kmeans++"):
            raise ValueError(f"init must be 'random' or 'kmeans++', got {self.init!r}")
        if self.gqa not in ("per_head", "shared"):
            raise ValueError(f"gqa must be 'per_head' or 'shared', got {self.gqa!r}")
        if self.cache_steps < 0:
            raise ValueError(f"cache_steps must be >= 0, got {self.cache_steps}")
        if self.kernels not in ("auto", "pallas", "reference", "interpret"):
            raise ValueError(f"kernels must be 'auto', 'pallas', 'reference' or 'interpret', got {self.kernels!r}")

    @property
    def kernel(self) -> str:
        """The kernel path resolved for the current device: 'pallas', 'interpret' or 'reference'."""
        if self.kernels == "interpret":
            return "interpret"
        return "pallas" if use_kernels(self.kernels) else "reference"

    # Static sizes derived from the cache capacity S.
    def prompt_cluster_slots(self, capacity: int) -> int:
        return max(1, (capacity - self.sinks) // self.tokens_per_cluster)

    def decode_cluster_slots(self, capacity: int) -> int:
        return self.decode_clusters * (capacity // self.decode_interval + 1)

    def init_state(self, config, batch_size, capacity):
        B, K, H = batch_size, config.num_kv_heads, config.head_dim
        C = self.prompt_cluster_slots(capacity) + self.decode_cluster_slots(capacity)
        zi = lambda *shape: jnp.zeros(shape, jnp.int32)
        return ClusterIndex(
            centroids=jnp.zeros((B, K, C, H), jnp.float32),
            sizes=zi(B, K, C),
            starts=zi(B, K, C),
            sorted_tokens=zi(B, K, capacity),
            clustered_upto=zi(B),
            num_prompt_clusters=zi(B),
        )

    def selection_shape(self, config, batch_size, capacity):
        heads = config.num_heads if self.gqa == "per_head" else config.num_kv_heads
        return (batch_size, heads, self.budget)

    def metadata_bytes(self, config, context):
        clusters = max(1, (context - self.sinks) // self.tokens_per_cluster)
        return config.num_kv_heads * clusters * config.head_dim * 4  # float32 centroids

    def after_prefill(self, state: ClusterIndex, keys, lengths):
        B, K, S, H = keys.shape
        C0 = self.prompt_cluster_slots(S)
        pos = jnp.arange(S)
        # [B, S] tokens to cluster: past the sinks, inside the prompt.
        valid = (pos[None, :] >= self.sinks) & (pos[None, :] < lengths[:, None])
        num_clusters = jnp.clip((lengths - self.sinks) // self.tokens_per_cluster, 1, C0).astype(jnp.int32)
        # One problem per (sequence, KV head), kept as [B, K] leading dims (not merged: see kmeans).
        with jax.named_scope("kmeans"):
            result = cosine_kmeans(
                keys,
                jnp.broadcast_to(valid[:, None], (B, K, S)),
                jnp.broadcast_to(num_clusters[:, None], (B, K)),
                self._head_keys(B, K, salt=0),
                max_clusters=C0,
                max_iters=self.max_iters,
                init=self.init,
                kernel=self.kernel,
            )
        # Positions sorted by label; masked tokens (label C0) sort last.
        sorted_tokens = jnp.argsort(result.labels, axis=-1, stable=True).astype(jnp.int32)
        sizes = result.sizes
        return state.replace(
            centroids=state.centroids.at[:, :, :C0].set(result.centroids),
            sizes=state.sizes.at[:, :, :C0].set(sizes),
            starts=state.starts.at[:, :, :C0].set(_exclusive_cumsum(sizes)),
            sorted_tokens=sorted_tokens,
            clustered_upto=lengths.astype(jnp.int32),
            num_prompt_clusters=num_clusters,
        )

    def _head_keys(self, B: int, K: int, salt: int) -> jax.Array:
        """[B, K, 2] PRNG keys that depend on the KV head only: a sequence clusters alike alone or in a batch."""
        per_head = problem_keys(jax.random.fold_in(jax.random.PRNGKey(self.seed), salt), K)
        return jnp.broadcast_to(per_head[None], (B,) + per_head.shape)

    def _scores(self, state: ClusterIndex, q):
        """q·μ of every cluster: [B, K, G, C] per query head, or [B, K, C] summed over a KV head's query heads."""
        B, N, H = q.shape
        K = state.centroids.shape[1]
        scores = jnp.einsum("BKGH,BKCH->BKGC", q.reshape(B, K, N // K, H).astype(jnp.float32), state.centroids)
        return scores if self.gqa == "per_head" else jnp.sum(scores, axis=2)

    def select(self, state: ClusterIndex, q, keys, lengths, prompt_lengths):
        """Sinks, then the top clusters' members: idx, mask [B, N, budget] (gqa "per_head"; query head n
        ranks the clusters of KV head n // G) or [B, K, budget] (gqa "shared")."""
        B, N, _ = q.shape
        scores = self._scores(state, q)
        sizes, starts = state.sizes, state.starts
        if self.gqa == "per_head":  # [B, K, G, C]: each query head ranks its KV head's clusters
            sizes = jnp.broadcast_to(sizes[:, :, None], scores.shape)
            starts = jnp.broadcast_to(starts[:, :, None], scores.shape)
        slots = self.budget - self.sinks
        # The KV head's token list [B, K, S] serves its G query heads as it is (no copy per query head).
        idx, mask = rank_and_index(scores, sizes, starts, state.sorted_tokens, slots, kernel=self.kernel)
        heads = idx.shape[1] * (idx.shape[2] if self.gqa == "per_head" else 1)
        idx, mask = idx.reshape(B, heads, slots), mask.reshape(B, heads, slots)
        sink_idx, sink_mask = sink_slots(jnp.minimum(lengths, prompt_lengths), self.sinks)
        idx = jnp.concatenate([expand_heads(sink_idx, heads), idx], axis=-1)
        mask = jnp.concatenate([expand_heads(sink_mask, heads), mask], axis=-1)
        return idx, mask

    def window_size(self, capacity: int) -> int:
        return self.decode_interval

    def window_start(self, state: ClusterIndex, lengths, prompt_lengths):
        return state.clustered_upto

    def index_recent(self, state: ClusterIndex, recent_keys, lengths, prompt_lengths):
        if state.sorted_tokens.shape[-1] < self.decode_interval:  # no interval fits in this cache
            return state
        due = lengths - state.clustered_upto >= self.decode_interval  # [B]
        return jax.lax.cond(
            jnp.any(due), lambda s: self._cluster_recent(s, recent_keys(), due, prompt_lengths), lambda s: s, state
        )

    def _cluster_recent(self, state: ClusterIndex, recent, due, prompt_lengths):
        """Clusters the `decode_interval` tokens past `clustered_upto` of each due sequence (their keys: recent
        [B, K, W, H]) into `decode_clusters` new clusters appended to the index."""
        B, K, W, H = recent.shape
        S = state.sorted_tokens.shape[-1]
        Cp = self.decode_clusters
        start = state.clustered_upto  # [B]
        with jax.named_scope("kmeans"):
            result = cosine_kmeans(
                recent,
                jnp.ones((B, K, W), bool),
                jnp.full((B, K), Cp, jnp.int32),
                self._head_keys(B, K, salt=1),
                max_clusters=Cp,
                max_iters=self.max_iters,
                init=self.init,
                kernel=self.kernel,
            )
        order = jnp.argsort(result.labels, axis=-1, stable=True)
        sizes = result.sizes
        # Where the new clusters and their members go: after the prompt clusters and earlier decode groups.
        C0 = self.prompt_cluster_slots(S)
        n_groups = (start - prompt_lengths) // W  # [B] decode groups already clustered
        slot = C0 + n_groups * Cp  # [B]
        # [B] where the members go in sorted_tokens: the list holds every clustered position, sinks excluded.
        member_offset = start - jnp.minimum(prompt_lengths, self.sinks)

        def write(state_b, sizes_b, cent_b, order_b, slot_b, off_b, start_b):
            new_tokens = (start_b + order_b).astype(jnp.int32)  # [K, W]
            return (
                jax.lax.dynamic_update_slice(state_b[0], cent_b, (0, slot_b, 0)),
                jax.lax.dynamic_update_slice(state_b[1], sizes_b, (0, slot_b)),
                jax.lax.dynamic_update_slice(state_b[2], off_b + _exclusive_cumsum(sizes_b), (0, slot_b)),
                jax.lax.dynamic_update_slice(state_b[3], new_tokens, (0, off_b)),
            )

        cur = (state.centroids, state.sizes, state.starts, state.sorted_tokens)
        new = jax.vmap(write)(cur, sizes, result.centroids, order, slot, member_offset, start)
        pick = lambda n, o: jnp.where(due.reshape((B,) + (1,) * (o.ndim - 1)), n, o)
        centroids, sizes_all, starts, sorted_tokens = (pick(n, o) for n, o in zip(new, cur))
        return state.replace(
            centroids=centroids, sizes=sizes_all, starts=starts, sorted_tokens=sorted_tokens,
            clustered_upto=jnp.where(due, start + W, start),
        )
