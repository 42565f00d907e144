"""Full decode attention split over the sequence (flash-decoding), through JAX's own Pallas GPU kernel
(`jax.experimental.pallas.ops.gpu.decode_attention.mqa`), mapped over the (sequence, KV head) pairs.

One query per query head over the first `length` rows of its KV head: q [B, K, G, H] (each KV head's G query
heads), k and v [B, K, S, H] (a layer's store rows), lengths [B, K] -> [B, K, G, H] float32. Each pair's rows are
split into up to `MAX_SPLITS` parts read in parallel, each an online softmax over blocks of rows, and the parts'
partial outputs are combined; a part wholly past the sequence's length is skipped, so a step reads the rows it
attends to, not the cache's capacity. Scores and softmax in float32; the parts' partial outputs in q's dtype (the
kernel's). XLA's form, `decode_attention_reference`, writes the [G, S] scores out and reads them back for the
softmax, in several kernels at a long context (docs/research_log.md). No soft-capped scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: The parts a (sequence, KV head) pair's rows are split into, at most: with 8 KV heads at batch 1, 128 programs,
#: about one per streaming multiprocessor of an H100 (132).
MAX_SPLITS = 16
#: Rows a program reads at once, largest first: the first that divides the rows.
BLOCK_ROWS = (128, 64, 32, 16)


def split_for(rows: int) -> tuple[int, int] | None:
    """(rows per block, parts) for a cache of `rows` rows: the largest of `BLOCK_ROWS` dividing it, and the most
    parts, at most `MAX_SPLITS`, that each hold whole blocks; None where no block size divides it (the kernel
    needs whole blocks)."""
    block = next((b for b in BLOCK_ROWS if rows % b == 0), None)
    if block is None:
        return None
    blocks = rows // block
    return block, max(d for d in range(1, MAX_SPLITS + 1) if blocks % d == 0)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *, interpret: bool = False
                     ) -> jax.Array:
    """The kernel (see the module's docstring). S must be a multiple of 16 (`split_for`)."""
    from jax.experimental.pallas.ops.gpu import decode_attention as jax_decode_attention

    B, K, G, H = q.shape
    split = split_for(k.shape[2])
    if split is None:
        raise ValueError(f"decode attention needs a multiple of {BLOCK_ROWS[-1]} cache rows, got {k.shape[2]}")
    block, parts = split
    pairs = lambda x: x.reshape(B * K, *x.shape[2:])  # noqa: E731
    out = jax_decode_attention.mqa(pairs(q).astype(k.dtype), pairs(k), pairs(v), kv_seq_len=pairs(lengths),
                                   block_k=block, k_splits=parts, interpret=interpret)
    return out.reshape(B, K, G, H).astype(jnp.float32)


def decode_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
    """Pure jnp, the same problem: every row's score, those past the length masked, one softmax."""
    S, H = k.shape[2], k.shape[3]
    scores = jnp.einsum("BKGH,BKSH->BKGS", q.astype(k.dtype), k, preferred_element_type=jnp.float32) / H ** 0.5
    scores = jnp.where(jnp.arange(S) < lengths[:, :, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("BKGS,BKSH->BKGH", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
