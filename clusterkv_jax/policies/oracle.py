"""OracleTopK: the exact top-B prompt tokens by q·k for every query head, the upper bound for recall.

Shapes: B batch, N query heads, K KV heads, G = N // K, S capacity, H head dim.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from clusterkv_jax.ops import top_k_indices
from clusterkv_jax.policies.base import FULL_LAYERS_HELP, PromptBudgetPolicy, StatelessPolicy, option
from clusterkv_jax.selection import Selection


@dataclasses.dataclass(frozen=True)
class OracleTopK(StatelessPolicy, PromptBudgetPolicy):
    """Each query head attends to the `budget` prompt tokens (positions < prompt_length) with the largest
    raw inner product q·k (query head n reads KV head n // G), found by scoring every prompt token, plus every
    generated token [prompt_length, length).

    Not a practical policy (it reads all keys every step); it is the ideal selection a compressed policy's
    recall is measured against. It keeps no index (its state is a placeholder).

    Budget accounting (`PromptBudgetPolicy`): prompt tokens only, every generated token attended outside it.
    A prompt of n tokens gives min(n, budget) selected tokens per head.
    """

    name = "oracle"
    budget: int = option(1024, "prompt tokens attended per step", least=1)
    full_layers: int = option(2, FULL_LAYERS_HELP, least=0)
    reads_all_keys = True  # it scores every prompt key at every step

    def select(self, state, q, keys, lengths, prompt_lengths):
        """The exact top prompt tokens: rows [B, N, min(budget, S)]."""
        B, N, H = q.shape
        K, S = keys.shape[1], keys.shape[2]
        qg = q.reshape(B, K, N // K, H)  # [B, K, G, H]
        scores = jnp.einsum("BKGH,BKSH->BKGS", qg, keys, preferred_element_type=jnp.float32).reshape(B, N, S)
        in_prompt = jnp.arange(S)[None, None, :] < prompt_lengths[:, None, None]  # [B, 1, S]
        scores = jnp.where(in_prompt, scores, -jnp.inf)
        idx = top_k_indices(scores, min(self.budget, S))  # [B, N, M]
        # Finite prompt scores rank above the -inf padding, so only slots past the prompt are masked.
        return Selection.of_rows(idx, idx < prompt_lengths[:, None, None])
