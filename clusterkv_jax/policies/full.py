"""FullKV: every layer attends to every cached token (the uncompressed reference)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from clusterkv_jax.policies.base import KVPolicy, option


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
