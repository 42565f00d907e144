"""PG19-style perplexity with the policy active: prefill `context` tokens, then teacher-force `eval_tokens`
one decode step at a time (so decode-time clustering happens as in generation), scoring each next token.

From the same run, against full KV at every position: next-token top-1 agreement and KL(full || policy) of
the next-token distributions (less noisy than comparing free-running continuations, which diverge for good at
the first different token)."""

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
from clusterkv_jax.policies import make_policy
from clusterkv_jax import sharding as sh
from clusterkv_jax.distributed import to_host
from clusterkv_jax.steps import bucket_length, cache_capacity, in_mesh_scope, pin_cache
from clusterkv_jax.model import forward_decode, forward_prefill
from clusterkv_jax.policies import FullKV
from clusterkv_jax.policies.base import KVPolicy


@functools.partial(jax.jit, static_argnames=("config", "policy", "capacity", "cache_dtype", "keep_log_probs",
                                             "sharding"))
@in_mesh_scope
def teacher_forced(params, prompt, lengths, continuation, reference=None, *, config: ModelConfig, policy: KVPolicy,
                   capacity: int, cache_dtype, keep_log_probs: bool = False, sharding=None) -> dict[str, jax.Array]:
    """prompt [B, T] right-padded with lengths [B]; continuation [B, E] the tokens that follow.

    Scores each continuation token, the first from the prefill logits, the rest from decode steps that feed the
    previous continuation token: {"nll": [B, E]}, plus, given full KV's log-probabilities `reference`
    [B, E, V], "kl" [B, E] (KL(full || policy) of the next-token distributions) and "top1" [B, E] (both put the
    same token first); with `keep_log_probs`, "log_probs" [B, E, V] (to be a later run's reference).
    `sharding`: `clusterkv_jax.sharding.ShardingRules` to keep the cache in its mesh layout.
    """
    B = prompt.shape[0]
    pin = functools.partial(pin_cache, config=config, policy=policy, sharding=sharding)
    cache = pin(init_cache(config, policy, B, capacity, cache_dtype))
    logits, cache = forward_prefill(params, config, policy, prompt, lengths, cache)

    def scored(logits, t, target):  # position t's scores from logits [B, V]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        out = {"nll": -jnp.take_along_axis(logp, target[:, None], axis=-1)[:, 0]}
        if reference is not None:
            ref = jax.lax.dynamic_index_in_dim(reference, t, axis=1, keepdims=False)  # [B, V]
            out["kl"] = jnp.sum(jnp.exp(ref) * (ref - logp), axis=-1)
            out["top1"] = jnp.argmax(logp, axis=-1) == jnp.argmax(ref, axis=-1)
        if keep_log_probs:
            out["log_probs"] = logp
        return out

    first = scored(logits, 0, continuation[:, 0])

    def step(cache, xs):
        t, feed, target = xs
        logits, cache = forward_decode(params, config, policy, feed, pin(cache))
        return pin(cache), scored(logits, t, target)

    E = continuation.shape[1]
    _, rest = jax.lax.scan(step, cache, (jnp.arange(1, E), continuation[:, :-1].T, continuation[:, 1:].T))
    return jax.tree.map(lambda f, r: jnp.concatenate([f[:, None], jnp.moveaxis(r, 0, 1)], axis=1), first, rest)


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


def window_scores(model, token_ids: list[int], offsets: list[int], context: int, eval_tokens: int,
                  policy: KVPolicy, reference: np.ndarray | None = None,
                  keep_log_probs: bool = False) -> dict[str, np.ndarray]:
    """`teacher_forced` for each window (processed as one batch): "nll" [windows, eval_tokens], and "kl",
    "top1" against `reference` / "log_probs" as asked."""
    bucket = bucket_length(context)
    prompt = np.zeros((len(offsets), bucket), np.int32)
    cont = np.zeros((len(offsets), eval_tokens), np.int32)
    for i, o in enumerate(offsets):
        prompt[i, :context] = token_ids[o : o + context]
        cont[i] = token_ids[o + context : o + context + eval_tokens]
    dtype = jax.tree_util.tree_leaves(model.params)[0].dtype
    lengths = np.full((len(offsets),), context, np.int32)
    mesh = getattr(model, "mesh", None)
    if mesh is None:
        place, rules, params = jnp.asarray, None, model.params
    else:  # the model's mesh (load_model(mesh=...)): windows on "data", KV heads on "model"
        rules = sh.sharding_rules(model.config, mesh, len(offsets))
        params = sh.shard_params(model.params, model.config, rules)
        place = functools.partial(sh.shard_batch, mesh_or_rules=rules)
    out = teacher_forced(params, place(prompt), place(lengths), place(cont),
                         None if reference is None else place(reference), config=model.config, policy=policy,
                         capacity=cache_capacity(bucket, eval_tokens), cache_dtype=dtype,
                         keep_log_probs=keep_log_probs, sharding=rules)
    return to_host(out)


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
                               "windows": len(offsets), "ppl": {}, "delta_vs_full": {}, "top1_agreement": {},
                               "kl_vs_full": {}}
    reference = None  # full KV's next-token log-probabilities [windows, eval_tokens, V]
    for name, budget in tqdm(runs, desc="ppl: policy x budget", disable=not progress, file=sys.stderr):
        policy = FullKV() if name == "full" else make_policy(name, budget, **(policy_options or {}).get(name, {}))
        scores = window_scores(model, token_ids, offsets, context, eval_tokens, policy, reference,
                               keep_log_probs=name == "full")
        ppl = float(math.exp(scores["nll"].mean()))
        if name == "full":
            results["ppl"]["full"] = {str(b): ppl for b in budgets}
            reference = scores["log_probs"]
            continue
        results["ppl"].setdefault(name, {})[str(budget)] = ppl
        results["delta_vs_full"].setdefault(name, {})[str(budget)] = ppl - results["ppl"]["full"][str(budget)]
        results["top1_agreement"].setdefault(name, {})[str(budget)] = float(scores["top1"].mean())
        results["kl_vs_full"].setdefault(name, {})[str(budget)] = float(scores["kl"].mean())
    return results
