"""FullKV: every layer attends to every cached token (the uncompressed reference)."""

from __future__ import annotations

import dataclasses


from clusterkv_jax.policies.base import StatelessPolicy


@dataclasses.dataclass(frozen=True)
class FullKV(StatelessPolicy):
    """`offload=True` keeps every layer's KV in host memory and streams each whole layer to the device at
    every step (the uncompressed offloading baseline)."""

    full_layers: int = 1 << 30  # every layer is a full layer, so the model never calls the hooks below
    offload: bool = False
    cache_steps: int = 0

    def __post_init__(self):
        if self.offload:  # every layer is offloaded: none keeps device KV
            object.__setattr__(self, "full_layers", 0)

    def decode_attention(self, state, q, keys, values, lengths, prompt_lengths):
        raise AssertionError("FullKV never selects: the model attends to the whole cache itself")
