"""Jitted prefill / decode steps and `generate`: prefill plus a `lax.while_loop` decode in one `jax.jit`.

Prompts are right-padded to a shape bucket and the cache capacity is derived from the bucket and
`max_new_tokens`, so `generate` compiles once per (batch, bucket, max_new_tokens, policy) and never per
step. Sampling settings are traced values: changing temperature / top-k / top-p / seed does not recompile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers
import sys
import time
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from clusterkv_jax import attend as attend_module
from clusterkv_jax import sharding as sh
from clusterkv_jax.cache import KVCache, init_cache
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.distributed import agreed, to_host, waiting_for_peers
from clusterkv_jax.model import PREFILL_BLOCK, forward_decode, forward_prefill
from clusterkv_jax.ops import sharded_trace
from clusterkv_jax.policies import FullKV, KVPolicy

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


# ----------------------------------------------------------------------------------------------------------
# Jitted steps for users who drive their own loop
# ----------------------------------------------------------------------------------------------------------


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
    return _index_due(pin_cache(cache, config, policy, sharding), policy,
                      functools.partial(pin_cache, config=config, policy=policy, sharding=sharding))


def _index_due(cache: KVCache, policy: KVPolicy, pin):
    """`index_due_windows` inside a trace (`pin` keeps the cache's layout)."""
    groups = attend_module.index_windows(policy, cache.groups, cache.lengths, cache.prompt_lengths, cache.capacity)
    cache = pin(cache.replace(groups=groups))
    return cache, attend_module.steps_until_due(policy, groups, cache.lengths, cache.prompt_lengths, cache.capacity)


# ----------------------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------------------


@flax.struct.dataclass
class Sampling:
    """Traced sampling settings. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @classmethod
    def make(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> "Sampling":
        for name, value in (("temperature", temperature), ("top_p", top_p)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {value!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
            raise TypeError(f"top_k must be an int (0: no top-k filter), got {top_k!r}")
        if not temperature >= 0:  # NaN too
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))


def sample_tokens(logits: jax.Array, sampling: Sampling, key: jax.Array) -> jax.Array:
    """logits [B, V] -> next tokens [B]: greedy, or temperature sampling within top-k and nucleus top-p."""
    V = logits.shape[-1]
    scaled = logits / jnp.maximum(sampling.temperature, 1e-6)
    # [B, V] descending
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(sampling.top_k > 0, jnp.minimum(sampling.top_k, V), V)
    kth_largest = sorted_desc[:, k - 1][:, None]
    sorted_topk = jnp.where(jnp.arange(V) < k, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_topk, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always).
    keep = (jnp.cumsum(probs, axis=-1) - probs) < sampling.top_p
    nucleus_min = jnp.min(jnp.where(keep, sorted_topk, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.maximum(kth_largest, nucleus_min)
    filtered = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    sampled = jax.random.categorical(key, filtered, axis=-1)
    return jnp.where(sampling.temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------------


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
    B = tokens.shape[0]
    pin = functools.partial(pin_cache, config=config, policy=policy, sharding=sharding)
    cache = pin(init_cache(config, policy, B, capacity, cache_dtype))
    logits, cache = forward_prefill(params, config, policy, tokens, lengths, cache, chunk=prefill_chunk)
    key, sub = jax.random.split(key)
    first = sample_tokens(logits, sampling, sub)
    return DecodeLoop(step=jnp.int32(1), last=first, cache=pin(cache),
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
            cache, until = _index_due(loop.cache, policy, pin)
        end = loop.step + until
        return jax.lax.while_loop(lambda loop: keep_going(loop) & (loop.step < end), step_fn, loop.replace(cache=cache))

    loop = jax.lax.while_loop(keep_going, interval_fn if intervals else step_fn, loop)
    return loop.replace(cache=pin(loop.cache))


_START_STATIC = ("config", "policy", "max_new_tokens", "capacity", "cache_dtype", "sharding", "prefill_chunk")
_DECODE_STATIC = ("config", "policy", "max_new_tokens", "sharding")

#: Prefill and the first token, one compiled program: (params, tokens, lengths, sampling, key, eos_ids, pad_id)
#: -> DecodeLoop. `generate` runs it and `decode_generation` as two programs to time prefill and decode apart.
start_generation = jax.jit(in_mesh_scope(_start), static_argnames=_START_STATIC)
#: The decode loop from a `start_generation` state (donated): (params, loop, sampling, eos_ids, pad_id[, stop_at])
#: -> DecodeLoop, stopping after step `stop_at` (traced: any stop point runs the same program) if given.
decode_generation = jax.jit(in_mesh_scope(_decode), static_argnames=_DECODE_STATIC, donate_argnames=("loop",))

#: `generate`'s decode loop returns to Python about this often (seconds), so that Ctrl-C stops it within about
#: that time; each return costs a wait for the device and a new call (docs/research_log.md "Ctrl-C").
INTERRUPT_SECONDS = 1.0


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during `generate`'s decode loop: `tokens` / `texts` hold what each prompt had generated by then (in
    the chunk of steps that finished last), as in `GenerationResult`."""

    def __init__(self, tokens: list[list[int]], texts: list[str] | None):
        super().__init__(f"interrupted after {max((len(t) for t in tokens), default=0)} generated tokens")
        self.tokens, self.texts = tokens, texts


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


def _placed_params(model, rules):
    """model.params on the mesh of `rules`, placed on the first call and kept on the model object."""
    key = (rules.mesh, rules.heads, rules.mlp)
    kept = getattr(model, "_sharded_params", None)
    if kept is not None and kept[0] is model.params and kept[1] == key:
        return kept[2]
    placed = sh.shard_params(model.params, model.config, rules)
    try:
        model._sharded_params = (model.params, key, placed)
    except (AttributeError, TypeError):  # a frozen or slotted model object: place on every call
        pass
    return placed


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per prompt, EOS included when one was produced
    texts: list[str] | None  # decoded without special tokens (None without a tokenizer)
    prompt_lengths: list[int]
    seconds: float  # wall time of the call: compile (where it compiled), prefill and decode
    cache: KVCache | None = None
    prefill_seconds: float = 0.0  # prefill and the first token (`start_generation`, compiled), until it was ready
    decode_seconds: float = 0.0  # the decode loop (`decode_generation`, compiled), until its tokens were on the host
    compile_seconds: float = 0.0  # tracing and compiling both programs (near 0 where jit had them already)
    compiled: bool = False  # this call compiled a program (its time is in compile_seconds, not the two above)

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens the decode loop produced (all but each sequence's first) per second of `decode_seconds`."""
        decoded = sum(max(len(t) - 1, 0) for t in self.tokens)
        return decoded / self.decode_seconds if decoded and self.decode_seconds > 0 else float("nan")


def _as_token_batch(model, prompts, chat: bool, add_special_tokens: bool) -> tuple[list[list[int]], bool]:
    """Normalises prompts (text, ids, or lists of either) into a list of id lists; says if input was single."""
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if not isinstance(prompts, (str, list, tuple)):
        raise TypeError(f"prompts must be a string, a list of token ids, or a list of either; got "
                        f"{type(prompts).__name__}")
    single = isinstance(prompts, str) or (
        isinstance(prompts, (list, tuple)) and len(prompts) > 0 and all(isinstance(t, (int, np.integer)) for t in prompts)
    )
    batch = [prompts] if single else list(prompts)
    if not batch:
        raise ValueError("no prompts given")
    ids: list[list[int]] = []
    for i, p in enumerate(batch):
        if isinstance(p, str):
            try:
                p.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"prompt {i} is not valid Unicode text: {e.reason} at character {e.start} "
                                 f"({p[e.start]!r})") from None
            if model.tokenizer is None:
                where = getattr(model, "path", None)
                where = f"model {where!r} has no tokenizer.json" if where else "the model has no tokenizer"
                raise ValueError(f"{where}, so text prompts cannot be tokenised: copy the checkpoint's "
                                 "tokenizer.json (and tokenizer_config.json) there, or pass token ids from Python")
            if chat:
                p = model.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                ids.append(model.tokenizer.encode(p, add_special_tokens=False))
            else:
                ids.append(model.tokenizer.encode(p, add_special_tokens=add_special_tokens))
        elif isinstance(p, (list, tuple, np.ndarray)):
            if chat:
                raise ValueError(f"chat=True wraps text in the chat template; prompt {i} is token ids (render the "
                                 "template yourself, or pass text)")
            items = p.tolist() if isinstance(p, np.ndarray) else list(p)
            if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in items):
                raise TypeError(f"prompt {i} must be a string or a list of int token ids, got {str(p)[:60]}")
            ids.append([int(t) for t in items])
        else:
            raise TypeError(f"prompt {i} must be a string or a list of int token ids, got {type(p).__name__}")
        if not ids[-1]:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in ids[-1] if not 0 <= t < model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {model.config.vocab_size}): {bad[:5]}")
    return ids, single


def generate(
    model,
    prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
    max_new_tokens: int = 128,
    policy: KVPolicy = FullKV(),
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    chat: bool = False,
    add_special_tokens: bool = True,
    stop_at_eos: bool = True,
    max_length: int | None = None,
    cache_dtype: Any = None,
    return_cache: bool = False,
    mesh: Any = None,
    prefill_chunk: int | None = None,
    progress: bool = False,
) -> GenerationResult:
    """Generates continuations for a prompt or a batch of prompts of different lengths.

    `model` is what `load_model` returns (anything with `.config`, `.params`, `.tokenizer`). Prompts are text
    (tokenised; `chat=True` wraps each in the chat template as a user turn) or token ids. Greedy by default;
    `temperature > 0` samples, optionally within `top_k` / `top_p`. Each sequence stops at its EOS.
    `max_length` caps prompt + new tokens (default: the model's `max_position_embeddings`).

    `mesh` (a `jax.sharding.Mesh` with axes ("data", "model"), or a spec such as "data=2,model=2"; see
    `clusterkv_jax.sharding`; default: the mesh `load_model` restored the model on, if any) runs the batch sharded
    over "data" and the KV heads over "model". The tokens are the same as without a mesh. On a mesh that spans
    processes (`clusterkv_jax.distributed`) every process makes the same call and gets the same result. Parameters are placed once and kept on `model` for later calls (or
    pass a model whose params came from `shard_params`). A batch that does not divide "data" is padded with
    copies of the first prompt; those rows are dropped from the results but stay in `cache`.

    `prefill_chunk` (a multiple of 512) runs prompts longer than it in chunks of that many tokens, each attending
    to the cache so far: peak activation memory follows the chunk, not the prompt; the tokens are the same.

    The decode loop returns to Python about every `INTERRUPT_SECONDS`: Ctrl-C then raises `GenerationInterrupted`
    holding the tokens generated so far; `progress=True` shows a progress bar of the tokens on stderr.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not isinstance(policy, KVPolicy):
        raise TypeError(f"policy must be a KVPolicy (FullKV(), ClusterKV(...), ...), got {type(policy).__name__}")
    config: ModelConfig = model.config
    ids, single = _as_token_batch(model, prompts, chat, add_special_tokens)
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral)
                                   or max_length < 1):
        raise ValueError(f"max_length must be a positive int (prompt + new tokens) or None (the model's "
                         f"max_position_embeddings), got {max_length!r}")
    limit = config.max_position_embeddings if max_length is None else max_length
    longest = max(len(p) for p in ids)
    if longest + max_new_tokens > limit:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the capacity of {limit} "
            f"positions; shorten the prompt or lower max_new_tokens"
        )
    sampling = Sampling.make(temperature, top_k, top_p)
    bucket = bucket_length(longest)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not -2**31 <= seed < 2**32:
        raise TypeError(f"seed must be an int in [-2^31, 2^32), got {seed!r}")
    if prefill_chunk is not None:
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, numbers.Integral):
            raise TypeError(f"prefill_chunk must be an int (a multiple of {PREFILL_BLOCK}) or None, got "
                            f"{prefill_chunk!r}")
        if prefill_chunk <= 0 or prefill_chunk % PREFILL_BLOCK:
            raise ValueError(f"prefill_chunk must be a positive multiple of {PREFILL_BLOCK}, got {prefill_chunk}")
        if bucket > prefill_chunk:
            bucket = -(-bucket // prefill_chunk) * prefill_chunk  # whole chunks
        else:
            prefill_chunk = None  # one chunk: the unchunked program
    n_prompts = len(ids)
    rules, params = None, model.params
    if mesh is None:
        mesh = getattr(model, "mesh", None)
    if mesh is None and jax.process_count() > 1:
        raise ValueError(f"JAX runs {jax.process_count()} processes: pass mesh= (a mesh over all {jax.device_count()} "
                         "devices), or load the model with load_model(path, mesh=...)")
    if mesh is not None:
        mesh = sh.make_mesh(mesh)
        ids = ids + [ids[0]] * (sh.padded_batch(n_prompts, mesh) - n_prompts)
        rules = sh.sharding_rules(config, mesh, len(ids))
        params = _placed_params(model, rules)
    tokens = np.zeros((len(ids), bucket), np.int32)
    for i, p in enumerate(ids):
        tokens[i, : len(p)] = p
    lengths = np.array([len(p) for p in ids], np.int32)
    tokens_in, lengths_in = jnp.asarray(tokens), jnp.asarray(lengths)
    if rules is not None:
        tokens_in, lengths_in = sh.shard_batch(tokens, rules), sh.shard_batch(lengths, rules)
    eos = set(config.eos_token_ids)
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
        eos.add(model.tokenizer.eos_token_id)
    eos_ids = np.array(sorted(eos) if stop_at_eos else [], np.int32)
    pad_id = config.pad_token_id if config.pad_token_id is not None else (min(eos) if eos else 0)
    if cache_dtype is None:
        cache_dtype = jax.tree_util.tree_leaves(model.params)[0].dtype

    start_args = (params, tokens_in, lengths_in, sampling, jax.random.PRNGKey(seed), jnp.asarray(eos_ids),
                  jnp.int32(pad_id))
    start_static = dict(config=config, policy=policy, max_new_tokens=max_new_tokens,
                        capacity=cache_capacity(bucket, max_new_tokens), cache_dtype=jnp.dtype(cache_dtype),
                        sharding=rules, prefill_chunk=prefill_chunk)
    decode_static = dict(config=config, policy=policy, max_new_tokens=max_new_tokens, sharding=rules)
    with counting_compiles() as compiles:
        start = time.perf_counter()
        # Each program is compiled before it runs (jit reuses the executable), so prefill_ and decode_seconds time
        # the compiled programs on every call, the first included, and the compile is reported apart.
        start_generation.lower(*start_args, **start_static).compile()
        compiled_prefill = time.perf_counter()
        with waiting_for_peers("prefill"):  # a program holding collectives, on a mesh spanning processes
            loop = jax.block_until_ready(start_generation(*start_args, **start_static))
        prefilled = time.perf_counter()
        compile_decode(params, loop, sampling, jnp.asarray(eos_ids), jnp.int32(pad_id), **decode_static)
        decoding = time.perf_counter()
        finished = []  # the latest chunk's (out, counts) on the host: what an interrupted call returns
        bar = tqdm(total=max_new_tokens, desc="generating", unit="token", disable=not progress, file=sys.stderr,
                   leave=False)

        def keep(chunk_out: np.ndarray, chunk_counts: np.ndarray) -> None:
            finished[:] = [chunk_out, chunk_counts]
            bar.update(int(chunk_counts[:n_prompts].max()) - bar.n)

        try:
            loop = decode_in_chunks(params, loop, sampling, jnp.asarray(eos_ids), jnp.int32(pad_id), **decode_static,
                                    on_chunk=keep)
        except KeyboardInterrupt:
            bar.close()
            if not finished:
                raise
            tokens = [finished[0][i, : finished[1][i]].tolist() for i in range(n_prompts)]
            texts = [model.tokenizer.decode(t) for t in tokens] if model.tokenizer is not None else None
            raise GenerationInterrupted(tokens, texts) from None
        bar.close()
        out, counts, cache = finished[0], finished[1], loop.cache
        end = time.perf_counter()
    nonfinite = int(to_host(loop.nonfinite))
    if nonfinite >= 0:
        where = "the prompt's last position" if nonfinite == 0 else f"generated token {nonfinite}"
        raise FloatingPointError(
            f"the model's logits hold NaN or inf at {where}: its parameters or the computation are not finite "
            "(a damaged checkpoint, or float16 overflow); no text was generated from them")
    compiled = compiles[0] > 0
    generated = [out[i, : counts[i]].tolist() for i in range(n_prompts)]
    texts = None
    if model.tokenizer is not None:
        texts = [model.tokenizer.decode(g) for g in generated]
    return GenerationResult(
        tokens=generated, texts=texts, prompt_lengths=lengths[:n_prompts].tolist(), seconds=end - start,
        cache=cache if return_cache else None, prefill_seconds=prefilled - compiled_prefill,
        decode_seconds=end - decoding, compile_seconds=(compiled_prefill - start) + (decoding - prefilled),
        compiled=compiled,
    )
