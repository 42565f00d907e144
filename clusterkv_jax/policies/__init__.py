"""KV selection policies: one module each, all behind `KVPolicy` (see `base.py`), and their names."""

from __future__ import annotations

from typing import Any

from clusterkv_jax.policies.base import KVPolicy, option
from clusterkv_jax.policies.clusterkv import ClusterKV, ClusterKVPaper
from clusterkv_jax.policies.full import FullKV
from clusterkv_jax.policies.infinigen import InfiniGen
from clusterkv_jax.policies.oracle import OracleTopK
from clusterkv_jax.policies.quest import Quest
from clusterkv_jax.policies.snapkv import SnapKV
from clusterkv_jax.policies.streaming import StreamingLLM

#: Every policy by its name (`KVPolicy.name`), full KV first.
POLICIES: dict[str, type[KVPolicy]] = {cls.name: cls for cls in
                                       (FullKV, ClusterKV, ClusterKVPaper, Quest, StreamingLLM, SnapKV, InfiniGen, OracleTopK)}


def make_policy(name: str, budget: int, **options: Any) -> KVPolicy:
    """The policy called `name` at `budget` tokens; `full` has no budget and takes `offload` only."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    if name == "full":
        return FullKV(offload=options.get("offload", False))
    return POLICIES[name](budget=budget, **options)


def parse_choices(text: str, choices, what: str) -> list[str]:
    """Comma-separated names, each one of `choices`; ValueError naming the first unknown one."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in choices:
            raise ValueError(f"unknown {what} {n!r}; choose from {', '.join(choices)}")
    if not names:
        raise ValueError(f"no {what}s given")
    return names


def parse_policies(text: str) -> list[str]:
    return parse_choices(text, list(POLICIES), "policy")


__all__ = ["KVPolicy", "ClusterKV", "ClusterKVPaper", "FullKV", "InfiniGen", "OracleTopK", "Quest", "SnapKV", "StreamingLLM",
           "POLICIES", "make_policy", "option", "parse_choices", "parse_policies"]
