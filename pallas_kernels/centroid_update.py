"""Per-cluster sums and member counts of keys (the K-means centroid accumulation) as a Pallas Triton kernel.

For each problem p (batch × KV head) and cluster c:

    sums[p, c]   = Σ_n [labels[p, n] == c] · keys[p, n]      (float32)
    counts[p, c] = Σ_n [labels[p, n] == c]                    (int32)

A label outside [0, C) contributes nothing, so both padding conventions work: `clusterkv_jax.kmeans` gives
masked tokens label C; -1 is ignored alike. The keys of such tokens are zeroed before the matmul, so a
NaN/inf in a padding row cannot leak into any sum.

The kernel builds one-hot tiles onehot[BN, BC] = (labels[:, None] == c_ids[None, :]) and accumulates
dot(onehotᵀ, keys_blk) on the matrix units. It is deterministic: no atomics. The kernel solves one problem on
the grid (C-blocks, N-splits); each program loops over its N-blocks, and when N is split across programs the
per-split partial sums are added by XLA in a fixed order. C-blocks vary fastest, so the programs that read the
same key tile run side by side and share it through L2. `centroid_update` maps it over the leading (batch,
head) dims with `jax.vmap`, which Pallas turns into more grid dims of the same launch.

float32 keys are split exactly into `passes` bfloat16 terms (hi + mid + lo carry all 24 mantissa bits), so
with passes=3 (the default) every product onehot × term is exact and the result matches a float32 matmul
up to summation order; passes=1 rounds the keys to bfloat16 (fastest, ~3 significant digits).
bfloat16 / float16 keys take one exact pass.

Block sizes are powers of two; any N, C, H is handled by masked loads and stores (H is not padded in memory).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dispatch import bf16_terms, map_leading, next_pow2


def _centroid_update_kernel(
    labels_ref,  # [num_tokens] int32
    keys_ref,  # [num_tokens, head_dim]
    sums_ref,  # [num_clusters, head_dim] float32 (this N-split's partial sums)
    counts_ref,  # [num_clusters] int32 (this N-split's partial counts)
    *,
    num_tokens: int,
    num_clusters: int,
    head_dim: int,
    block_n: int,
    block_c: int,
    block_h: int,
    blocks_per_split: int,
    passes: int,
):
    c_block, split = pl.program_id(0), pl.program_id(1)
    c0 = c_block * block_c
    c_ids = c0 + jnp.arange(block_c, dtype=jnp.int32)  # [block_c]
    h_ok = jnp.arange(block_h, dtype=jnp.int32) < head_dim  # [block_h]

    def body(t, carry):
        acc, cnt = carry  # [block_c, block_h] float32, [block_c] int32
        n0 = (split * blocks_per_split + t) * block_n
        n_ok = n0 + jnp.arange(block_n, dtype=jnp.int32) < num_tokens  # [block_n]
        labels = plgpu.load(labels_ref.at[pl.ds(n0, block_n)], mask=n_ok, other=-1)  # [block_n]
        row_ok = n_ok & (labels >= 0) & (labels < num_clusters)
        x = plgpu.load(
            keys_ref.at[pl.ds(n0, block_n), pl.ds(0, block_h)],
            mask=n_ok[:, None] & h_ok[None, :],
            other=0,
        )  # [block_n, block_h]
        # Padding rows may hold anything (NaN included): 0 · NaN would poison the matmul.
        x = jnp.where(row_ok[:, None], x, jnp.zeros_like(x))
        hit = labels[:, None] == c_ids[None, :]  # [block_n, block_c]
        terms = bf16_terms(x, passes)
        onehot = hit.astype(terms[0].dtype)  # 0/1: exact in any dtype
        for term in terms:
            acc += plgpu.dot(onehot, term, trans_a=True)  # [block_c, block_h], float32 accumulation
        cnt += jnp.sum(hit.astype(jnp.int32), axis=0)
        return acc, cnt

    acc = jnp.zeros((block_c, block_h), jnp.float32)
    cnt = jnp.zeros((block_c,), jnp.int32)
    acc, cnt = lax.fori_loop(0, blocks_per_split, body, (acc, cnt))

    c_ok = c_ids < num_clusters
    plgpu.store(sums_ref.at[pl.ds(c0, block_c), pl.ds(0, block_h)], acc, mask=c_ok[:, None] & h_ok[None, :])
    plgpu.store(counts_ref.at[pl.ds(c0, block_c)], cnt, mask=c_ok)


def _auto_num_splits(num_problems: int, c_blocks: int, n_blocks: int) -> int:
    """Enough programs to fill a GPU (~512), but at least 8 N-blocks per program."""
    wanted = pl.cdiv(512, num_problems * c_blocks)
    return max(1, min(wanted, n_blocks // 8))


@functools.partial(
    jax.jit,
    static_argnames=("num_clusters", "block_n", "block_c", "num_splits", "passes", "num_warps", "num_stages",
                     "interpret"),
)
def centroid_update(
    keys: jax.Array,  # [..., N, H] float32 / bfloat16 / float16
    labels: jax.Array,  # [..., N] int32; outside [0, num_clusters) (C or -1): ignored
    num_clusters: int,
    *,
    block_n: int = 64,
    block_c: int = 64,
    num_splits: int | None = None,
    passes: int = 3,
    num_warps: int = 8,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Per-cluster key sums [..., C, H] float32 and member counts [..., C] int32, in one kernel launch.

    Equal (up to float32 summation order) to `centroid_update_reference`. `passes` (1..3) is the number of
    bfloat16 terms float32 keys are split into; 3 is exact. `num_splits` splits N across programs
    (None: chosen from the shapes); partial sums are added in XLA in a fixed order.

    The launch defaults (8 warps, 2 stages) compile without register spills for sm80 and sm90 at H <= 128
    (checked offline with `check_lowering --ptx`); they are not tuned on hardware.
    """
    assert keys.ndim >= 2, f"keys must be [..., N, H], got {keys.shape}"
    *lead, N, H = keys.shape
    C = int(num_clusters)
    assert labels.shape == (*lead, N), f"labels {labels.shape} must be [..., N] = {(*lead, N)}"
    assert C >= 1, f"num_clusters must be >= 1, got {C}"
    assert N >= 1 and H >= 1, f"empty keys {keys.shape}"
    assert 1 <= passes <= 3, f"passes must be 1, 2 or 3, got {passes}"
    for name, b in (("block_n", block_n), ("block_c", block_c)):
        assert b >= 16 and b & (b - 1) == 0, f"{name}={b} must be a power of two >= 16"
    if keys.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        keys = keys.astype(jnp.float32)
    labels = labels.astype(jnp.int32)

    # Dot operands need every dimension >= 16 and a power of two.
    block_n = min(block_n, max(16, next_pow2(N)))
    block_c = min(block_c, max(16, next_pow2(C)))
    block_h = max(16, next_pow2(H))
    c_blocks = pl.cdiv(C, block_c)
    n_blocks = pl.cdiv(N, block_n)
    problems = math.prod(lead)
    splits = _auto_num_splits(problems, c_blocks, n_blocks) if num_splits is None else num_splits
    assert splits >= 1, f"num_splits must be >= 1, got {splits}"
    splits = min(splits, n_blocks)
    blocks_per_split = pl.cdiv(n_blocks, splits)
    splits = pl.cdiv(n_blocks, blocks_per_split)  # no empty trailing split

    kernel = functools.partial(
        _centroid_update_kernel,
        num_tokens=N,
        num_clusters=C,
        head_dim=H,
        block_n=block_n,
        block_c=block_c,
        block_h=block_h,
        blocks_per_split=blocks_per_split,
        passes=passes,
    )
    one = pl.pallas_call(
        kernel,
        grid=(c_blocks, splits),
        in_specs=[
            pl.BlockSpec((N,), lambda c, s: (0,)),  # labels
            pl.BlockSpec((N, H), lambda c, s: (0, 0)),  # keys
        ],
        out_specs=[
            pl.BlockSpec((None, C, H), lambda c, s: (s, 0, 0)),  # sums: this split's partial sums
            pl.BlockSpec((None, C), lambda c, s: (s, 0)),  # counts
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, C, H), jnp.float32),
            jax.ShapeDtypeStruct((splits, C), jnp.int32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="centroid_update",
    )
    sums, counts = map_leading(one, len(lead))(labels, keys)  # [..., splits, C, H], [..., splits, C]
    if splits == 1:
        return sums[..., 0, :, :], counts[..., 0, :]
    return jnp.sum(sums, axis=-3), jnp.sum(counts, axis=-2)


def _reference_one(keys: jax.Array, labels: jax.Array, num_clusters: int):
    """One problem: keys [N, H], labels [N] -> sums [C, H] float32, counts [C] int32, by a segment sum (N·H
    additions: on XLA:CPU faster than the one-hot [C, N] x [N, H] matmul (docs/research_log.md); and no TF32 or bfloat16
    passes on any device)."""
    ok = (labels >= 0) & (labels < num_clusters)
    # Padding rows may hold anything (NaN included): they are zeroed, then summed into a discarded segment.
    x = jnp.where(ok[:, None], keys.astype(jnp.float32), 0.0)
    segment = jnp.where(ok, labels, num_clusters)
    sums = jax.ops.segment_sum(x, segment, num_clusters + 1)[:num_clusters]
    counts = jax.ops.segment_sum(ok.astype(jnp.int32), segment, num_clusters + 1)[:num_clusters]
    return sums, counts


@functools.partial(jax.jit, static_argnames=("num_clusters",))
def centroid_update_reference(
    keys: jax.Array,  # [..., N, H]
    labels: jax.Array,  # [..., N] int32; outside [0, num_clusters): ignored
    num_clusters: int,
) -> tuple[jax.Array, jax.Array]:
    """Pure jnp, the same problems as `centroid_update`: sums [..., C, H] float32, counts [..., C] int32."""
    return map_leading(functools.partial(_reference_one, num_clusters=num_clusters), labels.ndim - 1)(keys, labels)
