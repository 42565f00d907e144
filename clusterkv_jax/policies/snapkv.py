"""SnapKV (Li et al., 2024): prompt tokens chosen once by the votes of the prompt's last queries; a
non-recallable eviction baseline.

After prefill, each query head scores every prompt token by the attention its last `window` prompt queries
(the observation window) give it, summed over those queries and smoothed by an average pool of `pool_size`
tokens (zero-padded, as `torch.nn.functional.avg_pool1d(padding=kernel // 2)`), and keeps the top
`budget - window` tokens before the window plus the window itself. Nothing else is ever attended again: what
the decode-time queries would have needed from the evicted tokens is lost, which is what recall (ClusterKV,
Quest) is for.

Shapes: B batch, N query heads, K KV heads, G = N // K, S capacity, H head dim, n observation window,
M = min(budget, S) selected slots.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from clusterkv_jax import axes
from clusterkv_jax.ops import top_k_indices
from clusterkv_jax.policies.base import FULL_LAYERS_HELP, PromptBudgetPolicy, option
from clusterkv_jax.policies.common import keep_observed, last_positions
from clusterkv_jax.selection import Selection


@flax.struct.dataclass
class SnapKVState:
    # [B, N, n, H] float32 the prompt's last n post-RoPE queries (slot j: position L - n + j)
    queries: jax.Array = axes.field("batch", "heads", "window", "head_dim")
    idx: jax.Array = axes.field("batch", "heads", "slots")  # [B, N, M] int32 kept prompt positions
    mask: jax.Array = axes.field("batch", "heads", "slots")  # [B, N, M] bool


@dataclasses.dataclass(frozen=True)
class SnapKV(PromptBudgetPolicy):
    """Per query head: the window's tokens plus the `budget - window` earlier prompt tokens with the most pooled
    votes (query head n reads KV head n // G, as in the other per-head policies).

    Budget accounting (`PromptBudgetPolicy`): prompt tokens, the window included; generated tokens are never
    evicted, so all of them are attended outside the budget. A prompt of at most `budget` tokens is kept whole.
    """

    name = "snapkv"
    budget: int = option(1024, "prompt tokens kept, the observation window included", least=1)
    window: int = option(32, "the prompt's last tokens whose queries vote (kept whole)", least=1)
    pool_size: int = option(5, "votes are average-pooled over this many tokens (odd)", least=1)
    full_layers: int = option(2, FULL_LAYERS_HELP, least=0)

    def __post_init__(self):
        super().__post_init__()
        if self.budget < self.window:
            raise ValueError(f"budget={self.budget} must be >= window={self.window} (the window is kept)")
        if self.pool_size % 2 == 0:
            raise ValueError(f"pool_size must be a positive odd number, got {self.pool_size}")

    @property
    def prompt_queries(self) -> int:
        return self.window

    def init_state(self, config, batch_size, capacity):
        B, N, M = batch_size, config.num_heads, min(self.budget, capacity)
        return SnapKVState(queries=jnp.zeros((B, N, self.window, config.head_dim), jnp.float32),
                           idx=jnp.zeros((B, N, M), jnp.int32), mask=jnp.zeros((B, N, M), bool))

    def observe_queries(self, state, queries, found):
        return state.replace(queries=keep_observed(state.queries, queries, found))

    def after_prefill(self, state, keys, lengths):
        B, N, n, H = state.queries.shape
        K, S = keys.shape[1], keys.shape[2]
        M = state.idx.shape[-1]
        w = min(n, M)
        q = state.queries.reshape(B, K, N // K, n, H)
        logits = jnp.einsum("BKGnH,BKSH->BKGnS", q, keys.astype(jnp.float32)).reshape(B, N, n, S) / H ** 0.5
        positions = last_positions(lengths, n)  # [B, n] the window queries' positions
        causal = jnp.arange(S)[None, None, :] <= positions[:, :, None]  # [B, n, S]
        probs = jax.nn.softmax(jnp.where(causal[:, None], logits, -jnp.inf), axis=-1)
        probs = jnp.where((positions >= 0)[:, None, :, None], probs, 0.0)  # no query before position 0
        prefix = jnp.maximum(lengths - n, 0)  # [B] the tokens before the window compete for the budget
        before = jnp.arange(S)[None, :] < prefix[:, None]  # [B, S]
        votes = jnp.where(before[:, None], probs.sum(axis=2), 0.0)  # [B, N, S]
        r = self.pool_size // 2
        pooled = jax.lax.reduce_window(votes, 0.0, jax.lax.add, (1, 1, self.pool_size), (1, 1, 1),
                                       ((0, 0), (0, 0), (r, r))) / self.pool_size
        top = top_k_indices(jnp.where(before[:, None], pooled, -jnp.inf), M - w)  # [B, N, M - w]
        window = jnp.broadcast_to((prefix[:, None] + jnp.arange(w))[:, None], (B, N, w))
        idx = jnp.concatenate([top, window], axis=-1).astype(jnp.int32)
        # Prompt tokens before the window score finitely and rank first, so a slot is real iff it lies before the
        # window; window slots are real below the length.
        mask = jnp.concatenate([top < prefix[:, None, None], window < lengths[:, None, None]], axis=-1)
        return state.replace(idx=idx, mask=mask)

    def select(self, state, q, keys, lengths, prompt_lengths):
        """The tokens chosen at prefill: rows [B, N, M], whatever the query."""
        return Selection.of_rows(state.idx, state.mask)
