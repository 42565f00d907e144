"""StreamingLLM (Xiao et al., 2024): attention sinks plus a sliding window, a non-recallable eviction baseline.

Shapes: B batch, N query heads, K KV heads, S capacity, H head dim.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from clusterkv_jax.policies.base import FULL_LAYERS_HELP, StatelessPolicy, option
from clusterkv_jax.policies.common import expand_heads, recent_window, sink_slots
from clusterkv_jax.selection import Selection


@dataclasses.dataclass(frozen=True)
class StreamingLLM(StatelessPolicy):
    """Attends the first `sinks` tokens and the most recent `budget - sinks` tokens of the whole sequence.

    Everything in between is evicted for good: the choice ignores the query, so a token that left the window
    can never be recalled. It keeps no index (its state is a placeholder).

    Budget accounting: the budget covers every attended token, sinks and generated tokens included (an
    eviction policy holds a fixed B-token cache, so no generated token is attended outside the budget: the
    policy has no window). A sequence of n tokens attends min(n, budget) of them.
    """

    name = "streaming"
    budget: int = option(1024, "tokens attended per step: the sinks and the most recent ones", least=1)
    sinks: int = option(16, "first tokens always attended (attention sinks)", least=0)
    full_layers: int = option(2, FULL_LAYERS_HELP, least=0)

    def __post_init__(self):
        super().__post_init__()
        if self.budget < self.sinks:
            raise ValueError(f"budget={self.budget} must be >= sinks={self.sinks}")

    def selection_shape(self, config, batch_size, capacity):
        return (batch_size, config.num_heads, self.budget, 1)

    def covers(self, capacity):
        return self.budget >= capacity

    def covers_now(self, state, lengths, prompt_lengths):
        return lengths <= self.budget

    def select(self, state, q, keys, lengths, prompt_lengths):
        """Sinks then the sliding window: rows [B, N, budget], the same for every head."""
        recent = self.budget - self.sinks
        s_idx, s_mask = sink_slots(lengths, self.sinks)  # [B, sinks]
        # The window starts after the sinks, so short sequences never attend a token twice.
        start = jnp.maximum(jnp.minimum(lengths, self.sinks), lengths - recent)  # [B]
        r_idx, r_mask = recent_window(lengths, start, recent)  # [B, budget - sinks]
        N = q.shape[1]
        idx = expand_heads(jnp.concatenate([s_idx, r_idx], axis=-1), N)
        mask = expand_heads(jnp.concatenate([s_mask, r_mask], axis=-1), N)
        return Selection.of_rows(idx, mask)
