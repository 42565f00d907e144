"""`clusterkv bench decode`: decode speed of every policy against full KV, as ratios measured in one process.

Per context, every policy prefills the same prompt (compile timed apart through AOT compilation), then the
policies decode round-robin one step at a time, so load on the machine hits them alike. Reported: prefill
seconds, the policy's indexing of the prompt (ClusterKV's clustering, Quest's paging) timed alone and its share
of prefill, decode ms/token (median of the steps after warm-up), tokens/s (x batch), end-to-end latency
(prefill + every decode step), device and host KV bytes, and each step's time as a multiple of its roofline
(`bench.roofline`: the bytes the step must read over the bandwidth measured on this device).

Synthetic mode (`--synthetic llama3-8b --layers N`): random weights of a real geometry and a random cache whose
keys have cluster structure, stored and indexed as a prefill would (prefilling 32k tokens of an 8B-wide model
is out of reach on small machines): prefill is then not timed, only the indexing.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from clusterkv_jax import sharding as sh
from clusterkv_jax.bench.hf import HFDecoder
from clusterkv_jax.bench.measure import compiled, timed
from clusterkv_jax.bench.report import format_decode_context
from clusterkv_jax.bench.roofline import step_bytes
from clusterkv_jax.bench.synthetic import synthetic_kv, synthetic_prefill
from clusterkv_jax.cache import SELECTING, KVCache, init_cache, kv_bytes, layer_kinds
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.policies import make_policy
from clusterkv_jax.decode_loop import INTERRUPT_SECONDS, decode_in_chunks, start_generation
from clusterkv_jax.sampling import Sampling
from clusterkv_jax.steps import bucket_length, cache_capacity, decode_step, index_due_windows, prefill
from clusterkv_jax.offload import hit_rates
from clusterkv_jax.policies import FullKV, KVPolicy

WARMUP_STEPS = 2


OFFLOADED = " offloaded"  # the label suffix of a policy's host-offloaded twin


def make_policies(names: list[str], budgets: list[int], offload_kv: bool = False,
                  policy_options: dict[str, dict] | None = None) -> dict[str, KVPolicy]:
    """{label: policy}: full KV once, every other policy at every budget ("clusterkv@1024"), each built with
    its `policy_options[name]`. With `offload_kv`, each also has its host-offloaded twin ("clusterkv@1024
    offloaded") decoding in the same run, so the cost of offloading is a ratio measured interleaved."""
    policies: dict[str, KVPolicy] = {"full": FullKV()}  # every ratio's reference: full KV on the device
    for name in names:
        if name == "full":
            continue
        for b in budgets:
            policies[f"{name}@{b}"] = make_policy(name, b, **(policy_options or {}).get(name, {}))
    if offload_kv:
        for label, policy in list(policies.items()):
            if "offload" not in {f.name for f in dataclasses.fields(policy)}:
                raise ValueError(f"--offload supports full, clusterkv and quest, not {label.split('@')[0]!r}")
            policies[label + OFFLOADED] = dataclasses.replace(policy, offload=True)
    return policies


def real_prefill(params, config: ModelConfig, policy: KVPolicy, prompts: np.ndarray, capacity: int,
                 dtype, rules=None) -> tuple[KVCache, jax.Array, dict[str, float]]:
    """Prefills prompts [B, T] (all of length T) -> (cache, first tokens [B], {prefill_s, prefill_compile_s}).
    With sharding `rules` (clusterkv_jax.sharding) the cache and the batch are laid out on its mesh."""
    B, T = prompts.shape
    tokens = np.zeros((B, bucket_length(T)), np.int32)
    tokens[:, :T] = prompts
    lengths = np.full((B,), T, np.int32)
    if rules is None:
        tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
        cache = init_cache(config, policy, B, capacity, dtype)
    else:
        tokens, lengths = sh.shard_batch(tokens, rules), sh.shard_batch(lengths, rules)
        cache = sh.init_cache_sharded(config, policy, B, capacity, dtype, rules)
    exe, compile_s = compiled(prefill, params, tokens, lengths, cache, config=config, policy=policy,
                              sharding=rules)
    (logits, cache), seconds = timed(exe, params, tokens, lengths, cache)
    return cache, jnp.argmax(logits, -1).astype(jnp.int32), {"prefill_s": seconds, "prefill_compile_s": compile_s}


def indexing_seconds(config: ModelConfig, policy: KVPolicy, keys: jax.Array, lengths: jax.Array,
                     repeats: int = 3) -> float:
    """The policy's indexing (`after_prefill`: ClusterKV's clustering) of its selecting layers, timed alone:
    keys [n, B, K, S, H] of those layers after a prefill. The median of `repeats` runs (one run of ~1 s varied
    by +-15% on a shared machine, which moved the clustering's share of prefill across its 5% target)."""
    state = policy.init_states(config, keys.shape[1], keys.shape[3], selecting_layers(config, policy, keys.shape[3]))
    fn = jax.jit(lambda s, k: jax.lax.map(lambda a: policy.after_prefill(a[0], a[1], lengths), (s, k)))
    exe, _ = compiled(fn, state, keys)
    return statistics.median(timed(exe, state, keys)[1] for _ in range(repeats))


def selecting_layers(config: ModelConfig, policy: KVPolicy, capacity: int) -> list[int]:
    return [i for i, kind in enumerate(layer_kinds(config, policy, capacity)) if kind.attention == SELECTING]


@dataclasses.dataclass
class _Run:
    cache: KVCache | None
    token: jax.Array | None
    step: Any  # AOT-compiled decode step
    times: list[float]
    info: dict[str, Any]
    index: Any = None  # AOT-compiled `index_due_windows`
    until: int | None = None  # steps before a window may fall due (None: the policy indexes no window)


def decode_loop_seconds(params, config: ModelConfig, policy: KVPolicy, prompts: np.ndarray, decode: int, *,
                        repeats: int = 5, rules=None) -> dict[str, Any]:
    """`generate`'s decode loop (`decode_generation`, no EOS: `decode` tokens) from the same prefilled state, as
    one program and in the chunks `generate` runs so that Ctrl-C stops it (`decode_in_chunks`), alternated for
    `repeats` rounds after a warm-up round (its compiles): ms per token of each (median of the rounds), the chunks
    per loop and the chunked loop's cost over the one-program loop (the median of each round's ratio: the two runs
    of a round are adjacent in time, so the machine's drift cancels)."""
    B, T = prompts.shape
    bucket = bucket_length(T)
    tokens = np.zeros((B, bucket), np.int32)
    tokens[:, :T] = prompts
    lengths = np.full((B,), T, np.int32)
    tokens_in, lengths_in = jnp.asarray(tokens), jnp.asarray(lengths)
    if rules is not None:
        tokens_in, lengths_in = sh.shard_batch(tokens, rules), sh.shard_batch(lengths, rules)
    sampling, eos, pad = Sampling.make(), jnp.zeros((0,), jnp.int32), jnp.int32(0)
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    statics = dict(config=config, policy=policy, max_new_tokens=decode, sharding=rules)
    modes = {"one_program": None, "chunked": INTERRUPT_SECONDS}
    times: dict[str, list[float]] = {m: [] for m in modes}
    chunks: list[int] = []
    prefilled = jax.block_until_ready(start_generation(
        params, tokens_in, lengths_in, sampling, jax.random.PRNGKey(0), eos, pad,
        capacity=cache_capacity(bucket, decode), cache_dtype=dtype, **statics))
    calls: list[int] = []

    def count_call(out, counts) -> None:
        calls.append(1)

    for round_ in range(repeats + 1):
        for mode in (list(modes) if round_ % 2 == 0 else list(modes)[::-1]):  # neither always goes first
            # A copy in the same placement (host memory kinds too): each run donates its state.
            loop = jax.block_until_ready(jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False),
                                                      prefilled))
            calls.clear()
            start = time.perf_counter()
            loop = decode_in_chunks(params, loop, sampling, eos, pad, seconds=modes[mode], on_chunk=count_call,
                                    **statics)
            jax.block_until_ready(loop.out)
            if round_:  # round 0 compiles
                times[mode].append((time.perf_counter() - start) / (decode - 1))
                if mode == "chunked":
                    chunks.append(len(calls))
            del loop
    one, chunked = (statistics.median(times[m]) for m in modes)
    cost = statistics.median(c / o - 1 for o, c in zip(times["one_program"], times["chunked"]))
    return {"one_program_ms": 1e3 * one, "chunked_ms": 1e3 * chunked, "chunks": statistics.median(chunks),
            "chunked_cost": cost, "chunked_cost_rounds": [c / o - 1 for o, c in zip(*times.values())],
            "rounds": repeats, "chunk_seconds": INTERRUPT_SECONDS}


def bench_decode(
    params,
    config: ModelConfig,
    policies: dict[str, KVPolicy],
    contexts: list[int],
    *,
    decode: int = 64,
    batch: int = 1,
    prompt_fn: Callable[[int, int], np.ndarray] | None = None,
    synthetic_seed: int | None = None,
    bandwidth_Bps: float | None = None,
    hf_model: Any = None,
    mesh: Any = None,
    progress: bool = True,
    decode_loop: bool = False,
) -> dict[str, Any]:
    """Decode speed of every policy at every context (see the module docstring).

    prompt_fn(context, batch) -> token ids [batch, context] runs a real prefill; otherwise (synthetic) the
    cache is filled by `synthetic_kv` with `synthetic_seed`. With `hf_model` (see `bench.hf`), HF
    transformers' full-KV decode of the same prompts runs too, interleaved with ours step by step. With a
    `mesh` (clusterkv_jax.sharding) params, caches and batches are sharded on it (real prompts only). With
    `decode_loop`, each policy's `generate` decode loop also runs as one program and in Ctrl-C chunks
    (`decode_loop_seconds`; random prompt tokens in synthetic mode) under "decode_loop".
    """
    if decode <= WARMUP_STEPS:
        raise ValueError(f"decode must be > {WARMUP_STEPS} (the warm-up steps), got {decode}")
    if "full" not in policies:
        raise ValueError("the policies must include 'full': every figure is a ratio to it")
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    rules = None
    if mesh is not None:
        if prompt_fn is None:
            raise ValueError("--mesh needs a real --model (the synthetic cache is not sharded)")
        rules = sh.sharding_rules(config, mesh, batch)
        params = sh.shard_params(params, config, mesh)
    kv_itemsize = jnp.dtype(dtype).itemsize
    results: dict[str, Any] = {"contexts": {}, "decode": decode, "batch": batch, "dtype": str(jnp.dtype(dtype)),
                               "bandwidth_Bps": bandwidth_Bps, "warmup_steps": WARMUP_STEPS,
                               "mesh": None if mesh is None else dict(mesh.shape),
                               "devices": mesh.size if mesh is not None else 1}
    for context in contexts:
        if context + decode > config.max_position_embeddings:
            raise ValueError(f"context {context} + decode {decode} exceeds the model's "
                             f"{config.max_position_embeddings} positions")
        capacity = cache_capacity(bucket_length(context), decode)
        runs: dict[str, _Run] = {}
        prompts = prompt_fn(context, batch) if prompt_fn else None
        kv = None if prompts is not None else synthetic_kv(
            jax.random.PRNGKey(synthetic_seed or 0), config, batch, context, capacity, dtype)
        bar = tqdm(policies.items(), desc=f"context {context}: prefill", disable=not progress, file=sys.stderr)
        for name, policy in bar:
            if prompts is not None:
                cache, token, info = real_prefill(params, config, policy, prompts, capacity, dtype, rules)
            else:
                cache, token, info = synthetic_prefill(config, policy, kv, context, capacity, dtype)
            # The step as `generate`'s loop runs it: windows indexed between runs of steps that need none.
            index, index_s = compiled(index_due_windows, cache, config=config, policy=policy, sharding=rules)
            cache, until = index(cache)
            step, compile_s = compiled(decode_step, params, token, cache, config=config, policy=policy,
                                       sharding=rules, index=until is None)
            info["decode_compile_s"] = compile_s + index_s
            info["kv_bytes"] = kv_bytes(cache)
            info["tokens"] = [int(token[0])]  # sequence 0's greedy tokens: what was decoded, for checking
            runs[name] = _Run(cache, token, step, [], info, index, None if until is None else int(until))
        # Each policy's indexing alone, on the prompt keys full KV stored (the keys every policy indexes).
        full_cache = runs["full"].cache
        for name, policy in policies.items():
            if layers := selecting_layers(config, policy, full_cache.capacity):
                keys = jnp.stack([full_cache.layer_kv(layer)[0] for layer in layers])
                runs[name].info["indexing_s"] = indexing_seconds(config, policy, keys, full_cache.lengths)
        del kv
        hf = None
        if hf_model is not None and prompts is not None:
            hf = HFDecoder(hf_model, prompts)
            runs["hf-full"] = _Run(None, None, None, [], {"prefill_s": hf.prefill_s, "tokens": hf.tokens})
        bar = tqdm(range(decode), desc=f"context {context}: decode", disable=not progress, file=sys.stderr)
        names = list(runs)
        for i in bar:
            # Rotate the order so no policy always runs right after the same one.
            for name in names[i % len(names):] + names[: i % len(names)]:
                run = runs[name]
                if name == "hf-full":
                    run.times.append(hf.step())
                    continue
                seconds = 0.0
                if run.until == 0:  # a window falls due: index it, timed as part of this step
                    (run.cache, until), seconds = timed(run.index, run.cache)
                    run.until = int(until)
                (logits, run.cache), step_seconds = timed(run.step, params, run.token, run.cache)
                run.times.append(seconds + step_seconds)
                if run.until is not None:
                    run.until -= 1
                run.token = jnp.argmax(logits, -1).astype(jnp.int32)
                run.info["tokens"].append(int(run.token[0]))
        row: dict[str, Any] = {}
        for name, run in runs.items():
            policy = policies.get(name)
            info = run.info
            step_s = statistics.median(run.times[WARMUP_STEPS:])
            info["decode_ms"] = 1e3 * step_s
            info["decode_tokens_per_s"] = batch / step_s
            info["decode_first_step_ms"] = 1e3 * run.times[0]
            info["decode_total_s"] = sum(run.times)
            prefill_like = info["prefill_s"] if info["prefill_s"] is not None else info.get("indexing_s", 0.0)
            info["end_to_end_s"] = prefill_like + info["decode_total_s"]
            if info.get("indexing_s") is not None and info["prefill_s"]:
                info["indexing_share_of_prefill"] = info["indexing_s"] / info["prefill_s"]
            rates = [r for r in hit_rates(run.cache) if r is not None] if run.cache is not None else []
            if rates:  # offloaded selecting layers: share of selected rows the device recall cache served
                info["recall_hit_rate"] = float(np.mean(rates))
            row[name] = info
            if policy is None:  # HF transformers: no roofline of ours
                continue
            # The unindexed window holds about half the decoded tokens, at most its size.
            recent = min(decode // 2, policy.window_size(capacity))
            info["step_bytes"] = step_bytes(config, params, policy, context, batch, recent, kv_itemsize)
            if bandwidth_Bps:
                info["roofline_ms"] = 1e3 * info["step_bytes"]["total"] / bandwidth_Bps
                info["x_roofline"] = info["decode_ms"] / info["roofline_ms"]
        full_ms = row["full"]["decode_ms"]
        for name, info in row.items():
            info["speedup_vs_full"] = full_ms / info["decode_ms"]
            if name.endswith(OFFLOADED) and name[:-len(OFFLOADED)] in row:  # its on-device twin ran alongside
                info["speedup_vs_on_device"] = row[name[:-len(OFFLOADED)]]["decode_ms"] / info["decode_ms"]
        results["contexts"][str(context)] = row
        if decode_loop:
            loop_prompts = prompts if prompts is not None else np.random.default_rng(synthetic_seed or 0).integers(
                0, config.vocab_size, (batch, context), dtype=np.int32)
            for name, policy in tqdm(policies.items(), desc=f"context {context}: decode loop", disable=not progress,
                                     file=sys.stderr):
                row[name]["decode_loop"] = decode_loop_seconds(params, config, policy, loop_prompts, decode,
                                                               rules=rules)
        if progress:
            print(format_decode_context(context, row), file=sys.stderr)
        del runs
    return results
