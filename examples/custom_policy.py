"""A new KV selection policy in under 40 lines, used with `generate` like the built-in ones.

`LowKeyNorm` attends the sinks, the `recent` latest tokens, and the prompt tokens whose keys have the
smallest L2 norm (a query-independent heuristic: low-norm keys tend to draw high attention; Devoto et al.,
2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"). Like StreamingLLM it is not
recallable: the norm ranking is fixed after prefill, whatever the queries later ask for.

The hooks (see `clusterkv_jax/policies/base.py`; shapes: B batch, N query heads, K KV heads, S cache
capacity, H head dim). `clusterkv_jax.attend` calls them inside the model's `lax.scan` over the layers >=
`full_layers`, one layer at a time, so everything is traced: static shapes, no Python branching on array values.
A policy only chooses tokens: reading their keys and values (from device or host memory) and attending is
`clusterkv_jax.attend`'s job.

- `init_state(config, batch_size, capacity)`: one layer's empty state, a pytree of arrays (the model stacks
  one per selecting layer). Here: the chosen positions [B, K, M].
- `after_prefill(state, keys, lengths)`: called once per layer after the prompt, with that layer's post-RoPE
  keys [B, K, S, H] (rows >= lengths[b] are padding); returns the layer's new state. Here: rank the norms.
- `select(state, q, keys, lengths, prompt_lengths)`: the budgeted selection for the new token's queries
  q [B, N, H]: `ckv.Selection.of_rows(idx, mask)`, positions and a validity mask [B, N, M] (one set per query
  head) or [B, K, M] (one per KV head, shared by its query heads). `keys` is None unless the policy sets
  `reads_all_keys`. The recall evaluation calls it too.
- `selection_shape(config, batch_size, capacity)`: (B, h, M, 1) of that selection (M chunks of 1 row),
  declared so that buffers (host offload's recall cache) can be sized before anything runs.
- Optional: `window_size` / `window_start` / `index_recent`, a window of recent tokens the policy has not
  indexed yet, attended in full (ClusterKV's not-yet-clustered tokens); `covers` / `covers_now`, when the
  selection would hold every token (then a step attends the whole layer, as full KV does); `metadata_bytes`
  for the roofline; `layout`, where the store keeps each token when not row = position (a
  `clusterkv_jax.policies.layout.RowLayout`: ClusterKV keeps each cluster's members in consecutive rows).

A policy is a frozen dataclass, so it is hashable and `jax.jit` treats it as a static argument: each
distinct setting compiles once. Budget rule: B counts every attended token, sinks and recent ones included.

    python examples/custom_policy.py [--budget 128] [--max-new-tokens 32]

Environment (used by the tests): CLUSTERKV_EXAMPLE_MODEL, the converted checkpoint (default: the bundled
SmolLM2-135M-Instruct, converted once); CLUSTERKV_EXAMPLE_FAST=1, a short prompt and few tokens;
CLUSTERKV_EXAMPLE_TEXT, the text the prompt is taken from (default: a short built-in story).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import jax
import jax.numpy as jnp

import clusterkv_jax as ckv
from clusterkv_jax.policies.common import expand_heads, recent_window, sink_slots


# --- the policy (31 lines) ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LowKeyNorm(ckv.KVPolicy):
    budget: int = 128
    sinks: int = 4
    recent: int = 32
    full_layers: int = 2

    def __post_init__(self):
        if self.budget <= self.sinks + self.recent:
            raise ValueError(f"budget={self.budget} must exceed sinks + recent = {self.sinks + self.recent}")

    def init_state(self, config, batch_size, capacity):
        slots = min(self.budget - self.sinks - self.recent, capacity)  # positions ranked by key norm
        return jnp.zeros((batch_size, config.num_kv_heads, slots), jnp.int32)

    def selection_shape(self, config, batch_size, capacity):
        ranked = min(self.budget - self.sinks - self.recent, capacity)
        return (batch_size, config.num_kv_heads, self.sinks + ranked + self.recent, 1)

    def after_prefill(self, state, keys, lengths):
        pos = jnp.arange(keys.shape[2])
        ok = (pos[None, :] >= self.sinks) & (pos[None, :] < lengths[:, None])  # [B, S] rankable rows
        norms = jnp.linalg.norm(keys.astype(jnp.float32), axis=-1)  # [B, K, S]
        norms = jnp.where(ok[:, None, :], norms, jnp.inf)
        return jax.lax.top_k(-norms, state.shape[-1])[1].astype(jnp.int32)  # [B, K, slots] smallest norms

    def select(self, state, q, keys, lengths, prompt_lengths):
        K = state.shape[1]
        s_idx, s_mask = sink_slots(lengths, self.sinks)  # [B, sinks]
        start = jnp.maximum(jnp.minimum(lengths, self.sinks), lengths - self.recent)  # window start [B]
        r_idx, r_mask = recent_window(lengths, start, self.recent)  # [B, recent]
        # Ranked positions count only inside the prompt, past the sinks and before the window: no duplicates.
        n_mask = (state >= self.sinks) & (state < jnp.minimum(prompt_lengths, start)[:, None, None])
        idx = jnp.concatenate([expand_heads(s_idx, K), state, expand_heads(r_idx, K)], axis=-1)
        mask = jnp.concatenate([expand_heads(s_mask, K), n_mask, expand_heads(r_mask, K)], axis=-1)
        return ckv.Selection.of_rows(idx, mask)  # [B, K, budget]: one selection per KV head, ranking fixed


# --- using it -------------------------------------------------------------------------------------------
def main() -> None:
    from clusterkv_jax.cli import smollm2_model_dir
    from clusterkv_jax.demo_text import DEMO_DOCUMENT

    fast = os.environ.get("CLUSTERKV_EXAMPLE_FAST", "") not in ("", "0")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.environ.get("CLUSTERKV_EXAMPLE_MODEL"))
    p.add_argument("--budget", type=int, default=64 if fast else 128)
    p.add_argument("--max-new-tokens", type=int, default=8 if fast else 32)
    args = p.parse_args()

    model = ckv.load_model(args.model or smollm2_model_dir())
    text = DEMO_DOCUMENT
    if os.environ.get("CLUSTERKV_EXAMPLE_TEXT"):
        with open(os.environ["CLUSTERKV_EXAMPLE_TEXT"], encoding="utf-8") as f:
            text = f.read(4000 if fast else 16000)
    prompt = model.tokenizer.encode(text, add_special_tokens=False)[: 200 if fast else 1500]
    print(f"prompt: {len(prompt)} tokens of text; greedy continuation of up to {args.max_new_tokens} tokens\n")

    runs = {"full KV": ckv.FullKV(),
            f"LowKeyNorm B={args.budget}": LowKeyNorm(budget=args.budget, recent=args.budget // 4),
            # A budget covering every token attends exactly what full KV attends: the same tokens.
            "LowKeyNorm B=everything": LowKeyNorm(budget=len(prompt) + args.max_new_tokens + 8,
                                                 recent=args.max_new_tokens + 4)}
    results = {name: ckv.generate(model, prompt, args.max_new_tokens, policy=policy) for name, policy in runs.items()}
    full = results["full KV"].tokens[0]
    for name, r in results.items():
        same = sum(a == b for a, b in zip(r.tokens[0], full))
        print(f"[{name}] {r.texts[0]!r}\n    same token as full KV at {same} of {len(full)} positions"
              f"{' (identical)' if r.tokens[0] == full else ''}")


if __name__ == "__main__":
    main()
