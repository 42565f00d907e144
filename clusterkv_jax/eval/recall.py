"""Recall of the budgeted selection: how much of the true top-B tokens and of the attention mass each policy
keeps, measured on the exact (full-KV) decode trajectory.

`RecallProbe` is itself a KVPolicy that covers every token: the model attends to the whole cache (so every policy
sees the same queries and keys), while the probe, observing each decode step, asks each wrapped policy for its
selection and accumulates, per layer,
  token recall  |selected ∩ true top-B by q·k| / min(B, prompt)   over the prompt tokens, and
  mass recall   Σ_{selected} softmax(q·k / √H) over the prompt,
averaged over query heads and sequences. One prefill and one decode loop serve every (policy, budget).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from clusterkv_jax import axes
from clusterkv_jax.attend import DecodeProbe, index_window
from clusterkv_jax.cache import init_cache
from clusterkv_jax.eval.report import json_safe
from clusterkv_jax.steps import bucket_length, cache_capacity, decode_step, prefill
from clusterkv_jax.policies import KVPolicy, make_policy


@flax.struct.dataclass
class ProbeState:
    layer: jax.Array = axes.field()  # [] this layer's index in the model (stacked: [n])
    inner: tuple  # each wrapped policy's layer state
    token_recall: jax.Array = axes.field("policies")  # [P] sums over steps
    mass_recall: jax.Array = axes.field("policies")  # [P]
    steps: jax.Array = axes.field()  # [] decode steps measured


@dataclasses.dataclass(frozen=True)
class RecallProbe(KVPolicy, DecodeProbe):
    policies: tuple = ()
    budgets: tuple = ()  # the budget B each policy is scored against
    reads_all_keys = True

    @property
    def full_layers(self) -> int:  # the model hands every layer >= the smallest full_layers to the probe
        return min(p.full_layers for p in self.policies)

    def init_states(self, config, batch_size, capacity, layers):
        n, P = len(layers), len(self.policies)
        return ProbeState(
            layer=jnp.asarray(tuple(layers), jnp.int32),
            inner=tuple(p.init_states(config, batch_size, capacity, layers) for p in self.policies),
            token_recall=jnp.zeros((n, P), jnp.float32),
            mass_recall=jnp.zeros((n, P), jnp.float32),
            steps=jnp.zeros((n,), jnp.int32),
        )

    @property
    def prompt_queries(self) -> int:
        return max(p.prompt_queries for p in self.policies)

    def observe_queries(self, state, queries, found):
        n = queries.shape[2]
        inner = tuple(p.observe_queries(s, queries[:, :, n - p.prompt_queries:], found[:, n - p.prompt_queries:])
                      if p.prompt_queries else s for p, s in zip(self.policies, state.inner))
        return state.replace(inner=inner)

    def after_prefill(self, state, keys, lengths):
        inner = tuple(
            jax.lax.cond(state.layer >= p.full_layers, lambda s, p=p: p.after_prefill(s, keys, lengths),
                         lambda s: s, s)
            for p, s in zip(self.policies, state.inner)
        )
        return state.replace(inner=inner)

    def covers(self, capacity):
        return True  # the model attends to every token, so every policy sees the exact trajectory

    def observe_decode(self, state, q, kv, lengths, prompt_lengths):
        """Scores each wrapped policy's selection, made as in its own decode step: its index advanced first."""
        keys = kv.keys()
        B, N, H = q.shape
        K, S = keys.shape[1], keys.shape[2]
        G = N // K
        # [B, N, S] exact scores over the prompt
        scores = jnp.einsum("BKGH,BKSH->BKGS", q.reshape(B, K, G, H), keys,
                            preferred_element_type=jnp.float32).reshape(B, N, S) / (H ** 0.5)
        in_prompt = (jnp.arange(S)[None, :] < prompt_lengths[:, None])[:, None, :]  # [B, 1, S]
        scores = jnp.where(in_prompt, scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        sorted_desc = -jnp.sort(-scores, axis=-1)
        token_recall, mass_recall, inner = [], [], []
        for p, budget, s in zip(self.policies, self.budgets, state.inner):
            active = state.layer >= p.full_layers
            # Advance the wrapped policy as it advances itself (decode-time clusters, pages, ... from the tokens
            # stored before this step: `attend.index_windows`), then select. This store is position-ordered: the
            # window's keys are read by position, whatever the policy's own layout.
            s = jax.lax.cond(active, lambda s, p=p: index_window(p, s, kv, lengths - 1, prompt_lengths,
                                                                 rows_of=lambda x: x),
                             lambda s: s, s)
            idx, mask = p.selected_positions(s, q, keys, lengths, prompt_lengths)
            if idx.shape[1] != N:  # one selection per KV head, shared by its query heads
                idx, mask = jnp.repeat(idx, G, axis=1), jnp.repeat(mask, G, axis=1)
            chosen = jnp.zeros((B, N, S), jnp.float32)
            idx = jnp.where(mask, idx, 0)
            chosen = jax.vmap(jax.vmap(lambda c, i, m: c.at[i].max(m.astype(jnp.float32))))(chosen, idx, mask)
            chosen = chosen * in_prompt
            k = jnp.minimum(budget, prompt_lengths)  # [B]
            kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None, None].repeat(N, 1), axis=-1)  # [B, N, 1]
            top = (scores >= kth) & in_prompt
            hits = jnp.sum(chosen * top, axis=-1) / k[:, None]
            mass = jnp.sum(chosen * probs, axis=-1)
            token_recall.append(jnp.where(active, jnp.mean(hits), 0.0))
            mass_recall.append(jnp.where(active, jnp.mean(mass), 0.0))
            inner.append(s)
        return state.replace(
            inner=tuple(inner),
            token_recall=state.token_recall + jnp.stack(token_recall),
            mass_recall=state.mass_recall + jnp.stack(mass_recall),
            steps=state.steps + 1,
        )

    def summary(self, state: ProbeState) -> list[tuple[float, float]]:
        """(token recall, mass recall) per wrapped policy, averaged over steps and its selecting layers."""
        token = np.asarray(state.token_recall)
        mass = np.asarray(state.mass_recall)
        steps = np.asarray(state.steps)
        layer = np.asarray(state.layer)
        out = []
        for i, p in enumerate(self.policies):
            layers = layer >= p.full_layers
            n = steps[layers].sum()
            out.append((float(token[layers, i].sum() / n), float(mass[layers, i].sum() / n)))
        return out


def run_recall(
    model,
    token_ids: list[int],
    *,
    context: int,
    steps: int,
    budgets: list[int],
    policy_names: list[str],
    policy_options: dict[str, dict[str, Any]] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Prefills `context` tokens, teacher-forces `steps` more, and scores every (policy, budget)."""
    from clusterkv_jax.eval.ppl import check_span

    check_span(model.config, context, steps, "--steps")
    if len(token_ids) < context + steps:
        raise ValueError(f"text has {len(token_ids)} tokens; --context {context} + --steps {steps} needs more")
    if steps < 1:
        raise ValueError("--steps must be >= 1")
    combos = [(n, b) for n in policy_names for b in budgets]
    probe = RecallProbe(
        policies=tuple(make_policy(n, b, **(policy_options or {}).get(n, {})) for n, b in combos),
        budgets=tuple(b for _, b in combos),
    )
    config = model.config
    idle = sorted({n for (n, _), p in zip(combos, probe.policies) if p.full_layers >= config.num_layers})
    if idle:  # their recall would be 0 / 0
        raise ValueError(f"the model has {config.num_layers} layers and {', '.join(idle)} attend(s) to every token in "
                         "the first full_layers of them: no layer selects, so there is no recall to measure; lower "
                         f"full_layers below {config.num_layers} (--full-layers, --POLICY-full-layers)")
    bucket = bucket_length(context)
    dtype = jax.tree_util.tree_leaves(model.params)[0].dtype
    cache = init_cache(config, probe, 1, cache_capacity(bucket, steps), dtype)
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :context] = token_ids[:context]
    _, cache = prefill(model.params, jnp.asarray(tokens), jnp.array([context], jnp.int32), cache,
                       config=config, policy=probe)
    for i in tqdm(range(steps), desc="recall: decode steps", disable=not progress, file=sys.stderr):
        nxt = jnp.array([token_ids[context + i]], jnp.int32)
        _, cache = decode_step(model.params, nxt, cache, config=config, policy=probe)
    results: dict[str, Any] = {"token_recall": {}, "mass_recall": {}, "context": context, "steps": steps}
    for (name, budget), (token, mass) in zip(combos, probe.summary(cache.policy_state)):
        results["token_recall"].setdefault(name, {})[str(budget)] = token
        results["mass_recall"].setdefault(name, {})[str(budget)] = mass
    return results


def format_table(results: dict[str, Any]) -> str:
    """Markdown table: policy × budget, 'token recall / mass recall'."""
    token, mass = results["token_recall"], results["mass_recall"]
    budgets = list(next(iter(token.values())).keys())
    lines = ["| policy | " + " | ".join(f"B={b}" for b in budgets) + " |",
             "|---|" + "---|" * len(budgets)]
    for name in token:
        cells = [f"{token[name][b]:.3f} / {mass[name][b]:.3f}" for b in budgets]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n(cells: top-B token recall / attention-mass recall)"


def write_json(results: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(json_safe(results), f, indent=2, allow_nan=False)

