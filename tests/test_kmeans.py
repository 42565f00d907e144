"""Cosine K-means against a NumPy reference, its objective, planted clusters, and masking edge cases."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterkv_jax.kmeans import _assign, cosine_kmeans, cosine_objective, init_random, kmeans_from_directions, problem_keys


def numpy_assign(unit, valid, d, num_clusters):
    """The documented assignment rule in NumPy (float64): the operands rounded to bfloat16 (ml_dtypes), each
    similarity scaled into [2, 4) as 0.9375 * cos + 3 and rounded to a grid of 2**(bits - 22), bits = ceil(log2 C);
    the highest grid value wins, the lowest cluster on a tie; disallowed clusters (>= num_clusters) never win; masked
    keys get C."""
    C = d.shape[0]
    bits = max(1, (C - 1).bit_length())
    unit, d = (x.astype(ml_dtypes.bfloat16).astype(np.float64) for x in (unit, d))
    grid = np.round((0.9375 * (unit @ d.T) + 3.0) / 2.0 ** (bits - 22))
    grid[:, num_clusters:] = -np.inf
    return np.where(valid, grid.argmax(-1), C)


def numpy_cosine_kmeans(keys, valid, num_clusters, directions, max_iters):
    """Independent reference for one problem: keys [N, H], valid [N], directions [C, H]."""
    unit = keys / np.maximum(np.linalg.norm(keys, axis=-1, keepdims=True), 1e-12)
    d = directions / np.maximum(np.linalg.norm(directions, axis=-1, keepdims=True), 1e-12)
    C = d.shape[0]

    def assign(d):
        return numpy_assign(unit, valid, d, num_clusters)

    labels = assign(d)
    for _ in range(max_iters):
        for c in range(C):
            members = unit[labels == c]
            if len(members):
                s = members.sum(0)
                d[c] = s / max(np.linalg.norm(s), 1e-12)
        new = assign(d)
        changed = (new != labels).any()
        labels = new
        if not changed:
            break
    centroids = np.stack([keys[labels == c].mean(0) if (labels == c).any() else d[c] for c in range(C)])
    sizes = np.array([(labels == c).sum() for c in range(C)])
    return labels, centroids, sizes


def _problems(P=4, N=300, H=16, seed=0):
    rng = np.random.default_rng(seed)
    keys = rng.normal(size=(P, N, H)).astype(np.float32) + rng.normal(size=(P, 1, H)).astype(np.float32)
    lengths = rng.integers(N // 3, N + 1, size=P)
    valid = np.arange(N)[None, :] < lengths[:, None]
    valid[:, :3] = False  # like sinks: masked at the front too
    return keys, valid


@pytest.mark.parametrize("C,max_iters", [(1, 10), (7, 3), (24, 50)])
def test_matches_numpy_reference_from_same_init(C, max_iters):
    keys, valid = _problems()
    num = np.array([C, max(1, C - 2), C, 1], np.int32)
    init = np.asarray(init_random(jnp.asarray(keys), jnp.asarray(valid), C, problem_keys(jax.random.PRNGKey(3), 4)))
    got = kmeans_from_directions(jnp.asarray(keys), jnp.asarray(valid), jnp.asarray(num), jnp.asarray(init),
                                 max_iters=max_iters)
    for p in range(keys.shape[0]):
        labels, centroids, sizes = numpy_cosine_kmeans(keys[p], valid[p], num[p], init[p].copy(), max_iters)
        np.testing.assert_array_equal(np.asarray(got.labels[p]), labels)
        np.testing.assert_array_equal(np.asarray(got.sizes[p]), sizes)
        np.testing.assert_allclose(np.asarray(got.centroids[p]), centroids, atol=1e-5)
        assert np.all(np.asarray(got.sizes[p])[num[p]:] == 0), "clusters beyond num_clusters stay empty"


@pytest.mark.parametrize("C", [5, 40, 90])  # 90: more seeds than some problems' valid keys
@pytest.mark.parametrize("nonfinite", [False, True])
def test_random_seeds_are_the_first_valid_keys_of_one_random_order(C, nonfinite):
    """K-means' random seeds, against NumPy: each problem's C valid keys with the largest of one uniform draw per
    position (the same draws: `problem_keys`), largest first, ties to the lower position, then, where fewer are
    valid, the others by the smallest draw. Both ways: `init_random` (a top_k of the seeds, a scanned loop's) and
    `seeds_in_order` over the draws' whole order (`random_order`, made from the draws alone: what `cosine_kmeans`
    shares between the layers of an unrolled loop); keys holding a NaN or inf (masked by `_finite_keys`) are left
    out alike."""
    from clusterkv_jax.kmeans import _finite_keys, random_order, seeds_in_order

    keys, valid = _problems(P=4, N=120, H=8, seed=3)
    if nonfinite:
        keys[0, 10:30, 2] = np.nan
        keys[3, ::7, 0] = np.inf
    rngs = problem_keys(jax.random.PRNGKey(5), 4)
    x, counted = (np.asarray(a) for a in _finite_keys(jnp.asarray(keys), jnp.asarray(valid)))
    u = np.stack([np.asarray(jax.random.uniform(r, (120,), jnp.float32)) for r in rngs])
    got = np.asarray(seeds_in_order(jnp.asarray(x), jnp.asarray(counted), random_order(rngs, 120), C))
    np.testing.assert_array_equal(got, np.asarray(init_random(jnp.asarray(x), jnp.asarray(counted), C, rngs)))
    for p in range(4):
        score = np.where(counted[p], u[p], -1.0 - u[p])
        want = np.argsort(-score, kind="stable")[:C]
        np.testing.assert_array_equal(got[p], x[p, want])
        assert np.all(np.isfinite(got[p]))


def test_objective_never_increases():
    keys, valid = _problems(P=3, N=400, H=8, seed=1)
    init = init_random(jnp.asarray(keys), jnp.asarray(valid), 16, problem_keys(jax.random.PRNGKey(0), 3))
    num = jnp.full((3,), 16, jnp.int32)
    objectives = []
    for it in range(8):
        r = kmeans_from_directions(jnp.asarray(keys), jnp.asarray(valid), num, init, max_iters=it)
        objectives.append(np.asarray(cosine_objective(jnp.asarray(keys), jnp.asarray(valid), r.labels, r.directions)))
    objectives = np.stack(objectives)
    assert np.all(np.diff(objectives, axis=0) <= 1e-3), objectives
    assert np.all(objectives[-1] < objectives[0])


@pytest.mark.parametrize("init", ["kmeans++"])
def test_recovers_planted_clusters(init):
    """k-means++ seeding finds every well-separated planted cluster (random seeding can put two seeds in
    one cluster and then legitimately converge to a merged local optimum, so it is not asserted here)."""
    rng = np.random.default_rng(2)
    P, C, per, H = 2, 6, 50, 32
    # Well-separated directions: scaled random orthonormal basis vectors with small angular noise.
    basis = np.linalg.qr(rng.normal(size=(H, H)))[0][:C]
    truth = np.repeat(np.arange(C), per)
    keys = np.stack([(basis[truth] + 0.05 * rng.normal(size=(C * per, H))) * rng.uniform(0.5, 3, (C * per, 1))
                     for _ in range(P)]).astype(np.float32)
    valid = np.ones((P, C * per), bool)
    r = cosine_kmeans(jnp.asarray(keys), jnp.asarray(valid), jnp.full((P,), C, jnp.int32), problem_keys(jax.random.PRNGKey(5), P),
                      max_clusters=C, max_iters=50, init=init)
    for p in range(P):
        labels = np.asarray(r.labels[p])
        # Same partition up to a permutation of cluster ids: a bijection between planted and found labels.
        pairs = set(zip(truth.tolist(), labels.tolist()))
        assert len(pairs) == C, f"{init}: planted clusters split or merged: {sorted(pairs)}"


def test_zero_norm_and_masked_keys_give_no_nan():
    keys = np.zeros((2, 50, 8), np.float32)
    keys[0, 10:20] = np.random.default_rng(0).normal(size=(10, 8))
    valid = np.zeros((2, 50), bool)
    valid[0, :30] = True  # 20 zero keys among the valid ones
    r = cosine_kmeans(jnp.asarray(keys), jnp.asarray(valid), jnp.array([4, 4], jnp.int32), problem_keys(jax.random.PRNGKey(0), 2),
                      max_clusters=4, max_iters=10, init="random")
    assert np.all(np.isfinite(np.asarray(r.centroids)))
    assert np.asarray(r.sizes[0]).sum() == 30 and np.asarray(r.sizes[1]).sum() == 0
    assert np.all(np.asarray(r.labels[1]) == 4)


def test_random_init_picks_distinct_valid_keys():
    keys, valid = _problems(P=3, N=100, H=4, seed=4)
    seeds = np.asarray(init_random(jnp.asarray(keys), jnp.asarray(valid), 20, problem_keys(jax.random.PRNGKey(1), 3)))
    for p in range(3):
        rows = [np.flatnonzero((keys[p] == s).all(-1))[0] for s in seeds[p]]
        assert len(set(rows)) == 20 and all(valid[p, r] for r in rows)


@pytest.mark.parametrize("tol", [0.01, 0.03, 0.1])
def test_tolerance_stops_each_problem_once_it_has_settled(tol):
    """Each problem runs Lloyd steps until, in its last step, at most floor(tol * its valid keys) keys changed
    cluster (then it is frozen, whatever the other problems do): the labels and step counts of a NumPy loop
    per problem; and a problem gives the same result alone as in the batch."""
    keys, valid = _problems(P=3, N=400, seed=5)
    C, max_iters = 12, 30
    num = np.full(3, C, np.int32)
    init = np.asarray(init_random(jnp.asarray(keys), jnp.asarray(valid), C, problem_keys(jax.random.PRNGKey(1), 3)))
    got = kmeans_from_directions(jnp.asarray(keys), jnp.asarray(valid), jnp.asarray(num), jnp.asarray(init),
                                 max_iters=max_iters, tol=tol)
    steps_per_problem = []
    for p in range(3):
        unit = keys[p] / np.linalg.norm(keys[p], axis=-1, keepdims=True)
        d = init[p] / np.linalg.norm(init[p], axis=-1, keepdims=True)
        labels = numpy_assign(unit, valid[p], d, C)
        steps = 0
        while steps < max_iters:
            for c in range(C):
                if (labels == c).any():
                    s = unit[labels == c].sum(0)
                    d[c] = s / np.linalg.norm(s)
            new = numpy_assign(unit, valid[p], d, C)
            moved = (new != labels).sum()
            labels, steps = new, steps + 1
            if moved <= np.floor(tol * valid[p].sum()):
                break
        steps_per_problem.append(steps)
        np.testing.assert_array_equal(np.asarray(got.labels[p]), labels)
        alone = kmeans_from_directions(jnp.asarray(keys[p:p + 1]), jnp.asarray(valid[p:p + 1]),
                                       jnp.asarray(num[p:p + 1]), jnp.asarray(init[p:p + 1]),
                                       max_iters=max_iters, tol=tol)
        np.testing.assert_array_equal(np.asarray(alone.labels[0]), labels)
        np.testing.assert_allclose(np.asarray(alone.centroids[0]), np.asarray(got.centroids[p]), atol=1e-6)
    assert int(got.iterations) == max(steps_per_problem)
    assert 1 < max(steps_per_problem) < max_iters  # the rule, not the cap, ended the loop


@pytest.mark.parametrize("C", [1, 2, 7, 100, 128, 129, 4096, 4097])
def test_assignment_picks_a_most_similar_allowed_cluster(C):
    """The packed max of `_assign` against NumPy's exact argmax of the bfloat16-rounded operands: the label is an
    allowed cluster, its cosine is within one grid step (2**(bits-22) / 0.9375) of the best, and it is the argmax
    wherever the best leads the runner-up by more than that. Keys equal to a direction (cos 1) or opposite to one (cos -1) included; past
    2**12 clusters `_assign` falls back to an exact argmax."""
    rng = np.random.default_rng(C)
    P, N, H = 3, 400, 16
    unit = rng.normal(size=(P, N, H))
    unit /= np.linalg.norm(unit, axis=-1, keepdims=True)
    d = rng.normal(size=(P, C, H))
    d /= np.linalg.norm(d, axis=-1, keepdims=True)
    unit[:, :2] = d[:, :1]  # cos 1 with cluster 0
    unit[:, 2:4] = -d[:, :1]  # cos -1 with cluster 0
    num = np.array([C, max(1, C // 2), 1])
    ok = np.arange(C)[None] < num[:, None]
    valid = rng.random((P, N)) < 0.9
    got = np.asarray(_assign(jnp.asarray(unit, jnp.float32), jnp.asarray(valid), jnp.asarray(d, jnp.float32),
                             jnp.asarray(ok)))
    # The products of the operands rounded to bfloat16 (`kmeans.ASSIGN_PASSES`), in float64 here.
    rounded_unit, rounded_d = (x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64) for x in (unit, d))
    sim = np.where(ok[:, None, :], rounded_unit @ rounded_d.transpose(0, 2, 1), -np.inf)
    step = 2.0 ** (max(1, (C - 1).bit_length()) - 22) / 0.9375 if C <= 4096 else 0.0
    assert np.all(got[~valid] == C)
    p_idx, n_idx = np.nonzero(valid)
    label = got[p_idx, n_idx]
    assert np.all(label < num[p_idx]), "a disallowed cluster won"
    best = sim.max(-1)[p_idx, n_idx]
    chosen = sim[p_idx, n_idx, label]
    assert np.all(chosen >= best - step - 1e-6)
    top2 = np.sort(sim, axis=-1)[..., -2:][p_idx, n_idx] if C > 1 else None
    clear = (top2[:, 1] - top2[:, 0] > step + 1e-6) if C > 1 else np.ones_like(label, bool)
    np.testing.assert_array_equal(label[clear], sim.argmax(-1)[p_idx, n_idx][clear])


@pytest.mark.parametrize("C", [7, 200])
def test_assignment_in_chunks_of_keys_is_the_documented_rule(C, monkeypatch):
    """Where the similarities of all keys at once would pass `ASSIGN_BLOCK_BYTES`, keys are assigned in chunks
    (multiples of 1,024; the last one padded): the labels are still the NumPy rule's, key for key, and a whole
    K-means run equals the NumPy reference."""
    from clusterkv_jax import kmeans

    rng = np.random.default_rng(C)
    P, N, H = 2, 2500, 16
    keys = rng.normal(size=(P, N, H)).astype(np.float32) + rng.normal(size=(P, 1, H)).astype(np.float32)
    unit = keys / np.linalg.norm(keys, axis=-1, keepdims=True)
    d = rng.normal(size=(P, C, H)).astype(np.float32)
    d /= np.linalg.norm(d, axis=-1, keepdims=True)
    valid = rng.random((P, N)) < 0.9
    num = np.array([C, max(1, C // 3)], np.int32)
    monkeypatch.setattr(kmeans, "ASSIGN_BLOCK_BYTES", 1)  # the smallest chunk: 1,024 keys, so 3 chunks
    got = np.asarray(kmeans._assign(jnp.asarray(unit), jnp.asarray(valid), jnp.asarray(d),
                                    jnp.asarray(np.arange(C)[None] < num[:, None])))
    for p in range(P):
        np.testing.assert_array_equal(got[p], numpy_assign(unit[p], valid[p], d[p], num[p]))
    jax.clear_caches()  # `kmeans_from_directions` is jitted: trace it anew under the patched size
    result = kmeans_from_directions(jnp.asarray(keys), jnp.asarray(valid), jnp.asarray(num), jnp.asarray(d),
                                    max_iters=4)
    for p in range(P):
        labels, centroids, _ = numpy_cosine_kmeans(keys[p], valid[p], num[p], d[p].copy(), 4)
        np.testing.assert_array_equal(np.asarray(result.labels[p]), labels)
        np.testing.assert_allclose(np.asarray(result.centroids[p]), centroids, atol=1e-5)
    jax.clear_caches()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), C=st.integers(1, 9), nonfinite=st.sampled_from([np.nan, np.inf, -np.inf]))
def test_kmeans_outputs_are_finite_wherever_the_counted_keys_are(seed, C, nonfinite):
    """Random masks, NaN or inf in masked rows and in some valid rows, zero-norm keys: centroids and directions
    stay finite, every finite valid key gets a cluster < its problem's count, and masked or non-finite keys
    get none (label C) and count in no cluster's size."""
    rng = np.random.default_rng(seed)
    P, N, H = 3, 64, 8
    keys = rng.normal(size=(P, N, H)).astype(np.float32)
    valid = rng.random((P, N)) < rng.uniform(0.1, 1.0)
    keys[rng.random((P, N)) < 0.2] = 0.0  # zero-norm keys
    bad_masked = (~valid) & (rng.random((P, N)) < 0.5)
    keys[bad_masked, rng.integers(0, H)] = nonfinite
    bad_valid = valid & (rng.random((P, N)) < 0.1)
    keys[bad_valid, 0] = nonfinite
    num = rng.integers(1, C + 1, size=P).astype(np.int32)
    r = cosine_kmeans(jnp.asarray(keys), jnp.asarray(valid), jnp.asarray(num), problem_keys(jax.random.PRNGKey(seed % 1000), P),
                      max_clusters=C, max_iters=5)
    assert np.all(np.isfinite(np.asarray(r.centroids))) and np.all(np.isfinite(np.asarray(r.directions)))
    labels, sizes = np.asarray(r.labels), np.asarray(r.sizes)
    counted = valid & np.all(np.isfinite(keys), axis=-1)
    assert np.all(labels[~counted] == C)
    assert np.all(labels[counted] < np.broadcast_to(num[:, None], (P, N))[counted])
    np.testing.assert_array_equal(sizes.sum(-1), counted.sum(-1))


def test_fixed_iterations_give_what_stopping_early_gives():
    """`fixed_iterations` (a GPU's K-means: a loop of known trip count, no host wait per iteration) runs all
    `max_iters` iterations with settled problems frozen: the labels, sizes, centroids, directions and the count of
    iterations with work equal the while loop's, for problems that settle early, late and never (`max_iters` cuts
    them), with and without a tolerance."""
    keys, valid = _problems(P=4, N=300, H=16, seed=4)
    num = jnp.array([1, 3, 12, 24], jnp.int32)
    init = init_random(jnp.asarray(keys), jnp.asarray(valid), 24, problem_keys(jax.random.PRNGKey(2), 4))
    for max_iters, tol in ((30, 0.0), (3, 0.0), (30, 0.05)):
        runs = [kmeans_from_directions(jnp.asarray(keys), jnp.asarray(valid), num, init, max_iters=max_iters, tol=tol,
                                       fixed_iterations=fixed) for fixed in (False, True)]
        for a, b in zip(*runs):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert 1 < int(runs[0].iterations) <= max_iters
    assert int(runs[0].iterations) < 30  # the tolerance stopped every problem early: the frozen tail did nothing


def test_the_tpu_form_assigns_as_the_cpu_form():
    """The XLA form on a TPU (implementation "tpu": bfloat16 operands into the product, the MXU's own form) and on
    the CPU ("reference": float32 values rounded to bfloat16) form the same products: the same labels, also in
    chunks of keys, and both match NumPy's rule on the rounded operands."""
    rng = np.random.default_rng(9)
    P, N, H, C = 3, 700, 32, 40
    unit = rng.normal(size=(P, N, H)).astype(np.float32)
    unit /= np.linalg.norm(unit, axis=-1, keepdims=True)
    d = unit[:, rng.choice(N, C, replace=False)] + 0.1 * rng.normal(size=(P, C, H)).astype(np.float32)
    d /= np.linalg.norm(d, axis=-1, keepdims=True)
    valid = rng.random((P, N)) < 0.9
    num = np.array([C, 17, 1])
    ok = np.arange(C)[None] < num[:, None]
    args = (jnp.asarray(unit), jnp.asarray(valid), jnp.asarray(d), jnp.asarray(ok))
    cpu, tpu = (np.asarray(_assign(*args, impl=impl)) for impl in ("reference", "tpu"))
    np.testing.assert_array_equal(tpu, cpu)
    for p in range(P):
        np.testing.assert_array_equal(cpu[p], numpy_assign(unit[p], valid[p], d[p], num[p]))
