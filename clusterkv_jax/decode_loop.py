"""The decode loop: prefill and the first token (`start_generation`), then decode steps in a `lax.while_loop`
until each sequence's EOS or `max_new_tokens` (`decode_generation`), run in chunks that return to Python
(`decode_in_chunks`), or both in one program (`generate_ids`).

Steps run in intervals where layers index windows of generated tokens: the due windows are indexed between
intervals, so a step holds no branch.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from clusterkv_jax import attend as attend_module
from clusterkv_jax.cache import KVCache, init_cache
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.distributed import agreed, to_host
from clusterkv_jax.model import forward_decode, forward_prefill
from clusterkv_jax.policies import FullKV, KVPolicy
from clusterkv_jax.policies.full import FullKVKeepingQueries
from clusterkv_jax.sampling import Sampling, sample_tokens
from clusterkv_jax.steps import in_mesh_scope, index_due, pin_cache


@flax.struct.dataclass
class DecodeLoop:
    """The state of `generate_ids`' decode loop."""

    step: jax.Array  # [] int32 tokens generated so far (the next one goes to out[:, step])
    last: jax.Array  # [B] int32 the token fed to the next decode step
    cache: KVCache
    out: jax.Array  # [B, max_new_tokens] int32 generated tokens, pad_id after a sequence's EOS
    done: jax.Array  # [B] bool the sequence produced an EOS
    counts: jax.Array  # [B] int32 tokens generated per sequence, its EOS included
    key: jax.Array  # PRNG key for the next sample
    # [] int32 the first generated token whose logits held NaN or inf (0: the prefill's), -1 while none did;
    # the loop stops there, and `generate` raises instead of returning tokens sampled from them.
    nonfinite: jax.Array


def _start(params, tokens, lengths, sampling: Sampling, key, eos_ids, pad_id, *, config: ModelConfig,
           policy: KVPolicy, max_new_tokens: int, capacity: int, cache_dtype: Any, sharding=None,
           prefill_chunk: int | None = None) -> DecodeLoop:
    """Prefill (in chunks of `prefill_chunk` tokens, if given) and the first sampled token: the decode loop's
    starting state."""
    logits, cache = _prefill(params, tokens, lengths, config, policy, capacity, cache_dtype, sharding, prefill_chunk)
    return _first_token(logits, cache, sampling, key, eos_ids, pad_id, max_new_tokens)


def _prefill(params, tokens, lengths, config: ModelConfig, policy: KVPolicy, capacity: int, cache_dtype: Any,
             sharding, prefill_chunk: int | None):
    """A new cache for `policy` filled by a prefill: (logits [B, V] at each prompt's last token, the cache)."""
    pin = functools.partial(pin_cache, config=config, policy=policy, sharding=sharding)
    cache = pin(init_cache(config, policy, tokens.shape[0], capacity, cache_dtype))
    logits, cache = forward_prefill(params, config, policy, tokens, lengths, cache, chunk=prefill_chunk)
    return logits, pin(cache)


def _prefill_full(params, tokens, lengths, *, config: ModelConfig, capacity: int, cache_dtype: Any, sharding=None,
                  prefill_chunk: int | None = None, prompt_queries: int = 0):
    """A full-KV prefill for `start_prefilled`: (logits [B, V] at each prompt's last token, the full-KV cache).
    `prompt_queries` n > 0: each layer also keeps the prompt's last n queries (`FullKVKeepingQueries`)."""
    policy = FullKVKeepingQueries(prompt_queries=prompt_queries) if prompt_queries else FullKV()
    return _prefill(params, tokens, lengths, config, policy, capacity, cache_dtype, sharding, prefill_chunk)


def _start_prefilled(full, logits, sampling: Sampling, key, eos_ids, pad_id, *, config: ModelConfig,
                     policy: KVPolicy, max_new_tokens: int, sharding=None) -> DecodeLoop:
    """`_start` from a prefill already run: `full`, the full-KV cache it filled, and `logits` [B, V], its last
    prompt tokens' (`clusterkv_jax.generate.prefill_prompts`). The policy's cache is filled from `full`
    (`attend.copy_prompt`); `full` is kept, for the next policy."""
    pin = functools.partial(pin_cache, config=config, policy=policy, sharding=sharding)
    cache = pin(init_cache(config, policy, full.batch_size, full.capacity, full.dtype))
    cache = attend_module.copy_prompt(cache, full, policy=policy)
    return _first_token(logits, pin(cache), sampling, key, eos_ids, pad_id, max_new_tokens)


def _first_token(logits, cache: KVCache, sampling: Sampling, key, eos_ids, pad_id, max_new_tokens: int) -> DecodeLoop:
    """The decode loop's starting state: the first token sampled from the prompts' last logits [B, V]."""
    B = logits.shape[0]
    key, sub = jax.random.split(key)
    first = sample_tokens(logits, sampling, sub)
    return DecodeLoop(step=jnp.int32(1), last=first, cache=cache,
                      out=jnp.full((B, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first),
                      done=jnp.isin(first, eos_ids), counts=jnp.ones((B,), jnp.int32), key=key,
                      nonfinite=jnp.where(_all_finite(logits), -1, 0).astype(jnp.int32))


def _all_finite(logits: jax.Array, live: jax.Array | None = None) -> jax.Array:
    """Whether the logits [B, V] of every live sequence (default: all) are finite."""
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    return jnp.all(finite if live is None else finite | ~live)


def _decode(params, loop: DecodeLoop, sampling: Sampling, eos_ids, pad_id, stop_at=None, *, config: ModelConfig,
            policy: KVPolicy, max_new_tokens: int, sharding=None) -> DecodeLoop:
    """Decode steps until `max_new_tokens` tokens (or `stop_at` ([] int32, traced) if smaller) or every
    sequence's EOS."""
    pin = functools.partial(pin_cache, config=config, policy=policy, sharding=sharding)
    limit = max_new_tokens if stop_at is None else jnp.minimum(stop_at, max_new_tokens)

    def keep_going(loop: DecodeLoop):
        return (loop.step < limit) & ~jnp.all(loop.done) & (loop.nonfinite < 0)

    # Where layers index windows of generated tokens, the steps run in intervals: every layer indexes what is due
    # (one branch), then the steps until the next window can fall due run without asking. So a step holds no
    # branch (on a GPU each waits for the host) and none of indexing's writes (a dozen small kernels a selecting
    # layer), which happen once per interval instead of on every step.
    intervals = attend_module.indexes_windows(policy, loop.cache.groups, loop.cache.lengths, loop.cache.capacity)

    def step_fn(loop: DecodeLoop) -> DecodeLoop:
        logits, cache = forward_decode(params, config, policy, loop.last, loop.cache, index=not intervals)
        key, sub = jax.random.split(loop.key)
        nxt = jnp.where(loop.done, pad_id, sample_tokens(logits, sampling, sub))
        nonfinite = jnp.where(_all_finite(logits, ~loop.done), loop.nonfinite, loop.step)
        return DecodeLoop(step=loop.step + 1, last=nxt, cache=pin(cache),
                          out=jax.lax.dynamic_update_slice_in_dim(loop.out, nxt[:, None], loop.step, axis=1),
                          done=loop.done | jnp.isin(nxt, eos_ids), counts=loop.counts + (~loop.done).astype(jnp.int32),
                          key=key, nonfinite=nonfinite)

    def interval_fn(loop: DecodeLoop) -> DecodeLoop:
        with jax.named_scope("index_between_steps"):
            cache, until = index_due(loop.cache, policy, pin)
        end = loop.step + until
        return jax.lax.while_loop(lambda loop: keep_going(loop) & (loop.step < end), step_fn, loop.replace(cache=cache))

    loop = jax.lax.while_loop(keep_going, interval_fn if intervals else step_fn, loop)
    return loop.replace(cache=pin(loop.cache))


_START_STATIC = ("config", "policy", "max_new_tokens", "capacity", "cache_dtype", "sharding", "prefill_chunk")
_DECODE_STATIC = ("config", "policy", "max_new_tokens", "sharding")

#: Prefill and the first token, one compiled program: (params, tokens, lengths, sampling, key, eos_ids, pad_id)
#: -> DecodeLoop. `generate` runs it and `decode_generation` as two programs to time prefill and decode apart.
start_generation = jax.jit(in_mesh_scope(_start), static_argnames=_START_STATIC)
#: A prefill under full KV that several policies start from: (params, tokens, lengths) -> (logits, cache).
prefill_full = jax.jit(in_mesh_scope(_prefill_full),
                       static_argnames=("config", "capacity", "cache_dtype", "sharding", "prefill_chunk",
                                        "prompt_queries"))
#: `start_generation` from a shared prefill: (full, logits, sampling, key, eos_ids, pad_id) -> DecodeLoop, `full`
#: and `logits` from `clusterkv_jax.generate.prefill_prompts`.
start_prefilled = jax.jit(in_mesh_scope(_start_prefilled),
                          static_argnames=("config", "policy", "max_new_tokens", "sharding"))
#: The decode loop from a `start_generation` state (donated): (params, loop, sampling, eos_ids, pad_id[, stop_at])
#: -> DecodeLoop, stopping after step `stop_at` (traced: any stop point runs the same program) if given.
decode_generation = jax.jit(in_mesh_scope(_decode), static_argnames=_DECODE_STATIC, donate_argnames=("loop",))

#: `generate`'s decode loop returns to Python about this often (seconds), so that Ctrl-C stops it within about
#: that time; each return costs a wait for the device and a new call (docs/research_log.md "Ctrl-C").
INTERRUPT_SECONDS = 1.0


def compile_decode(params, loop: DecodeLoop, sampling: Sampling, eos_ids, pad_id, **static) -> None:
    """Compiles the program `decode_in_chunks` runs from `loop` (the same static arguments) without running it. The
    arguments are passed as `decode_in_chunks` passes them: jit keys its cache on that form too."""
    decode_generation.lower(params, loop, sampling=sampling, eos_ids=eos_ids, pad_id=pad_id, stop_at=jnp.int32(0),
                            **static).compile()


def decode_in_chunks(params, loop: DecodeLoop, sampling: Sampling, eos_ids, pad_id, *, config: ModelConfig,
                     policy: KVPolicy, max_new_tokens: int, sharding=None, seconds: float | None = INTERRUPT_SECONDS,
                     on_chunk: Callable[[np.ndarray, np.ndarray], None] | None = None) -> DecodeLoop:
    """`decode_generation` to the end, as consecutive calls of about `seconds` each (one compiled program; the
    steps per call follow the measured step time), so Python can act between them: Ctrl-C stops the loop within
    about `seconds`. Each call is queued before the host waits for the previous one's status, so the device does
    not idle between calls. `on_chunk(out [B, max_new_tokens], counts [B])` gets each call's tokens on the host.
    `seconds=None`: one call."""
    run = functools.partial(decode_generation, params, sampling=sampling, eos_ids=eos_ids, pad_id=pad_id,
                            config=config, policy=policy, max_new_tokens=max_new_tokens, sharding=sharding)
    if seconds is None:
        loop = run(loop)
        if on_chunk is not None:
            on_chunk(*to_host((loop.out, loop.counts)))
        return loop
    step, chunk = int(to_host(loop.step)), 4
    target = min(step + chunk, max_new_tokens)
    loop = run(loop, stop_at=jnp.int32(target))
    last = time.perf_counter()  # after the first call's compile, which happens as it is called
    while True:
        # Copies of the call's status, taken before the next call (queued now) consumes its donated state.
        status = [jnp.copy(x) for x in (loop.step, loop.done, loop.nonfinite, loop.out, loop.counts)]
        ahead = min(target + chunk, max_new_tokens)
        loop = run(loop, stop_at=jnp.int32(ahead))
        # On a mesh spanning processes each holds only its shards: `to_host` gathers the whole on every process.
        reached, done, nonfinite, out, counts = to_host(status)
        now = time.perf_counter()
        if on_chunk is not None:
            on_chunk(out, counts)
        if reached < target or reached >= max_new_tokens or bool(np.all(done)) or nonfinite >= 0:
            return loop  # the call queued last found nothing left to do
        # Steps that fill `seconds` at the rate just seen, at most 4x the last chunk; with several processes, process
        # 0's count, so every process queues the same calls (each deciding by its own clock, the two processes of
        # tests/test_multiprocess.py sometimes queued different numbers of calls and waited in a collective forever).
        chunk = agreed(max(1, min(4 * chunk, int(seconds * (reached - step) / max(now - last, 1e-9)))))
        step, target, last = int(reached), ahead, now


@functools.partial(jax.jit, static_argnames=_START_STATIC)
@in_mesh_scope
def generate_ids(
    params,
    tokens: jax.Array,  # [B, T] right-padded prompts
    lengths: jax.Array,  # [B]
    sampling: Sampling,
    key: jax.Array,
    eos_ids: jax.Array,  # [E] token ids that end a sequence (may be empty)
    pad_id: jax.Array,  # [] written after a sequence ended
    *,
    config: ModelConfig,
    policy: KVPolicy,
    max_new_tokens: int,
    capacity: int,
    cache_dtype: Any,
    sharding=None,
    prefill_chunk: int | None = None,
):
    """Prefill and decode up to `max_new_tokens` in one compiled program. Returns (tokens [B, max_new_tokens]
    padded with pad_id after each sequence's EOS, generated counts [B] including the EOS, final cache).
    With `sharding` (`clusterkv_jax.sharding.ShardingRules`) the cache is created and kept in its mesh
    layout throughout (batch on "data", KV heads on "model")."""
    loop = _start(params, tokens, lengths, sampling, key, eos_ids, pad_id, config=config, policy=policy,
                  max_new_tokens=max_new_tokens, capacity=capacity, cache_dtype=cache_dtype, sharding=sharding,
                  prefill_chunk=prefill_chunk)
    loop = _decode(params, loop, sampling, eos_ids, pad_id, config=config, policy=policy,
                   max_new_tokens=max_new_tokens, sharding=sharding)
    return loop.out, loop.counts, loop.cache
