"""InfiniGen (Lee et al., OSDI 2024): every prompt token scored at each decode step from a few skewed
channels of the query and key, the top `budget` attended.

InfiniGen rotates each head's query and key space by an orthogonal "skewing" matrix A (the right singular
vectors of a sample of queries Q = U Σ Aᵀ), so that q·k = (qA)·(kA) is unchanged while a few channels of qA
carry most of the product; it keeps those `partial_ratio` x H channels of every key and ranks the tokens by
the partial product. What differs here, and why:
- The sample is each prompt's own last `sample` post-RoPE queries (InfiniGen fits A offline on calibration
  text). A is applied after RoPE: a skew folded into the projection weights would be rotated differently at
  every position and would not preserve q·k.
- One A per KV head (from its G query heads' samples), since the partial keys are stored once per KV head.
- The step's own query is scored (InfiniGen speculates from the previous layer's input to prefetch early), and
  the top `budget` tokens are taken (InfiniGen takes those within a threshold of the best score): both make the
  baseline's selection at least as accurate as the published one, at the same per-token scoring cost, which is
  the cost the paper measures (`bench attention` times it as "select").

Shapes: B batch, N query heads, K KV heads, G = N // K, S capacity, H head dim, n sample, r partial channels,
M = min(budget, S) selected slots.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp

from clusterkv_jax import axes
from clusterkv_jax.ops import top_k_indices
from clusterkv_jax.policies.base import FULL_LAYERS_HELP, PromptBudgetPolicy, option
from clusterkv_jax.policies.common import keep_observed
from clusterkv_jax.selection import Selection


@flax.struct.dataclass
class InfiniGenState:
    # [B, N, n, H] float32 the prompt's last n post-RoPE queries
    queries: jax.Array = axes.field("batch", "heads", "window", "head_dim")
    # [B, K, H, r] float32 the r kept columns of the skewing matrix A
    skew: jax.Array = axes.field("batch", "kv_heads", "head_dim", "channels")
    # [B, K, S, r] float32 keys · skew of the prompt (0 past it)
    partial_keys: jax.Array = axes.field("batch", "kv_heads", "rows", "channels")


def partial_channels(head_dim: int, ratio: float) -> int:
    return max(1, min(head_dim, math.ceil(ratio * head_dim)))


@dataclasses.dataclass(frozen=True)
class InfiniGen(PromptBudgetPolicy):
    """Per query head: the `budget` prompt tokens with the largest partial score (qA_r)·(kA_r), plus every
    generated token.

    Budget accounting (`PromptBudgetPolicy`): prompt tokens only, every generated token attended outside it.
    It reads every prompt token's r partial channels at every step (r / H of the keys' bytes).
    """

    name = "infinigen"
    budget: int = option(1024, "prompt tokens attended per step", least=1)
    partial_ratio: float = option(0.3, "fraction of the head dim scored per token (the skewed channels)")
    sample: int = option(64, "the prompt's last queries the skewing basis is fitted to", least=1)
    full_layers: int = option(2, FULL_LAYERS_HELP, least=0)

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.partial_ratio <= 1:
            raise ValueError(f"partial_ratio must be in (0, 1], got {self.partial_ratio}")

    @property
    def prompt_queries(self) -> int:
        return self.sample

    def metadata_bytes(self, config, context):
        return config.num_kv_heads * context * partial_channels(config.head_dim, self.partial_ratio) * 4

    def init_state(self, config, batch_size, capacity):
        B, N, K, H = batch_size, config.num_heads, config.num_kv_heads, config.head_dim
        r = partial_channels(H, self.partial_ratio)
        return InfiniGenState(queries=jnp.zeros((B, N, self.sample, H), jnp.float32),
                              skew=jnp.zeros((B, K, H, r), jnp.float32),
                              partial_keys=jnp.zeros((B, K, capacity, r), jnp.float32))

    def observe_queries(self, state, queries, found):
        return state.replace(queries=keep_observed(state.queries, queries, found))

    def after_prefill(self, state, keys, lengths):
        B, N, n, H = state.queries.shape
        K, S = keys.shape[1], keys.shape[2]
        r = state.skew.shape[-1]
        # The right singular vectors of the sample Q are the eigenvectors of QᵀQ [H, H] (a complete basis even
        # with fewer samples than channels). Slots before position 0 hold zeros: they do not move them.
        sample = state.queries.reshape(B, K, (N // K) * n, H)
        skew = jnp.linalg.eigh(jnp.einsum("BKmH,BKmI->BKHI", sample, sample))[1]  # [B, K, H, H] columns
        weight = jnp.abs(jnp.einsum("BKmH,BKHc->BKmc", sample, skew)).sum(axis=2)  # [B, K, H] per channel
        kept = top_k_indices(weight, r)  # [B, K, r]
        skew = jnp.take_along_axis(skew, kept[:, :, None, :], axis=-1)  # [B, K, H, r]
        in_prompt = (jnp.arange(S)[None, :] < lengths[:, None])[:, None, :, None]  # [B, 1, S, 1]
        partial = jnp.einsum("BKSH,BKHr->BKSr", keys.astype(jnp.float32), skew)
        return state.replace(skew=skew, partial_keys=jnp.where(in_prompt, partial, 0.0))

    def select(self, state, q, keys, lengths, prompt_lengths):
        """The top prompt tokens by partial score: rows [B, N, M]."""
        B, N, H = q.shape
        K, S = state.partial_keys.shape[1], state.partial_keys.shape[2]
        M = min(self.budget, S)
        qg = q.reshape(B, K, N // K, H).astype(jnp.float32)
        q_partial = jnp.einsum("BKGH,BKHr->BKGr", qg, state.skew)
        scores = jnp.einsum("BKGr,BKSr->BKGS", q_partial, state.partial_keys).reshape(B, N, S)
        in_prompt = jnp.arange(S)[None, None, :] < prompt_lengths[:, None, None]
        idx = top_k_indices(jnp.where(in_prompt, scores, -jnp.inf), M)
        return Selection.of_rows(idx, idx < prompt_lengths[:, None, None])
