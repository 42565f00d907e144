"""Per-cluster key sums and member counts (the K-means centroid accumulation) as a Pallas Mosaic TPU kernel.

The same problem as `centroid_update` (the Triton kernel) and `centroid_update_reference`: for each problem p
(batch × KV head) and cluster c,

    sums[p, c]   = Σ_n [labels[p, n] == c] · keys[p, n]      (float32)
    counts[p, c] = Σ_n [labels[p, n] == c]                    (int32)

with labels outside [0, C) ignored (and their keys zeroed first, so a NaN in a padding row reaches no sum).

On a TPU the accumulation is a matrix product on the MXU: the grid is (C-blocks, N-blocks) with N innermost
(a reduction: "arbitrary"), and each step adds onehot[BC, BN] x keys[BN, H] into its sums block and the one-hot's
row sums into its counts block, both staying in VMEM across the N-steps (counts in float32: exact up to 2^24
members). float32 keys are multiplied at `Precision.HIGHEST` (multi-pass bfloat16 on the MXU: float32 accuracy),
bfloat16 keys at the default (their products are exact in float32); the one-hot factor is exact in any precision.
Blocks: labels [1, BN] (BN a multiple of 128), keys [BN, H] (the whole row), sums [BC, H] and counts [BC, 1] (BC a
multiple of 8); N and C are padded to whole blocks. The leading (batch, head) dims are one more, parallel, grid dim.
The keys go in as they are (zeroed where ignored): an earlier form appended a column of ones to count with the
same product, and keys of H + 1 = 129 columns lie in HBM padded to 256 lanes: 260 MiB a copy at 32k (8 KV heads,
float32), read once per K-means iteration (docs/research_log.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _centroid_update_tpu_kernel(
    labels_ref,  # [1, BN] int32 this N-block's labels (-1: padding)
    keys_ref,  # [BN, H] float32 / bfloat16: this N-block's keys
    sums_ref,  # [BC, H] float32 this C-block's sums, accumulated over N-blocks
    counts_ref,  # [BC, 1] float32 this C-block's member counts, likewise
    *,
    block_c: int,
):
    @pl.when(pl.program_id(2) == 0)  # grid (problem, C-block, N-block)
    def _():
        sums_ref[...] = jnp.zeros_like(sums_ref)
        counts_ref[...] = jnp.zeros_like(counts_ref)

    clusters = pl.program_id(1) * block_c + lax.broadcasted_iota(jnp.int32, (block_c, labels_ref.shape[1]), 0)
    member = labels_ref[...] == clusters  # [BC, BN]
    # HIGHEST for float32 keys only: Mosaic rejects a bfloat16 product at fp32 contract precision ("Bad lhs type",
    # found by compiling for a v5e without one: `make aot-tpu`); bfloat16 products are exact in float32.
    precision = lax.Precision.HIGHEST if keys_ref.dtype == jnp.float32 else lax.Precision.DEFAULT
    sums_ref[...] += jnp.dot(member.astype(keys_ref.dtype), keys_ref[...], preferred_element_type=jnp.float32,
                             precision=precision)
    counts_ref[...] += jnp.sum(member.astype(jnp.float32), axis=1, keepdims=True)


@functools.partial(jax.jit, static_argnames=("num_clusters", "block_n", "block_c", "interpret"))
def centroid_update_tpu(
    keys: jax.Array,  # [..., N, H] float32 / bfloat16
    labels: jax.Array,  # [..., N] int32; outside [0, num_clusters) (C or -1): ignored
    num_clusters: int,
    *,
    block_n: int = 512,
    block_c: int = 128,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Per-cluster key sums [..., C, H] float32 and member counts [..., C] int32 (see the module docstring).
    `interpret=True` runs the kernel in Pallas's TPU interpreter (any device; for tests)."""
    assert keys.ndim >= 2, f"keys must be [..., N, H], got {keys.shape}"
    *lead, N, H = keys.shape
    C = int(num_clusters)
    assert labels.shape == (*lead, N), f"labels {labels.shape} must be [..., N] = {(*lead, N)}"
    assert C >= 1 and N >= 1 and H >= 1, f"need num_clusters >= 1 and non-empty keys, got {C}, {keys.shape}"
    assert block_n % 128 == 0 and block_c % 8 == 0, f"block_n={block_n} (x128), block_c={block_c} (x8)"
    dtype = keys.dtype if keys.dtype == jnp.bfloat16 else jnp.float32
    labels = labels.astype(jnp.int32)
    ok = (labels >= 0) & (labels < C)
    block_n = min(block_n, pl.cdiv(N, 128) * 128)
    block_c = min(block_c, pl.cdiv(C, 8) * 8)
    n_pad, c_pad = pl.cdiv(N, block_n) * block_n, pl.cdiv(C, block_c) * block_c
    # Padding and ignored rows: label -1 (matches no cluster) and zero keys (no NaN reaches a sum).
    labels = jnp.pad(jnp.where(ok, labels, -1), [(0, 0)] * len(lead) + [(0, n_pad - N)], constant_values=-1)
    rows = jnp.pad(jnp.where(ok[..., None], keys.astype(dtype), 0), [(0, 0)] * len(lead) + [(0, n_pad - N), (0, 0)])
    # The problems as one more grid dim (not vmap: Mosaic's dimension semantics must name every grid dim).
    P = math.prod(lead)
    sums, counts = pl.pallas_call(
        functools.partial(_centroid_update_tpu_kernel, block_c=block_c),
        grid=(P, c_pad // block_c, n_pad // block_n),
        in_specs=[
            pl.BlockSpec((None, 1, block_n), lambda p, c, n: (p, 0, n)),  # labels [P, 1, N]
            pl.BlockSpec((None, block_n, H), lambda p, c, n: (p, n, 0)),  # keys [P, N, H]
        ],
        out_specs=[pl.BlockSpec((None, block_c, H), lambda p, c, n: (p, c, 0)),
                   pl.BlockSpec((None, block_c, 1), lambda p, c, n: (p, c, 0))],
        out_shape=[jax.ShapeDtypeStruct((P, c_pad, H), jnp.float32), jax.ShapeDtypeStruct((P, c_pad, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="centroid_update_tpu",
    )(labels.reshape(P, 1, n_pad), rows.reshape(P, n_pad, H))
    counts = jnp.round(counts.reshape(*lead, c_pad)[..., :C]).astype(jnp.int32)
    return sums.reshape(*lead, c_pad, H)[..., :C, :], counts
