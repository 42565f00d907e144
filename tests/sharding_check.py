"""Sharded runs for tests/test_sharding.py, in a process of its own with 4 CPU devices (the rest of the suite
runs with one): `python -m tests.sharding_check OUT.json`. Needs XLA_FLAGS=--xla_force_host_platform_device_count=4
set before JAX starts (the test sets it). Writes what it measured (tokens, shardings, the collectives in the
compiled HLO); the assertions live in the test.
"""

from __future__ import annotations

import json
import re
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from clusterkv_jax import ClusterKV, FullKV, InfiniGen, Quest, SnapKV, generate, prefill_prompts
from clusterkv_jax import sharding as sh
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.distributed import held_bytes
from clusterkv_jax.decode_loop import generate_ids
from clusterkv_jax.sampling import Sampling
from clusterkv_jax.steps import decode_step, prefill
from clusterkv_jax.loading import Model
from clusterkv_jax.model import for_device, fuse_layer, init_params, move_model_dim_last, unstack_layers
from pallas_kernels import dispatch

# 4 query / 2 KV heads: model=2 splits them. 6 / 3: it cannot (the fallback replicates them).
CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=16)
CFG_3KV = ModelConfig(vocab_size=128, hidden_size=48, intermediate_size=96, num_layers=3, num_heads=6,
                      num_kv_heads=3, head_dim=8)
# Budget 16 against prompts of 20-64 tokens: selection drops most of each prompt; 16 new tokens reach a
# decode-time clustering (decode_interval 8).
SMALL = dict(budget=16, sinks=4, tokens_per_cluster=8, decode_interval=8, decode_clusters=2, full_layers=1)
POLICIES = {
    "full": FullKV(),
    "full_offload": FullKV(offload=True),
    "clusterkv": ClusterKV(**SMALL),
    "clusterkv_offload": ClusterKV(offload=True, **SMALL),
    # The Pallas kernels (K-means centroid sums, cluster -> token indexing) in interpret mode, run per shard.
    "clusterkv_kernels": ClusterKV(kernels="interpret", **SMALL),
    # The prompt's last queries observed per shard; InfiniGen's eigendecomposition per (sequence, KV head).
    "snapkv": SnapKV(budget=16, window=8, pool_size=3, full_layers=1),
    "infinigen": InfiniGen(budget=16, sample=8, full_layers=1),
}
NEW = 16
LENGTHS = [64, 23, 50, 37, 61, 30, 45, 20]  # one prompt bucket (64): `alone` compiles once per batch size
MESH_SPEC = "data=2,model=2"


def _model(config, seed):
    params = init_params(config, jax.random.PRNGKey(seed))
    # Projections 3x the std-0.02 init: attention is peaked enough that dropping tokens changes the output,
    # and greedy margins (>= 4e-3 on these prompts) dwarf the rounding of sharded reductions (~1e-6).
    scale = lambda path, x: x if re.search(r"norm|embed", jax.tree_util.keystr(path)) else 3.0 * x
    return Model(config, jax.tree_util.tree_map_with_path(scale, params), tokenizer=None)


def _prompts(n_lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128, n).tolist() for n in n_lengths]


def _sharding_report(x, want: NamedSharding) -> dict:
    return {"ok": bool(x.sharding.is_equivalent_to(want, x.ndim)) and x.sharding.memory_kind == want.memory_kind,
            "got": f"{x.sharding.spec} {x.sharding.memory_kind}", "want": f"{want.spec} {want.memory_kind}"}


def _collectives(hlo: str) -> list[str]:
    found = []
    for line in hlo.splitlines():
        kinds = "all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter"
        m = re.search(rf"= (.+?) ({kinds})(?:-start)?\(", line)  # the shape may be a tuple (combined ops)
        if m:
            name = re.search(r'op_name="([^"]+)"', line)
            found.append(f"{m.group(2)}|{m.group(1)}|{name.group(1) if name else ''}")
    return found


def main(out_path: str) -> None:
    t0 = time.perf_counter()
    mesh = sh.make_mesh(MESH_SPEC)
    model = _model(CFG, 0)
    prompts = _prompts(LENGTHS, 1)
    res: dict = {"devices": len(jax.devices()), "tokens": {}, "shardings": {}, "section_seconds": {}}
    lap = [time.perf_counter()]

    def section(name):  # how long each part took (the report says where the test's time goes)
        now = time.perf_counter()
        res["section_seconds"][name] = round(now - lap[0], 1)
        lap[0] = now
    kw = dict(stop_at_eos=False, return_cache=True)

    # Sharded vs unsharded generation, four policies, a ragged batch of 8.
    caches = {}
    for name, policy in POLICIES.items():
        plain = generate(model, prompts, NEW, policy=policy, **kw)
        sharded = generate(model, prompts, NEW, policy=policy, mesh=mesh, **kw)
        res["tokens"][name] = {"plain": plain.tokens, "sharded": sharded.tokens}
        caches[name] = sharded.cache

    section("policies")

    # One prefill on the mesh shared by four policies (`prefill_prompts`, keeping the prompts' last 8 queries for
    # SnapKV and InfiniGen): each generates its own unsharded prefill's tokens.
    shared = prefill_prompts(model, prompts, NEW, mesh=mesh, prompt_queries=8)
    served = ("clusterkv", "clusterkv_offload", "snapkv", "infinigen")
    res["tokens"]["prefilled"] = {
        "plain": [res["tokens"][name]["plain"] for name in served],
        "sharded": [generate(model, prompts, NEW, policy=POLICIES[name], prefilled=shared, stop_at_eos=False).tokens
                    for name in served]}
    del shared

    section("prefilled")

    # Each prompt alone (ClusterKV, offload on): unsharded B=1, and sharded (B=1 padded to data=2).
    policy = POLICIES["clusterkv_offload"]
    res["tokens"]["alone"] = {
        "plain": [generate(model, p, NEW, policy=policy, stop_at_eos=False).tokens[0] for p in prompts],
        "sharded": [generate(model, p, NEW, policy=policy, stop_at_eos=False, mesh=mesh).tokens[0] for p in prompts],
    }

    section("alone")

    # Shardings of what came back, against specs written out here.
    def named(*spec, kind="device"):
        return NamedSharding(mesh, P(*spec), memory_kind=kind)

    kv = named(None, "data", "model", None, None)
    c = caches["clusterkv_offload"]
    ps, host = c.policy_state, c.selecting.store
    want = {
        "cache.k": (c.groups[0].store.k, kv), "cache.v": (c.groups[0].store.v, kv),
        "cache.lengths": (c.lengths, named("data")), "cache.prompt_lengths": (c.prompt_lengths, named("data")),
        "cache.host_k": (host.k, named(None, "data", "model", None, None, kind="pinned_host")),
        "cache.host_v": (host.v, named(None, "data", "model", None, None, kind="pinned_host")),
        "clusterkv.centroids": (ps.centroids, named(None, "data", "model", None, None)),
        "clusterkv.sizes": (ps.sizes, named(None, "data", "model", None)),
        "clusterkv.block_start": (ps.block_start, named(None, "data", "model", None)),
        "clusterkv.row_positions": (ps.row_positions, named(None, "data", "model", None)),
        "clusterkv.clustered_upto": (ps.clustered_upto, named(None, "data")),
        "offload.ring_k": (host.ring_k, named(None, "data", "model", None, None)),
        "offload.cache_ids": (host.recall.ids, named(None, "data", "model", None)),  # [n, B, h, R * c]
        "offload.cache_k": (host.recall.k, named(None, "data", "model", None, None)),  # [n, B, h, R * c, chunk * H]
        "offload.step": (host.recall.step, named()),
        "fullkv.k": (caches["full"].groups[0].store.k, kv),
    }
    placed = model._sharded_params  # what generate placed and kept on the model
    assert placed[0] is model.params
    layers = placed[2]["layers"]
    want.update({
        "params.embed": (placed[2]["embed"], named()),
        "params.q": (layers["q"], named(None, None, "model", None)),
        "params.k": (layers["k"], named(None, None, "model", None)),
        "params.o": (layers["o"], named(None, "model", None, None)),
        "params.gate": (layers["gate"], named(None, None, "model")),
        "params.down": (layers["down"], named(None, "model", None)),
        "params.attn_norm": (layers["attn_norm"], named()),
    })
    # Per-layer parameters (a GPU's layout, `unstack_layers`): each layer's arrays split as the stack is, less its
    # leading "layers" dim, holding that layer's values.
    per_layer = sh.shard_params(unstack_layers(model.params), CFG, mesh)["layers"]
    want.update({
        "params.per_layer.q": (per_layer[1]["q"], named(None, "model", None)),
        "params.per_layer.o": (per_layer[1]["o"], named("model", None, None)),
        "params.per_layer.gate": (per_layer[0]["gate"], named(None, "model")),
        "params.per_layer.down": (per_layer[1]["down"], named("model", None)),
        "params.per_layer.attn_norm": (per_layer[1]["attn_norm"], named()),
    })
    res["per_layer_values_equal"] = all(
        np.array_equal(np.asarray(per_layer[i][name]), np.asarray(model.params["layers"][name][i]))
        for i in range(CFG.num_layers) for name in model.params["layers"])
    # Fused per-layer parameters (what `for_device` gives a GPU, `fuse_layer`), fused from the placed ones: qkv
    # [D, K, G + 2, H] split by KV head, so each device holds the query, key and value heads of its KV heads;
    # gate_up [D, 2, F] by F. Placed so, `shard_params` moves nothing.
    fused = tuple(fuse_layer(layer) for layer in per_layer)
    placed_again = sh.shard_params({**model.params, "layers": fused}, CFG, mesh)["layers"]
    res["fused_placed_as_sharded"] = all(x is y for x, y in zip(jax.tree.leaves(fused), jax.tree.leaves(placed_again)))
    want.update({
        "params.fused.qkv": (fused[1]["qkv"], named(None, "model", None, None)),
        "params.fused.gate_up": (fused[0]["gate_up"], named(None, None, "model")),
        "params.fused.o": (fused[1]["o"], named("model", None, None)),
    })
    G = CFG.num_heads // CFG.num_kv_heads
    stacked = {name: np.asarray(x) for name, x in model.params["layers"].items()}
    res["fused_values_equal"] = all(
        np.array_equal(np.asarray(fused[i]["qkv"])[:, kv, G], stacked["k"][i][:, kv])
        and np.array_equal(np.asarray(fused[i]["qkv"])[:, kv, G + 1], stacked["v"][i][:, kv])
        and np.array_equal(np.asarray(fused[i]["qkv"])[:, kv, :G], stacked["q"][i][:, kv * G:(kv + 1) * G])
        and np.array_equal(np.asarray(fused[i]["gate_up"])[:, 1], stacked["up"][i])
        for i in range(CFG.num_layers) for kv in range(CFG.num_kv_heads))
    # Stacked, q/k/v with the model dim last (what `for_device` gives a TPU, `move_model_dim_last`), moved from the
    # placed ones: split by head as before, each device transposing its own shard, so `shard_params` moves nothing;
    # generated on the mesh from them, ClusterKV's tokens are the unsharded ones.
    moved = move_model_dim_last(layers)
    placed_again = sh.shard_params({**model.params, "layers": moved}, CFG, mesh)["layers"]
    res["moved_placed_as_sharded"] = all(x is y for x, y in zip(jax.tree.leaves(moved), jax.tree.leaves(placed_again)))
    want.update({
        "params.model_dim_last.q_t": (moved["q_t"], named(None, "model", None, None)),
        "params.model_dim_last.v_t": (moved["v_t"], named(None, "model", None, None)),
    })
    res["moved_values_equal"] = all(np.array_equal(np.asarray(moved[name + "_t"]), np.moveaxis(stacked[name], 1, -1))
                                    for name in ("q", "k", "v"))
    moved_model = Model(CFG, {**placed[2], "layers": moved}, tokenizer=None)
    res["tokens"]["model_dim_last"] = {
        "plain": res["tokens"]["clusterkv"]["plain"],
        "sharded": generate(moved_model, prompts, NEW, policy=POLICIES["clusterkv"], mesh=mesh,
                            stop_at_eos=False).tokens}
    res["shardings"] = {k: _sharding_report(x, s) for k, (x, s) in want.items()}
    # A second call reuses the placed parameters (no new placement).
    generate(model, prompts[:2], NEW, policy=POLICIES["full"], mesh=mesh, stop_at_eos=False)
    res["params_reused"] = model._sharded_params[2] is placed[2]

    section("shardings")

    # The benchmark path: shard_params + init_cache_sharded + jitted prefill / decode_step with sharding=.
    policy = POLICIES["clusterkv_offload"]
    B, cap = len(prompts), 128
    rules = sh.sharding_rules(CFG, mesh, B)
    params = sh.shard_params(model.params, CFG, mesh)
    cache = sh.init_cache_sharded(CFG, policy, B, cap, jnp.float32, mesh)
    res["shardings"]["init_cache_sharded.host_k"] = _sharding_report(
        cache.selecting.store.k, named(None, "data", "model", None, None, kind="pinned_host"))
    res["shardings"]["init_cache_sharded.centroids"] = _sharding_report(
        cache.policy_state.centroids, named(None, "data", "model", None, None))
    tokens = np.zeros((B, 64), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    logits, cache = prefill(params, sh.shard_batch(tokens, rules), sh.shard_batch(np.array(LENGTHS, np.int32), rules),
                            cache, config=CFG, policy=policy, sharding=rules)
    steps = [np.asarray(logits).argmax(-1)]
    for _ in range(NEW - 1):
        logits, cache = decode_step(params, jnp.asarray(steps[-1], jnp.int32), cache, config=CFG, policy=policy,
                                    sharding=rules)
        steps.append(np.asarray(logits).argmax(-1))
    res["tokens"]["steps_loop"] = {"plain": res["tokens"]["clusterkv_offload"]["plain"],
                                   "sharded": np.stack(steps, 1).tolist()}
    res["shardings"]["decode_step.k"] = _sharding_report(cache.groups[0].store.k, kv)
    res["shardings"]["decode_step.host_k"] = _sharding_report(
        cache.selecting.store.k, named(None, "data", "model", None, None, kind="pinned_host"))
    res["shardings"]["decode_step.centroids"] = _sharding_report(
        cache.policy_state.centroids, named(None, "data", "model", None, None))

    section("steps_loop")

    # Collectives in the compiled program: ClusterKV with offload, ClusterKV with gqa="shared", and Quest (its
    # page ranking is a top-k on every decode step).
    res["collectives"] = {}
    for name, policy in (("clusterkv_offload", POLICIES["clusterkv_offload"]),
                         ("clusterkv_shared", ClusterKV(gqa="shared", **SMALL)),
                         ("clusterkv_kernels", POLICIES["clusterkv_kernels"]),
                         ("quest", Quest(budget=16, page_size=4, full_layers=1))):
        lowered = generate_ids.lower(
            params, sh.shard_batch(tokens, rules), sh.shard_batch(np.array(LENGTHS, np.int32), rules),
            Sampling.make(), jax.random.PRNGKey(0), jnp.zeros((0,), jnp.int32), jnp.int32(0), config=CFG,
            policy=policy, max_new_tokens=NEW, capacity=cap, cache_dtype=jnp.dtype(jnp.float32), sharding=rules)
        res["collectives"][name] = _collectives(lowered.compile().as_text())
    # A GPU's program: the layers unrolled over per-layer, fused parameters (`for_device`).
    from clusterkv_jax import kernels

    with kernels.forced_layer_loop("unrolled"):
        gpu_params = sh.shard_params(for_device(model.params), CFG, mesh)
        lowered = generate_ids.lower(
            gpu_params, sh.shard_batch(tokens, rules), sh.shard_batch(np.array(LENGTHS, np.int32), rules),
            Sampling.make(), jax.random.PRNGKey(0), jnp.zeros((0,), jnp.int32), jnp.int32(0), config=CFG,
            policy=POLICIES["clusterkv_offload"], max_new_tokens=NEW, capacity=cap,
            cache_dtype=jnp.dtype(jnp.float32), sharding=rules)
        res["collectives"]["gpu_layout"] = _collectives(lowered.compile().as_text())
    res["sizes"] = {"B": B, "T": 64, "D": CFG.hidden_size, "S": cap}

    section("collectives")

    # The same program with the Pallas kernels, lowered for CUDA (no GPU needed to lower): the kernels must be
    # Triton calls inside shard_map (manual) regions, one per device shard, not custom calls the partitioner
    # would gather. The kernel switch is forced on as if these host devices were sm80+ GPUs.
    with mock.patch.object(dispatch, "kernels_supported", lambda device=None: True):
        lowered = generate_ids.trace(
            params, sh.shard_batch(tokens, rules), sh.shard_batch(np.array(LENGTHS, np.int32), rules),
            Sampling.make(), jax.random.PRNGKey(0), jnp.zeros((0,), jnp.int32), jnp.int32(0), config=CFG,
            policy=ClusterKV(kernels="pallas", **SMALL), max_new_tokens=NEW, capacity=cap,
            cache_dtype=jnp.dtype(jnp.float32), sharding=rules).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    res["cuda_lowering"] = {"triton_calls": text.count("__gpu$xla.gpu.triton"),
                            "manual_regions": text.count("sdy.manual_computation")}

    section("cuda_lowering")

    # Fallback: 3 KV heads on model=2 are replicated; a batch of 3 is padded to 4 for data=2.
    model3 = _model(CFG_3KV, 2)
    prompts3 = _prompts([40, 64, 27], 3)
    res["fallback"] = {}
    for name in ("full", "clusterkv_offload"):
        plain = generate(model3, prompts3, NEW, policy=POLICIES[name], stop_at_eos=False)
        sharded = generate(model3, prompts3, NEW, policy=POLICIES[name], mesh=mesh, stop_at_eos=False,
                           return_cache=True)
        c = sharded.cache
        res["fallback"][name] = {
            "plain": plain.tokens, "sharded": sharded.tokens, "cache_batch": c.batch_size,
            "k": _sharding_report(c.groups[0].store.k, named(None, "data", None, None, None)),
            "q": _sharding_report(model3._sharded_params[2]["layers"]["q"], named()),
            "gate": _sharding_report(model3._sharded_params[2]["layers"]["gate"], named(None, None, "model")),
        }
        if c.offloaded:
            res["fallback"][name]["host_k"] = _sharding_report(
                c.selecting.store.k, named(None, "data", None, None, None, kind="pinned_host"))
            res["fallback"][name]["centroids"] = _sharding_report(c.policy_state.centroids, named(None, "data"))

    # What --mesh's memory check counts (sharding.held_param_bytes) against what placing the parameters holds on
    # the devices, with the heads split over "model" and with them copied to each of its devices (3 KV heads).
    res["held_param_bytes"] = {
        name: {"counted": sh.held_param_bytes(cfg, np.asarray(m.params["embed"]).dtype, MESH_SPEC),
               "placed": held_bytes(placed)["with_copies"], "whole": held_bytes(placed)["whole"]}
        for name, cfg, m in (("split", CFG, model), ("heads_copied", CFG_3KV, model3))
        for placed in [sh.shard_params(m.params, cfg, mesh)]}

    section("fallback")
    res["seconds"] = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
