"""ClusterKV: recallable KV selection at the granularity of semantic clusters of keys.

After prefill, per layer >= full_layers, sequence and KV head, the post-RoPE keys of tokens [sinks, L) are
clustered with cosine K-means into C0 = max(1, (L - sinks) // tokens_per_cluster) clusters; every
`decode_interval` generated tokens, those tokens alone are clustered into `decode_clusters` more, appended to the
index. Each cluster's stored centroid is the mean of its member keys. At decode, clusters are ranked by q·μ and
taken in that order until the budget is filled (the last one trimmed); the sinks are always attended; generated
tokens not clustered yet are attended in full (the window, reported outside the budget).

The policy below is the protocol's side (`KVPolicy`): its options, sizes and hooks. What it keeps per layer is a
`ClusterIndex` (`clusterkv_jax.policies.cluster_index`: built at prefill, extended per window); how it ranks and
selects is `clusterkv_jax.policies.cluster_select`'s; where the store keeps each cluster's members (consecutive
rows, in whole blocks, after a ring of rows for the window, so a selection reads a few dozen contiguous blocks)
is its layout's, `ClusterKV.layout` (`clusterkv_jax.policies.cluster_blocks`).

Shapes: B batch, N query heads, K KV heads, S capacity (positions), H head dim.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from clusterkv_jax import kernels
from clusterkv_jax.ops import gather_rows, row_index
from clusterkv_jax.policies import cluster_index, cluster_select
from clusterkv_jax.policies.base import FULL_LAYERS_HELP, KVPolicy, option
from clusterkv_jax.policies.cluster_blocks import ClusterBlocks
from clusterkv_jax.policies.cluster_index import ClusterIndex
from clusterkv_jax.selection import Selection

SCORES = ("dot", "density")


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

    # ---- Sizes, from the capacity S ----------------------------------------------------------------------

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

    # ---- What it keeps: the index of each layer (`cluster_index`) ------------------------------------------

    def init_state(self, config, batch_size, capacity):
        return cluster_index.empty_index(self, config, batch_size, capacity)

    def after_prefill(self, state: ClusterIndex, keys, lengths):
        return cluster_index.index_prompt(self, state, keys, lengths)

    def window_start(self, state: ClusterIndex, lengths, prompt_lengths):
        return state.clustered_upto

    def recent_due(self, state: ClusterIndex, lengths):
        return lengths - state.clustered_upto >= self.decode_interval  # [B]

    def index_due(self, state: ClusterIndex, recent_keys, due, prompt_lengths):
        return cluster_index.cluster_window(self, state, recent_keys, due, prompt_lengths)

    def add_indexed(self, state: ClusterIndex, added, due):
        return cluster_index.add_window(self, state, added, due)

    # ---- What it selects (`cluster_select`) ------------------------------------------------------------------

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

    def select(self, state: ClusterIndex, q, keys, lengths, prompt_lengths) -> Selection:
        """Blocks of the top clusters after the sinks' (`cluster_select.select_blocks`), or with `token_refine`
        the best rows of more candidates (`cluster_select.select_tokens`; `keys`: their key blocks)."""
        if self.token_refine > 1:
            return cluster_select.select_tokens(self, state, q, keys, lengths, prompt_lengths)
        return cluster_select.select_blocks(self, state, q, lengths, prompt_lengths)

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
