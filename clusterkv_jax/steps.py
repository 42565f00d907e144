"""The jitted steps a caller drives a loop with: `prefill` a batch of prompts, `decode_step` one token each,
`index_due_windows` between steps; and the shapes they take (`bucket_length`, `cache_capacity`).

Each step donates its cache and compiles once per (batch, bucket, capacity, policy). `sharding` (the
`clusterkv_jax.sharding.ShardingRules` of a sharded cache) keeps the cache in its mesh layout.
"""

from __future__ import annotations

import contextlib
import functools

import jax

from clusterkv_jax import attend as attend_module
from clusterkv_jax import sharding as sh
from clusterkv_jax.cache import KVCache
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.model import forward_decode, forward_prefill
from clusterkv_jax.ops import sharded_trace
from clusterkv_jax.policies import KVPolicy

CAPACITY_MULTIPLE = 128
#: The event jax records for each program it compiles (`jax.monitoring`).
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def counting_compiles():
    """Counts the programs jax compiles inside the block: yields a list whose one item is the count so far."""
    count = [0]

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def in_mesh_scope(fn):
    """Traces fn(..., sharding=ShardingRules) for the rules' mesh (`ops.sharded_trace`), so mesh-aware ops
    (`ops.top_k_indices`, the Pallas kernels through `ops.per_shard`) pick their per-shard forms; without
    `sharding` nothing changes."""
    @functools.wraps(fn)
    def traced(*args, sharding=None, **kwargs):
        if sharding is None:
            return fn(*args, **kwargs)
        with sharded_trace(sharding.shard_axes):
            return fn(*args, sharding=sharding, **kwargs)

    return traced


def pin_cache(cache: KVCache, config: ModelConfig, policy: KVPolicy, sharding) -> KVCache:
    """Inside jit, with ShardingRules: keeps every cache leaf in its mesh layout (see clusterkv_jax.sharding)."""
    if sharding is None:
        return cache
    shardings = sh.cached_cache_shardings(config, policy, cache.batch_size, cache.capacity, cache.dtype, sharding)
    return sh.constrain_cache(cache, shardings)


@functools.partial(jax.jit, static_argnames=("config", "policy", "all_logits", "sharding", "chunk"),
                   donate_argnames=("cache",))
@in_mesh_scope
def prefill(params, tokens, lengths, cache: KVCache, *, config: ModelConfig, policy: KVPolicy,
            all_logits: bool = False, sharding=None, chunk: int | None = None):
    """tokens [B, T] right-padded, lengths [B] -> (logits [B, V] at each last prompt token, or [B, T, V]
    with `all_logits`; the filled cache). The input cache is donated. `sharding`: the
    `clusterkv_jax.sharding.ShardingRules` of a sharded cache (from `init_cache_sharded`), kept on return."""
    cache = pin_cache(cache, config, policy, sharding)
    logits, cache = forward_prefill(params, config, policy, tokens, lengths, cache, all_logits=all_logits,
                                    chunk=chunk)
    return logits, pin_cache(cache, config, policy, sharding)


@functools.partial(jax.jit, static_argnames=("config", "policy", "sharding", "index"), donate_argnames=("cache",))
@in_mesh_scope
def decode_step(params, tokens, cache: KVCache, *, config: ModelConfig, policy: KVPolicy, sharding=None,
                index: bool = True):
    """tokens [B] -> (logits [B, V], cache with the tokens appended). The input cache is donated.
    `sharding`: as for `prefill`. The caller keeps cache.lengths < cache.capacity (a traced length cannot
    raise under jit; a full cache does not store the new token's KV): size it with `cache_capacity`, as
    `generate` does. The step first indexes the windows that are due; `index=False` is the step as `generate`'s
    loop runs it, for a caller that indexes them itself (`index_due_windows`) before they fall due
    (`attend.steps_until_due`)."""
    cache = pin_cache(cache, config, policy, sharding)
    logits, cache = forward_decode(params, config, policy, tokens, cache, index=index)
    return logits, pin_cache(cache, config, policy, sharding)


@functools.partial(jax.jit, static_argnames=("config", "policy", "sharding"), donate_argnames=("cache",))
@in_mesh_scope
def index_due_windows(cache: KVCache, *, config: ModelConfig, policy: KVPolicy, sharding=None):
    """-> (the cache with the selecting layers' due windows indexed, the decode steps that can then run with
    `decode_step(..., index=False)` before the next may fall due ([] int32; None where no layer indexes a window)).
    The input cache is donated."""
    return index_due(pin_cache(cache, config, policy, sharding), policy,
                     functools.partial(pin_cache, config=config, policy=policy, sharding=sharding))


def index_due(cache: KVCache, policy: KVPolicy, pin):
    """`index_due_windows` inside a trace (`pin` keeps the cache's layout)."""
    groups = attend_module.index_windows(policy, cache.groups, cache.lengths, cache.prompt_lengths, cache.capacity)
    cache = pin(cache.replace(groups=groups))
    return cache, attend_module.steps_until_due(policy, groups, cache.lengths, cache.prompt_lengths, cache.capacity)


def bucket_length(n: int) -> int:
    """Prompt shape bucket: powers of two from 64 to 1024, then multiples of 1024."""
    if n <= 1024:
        return max(64, 1 << (n - 1).bit_length())
    return -(-n // 1024) * 1024


def cache_capacity(bucket: int, max_new_tokens: int) -> int:
    """Positions a cache holds for a prompt bucket and `max_new_tokens`: their sum rounded up to a multiple of
    CAPACITY_MULTIPLE and, from 16k on, of 2^(⌊log2 n⌋ − 6) (at most 1/64 more). XLA:GPU splits the attention's
    probabilities-times-V product over the sequence, and pads a length its split does not divide: a copy of the
    layer's V at every decode step (deviceless H100: at 32,896 positions 67 MB a layer; at 33,280, none)."""
    n = bucket + max_new_tokens
    granule = max(CAPACITY_MULTIPLE, 1 << max(0, n.bit_length() - 7))
    return -(-n // granule) * granule
