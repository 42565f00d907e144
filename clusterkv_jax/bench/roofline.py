"""The roofline of a decode step: the bytes it must read, over the bandwidth measured on this device."""

from __future__ import annotations

import jax

from clusterkv_jax.cache import FULL, SELECTING, WINDOWED, layer_kinds
from clusterkv_jax.config import ModelConfig


def step_bytes(config: ModelConfig, params, policy, context: int, batch: int, recent: int,
               kv_itemsize: int) -> dict[str, int]:
    """Bytes one decode step must read at `context` tokens: the weights (the embedding table only at the batch's
    tokens unless it is also the LM head), the KV it attends (whole layers for full layers; for a selecting layer
    the policy's selection per selection head, plus `recent` unindexed tokens per KV head), and the policy's
    index (`metadata_bytes`: centroids, page bounds). A windowed layer reads its window."""
    c = config
    embed = params["embed"]
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    weights = param_bytes - (0 if c.tie_word_embeddings else embed.nbytes - batch * embed[0].nbytes)
    row = 2 * c.head_dim * kv_itemsize  # one token's K and V in one head
    kinds = [k.attention for k in layer_kinds(c, policy, context)]
    full_layers, selecting = kinds.count(FULL), kinds.count(SELECTING)
    rows = full_layers * context + kinds.count(WINDOWED) * min(c.sliding_window or 0, context)
    kv = rows * batch * c.num_kv_heads * row
    meta = 0
    if selecting:
        _, heads, chunks, chunk = policy.selection_shape(c, batch, context)
        # Each selection head reads its selection (whole chunks); the window is read once per KV head (shared by
        # its query heads).
        kv += selecting * batch * (heads * min(chunks * chunk, context) + c.num_kv_heads * recent) * row
        meta = selecting * batch * policy.metadata_bytes(c, context)
    return {"weights": int(weights), "kv": int(kv), "metadata": int(meta), "total": int(weights + kv + meta)}
