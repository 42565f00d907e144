"""Output agreement: greedy continuations under each policy against full KV's, from the same prompts."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from clusterkv_jax.policies import make_policy
from clusterkv_jax.eval.ppl import check_span, window_offsets
from clusterkv_jax.generate import generate
from clusterkv_jax.prompts import prefill_prompts
from clusterkv_jax.policies import FullKV


def run_agreement(model, token_ids: list[int], *, context: int, new_tokens: int, samples: int,
                  budgets: list[int], policy_names: list[str], policy_options: dict[str, dict] | None = None,
                  progress: bool = True) -> dict[str, Any]:
    """Fraction of positions whose token equals full KV's, and of whole continuations that are identical."""
    check_span(model.config, context, new_tokens, "--new-tokens")
    offsets = window_offsets(len(token_ids), context, samples)
    prompts = [token_ids[o : o + context] for o in offsets]
    runs = [(n, b) for n in policy_names if n != "full" for b in budgets]
    policies = [make_policy(name, budget, **(policy_options or {}).get(name, {})) for name, budget in runs]
    # One prefill for every policy, keeping the prompt's last queries for those that index by them.
    shared = prefill_prompts(model, prompts, new_tokens,
                             prompt_queries=max([p.prompt_queries for p in policies], default=0))

    def tokens(policy):
        return generate(model, prompts, new_tokens, policy, stop_at_eos=False, prefilled=shared).tokens

    reference = tokens(FullKV())
    results: dict[str, Any] = {"metric": "agreement", "context": context, "new_tokens": new_tokens,
                               "samples": samples, "token_agreement": {}, "sequence_agreement": {}}
    for (name, budget), policy in tqdm(list(zip(runs, policies)), desc="agreement: policy x budget",
                                       disable=not progress, file=sys.stderr):
        got = tokens(policy)
        same = np.array([[a == b for a, b in zip(g, r)] for g, r in zip(got, reference)])
        results["token_agreement"].setdefault(name, {})[str(budget)] = float(same.mean())
        results["sequence_agreement"].setdefault(name, {})[str(budget)] = float(same.all(axis=1).mean())
    return results
