"""Policies by their CLI names, for the evaluation sweeps."""

from __future__ import annotations

from typing import Any

from clusterkv_jax.policies import ClusterKV, FullKV, InfiniGen, KVPolicy, OracleTopK, Quest, SnapKV, StreamingLLM

POLICY_CLASSES = {"clusterkv": ClusterKV, "quest": Quest, "streaming": StreamingLLM, "snapkv": SnapKV,
                  "infinigen": InfiniGen, "oracle": OracleTopK}


def make_policy(name: str, budget: int, **options: Any) -> KVPolicy:
    """The policy called `name` at `budget` tokens; `full` ignores the budget and every option but `offload`."""
    if name == "full":
        return FullKV(offload=options.get("offload", False))
    if name not in POLICY_CLASSES:
        raise ValueError(f"unknown policy {name!r}; choose from full, {', '.join(POLICY_CLASSES)}")
    return POLICY_CLASSES[name](budget=budget, **options)


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
    return parse_choices(text, ["full", *POLICY_CLASSES], "policy")
