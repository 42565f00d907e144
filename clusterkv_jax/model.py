"""A functional Llama-family decoder: RMSNorm, RoPE (default / linear / llama3), GQA, SwiGLU.

Parameters are a plain pytree (see `param_shapes`); every function here is pure and jit-able. Layers are
stacked on a leading axis and run under `lax.scan`, so compile time does not grow with depth. The KV cache
(`KVCache`) is carried through the scan whole and indexed by layer, so a decode step writes one row per
layer in place instead of copying the cache. Norms, RoPE, softmax and logits are computed in float32.

Shapes: B batch, T tokens, S cache capacity, D hidden, N query heads, K KV heads, G = N // K, H head dim,
F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from clusterkv_jax import attention, offload
from clusterkv_jax.cache import KVCache, row_index, scatter_rows
from clusterkv_jax.config import ModelConfig

Params = dict[str, Any]

# Queries per block in prefill attention: bounds the [B, N, block, T] score tensor for long prompts.
PREFILL_QUERY_BLOCK = 512


def param_shapes(config: ModelConfig) -> Params:
    """The parameter pytree as shape tuples: the contract between converters, checkpoints and the model."""
    c = config
    L, D, N, K, H, F = c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    layers = {
        "attn_norm": (L, D),
        "q": (L, D, N, H),
        "k": (L, D, K, H),
        "v": (L, D, K, H),
        "o": (L, N, H, D),
        "mlp_norm": (L, D),
        "gate": (L, D, F),
        "up": (L, D, F),
        "down": (L, F, D),
    }
    if c.qkv_bias:
        layers.update(q_bias=(L, N, H), k_bias=(L, K, H), v_bias=(L, K, H))
    if c.o_bias:
        layers["o_bias"] = (L, D)
    shapes: Params = {"embed": (c.vocab_size, D), "layers": layers, "final_norm": (D,)}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (D, c.vocab_size)
    return shapes


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random parameters (normal, std 0.02; norms at 1) for tests and synthetic benchmarks."""
    shapes = param_shapes(config)
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
    keys = jax.random.split(key, len(leaves))
    out = []
    for path, shape, k in zip(paths, leaves, keys):
        if "norm" in path:
            out.append(jnp.ones(shape, dtype))
        else:
            out.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


# ----------------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as HF computes it: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> jax.Array:
    """Inverse RoPE frequencies [H/2], with `linear` or Llama-3.1 `llama3` scaling applied."""
    H = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    s = config.rope_scaling
    if s.rope_type == "linear":
        return inv_freq / s.factor
    if s.rope_type == "llama3":
        old_len = s.original_max_position_embeddings
        low_freq_wavelen = old_len / s.low_freq_factor
        high_freq_wavelen = old_len / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
        scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return jnp.where(is_medium, smoothed, scaled)
    return inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates x [..., T, heads, H] by positions [..., T] (HF's rotate-half layout)."""
    # [..., T, H/2]
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def _project_qkv(layer: Params, x: jax.Array, positions: jax.Array, inv_freq: jax.Array):
    """x [B, T, D] -> post-RoPE q [B, T, N, H], k [B, T, K, H] and v [B, T, K, H]."""
    q = jnp.einsum("BTD,DNH->BTNH", x, layer["q"])
    k = jnp.einsum("BTD,DKH->BTKH", x, layer["k"])
    v = jnp.einsum("BTD,DKH->BTKH", x, layer["v"])
    if "q_bias" in layer:
        q, k, v = q + layer["q_bias"], k + layer["k_bias"], v + layer["v_bias"]
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def _output_and_mlp(layer: Params, config: ModelConfig, x: jax.Array, attn: jax.Array) -> jax.Array:
    """Residual add of the attention output attn [B, T, N, H], then the SwiGLU MLP block."""
    out = jnp.einsum("BTNH,NHD->BTD", attn.astype(x.dtype), layer["o"])
    if "o_bias" in layer:
        out = out + layer["o_bias"]
    x = x + out
    h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
    gate = jnp.einsum("BTD,DF->BTF", h, layer["gate"])
    up = jnp.einsum("BTD,DF->BTF", h, layer["up"])
    return x + jnp.einsum("BTF,FD->BTD", jax.nn.silu(gate) * up, layer["down"])


def _logits(params: Params, config: ModelConfig, x: jax.Array) -> jax.Array:
    """Final norm and LM head: x [..., D] -> float32 logits [..., V]."""
    x = rms_norm(x, params["final_norm"], config.rms_norm_eps)
    if config.tie_word_embeddings:
        return jnp.einsum("...D,VD->...V", x, params["embed"], preferred_element_type=jnp.float32)
    return jnp.einsum("...D,DV->...V", x, params["lm_head"], preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------------------
# Prefill and decode
# ----------------------------------------------------------------------------------------------------------


def forward_prefill(
    params: Params,
    config: ModelConfig,
    policy,
    tokens: jax.Array,  # [B, T] right-padded prompt tokens
    lengths: jax.Array,  # [B] true prompt lengths
    cache: KVCache,
    *,
    all_logits: bool = False,
) -> tuple[jax.Array, KVCache]:
    """Runs the prompts from an empty cache. Returns logits [B, V] at each last prompt token (or [B, T, V]
    at every position when `all_logits`) and the cache holding the prompt KV and the policy's state."""
    B, T = tokens.shape
    S = cache.capacity
    assert T <= S, f"prompt bucket {T} exceeds cache capacity {S}"
    inv_freq = rope_inv_freq(config)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x = params["embed"][tokens]
    layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)
    compressed = policy.full_layers < config.num_layers

    offloaded = cache.offloaded
    device_layers = config.num_layers - (cache.host_k.shape[0] if offloaded else 0)

    def layer_fn(carry, xs):
        x, k_all, v_all, host_k, host_v = carry
        layer, layer_id, state = xs
        h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
        q, k, v = _project_qkv(layer, h, positions, inv_freq)
        attn = attention.causal_attention(q, k, v, query_block=PREFILL_QUERY_BLOCK)
        # Store the keys and values as [B, K, T, H] rows 0..T of this layer.
        k_bkth = jnp.swapaxes(k, 1, 2).astype(k_all.dtype)
        v_bkth = jnp.swapaxes(v, 1, 2).astype(v_all.dtype)

        def device_write(kv):
            k_all, v_all, host_k, host_v = kv
            k_all = jax.lax.dynamic_update_slice(k_all, k_bkth[None], (layer_id, 0, 0, 0, 0))
            v_all = jax.lax.dynamic_update_slice(v_all, v_bkth[None], (layer_id, 0, 0, 0, 0))
            return k_all, v_all, host_k, host_v

        def host_write(kv):
            k_all, v_all, host_k, host_v = kv
            host_k, host_v = offload.write_prefill(host_k, host_v, layer_id - device_layers, k_bkth, v_bkth)
            return k_all, v_all, host_k, host_v

        kv = (k_all, v_all, host_k, host_v)
        if offloaded:
            k_all, v_all, host_k, host_v = jax.lax.cond(layer_id >= device_layers, host_write, device_write, kv)
            # The policy indexes this layer's prompt keys from a transient device copy padded to capacity.
            k_layer = jnp.pad(k_bkth, ((0, 0), (0, 0), (0, S - T), (0, 0)))
        else:
            k_all, v_all, host_k, host_v = device_write(kv)
            # [B, K, S, H] this layer's whole store, rows >= lengths are padding.
            k_layer = jax.lax.dynamic_index_in_dim(k_all, layer_id, keepdims=False)
        if compressed:
            state = jax.lax.cond(
                layer_id >= policy.full_layers,
                lambda s: policy.after_prefill(s, k_layer, lengths),
                lambda s: s,
                state,
            )
        return (_output_and_mlp(layer, config, x, attn), k_all, v_all, host_k, host_v), state

    (x, k_all, v_all, host_k, host_v), state = jax.lax.scan(
        layer_fn, (x, cache.k, cache.v, cache.host_k, cache.host_v),
        (params["layers"], layer_ids, cache.policy_state)
    )
    if all_logits:
        logits = _logits(params, config, x)
    else:
        last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
        logits = _logits(params, config, last)
    new_cache = cache.replace(k=k_all, v=v_all, lengths=lengths.astype(jnp.int32),
                              prompt_lengths=lengths.astype(jnp.int32), policy_state=state,
                              host_k=host_k, host_v=host_v)
    return logits, new_cache


def forward_decode(
    params: Params,
    config: ModelConfig,
    policy,
    tokens: jax.Array,  # [B] one new token per sequence
    cache: KVCache,
) -> tuple[jax.Array, KVCache]:
    """Appends one token per sequence at position `cache.lengths` and returns its logits [B, V]."""
    B = tokens.shape[0]
    inv_freq = rope_inv_freq(config)
    positions = cache.lengths[:, None]  # [B, 1]
    new_lengths = cache.lengths + 1
    x = params["embed"][tokens][:, None]  # [B, 1, D]
    layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)
    compressed = policy.full_layers < config.num_layers

    offloaded = cache.offloaded
    device_layers = config.num_layers - (cache.host_k.shape[0] if offloaded else 0)

    def layer_fn(carry, xs):
        x, k_all, v_all, host_k, host_v = carry
        layer, layer_id, state, ost = xs
        h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
        q, k, v = _project_qkv(layer, h, positions, inv_freq)
        q1, k1, v1 = q[:, 0], k[:, 0], v[:, 0]  # [B, N, H], [B, K, H], [B, K, H]

        def on_device(args):
            k_all, v_all, host_k, host_v, state, ost = args
            # Write this token's K/V at each sequence's own position: [B, K, H] rows into [L, B, K, S, H]
            # (B and K as scatter batching dims, so a sharded cache is written shard by shard).
            rows = row_index(jnp.broadcast_to(cache.lengths[:, None, None], k1.shape[:2] + (1,)), layer_id)
            k_all = scatter_rows(k_all, rows, k1[:, :, None])
            v_all = scatter_rows(v_all, rows, v1[:, :, None])
            k_layer = jax.lax.dynamic_index_in_dim(k_all, layer_id, keepdims=False)  # [B, K, S, H]
            v_layer = jax.lax.dynamic_index_in_dim(v_all, layer_id, keepdims=False)
            if compressed and not offloaded:
                attn, state = jax.lax.cond(
                    layer_id >= policy.full_layers,
                    lambda s: policy.decode_attention(s, q1, k_layer, v_layer, new_lengths, cache.prompt_lengths),
                    lambda s: (attention.decode_attention(q1, k_layer, v_layer, new_lengths), s),
                    state,
                )
            else:
                attn = attention.decode_attention(q1, k_layer, v_layer, new_lengths)
            return attn, (k_all, v_all, host_k, host_v, state, ost)

        def on_host(args):
            k_all, v_all, host_k, host_v, state, ost = args
            host_layer = layer_id - device_layers
            attn, state, ost, host_k, host_v = offload.decode_layer(
                policy, state, ost, q1, k1, v1, host_k, host_v, host_layer, cache.lengths, new_lengths,
                cache.prompt_lengths)
            return attn, (k_all, v_all, host_k, host_v, state, ost)

        args = (k_all, v_all, host_k, host_v, state, ost)
        if offloaded:
            attn, args = jax.lax.cond(layer_id >= device_layers, on_host, on_device, args)
        else:
            attn, args = on_device(args)
        k_all, v_all, host_k, host_v, state, ost = args
        return (_output_and_mlp(layer, config, x, attn[:, None]), k_all, v_all, host_k, host_v), (state, ost)

    (x, k_all, v_all, host_k, host_v), (state, ost) = jax.lax.scan(
        layer_fn, (x, cache.k, cache.v, cache.host_k, cache.host_v),
        (params["layers"], layer_ids, cache.policy_state, cache.offload_state)
    )
    logits = _logits(params, config, x[:, 0])
    new_cache = cache.replace(k=k_all, v=v_all, lengths=new_lengths, policy_state=state, host_k=host_k,
                              host_v=host_v, offload_state=ost)
    return logits, new_cache
