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
One launch for all problems; grid (P, M-blocks).

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
    j0 = pl.program_id(1) * block_m
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


@functools.partial(
    jax.jit, static_argnames=("slots", "group", "block_m", "block_c", "num_warps", "num_stages", "interpret")
)
def cluster_to_token_index(
    ranked_sizes: jax.Array,  # [P, C] int32, clusters in descending score order
    ranked_starts: jax.Array,  # [P, C] int32 offsets into sorted_tokens, same order
    sorted_tokens: jax.Array,  # [P // group, S] int32 token positions grouped by cluster
    slots: int,
    *,
    group: int = 1,
    block_m: int = 128,
    block_c: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Token positions idx [P, M] int32 and mask [P, M] bool of the M = `slots` budget slots, one launch.

    Equal to `cluster_to_token_index_reference` (the part of `rank_and_index` after the argsort).
    Problem p reads sorted_tokens[p // group]: with per-query-head ranking under GQA, pass the KV heads'
    token lists once and group = query heads per KV head, instead of repeating them.
    """
    assert ranked_sizes.ndim == 2, f"ranked_sizes must be [P, C], got {ranked_sizes.shape}"
    P, C = ranked_sizes.shape
    assert ranked_starts.shape == (P, C), f"ranked_starts {ranked_starts.shape} must be [P, C] = {(P, C)}"
    assert group >= 1 and P % group == 0, f"group={group} must divide P={P}"
    assert sorted_tokens.ndim == 2 and sorted_tokens.shape[0] == P // group, (
        f"sorted_tokens {sorted_tokens.shape} must be [P // group, S] = [{P // group}, S]"
    )
    S = sorted_tokens.shape[1]
    M = int(slots)
    assert M >= 1 and C >= 1 and S >= 1, f"need slots, C and S >= 1, got {M=}, {C=}, {S=}"
    for name, b in (("block_m", block_m), ("block_c", block_c)):
        assert b >= 1 and b & (b - 1) == 0, f"{name}={b} must be a power of two"
    block_m = min(block_m, _next_pow2(M))
    block_c = min(block_c, _next_pow2(C))

    kernel = functools.partial(
        _cluster_index_kernel,
        num_clusters=C,
        num_tokens=S,
        slots=M,
        block_m=block_m,
        block_c=block_c,
    )
    return pl.pallas_call(
        kernel,
        grid=(P, pl.cdiv(M, block_m)),
        in_specs=[
            pl.BlockSpec((None, C), lambda p, m: (p, 0)),  # ranked_sizes
            pl.BlockSpec((None, C), lambda p, m: (p, 0)),  # ranked_starts
            pl.BlockSpec((None, S), lambda p, m: (p // group, 0)),  # sorted_tokens
        ],
        out_specs=[
            pl.BlockSpec((None, M), lambda p, m: (p, 0)),  # idx
            pl.BlockSpec((None, M), lambda p, m: (p, 0)),  # mask
        ],
        out_shape=[
            jax.ShapeDtypeStruct((P, M), jnp.int32),
            jax.ShapeDtypeStruct((P, M), jnp.bool_),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="cluster_to_token_index",
    )(ranked_sizes.astype(jnp.int32), ranked_starts.astype(jnp.int32), sorted_tokens.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("slots",))
def cluster_to_token_index_reference(
    ranked_sizes: jax.Array,  # [P, C] int32
    ranked_starts: jax.Array,  # [P, C] int32
    sorted_tokens: jax.Array,  # [P, S] int32
    slots: int,
) -> tuple[jax.Array, jax.Array]:
    """Pure jnp, as `clusterkv_jax.policies.clusterkv.rank_and_index` after its argsort."""
    C = ranked_sizes.shape[-1]
    S = sorted_tokens.shape[-1]
    cum = jnp.cumsum(ranked_sizes, axis=-1)  # [P, C] inclusive prefix sums
    j = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), cum.shape[:-1] + (slots,))
    # Slot j belongs to the first ranked cluster whose prefix sum exceeds j.
    r = jax.vmap(lambda c, q: jnp.searchsorted(c, q, side="right"))(cum, j)
    r_clip = jnp.minimum(r, C - 1)
    before = jnp.take_along_axis(cum - ranked_sizes, r_clip, axis=-1)
    offset = jnp.take_along_axis(ranked_starts, r_clip, axis=-1) + (j - before)
    idx = jnp.take_along_axis(sorted_tokens, jnp.clip(offset, 0, S - 1), axis=-1)
    mask = j < cum[..., -1:]
    return jnp.where(mask, idx, 0).astype(jnp.int32), mask
