"""KV selection policies: one module each, all behind `KVPolicy` (see `base.py`)."""

from clusterkv_jax.policies.base import KVPolicy
from clusterkv_jax.policies.full import FullKV

__all__ = ["KVPolicy", "FullKV"]
