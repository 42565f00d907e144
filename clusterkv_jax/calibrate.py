"""A learned cluster score for ClusterKV (`score="calibrated"`), fitted with optax on calibration text.

ClusterKV fills a token budget with whole clusters, best first, so the right order is by each cluster's share of
the attention mass per member token. The paper ranks by q·μ; `score="density"` models the per-token share with
a Gaussian per cluster. Here, per layer and query head, three weights w define

    s_c = w0 · (q·μ_c)/√H  +  w1 · ½ Σ_h q_h² σ²_ch / H  +  w2 · log n_c

(w = (1, 1, 0) is "density"; (1, 0, 0) ranks as the paper does), fitted so that softmax_c(s_c + log n_c), the
modelled share of each cluster in the mass, matches the true share: cross-entropy against the attention mass
that the prompt's last `queries` queries put on the clusters of the tokens before them (sinks excluded),
minimised with optax's Adam. A perfect fit ranks clusters by their true mass per token.

`collect_samples` runs one prefill of the calibration text; `fit_weights` fits; `save` / `load` keep the weights
as JSON with the ClusterKV settings they were fitted for. `rank_recall` estimates the mass a greedy fill by any
score keeps on held-apart samples (the trimmed cluster counted pro rata), to compare scores before a full
`eval recall`.

Shapes: L model layers, n selecting layers, B batch, N query heads, K KV heads, G = N // K, Q queries per
sequence, S capacity, C cluster slots, H head dim, F = 3 features.
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
import optax
from tqdm.auto import tqdm

from clusterkv_jax.cache import init_cache
from clusterkv_jax.policies.base import KVPolicy
from clusterkv_jax.policies.clusterkv import ClusterKV

FEATURES = ("dot", "spread", "log_size")
DENSITY = (1.0, 1.0, 0.0)  # the weights that make the calibrated score equal score="density"
FORMAT = "clusterkv-score-calibration/1"


def score_features(centroids, variances, sizes, q):
    """The F features of every (query, cluster): q [..., G, Q, H] against one KV head's clusters centroids and
    variances [..., C, H], sizes [..., C] -> [..., G, Q, C, F] float32."""
    H = q.shape[-1]
    q = q.astype(jnp.float32)
    dot = jnp.einsum("...GQH,...CH->...GQC", q, centroids) / H ** 0.5
    spread = 0.5 * jnp.einsum("...GQH,...CH->...GQC", q * q, variances) / H
    log_size = jnp.broadcast_to(jnp.log(jnp.maximum(sizes, 1).astype(jnp.float32))[..., None, None, :], dot.shape)
    return jnp.stack([dot, spread, log_size], axis=-1)


@flax.struct.dataclass
class Samples:
    """One selecting layer's calibration samples (stacked over layers: a leading [n])."""

    queries: jax.Array  # [B, N, Q, H] float32 the prompt's last Q queries
    features: jax.Array  # [B, K, G, Q, C, F] float32
    mass: jax.Array  # [B, K, G, Q, C] float32 each cluster's share of the mass on clustered tokens
    sizes: jax.Array  # [B, K, C] int32 (0: unused slot)
    index: Any = None  # the ClusterKV index of the clustered tokens (dropped after prefill)


@dataclasses.dataclass(frozen=True)
class _Sampler(KVPolicy):
    """Prefill-only policy: clusters each prompt's tokens before its last `queries` (as `policy` would cluster a
    prompt of that length) and records what those queries see of the clusters."""

    policy: ClusterKV = None
    queries: int = 128

    @property
    def full_layers(self) -> int:
        return self.policy.full_layers

    @property
    def prompt_queries(self) -> int:
        return self.queries

    def init_state(self, config, batch_size, capacity):
        B, N, K, H = batch_size, config.num_heads, config.num_kv_heads, config.head_dim
        G, Q, C = N // K, self.queries, self.policy.prompt_cluster_slots(capacity)
        return Samples(queries=jnp.zeros((B, N, Q, H), jnp.float32),
                       features=jnp.zeros((B, K, G, Q, C, len(FEATURES)), jnp.float32),
                       mass=jnp.zeros((B, K, G, Q, C), jnp.float32), sizes=jnp.zeros((B, K, C), jnp.int32),
                       index=self.policy.init_state(config, batch_size, capacity))

    def observe_queries(self, state, queries, found):
        keep = found[:, None, :, None]
        return state.replace(queries=jnp.where(keep, queries, state.queries))

    def after_prefill(self, state, keys, lengths):
        B, K, S, H = keys.shape
        N, Q = state.queries.shape[1], self.queries
        G, C = N // K, state.sizes.shape[-1]
        clustered = lengths - Q  # the queries' positions come after every clustered token
        index = self.policy.after_prefill(state.index, keys, clustered)
        C = min(C, index.sizes.shape[-1])
        sizes, centroids, variances = index.sizes[..., :C], index.centroids[..., :C, :], index.variances[..., :C, :]
        q = state.queries.reshape(B, K, G, Q, H)
        # Each store row's cluster: rows [block_start·bs, block_start·bs + size) hold a cluster's members.
        bs = self.policy.block_size
        rows = jnp.arange(index.row_positions.shape[-1])
        first_row = index.block_start[..., :C] * bs  # [B, K, C]
        member = ((rows[None, None, None, :] >= first_row[..., None])
                  & (rows[None, None, None, :] < (first_row + sizes)[..., None]))  # [B, K, C, R]
        positions = jnp.clip(index.row_positions, 0, S - 1)  # [B, K, R]
        row_keys = jnp.take_along_axis(keys.astype(jnp.float32), positions[..., None], axis=2)  # [B, K, R, H]
        in_cluster = jnp.any(member, axis=2)  # [B, K, R]
        logits = jnp.einsum("BKGQH,BKRH->BKGQR", q, row_keys) / H ** 0.5
        logits = jnp.where(in_cluster[:, :, None, None], logits, -jnp.inf)
        probs = jax.nn.softmax(logits, axis=-1)
        mass = jnp.einsum("BKGQR,BKCR->BKGQC", probs, member.astype(jnp.float32))
        features = score_features(centroids, variances, sizes, q)
        pad = state.sizes.shape[-1] - C
        return state.replace(
            features=jnp.pad(features, ((0, 0),) * 4 + ((0, pad), (0, 0))),
            mass=jnp.pad(mass, ((0, 0),) * 4 + ((0, pad),)),
            sizes=jnp.pad(sizes, ((0, 0), (0, 0), (0, pad))),
        )


def collect_samples(model, token_ids, *, policy: ClusterKV, context: int, queries: int = 128) -> Samples:
    """Prefills `context` tokens of `token_ids` and returns every selecting layer's samples (leading [n])."""
    from clusterkv_jax.generate import bucket_length, prefill

    policy = dataclasses.replace(policy, score="density", score_weights=())  # the samples need member variances
    if len(token_ids) < context:
        raise ValueError(f"calibration text has {len(token_ids)} tokens; --context {context} needs more")
    if not 0 < queries < context - policy.sinks - policy.tokens_per_cluster:
        raise ValueError(f"queries={queries} must be in [1, context - sinks - tokens_per_cluster)")
    sampler = _Sampler(policy=policy, queries=queries)
    bucket = bucket_length(context)
    dtype = jax.tree_util.tree_leaves(model.params)[0].dtype
    cache = init_cache(model.config, sampler, 1, bucket, dtype)
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :context] = token_ids[:context]
    _, cache = prefill(model.params, jnp.asarray(tokens), jnp.array([context], jnp.int32), cache,
                       config=model.config, policy=sampler)
    return cache.policy_state


def _loss(weights, features, mass, valid):
    """Mean cross-entropy of the true cluster shares `mass` [Q, C] against softmax(s + log n) over the valid
    [Q, C] clusters, for one head: weights [F], features [Q, C, F]."""
    score = features @ weights + features[..., 2]  # s_c + log n_c
    log_p = jax.nn.log_softmax(jnp.where(valid, score, -jnp.inf), axis=-1)
    return -jnp.mean(jnp.sum(jnp.where(valid, mass * log_p, 0.0), axis=-1))


def fit_weights(samples: Samples, *, steps: int = 300, learning_rate: float = 0.05, progress: bool = True):
    """Weights [n, N, F] (per selecting layer and query head) minimising the cross-entropy, from DENSITY."""
    if not (np.isfinite(learning_rate) and learning_rate > 0) or steps < 1:
        raise ValueError(f"need learning_rate > 0 and steps >= 1, got {learning_rate} and {steps}")
    n, B, K, G = samples.mass.shape[:4]
    # [n, K, G, B·Q, C(, F)]: one problem per (layer, query head).
    per_head = lambda x: jnp.moveaxis(x, 1, 3).reshape(n, K, G, -1, *x.shape[5:])  # noqa: E731
    features, mass = per_head(samples.features), per_head(samples.mass)
    valid = per_head(jnp.broadcast_to(samples.sizes[:, :, :, None, None, :] > 0, samples.mass.shape))
    loss = jax.vmap(jax.vmap(jax.vmap(_loss)))  # over n, K, G
    total = lambda w: jnp.sum(loss(w, features, mass, valid))  # noqa: E731
    optimizer = optax.adam(learning_rate)
    weights = jnp.broadcast_to(jnp.asarray(DENSITY, jnp.float32), (n, K, G, len(FEATURES)))
    opt_state = optimizer.init(weights)

    @jax.jit
    def step(weights, opt_state):
        value, grad = jax.value_and_grad(total)(weights)
        updates, opt_state = optimizer.update(grad, opt_state, weights)
        return optax.apply_updates(weights, updates), opt_state, value

    for _ in tqdm(range(steps), desc="calibrate: fit", disable=not progress, file=sys.stderr):
        weights, opt_state, value = step(weights, opt_state)
    return weights.reshape(n, K * G, len(FEATURES)), float(value) / (n * K * G)


def rank_recall(samples: Samples, weights, budgets, sinks: int) -> dict[int, float]:
    """Mean mass share (over clustered tokens) kept by filling budget - sinks tokens with clusters in the order of
    the score `weights` [n, N, F] (None: the true mass per token, an upper bound for any cluster score); the last
    cluster counted pro rata."""
    f = np.asarray(samples.features)  # [n, B, K, G, Q, C, F]
    mass = np.asarray(samples.mass)
    sizes = np.asarray(samples.sizes)[:, :, :, None, None, :]  # [n, B, K, 1, 1, C]
    n, B, K, G = mass.shape[:4]
    if weights is None:
        score = mass / np.maximum(sizes, 1)
    else:
        w = np.asarray(weights).reshape(n, 1, K, G, 1, 1, len(FEATURES))
        score = np.sum(f * w, axis=-1)
    score = np.where(sizes > 0, score, -np.inf)
    order = np.argsort(-score, axis=-1, kind="stable")
    ranked_sizes = np.take_along_axis(np.broadcast_to(sizes, score.shape), order, axis=-1)
    ranked_mass = np.take_along_axis(mass, order, axis=-1)
    before = np.cumsum(ranked_sizes, axis=-1) - ranked_sizes
    out = {}
    for budget in budgets:
        taken = np.clip(budget - sinks - before, 0, ranked_sizes) / np.maximum(ranked_sizes, 1)
        out[budget] = float(np.mean(np.sum(taken * ranked_mass, axis=-1)))
    return out


def save(path: str, weights, config, *, policy: ClusterKV, about: dict[str, Any]) -> None:
    """Writes the weights [n, N, F] of the selecting layers as JSON, per model layer (the full layers, which never
    select, hold DENSITY), with the settings they were fitted for and `about` (text, context, loss...)."""
    weights = np.asarray(weights, np.float64)
    first = config.num_layers - weights.shape[0]
    full = np.broadcast_to(np.asarray(DENSITY), (first, config.num_heads, len(FEATURES)))
    data = {
        "format": FORMAT,
        "features": list(FEATURES),
        "num_layers": config.num_layers,
        "num_heads": config.num_heads,
        "fitted_for": {"tokens_per_cluster": policy.tokens_per_cluster, "sinks": policy.sinks,
                       "full_layers": policy.full_layers, "max_iters": policy.max_iters},
        **about,
        "weights": np.concatenate([full, weights]).round(6).tolist(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)  # never a half-written file at `path`


def load_weights(path: str) -> tuple:
    """The weights of a file written by `save`, as ClusterKV's `score_weights` (nested tuples [L][N][F])."""
    from clusterkv_jax.config import read_json_object

    data = read_json_object(path)
    if data.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a score calibration (format {data.get('format')!r}, expected {FORMAT!r})")
    try:
        weights = np.asarray(data.get("weights"), np.float32)
    except (TypeError, ValueError):  # ragged lists, strings
        weights = np.zeros(0)
    if weights.ndim != 3 or weights.shape[-1] != len(FEATURES) or not np.all(np.isfinite(weights)):
        raise ValueError(f"{path!r}: weights must be finite numbers shaped [layers][query heads][{len(FEATURES)}]")
    return tuple(tuple(tuple(float(x) for x in head) for head in layer) for layer in weights)
