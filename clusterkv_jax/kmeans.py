"""Batched cosine K-means as a jitted `lax.while_loop`.

Assignment uses cosine similarity; the cluster direction used for assignment is the normalised sum of the
member keys' unit vectors (spherical K-means), which makes the objective Σ cos(key, direction) monotone
non-decreasing. After convergence each cluster's stored centroid is the mean of its member keys (raw, not
normalised), so that q·μ equals the members' average attention logit: that is what ClusterKV ranks by.

Shapes: P independent problems (batch × KV heads), N keys, C (static) cluster slots, H head dim. P may be
several leading dims (e.g. [B, K]): every function maps over all of them, so callers need not merge B and K
into one dim (which, under a mesh with B and K on different axes, would force a gather).

A key holding a NaN or inf is treated as masked: it joins no cluster. Assignment counts similarities closer
than 2**(ceil(log2 C) - 22) / 0.9375 as tied (3.3e-5 for 128 clusters; see `_assign` for why).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from clusterkv_jax import kernels
from clusterkv_jax.ops import map_leading, top_k_indices
from pallas_kernels.kmeans_assign import round_parts

_EPS = 1e-12


class KMeansResult(NamedTuple):
    labels: jax.Array  # [P, N] int32 cluster of each key; C for masked keys
    centroids: jax.Array  # [P, C, H] float32 mean of member keys (empty: the unit direction it kept)
    sizes: jax.Array  # [P, C] int32 member counts
    directions: jax.Array  # [P, C, H] unit directions the final labels were assigned against
    iterations: jax.Array  # [] int32 update steps run


def _finite_keys(keys: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 keys with every row holding a NaN or inf zeroed and masked: such a key joins no cluster, and the
    zeros keep 0 * NaN out of the member sums (a masked row must not poison the centroids)."""
    x = keys.astype(jnp.float32)
    finite = jnp.all(jnp.isfinite(x), axis=-1)
    return jnp.where(finite[..., None], x, 0.0), valid & finite


def _normalize(x: jax.Array) -> jax.Array:
    """Unit vectors along the last axis; zero vectors stay zero (no NaN)."""
    norm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
    return x / jnp.maximum(norm, _EPS)


# Similarities are scaled into [2 + 1/16, 4 - 1/16] before packing: one float exponent, away from its edges.
_PACK_SCALE, _PACK_OFFSET = 0.9375, 3.0
_PACK_MAX_BITS = 12  # more clusters than 2**12: similarities closer than ~1e-3 would tie; use argmax instead
#: The most bytes of [P, keys, C] float32 similarities one assignment step computes at once. Where the product is
#: written to memory (XLA:GPU and XLA:TPU; XLA:CPU fuses it with the max), all N keys at once grow with the square
#: of the context (Llama-3-8B's 8 KV heads: 442 MB a layer at 32k, 7 GB at 128k); keys then go in chunks (multiples
#: of 1,024) that stay within this. Smaller problems are assigned whole: chunks cost time on the CPU (37% at 84
#: problems of 8,000 keys and 100 clusters, chunks of 4,096).
ASSIGN_BLOCK_BYTES = 128 << 20
#: How the assignment's products are formed: 1, bfloat16 operands with float32 products and sums (the tensor
#: cores' and the MXU's native form; on SmolLM2's keys at 8k, attention-mass recall at B=512 moved by -0.0006 on
#: average over two texts and three seeds, at most 0.0016, where the seeds alone move it by 0.004-0.010:
#: docs/research_log.md); 3, float32 (the kernel: three bfloat16 products, about 16 significant bits).
ASSIGN_PASSES = 1


def _assign(unit_keys, valid, directions, cluster_ok, impl: str = "reference", passes: int | None = None):
    """Label of the most cosine-similar allowed cluster per key; C for masked keys. The similarities are float32
    products of bfloat16 operands (`ASSIGN_PASSES`), on every device. `impl` "pallas" or "interpret"
    runs `kernels.kmeans_assign` (the similarities never leave the chip); "reference" and "tpu" run this XLA form
    ("tpu" with bfloat16 operands, "reference" with float32 values rounded to them: the same products).

    Why not `argmax` here: XLA:CPU cannot fuse an argmax (a two-operand reduce) with the [P, N, C] similarity
    product, so the product is written to memory and read back, which took half of K-means' time. A plain max
    does fuse. So each similarity is scaled into [2, 4) (one float exponent there: the mantissa is fixed
    point), rounded to free its low ceil(log2 C) mantissa bits, and those bits are set to C-1-c: the max of
    these floats carries the best cluster in its low bits (the lower c on a tie). The price: similarities
    within 2**(bits-22) / 0.9375 of each other count as tied (3.3e-5 for 128 clusters).
    """
    passes = ASSIGN_PASSES if passes is None else passes
    if impl in ("pallas", "interpret"):
        return kernels.kmeans_assign(unit_keys, valid, directions, cluster_ok, passes=passes, impl=impl)
    N, C = unit_keys.shape[-2], directions.shape[-2]
    chunk = max(1024, ASSIGN_BLOCK_BYTES // (4 * C * int(np.prod(unit_keys.shape[:-2]))) // 1024 * 1024)
    if N <= chunk:
        return _assign_block(unit_keys, valid, directions, cluster_ok, passes, impl == "tpu")
    n = -(-N // chunk)  # keys in n chunks: a [P, chunk, C] similarity block at a time
    pad = [(0, 0)] * (unit_keys.ndim - 2) + [(0, n * chunk - N)]
    keys = jnp.pad(unit_keys, pad + [(0, 0)])
    keys = jnp.moveaxis(keys.reshape(*keys.shape[:-2], n, chunk, keys.shape[-1]), -3, 0)
    ok = jnp.moveaxis(jnp.pad(valid, pad).reshape(*valid.shape[:-1], n, chunk), -2, 0)
    labels = jax.lax.map(lambda a: _assign_block(a[0], a[1], directions, cluster_ok, passes, impl == "tpu"),
                         (keys, ok))
    return jnp.moveaxis(labels, 0, -2).reshape(*valid.shape[:-1], n * chunk)[..., :N]


def _assign_block(unit_keys, valid, directions, cluster_ok, passes: int, mxu: bool):
    """`_assign` of keys [P, N, H] all at once (`mxu`: bfloat16 operands, the TPU's form)."""
    C = directions.shape[-2]
    bits = max(1, (C - 1).bit_length())
    # [P, N, C]
    if passes == 1 and mxu:  # bfloat16 operands, float32 products and sums: the MXU's own form
        sim = jnp.einsum("...NH,...CH->...NC", unit_keys.astype(jnp.bfloat16), directions.astype(jnp.bfloat16),
                         preferred_element_type=jnp.float32)
    elif passes == 1:
        # The same products from float32 values rounded to bfloat16, which every float32 dot forms exactly (TF32
        # included). XLA:CPU took 25% longer over bfloat16 operands, XLA:TPU held 416 MB more over rounded float32
        # (docs/research_log.md).
        sim = jnp.einsum("...NH,...CH->...NC", round_parts(unit_keys, 1), round_parts(directions, 1))
    else:
        sim = jnp.einsum("...NH,...CH->...NC", unit_keys, directions, precision=jax.lax.Precision.HIGHEST)
    if bits > _PACK_MAX_BITS:
        labels = jnp.argmax(jnp.where(cluster_ok[..., None, :], sim, -jnp.inf), axis=-1).astype(jnp.int32)
    else:
        # A disallowed cluster lands below 0, under every allowed one.
        offset = jnp.where(cluster_ok, jnp.float32(_PACK_OFFSET), jnp.float32(-_PACK_OFFSET))[..., None, :]
        value = jax.lax.reduce_precision(sim * _PACK_SCALE + offset, exponent_bits=8, mantissa_bits=23 - bits)
        code = (C - 1 - jnp.arange(C, dtype=jnp.int32)).astype(jnp.float32) * 2.0**-22
        best = jnp.max(value + code, axis=-1)  # [P, N] in [2, 4): low `bits` mantissa bits = C-1-label
        low = jax.lax.bitcast_convert_type(best, jnp.int32) & ((1 << bits) - 1)
        labels = jnp.clip(C - 1 - low, 0, C - 1)  # the clip only matters for a problem with no allowed cluster
    return jnp.where(valid, labels, C)


def _member_sums(labels, x, C, impl: str = "reference"):
    """Per-cluster sums of x [P, N, H] and counts (float32) of the labels [P, N] (masked keys have label C: no
    row), by `kernels.centroid_update` with implementation `impl` (`kernels.IMPLEMENTATIONS`)."""
    sums, counts = kernels.centroid_update(x, labels, C, impl=impl)
    return sums, counts.astype(jnp.float32)


def cluster_mask(num_clusters: jax.Array, C: int) -> jax.Array:
    """[P, C] True for the cluster slots each problem uses."""
    return jnp.arange(C) < num_clusters[..., None]


@functools.partial(jax.jit, static_argnames=("max_iters", "impl", "tol", "assign_impl", "fixed_iterations"))
def kmeans_from_directions(
    keys: jax.Array,  # [P, N, H]
    valid: jax.Array,  # [P, N] bool
    num_clusters: jax.Array,  # [P] int32, <= C
    init_directions: jax.Array,  # [P, C, H]
    max_iters: int = 20,
    impl: str = "reference",
    tol: float = 0.0,
    assign_impl: str = "reference",
    fixed_iterations: bool = False,
) -> KMeansResult:
    """Lloyd iterations under cosine similarity from given initial cluster directions. Each problem stops (and
    keeps its labels and directions) once at most a fraction `tol` of its valid keys changed cluster in an
    iteration (0: none changed), or at `max_iters`; `iterations` is the most any problem ran. `impl`: the
    centroid update's implementation, `assign_impl` the assignment's (`clusterkv_jax.kernels`). `fixed_iterations`:
    run all `max_iters` iterations as a loop of known trip count, settled problems frozen (the same result, no host
    wait per iteration on a GPU)."""
    x, valid = _finite_keys(keys, valid)
    return _lloyd(x, valid, num_clusters, init_directions, max_iters, impl, tol, assign_impl, fixed_iterations)


def _lloyd(x, valid, num_clusters, init_directions, max_iters: int, impl: str, tol: float, assign_impl: str,
           fixed_iterations: bool) -> KMeansResult:
    """`kmeans_from_directions` on keys already made finite (`_finite_keys`)."""
    C = init_directions.shape[-2]
    unit = _normalize(x)
    ok = cluster_mask(num_clusters, C)
    directions = _normalize(init_directions.astype(jnp.float32))
    labels = _assign(unit, valid, directions, ok, assign_impl)

    def update(labels, directions):
        sums, counts = _member_sums(labels, unit, C, impl)
        # An emptied cluster keeps its previous direction, so it stays a valid (finite) centroid.
        return jnp.where(counts[..., None] > 0, _normalize(sums), directions)

    # Keys that may still move in a settled problem (with tol=0, settled means no key moved).
    allowed = jnp.floor(tol * jnp.sum(valid, axis=-1))  # [P]

    def cond(state):
        it, _, _, active = state
        return jnp.any(active) & (it < max_iters)

    def body(state):
        # A settled problem is frozen, so each problem's result is the same whatever problems run beside it
        # (a sequence clusters alike alone or in a batch); with tol=0 a settled problem is a fixed point anyway.
        it, labels, directions, active = state
        new_directions = update(labels, directions)
        new_labels = _assign(unit, valid, new_directions, ok, assign_impl)
        moved = jnp.sum(new_labels != labels, axis=-1)  # [P]
        directions = jnp.where(active[..., None, None], new_directions, directions)
        labels = jnp.where(active[..., None], new_labels, labels)
        return it + 1, labels, directions, active & (moved > allowed)

    state = (jnp.int32(0), labels, directions, jnp.ones(valid.shape[:-1], bool))
    if fixed_iterations:
        # XLA:GPU copies a while loop's predicate to the host on every iteration and waits for it
        # (`kernels.branches_wait_for_host`); a loop of known trip count it runs without. Settled problems are frozen
        # by the body, so all `max_iters` iterations give what stopping early gives; `iterations` counts those in
        # which some problem was still active.
        def fixed_body(_, state):
            it, *rest = body(state)
            return (it - 1 + jnp.any(state[3]).astype(jnp.int32), *rest)

        it, labels, directions, _ = jax.lax.fori_loop(0, max_iters, fixed_body, state)
    else:
        it, labels, directions, _ = jax.lax.while_loop(cond, body, state)
    sums, counts = _member_sums(labels, x, C, impl)
    centroids = jnp.where(counts[..., None] > 0, sums / jnp.maximum(counts, 1)[..., None], directions)
    return KMeansResult(labels, centroids, counts.astype(jnp.int32), directions, it)


def _draws(rngs: jax.Array, N: int) -> jax.Array:
    """One uniform draw per position [P, N] from one PRNG key per problem (rngs [P, 2])."""
    # float32 draws also under JAX_ENABLE_X64, so the seeds do not change with it.
    return map_leading(lambda r: jax.random.uniform(r, (N,), jnp.float32), rngs.ndim - 1)(rngs)


def init_random(keys: jax.Array, valid: jax.Array, C: int, rngs: jax.Array) -> jax.Array:
    """C distinct valid keys per problem, uniformly at random: [P, C, H]: the C largest of one uniform draw per
    position among the valid keys, then, where fewer are valid, the others by the smallest draw (ties to the lower
    position). Needs C <= N.

    rngs holds one PRNG key per problem [P, 2], so a problem's seeds do not depend on the batch around it.
    """
    u = _draws(rngs, keys.shape[-2])
    idx = top_k_indices(jnp.where(valid, u, -1.0 - u), C)  # valid keys first, in random order
    return jnp.take_along_axis(keys.astype(jnp.float32), idx[..., None], axis=-2)


def random_order(rngs: jax.Array, N: int) -> jax.Array:
    """Each problem's N positions [P, N] in descending order of one uniform draw per position (`init_random`'s
    draws; ties to the lower position). It reads neither the keys nor which are valid, so the layers of an unrolled
    program that share their PRNG keys share it (`cosine_kmeans`: one sort for them all)."""
    return top_k_indices(_draws(rngs, N), N)


def seeds_in_order(keys: jax.Array, valid: jax.Array, order: jax.Array, C: int) -> jax.Array:
    """`init_random`'s seeds from its draws' order ([P, N], `random_order`): the first C valid keys [P, C, H]
    (float32) in it, then, where fewer are valid, the invalid ones from its end (ties among those in the other
    order: seeds of clusters no problem uses). A compaction of the order, no sort."""
    taken = jnp.take_along_axis(valid, order, axis=-1)  # [P, N]
    count, skipped = jnp.cumsum(taken, axis=-1), jnp.cumsum(~taken, axis=-1)
    slot = jnp.where(taken, count - 1, count[..., -1:] + skipped[..., -1:] - skipped)  # a permutation of [0, N)
    # One scatter per problem, vmapped: flattening the problems' dims into one would merge dims that a mesh shards
    # apart (batch, KV heads) and gather them.
    idx = map_leading(lambda o, s: jnp.zeros_like(o).at[s].set(o), order.ndim - 1)(order, slot)[..., :C]
    return jnp.take_along_axis(keys.astype(jnp.float32), idx[..., None], axis=-2)


def init_kmeans_plus_plus(keys: jax.Array, valid: jax.Array, C: int, rngs: jax.Array) -> jax.Array:
    """k-means++ seeding under cosine distance: each next seed drawn with probability ∝ (1 − max cos)²."""

    def one(x, valid, rng):  # x [N, H], valid [N]
        x = x.astype(jnp.float32)
        unit = _normalize(x)
        rngs = jax.random.split(rng, C)
        first = jax.random.categorical(rngs[0], jnp.where(valid, 0.0, -jnp.inf).astype(jnp.float32))
        seeds = jnp.zeros((C, x.shape[1]), jnp.float32).at[0].set(x[first])
        best_sim = unit @ unit[first]

        def body(c, carry):
            seeds, best_sim = carry
            dist = jnp.clip(1.0 - best_sim, 0.0, 2.0)
            # Tiny floor keeps the draw defined when every remaining key coincides with a seed.
            pick = jax.random.categorical(rngs[c], jnp.where(valid, jnp.log(dist * dist + 1e-20), -jnp.inf))
            return seeds.at[c].set(x[pick]), jnp.maximum(best_sim, unit @ unit[pick])

        return jax.lax.fori_loop(1, C, body, (seeds, best_sim))[0]

    return map_leading(one, valid.ndim - 1)(keys, valid, rngs)


def problem_keys(seed_key: jax.Array, P: int) -> jax.Array:
    """One PRNG key per problem, [P, 2]."""
    return jax.vmap(lambda i: jax.random.fold_in(seed_key, i))(jnp.arange(P))


def cosine_kmeans(
    keys: jax.Array,  # [P, N, H]
    valid: jax.Array,  # [P, N] bool
    num_clusters: jax.Array,  # [P] int32 clusters wanted per problem (<= max_clusters)
    rngs: jax.Array,  # [P, 2] one PRNG key per problem (see `problem_keys`)
    *,
    max_clusters: int,
    max_iters: int = 20,
    init: str = "random",
    impl: str = "reference",
    tol: float = 0.0,
    assign_impl: str = "reference",
    fixed_iterations: bool | None = None,
) -> KMeansResult:
    """Cosine K-means of each problem's valid keys into num_clusters[p] clusters (slots beyond stay empty),
    iterated until at most a fraction `tol` of each problem's keys moves (see `kmeans_from_directions`).
    A key holding a NaN or inf counts as masked (label C, in no cluster). Jitted; a `num_clusters` known here
    (not traced) outside [1, max_clusters] is refused. `fixed_iterations` (None: where a loop's predicate waits for
    the host, `kernels.branches_wait_for_host`) runs all `max_iters` iterations, to the same result."""
    if isinstance(max_clusters, bool) or not isinstance(max_clusters, int) or max_clusters < 1:
        raise ValueError(f"max_clusters must be a positive int, got {max_clusters!r}")
    if isinstance(max_iters, bool) or not isinstance(max_iters, int) or max_iters < 1:
        raise ValueError(f"max_iters must be a positive int, got {max_iters!r}")
    if init not in ("random", "kmeans++"):
        raise ValueError(f"unknown init {init!r}; use 'random' or 'kmeans++'")
    try:
        counts = np.asarray(num_clusters)
    except jax.errors.TracerArrayConversionError:  # traced: the caller's to keep in [1, max_clusters]
        counts = None
    if counts is not None and counts.size and (counts.min() < 1 or counts.max() > max_clusters):
        raise ValueError(f"num_clusters must be in [1, max_clusters={max_clusters}] for every problem, got "
                         f"{counts.tolist() if counts.size <= 8 else (counts.min(), counts.max())}")
    # Where the layers are unrolled (a GPU's loop), the random initialisation's order is made from the PRNG keys alone,
    # before the layer's own values: layers indexed one by one that share their keys (ClusterKV's offloaded prompt
    # layers) share it, one sort where XLA:GPU compiles one per layer (docs/research_log.md, "XLA:GPU compiles every
    # sort anew"; offloaded, 32 layers: 41.9 s to compile against 69.9 s). Device stores are indexed in one loop
    # (`attend.indexed_in_one_loop`), one sort either way. A scanned loop has one body for all its layers; there a
    # top_k of the seeds alone costs less than the whole order (XLA:CPU, 3 x 8192 draws: 0.2 against 6 ms).
    shared = init == "random" and kernels.layer_loop() == "unrolled"
    order = random_order(rngs, keys.shape[-2]) if shared else None
    # Every layer's K-means starts from the same constant PRNG keys: values of its own (`kernels.layer_values`).
    keys, valid, num_clusters, rngs, order = kernels.layer_values(keys, valid, num_clusters, rngs, order)
    return _cosine_kmeans(keys, valid, num_clusters, rngs, order, max_clusters=max_clusters, max_iters=max_iters,
                          init=init, impl=impl, tol=tol, assign_impl=assign_impl,
                          fixed_iterations=kernels.branches_wait_for_host() if fixed_iterations is None
                          else bool(fixed_iterations))


@functools.partial(jax.jit, static_argnames=("max_clusters", "max_iters", "init", "impl", "tol", "assign_impl",
                                             "fixed_iterations"))
def _cosine_kmeans(keys, valid, num_clusters, rngs, order, *, max_clusters: int, max_iters: int, init: str,
                   impl: str, tol: float, assign_impl: str, fixed_iterations: bool) -> KMeansResult:
    keys, valid = _finite_keys(keys, valid)
    if init == "random" and order is not None:
        directions = seeds_in_order(keys, valid, order, max_clusters)
    elif init == "random":
        directions = init_random(keys, valid, max_clusters, rngs)
    else:
        directions = init_kmeans_plus_plus(keys, valid, max_clusters, rngs)
    return _lloyd(keys, valid, num_clusters, directions, max_iters, impl, tol, assign_impl, fixed_iterations)


def cosine_objective(keys: jax.Array, valid: jax.Array, labels: jax.Array, directions: jax.Array) -> jax.Array:
    """Σ over valid keys of (1 − cos(key, direction of its cluster)) per problem: [P]."""
    C = directions.shape[-2]
    d = jnp.take_along_axis(_normalize(directions), jnp.minimum(labels, C - 1)[..., None], axis=-2)
    cos = jnp.sum(_normalize(keys.astype(jnp.float32)) * d, axis=-1)
    return jnp.sum(jnp.where(valid, 1.0 - cos, 0.0), axis=-1)
