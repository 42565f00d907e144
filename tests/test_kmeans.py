"""Cosine K-means against a NumPy reference, its objective, planted clusters, and masking edge cases."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clusterkv_jax.kmeans import cosine_kmeans, cosine_objective, init_random, kmeans_from_directions, problem_keys


def numpy_cosine_kmeans(keys, valid, num_clusters, directions, max_iters):
    """Independent reference for one problem: keys [N, H], valid [N], directions [C, H]."""
    unit = keys / np.maximum(np.linalg.norm(keys, axis=-1, keepdims=True), 1e-12)
    d = directions / np.maximum(np.linalg.norm(directions, axis=-1, keepdims=True), 1e-12)
    C = d.shape[0]

    def assign(d):
        sim = unit @ d.T
        sim[:, num_clusters:] = -np.inf
        return np.where(valid, sim.argmax(-1), C)

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
        labels = np.where(valid[p], (unit @ d.T).argmax(-1), C)
        steps = 0
        while steps < max_iters:
            for c in range(C):
                if (labels == c).any():
                    s = unit[labels == c].sum(0)
                    d[c] = s / np.linalg.norm(s)
            new = np.where(valid[p], (unit @ d.T).argmax(-1), C)
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
