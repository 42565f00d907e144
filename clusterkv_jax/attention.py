"""Attention in pure JAX: causal prefill, full decode, and decode over a selected subset of tokens.

Scores and softmax are float32 whatever the KV dtype. Shapes: B batch, T tokens, S cache capacity,
N query heads, K KV heads, G = N // K query heads per KV head, H head dim, M selected tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so a fully masked row gives a uniform softmax instead of NaN


def _softmax_weighted_sum(scores: jax.Array, mask: jax.Array, values: jax.Array, spec: str) -> jax.Array:
    scores = jnp.where(mask, scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum(spec, probs.astype(values.dtype), values, preferred_element_type=jnp.float32)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, query_block: int = 512) -> jax.Array:
    """q [B, T, N, H], k and v [B, T, K, H] -> causal attention output [B, T, N, H] (float32).

    Long prompts are processed `query_block` queries at a time so the score tensor stays [B, K, G, block, T].
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    scale = 1.0 / (H ** 0.5)
    # [B, T, K, G, H]
    qg = q.reshape(B, T, K, G, H)
    key_pos = jnp.arange(T)

    def block(q_blk: jax.Array, start: jax.Array) -> jax.Array:
        # q_blk [B, Q, K, G, H] -> scores [B, K, G, Q, T]
        scores = jnp.einsum("BQKGH,BTKH->BKGQT", q_blk, k, preferred_element_type=jnp.float32) * scale
        query_pos = start + jnp.arange(q_blk.shape[1])
        mask = key_pos[None, :] <= query_pos[:, None]  # [Q, T]
        return _softmax_weighted_sum(scores, mask, v, "BKGQT,BTKH->BQKGH")

    if T <= query_block:
        out = block(qg, jnp.int32(0))
    else:
        # Pad the queries to whole blocks (the padded queries' outputs are dropped), so any T keeps the
        # score tensor at [B, K, G, block, T].
        n_blocks = -(-T // query_block)
        qg = jnp.pad(qg, ((0, 0), (0, n_blocks * query_block - T), (0, 0), (0, 0), (0, 0)))
        # [n_blocks, B, Q, K, G, H]
        q_blocks = jnp.moveaxis(qg.reshape(B, n_blocks, query_block, K, G, H), 1, 0)
        starts = jnp.arange(n_blocks, dtype=jnp.int32) * query_block
        out = jax.lax.map(lambda args: block(*args), (q_blocks, starts))
        out = jnp.moveaxis(out, 0, 1).reshape(B, n_blocks * query_block, K, G, H)[:, :T]
    return out.reshape(B, T, N, H)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
    """One query per sequence over its whole cache: q [B, N, H], k and v [B, K, S, H], lengths [B]
    (tokens valid in the cache, the current one included) -> [B, N, H] (float32)."""
    B, N, H = q.shape
    K, S = k.shape[1], k.shape[2]
    # [B, K, G, H]
    qg = q.reshape(B, K, N // K, H)
    # [B, K, G, S]
    scores = jnp.einsum("BKGH,BKSH->BKGS", qg, k, preferred_element_type=jnp.float32) / (H ** 0.5)
    mask = (jnp.arange(S)[None, :] < lengths[:, None])[:, None, None, :]
    out = _softmax_weighted_sum(scores, mask, v, "BKGS,BKSH->BKGH")
    return out.reshape(B, N, H)


def selection_and_window_attention(
    q: jax.Array,  # [B, N, H]
    k_sel: jax.Array,  # [B, h, M, H] selected rows; h = N (per query head) or K (shared by a KV head's G heads)
    v_sel: jax.Array,  # [B, h, M, H]
    sel_mask: jax.Array,  # [B, h, M]
    k_win: jax.Array | None = None,  # [B, K, W, H] a window of rows every query head of the KV head attends
    v_win: jax.Array | None = None,  # [B, K, W, H]
    win_mask: jax.Array | None = None,  # [B, W]
) -> jax.Array:
    """One query per head over its selected rows and its KV head's window (if any), one softmax over both ->
    [B, N, H] (float32). Rows shared by the G query heads of a KV head are read once, not copied per query head."""
    B, N, H = q.shape
    M = k_sel.shape[2]
    per_query_head = k_sel.shape[1] == N
    if k_win is None:
        K = k_sel.shape[1] if not per_query_head else N  # no window: any grouping of the heads works
        k_win = v_win = jnp.zeros((B, K, 0, H), k_sel.dtype)
        win_mask = jnp.zeros((B, 0), bool)
    K, W = k_win.shape[1], k_win.shape[2]
    G = N // K
    qg = q.reshape(B, K, G, H)
    if per_query_head:
        k_sel, v_sel = k_sel.reshape(B, K, G, M, H), v_sel.reshape(B, K, G, M, H)
        sel_spec, sel_mask = "BKGMH", sel_mask.reshape(B, K, G, M)
    else:
        sel_spec, sel_mask = "BKMH", jnp.broadcast_to(sel_mask[:, :, None, :], (B, K, G, M))
    # [B, K, G, M + W]. The rows are the left operand and the row axis comes first in the product: XLA:CPU runs
    # "BKGH,BKGMH" as 3x slower batched matrix-vector products than "BKGMH,BKGH", and a [M, H] x [H, G] product
    # written "->BKGM" ~1.6x slower than "->BKMG" and a transpose of the small result (the same for the output).
    def rows_times_queries(rows, spec):
        if spec == "BKGMH":
            return jnp.einsum("BKGMH,BKGH->BKGM", rows, qg, preferred_element_type=jnp.float32)
        return jnp.swapaxes(jnp.einsum(f"{spec},BKGH->BKMG", rows, qg, preferred_element_type=jnp.float32), -1, -2)

    scores = jnp.concatenate([rows_times_queries(k_sel, sel_spec), rows_times_queries(k_win, "BKMH")],
                             axis=-1) / (H ** 0.5)
    mask = jnp.concatenate([sel_mask, jnp.broadcast_to(win_mask[:, None, None, :], (B, K, G, W))], axis=-1)
    probs = jax.nn.softmax(jnp.where(mask, scores, NEG_INF), axis=-1)
    p_sel, p_win = probs[..., :M].astype(v_sel.dtype), probs[..., M:].astype(v_win.dtype)
    # [B, K, G, H]
    out = (jnp.einsum(f"{sel_spec},BKGM->BKGH", v_sel, p_sel, preferred_element_type=jnp.float32)
           + jnp.einsum("BKWH,BKGW->BKGH", v_win, p_win, preferred_element_type=jnp.float32))
    return out.reshape(B, N, H)
