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


class StatelessPolicy(KVPolicy):
    """A policy that keeps no index: a placeholder state and nothing to do after prefill."""

    def init_state(self, config: ModelConfig, batch_size: int, capacity: int) -> Any:
        import jax.numpy as jnp

        return jnp.zeros((config.num_layers,), jnp.int32)  # a placeholder leaf: scan needs an [L] axis

    def after_prefill(self, state: Any, keys: jax.Array, lengths: jax.Array) -> Any:
        return state


class IndexedPolicy(KVPolicy):
    """A policy whose decode attention is: a budgeted selection over indexed tokens (`select`), plus a window of
    the generated tokens not yet indexed, [indexed_upto, length), attended in full.

    Subclasses provide the hooks below; `decode_attention` is generic, and the host-offloaded path
    (`clusterkv_jax.offload`) drives the same hooks with keys and values that live in host memory.
    """

    #: Keep the full KV of layers >= full_layers in host memory (`pinned_host`); see clusterkv_jax.offload.
    offload: bool = False
    #: Offload only: the device keeps the rows selected in the last `cache_steps` steps (0: no cache).
    cache_steps: int = 1

    def window_size(self) -> int:
        """Static bound on the unindexed window (the tokens past `indexed_upto`, the current one included)."""
        raise NotImplementedError

    def indexed_upto(self, state: Any) -> jax.Array:
        """[B] positions < this are indexed (or sinks); the window is [indexed_upto, length)."""
        raise NotImplementedError

    def index_recent(self, state: Any, recent_keys, lengths: jax.Array, prompt_lengths: jax.Array) -> Any:
        """Indexes the window's tokens once enough have accumulated. `recent_keys()` returns the keys of
        positions [indexed_upto, indexed_upto + window_size) as [B, K, W, H]; call it only when needed."""
        raise NotImplementedError

    def decode_attention(self, state, q, keys, values, lengths, prompt_lengths):
        from clusterkv_jax.policies.common import attend_to_indices, recent_window

        import jax.numpy as jnp

        W, S = self.window_size(), keys.shape[2]

        def recent_keys():
            rows = jnp.minimum(self.indexed_upto(state)[:, None] + jnp.arange(W), S - 1)  # [B, W]
            return jnp.take_along_axis(keys, rows[:, None, :, None], axis=2)

        state = self.index_recent(state, recent_keys, lengths, prompt_lengths)
        idx, mask = self.select(state, q, keys, lengths, prompt_lengths)
        w_idx, w_mask = recent_window(lengths, self.indexed_upto(state), W)
        return attend_to_indices(q, keys, values, idx, mask, w_idx, w_mask), state
