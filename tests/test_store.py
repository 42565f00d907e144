"""The KV-store protocol (clusterkv_jax.store): DeviceKV and HostKV answer it alike, as a NumPy model of the
store says, including positions past the capacity (writes dropped, reads clamped); and causal prefill attention
at any prompt length against NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clusterkv_jax import kernels
from clusterkv_jax.attention import causal_attention
from clusterkv_jax.offload import HostKV, to_device
from clusterkv_jax.store import DeviceKV, Selection
from tests.helpers import assert_same_rows

n, B, K, S, H, W = 2, 2, 2, 24, 4, 6


def _stores():
    device = DeviceKV.create(n, B, K, S, H, jnp.float32)
    host = HostKV.create(n, B, K, S, H, jnp.float32, window=W, selection_shape=(B, 2 * K, 5, 1), recall_steps=1)
    return {"device": device, "host": host}


@pytest.mark.parametrize("placement", ["device", "host"])
def test_store_protocol_against_numpy(placement):
    rng = np.random.default_rng(0)
    store = _stores()[placement]
    want_k, want_v = np.zeros((2, n, B, K, S, H), np.float32)
    T = 10
    prompt_k, prompt_v = rng.normal(size=(2, B, K, T, H)).astype(np.float32)
    store = jax.jit(lambda s, k, v: s.write_prompt(jnp.int32(1), k, v))(store, prompt_k, prompt_v)
    want_k[1, :, :, :T], want_v[1, :, :, :T] = prompt_k, prompt_v

    write = jax.jit(lambda s, p, k, v: s.write_token(jnp.int32(1), p, k, v))
    # Sequence 1 writes one position past the capacity at the last step: that write is dropped.
    positions = [np.array([T + t, T + t if t < 3 else S]) for t in range(4)]
    for pos in positions:
        k, v = rng.normal(size=(2, B, K, H)).astype(np.float32)
        store = write(store, jnp.asarray(pos, jnp.int32), k, v)
        for b in range(B):
            if pos[b] < S:
                want_k[1, b, :, pos[b]], want_v[1, b, :, pos[b]] = k[b], v[b]

    view = lambda s: s.layer(jnp.int32(1))  # noqa: E731
    keys, values = jax.jit(lambda s: (view(s).keys(), view(s).values()))(store)
    np.testing.assert_array_equal(np.asarray(keys), want_k[1])
    np.testing.assert_array_equal(np.asarray(values), want_v[1])
    layer0 = jax.jit(lambda s: s.layer(jnp.int32(0)).keys())(store)
    assert not np.asarray(layer0).any(), "other layers untouched"

    # A selection per query head (h = 2K, head n reads KV head n // 2) with out-of-range positions clamped.
    idx = rng.integers(0, T + 3, (B, 2 * K, 5)).astype(np.int32)
    idx[0, 0, 0] = S + 7  # clamped to S - 1
    mask = rng.random((B, 2 * K, 5)) < 0.8
    k_sel, v_sel, got_mask = jax.jit(lambda s, i, m: view(s).read(Selection.of_rows(i, m))[:3])(store, idx, mask)
    kv_head = (np.arange(2 * K) // 2)[None, :, None]
    clamped = np.minimum(idx, S - 1)
    assert_same_rows(k_sel, got_mask, want_k[1, np.arange(B)[:, None, None], kv_head, clamped], mask)
    assert_same_rows(v_sel, got_mask, want_v[1, np.arange(B)[:, None, None], kv_head, clamped], mask)

    # The window: the last W tokens written (HostKV serves them from its device ring).
    w_idx = np.array([[T, T + 1, T + 2, T + 3], [T, T + 1, T + 2, T + 2]], np.int32)
    k_win, v_win = jax.jit(lambda s, i: view(s).window(i))(store, w_idx)
    np.testing.assert_array_equal(np.asarray(k_win), np.transpose(want_k[1, np.arange(B)[:, None], :, w_idx], (0, 2, 1, 3)))
    np.testing.assert_array_equal(np.asarray(v_win), np.transpose(want_v[1, np.arange(B)[:, None], :, w_idx], (0, 2, 1, 3)))

    if placement == "host":
        assert store.k.sharding.memory_kind == "pinned_host"
        np.testing.assert_array_equal(np.asarray(to_device(store.k)), want_k)


@pytest.mark.parametrize("placement,aligned,by_row", [
    ("device", False, False), ("device", True, False), ("device", False, True), ("host", False, False),
    ("host", True, False)], ids=["device-any-start", "device-aligned", "device-by-row", "host-any-start",
                                 "host-aligned"])
def test_chunks_layers_and_window_commits_against_numpy(placement, aligned, by_row):
    """Whole-layer writes, reads of chunks of consecutive rows (the recall cache looking whole chunks up; with
    `aligned`, chunks that are whole blocks of the store, read as blocks; `by_row`, chunks from any start read an
    index per row, as on a TPU), and the window's rows copied to rows elsewhere (and a commit with every
    destination out of range: nothing moves), as a NumPy model of the store says."""
    with kernels.forced_chunks_read_row_by_row(by_row):
        _chunks_layers_and_window_commits(placement, aligned)


def _chunks_layers_and_window_commits(placement, aligned):
    rng = np.random.default_rng(1)
    chunk, c = 4, 3
    if placement == "device":
        store = DeviceKV.create(n, B, K, S, H, jnp.float32)
    else:
        store = HostKV.create(n, B, K, S, H, jnp.float32, window=W, selection_shape=(B, K, c, chunk), recall_steps=2)
    want_k, want_v = rng.normal(size=(2, B, K, S, H)).astype(np.float32)
    store = jax.jit(lambda s, k, v: s.write_layer(jnp.int32(0), k, v))(store, want_k, want_v)
    view = lambda s: s.layer(jnp.int32(0))  # noqa: E731
    def read_selection(s, st, m):
        k, v, got_mask, after = view(s).read(Selection(starts=st, mask=m, chunk=chunk, aligned=aligned))
        return k, v, got_mask, after.store

    read = jax.jit(read_selection)
    for step in range(3):  # the recall cache sees repeated chunks
        starts = rng.integers(0, S - chunk + 1, (B, K, c)).astype(np.int32)
        if aligned:
            starts = starts // chunk * chunk
        mask = rng.random((B, K, c, chunk)) < 0.8
        k_sel, v_sel, got_mask, store = read(store, starts, mask)
        rows = (starts[..., None] + np.arange(chunk)).reshape(B, K, c * chunk)
        flat_mask = mask.reshape(B, K, c * chunk)
        assert_same_rows(k_sel, got_mask, np.take_along_axis(want_k, rows[..., None], axis=2), flat_mask)
        assert_same_rows(v_sel, got_mask, np.take_along_axis(want_v, rows[..., None], axis=2), flat_mask)
    # The window: tokens written at rows 3..6, then copied to rows dest (row S: out of range, dropped).
    for t, row in enumerate(range(3, 7)):
        k, v = rng.normal(size=(2, B, K, H)).astype(np.float32)
        store = jax.jit(lambda s, r, k, v: s.write_token(jnp.int32(0), r, k, v))(store, jnp.full((B,), row), k, v)
        want_k[:, :, row], want_v[:, :, row] = k, v
    window = np.tile(np.arange(3, 7), (B, 1)).astype(np.int32)
    dest = rng.permutation(np.arange(10, 10 + K * 4)).reshape(1, K, 4).repeat(B, 0).astype(np.int32)
    dest[1, 0, 2] = S
    commit = jax.jit(lambda s, w, d: view(s).commit_window(w, d).store)
    store = commit(store, window, dest)
    store = commit(store, window[:, ::-1].copy(), np.full_like(dest, S))  # nothing due: every row dropped
    for b in range(B):
        for k in range(K):
            for i in range(4):
                if dest[b, k, i] < S:
                    want_k[b, k, dest[b, k, i]], want_v[b, k, dest[b, k, i]] = want_k[b, k, 3 + i], want_v[b, k, 3 + i]
    keys, values = jax.jit(lambda s: (view(s).keys(), view(s).values()))(store)
    np.testing.assert_array_equal(np.asarray(keys), want_k)
    np.testing.assert_array_equal(np.asarray(values), want_v)


def test_kv_bytes_count_what_each_placement_holds():
    stores = _stores()
    row = B * K * S * H * 4
    assert stores["device"].nbytes() == {"device": 2 * n * row, "host": 0}
    host = stores["host"].nbytes()
    assert host["host"] == 2 * n * row
    ring, recall = 2 * n * B * K * W * H * 4, 2 * n * B * 2 * K * 1 * 5 * H * 4
    assert host["device"] >= ring + recall and host["device"] < ring + recall + 4096  # plus ids and counters


@pytest.mark.parametrize("T, block", [(300, 512), (700, 256), (1024, 256), (513, 512), (1, 64), (65, 64)])
def test_causal_attention_at_any_length(T, block):
    """Equal to NumPy softmax attention for prompts shorter than a block, a whole number of blocks, and not;
    and, when the prompt spans several blocks, only [G * block, block] score tiles (never [T, T])."""
    rng = np.random.default_rng(T)
    Bq, N, Kh, Hd = 2, 4, 2, 8
    q = rng.normal(size=(Bq, T, N, Hd)).astype(np.float32)
    k, v = rng.normal(size=(2, Bq, T, Kh, Hd)).astype(np.float32)
    got = np.asarray(causal_attention(q, k, v, block=block))
    G = N // Kh
    scores = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, G, axis=2)) / np.sqrt(Hd)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), np.repeat(v, G, axis=2))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    if T > block:
        jaxpr = jax.make_jaxpr(lambda q, k, v: causal_attention(q, k, v, block=block))(q, k, v)
        shapes = list(_shapes(jaxpr.jaxpr))
        assert any(s[-2:] == (G * block, block) for s in shapes), "the score tile"
        assert not any(len(s) >= 2 and s[-1] >= T and s[-2] >= block for s in shapes), "a score row over all keys"


def _shapes(jaxpr):
    """Shapes of every value computed in a jaxpr, inside loop and branch bodies too."""
    for eqn in jaxpr.eqns:
        yield from (var.aval.shape for var in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if hasattr(sub, "eqns"):
                    yield from _shapes(sub)
                elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from _shapes(sub.jaxpr)


def test_device_commit_is_conditional_on_the_cpu_only():
    """`DeviceLayer.commit_window` skips its scatter under a `lax.cond` on the CPU (where the cond updates the
    store in place and the unconditional scatter cost a quarter of a layer's step) and is a plain scatter for
    CUDA (where a cond returning the store copied it whole): `lax.platform_dependent` resolves at lowering."""
    store = DeviceKV.create(n, B, K, S, H, jnp.float32)
    window = jnp.zeros((B, 4), jnp.int32)
    dest = jnp.full((B, K, 4), S, jnp.int32)
    commit = jax.jit(lambda s, w, d: s.layer(jnp.int32(0)).commit_window(w, d).store)

    def module(platform):
        return commit.trace(store, window, dest).lower(lowering_platforms=(platform,)).as_text()

    # The due test (any destination < R) is the only comparison: the CPU module computes it to branch on, the CUDA
    # one does not (its only `case` is platform_dependent's own, on a constant index, which XLA folds).
    cpu, cuda = module("cpu"), module("cuda")
    assert "stablehlo.compare" in cpu and "stablehlo.scatter" in cpu
    assert "stablehlo.compare" not in cuda and "stablehlo.scatter" in cuda
    compiled = commit.lower(store, window, dest).compile().as_text()
    assert "conditional(" in compiled


def test_scatter_entries_writes_one_layer_and_drops_out_of_range():
    """ops.scatter_entries (the recall cache's slot ids and last-use steps) against NumPy: values land at
    [layer, b, k, index] of one layer only; an index past the table is dropped."""
    from clusterkv_jax.ops import row_index, scatter_entries

    rng = np.random.default_rng(3)
    L, m = 3, 5
    table = rng.integers(-9, 9, (L, B, K, S)).astype(np.int32)
    index = rng.permutation(S + 4)[: B * K * m].reshape(B, K, m).astype(np.int32)  # some >= S: dropped
    values = rng.integers(100, 200, (B, K, m)).astype(np.int32)
    want = table.copy()
    for b in range(B):
        for k in range(K):
            for i in range(m):
                if index[b, k, i] < S:
                    want[1, b, k, index[b, k, i]] = values[b, k, i]
    got = jax.jit(scatter_entries)(jnp.asarray(table), row_index(jnp.asarray(index), 1), jnp.asarray(values))
    np.testing.assert_array_equal(np.asarray(got), want)
