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

import flax.struct
import jax
import jax.numpy as jnp

from clusterkv_jax.kmeans import cosine_kmeans, problem_keys
from clusterkv_jax.ops import map_leading
from clusterkv_jax.policies.base import IndexedPolicy
from clusterkv_jax.policies.common import expand_heads, sink_slots


@flax.struct.dataclass
class ClusterIndex:
    """One layer's cluster metadata (the model stacks a leading [L] axis)."""

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
    sorted_tokens: jax.Array,  # [..., S] int32
    slots: int,
    kernel: str = "reference",
) -> tuple[jax.Array, jax.Array]:
    """Clusters in descending score order, members taken until `slots` tokens (the last cluster trimmed).

    Returns token positions [..., slots] and a mask [..., slots] (False where fewer tokens exist). The
    ranking is an argsort in XLA; the slot -> token indexing runs in the Pallas `cluster_to_token_index`
    kernel when kernel is "pallas" (or "interpret"), else in jnp below.
    """
    scores = jnp.where(sizes > 0, scores, -jnp.inf)
    order = jnp.argsort(-scores, axis=-1)  # [..., C] best first
    ranked_sizes = jnp.take_along_axis(sizes, order, axis=-1)
    ranked_starts = jnp.take_along_axis(starts, order, axis=-1)
    if kernel != "reference":
        from pallas_kernels import cluster_to_token_index

        lead, C, S = scores.shape[:-1], sizes.shape[-1], sorted_tokens.shape[-1]
        idx, mask = cluster_to_token_index(ranked_sizes.reshape(-1, C), ranked_starts.reshape(-1, C),
                                           sorted_tokens.reshape(-1, S), slots, interpret=kernel == "interpret")
        return idx.reshape(lead + (slots,)), mask.reshape(lead + (slots,))
    cum = jnp.cumsum(ranked_sizes, axis=-1)  # [..., C] inclusive prefix sums
    lead = scores.shape[:-1]
    j = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), lead + (slots,))
    # Slot j belongs to the first ranked cluster whose prefix sum exceeds j. Mapped over the leading dims
    # without merging them, so B and heads keep their own mesh axes.
    r = map_leading(lambda c, q: jnp.searchsorted(c, q, side="right"), len(lead))(cum, j)
    C = sizes.shape[-1]
    r_clip = jnp.minimum(r, C - 1)
    before = jnp.take_along_axis(cum - ranked_sizes, r_clip, axis=-1)
    offset = jnp.take_along_axis(ranked_starts, r_clip, axis=-1) + (j - before)
    S = sorted_tokens.shape[-1]
    idx = jnp.take_along_axis(sorted_tokens, jnp.clip(offset, 0, S - 1), axis=-1)
    mask = j < cum[..., -1:]
    return jnp.where(mask, idx, 0), mask


@dataclasses.dataclass(frozen=True)
class ClusterKV(IndexedPolicy):
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
        from pallas_kernels import use_kernels

        return "pallas" if use_kernels(self.kernels) else "reference"

    # Static sizes derived from the cache capacity S.
    def prompt_cluster_slots(self, capacity: int) -> int:
        return max(1, (capacity - self.sinks) // self.tokens_per_cluster)

    def decode_cluster_slots(self, capacity: int) -> int:
        return self.decode_clusters * (capacity // self.decode_interval + 1)

    def init_state(self, config, batch_size, capacity):
        L, B, K, H = config.num_layers, batch_size, config.num_kv_heads, config.head_dim
        C = self.prompt_cluster_slots(capacity) + self.decode_cluster_slots(capacity)
        zi = lambda *shape: jnp.zeros((L, *shape), jnp.int32)
        return ClusterIndex(
            centroids=jnp.zeros((L, B, K, C, H), jnp.float32),
            sizes=zi(B, K, C),
            starts=zi(B, K, C),
            sorted_tokens=zi(B, K, capacity),
            clustered_upto=zi(B),
            num_prompt_clusters=zi(B),
        )

    def after_prefill(self, state: ClusterIndex, keys, lengths):
        B, K, S, H = keys.shape
        C0 = self.prompt_cluster_slots(S)
        pos = jnp.arange(S)
        # [B, S] tokens to cluster: past the sinks, inside the prompt.
        valid = (pos[None, :] >= self.sinks) & (pos[None, :] < lengths[:, None])
        num_clusters = jnp.clip((lengths - self.sinks) // self.tokens_per_cluster, 1, C0).astype(jnp.int32)
        # One problem per (sequence, KV head), kept as [B, K] leading dims (not merged: see kmeans).
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
        B, N, H = q.shape
        K = state.centroids.shape[1]
        # [B, K, G, C] inner products with the centroids
        scores = jnp.einsum("BKGH,BKCH->BKGC", q.reshape(B, K, N // K, H).astype(jnp.float32), state.centroids)
        if self.gqa == "shared":
            return jnp.sum(scores, axis=2)  # [B, K, C]
        return scores.reshape(B, N, -1)  # [B, N, C]

    def select(self, state: ClusterIndex, q, keys, lengths, prompt_lengths):
        B, N, _ = q.shape
        K = state.sizes.shape[1]
        heads = N if self.gqa == "per_head" else K
        group = heads // K  # selections per KV head
        scores = self._scores(state, q)

        def per_head(x):  # [B, K, ...] -> [B, heads, ...]
            return jnp.repeat(x, group, axis=1)

        slots = self.budget - self.sinks
        idx, mask = rank_and_index(
            scores, per_head(state.sizes), per_head(state.starts), per_head(state.sorted_tokens), slots,
            kernel=self.kernel,
        )
        sink_idx, sink_mask = sink_slots(jnp.minimum(lengths, prompt_lengths), self.sinks)
        idx = jnp.concatenate([expand_heads(sink_idx, heads), idx], axis=-1)
        mask = jnp.concatenate([expand_heads(sink_mask, heads), mask], axis=-1)
        return idx, mask

    def window_size(self) -> int:
        return self.decode_interval

    def indexed_upto(self, state: ClusterIndex):
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
