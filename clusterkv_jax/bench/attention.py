"""`clusterkv bench attention`: one layer's decode attention alone, full vs each policy's decode step (index,
select, read, attend), and what its selection costs, on synthetic clustered keys: alone (a program of its own) and
inside the step (the step less the same step given the selection)."""

from __future__ import annotations

import dataclasses
import statistics
import sys
from typing import Any

import jax
import jax.numpy as jnp

from clusterkv_jax import attention
from clusterkv_jax.attend import decode_selecting, write_prompt_layer
from clusterkv_jax.bench.measure import compiled, timed
from clusterkv_jax.bench.synthetic import synthetic_kv
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.steps import bucket_length, cache_capacity
from clusterkv_jax.policies import KVPolicy
from clusterkv_jax.store import DeviceKV


def _output_state_and_store(result, state):
    out, view = result  # a decode step leaves the state as it was
    return out, state, view.store


class _Donating:
    """Calls exe(state, q, store, lengths, *rest) -> (out, state, store), passing each call's state and store to
    the next (both donated, as the model's decode step donates the cache)."""

    def __init__(self, exe, state, store):
        self.exe, self.state, self.store = exe, state, store

    def __call__(self, q, lengths, *rest):
        out, self.state, self.store = self.exe(self.state, q, self.store, lengths, *rest)
        return out


def _given_selection(policy: KVPolicy, selection) -> KVPolicy:
    """`policy` whose `select` returns `selection` (traced, computed outside): its decode step without the
    selection's work, the rest (index, read, attend) unchanged."""
    given = type(f"Given{type(policy).__name__}", (type(policy),), {"select": lambda self, *args: selection})
    return given(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.init})


def bench_attention(config: ModelConfig, policies: dict[str, KVPolicy], contexts: list[int], *, batch: int = 1,
                    dtype=jnp.float32, repeats: int = 20, seed: int = 0, progress: bool = True) -> dict[str, Any]:
    """One layer's decode attention: full (`attention.decode_attention`) vs each selecting policy's decode step
    (`attend.decode_selecting`, over its own store layout, the store donated as in the model's step), its `select`
    alone, and the step given the selection (select_in_step_ms: the step's time less this). Each time is the median of
    `repeats` calls; every step, and the step given its selection, is timed right after a full-attention call (a
    program that reads the whole layer, as the layers before do in a model), the select after the given step.
    Policies that select in no layer of `config` (full KV) are timed once, as "full"."""
    one_layer = dataclasses.replace(config, num_layers=1, layer_types=())  # one full-attention layer
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
        indexing: dict[str, float] = {}  # the layer's prompt indexing and layout (ClusterKV: clustering)
        calls["full"] = (compiled(jax.jit(attention.decode_attention), q, k, v, lengths)[0], (q, k, v, lengths))
        order: list[str] = []
        for name, policy in policies.items():
            if policy.full_layers >= config.num_layers:  # selects nothing
                continue
            policy = dataclasses.replace(policy, full_layers=0)
            state = policy.init_state(one_layer, batch, capacity)
            if n := policy.prompt_queries:  # SnapKV, InfiniGen: the prompt's last queries (random, as the keys)
                sample = jax.random.normal(jax.random.PRNGKey(seed + 2), (batch, N, n, H), jnp.float32)
                state = policy.observe_queries(state, sample, jnp.ones((batch, n), bool))
            rows = policy.layout.store_rows(capacity)
            empty = (DeviceKV.create(1, batch, config.num_kv_heads, rows, H, dtype), state)
            # The store and index a prefill of this prompt leaves, in the policy's layout.
            index = jax.jit(lambda e, k, v, n, p=policy: write_prompt_layer(p, *e, jnp.int32(0), k, v, n,
                                                                              capacity))
            (store, lay), index_s = timed(compiled(index, empty, k, v, lengths)[0], empty, k, v, lengths)
            # As in the model's decode step, the state and the store are donated (a policy may update them in
            # place; without donation a step that may rewrite them copies them whole). The lengths do not grow, so
            # every call makes the same selection.
            attend = jax.jit(lambda s, q, st, n, p=policy: _output_state_and_store(decode_selecting(
                p, s, q, st.layer(jnp.int32(0), capacity), n, n), s), donate_argnums=(0, 2))
            given = jax.jit(lambda s, q, st, n, sel, p=policy: _output_state_and_store(decode_selecting(
                _given_selection(p, sel), s, q, st.layer(jnp.int32(0), capacity), n, n), s), donate_argnums=(0, 2))
            copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731  (each call donates its own)
            # What `select` reads of the keys: all of them (by position), blocks of its own store, or none.
            keys = k if policy.reads_all_keys else copy(store) if policy.reads_key_blocks else None

            def select_call(s, q, k, n, p=policy):
                if p.reads_key_blocks:
                    k = k.layer(jnp.int32(0), capacity).key_blocks
                return p.select(s, q, k, n, n)

            select = compiled(jax.jit(select_call), lay, q, keys, lengths)[0]
            selection = select(lay, q, keys, lengths)  # what the given step is handed
            state_2, store_2, state = copy(lay), copy(store), copy(lay)  # `lay` stays for the select timing
            calls[name] = (_Donating(compiled(attend, state, q, store, lengths)[0], state, store), (q, lengths))
            calls[f"{name} given"] = (_Donating(compiled(given, state_2, q, store_2, lengths, selection)[0],
                                                state_2, store_2), (q, lengths, selection))
            indexing[name] = index_s
            calls[f"{name} select"] = (select, (lay, q, keys, lengths))
            order += ["full", name, "full", f"{name} given", f"{name} select"]
        times: dict[str, list[float]] = {name: [] for name in calls}
        for i in range(repeats + 1):
            for name in order or ["full"]:
                exe, args = calls[name]
                _, seconds = timed(exe, *args)
                if i:  # the first call of each warms up
                    times[name].append(seconds)
        ms = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
        row = {name: {"ms": t} for name, t in ms.items() if not name.endswith(" given")}
        for name, seconds in indexing.items():
            row[name]["indexing_ms"] = 1e3 * seconds
            row[name]["given_selection_ms"] = ms[f"{name} given"]
            row[name]["select_in_step_ms"] = ms[name] - ms[f"{name} given"]
            row[name]["select_share_in_step"] = row[name]["select_in_step_ms"] / ms[name]
        for name, info in row.items():
            info["speedup_vs_full"] = row["full"]["ms"] / info["ms"]
            if name.endswith(" select"):
                info["share_of_policy_attention"] = info["ms"] / row[name[: -len(" select")]]["ms"]
        results["contexts"][str(context)] = row
        if progress:
            print(f"context {context}: " + ", ".join(f"{n} {r['ms']:.2f} ms" for n, r in row.items()), file=sys.stderr)
    return results
