"""Pallas kernels (interpret mode on a CPU, compiled on a CUDA GPU) against their pure-jnp references, and
lowering for CUDA."""

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
from clusterkv_jax.policies.cluster_select import rank_and_index
from pallas_kernels import dispatch
from pallas_kernels.centroid_update import centroid_update, centroid_update_reference
from pallas_kernels.cluster_index import cluster_to_block_index, cluster_to_block_index_reference
from pallas_kernels.cluster_index_tpu import cluster_to_block_index_tpu
from pallas_kernels.kmeans_assign import kmeans_assign, kmeans_assign_reference
from tests.helpers import triton_interpret, triton_mode

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
    got = centroid_update(keys, labels, C, interpret=triton_interpret())
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
    s, c = centroid_update(keys, labels, C, num_splits=num_splits, block_n=32, interpret=triton_interpret())
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
    _assert_sums_close(centroid_update(rounded, labels, C, interpret=triton_interpret()), want, keys)
    half = keys.astype(jnp.float16)
    _assert_sums_close(centroid_update(half, labels, C, interpret=triton_interpret()),
                       centroid_update_reference(half, labels, C), keys)
    # float32 keys with one bfloat16 pass: the sums of the bfloat16-rounded keys.
    _assert_sums_close(centroid_update(keys, labels, C, passes=1, interpret=triton_interpret()), want, keys)
    # Two passes are much closer to float32 than one.
    s2, _ = centroid_update(keys, labels, C, passes=2, interpret=triton_interpret())
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
    got = centroid_update(keys, labels, C, interpret=triton_interpret())
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
        lambda labels: jax.lax.fori_loop(
            0, 1, lambda i, c: centroid_update(keys, labels, C, interpret=triton_interpret()), zeros)
    )(result.labels)
    ref_sums, ref_counts = _member_sums(result.labels, keys, C)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(ref_counts).astype(np.int32))
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(result.sizes))
    np.testing.assert_allclose(np.asarray(sums), np.asarray(ref_sums), rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------------------------------------ kmeans_assign


def _numpy_assign(keys, valid, directions, allowed, passes):
    """K-means' assignment in NumPy: float64 products of the operands rounded to bfloat16 by ml_dtypes (passes=1;
    unrounded for 3), the best allowed cluster (the lowest on a tie), C for an invalid key; and each key's margin
    between its two best clusters."""
    import ml_dtypes

    def rounded(x):
        return x.astype(ml_dtypes.bfloat16).astype(np.float64) if passes == 1 else x.astype(np.float64)

    sim = np.einsum("...nh,...ch->...nc", rounded(keys), rounded(directions))
    sim = np.where(allowed[..., None, :], sim, -np.inf)
    labels = np.where(valid, sim.argmax(-1), directions.shape[-2])
    top2 = -np.sort(-sim, axis=-1)[..., :2] if sim.shape[-1] > 1 else np.concatenate([sim, sim - 1], -1)
    return labels, top2[..., 0] - top2[..., 1]


def _unit(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("passes", [1, 3])
@pytest.mark.parametrize(
    "lead, N, C, H",
    [
        ((2, 3), 300, 41, 64),  # [B, K] problems, N and C not whole blocks
        ((1,), 1100, 150, 128),  # several key and cluster blocks
        ((2,), 129, 5, 80),  # H not a power of two, fewer clusters than a block
        ((1,), 40, 1, 16),  # one cluster
    ],
)
def test_kmeans_assign_equals_a_numpy_argmax(lead, N, C, H, passes):
    """The Triton kernel (interpret mode off a GPU) and the reference: each valid key gets the allowed cluster of
    highest similarity (products of bfloat16-rounded operands for passes=1), ties to the lowest; an invalid key gets
    C; a disallowed cluster is never chosen even when it is the most similar. Keys whose two best clusters lie
    within the float32 sums' order of each other may take either."""
    rng = np.random.default_rng(N + C)
    keys, directions = _unit(rng, (*lead, N, H)), _unit(rng, (*lead, C, H))
    directions[..., -1, :] = keys[..., 0, :]  # the first key's best cluster is the last one, when it is allowed
    valid = rng.random((*lead, N)) > 0.2
    allowed = np.arange(C) < rng.integers(max(1, C - 3), C + 1, size=(*lead, 1))
    want, margin = _numpy_assign(keys, valid, directions, allowed, passes)
    clear = margin > 1e-5
    for name, got in (("kernel", kmeans_assign(keys, valid, directions, allowed, passes=passes,
                                                interpret=triton_interpret())),
                      ("reference", kmeans_assign_reference(keys, valid, directions, allowed, passes=passes))):
        got = np.asarray(got)
        assert got.dtype == np.int32 and got.shape == want.shape, name
        np.testing.assert_array_equal(got[~valid], C, err_msg=name)
        assert np.all(np.take_along_axis(allowed, np.minimum(got, C - 1), axis=-1) | ~valid), name
        np.testing.assert_array_equal(np.where(clear, got, -1), np.where(clear, want, -1), err_msg=name)
    assert clear.mean() > 0.95


def test_kmeans_assign_in_kmeans_equals_the_xla_form():
    """The wiring: cosine K-means with its assignment in the kernel (inside the jitted while loop) gives the labels,
    sizes and centroids of its XLA form."""
    rng = np.random.default_rng(12)
    P, N, H, C = 2, 400, 64, 20
    keys = jnp.asarray(rng.standard_normal((P, N, H)) + rng.standard_normal((P, 1, H)), jnp.float32)
    valid = jnp.asarray(np.arange(N)[None, :] < np.array([[N], [250]]))
    args = (keys, valid, jnp.array([C, 9]), problem_keys(jax.random.PRNGKey(1), P))
    xla = cosine_kmeans(*args, max_clusters=C, max_iters=6)
    kernel = cosine_kmeans(*args, max_clusters=C, max_iters=6, assign_impl=triton_mode())
    assert int(xla.iterations) > 1
    np.testing.assert_array_equal(np.asarray(kernel.labels), np.asarray(xla.labels))
    np.testing.assert_array_equal(np.asarray(kernel.sizes), np.asarray(xla.sizes))
    np.testing.assert_allclose(np.asarray(kernel.centroids), np.asarray(xla.centroids), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "lead, N, H, C, dtype, kind",
    [
        ((2, 3), 1000, 64, 37, jnp.float32, "uniform"),  # [B, K] problems, N and C not whole blocks
        ((1,), 4099, 128, 300, jnp.float32, "giant"),  # several N- and C-blocks
        ((2,), 700, 80, 130, jnp.bfloat16, "empty"),  # H not a multiple of 128, empty clusters
        ((3,), 33, 128, 300, jnp.float32, "uniform"),  # fewer tokens than clusters
        ((1,), 100, 64, 1, jnp.float32, "uniform"),
    ],
)
def test_centroid_update_tpu_matches_reference_in_tpu_interpret_mode(lead, N, H, C, dtype, kind):
    from pallas_kernels.centroid_update_tpu import centroid_update_tpu

    P = int(np.prod(lead))
    rng = np.random.default_rng(N + H + C)
    keys = jnp.asarray(rng.standard_normal((P, N, H)), dtype)
    labels = _labels(rng, P, N, C, kind, lengths=rng.integers(N // 2, N + 1, P),
                     pad_label=int(rng.choice([C, -1])))
    # Padding rows may hold garbage: it must not reach any sum.
    keys = jnp.where(((labels == C) | (labels < 0))[..., None], jnp.nan, keys).reshape(*lead, N, H)
    labels = labels.reshape(*lead, N)
    got = centroid_update_tpu(keys, labels, C, block_n=256, block_c=64, interpret=True)
    clean = jnp.where(jnp.isnan(keys), 0.0, keys)
    assert bool(jnp.all(jnp.isfinite(got[0])))
    _assert_sums_close(got, centroid_update_reference(clean, labels, C), clean)


def test_centroid_update_tpu_lowers_to_mosaic():
    from pallas_kernels.centroid_update_tpu import centroid_update_tpu

    S = jax.ShapeDtypeStruct
    fn = jax.jit(lambda k, lab: centroid_update_tpu(k, lab, 400))
    text = fn.trace(S((1, 8, 32768, 128), jnp.float32), S((1, 8, 32768), jnp.int32)).lower(
        lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1  # one Mosaic kernel for all 8 problems


# ---------------------------------------------------------------------------------------- cluster_to_block_index


def _brute_force_blocks(sizes, starts, tokens, slots, block):
    """Walk the ranked clusters: whole clusters while both budgets hold, the crossing one trimmed; per problem."""
    sizes, starts = np.asarray(sizes), np.asarray(starts)
    out_blocks = np.zeros(sizes.shape[:-1] + (slots,), np.int32)
    out_rows = np.zeros_like(out_blocks)
    for p in np.ndindex(sizes.shape[:-1]):
        blocks, rows, taken = [], [], 0
        for z, first in zip(sizes[p], starts[p]):
            if z == 0:
                continue
            take = min(z, tokens - taken, block * (slots - len(blocks)))
            if take <= 0:
                break
            taken += take
            for u in range(-(-take // block)):
                blocks.append(first + u)
                rows.append(min(block, take - block * u))
        out_blocks[p][: len(blocks)] = blocks
        out_rows[p][: len(rows)] = rows
    return out_blocks, out_rows


def _check_blocks(sizes, starts, tokens, slots, block, tpu=True, **kw):
    """The Triton kernel (compiled on a CUDA GPU, else interpret mode), the reference and (tpu) the Mosaic kernel
    (TPU interpret mode) against the brute-force walk."""
    sizes, starts = jnp.asarray(sizes, jnp.int32), jnp.asarray(starts, jnp.int32)
    got = cluster_to_block_index(sizes, starts, tokens, slots, block, interpret=triton_interpret(), **kw)
    ref = cluster_to_block_index_reference(sizes, starts, tokens, slots, block)
    mosaic = cluster_to_block_index_tpu(sizes, starts, tokens, slots, block, interpret=True) if tpu else ref
    want = _brute_force_blocks(sizes, starts, tokens, slots, block)
    for g, r, m, w in zip(got, ref, mosaic, want):
        assert g.shape == w.shape and g.dtype == jnp.int32 and m.shape == w.shape and m.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(g), w)
        np.testing.assert_array_equal(np.asarray(r), w)
        np.testing.assert_array_equal(np.asarray(m), w)
    return [np.asarray(x) for x in got]


@pytest.mark.parametrize(
    "case, C, slots, tokens, block",
    [
        ("random", 37, 30, 300, 16),
        ("random", 80, 80, 1008, 16),  # ClusterKV's defaults at B=1024
        ("tokens_bind", 20, 50, 100, 4),  # the token budget ends the selection
        ("blocks_bind", 40, 6, 10_000, 16),  # the block slots end it
        ("zero_sizes", 64, 40, 500, 8),
        ("giant", 12, 20, 2000, 16),
        ("single_cluster", 1, 9, 77, 16),
        ("all_empty", 8, 5, 100, 16),
        ("rows", 30, 40, 40, 1),  # block 1: single rows
        ("random", 150, 64, 900, 7),  # a block that is no power of two; more clusters than one lane row
    ],
)
def test_cluster_block_index_cases(case, C, slots, tokens, block):
    rng = np.random.default_rng(C + slots)
    P = 3
    if case in ("random", "tokens_bind", "blocks_bind", "rows"):
        sizes = rng.integers(0, 120, (P, C))
    elif case == "zero_sizes":
        sizes = rng.integers(1, 90, (P, C)) * (rng.random((P, C)) < 0.4)
        sizes[:, :5] = 0  # the best-ranked clusters empty
    elif case == "giant":
        sizes = rng.integers(0, 3, (P, C))
        sizes[0, 0] = 500  # the first-ranked giant cluster alone fills the slots
        sizes[1, C // 2] = 500
        sizes[2, -1] = 500
    elif case == "single_cluster":
        sizes = np.array([[40], [77], [200]])
    else:
        sizes = np.zeros((P, C), int)
    starts = rng.permutation(10 * P * C).reshape(P, 10 * C)[:, :C] * 20
    blocks, rows = _check_blocks(sizes, starts, tokens, slots, block)
    assert np.all(rows.sum(axis=1) <= tokens) and np.all(rows <= block)


@pytest.mark.parametrize("block_c", [1, 4, 64])
def test_cluster_block_index_chunks(block_c):
    """Several cluster chunks per problem (the running prefix sums across chunks, the early exit)."""
    rng = np.random.default_rng(block_c)
    sizes = rng.integers(0, 40, (2, 90))
    _check_blocks(sizes, rng.integers(0, 5000, (2, 90)), 400, 30, 8, block_c=block_c)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_cluster_block_index_property(data):
    # Shapes from small sets, so that compilations are shared between examples.
    C = data.draw(st.sampled_from([1, 5, 33]), label="C")
    slots = data.draw(st.sampled_from([1, 12, 40]), label="slots")
    block = data.draw(st.sampled_from([1, 16]), label="block")
    tokens = data.draw(st.integers(0, 600), label="tokens")
    sizes = np.array(data.draw(st.lists(st.lists(st.integers(0, 70), min_size=C, max_size=C), min_size=2,
                                        max_size=2)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    starts = rng.permutation(100 * C)[: 2 * C].reshape(2, C) * 10
    blocks, rows = _check_blocks(sizes, starts, tokens, slots, block)
    for p in range(2):
        used = rows[p] > 0
        assert np.all(used[: used.sum()]), "used slots come first"
        assert rows[p].sum() == min(tokens, rows[p].sum()) <= sizes[p].sum()


def test_cluster_block_index_equals_rank_and_index():
    """The wiring ClusterKV does: top_k in XLA, then the kernel == rank_and_index's reference path, per query
    head ([B, K, G, C] scores, each head ranking its KV head's clusters)."""
    rng = np.random.default_rng(5)
    B, K, G, C, Mb = 2, 2, 3, 50, 20
    sizes = jnp.asarray(np.broadcast_to(rng.integers(0, 60, (B, K, 1, C)), (B, K, G, C)), jnp.int32)
    starts = jnp.asarray(np.broadcast_to(rng.permutation(B * K * C).reshape(B, K, 1, C) * 8, (B, K, G, C)),
                         jnp.int32)
    scores = jnp.asarray(rng.standard_normal((B, K, G, C)), jnp.float32)
    want = rank_and_index(scores, sizes, starts, 300, Mb, 16)
    got = rank_and_index(scores, sizes, starts, 300, Mb, 16, impl=triton_mode())
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert int(np.asarray(want[1]).sum()) > 0


# ---------------------------------------------------------------------------------------------- selected_attention


@pytest.mark.parametrize(
    "B, h, G, H, P, c, n, dtype",
    [
        (2, 6, 1, 64, 50, 16, 7, jnp.float32),  # a selection per query head
        (2, 2, 3, 64, 50, 16, 9, jnp.float32),  # shared by 3 query heads (padded to 4 rows)
        (1, 8, 4, 128, 40, 16, 13, jnp.bfloat16),
        (2, 3, 2, 32, 30, 4, 5, jnp.float32),  # pages of 4 rows; n not a multiple of block_pages
    ],
)
@pytest.mark.parametrize("kernel", ["triton", "tpu"])
def test_selected_attention_matches_reference_and_numpy(B, h, G, H, P, c, n, dtype, kernel):
    """The Triton kernel (compiled on a CUDA GPU, else interpret mode) and its Mosaic version (TPU interpret mode)
    against a NumPy loop."""
    from pallas_kernels.selected_attention import selected_attention, selected_attention_reference
    from pallas_kernels.selected_attention_tpu import selected_attention_tpu

    if kernel == "tpu":
        selected_attention = selected_attention_tpu  # noqa: F811  (same arguments, same result)

    rng = np.random.default_rng(B * h + G + n)
    q = jnp.asarray(rng.standard_normal((B, h, G, H)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((P, c, H)), dtype) for _ in range(2))
    pages = rng.integers(0, P, (B, h, n)).astype(np.int32)
    mask = rng.random((B, h, n, c)) < 0.6
    mask[0, 0] = False  # a head with no row: zeros
    interpret = True if kernel == "tpu" else triton_interpret()
    got = np.asarray(selected_attention(q, k, v, jnp.asarray(pages), jnp.asarray(mask), interpret=interpret))
    ref = np.asarray(selected_attention_reference(q, k, v, jnp.asarray(pages), jnp.asarray(mask)))
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    want = np.zeros((B, h, G, H))
    for b in range(B):
        for s in range(h):
            rows = [(p, r) for p, m in zip(pages[b, s], mask[b, s]) for r in range(c) if m[r]]
            if rows:
                kk = np.stack([kn[p, r] for p, r in rows])
                vv = np.stack([vn[p, r] for p, r in rows])
                logits = qn[b, s] @ kk.T / np.sqrt(H)
                w = np.exp(logits - logits.max(-1, keepdims=True))
                want[b, s] = (w / w.sum(-1, keepdims=True)) @ vv
    assert got.shape == (B, h, G, H) and got.dtype == np.float32
    # On a GPU float32 dots default to TF32 inputs (10 mantissa bits), in XLA and in Triton: on an H200 the kernel
    # and the reference were 2e-4 to 7e-4 off the float64 loop.
    tol = 2e-3 if jax.default_backend() == "gpu" else 2e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(ref, want, rtol=tol, atol=tol)
    assert not got[0, 0].any()


@pytest.mark.parametrize("rows, want", [(33280, (128, 13)), (133120, (128, 16)), (1152, (128, 9)), (128, (128, 1)),
                                        (48, (16, 3)), (100, None)])
def test_decode_attention_splits_whole_blocks(rows, want):
    """`bench decode`'s capacities at 32k and 128k, a short one, a tiny one, and one no block divides."""
    from pallas_kernels.decode_attention import MAX_SPLITS, split_for

    assert split_for(rows) == want
    if want:
        block, parts = want
        assert rows % (block * parts) == 0 and parts <= MAX_SPLITS


@pytest.mark.parametrize("B, K, G, S, H, dtype", [(2, 2, 3, 512, 64, jnp.float32), (1, 4, 4, 1152, 128, jnp.bfloat16)])
def test_decode_attention_matches_reference_and_numpy(B, K, G, S, H, dtype):
    """JAX's flash-decoding kernel as `kernels.decode_attention` runs it (compiled on a CUDA GPU, else interpret
    mode), over ragged lengths (one inside the first part of the rows, one across parts, one at the capacity),
    against a NumPy softmax per query head and against XLA's form (`attention.decode_attention`)."""
    from clusterkv_jax import attention, kernels
    from pallas_kernels.decode_attention import decode_attention_reference

    rng = np.random.default_rng(S + G)
    q = jnp.asarray(rng.standard_normal((B, K * G, H)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((B, K, S, H)), dtype) for _ in range(2))
    lengths = np.array([37, S][:B] if B > 1 else [S // 2 + 5], np.int32)
    got = np.asarray(kernels.decode_attention(q, k, v, jnp.asarray(lengths), impl=triton_mode()))
    xla = np.asarray(attention.decode_attention(q, k, v, jnp.asarray(lengths)))
    ref = np.asarray(decode_attention_reference(q.reshape(B, K, G, H), k, v,
                                                jnp.asarray(np.repeat(lengths[:, None], K, 1)))).reshape(B, K * G, H)
    qn, kn, vn = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
    want = np.zeros((B, K * G, H))
    for b in range(B):
        for n in range(K * G):
            s = kn[b, n // G, : lengths[b]] @ qn[b, n] / np.sqrt(H)
            p = np.exp(s - s.max())
            want[b, n] = (p / p.sum()) @ vn[b, n // G, : lengths[b]]
    assert got.shape == (B, K * G, H) and got.dtype == np.float32
    # bfloat16: the probabilities and the parts' partial outputs are rounded to it (8 bits) before the last sums.
    tol = 2e-2 if dtype == jnp.bfloat16 else (2e-3 if jax.default_backend() == "gpu" else 2e-5)
    for name, x in (("kernel", got), ("xla", xla), ("reference", ref)):
        np.testing.assert_allclose(x, want, rtol=tol, atol=tol, err_msg=name)


# ------------------------------------------------------------------------------------------------------ dispatch


def _fake_device(platform, cc=None):
    return types.SimpleNamespace(platform=platform, compute_capability=cc, device_kind="fake")


def _runs_triton(device) -> bool:
    """A CUDA GPU of compute capability >= 8.0, read off the device itself."""
    return device.platform == "gpu" and float(getattr(device, "compute_capability", 0) or 0) >= 8.0


def test_kernels_supported():
    assert dispatch.kernels_supported() == _runs_triton(jax.devices()[0])  # the device this runs on
    assert dispatch.kernels_supported(_fake_device("gpu", "8.0"))
    assert dispatch.kernels_supported(_fake_device("gpu", "9.0"))
    assert not dispatch.kernels_supported(_fake_device("gpu", "7.5"))
    assert not dispatch.kernels_supported(_fake_device("gpu", None))  # ROCm
    assert not dispatch.kernels_supported(_fake_device("cpu"))


def test_kernel_modes_resolve_in_one_place():
    from clusterkv_jax import kernels
    from clusterkv_jax.kernels import resolve

    assert resolve("reference") == "reference"
    assert resolve("auto") == ("pallas" if dispatch.kernels_supported() else "reference")
    with pytest.raises(ValueError, match="kernel mode"):
        resolve("triton")
    if not dispatch.kernels_supported():
        with pytest.raises(RuntimeError, match="compute capability"):
            resolve("pallas")
    assert resolve("interpret") == "interpret"
    with pytest.raises(ValueError, match="kernel op"):
        resolve("auto", "attention")
    # "auto" on a CUDA GPU: the kernel or the reference, whichever was faster on an H200, op by op.
    with dispatch.compile_for(_fake_device("gpu", "9.0")):
        assert [resolve("auto", op) for op in kernels.OPS] == ["reference", "pallas", "reference", "pallas",
                                                               "reference"]
        assert [resolve("pallas", op) for op in kernels.OPS] == ["pallas"] * 5
        assert [resolve("reference", op) for op in kernels.OPS] == ["reference"] * 5
    with dispatch.compile_for(_fake_device("tpu")):
        assert [resolve("auto", op) for op in kernels.OPS] == ["tpu"] * 5


def test_on_tpu_clusterkv_runs_the_mosaic_kernels(monkeypatch):
    from clusterkv_jax import kernels, kmeans
    from clusterkv_jax.policies import ClusterKV
    from pallas_kernels.centroid_update_tpu import centroid_update_tpu

    assert not dispatch.on_tpu()  # this CPU-only machine
    assert dispatch.on_tpu(_fake_device("tpu")) and not dispatch.on_tpu(_fake_device("gpu", "9.0"))
    monkeypatch.setattr(dispatch, "on_tpu", lambda: True)
    assert [kernels.resolve(ClusterKV(kernels=k).kernels) for k in ("auto", "pallas", "reference", "interpret")] == [
        "tpu", "tpu", "reference", "interpret"]
    # kernel "tpu": K-means sums and the block indexing by the Mosaic kernels (here in TPU interpret mode).
    calls = []

    def interpreted(kernel):
        def run(*args, **kwargs):
            calls.append(kernel.__name__)
            return kernel(*args, **kwargs, interpret=True)
        return run

    monkeypatch.setattr(kernels, "centroid_update_tpu", interpreted(centroid_update_tpu))
    monkeypatch.setattr(kernels, "cluster_to_block_index_tpu", interpreted(cluster_to_block_index_tpu))
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((3, 200, 16)), jnp.float32)
    labels = _labels(rng, 3, 200, 12, "uniform", lengths=[200, 150, 7])
    sums, counts = kmeans._member_sums(labels, x, 12, impl="tpu")
    want_sums, want_counts = centroid_update_reference(x, labels, 12)
    assert calls == ["centroid_update_tpu"]
    _assert_sums_close((sums, counts.astype(jnp.int32)), (want_sums, want_counts), x)
    scores = jnp.asarray(rng.standard_normal((2, 3, 20)), jnp.float32)
    sizes = jnp.asarray(rng.integers(0, 40, (2, 3, 20)), jnp.int32)
    starts = jnp.asarray(rng.integers(0, 100, (2, 3, 20)), jnp.int32)
    got = rank_and_index(scores, sizes, starts, 100, 20, 16, impl="tpu")
    want = rank_and_index(scores, sizes, starts, 100, 20, 16, impl="reference")
    assert calls == ["centroid_update_tpu", "cluster_to_block_index_tpu"]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# ------------------------------------------------------------------------------------------------------ lowering


@pytest.mark.slow  # starts a Python process
def test_check_lowering_for_cuda_and_tpu():
    proc = subprocess.run(
        [sys.executable, "-m", "pallas_kernels.check_lowering"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if " OK " in line]
    cuda = [line for line in lines if "triton kernel" in line]
    tpu = [line for line in lines if "mosaic kernel(s) for tpu" in line]
    assert sum(line.startswith("centroid_update ") for line in cuda) == 4
    assert sum("cluster_to_block_index" in line for line in cuda) == 2
    assert sum(line.startswith("selected_attention ") for line in cuda) == 4
    assert sum(line.startswith("kmeans_assign ") for line in cuda) == 4
    assert sum(line.startswith("decode_attention ") for line in cuda) == 2
    assert sum(line.startswith("centroid_update_tpu ") for line in tpu) == 4
    assert sum(line.startswith("cluster_to_block_index_tpu ") for line in tpu) == 2
    assert sum(line.startswith("selected_attention_tpu ") for line in tpu) == 4
    assert "all kernels lowered for cuda" in proc.stdout and "all kernels lowered for tpu" in proc.stdout


@pytest.mark.slow  # starts processes
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


def test_compile_for_chooses_kernels_for_the_target_device():
    """Ahead-of-time compilation for a GPU that is not attached: inside `compile_for(device)` the kernel switch
    answers for that device, outside for the first JAX device, also after an error inside."""
    from clusterkv_jax.kernels import resolve
    from clusterkv_jax.policies import ClusterKV

    h100, tpu = _fake_device("gpu", "9.0"), _fake_device("tpu")
    here = "pallas" if _runs_triton(jax.devices()[0]) else "reference"
    assert resolve(ClusterKV().kernels) == here
    with dispatch.compile_for(h100):
        assert dispatch.kernels_supported() and resolve("auto") == "pallas" and resolve("pallas") == "pallas"
        assert [resolve(ClusterKV(kernels=k).kernels) for k in ("auto", "pallas", "reference")] == [
            "pallas", "pallas", "reference"]
        with dispatch.compile_for(tpu):  # the innermost target wins
            assert dispatch.on_tpu() and resolve(ClusterKV().kernels) == "tpu"
        assert not dispatch.on_tpu()
    with pytest.raises(KeyError), dispatch.compile_for(h100):
        raise KeyError("inside")
    assert dispatch.kernels_supported() == (here == "pallas") and resolve(ClusterKV().kernels) == here
    with dispatch.compile_for(_fake_device("gpu", "7.5")), pytest.raises(RuntimeError, match="compute capability"):
        resolve("pallas")
