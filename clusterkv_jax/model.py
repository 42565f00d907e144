"""A functional Llama-family decoder: RMSNorm, RoPE (default / linear / llama3), GQA, SwiGLU.

Parameters are a plain pytree (see `param_shapes`); every function here is pure and jit-able. Layers are
stacked on a leading axis and run under `lax.scan`, so compile time does not grow with depth: one scan per
group of the cache (`clusterkv_jax.cache`: the full layers, then the selecting layers, each group with its
store on the device or in host memory), all over the same layer body. A group's store is carried through its
scan whole and indexed by layer, so a decode step writes one row per layer in place instead of copying the
cache. Norms, RoPE, softmax and logits are computed in float32.

Shapes: B batch, T tokens, S cache capacity, D hidden, N query heads, K KV heads, G = N // K, H head dim,
F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from clusterkv_jax import attention
from clusterkv_jax.cache import KVCache, LayerGroup, observe_prompt_queries, write_prompt_layer
from clusterkv_jax.config import ModelConfig

Params = dict[str, Any]

# Queries per block in prefill attention: bounds the [B, N, block, T] score tensor for long prompts.
PREFILL_BLOCK = 512


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
# Prefill and decode: one layer body, one scan per layer group
# ----------------------------------------------------------------------------------------------------------


def _layer(layer: Params, config: ModelConfig, x: jax.Array, positions: jax.Array, inv_freq: jax.Array, attend):
    """One decoder layer. attend(q [B, T, N, H], k, v [B, T, K, H]) -> (attention output [B, T, N, H], extra)
    stores the new K/V and attends (prefill or decode); returns (x after attention and MLP, extra)."""
    h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
    q, k, v = _project_qkv(layer, h, positions, inv_freq)
    attn, extra = attend(q, k, v)
    return _output_and_mlp(layer, config, x, attn), extra


def _scan_groups(params: Params, groups: tuple[LayerGroup, ...], x: jax.Array, step):
    """Runs the layers group by group (one `lax.scan` each). step(group, layer params, i, x, store, state) ->
    (x, store, state, changed) for layer i of the group, changed a traced bool saying whether the layer's state
    changed (None: assume it did). Returns x and the groups with their new stores and states.

    A group's stacked states ride in the scan's carry, like its store, and a layer's state is written back only
    when it changed (on the CPU, under a `lax.cond`): most decode steps change no policy state (ClusterKV's
    changes once every `decode_interval` steps), and writing every layer's state back each step, as the scan's
    outputs did, took ~0.9 ms of a traced ~46 ms SmolLM2 step at 4k on the CPU (RESULTS.md). Elsewhere the write
    always runs: a conditional that returns the carry may make XLA:GPU copy it whole (see
    `LayerView.commit_window`)."""
    out = []
    for group in groups:
        def body(carry, i, group=group):
            x, store, states = carry
            def at(tree, index):
                return jax.tree.map(lambda p: jax.lax.dynamic_index_in_dim(p, index, keepdims=False), tree)

            # Indexed inside the body (not scanned over a slice), so no group copies the weights.
            x, store, state, changed = step(group, at(params["layers"], group.start + i), i, x, store, at(states, i))

            def write(states):
                return jax.tree.map(lambda s, new: jax.lax.dynamic_update_index_in_dim(s, new, i, 0), states, state)

            if changed is None:
                states = write(states)
            else:
                states = jax.lax.platform_dependent(
                    states, cpu=lambda s: jax.lax.cond(changed, write, lambda s: s, s), default=write)
            return (x, store, states), None

        (x, store, state), _ = jax.lax.scan(body, (x, group.store, group.state),
                                            jnp.arange(group.num_layers, dtype=jnp.int32))
        out.append(group.replace(store=store, state=state))
    return x, tuple(out)


def forward_prefill(
    params: Params,
    config: ModelConfig,
    policy,
    tokens: jax.Array,  # [B, T] right-padded prompt tokens
    lengths: jax.Array,  # [B] true prompt lengths
    cache: KVCache,
    *,
    all_logits: bool = False,
    chunk: int | None = None,
) -> tuple[jax.Array, KVCache]:
    """Runs the prompts from an empty cache. Returns logits [B, V] at each last prompt token (or [B, T, V]
    at every position when `all_logits`) and the cache holding the prompt KV and the policy's state.

    With `chunk` (a multiple of PREFILL_BLOCK dividing T), the prompt runs `chunk` tokens at a time (`lax.scan`),
    each chunk attending to the cache so far, so activations are bounded by the chunk, not the prompt (see
    `_prefill_chunks`); the logits and the cache equal the unchunked ones up to float rounding."""
    B, T = tokens.shape
    S = cache.capacity
    assert T <= S, f"prompt bucket {T} exceeds cache capacity {S}"
    if chunk is not None and chunk < T:
        x, groups = _prefill_chunks(params, config, policy, tokens, lengths, cache, chunk)
    else:
        inv_freq = rope_inv_freq(config)
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

        def step(group, layer, i, x, store, state):
            def attend(q, k, v):
                # [B, K, T, H] rows 0..T of this layer, in the store's dtype.
                k_rows = jnp.swapaxes(k, 1, 2).astype(store.k.dtype)
                v_rows = jnp.swapaxes(v, 1, 2).astype(store.v.dtype)
                observed = observe_prompt_queries(policy, group, state, q, 0, lengths)
                stored = write_prompt_layer(policy, group, store, observed, i, k_rows, v_rows, lengths, S)
                return attention.causal_attention(q, k, v, block=PREFILL_BLOCK), stored

            x, (store, state) = _layer(layer, config, x, positions, inv_freq, attend)
            return x, store, state, None

        x, groups = _scan_groups(params, cache.groups, params["embed"][tokens], step)
    if all_logits:
        logits = _logits(params, config, x)
    else:
        last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
        logits = _logits(params, config, last)
    lengths = lengths.astype(jnp.int32)
    return logits, cache.replace(groups=groups, lengths=lengths, prompt_lengths=lengths)


def _prefill_chunks(params, config, policy, tokens, lengths, cache: KVCache, chunk: int):
    """Chunked prefill: every chunk writes its K/V to rows [start, start + chunk) of each layer's store (position
    order, in the cache's dtype) and attends to rows [0, T) causally (later rows are masked or still empty);
    then the selecting layers are indexed and laid out from their stored prompt rows, as an unchunked prefill
    does. Returns the last hidden states [B, T, D] and the groups."""
    B, T = tokens.shape
    if chunk % PREFILL_BLOCK or T % chunk:
        raise ValueError(f"prefill chunk {chunk} must be a multiple of {PREFILL_BLOCK} that divides the prompt "
                         f"bucket {T}")
    inv_freq = rope_inv_freq(config)

    def run_chunk(groups, c):
        start = c * chunk
        positions = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (B, chunk))

        def step(group, layer, i, x, store, state):
            def attend(q, k, v):
                written = store.write_prompt(i, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), start=start)
                view = written.layer(i)
                out = attention.causal_attention_over_rows(q, view.keys()[:, :, :T], view.values()[:, :, :T],
                                                           start, block=PREFILL_BLOCK)
                return out, (written, observe_prompt_queries(policy, group, state, q, start, lengths))

            x, (store, state) = _layer(layer, config, x, positions, inv_freq, attend)
            return x, store, state, None

        x = params["embed"][jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)]
        x, groups = _scan_groups(params, groups, x, step)
        return groups, x

    groups, xs = jax.lax.scan(run_chunk, cache.groups, jnp.arange(T // chunk, dtype=jnp.int32))
    x = jnp.moveaxis(xs, 0, 1).reshape(B, T, -1)  # [n, B, chunk, D] -> [B, T, D]

    def index(group):  # the selecting layers: what write_prompt_layer does after a layer's K/V
        def body(store, xs):
            i, state = xs
            view = store.layer(i)
            return write_prompt_layer(policy, group, store, state, i, view.keys()[:, :, :T],
                                      view.values()[:, :, :T], lengths, cache.capacity)

        store, state = jax.lax.scan(body, group.store, (jnp.arange(group.num_layers, dtype=jnp.int32), group.state))
        return group.replace(store=store, state=state)

    return x, tuple(index(g) if g.selecting else g for g in groups)


def forward_decode(
    params: Params,
    config: ModelConfig,
    policy,
    tokens: jax.Array,  # [B] one new token per sequence
    cache: KVCache,
) -> tuple[jax.Array, KVCache]:
    """Appends one token per sequence at position `cache.lengths` and returns its logits [B, V]."""
    inv_freq = rope_inv_freq(config)
    positions = cache.lengths[:, None]  # [B, 1]
    new_lengths = cache.lengths + 1
    S = cache.capacity

    def step(group, layer, i, x, store, state):
        def attend(q, k, v):
            q1 = q[:, 0]  # [B, N, H]
            # This token's K/V [B, K, H] at each sequence's own position (at the row the policy keeps it in).
            rows = policy.token_rows(state, cache.lengths, S) if group.selecting else cache.lengths
            kv = store.write_token(i, rows, k[:, 0], v[:, 0]).layer(i, S)
            if group.selecting:
                out, new_state, kv = policy.decode_attention(state, q1, kv, new_lengths, cache.prompt_lengths)
                changed = policy.decode_changed_state(state, new_state)
            else:
                with jax.named_scope("attend"):
                    out = attention.decode_attention(q1, kv.keys(), kv.values(), new_lengths)
                new_state, changed = state, jnp.bool_(False)
            return out[:, None], (kv.store, new_state, changed)

        x, (store, state, changed) = _layer(layer, config, x, positions, inv_freq, attend)
        return x, store, state, changed

    x, groups = _scan_groups(params, cache.groups, params["embed"][tokens][:, None], step)
    logits = _logits(params, config, x[:, 0])
    return logits, cache.replace(groups=groups, lengths=new_lengths)
