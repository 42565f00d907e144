"""The interface every KV selection policy implements.

A policy is a frozen dataclass (hashable, so it is a static argument of `jax.jit`) with three hooks the
model calls inside its layer scan. Layers below `full_layers` never reach the policy: they attend to the
whole cache. A new policy is one new module implementing these hooks.

Budget rule (the same for every policy): a budget B counts every token attended from the prompt and from
already-clustered generated tokens, attention sinks included; generated tokens a policy has not yet
indexed are attended in full and reported separately.
"""

from __future__ import annotations

from typing import Any

import jax

from clusterkv_jax.config import ModelConfig


class KVPolicy:
    """Base class. Subclasses are `@dataclasses.dataclass(frozen=True)`."""

    #: Layers with index < full_layers attend to every token. A policy that never selects sets it >= L.
    full_layers: int = 0

    def init_state(self, config: ModelConfig, batch_size: int, capacity: int) -> Any:
        """The policy's empty state for all layers: a pytree whose leaves have a leading [L] axis."""
        raise NotImplementedError

    def after_prefill(self, state: Any, keys: jax.Array, lengths: jax.Array) -> Any:
        """Indexes one layer's prompt keys [B, K, S, H] (rows >= lengths[b] are padding); returns its state."""
        raise NotImplementedError

    def decode_attention(
        self,
        state: Any,
        q: jax.Array,  # [B, N, H] post-RoPE queries of the new token
        keys: jax.Array,  # [B, K, S, H] this layer's store, the new token's row written
        values: jax.Array,  # [B, K, S, H]
        lengths: jax.Array,  # [B] valid rows, the new token included
        prompt_lengths: jax.Array,  # [B]
    ) -> tuple[jax.Array, Any]:
        """Attention output [B, N, H] over the tokens this policy selects, and the layer's new state."""
        raise NotImplementedError

    def select(
        self,
        state: Any,
        q: jax.Array,  # [B, N, H]
        keys: jax.Array,  # [B, K, S, H]
        lengths: jax.Array,  # [B]
        prompt_lengths: jax.Array,  # [B]
    ) -> tuple[jax.Array, jax.Array]:
        """The budgeted selection (the B tokens counted by the budget, sinks included; not the recent
        window of unindexed generated tokens): token positions idx [B, N, M] and a validity mask [B, N, M].
        Used by `decode_attention` and by the recall evaluation."""
        raise NotImplementedError
