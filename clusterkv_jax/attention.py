"""Attention in pure JAX: causal prefill, full decode, and decode over a selected subset of tokens.

Scores and softmax are float32 whatever the KV dtype. Shapes: B batch, T tokens, S cache capacity,
N query heads, K KV heads, G = N // K query heads per KV head, H head dim, M selected tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so a fully masked row gives a uniform softmax instead of NaN


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's soft-capping of scores and logits); x itself when cap is None. Monotone: no
    ranking of keys by their scores changes."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def _softmax_weighted_sum(scores: jax.Array, mask: jax.Array, values: jax.Array, spec: str) -> jax.Array:
    scores = jnp.where(mask, scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum(spec, probs.astype(values.dtype), values, preferred_element_type=jnp.float32)


def causal_mask(q_positions: jax.Array, k_positions: jax.Array, window: int | None = None) -> jax.Array:
    """[..., Q, T]: key position <= query position and, with a window W, within the query's last W positions (its
    own included; HF's sliding window: q - k < W)."""
    q, k = q_positions[..., :, None], k_positions[..., None, :]
    mask = k <= q
    return mask if window is None else mask & (q - k < window)


def causal_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None = None,
                               cap: float | None = None) -> jax.Array:
    """q [B, T, N, H], k and v [B, T, K, H] -> causal attention [B, T, N, H] (float32), each query over its last
    `window` positions when given, scores soft-capped by `cap` when given: the whole [T, T] score matrix, masked.
    For tests and short prompts."""
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    scores = softcap(jnp.einsum("BQKGH,BTKH->BKGQT", qg, k, preferred_element_type=jnp.float32) / (H ** 0.5), cap)
    mask = causal_mask(jnp.arange(T), jnp.arange(T), window)  # [Q, T]
    return _softmax_weighted_sum(scores, mask, v, "BKGQT,BTKH->BQKGH").reshape(B, T, N, H)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block: int = 512,
                     window: int | None = None, cap: float | None = None) -> jax.Array:
    """q [B, T, N, H], k and v [B, T, K, H] -> causal attention output [B, T, N, H] (float32), flash style.

    Queries and keys in blocks of `block` (T padded to whole blocks): query block i visits key blocks 0..i only,
    with an online softmax, so the work is the causal half of the [T, T] scores and no more than a
    [B, K, G * block, block] score tile exists at once. Padded keys lie after every real query, so causality
    masks them; the padded queries' outputs are dropped. Right-padded ragged prompts need nothing more.
    With a `window` W, query block i visits only the key blocks holding its last W positions: the work follows
    T·W, not T².
    Equal to `causal_attention_reference` up to float rounding.
    """
    T = q.shape[1]
    if T <= block:
        return causal_attention_reference(q, k, v, window, cap)
    # Head-major keys, so a block of keys is one contiguous slice per head.
    return causal_attention_over_rows(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), jnp.int32(0), block=block,
                                      window=window, cap=cap)


def causal_attention_over_rows(q: jax.Array, k_rows: jax.Array, v_rows: jax.Array, q_start: jax.Array, *,
                               block: int = 512, window: int | None = None, cap: float | None = None) -> jax.Array:
    """Queries q [B, T, N, H] at positions q_start + [0, T) over keys and values k_rows, v_rows [B, K, S, H] at
    positions [0, S) (a layer's store rows: chunked prefill attends to the cache so far), causal ->
    [B, T, N, H] (float32). q_start must be a multiple of `block`; the flash loop of `causal_attention`, whose
    query block i (absolute) visits key blocks 0..i (with a `window`, only those within it)."""
    B, T, N, H = q.shape
    K, S = k_rows.shape[1], k_rows.shape[2]
    G = N // K
    n = -(-T // block)
    scale = 1.0 / (H ** 0.5)
    # A query block's G heads form one [G * block, H] matrix: q [n, B, K, G * block, H].
    q = jnp.pad(q, ((0, 0), (0, n * block - T), (0, 0), (0, 0)))
    qb = q.reshape(B, n, block, K, G, H).transpose(1, 0, 3, 4, 2, 5).reshape(n, B, K, G * block, H)
    # Keys padded to whole blocks (the padding lies after every real query: the caller has q_start + T <= S).
    kh, vh = (jnp.pad(x, ((0, 0), (0, 0), (0, -S % block), (0, 0))) for x in (k_rows, v_rows))
    offsets = jnp.arange(block, dtype=jnp.int32)
    causal = jnp.tile(offsets[:, None] >= offsets[None, :], (G, 1))  # [G * block, block] inside the diagonal
    first = q_start // block

    def query_block(args):
        i, q_i = args  # i: absolute block index; q_i [B, K, G * block, H]
        q_i = q_i.astype(jnp.float32) * scale

        def key_block(j, carry):
            m, l, acc = carry  # [B, K, G * block] running max and sum, [B, K, G * block, H] weighted values
            k_j = jax.lax.dynamic_slice_in_dim(kh, j * block, block, axis=2)  # [B, K, block, H]
            v_j = jax.lax.dynamic_slice_in_dim(vh, j * block, block, axis=2)
            s = softcap(jnp.einsum("BKQH,BKTH->BKQT", q_i.astype(k_j.dtype), k_j, preferred_element_type=jnp.float32),
                        cap)
            if window is None:
                s = jnp.where((j < i) | causal, s, NEG_INF)
            else:
                q_pos = i * block + jnp.tile(offsets, G)  # [G * block]
                s = jnp.where(causal_mask(q_pos, j * block + offsets, window), s, NEG_INF)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            correction = jnp.exp(m - m_new)
            l = l * correction + jnp.sum(p, axis=-1)
            acc = acc * correction[..., None] + jnp.einsum("BKQT,BKTH->BKQH", p.astype(v_j.dtype), v_j,
                                                           preferred_element_type=jnp.float32)
            return m_new, l, acc

        init = (jnp.full((B, K, G * block), NEG_INF, jnp.float32), jnp.zeros((B, K, G * block), jnp.float32),
                jnp.zeros((B, K, G * block, H), jnp.float32))
        lo = 0 if window is None else jnp.maximum(i * block - window + 1, 0) // block
        _, l, acc = jax.lax.fori_loop(lo, i + 1, key_block, init)
        return acc / l[..., None]

    out = jax.lax.map(query_block, (first + jnp.arange(n, dtype=jnp.int32), qb))  # [n, B, K, G * block, H]
    out = out.reshape(n, B, K, G, block, H).transpose(1, 0, 4, 2, 3, 5).reshape(B, n * block, N, H)
    return out[:, :T]


def window_attention(q: jax.Array, q_positions: jax.Array, k: jax.Array, v: jax.Array, k_positions: jax.Array,
                     window: int, cap: float | None = None) -> jax.Array:
    """Queries q [B, T, N, H] at q_positions [B, T] over keys and values k, v [B, K, M, H] at k_positions [B, M]
    (negative: no token), each query over its last `window` positions -> [B, T, N, H] (float32). A chunk of a
    prompt in a windowed layer: the ring's rows and the chunk's own."""
    B, T, N, H = q.shape
    K = k.shape[1]
    qg = q.reshape(B, T, K, N // K, H)
    scores = softcap(jnp.einsum("BQKGH,BKTH->BKGQT", qg, k, preferred_element_type=jnp.float32) / (H ** 0.5), cap)
    mask = causal_mask(q_positions, k_positions, window) & (k_positions >= 0)[:, None, :]  # [B, Q, M]
    return _softmax_weighted_sum(scores, mask[:, None, None], v, "BKGQT,BKTH->BQKGH").reshape(B, T, N, H)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, cap: float | None = None
                     ) -> jax.Array:
    """One query per sequence over its whole cache: q [B, N, H], k and v [B, K, S, H], lengths [B]
    (tokens valid in the cache, the current one included) -> [B, N, H] (float32)."""
    S = k.shape[2]
    return rows_attention(q, k, v, (jnp.arange(S)[None, :] < lengths[:, None])[:, None], cap)


def rows_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, cap: float | None = None) -> jax.Array:
    """One query per head over the rows of its KV head where mask [B, 1 or K, R]: q [B, N, H], k and v
    [B, K, R, H] -> [B, N, H] (float32)."""
    B, N, H = q.shape
    K = k.shape[1]
    # [B, K, G, H]
    qg = q.reshape(B, K, N // K, H)
    # [B, K, G, R]
    scores = softcap(jnp.einsum("BKGH,BKSH->BKGS", qg, k, preferred_element_type=jnp.float32) / (H ** 0.5), cap)
    out = _softmax_weighted_sum(scores, mask[:, :, None, :], v, "BKGS,BKSH->BKGH")
    return out.reshape(B, N, H)


def selection_and_window_attention(
    q: jax.Array,  # [B, N, H]
    k_sel: jax.Array,  # [B, h, M, H] selected rows; h = N (per query head) or K (shared by a KV head's G heads)
    v_sel: jax.Array,  # [B, h, M, H]
    sel_mask: jax.Array,  # [B, h, M]
    k_win: jax.Array | None = None,  # [B, K, W, H] a window of rows every query head of the KV head attends
    v_win: jax.Array | None = None,  # [B, K, W, H]
    win_mask: jax.Array | None = None,  # [B, W]
    cap: float | None = None,  # scores soft-capped (Gemma 2)
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
    # "BKGH,BKGMH" as slower batched matrix-vector products than "BKGMH,BKGH", and a [M, H] x [H, G] product
    # written "->BKGM" slower than "->BKMG" and a transpose of the small result (the same for the output;
    # docs/research_log.md).
    def rows_times_queries(rows, spec):
        if spec == "BKGMH":
            return jnp.einsum("BKGMH,BKGH->BKGM", rows, qg, preferred_element_type=jnp.float32)
        return jnp.swapaxes(jnp.einsum(f"{spec},BKGH->BKMG", rows, qg, preferred_element_type=jnp.float32), -1, -2)

    scores = softcap(jnp.concatenate([rows_times_queries(k_sel, sel_spec), rows_times_queries(k_win, "BKMH")],
                                     axis=-1) / (H ** 0.5), cap)
    mask = jnp.concatenate([sel_mask, jnp.broadcast_to(win_mask[:, None, None, :], (B, K, G, W))], axis=-1)
    probs = jax.nn.softmax(jnp.where(mask, scores, NEG_INF), axis=-1)
    p_sel, p_win = probs[..., :M].astype(v_sel.dtype), probs[..., M:].astype(v_win.dtype)
    # [B, K, G, H]
    out = (jnp.einsum(f"{sel_spec},BKGM->BKGH", v_sel, p_sel, preferred_element_type=jnp.float32)
           + jnp.einsum("BKWH,BKGW->BKGH", v_win, p_win, preferred_element_type=jnp.float32))
    return out.reshape(B, N, H)
