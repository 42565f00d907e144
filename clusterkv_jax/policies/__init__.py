"""KV selection policies: one module each, all behind `KVPolicy` (see `base.py`)."""

from clusterkv_jax.policies.base import KVPolicy
from clusterkv_jax.policies.clusterkv import ClusterKV
from clusterkv_jax.policies.full import FullKV
from clusterkv_jax.policies.infinigen import InfiniGen
from clusterkv_jax.policies.oracle import OracleTopK
from clusterkv_jax.policies.quest import Quest
from clusterkv_jax.policies.snapkv import SnapKV
from clusterkv_jax.policies.streaming import StreamingLLM

__all__ = ["KVPolicy", "ClusterKV", "FullKV", "InfiniGen", "OracleTopK", "Quest", "SnapKV", "StreamingLLM"]
