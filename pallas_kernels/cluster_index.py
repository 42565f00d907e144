"""Budgeted block slots → store blocks for ClusterKV's cluster ranking, as a Pallas Triton kernel.

ClusterKV's store keeps each cluster's members in consecutive rows, in whole blocks of `block` rows starting at
block `start_r`. Given clusters already in descending score order (the top_k stays in XLA) with sizes s_r, the
rule takes clusters in that order while both budgets hold, `tokens` tokens and `slots` blocks, and trims the one
that crosses either:

    take_r = clip(min(tokens − Σ_{r'<r} s_r',  block · (slots − Σ_{r'<r} ⌈s_r' / block⌉)),  0,  s_r)

(a trimmed cluster keeps its first members). Cluster r then uses u_r = ⌈take_r / block⌉ blocks; slot j
(0 ≤ j < slots) belongs to the cluster r with U_r − u_r ≤ j < U_r (U the prefix sums of u) and reads

    block[j] = start_r + (j − (U_r − u_r))        rows[j] = clip(take_r − block · (j − (U_r − u_r)), 0, block)

so whole blocks of whole clusters come first and only the last cluster's last block is partly read; unused
slots hold block 0 with 0 rows.

The kernel solves one problem: it walks the clusters in chunks of BC, keeps the running prefix sums (in-kernel
`cumsum`, a Triton scan) and, for each slot, adds the block and rows of the one cluster whose [U − u, U)
contains it. It stops once the prefix of used blocks passes every slot. `cluster_to_block_index` maps it over
the leading dims with `jax.vmap`, which Pallas turns into more grid dims of one launch.

Sizes must be >= 0 (ClusterKV gives unused cluster slots size 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dispatch import map_leading, next_pow2


def _cluster_block_kernel(
    sizes_ref,  # [num_clusters] int32, ranked (best first)
    starts_ref,  # [num_clusters] int32 first block of each cluster, same order
    blocks_ref,  # [slots] int32
    rows_ref,  # [slots] int32
    *,
    num_clusters: int,
    tokens: int,
    slots: int,
    block: int,
    block_m: int,
    block_c: int,
):
    j = jnp.arange(block_m, dtype=jnp.int32)  # [block_m] slot ids (block_m >= slots)
    num_chunks = pl.cdiv(num_clusters, block_c)

    def cond(carry):
        k, _, _, used_base, _, _ = carry
        return (k < num_chunks) & (used_base < slots)

    def body(carry):
        k, tok_base, blk_base, used_base, out_block, out_rows = carry
        c0 = k * block_c
        c_ok = c0 + jnp.arange(block_c, dtype=jnp.int32) < num_clusters  # [block_c]
        size = plgpu.load(sizes_ref.at[pl.ds(c0, block_c)], mask=c_ok, other=0)  # [block_c]
        start = plgpu.load(starts_ref.at[pl.ds(c0, block_c)], mask=c_ok, other=0)  # [block_c]
        nb = (size + block - 1) // block
        tok_excl = tok_base + jnp.cumsum(size) - size
        blk_excl = blk_base + jnp.cumsum(nb) - nb
        take = jnp.clip(jnp.minimum(tokens - tok_excl, block * (slots - blk_excl)), 0, size)
        used = (take + block - 1) // block
        used_incl = used_base + jnp.cumsum(used)
        used_excl = used_incl - used
        hit = (used_excl[None, :] <= j[:, None]) & (j[:, None] < used_incl[None, :])  # [block_m, block_c]
        within = j[:, None] - used_excl[None, :]
        out_block += jnp.sum(jnp.where(hit, start[None, :] + within, 0), axis=1)
        out_rows += jnp.sum(jnp.where(hit, jnp.clip(take[None, :] - block * within, 0, block), 0), axis=1)
        return k + 1, tok_base + jnp.sum(size), blk_base + jnp.sum(nb), used_base + jnp.sum(used), out_block, out_rows

    zeros = jnp.zeros((block_m,), jnp.int32)
    _, _, _, _, out_block, out_rows = lax.while_loop(
        cond, body, (jnp.int32(0), jnp.int32(0), jnp.int32(0), jnp.int32(0), zeros, zeros))
    in_range = j < slots
    plgpu.store(blocks_ref.at[pl.ds(0, block_m)], out_block, mask=in_range)
    plgpu.store(rows_ref.at[pl.ds(0, block_m)], out_rows, mask=in_range)


@functools.partial(jax.jit, static_argnames=("tokens", "slots", "block_size", "block_c", "num_warps", "interpret"))
def cluster_to_block_index(
    ranked_sizes: jax.Array,  # [..., C] int32, clusters in descending score order
    ranked_starts: jax.Array,  # [..., C] int32 first block of each cluster, same order
    tokens: int,
    slots: int,
    block_size: int,
    *,
    block_c: int = 64,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Blocks [..., slots] int32 and rows read in each [..., slots] int32 (see the module docstring), one launch.

    Equal to `cluster_to_block_index_reference`.
    """
    assert ranked_sizes.shape == ranked_starts.shape, (ranked_sizes.shape, ranked_starts.shape)
    C, M = ranked_sizes.shape[-1], int(slots)
    assert M >= 1 and C >= 1 and tokens >= 0 and block_size >= 1, f"{M=}, {C=}, {tokens=}, {block_size=}"
    assert block_c >= 1 and block_c & (block_c - 1) == 0, f"block_c={block_c} must be a power of two"
    block_c = min(block_c, next_pow2(C))
    kernel = functools.partial(_cluster_block_kernel, num_clusters=C, tokens=int(tokens), slots=M,
                               block=int(block_size), block_m=next_pow2(M), block_c=block_c)
    one = pl.pallas_call(
        kernel,
        grid=(1,),
        in_specs=[
            pl.BlockSpec((C,), lambda i: (0,)),  # ranked_sizes
            pl.BlockSpec((C,), lambda i: (0,)),  # ranked_starts
        ],
        out_specs=[
            pl.BlockSpec((M,), lambda i: (0,)),  # blocks
            pl.BlockSpec((M,), lambda i: (0,)),  # rows
        ],
        out_shape=[jax.ShapeDtypeStruct((M,), jnp.int32), jax.ShapeDtypeStruct((M,), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="cluster_to_block_index",
    )
    return map_leading(one, ranked_sizes.ndim - 1)(ranked_sizes.astype(jnp.int32), ranked_starts.astype(jnp.int32))


def _reference_one(ranked_sizes, ranked_starts, tokens: int, slots: int, block: int):
    """One problem: sizes, starts [C] -> blocks, rows [slots]."""
    C = ranked_sizes.shape[-1]
    size = ranked_sizes
    nb = -(-size // block)
    tok_before = jnp.cumsum(size) - size
    blk_before = jnp.cumsum(nb) - nb
    take = jnp.clip(jnp.minimum(tokens - tok_before, block * (slots - blk_before)), 0, size)
    used = -(-take // block)
    cum = jnp.cumsum(used)  # [C] inclusive prefix sums of used blocks
    j = jnp.arange(slots, dtype=jnp.int32)
    # Slot j belongs to the first ranked cluster whose prefix sum exceeds j: the count of prefix sums <= j. One
    # [slots, C] comparison, not a `searchsorted` (on XLA:CPU a while loop of small thunks, a visible part of a
    # SmolLM2 decode step; docs/research_log.md).
    r = jnp.minimum(jnp.sum(cum[None, :] <= j[:, None], axis=-1, dtype=jnp.int32), C - 1)
    within = j - (cum[r] - used[r])
    valid = j < cum[-1]
    blocks = jnp.where(valid, ranked_starts[r] + within, 0)
    rows = jnp.where(valid, jnp.clip(take[r] - block * within, 0, block), 0)
    return blocks.astype(jnp.int32), rows.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("tokens", "slots", "block_size"))
def cluster_to_block_index_reference(
    ranked_sizes: jax.Array,  # [..., C] int32
    ranked_starts: jax.Array,  # [..., C] int32
    tokens: int,
    slots: int,
    block_size: int,
) -> tuple[jax.Array, jax.Array]:
    """Pure jnp: the same problems, the same mapping as `cluster_to_block_index`."""
    one = functools.partial(_reference_one, tokens=tokens, slots=slots, block=block_size)
    return map_leading(one, ranked_sizes.ndim - 1)(ranked_sizes.astype(jnp.int32), ranked_starts.astype(jnp.int32))
