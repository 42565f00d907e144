"""K-means' assignment step (each key's most similar allowed cluster) as a Pallas Triton kernel.

For each problem p (batch × KV head) and key n:

    labels[p, n] = argmax_c { keys[p, n] · directions[p, c]  :  allowed[p, c] }     (num_clusters if not valid[p, n])

ties to the lowest c. Where XLA computes this, the [N, C] similarities of a problem are written to memory and read
back for the argmax (XLA:GPU fuses no reduction into a matrix product): at 32k keys and 415 clusters, 53 MB a KV
head for each iteration of each layer, against 8 MB of keys. The kernel keeps them on chip: each program takes a
block of keys, walks the clusters in blocks of BC on the matrix units, and keeps a running best per key (as flash
attention keeps a running max), so only the keys, the directions and the labels cross memory.

Precision: the products run in bfloat16 with float32 accumulation, `passes` = 1 (the tensor cores' own rate);
both operands are rounded to bfloat16 first, so the result is the argmax of the float32 products of the rounded
operands, which is what `kmeans_assign_reference` computes on any device. passes=3 splits each float32 operand
into a bfloat16 high and low part and adds the three largest cross products (about 16 significant bits, 3x the
work).

`kmeans_assign` maps the one-problem kernel over the leading (batch, head) dims with `jax.vmap`, which Pallas turns
into more grid dims of one launch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dispatch import bf16_terms, map_leading, next_pow2


def _products(a_parts: list[jax.Array], b_parts: list[jax.Array], dot) -> jax.Array:
    """a · bᵀ in float32 from their bfloat16 parts: hi·hi (one part each), + hi·lo + lo·hi (two)."""
    out = dot(a_parts[0], b_parts[0])
    if len(a_parts) == 2:
        out += dot(a_parts[0], b_parts[1]) + dot(a_parts[1], b_parts[0])
    return out


def _kmeans_assign_kernel(
    keys_ref,  # [num_keys, head_dim]
    valid_ref,  # [num_keys] int32 (1: a key to assign)
    directions_ref,  # [num_clusters, head_dim]
    allowed_ref,  # [num_clusters] int32 (1: a cluster a key may join)
    labels_ref,  # [num_keys] int32
    *,
    num_keys: int,
    num_clusters: int,
    head_dim: int,
    block_n: int,
    block_c: int,
    block_h: int,
    passes: int,
):
    n0 = pl.program_id(0) * block_n
    n_ok = n0 + jnp.arange(block_n, dtype=jnp.int32) < num_keys  # [block_n]
    h_ok = jnp.arange(block_h, dtype=jnp.int32) < head_dim  # [block_h]
    x = plgpu.load(keys_ref.at[pl.ds(n0, block_n), pl.ds(0, block_h)], mask=n_ok[:, None] & h_ok[None, :],
                   other=0).astype(jnp.float32)  # [block_n, block_h]
    x_parts = bf16_terms(x, 1 if passes == 1 else 2)  # once, for every cluster block (masked rows: 0)

    def body(t, carry):
        best, label = carry  # [block_n] float32, [block_n] int32
        c0 = t * block_c
        c_ids = c0 + jnp.arange(block_c, dtype=jnp.int32)  # [block_c]
        c_in = c_ids < num_clusters
        d = plgpu.load(directions_ref.at[pl.ds(c0, block_c), pl.ds(0, block_h)],
                       mask=c_in[:, None] & h_ok[None, :], other=0).astype(jnp.float32)  # [block_c, block_h]
        allowed = plgpu.load(allowed_ref.at[pl.ds(c0, block_c)], mask=c_in, other=0) > 0  # [block_c]
        d_parts = bf16_terms(d, 1 if passes == 1 else 2)
        sim = _products(x_parts, d_parts, lambda a, b: plgpu.dot(a, b, trans_b=True))  # [block_n, block_c] float32
        sim = jnp.where(allowed[None, :], sim, -jnp.inf)
        block_best = jnp.max(sim, axis=1)  # [block_n]
        # The lowest cluster of this block reaching the block's best (ties to the lowest c, as argmax).
        block_label = jnp.min(jnp.where(sim == block_best[:, None], c_ids[None, :], num_clusters), axis=1)
        better = block_best > best  # strict: an equal later block keeps the lower c
        return jnp.where(better, block_best, best), jnp.where(better, block_label, label)

    best = jnp.full((block_n,), -jnp.inf, jnp.float32)
    label = jnp.zeros((block_n,), jnp.int32)  # a problem with no allowed cluster: 0, as the reference's clip
    best, label = lax.fori_loop(0, pl.cdiv(num_clusters, block_c), body, (best, label))
    valid = plgpu.load(valid_ref.at[pl.ds(n0, block_n)], mask=n_ok, other=0) > 0
    plgpu.store(labels_ref.at[pl.ds(n0, block_n)], jnp.where(valid, label, num_clusters), mask=n_ok)


@functools.partial(jax.jit, static_argnames=("block_n", "block_c", "passes", "num_warps", "num_stages", "interpret"))
def kmeans_assign(
    keys: jax.Array,  # [..., N, H] (unit vectors for cosine K-means)
    valid: jax.Array,  # [..., N] bool
    directions: jax.Array,  # [..., C, H]
    allowed: jax.Array,  # [..., C] bool
    *,
    block_n: int = 64,
    block_c: int = 64,
    passes: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Each valid key's most similar allowed cluster [..., N] int32 (C for an invalid key), in one launch.

    Equal to `kmeans_assign_reference(..., passes=passes)` up to the order of the float32 sums (a key whose two
    best clusters lie closer than that may take either). The launch defaults compile for sm80 and sm90 at H <= 128
    (deviceless, `make aot-cuda`); they are not tuned on hardware."""
    *lead, N, H = keys.shape
    C = directions.shape[-2]
    assert valid.shape == (*lead, N), f"valid {valid.shape} must be [..., N] = {(*lead, N)}"
    assert directions.shape == (*lead, C, H), f"directions {directions.shape} must be {(*lead, C, H)}"
    assert allowed.shape == (*lead, C), f"allowed {allowed.shape} must be [..., C] = {(*lead, C)}"
    assert passes in (1, 3), f"passes must be 1 or 3, got {passes}"
    for name, b in (("block_n", block_n), ("block_c", block_c)):
        assert b >= 16 and b & (b - 1) == 0, f"{name}={b} must be a power of two >= 16"
    # Dot operands need every dimension >= 16 and a power of two.
    block_n = min(block_n, max(16, next_pow2(N)))
    block_c = min(block_c, max(16, next_pow2(C)))
    block_h = max(16, next_pow2(H))
    kernel = functools.partial(_kmeans_assign_kernel, num_keys=N, num_clusters=C, head_dim=H, block_n=block_n,
                               block_c=block_c, block_h=block_h, passes=passes)
    one = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(N, block_n),),
        in_specs=[
            pl.BlockSpec((N, H), lambda n: (0, 0)),  # keys
            pl.BlockSpec((N,), lambda n: (0,)),  # valid
            pl.BlockSpec((C, H), lambda n: (0, 0)),  # directions
            pl.BlockSpec((C,), lambda n: (0,)),  # allowed
        ],
        out_specs=pl.BlockSpec((N,), lambda n: (0,)),
        out_shape=jax.ShapeDtypeStruct((N,), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kmeans_assign",
    )
    return map_leading(one, len(lead))(keys, valid.astype(jnp.int32), directions, allowed.astype(jnp.int32))


def round_parts(x: jax.Array, passes: int) -> jax.Array:
    """x in float32 as the sum of its bfloat16 parts would give: rounded to bfloat16 (passes=1), or x itself
    (passes=3, whose missing lo·lo term is below float32's own rounding for unit vectors)."""
    x = x.astype(jnp.float32)
    return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7) if passes == 1 else x


@functools.partial(jax.jit, static_argnames=("passes",))
def kmeans_assign_reference(keys: jax.Array, valid: jax.Array, directions: jax.Array, allowed: jax.Array, *,
                            passes: int = 1) -> jax.Array:
    """Pure jnp, the same problems as `kmeans_assign`: float32 products of the operands rounded as the kernel's
    parts are, argmax over the allowed clusters -> [..., N] int32 (C for an invalid key)."""
    C = directions.shape[-2]
    sim = jnp.einsum("...NH,...CH->...NC", round_parts(keys, passes), round_parts(directions, passes),
                     precision=lax.Precision.HIGHEST)
    labels = jnp.argmax(jnp.where(allowed[..., None, :], sim, -jnp.inf), axis=-1).astype(jnp.int32)
    return jnp.where(valid, labels, C)
