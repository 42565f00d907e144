"""PG19-style perplexity with the policy active: prefill `context` tokens, then teacher-force `eval_tokens`
one decode step at a time (so decode-time clustering happens as in generation), scoring each next token."""

from __future__ import annotations

import functools
import math
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from clusterkv_jax.cache import init_cache
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.eval.policies import make_policy
from clusterkv_jax.generate import bucket_length, cache_capacity
from clusterkv_jax.model import forward_decode, forward_prefill
from clusterkv_jax.policies import FullKV
from clusterkv_jax.policies.base import KVPolicy


def _nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Negative log-likelihood of targets [B] under logits [B, V] (float32)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnames=("config", "policy", "capacity", "cache_dtype"))
def teacher_forced_nll(params, prompt, lengths, continuation, *, config: ModelConfig, policy: KVPolicy,
                       capacity: int, cache_dtype):
    """prompt [B, T] right-padded with lengths [B]; continuation [B, E] the tokens that follow.

    Returns NLL [B, E] of each continuation token: the first from the prefill logits, the rest from decode
    steps that feed the previous continuation token.
    """
    B = prompt.shape[0]
    cache = init_cache(config, policy, B, capacity, cache_dtype)
    logits, cache = forward_prefill(params, config, policy, prompt, lengths, cache)
    first = _nll(logits, continuation[:, 0])

    def step(cache, tokens):
        feed, target = tokens
        logits, cache = forward_decode(params, config, policy, feed, cache)
        return cache, _nll(logits, target)

    _, rest = jax.lax.scan(step, cache, (continuation[:, :-1].T, continuation[:, 1:].T))
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def check_span(config, context: int, extra: int, extra_name: str) -> None:
    """Refuses a context that is not a positive int, or a context + `extra` more tokens past the model's
    `max_position_embeddings` (RoPE positions the model was not trained for give numbers, not errors)."""
    if isinstance(context, bool) or not isinstance(context, (int, np.integer)) or context < 1:
        raise ValueError(f"--context must be a positive number of tokens, got {context!r}")
    limit = config.max_position_embeddings
    if context + extra > limit:
        raise ValueError(f"--context {context} + {extra_name} {extra} = {context + extra} tokens exceeds the model's "
                         f"max_position_embeddings ({limit})")


def window_offsets(num_tokens: int, span: int, windows: int) -> list[int]:
    """Start offsets of `windows` non-overlapping spans of `span` tokens, evenly spread over the text."""
    if span > num_tokens:
        raise ValueError(f"text has {num_tokens} tokens; one window needs {span}")
    if windows < 1:
        raise ValueError("--windows must be >= 1")
    if windows * span > num_tokens:
        raise ValueError(f"text has {num_tokens} tokens; {windows} windows of {span} do not fit")
    stride = (num_tokens - span) // max(windows - 1, 1)
    return [i * stride for i in range(windows)]


def window_nll(model, token_ids: list[int], offsets: list[int], context: int, eval_tokens: int,
               policy: KVPolicy) -> np.ndarray:
    """NLL [windows, eval_tokens] for each window (processed as one batch)."""
    bucket = bucket_length(context)
    prompt = np.zeros((len(offsets), bucket), np.int32)
    cont = np.zeros((len(offsets), eval_tokens), np.int32)
    for i, o in enumerate(offsets):
        prompt[i, :context] = token_ids[o : o + context]
        cont[i] = token_ids[o + context : o + context + eval_tokens]
    dtype = jax.tree_util.tree_leaves(model.params)[0].dtype
    nll = teacher_forced_nll(model.params, jnp.asarray(prompt), jnp.full((len(offsets),), context, jnp.int32),
                             jnp.asarray(cont), config=model.config, policy=policy,
                             capacity=cache_capacity(bucket, eval_tokens), cache_dtype=dtype)
    return np.asarray(nll)


def run_ppl(model, token_ids: list[int], *, context: int, eval_tokens: int, budgets: list[int],
            policy_names: list[str], windows: int = 1, policy_options: dict[str, dict] | None = None,
            progress: bool = True) -> dict[str, Any]:
    """Perplexity per (policy, budget) and its difference to full KV, averaged over `windows` windows."""
    if eval_tokens < 2:
        raise ValueError("--eval-tokens must be >= 2")
    check_span(model.config, context, eval_tokens, "--eval-tokens")
    offsets = window_offsets(len(token_ids), context + eval_tokens, windows)
    runs = [("full", None)] + [(n, b) for n in policy_names if n != "full" for b in budgets]
    results: dict[str, Any] = {"metric": "perplexity", "context": context, "eval_tokens": eval_tokens,
                               "windows": len(offsets), "ppl": {}, "delta_vs_full": {}}
    for name, budget in tqdm(runs, desc="ppl: policy x budget", disable=not progress, file=sys.stderr):
        policy = FullKV() if name == "full" else make_policy(name, budget, **(policy_options or {}).get(name, {}))
        nll = window_nll(model, token_ids, offsets, context, eval_tokens, policy)
        ppl = float(math.exp(nll.mean()))
        if name == "full":
            results["ppl"]["full"] = {str(b): ppl for b in budgets}
            continue
        results["ppl"].setdefault(name, {})[str(budget)] = ppl
        results["delta_vs_full"].setdefault(name, {})[str(budget)] = ppl - results["ppl"]["full"][str(budget)]
    return results
