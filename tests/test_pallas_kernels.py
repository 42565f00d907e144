"""Pallas kernels (interpret mode on CPU) against their pure-jnp references, and lowering for CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clusterkv_jax.kmeans import _member_sums, cosine_kmeans, problem_keys
from clusterkv_jax.policies.clusterkv import rank_and_index
from pallas_kernels import dispatch
from pallas_kernels.centroid_update import centroid_update, centroid_update_reference
from pallas_kernels.cluster_index import cluster_to_token_index, cluster_to_token_index_reference

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- centroid_update


def _labels(rng, P, N, C, kind, lengths=None, pad_label=None):
    """[P, N] int32 labels of a given distribution; tokens at or past lengths[p] get pad_label (default C)."""
    if kind == "uniform":
        labels = rng.integers(0, C, (P, N))
    elif kind == "empty":  # only every third cluster used: the rest stay empty
        labels = 3 * rng.integers(0, max(1, C // 3), (P, N))
        labels = np.minimum(labels, C - 1)
    elif kind == "giant":  # one cluster holds ~all tokens
        labels = np.where(rng.random((P, N)) < 0.97, C // 2, rng.integers(0, C, (P, N)))
    else:
        raise ValueError(kind)
    if lengths is not None:
        pad = C if pad_label is None else pad_label
        labels = np.where(np.arange(N)[None, :] < np.asarray(lengths)[:, None], labels, pad)
    return jnp.asarray(labels, jnp.int32)


def _assert_sums_close(got, want, keys):
    (s, c), (rs, rc) = got, want
    assert s.shape == rs.shape and s.dtype == jnp.float32
    assert c.shape == rc.shape and c.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(c), np.asarray(rc))
    # float32 sums of up to N terms in a different order: tolerance scales with the counts and key sizes.
    scale = float(jnp.max(jnp.abs(keys.astype(jnp.float32)))) * np.sqrt(np.maximum(np.asarray(rc), 1))[..., None]
    err = np.abs(np.asarray(s) - np.asarray(rs))
    tol = 1e-5 * scale + 1e-6
    assert np.all(err <= tol), f"max error {err.max():.3g}, worst ratio to tolerance {np.max(err / tol):.3g}"


@pytest.mark.parametrize(
    "P, N, H, C, kind",
    [
        (2, 1000, 64, 37, "uniform"),
        (1, 4099, 128, 512, "uniform"),
        (3, 1000, 80, 100, "empty"),
        (2, 1000, 64, 1, "uniform"),
        (2, 4099, 64, 16, "giant"),
        (1, 33, 128, 300, "empty"),  # fewer tokens than clusters
        (2, 4099, 128, 400, "giant"),
    ],
)
def test_centroid_update_matches_reference(P, N, H, C, kind):
    rng = np.random.default_rng(P * N + H + C)
    keys = jnp.asarray(rng.standard_normal((P, N, H)), jnp.float32)
    lengths = rng.integers(N // 2, N + 1, P)  # several problems, different valid lengths
    labels = _labels(rng, P, N, C, kind, lengths)
    got = centroid_update(keys, labels, C, interpret=True)
    _assert_sums_close(got, centroid_update_reference(keys, labels, C), keys)


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("pad_label", ["C", -1])
def test_centroid_update_padding_and_splits(num_splits, pad_label):
    P, N, H, C = 3, 1000, 64, 40
    rng = np.random.default_rng(7)
    keys = jnp.asarray(rng.standard_normal((P, N, H)), jnp.float32)
    lengths = [N, 613, 0]  # full, partial, nothing valid
    labels = _labels(rng, P, N, C, "uniform", lengths, pad_label=C if pad_label == "C" else -1)
    # Padding rows may hold garbage: they must not reach any sum.
    keys = jnp.where(((labels == C) | (labels < 0))[..., None], jnp.nan, keys)
    s, c = centroid_update(keys, labels, C, num_splits=num_splits, block_n=32, interpret=True)
    assert bool(jnp.all(jnp.isfinite(s)))
    np.testing.assert_array_equal(np.asarray(c).sum(axis=1), [N, 613, 0])
    clean = jnp.where(jnp.isnan(keys), 0.0, keys)
    _assert_sums_close((s, c), centroid_update_reference(clean, labels, C), clean)
    assert not bool(jnp.any(s[2])), "a problem with no valid token has all-zero sums"


def test_centroid_update_low_precision_paths():
    P, N, H, C = 2, 500, 80, 24
    rng = np.random.default_rng(3)
    keys = jnp.asarray(rng.standard_normal((P, N, H)), jnp.float32)
    labels = _labels(rng, P, N, C, "uniform")
    rounded = keys.astype(jnp.bfloat16)
    want = centroid_update_reference(rounded, labels, C)
    # bfloat16 keys: one exact pass.
    _assert_sums_close(centroid_update(rounded, labels, C, interpret=True), want, keys)
    half = keys.astype(jnp.float16)
    _assert_sums_close(centroid_update(half, labels, C, interpret=True), centroid_update_reference(half, labels, C), keys)
    # float32 keys with one bfloat16 pass: the sums of the bfloat16-rounded keys.
    _assert_sums_close(centroid_update(keys, labels, C, passes=1, interpret=True), want, keys)
    # Two passes are much closer to float32 than one.
    s2, _ = centroid_update(keys, labels, C, passes=2, interpret=True)
    rs, _ = centroid_update_reference(keys, labels, C)
    assert float(jnp.max(jnp.abs(s2 - rs))) < 1e-2 * float(jnp.max(jnp.abs(rs - want[0])))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(["uniform", "empty", "giant"]),
    pad_fraction=st.floats(0.0, 1.0),
)
def test_centroid_update_property(seed, kind, pad_fraction):
    P, N, H, C = 2, 300, 16, 20  # fixed shapes: one compilation
    rng = np.random.default_rng(seed)
    keys = jnp.asarray(rng.standard_normal((P, N, H)) * 10.0 ** rng.integers(-3, 4), jnp.float32)
    labels = _labels(rng, P, N, C, kind, lengths=[N, int(N * (1 - pad_fraction))])
    got = centroid_update(keys, labels, C, interpret=True)
    _assert_sums_close(got, centroid_update_reference(keys, labels, C), keys)


def test_centroid_update_equals_kmeans_member_sums():
    """The wiring the lead will do: kmeans' labels (masked = C) through the kernel == _member_sums."""
    P, N, H, C = 2, 300, 64, 12
    rng = np.random.default_rng(11)
    keys = jnp.asarray(rng.standard_normal((P, N, H)), jnp.float32)
    valid = jnp.asarray(np.arange(N)[None, :] < np.array([[N], [200]]))
    result = cosine_kmeans(keys, valid, jnp.array([C, 7]), problem_keys(jax.random.PRNGKey(0), P), max_clusters=C)
    # As it will run: inside K-means' jitted while loop.
    zeros = (jnp.zeros((P, C, H), jnp.float32), jnp.zeros((P, C), jnp.int32))
    sums, counts = jax.jit(
        lambda labels: jax.lax.fori_loop(0, 1, lambda i, c: centroid_update(keys, labels, C, interpret=True), zeros)
    )(result.labels)
    ref_sums, ref_counts = _member_sums(result.labels, keys, C)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(ref_counts).astype(np.int32))
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(result.sizes))
    np.testing.assert_allclose(np.asarray(sums), np.asarray(ref_sums), rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------- cluster_to_token_index


def _cluster_problem(rng, sizes: np.ndarray, S: int):
    """Ranked metadata for given ranked sizes [P, C]: clusters laid out in a random label order in S slots."""
    P, C = sizes.shape
    starts = np.zeros_like(sizes)
    for p in range(P):
        layout = rng.permutation(C)  # label order of the ranked clusters in sorted_tokens
        offs = np.cumsum(sizes[p, layout]) - sizes[p, layout]
        starts[p, layout] = offs
    tokens = np.stack([rng.permutation(S) for _ in range(P)])  # distinct positions
    return (jnp.asarray(sizes, jnp.int32), jnp.asarray(starts, jnp.int32), jnp.asarray(tokens, jnp.int32))


def _brute_force(sizes, starts, tokens, M):
    """Union of the top-ranked clusters' members in rank order, the last one trimmed, padded with 0."""
    sizes, starts, tokens = map(np.asarray, (sizes, starts, tokens))
    idx = np.zeros((sizes.shape[0], M), np.int32)
    mask = np.zeros((sizes.shape[0], M), bool)
    for p in range(sizes.shape[0]):
        taken = np.concatenate([tokens[p, s : s + n] for s, n in zip(starts[p], sizes[p])] + [np.zeros(0, int)])
        taken = taken[:M]
        idx[p, : len(taken)] = taken
        mask[p, : len(taken)] = True
    return idx, mask


def _check_index(sizes, starts, tokens, M, **kw):
    idx, mask = cluster_to_token_index(sizes, starts, tokens, M, interpret=True, **kw)
    assert idx.shape == mask.shape == (sizes.shape[0], M)
    assert idx.dtype == jnp.int32 and mask.dtype == jnp.bool_
    ref_idx, ref_mask = cluster_to_token_index_reference(sizes, starts, tokens, M)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(ref_mask))
    bf_idx, bf_mask = _brute_force(sizes, starts, tokens, M)
    np.testing.assert_array_equal(np.asarray(idx), bf_idx)
    np.testing.assert_array_equal(np.asarray(mask), bf_mask)
    return np.asarray(idx), np.asarray(mask)


@pytest.mark.parametrize(
    "case, C, M",
    [
        ("random", 37, 100),
        ("random", 400, 1000),  # M not a multiple of the 128-slot block
        ("budget_exceeds_tokens", 20, 300),
        ("zero_sizes", 64, 200),
        ("giant", 50, 129),
        ("single_cluster", 1, 77),
        ("all_empty", 8, 16),
    ],
)
def test_cluster_index_cases(case, C, M):
    rng = np.random.default_rng(C + M)
    P = 3
    if case == "random":
        sizes = rng.integers(0, 12, (P, C))
    elif case == "budget_exceeds_tokens":
        sizes = rng.integers(0, 5, (P, C))  # total < M
    elif case == "zero_sizes":
        sizes = rng.integers(1, 9, (P, C)) * (rng.random((P, C)) < 0.4)
        sizes[:, :5] = 0  # the best-ranked clusters empty
    elif case == "giant":
        sizes = rng.integers(0, 3, (P, C))
        sizes[0, 0] = 500  # first-ranked giant cluster alone fills the budget
        sizes[1, C // 2] = 500  # giant in the middle of the ranking
        sizes[2, -1] = 500  # giant last
    elif case == "single_cluster":
        sizes = np.array([[40], [77], [200]])
    else:
        sizes = np.zeros((P, C), int)
    S = int(sizes.sum(axis=1).max()) + int(rng.integers(0, 10))
    idx, mask = _check_index(*_cluster_problem(rng, sizes, max(S, 1)), M)
    np.testing.assert_array_equal(mask.sum(axis=1), np.minimum(M, sizes.sum(axis=1)))


@pytest.mark.parametrize("block_m, block_c", [(16, 16), (32, 4), (128, 64)])
def test_cluster_index_blocks(block_m, block_c):
    """Several cluster chunks per slot block (the early exit and the running prefix sum across chunks)."""
    rng = np.random.default_rng(block_m * block_c)
    sizes = rng.integers(0, 6, (2, 90))
    _check_index(*_cluster_problem(rng, sizes, int(sizes.sum(axis=1).max())), 150, block_m=block_m, block_c=block_c)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_cluster_index_property(data):
    # Shapes from small sets, so that compilations are shared between examples.
    C = data.draw(st.sampled_from([1, 5, 33]), label="C")
    M = data.draw(st.sampled_from([1, 24, 100]), label="M")
    sizes = np.array(data.draw(st.lists(st.lists(st.integers(0, 40), min_size=C, max_size=C), min_size=2, max_size=2)))
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    rng = np.random.default_rng(seed)
    S = 64 * 40  # >= every total: one shape per (C, M)
    sizes_j, starts, tokens = _cluster_problem(rng, sizes, S)
    idx, mask = _check_index(sizes_j, starts, tokens, M, block_m=16, block_c=4)
    total = sizes.sum(axis=1)
    for p in range(2):
        valid = idx[p][mask[p]]
        assert mask[p].sum() == min(M, total[p])  # exactly min(M, total) valid
        assert np.all(mask[p][: mask[p].sum()])  # valid slots come first
        assert len(np.unique(valid)) == len(valid)  # distinct tokens
        assert np.all(idx[p][~mask[p]] == 0)
        # Whole clusters in rank order, only the last one taken may be trimmed.
        members = [set(np.asarray(tokens[p, s : s + n]).tolist()) for s, n in zip(np.asarray(starts[p]), sizes[p])]
        chosen = set(valid.tolist())
        cum = np.cumsum(sizes[p])
        for r, m in enumerate(members):
            if cum[r] <= M:
                assert m <= chosen
            elif cum[r] - sizes[p, r] >= M:
                assert not (m & chosen)


def test_cluster_index_equals_rank_and_index():
    """The wiring the lead will do: argsort in XLA, then the kernel == rank_and_index."""
    rng = np.random.default_rng(5)
    P, C, S, M = 4, 50, 400, 150
    sizes = rng.integers(0, 16, (P, C)) * (rng.random((P, C)) < 0.8)
    sizes = np.minimum(sizes, 8)
    starts = np.cumsum(sizes, axis=1) - sizes  # label order, as after_prefill stores them
    tokens = jnp.asarray(np.stack([rng.permutation(S) for _ in range(P)]), jnp.int32)
    scores = jnp.asarray(rng.standard_normal((P, C)), jnp.float32)
    sizes, starts = jnp.asarray(sizes, jnp.int32), jnp.asarray(starts, jnp.int32)
    want = rank_and_index(scores, sizes, starts, tokens, M)
    order = jnp.argsort(-jnp.where(sizes > 0, scores, -jnp.inf), axis=-1)
    ranked_sizes = jnp.take_along_axis(sizes, order, axis=-1)
    ranked_starts = jnp.take_along_axis(starts, order, axis=-1)
    got = cluster_to_token_index(ranked_sizes, ranked_starts, tokens, M, interpret=True)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_cluster_index_group_shares_token_lists():
    """Sizes [P, G, C] with tokens [P, S]: the G problems of p all read sorted_tokens[p] (per-query-head ranking
    of a KV head's clusters), as the reference does with the token lists repeated G times."""
    rng = np.random.default_rng(9)
    B, K, G, C, S, M = 2, 2, 3, 30, 200, 70
    sizes = np.minimum(rng.integers(0, 12, (B * K, C)), 6)
    starts = np.cumsum(sizes, axis=1) - sizes
    tokens = jnp.asarray(np.stack([rng.permutation(S) for _ in range(B * K)]), jnp.int32)
    order = np.argsort(rng.standard_normal((B * K * G, C)), axis=1)  # each query head ranks its own way
    rep = lambda x: np.repeat(x, G, axis=0)  # noqa: E731
    ranked_sizes = jnp.asarray(np.take_along_axis(rep(sizes), order, axis=1), jnp.int32)
    ranked_starts = jnp.asarray(np.take_along_axis(rep(starts), order, axis=1), jnp.int32)
    grouped = lambda x: x.reshape(B * K, G, C)  # noqa: E731
    got = cluster_to_token_index(grouped(ranked_sizes), grouped(ranked_starts), tokens, M, interpret=True)
    want = cluster_to_token_index_reference(ranked_sizes, ranked_starts, jnp.repeat(tokens, G, axis=0), M)
    np.testing.assert_array_equal(np.asarray(got[0]).reshape(B * K * G, M), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]).reshape(B * K * G, M), np.asarray(want[1]))
    ref_grouped = cluster_to_token_index_reference(grouped(ranked_sizes), grouped(ranked_starts), tokens, M)
    np.testing.assert_array_equal(np.asarray(ref_grouped[0]).reshape(B * K * G, M), np.asarray(want[0]))


# ------------------------------------------------------------------------------------------------------ dispatch


def _fake_device(platform, cc=None):
    return types.SimpleNamespace(platform=platform, compute_capability=cc, device_kind="fake")


def test_kernels_supported():
    assert not dispatch.kernels_supported()  # this CPU-only machine
    assert dispatch.kernels_supported(_fake_device("gpu", "8.0"))
    assert dispatch.kernels_supported(_fake_device("gpu", "9.0"))
    assert not dispatch.kernels_supported(_fake_device("gpu", "7.5"))
    assert not dispatch.kernels_supported(_fake_device("gpu", None))  # ROCm
    assert not dispatch.kernels_supported(_fake_device("cpu"))


def test_use_kernels_modes():
    assert dispatch.use_kernels("reference") is False
    assert dispatch.use_kernels("auto") is dispatch.kernels_supported()
    with pytest.raises(ValueError, match="kernel mode"):
        dispatch.use_kernels("triton")
    if not dispatch.kernels_supported():
        with pytest.raises(RuntimeError, match="compute capability"):
            dispatch.use_kernels("pallas")
    assert dispatch.use_kernels("pallas", interpret=True) is True


# ------------------------------------------------------------------------------------------------------ lowering


def test_check_lowering_for_cuda():
    proc = subprocess.run(
        [sys.executable, "-m", "pallas_kernels.check_lowering"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if " OK " in line]
    assert sum("centroid_update" in line for line in lines) == 4
    assert sum("cluster_to_token_index" in line for line in lines) == 2


@pytest.mark.skipif(
    not os.environ.get("CLUSTERKV_TRITON_PYTHON"),
    reason="set CLUSTERKV_TRITON_PYTHON to a Python with the PyPI triton package to compile the TTIR to cubin",
)
def test_check_lowering_compiles_to_cubin():
    proc = subprocess.run(
        [sys.executable, "-m", "pallas_kernels.check_lowering", "--ptx", os.environ["CLUSTERKV_TRITON_PYTHON"]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all kernels compiled to cubin" in proc.stdout
    assert "spills 0/0 B" in proc.stdout
