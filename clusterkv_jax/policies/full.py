"""FullKV: every layer attends to every cached token (the uncompressed reference); `FullKVKeepingQueries`, full KV
whose prefill also keeps each layer's last prompt queries (a shared prefill for SnapKV and InfiniGen)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from clusterkv_jax import axes
from clusterkv_jax.policies.base import KVPolicy, option
from clusterkv_jax.policies.common import keep_observed


@dataclasses.dataclass(frozen=True)
class FullKV(KVPolicy):
    """Every layer is a full layer: the model never calls a selection hook. `offload=True` keeps every layer's
    K/V in host memory and streams each whole layer to the device at every step (the uncompressed
    offloading baseline)."""

    name = "full"
    full_layers: ClassVar[int] = 1 << 30  # not a setting: every layer attends to everything
    offload: bool = option(False, "keep every layer's K/V in host memory, streamed to the device each step")

    def offloads(self, selecting: bool) -> bool:
        return self.offload  # all layers are full ones, and all of them move to the host


@flax.struct.dataclass
class KeptQueries:
    # [B, N, n, H] float32 the prompt's last n post-RoPE queries (slot j: position L - n + j)
    queries: jax.Array = axes.field("batch", "heads", "window", "head_dim")


@dataclasses.dataclass(frozen=True)
class FullKVKeepingQueries(KVPolicy):
    """Full KV whose prefill also keeps each layer's last `prompt_queries` prompt queries (post-RoPE): what a
    shared prefill (`prefill_prompts(..., prompt_queries=n)`) holds for the policies that index the prompt by
    them (SnapKV, InfiniGen). Its layers are selecting ones that select every token (`covers`), so that each
    has a state to keep its queries in; it attends as FullKV does. Not on the command line."""

    prompt_queries: int = option(32, "the prompt's last queries kept per layer", least=1)

    def covers(self, capacity: int) -> bool:
        return True  # every layer attends to everything, as full KV's

    def selection_shape(self, config, batch_size, capacity):
        return (batch_size, config.num_heads, 1, 1)  # never selects

    def init_state(self, config, batch_size, capacity):
        shape = (batch_size, config.num_heads, self.prompt_queries, config.head_dim)
        return KeptQueries(queries=jnp.zeros(shape, jnp.float32))

    def observe_queries(self, state, queries, found):
        return state.replace(queries=keep_observed(state.queries, queries, found))
