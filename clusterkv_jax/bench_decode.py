"""`clusterkv bench decode` and `clusterkv bench attention`: speed of ClusterKV against full KV, as ratios
measured in one process. Figures are printed and written, never asserted.

decode: per context, every policy prefills the same prompt (compile timed apart through AOT compilation),
then the policies decode round-robin one step at a time, so load on the machine hits them alike. Reported:
prefill seconds, clustering seconds (the K-means of every compressed layer timed alone on the prompt's keys)
and its share of prefill, decode ms/token (median of the steps after warm-up), tokens/s (x batch), end-to-end
latency (prefill + every decode step), device and host KV bytes, and each step's time as a multiple of its
roofline: the bytes the step must read (weights, attended KV, cluster/page metadata) over the bandwidth
measured on this device.

Synthetic mode (`--synthetic llama3-8b --layers N`): random weights of a real geometry and a random cache
whose keys have cluster structure, filled directly (prefilling 32k tokens of an 8B-wide model is out of
reach on small machines): prefill is then not timed, only the clustering.

attention: one layer's decode attention alone, full vs each policy's select + gather + attend.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from clusterkv_jax import attention, offload
from clusterkv_jax.cache import KVCache, init_cache, kv_bytes
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.generate import bucket_length, cache_capacity, decode_step, prefill
from clusterkv_jax.policies import ClusterKV, FullKV, KVPolicy, Quest
from clusterkv_jax.policies.base import IndexedPolicy

WARMUP_STEPS = 2


# ----------------------------------------------------------------------------------------------------------
# Policies, bandwidth and the roofline
# ----------------------------------------------------------------------------------------------------------


def make_policies(names: list[str], budgets: list[int], offload_kv: bool = False,
                  policy_options: dict[str, dict] | None = None) -> dict[str, KVPolicy]:
    """{label: policy}: full KV once, every other policy at every budget ("clusterkv@1024"), each built with
    its `policy_options[name]`."""
    from clusterkv_jax.eval.policies import make_policy

    policies: dict[str, KVPolicy] = {"full": FullKV(offload=offload_kv)}
    for name in names:
        if name == "full":
            continue
        for b in budgets:
            extra = dict((policy_options or {}).get(name, {}))
            if offload_kv:
                if name not in ("clusterkv", "quest"):
                    raise ValueError(f"--offload supports full, clusterkv and quest, not {name!r}")
                extra["offload"] = True
            policies[f"{name}@{b}"] = make_policy(name, b, **extra)
    return policies


def measure_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> dict[str, float]:
    """This device's memory bandwidth in bytes/s, the best of a read (sum) and a read+write (scale) of
    `nbytes`, each the fastest of `repeats` runs."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    read = jax.jit(lambda a: jnp.sum(a))
    scale = jax.jit(lambda a: a * 1.5)

    def best(fn, moved):
        jax.block_until_ready(fn(x))  # compile
        return moved / min(timed(fn, x)[1] for _ in range(repeats))

    out = {"read_Bps": best(read, nbytes), "copy_Bps": best(scale, 2 * nbytes)}
    out["bandwidth_Bps"] = max(out.values())
    return out


def _param_bytes(params) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(params))


def step_bytes(config: ModelConfig, params, policy: KVPolicy, context: int, batch: int, recent: int,
               kv_itemsize: int) -> dict[str, int]:
    """Bytes one decode step must read at `context` tokens: weights (the embedding table only when it is
    also the LM head), the KV it attends (whole layers for full layers; for a selecting layer its budget per
    selection head plus `recent` unindexed tokens per KV head), and the selection metadata (centroids or page
    bounds)."""
    c = config
    embed = params["embed"]
    weights = _param_bytes(params) - (0 if c.tie_word_embeddings else embed.nbytes - batch * embed[0].nbytes)
    row = 2 * c.head_dim * kv_itemsize  # one token's K and V in one head
    full_layers = min(policy.full_layers, c.num_layers)
    kv = full_layers * batch * c.num_kv_heads * context * row
    meta = 0
    selecting = c.num_layers - full_layers
    if selecting:
        heads = c.num_kv_heads if getattr(policy, "gqa", "per_head") == "shared" else c.num_heads
        budget = getattr(policy, "budget", context)
        # Each selection head reads its budget; the window is read once per KV head (shared by its query heads).
        kv += selecting * batch * (heads * min(budget, context) + c.num_kv_heads * recent) * row
        if isinstance(policy, ClusterKV):
            clusters = max(1, (context - policy.sinks) // policy.tokens_per_cluster)
            meta = selecting * batch * c.num_kv_heads * clusters * c.head_dim * 4
        elif isinstance(policy, Quest):
            pages = -(-context // policy.page_size)
            meta = selecting * batch * c.num_kv_heads * pages * 2 * c.head_dim * 4
    return {"weights": int(weights), "kv": int(kv), "metadata": int(meta), "total": int(weights + kv + meta)}


# ----------------------------------------------------------------------------------------------------------
# Caches: from a real prefill, or synthetic
# ----------------------------------------------------------------------------------------------------------


def _compiled(fn, *args, **static):
    """(AOT-compiled fn for these argument shapes, compile seconds)."""
    start = time.perf_counter()
    exe = fn.lower(*args, **static).compile()
    return exe, time.perf_counter() - start


def timed(fn, *args):
    """(fn(*args) once ready, its wall seconds)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


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
        from clusterkv_jax import sharding as sh

        tokens, lengths = sh.shard_batch(tokens, rules), sh.shard_batch(lengths, rules)
        cache = sh.init_cache_sharded(config, policy, B, capacity, dtype, rules)
    exe, compile_s = _compiled(prefill, params, tokens, lengths, cache, config=config, policy=policy,
                               sharding=rules)
    (logits, cache), seconds = timed(exe, params, tokens, lengths, cache)
    return cache, jnp.argmax(logits, -1).astype(jnp.int32), {"prefill_s": seconds, "prefill_compile_s": compile_s}


def synthetic_kv(key, config: ModelConfig, batch: int, context: int, capacity: int, dtype, centers: int = 64):
    """Random K, V [L, B, K, S, H] whose keys gather around `centers` directions per head (real keys cluster;
    pure noise would not), rows >= context zero."""
    L, K, H = config.num_layers, config.num_kv_heads, config.head_dim
    kc, ka, kn, kv = jax.random.split(key, 4)
    center = jax.random.normal(kc, (L, 1, K, centers, H))
    which = jax.random.randint(ka, (L, batch, K, capacity), 0, centers)
    noise = jax.random.normal(kn, (L, batch, K, capacity, H))
    keys = jnp.take_along_axis(center, which[..., None], axis=3) + 0.5 * noise
    values = jax.random.normal(kv, (L, batch, K, capacity, H))
    valid = (jnp.arange(capacity) < context)[None, None, None, :, None]
    return jnp.where(valid, keys, 0).astype(dtype), jnp.where(valid, values, 0).astype(dtype)


@functools.partial(jax.jit, static_argnames=("config", "policy"), donate_argnames=("cache",))
def index_prompt(keys, values, lengths, cache: KVCache, *, config: ModelConfig, policy: KVPolicy) -> KVCache:
    """Stores K/V [L, B, K, S, H] as the prompt's and runs the policy's after-prefill indexing (the clustering,
    for ClusterKV) on every compressed layer: the cache state a prefill of that prompt leaves."""
    L = config.num_layers
    offloaded = cache.offloaded
    device_layers = L - (cache.host_k.shape[0] if offloaded else 0)
    state = cache.policy_state
    if policy.full_layers < L:
        def index(layer_state, layer_keys):
            return policy.after_prefill(layer_state, layer_keys, lengths)

        n = policy.full_layers
        tail = jax.tree.map(lambda x: x[n:], state)
        tail = jax.lax.map(lambda a: index(*a), (tail, keys[n:]))
        state = jax.tree.map(lambda full, t: full.at[n:].set(t), state, tail)
    if offloaded:
        host_k, host_v = offload.to_host(keys[device_layers:]), offload.to_host(values[device_layers:])
        cache = cache.replace(host_k=host_k, host_v=host_v)
    k = keys[:device_layers] if device_layers else cache.k
    v = values[:device_layers] if device_layers else cache.v
    return cache.replace(k=k.astype(cache.k.dtype), v=v.astype(cache.v.dtype), lengths=lengths,
                         prompt_lengths=lengths, policy_state=state)


def synthetic_prefill(config: ModelConfig, policy: KVPolicy, kv, context: int, capacity: int,
                      dtype) -> tuple[KVCache, jax.Array, dict[str, float]]:
    """A cache holding synthetic KV as if `context` tokens were prefilled; 'prefill' time = the indexing."""
    keys, values = kv
    B = keys.shape[1]
    lengths = jnp.full((B,), context, jnp.int32)
    cache = init_cache(config, policy, B, capacity, dtype)
    exe, compile_s = _compiled(index_prompt, keys, values, lengths, cache, config=config, policy=policy)
    cache, seconds = timed(exe, keys, values, lengths, cache)
    return cache, jnp.zeros((B,), jnp.int32), {"prefill_s": None, "prefill_compile_s": compile_s,
                                               "indexing_s": seconds}


def clustering_seconds(config: ModelConfig, policy: ClusterKV, keys: jax.Array, lengths: jax.Array) -> float:
    """The K-means of every compressed layer, timed alone: keys [L, B, K, S, H] of a prefilled prompt."""
    n = policy.full_layers
    state = jax.tree.map(lambda x: x[n:], policy.init_state(config, keys.shape[1], keys.shape[3]))
    fn = jax.jit(lambda s, k: jax.lax.map(lambda a: policy.after_prefill(a[0], a[1], lengths), (s, k)))
    exe, _ = _compiled(fn, state, keys[n:])
    _, seconds = timed(exe, state, keys[n:])
    return seconds


# ----------------------------------------------------------------------------------------------------------
# Decode benchmark
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Run:
    cache: KVCache
    token: jax.Array
    step: Any  # AOT-compiled decode step
    times: list[float]
    info: dict[str, Any]


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
) -> dict[str, Any]:
    """Decode speed of every policy at every context (see the module docstring).

    prompt_fn(context, batch) -> token ids [batch, context] runs a real prefill; otherwise (synthetic) the
    cache is filled by `synthetic_kv` with `synthetic_seed`. With `hf_model` (see `bench_hf`), HF
    transformers' full-KV decode of the same prompts runs too, interleaved with ours step by step. With a
    `mesh` (clusterkv_jax.sharding) params, caches and batches are sharded on it (real prompts only).
    """
    if decode <= WARMUP_STEPS:
        raise ValueError(f"decode must be > {WARMUP_STEPS} (the warm-up steps), got {decode}")
    if "full" not in policies:
        raise ValueError("the policies must include 'full': every figure is a ratio to it")
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    rules = None
    if mesh is not None:
        from clusterkv_jax import sharding as sh

        if prompt_fn is None:
            raise ValueError("--mesh needs a real --model (the synthetic cache is not sharded)")
        policies = {name: sh.policy_for_mesh(p, mesh) for name, p in policies.items()}
        rules = sh.sharding_rules(config, mesh, batch)
        params = sh.shard_params(params, config, mesh)
    kv_itemsize = jnp.dtype(dtype).itemsize
    results: dict[str, Any] = {"contexts": {}, "decode": decode, "batch": batch, "dtype": str(jnp.dtype(dtype)),
                               "bandwidth_Bps": bandwidth_Bps, "warmup_steps": WARMUP_STEPS,
                               "mesh": None if mesh is None else dict(mesh.shape),
                               "devices": mesh.size if mesh is not None else 1}
    from tqdm.auto import tqdm

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
            step, compile_s = _compiled(decode_step, params, token, cache, config=config, policy=policy,
                                        sharding=rules)
            info["decode_compile_s"] = compile_s
            info["kv_bytes"] = kv_bytes(cache)
            info["tokens"] = [int(token[0])]  # sequence 0's greedy tokens: what was decoded, for checking
            runs[name] = _Run(cache, token, step, [], info)
        # Clustering alone, on the prompt keys full KV stored (the same keys every ClusterKV run clusters).
        clustering = {}
        full_cache = runs["full"].cache
        for name, policy in policies.items():
            if isinstance(policy, ClusterKV):
                keys = full_cache.k if not full_cache.offloaded else offload.to_device(full_cache.host_k)
                # The clustering does not depend on the budget or on offloading: time it once per setting.
                key_of = dataclasses.replace(policy, offload=False, budget=max(policy.sinks, 1))
                if key_of not in clustering:
                    clustering[key_of] = clustering_seconds(config, key_of, keys, full_cache.lengths)
                runs[name].info["clustering_s"] = clustering[key_of]
        del kv
        hf = None
        if hf_model is not None and prompts is not None:
            from clusterkv_jax.bench_hf import HFDecoder

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
                (logits, run.cache), seconds = timed(run.step, params, run.token, run.cache)
                run.times.append(seconds)
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
            if info.get("clustering_s") is not None and info["prefill_s"]:
                info["clustering_share_of_prefill"] = info["clustering_s"] / info["prefill_s"]
            row[name] = info
            if policy is None:  # HF transformers: no roofline of ours
                continue
            recent = decode // 2 if isinstance(policy, IndexedPolicy) else 0
            info["step_bytes"] = step_bytes(config, params, policy, context, batch, recent, kv_itemsize)
            if bandwidth_Bps:
                info["roofline_ms"] = 1e3 * info["step_bytes"]["total"] / bandwidth_Bps
                info["x_roofline"] = info["decode_ms"] / info["roofline_ms"]
        full_ms = row["full"]["decode_ms"]
        for info in row.values():
            info["speedup_vs_full"] = full_ms / info["decode_ms"]
        results["contexts"][str(context)] = row
        if progress:
            print(format_decode_context(context, row), file=sys.stderr)
        del runs
    return results


# ----------------------------------------------------------------------------------------------------------
# Attention-only benchmark
# ----------------------------------------------------------------------------------------------------------


def bench_attention(config: ModelConfig, policies: dict[str, KVPolicy], contexts: list[int], *, batch: int = 1,
                    dtype=jnp.float32, repeats: int = 20, seed: int = 0, progress: bool = True) -> dict[str, Any]:
    """One layer's decode attention: full (`attention.decode_attention`) vs each selecting policy's
    `decode_attention` (select + gather + attend) and its `select` alone, on synthetic clustered keys. Each
    time is the median of `repeats` calls, the policies interleaved."""
    one_layer = dataclasses.replace(config, num_layers=1)
    results: dict[str, Any] = {"contexts": {}, "batch": batch, "dtype": str(jnp.dtype(dtype)),
                               "geometry": {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads,
                                            "head_dim": config.head_dim}}
    N, H = config.num_heads, config.head_dim
    for context in contexts:
        capacity = cache_capacity(bucket_length(context), 1)
        kv = synthetic_kv(jax.random.PRNGKey(seed), one_layer, batch, context, capacity, dtype)
        k, v = kv[0][0], kv[1][0]  # [B, K, S, H]
        # The new token's row is already written: lengths count it.
        lengths = jnp.full((batch,), context, jnp.int32)
        q = jax.random.normal(jax.random.PRNGKey(seed + 1), (batch, N, H), jnp.float32).astype(dtype)
        calls: dict[str, tuple[Any, tuple]] = {}
        indexing: dict[str, float] = {}  # after-prefill indexing of the layer (the clustering, for ClusterKV)
        full_exe, _ = _compiled(jax.jit(attention.decode_attention), q, k, v, lengths)
        calls["full"] = (full_exe, (q, k, v, lengths))
        for name, policy in policies.items():
            if isinstance(policy, FullKV):
                continue
            policy = dataclasses.replace(policy, full_layers=0)
            empty = jax.tree.map(lambda x: x[0], policy.init_state(one_layer, batch, capacity))
            index = jax.jit(lambda s, k, n, p=policy: p.after_prefill(s, k, n))
            lay, index_s = timed(_compiled(index, empty, k, lengths)[0], empty, k, lengths)
            attend = jax.jit(lambda s, q, k, v, n, p=policy: p.decode_attention(s, q, k, v, n, n)[0])
            select = jax.jit(lambda s, q, k, n, p=policy: p.select(s, q, k, n, n))
            calls[name] = (_compiled(attend, lay, q, k, v, lengths)[0], (lay, q, k, v, lengths))
            indexing[name] = index_s
            calls[f"{name} select"] = (_compiled(select, lay, q, k, lengths)[0], (lay, q, k, lengths))
        times: dict[str, list[float]] = {name: [] for name in calls}
        for i in range(repeats + 1):
            for name, (exe, args) in calls.items():
                _, seconds = timed(exe, *args)
                if i:  # the first call of each warms up
                    times[name].append(seconds)
        row = {name: {"ms": 1e3 * statistics.median(ts)} for name, ts in times.items()}
        for name, seconds in indexing.items():
            row[name]["indexing_ms"] = 1e3 * seconds
        for name, info in row.items():
            info["speedup_vs_full"] = row["full"]["ms"] / info["ms"]
            if name.endswith(" select"):
                info["share_of_policy_attention"] = info["ms"] / row[name[: -len(" select")]]["ms"]
        results["contexts"][str(context)] = row
        if progress:
            print(f"context {context}: " + ", ".join(f"{n} {r['ms']:.2f} ms" for n, r in row.items()), file=sys.stderr)
    return results


# ----------------------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------------------


def _fmt(x, spec):
    return "" if x is None else format(x, spec)


def format_decode_context(context: int, row: dict[str, Any]) -> str:
    lines = [f"context {context}",
             "| policy | prefill s | clustering s (share) | decode ms/token | tokens/s | vs full | x roofline | "
             "end-to-end s | device KV MB | host KV MB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in row.items():
        share = r.get("clustering_share_of_prefill")
        clustering = "" if r.get("clustering_s") is None else (
            f"{r['clustering_s']:.2f}" + (f" ({100 * share:.1f}%)" if share is not None else ""))
        kvb = r.get("kv_bytes", {})
        lines.append(
            f"| {name} | {_fmt(r.get('prefill_s'), '.2f')} | {clustering} | {r['decode_ms']:.1f} | "
            f"{r['decode_tokens_per_s']:.1f} | {r['speedup_vs_full']:.2f}x | {_fmt(r.get('x_roofline'), '.1f')} | "
            f"{_fmt(r.get('end_to_end_s'), '.2f')} | {_fmt(kvb.get('device', 0) / 1e6 if kvb else None, '.0f')} | "
            f"{_fmt(kvb.get('host', 0) / 1e6 if kvb else None, '.0f')} |")
    return "\n".join(lines)


def format_decode(results: dict[str, Any]) -> str:
    head = (f"decode: batch {results['batch']}, {results['decode']} steps (median after {results['warmup_steps']} "
            f"warm-up), {results['dtype']}")
    if results.get("mesh"):
        head += f", mesh {results['mesh']} over {results['devices']} devices"
    if results.get("bandwidth_Bps"):
        head += f", measured bandwidth {results['bandwidth_Bps'] / 1e9:.1f} GB/s"
    parts = [head] + [format_decode_context(int(c), row) for c, row in results["contexts"].items()]
    parts.append(format_targets(results))
    return "\n\n".join(p for p in parts if p)


def format_targets(results: dict[str, Any]) -> str:
    """The issue's decode targets, where this run has the contexts they need."""
    ctx = results["contexts"]
    lines = []
    if "8000" in ctx and "1000" in ctx and "clusterkv@1024" in ctx["8000"]:
        ours, full1k, full8k = ctx["8000"]["clusterkv@1024"], ctx["1000"]["full"], ctx["8000"]["full"]
        lines.append(f"- ClusterKV B=1024 at 8k / full KV at 1k decode step: "
                     f"{ours['decode_ms'] / full1k['decode_ms']:.2f}x "
                     f"(target <= 1.15x)")
        lines.append(f"- ClusterKV B=1024 speed-up over full KV at 8k: {full8k['decode_ms'] / ours['decode_ms']:.2f}x "
                     f"(target >= 1.8x)")
        if ours.get("clustering_share_of_prefill") is not None:
            lines.append(f"- clustering share of prefill at 8k: {100 * ours['clustering_share_of_prefill']:.1f}% "
                         f"(target <= 5%)")
    for c, row in ctx.items():
        if "hf-full" in row:
            best = max((r for n, r in row.items() if n != "hf-full"), key=lambda r: r["decode_tokens_per_s"])
            lines.append(f"- context {c}: HF transformers full KV {row['hf-full']['decode_ms']:.1f} ms/token; ours "
                         f"full {row['full']['decode_ms']:.1f}, best {best['decode_ms']:.1f}")
    return "targets:\n" + "\n".join(lines) if lines else ""


def format_attention(results: dict[str, Any]) -> str:
    g = results["geometry"]
    lines = [f"one layer's decode attention: {g['num_heads']} q heads, {g['num_kv_heads']} KV heads, "
             f"d {g['head_dim']}, "
             f"batch {results['batch']}, {results['dtype']}",
             "| context | " + " | ".join(next(iter(results["contexts"].values()))) + " |"]
    lines.append("|---|" + "---|" * (lines[-1].count("|") - 2))
    for c, row in results["contexts"].items():
        lines.append(f"| {c} | " + " | ".join(f"{r['ms']:.2f} ms ({r['speedup_vs_full']:.1f}x)" for r in row.values())
                     + " |")
    return "\n".join(lines)


def plot_decode(results: dict[str, Any], path: str, title: str) -> None:
    """Decode ms/token and speed-up over full KV against context, a line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [int(c) for c in results["contexts"]]
    names = list(dict.fromkeys(n for row in results["contexts"].values() for n in row))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, name in enumerate(names):
        xs = [c for c in contexts if name in results["contexts"][str(c)]]
        rows = [results["contexts"][str(c)][name] for c in xs]
        key = "decode_ms" if "decode_ms" in rows[0] else "ms"
        axes[0].plot(xs, [r[key] for r in rows], marker="o", label=name, color=f"C{i}")
        axes[1].plot(xs, [r["speedup_vs_full"] for r in rows], marker="o", label=name, color=f"C{i}")
    for ax, label in zip(axes, ["ms per decode step" if "decode" in results else "ms per call",
                                "speed-up over full KV"]):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_bench(results: dict[str, Any], out_dir: str, name: str, text: str, title: str) -> dict[str, str]:
    """NAME.json, NAME.md (the printed tables) and NAME.png in out_dir."""
    from clusterkv_jax.eval.report import write_outputs

    return write_outputs(results, out_dir, name, f"# {title}\n\n{text}\n",
                         lambda path: plot_decode(results, path, title))
