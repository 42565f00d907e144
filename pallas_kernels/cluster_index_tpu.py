"""Budgeted block slots → store blocks for ClusterKV's cluster ranking, as a Pallas Mosaic TPU kernel.

The same rule as `cluster_to_block_index` (the Triton kernel; its module docstring states it) and
`cluster_to_block_index_reference`: clusters in descending score order with sizes s_r and first blocks start_r
are taken while `tokens` tokens and `slots` blocks hold, the crossing one trimmed; slot j reads block
start_r + (j − (U_r − u_r)) of the cluster r with U_r − u_r ≤ j < U_r, rows clip(take_r − block·(j − (U_r −
u_r)), 0, block); unused slots read block 0, 0 rows.

On a TPU there is no scan to walk the clusters with, so the kernel is written with the vector and matrix
units only: the prefix sums are products with a triangular 0/1 matrix on the MXU (float32 at
Precision.HIGHEST: exact for integers below 2^24), and each slot finds its cluster by comparing against all
clusters at once ([slots, C] masks, reduced along the lanes). Clusters lie along the lanes ([1, C] rows),
slots along the sublanes ([slots, 1] columns), so nothing is transposed. Counts, blocks and rows are carried in
float32 (exact below 2^24) and cast to int32 at the end. One problem per grid step; the leading (batch, head)
dims are the grid. C and the slots are padded to multiples of 128 and 8 (padding clusters have size 0 and take
nothing).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _ceil_div(x: jax.Array, d: int) -> jax.Array:
    """⌈x / d⌉ of float32 holding integers in [0, 2^24), exactly: a division may be compiled as a multiplication by
    1/d (for d = 7, 14 · (1/7) rounds above 2), so the rounded quotient is corrected by exact integer products."""
    q = jnp.ceil(x * (1.0 / d))
    q = jnp.where((q - 1.0) * d >= x, q - 1.0, q)
    return jnp.where(q * d < x, q + 1.0, q)


def _cluster_block_tpu_kernel(
    sizes_ref,  # [1, C] int32 ranked sizes (best first; padding 0)
    starts_ref,  # [1, C] int32 first block of each, same order
    blocks_ref,  # [M, 1] int32 the block each slot reads
    rows_ref,  # [M, 1] int32 rows read in it
    *,
    tokens: int,
    slots: int,
    block: int,
):
    C, M = sizes_ref.shape[1], blocks_ref.shape[0]
    size = sizes_ref[...].astype(jnp.float32)  # [1, C]
    start = starts_ref[...].astype(jnp.float32)
    earlier = (lax.broadcasted_iota(jnp.int32, (C, C), 0) < lax.broadcasted_iota(jnp.int32, (C, C), 1))

    def before(x):  # [1, C] -> Σ_{r' < r} x[r'] as [1, C]: one product with the strictly triangular matrix
        return jnp.dot(x, earlier.astype(jnp.float32), preferred_element_type=jnp.float32,
                       precision=lax.Precision.HIGHEST)

    nb = _ceil_div(size, block)
    take = jnp.clip(jnp.minimum(tokens - before(size), block * (slots - before(nb))), 0.0, size)
    used = _ceil_div(take, block)
    used_excl = before(used)  # [1, C] the first slot of each cluster
    j = lax.broadcasted_iota(jnp.int32, (M, C), 0).astype(jnp.float32)  # slot ids down the sublanes
    hit = (used_excl <= j) & (j < used_excl + used)  # [M, C] the one cluster of each used slot
    within = j - used_excl
    blocks_ref[...] = jnp.sum(jnp.where(hit, start + within, 0.0), axis=1, keepdims=True).astype(jnp.int32)
    rows_ref[...] = jnp.sum(jnp.where(hit, jnp.clip(take - block * within, 0.0, float(block)), 0.0), axis=1,
                            keepdims=True).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("tokens", "slots", "block_size", "interpret"))
def cluster_to_block_index_tpu(
    ranked_sizes: jax.Array,  # [..., C] int32, clusters in descending score order
    ranked_starts: jax.Array,  # [..., C] int32 first block of each cluster, same order
    tokens: int,
    slots: int,
    block_size: int,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Blocks [..., slots] int32 and rows read in each [..., slots] int32, equal to
    `cluster_to_block_index_reference`. `interpret=True` runs Pallas's TPU interpreter (any device; tests)."""
    assert ranked_sizes.shape == ranked_starts.shape, (ranked_sizes.shape, ranked_starts.shape)
    *lead, C = ranked_sizes.shape
    M = int(slots)
    assert M >= 1 and C >= 1 and tokens >= 0 and block_size >= 1, f"{M=}, {C=}, {tokens=}, {block_size=}"
    P, c_pad, m_pad = math.prod(lead), pl.cdiv(C, 128) * 128, pl.cdiv(M, 8) * 8
    pad = lambda x: jnp.pad(x.astype(jnp.int32).reshape(P, 1, C), ((0, 0), (0, 0), (0, c_pad - C)))  # noqa: E731
    row = pl.BlockSpec((None, 1, c_pad), lambda p: (p, 0, 0))
    column = pl.BlockSpec((None, m_pad, 1), lambda p: (p, 0, 0))
    blocks, rows = pl.pallas_call(
        functools.partial(_cluster_block_tpu_kernel, tokens=int(tokens), slots=M, block=int(block_size)),
        grid=(P,),
        in_specs=[row, row],
        out_specs=[column, column],
        out_shape=[jax.ShapeDtypeStruct((P, m_pad, 1), jnp.int32)] * 2,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="cluster_to_block_index_tpu",
    )(pad(ranked_sizes), pad(ranked_starts))
    return blocks[:, :M, 0].reshape(*lead, M), rows[:, :M, 0].reshape(*lead, M)
