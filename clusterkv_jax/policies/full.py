"""FullKV: every layer attends to every cached token (the uncompressed reference)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from clusterkv_jax.policies.base import KVPolicy


@dataclasses.dataclass(frozen=True)
class FullKV(KVPolicy):
    full_layers: int = 1 << 30  # every layer is a full layer, so the model never calls the hooks below

    def init_state(self, config, batch_size, capacity):
        return jnp.zeros((config.num_layers,), jnp.int32)  # a placeholder leaf: scan needs an [L] axis

    def after_prefill(self, state, keys, lengths):
        return state

    def decode_attention(self, state, q, keys, values, lengths, prompt_lengths):
        raise AssertionError("FullKV never selects: the model attends to the whole cache itself")
