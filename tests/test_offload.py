"""Host-offloaded KV: memory kinds, equality with the on-device path, the R-step recall cache against a
NumPy simulation, and device bytes that do not grow with the context."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clusterkv_jax import offload
from clusterkv_jax.cache import init_cache, kv_bytes
from clusterkv_jax.offload import HostKV
from clusterkv_jax.store import Selection
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.generate import generate
from clusterkv_jax.steps import decode_step, prefill
from clusterkv_jax.loading import Model
from clusterkv_jax.model import init_params
from clusterkv_jax.policies import ClusterKV, FullKV, Quest
from tests.helpers import assert_same_rows

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=16)
PARAMS = init_params(CFG, jax.random.PRNGKey(0))
SMALL = dict(sinks=4, tokens_per_cluster=8, decode_interval=16, decode_clusters=2)
TOKENS = np.random.default_rng(0).integers(0, 128, (2, 448))
LENGTHS = np.array([180, 120])


def run(policy, steps=40):
    cache = init_cache(CFG, policy, 2, 448, jnp.float32)
    logits, cache = prefill(PARAMS, jnp.asarray(TOKENS[:, :192]), jnp.asarray(LENGTHS), cache, config=CFG,
                            policy=policy)
    out = [np.asarray(logits)]
    for i in range(steps):
        logits, cache = decode_step(PARAMS, jnp.asarray(TOKENS[np.arange(2), LENGTHS + i]), cache, config=CFG,
                                    policy=policy)
        out.append(np.asarray(logits))
    return np.stack(out), cache


POLICIES = {
    "full": lambda **kw: FullKV(**kw),
    "clusterkv": lambda **kw: ClusterKV(budget=48, **SMALL, **kw),
    "clusterkv_shared_R2": lambda **kw: ClusterKV(budget=48, gqa="shared", recall_steps=2, **SMALL, **kw),
    "quest": lambda **kw: Quest(budget=48, page_size=8, **kw),
    # Candidates' keys read from host memory (`HostLayer.key_blocks`), then rows selected.
    "clusterkv_token_refine": lambda **kw: ClusterKV(budget=48, token_refine=2, **SMALL, **kw),
    # A budget covering the capacity: every step attends the whole layer, the window's tokens from the device ring.
    "clusterkv_covering": lambda **kw: ClusterKV(budget=512, **SMALL, **kw),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_offload_matches_device_path_and_uses_pinned_host(name):
    on_device, _ = run(POLICIES[name]())
    offloaded, cache = run(POLICIES[name](offload=True))
    np.testing.assert_allclose(offloaded, on_device, atol=1e-6, rtol=0)
    host = cache.groups[-1].store
    assert isinstance(host, HostKV)
    assert host.k.sharding.memory_kind == "pinned_host"
    assert host.v.sharding.memory_kind == "pinned_host"
    # Everything else (device stores, the window ring, the recall cache, the policy state) is device memory.
    host_kv = {id(g.store.k) for g in cache.groups if g.on_host} | {id(g.store.v) for g in cache.groups if g.on_host}
    for leaf in jax.tree_util.tree_leaves(cache):
        assert leaf.sharding.memory_kind == ("pinned_host" if id(leaf) in host_kv else "device")
    if name not in ("full", "clusterkv_covering"):  # the covering budget selects nothing
        rates = offload.hit_rates(cache)
        assert rates[:2] == [None, None], "full layers select nothing"
        assert all(0 <= r <= 1 for r in rates[2:])


def test_generate_with_offload_gives_the_same_tokens():
    model = Model(CFG, PARAMS, tokenizer=None)
    prompts = [TOKENS[0, :100].tolist(), TOKENS[1, :64].tolist()]
    for make in (POLICIES["clusterkv"], POLICIES["quest"]):
        plain = generate(model, prompts, 40, policy=make(), stop_at_eos=False)
        off = generate(model, prompts, 40, policy=make(offload=True), stop_at_eos=False, return_cache=True)
        assert off.tokens == plain.tokens
        assert off.cache.groups[-1].store.k.sharding.memory_kind == "pinned_host"


def test_longer_cache_history_hits_at_least_as_often():
    """Offload does not change the trajectory, so R=2 sees the same selections as R=1 and a superset cache."""
    _, r1 = run(ClusterKV(budget=48, offload=True, recall_steps=1, **SMALL))
    _, r2 = run(ClusterKV(budget=48, offload=True, recall_steps=2, **SMALL))
    for a, b in zip(offload.hit_rates(r1)[2:], offload.hit_rates(r2)[2:]):
        assert b >= a - 1e-9
    assert offload.hit_rates(r1)[2] > 0  # consecutive steps do share clusters


def numpy_cache_simulation(selections, R, kv_heads, fetch_size):
    """An R-step cache in NumPy: a token hits if the same (sequence, head) selected it in the last R steps. Returns
    (hits, selected tokens, rows fetched): each step fetches its misses in rounds of `fetch_size` per KV head, as
    many rounds as the (sequence, KV head) with the most misses among its selection heads needs."""
    history, hits, total, fetched = [], 0, 0, 0
    for idx, mask in selections:
        B, h = idx.shape[:2]
        misses = np.zeros((B, kv_heads), int)
        for b in range(B):
            for head in range(h):
                recent = set()
                for past_idx, past_mask in history[-R:]:
                    recent |= set(past_idx[b, head][past_mask[b, head]].tolist())
                chosen = idx[b, head][mask[b, head]].tolist()
                hits += sum(t in recent for t in chosen)
                total += len(chosen)
                misses[b, head // (h // kv_heads)] += sum(t not in recent for t in chosen)
        fetched += -(-misses.max() // fetch_size) * B * kv_heads * fetch_size
        history.append((idx, mask))
    return hits, total, fetched


@pytest.mark.parametrize("R, chunk, aligned", [(1, 1, False), (2, 1, False), (3, 1, False), (1, 1, True),
                                               (3, 1, True), (1, 4, True), (2, 4, True), (2, 4, False)])
def test_recall_cache_matches_numpy_simulation_and_returns_host_rows(R, chunk, aligned):
    """Chunks of `chunk` rows starting at multiples of it; `aligned` says so (the cache then looks them up in a
    table by block, else it compares every chunk with every slot): the same hits, rows and moves either way."""
    rng = np.random.default_rng(R)
    B, K, h, M, H = 2, 2, 4, 12, 16
    S = 64 * chunk
    store = HostKV.create(1, B, K, S, H, jnp.float32, window=16, selection_shape=(B, h, M, chunk), recall_steps=R)
    store = store.replace(k=offload.to_host(jnp.asarray(rng.normal(size=(1, B, K, S, H)), jnp.float32)),
                          v=offload.to_host(jnp.asarray(rng.normal(size=(1, B, K, S, H)), jnp.float32)))

    @jax.jit
    def step(store, idx, mask):  # idx [B, h, M] chunk numbers, mask [B, h, M] whole chunks selected
        selection = Selection(starts=idx * chunk, mask=jnp.broadcast_to(mask[..., None], (*mask.shape, chunk)),
                              chunk=chunk, aligned=aligned)
        k, v, got_mask, view = store.layer(jnp.int32(0)).read(selection)
        return k, v, got_mask, view.store

    selections = []
    for t in range(8):
        # Overlapping selections from a small pool, so some steps hit and some miss.
        idx = np.stack([[rng.choice(24, M, replace=False) + (t % 3) * 4 for _ in range(h)] for _ in range(B)])
        mask = rng.random((B, h, M)) > 0.15
        k, v, got_mask, store = step(store, jnp.asarray(idx, jnp.int32), jnp.asarray(mask))
        hk, hv = np.asarray(offload.to_device(store.k))[0], np.asarray(offload.to_device(store.v))[0]
        kv_head = np.arange(h) // (h // K)
        rows = (idx[..., None] * chunk + np.arange(chunk)).reshape(B, h, M * chunk)
        row_mask = np.repeat(mask, chunk, axis=-1)
        assert_same_rows(k, got_mask, hk[np.arange(B)[:, None, None], kv_head[None, :, None], rows], row_mask)
        assert_same_rows(v, got_mask, hv[np.arange(B)[:, None, None], kv_head[None, :, None], rows], row_mask)
        selections.append((idx, mask))
    hits, total, fetched = numpy_cache_simulation(selections, R, K, offload.fetch_size(h // K * M))
    assert (int(store.recall.hits[0]), int(store.recall.selected[0])) == (hits * chunk, total * chunk)
    # Only whole rounds of a KV head's packed misses move: the rows the NumPy rounds count.
    assert int(store.recall.fetched[0]) == fetched * chunk
    assert 0 < hits < total
    # Selecting the last step's chunks again hits everything: nothing moves.
    before = float(store.recall.fetched[0])
    _, _, _, store = step(store, jnp.asarray(idx, jnp.int32), jnp.asarray(mask))
    assert float(store.recall.fetched[0]) == before


def test_device_kv_bytes_do_not_grow_with_context():
    policy = ClusterKV(budget=64, offload=True, **SMALL)
    small, large = (init_cache(CFG, policy, 1, cap, jnp.float32) for cap in (2048, 8192))

    def compressed_device_bytes(cache):
        host = cache.groups[1].store
        return sum(x.nbytes for x in (host.ring_k, host.ring_v, host.recall.k, host.recall.v))

    assert compressed_device_bytes(small) == compressed_device_bytes(large)
    # The host holds every row of the selecting layers' stores (ClusterKV's layout: ~1.2 rows per position).
    for cache, cap in ((small, 2048), (large, 8192)):
        layers, rows = CFG.num_layers - policy.full_layers, policy.layout.store_rows(cap)
        assert kv_bytes(cache)["host"] == 2 * layers * CFG.num_kv_heads * rows * CFG.head_dim * 4
    assert 3.9 < kv_bytes(large)["host"] / kv_bytes(small)["host"] <= 4
    # Device KV is the 2 full layers (which grow) plus the fixed compressed-layer buffers.
    full_layers = lambda c: c.groups[0].store.k.nbytes + c.groups[0].store.v.nbytes
    assert kv_bytes(large)["device"] - full_layers(large) == kv_bytes(small)["device"] - full_layers(small)


def test_offload_falls_back_without_host_memory(monkeypatch):
    monkeypatch.setattr(offload, "host_memory_kind", lambda: None)
    on_device, _ = run(POLICIES["clusterkv"]())
    fallback, cache = run(POLICIES["clusterkv"](offload=True))
    np.testing.assert_allclose(fallback, on_device, atol=1e-6, rtol=0)
    assert cache.groups[-1].store.k.sharding.memory_kind == "device"


def test_bench_offload_reports_hit_rates_bytes_and_clustering_share():
    from clusterkv_jax.bench.offload import bench_offload
    from clusterkv_jax.bench.report import format_offload

    model = Model(CFG, PARAMS, tokenizer=None)
    ids = TOKENS[0].tolist()
    res = bench_offload(model, ids, context=200, new_tokens=20, budget=48, recall_steps=[1, 2], progress=False)
    r1, r2 = res["runs"]["R=1"], res["runs"]["R=2"]
    assert 0 < r1["hit_rate"] <= r2["hit_rate"] <= 1
    assert r1["kv_bytes"]["host"] == r2["kv_bytes"]["host"] > 0
    assert r2["kv_bytes"]["device"] > r1["kv_bytes"]["device"]  # R=2 keeps two steps of rows
    assert res["prefill"]["full"]["prefill_s"] > 0 and "clustering" in format_offload(res)


def test_pack_misses_against_numpy():
    """offload.pack_misses against a loop: each KV head's misses in (selection head, selection) order at the
    front of its rounds, with their starts and their slots in the KV head's cache rows; the rest start 0, slot
    G·S; kv_slot and the miss counts likewise."""
    rng = np.random.default_rng(5)
    B, K, G, c, S, n = 2, 3, 2, 7, 9, 4
    h = K * G
    starts = rng.integers(0, 1000, (B, h, c)).astype(np.int32)
    slot = rng.integers(0, S + 1, (B, h, c)).astype(np.int32)  # S: in no slot
    miss = rng.random((B, h, c)) < 0.4
    miss_number = np.cumsum(miss, axis=-1).astype(np.int32) - 1
    kv_slot, miss_starts, miss_slots, kv_misses = jax.jit(offload.pack_misses, static_argnums=(4, 5, 6))(
        starts, slot, miss, miss_number, K, S, n)
    P = -(-G * c // n) * n
    for b in range(B):
        for k in range(K):
            want_starts, want_slots, want_kv_slot = [], [], []
            for g in range(G):
                for i in range(c):
                    row = g * S + slot[b, k * G + g, i] if slot[b, k * G + g, i] < S else G * S
                    want_kv_slot.append(row)
                    if miss[b, k * G + g, i]:
                        want_starts.append(starts[b, k * G + g, i])
                        want_slots.append(row)
            m = len(want_starts)
            np.testing.assert_array_equal(np.asarray(kv_slot[b, k]), want_kv_slot)
            assert int(kv_misses[b, k]) == m
            np.testing.assert_array_equal(np.asarray(miss_starts[b, k]), want_starts + [0] * (P - m))
            np.testing.assert_array_equal(np.asarray(miss_slots[b, k]), want_slots + [G * S] * (P - m))


@pytest.mark.parametrize("writer", ["_update_rows", "_rewrite_planes"])
def test_gpu_and_tpu_host_writes_equal_a_numpy_scatter(writer):
    """The writes into host memory that XLA:GPU (a dynamic-update-slice per row) and XLA:TPU (whole planes read,
    updated and written back) compile to DMAs, run here on the CPU's pinned_host memory: the rows in range land
    where a NumPy scatter puts them, a pair with every row out of range and every other row stay as they were."""
    from clusterkv_jax import offload

    n, B, K, R, H, m = 2, 2, 3, 40, 4, 5
    rng = np.random.default_rng(0)
    base = rng.normal(size=(n, B, K, R, H)).astype(np.float32)
    rows = np.stack([rng.permutation(R + 3)[:m] for _ in range(B * K)]).reshape(B, K, m).astype(np.int32)
    rows[0, 1] = R + 1  # nothing to write for this (sequence, KV head)
    values = rng.normal(size=(B, K, m, H)).astype(np.float32)
    want = base.copy()
    for b, k, i in np.ndindex(B, K, m):
        if rows[b, k, i] < R:
            want[1, b, k, rows[b, k, i]] = values[b, k, i]
    store = offload.to_host(jnp.asarray(base))
    got = jax.jit(getattr(offload, writer), donate_argnums=0)(store, jnp.int32(1), jnp.asarray(rows),
                                                                 jnp.asarray(values))
    assert got.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(offload.to_device(got)), want)

