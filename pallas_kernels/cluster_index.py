"""Budgeted-slot → token index for ClusterKV's cluster ranking, as a Pallas Triton kernel.

Given clusters already in descending score order (the argsort stays in XLA), with sizes s_r, start
offsets st_r into the label-sorted token list, and inclusive prefix sums cum_r = s_0 + … + s_r, budget slot
j (0 ≤ j < M) belongs to the ranked cluster r with cum_r − s_r ≤ j < cum_r (= the number of prefix sums
≤ j: `searchsorted(cum, j, side="right")`), and takes

    idx[j]  = sorted_tokens[st_r + (j − (cum_r − s_r))]      mask[j] = j < cum_{C−1} (the total)

so the top clusters are taken whole and the last one trimmed; masked slots hold 0.

The kernel needs neither a search nor a gather of cluster metadata: it walks the clusters in chunks of
BC, keeps the running prefix sum (in-kernel `cumsum`, a Triton scan), and for each slot adds
st_c + j − excl_c over the one cluster c whose [excl_c, cum_c) contains j (zero-size clusters contain
nothing). It stops as soon as the prefix sum covers every slot of its block, so with a budget of ~1000
tokens and ~80 tokens per cluster it reads only the first chunk. The one gather is the final token load.

The kernel solves one problem (grid: M-blocks); `cluster_to_token_index` maps it over the leading dims with
`jax.vmap`, which Pallas turns into more grid dims of the same launch. A token list may serve several
problems (the G query heads of a KV head rank clusters apart but share its token list): leading dims of
the sizes beyond those of the token list are mapped with the token list unbatched, so it is never copied.

Sizes must be >= 0 (the ranking gives unused cluster slots size 0). Token offsets are clamped to
[0, S) so that inconsistent metadata cannot read out of bounds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _cluster_index_kernel(
    sizes_ref,  # [num_clusters] int32, ranked (best first)
    starts_ref,  # [num_clusters] int32, ranked
    tokens_ref,  # [num_tokens] int32 token positions grouped by cluster
    idx_ref,  # [slots] int32
    mask_ref,  # [slots] bool
    *,
    num_clusters: int,
    num_tokens: int,
    slots: int,
    block_m: int,
    block_c: int,
):
    j0 = pl.program_id(0) * block_m
    j = j0 + jnp.arange(block_m, dtype=jnp.int32)  # [block_m] slot ids
    num_chunks = pl.cdiv(num_clusters, block_c)
    last_slot = j0 + block_m - 1

    def cond(carry):
        k, base, _ = carry
        # Stop once the prefix sum passed every slot of this block.
        return (k < num_chunks) & (base <= last_slot)

    def body(carry):
        k, base, pos = carry  # [], [], [block_m]
        c0 = k * block_c
        c_ok = c0 + jnp.arange(block_c, dtype=jnp.int32) < num_clusters  # [block_c]
        size = plgpu.load(sizes_ref.at[pl.ds(c0, block_c)], mask=c_ok, other=0)  # [block_c]
        start = plgpu.load(starts_ref.at[pl.ds(c0, block_c)], mask=c_ok, other=0)  # [block_c]
        incl = base + jnp.cumsum(size)  # [block_c] inclusive prefix sums
        excl = incl - size
        hit = (excl[None, :] <= j[:, None]) & (j[:, None] < incl[None, :])  # [block_m, block_c]
        offset = start[None, :] + (j[:, None] - excl[None, :])
        pos += jnp.sum(jnp.where(hit, offset, 0), axis=1)
        return k + 1, base + jnp.sum(size), pos

    _, total, pos = lax.while_loop(
        cond, body, (jnp.int32(0), jnp.int32(0), jnp.zeros((block_m,), jnp.int32))
    )
    # `total` is exact whenever it matters: the loop stops early only once total > every slot here.
    valid = j < total  # [block_m]
    pos = jnp.clip(pos, 0, num_tokens - 1)
    token = plgpu.load(tokens_ref.at[pos], mask=valid, other=0)  # [block_m] gather
    in_range = j < slots
    plgpu.store(idx_ref.at[pl.ds(j0, block_m)], jnp.where(valid, token, 0), mask=in_range)
    plgpu.store(mask_ref.at[pl.ds(j0, block_m)], valid, mask=in_range)


def map_problems(one, ranked_sizes, ranked_starts, sorted_tokens):
    """one(sizes [C], starts [C], tokens [S]) over every problem: sizes / starts [*lead, C] and tokens
    [*lead_t, S] with lead_t a prefix of lead. The dims of lead_t map all three; the rest of lead map the sizes
    and starts with the token list unbatched (shared, not copied)."""
    shared = sorted_tokens.ndim - 1
    extra = ranked_sizes.ndim - 1 - shared
    assert ranked_sizes.shape == ranked_starts.shape, (ranked_sizes.shape, ranked_starts.shape)
    assert extra >= 0 and ranked_sizes.shape[:shared] == sorted_tokens.shape[:-1], (
        f"sorted_tokens {sorted_tokens.shape} must lead like ranked_sizes {ranked_sizes.shape}")
    fn = one
    for _ in range(extra):
        fn = jax.vmap(fn, in_axes=(0, 0, None))
    for _ in range(shared):
        fn = jax.vmap(fn)
    return fn(ranked_sizes.astype(jnp.int32), ranked_starts.astype(jnp.int32), sorted_tokens.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("slots", "block_m", "block_c", "num_warps", "num_stages", "interpret"))
def cluster_to_token_index(
    ranked_sizes: jax.Array,  # [..., C] int32, clusters in descending score order
    ranked_starts: jax.Array,  # [..., C] int32 offsets into sorted_tokens, same order
    sorted_tokens: jax.Array,  # [..., S] int32 token positions grouped by cluster (leading dims: a prefix)
    slots: int,
    *,
    block_m: int = 128,
    block_c: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Token positions idx [..., M] int32 and mask [..., M] bool of the M = `slots` budget slots, one launch.

    Equal to `cluster_to_token_index_reference`. See `map_problems` for how the token list is shared.
    """
    C, S, M = ranked_sizes.shape[-1], sorted_tokens.shape[-1], int(slots)
    assert M >= 1 and C >= 1 and S >= 1, f"need slots, C and S >= 1, got {M=}, {C=}, {S=}"
    for name, b in (("block_m", block_m), ("block_c", block_c)):
        assert b >= 1 and b & (b - 1) == 0, f"{name}={b} must be a power of two"
    block_m = min(block_m, _next_pow2(M))
    block_c = min(block_c, _next_pow2(C))
    kernel = functools.partial(_cluster_index_kernel, num_clusters=C, num_tokens=S, slots=M, block_m=block_m,
                               block_c=block_c)
    one = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(M, block_m),),
        in_specs=[
            pl.BlockSpec((C,), lambda m: (0,)),  # ranked_sizes
            pl.BlockSpec((C,), lambda m: (0,)),  # ranked_starts
            pl.BlockSpec((S,), lambda m: (0,)),  # sorted_tokens
        ],
        out_specs=[
            pl.BlockSpec((M,), lambda m: (0,)),  # idx
            pl.BlockSpec((M,), lambda m: (0,)),  # mask
        ],
        out_shape=[jax.ShapeDtypeStruct((M,), jnp.int32), jax.ShapeDtypeStruct((M,), jnp.bool_)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="cluster_to_token_index",
    )
    return map_problems(one, ranked_sizes, ranked_starts, sorted_tokens)


def _reference_one(ranked_sizes, ranked_starts, sorted_tokens, slots: int):
    """One problem: sizes, starts [C], tokens [S] -> idx, mask [slots]."""
    C, S = ranked_sizes.shape[-1], sorted_tokens.shape[-1]
    cum = jnp.cumsum(ranked_sizes)  # [C] inclusive prefix sums
    j = jnp.arange(slots, dtype=jnp.int32)
    # Slot j belongs to the first ranked cluster whose prefix sum exceeds j.
    r = jnp.minimum(jnp.searchsorted(cum, j, side="right"), C - 1)
    offset = ranked_starts[r] + (j - (cum[r] - ranked_sizes[r]))
    idx = sorted_tokens[jnp.clip(offset, 0, S - 1)]
    mask = j < cum[-1]
    return jnp.where(mask, idx, 0).astype(jnp.int32), mask


@functools.partial(jax.jit, static_argnames=("slots",))
def cluster_to_token_index_reference(
    ranked_sizes: jax.Array,  # [..., C] int32
    ranked_starts: jax.Array,  # [..., C] int32
    sorted_tokens: jax.Array,  # [..., S] int32 (leading dims: a prefix of the sizes')
    slots: int,
) -> tuple[jax.Array, jax.Array]:
    """Pure jnp: the same problems, the same mapping as `cluster_to_token_index`."""
    return map_problems(functools.partial(_reference_one, slots=slots), ranked_sizes, ranked_starts, sorted_tokens)
