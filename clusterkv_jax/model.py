"""A functional decoder for the families it reads (Llama, Mistral, Qwen2, Qwen3, GLM, GLM-4, Phi-3, Gemma 2,
Gemma 3): RMSNorm, RoPE (default / linear / llama3 / yarn / longrope / dynamic; whole or partial, halves or
interleaved pairs), GQA, a gated MLP; what a family changes is a field of `ModelConfig` (`config.FAMILIES`): q/k/v
and output biases, per-head q/k norms, norms after the attention and the MLP, Gemma's (1 + w) norms, scaled
embeddings, GeGLU, score scale and soft-capping, and a RoPE base of its own for sliding layers.

Parameters are a plain pytree (see `param_shapes`), each layer parameter stacked on a leading [L] axis; every
function here is pure and jit-able. On a GPU the layers run in a plain Python loop over per-layer arrays, each
layer's q/k/v and gate/up weights fused into one array each (`for_device`), so XLA reads each weight once a step;
elsewhere a `lax.scan` runs them over the stacks (on a TPU q/k/v stored with the model dim last, which it reads
in place). How a layer stores its K/V and attends (to every token, to its window, or to what a KV policy selects)
is `clusterkv_jax.attend`'s: the model hands each layer's q, k, v to the step it runs (`attend.Prefill`,
`attend.PrefillChunk`, `attend.Decode`) and knows nothing of the policy. A layer's K/V live in its group's store
(`clusterkv_jax.cache`), written in place one row per layer. Norms, RoPE, softmax and logits are computed in
float32.

Shapes: B batch, T tokens, S cache capacity, D hidden, N query heads, K KV heads, G = N // K, H head dim,
F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from clusterkv_jax import attend as attend_module
from clusterkv_jax import kernels
from clusterkv_jax import rope
from clusterkv_jax.attention import softcap
from clusterkv_jax.attend import PREFILL_BLOCK
from clusterkv_jax.cache import KVCache, LayerGroup
from clusterkv_jax.config import SLIDING_ATTENTION, ModelConfig

Params = dict[str, Any]


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
    if c.qk_norm:
        layers.update(q_norm=(L, H), k_norm=(L, H))
    if c.post_norms:
        layers.update(post_attn_norm=(L, D), post_mlp_norm=(L, D))
    shapes: Params = {"embed": (c.vocab_size, D), "layers": layers, "final_norm": (D,)}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (D, c.vocab_size)
    return shapes


#: The logical name of each dim of each layer parameter (`param_shapes`' [L, ...] layouts). `clusterkv_jax.sharding`
#: splits "heads" / "kv_heads" and "mlp" over the mesh; checkpoints store the head dims in chunks of one head.
LAYER_PARAM_AXES = {
    "attn_norm": ("layers", "embed"), "mlp_norm": ("layers", "embed"),
    "q": ("layers", "embed", "heads", "head_dim"), "k": ("layers", "embed", "kv_heads", "head_dim"),
    "v": ("layers", "embed", "kv_heads", "head_dim"), "o": ("layers", "heads", "head_dim", "embed"),
    "gate": ("layers", "embed", "mlp"), "up": ("layers", "embed", "mlp"), "down": ("layers", "mlp", "embed"),
    "q_bias": ("layers", "heads", "head_dim"), "k_bias": ("layers", "kv_heads", "head_dim"),
    "v_bias": ("layers", "kv_heads", "head_dim"), "o_bias": ("layers", "embed"),
    "q_norm": ("layers", "head_dim"), "k_norm": ("layers", "head_dim"),
    "post_attn_norm": ("layers", "embed"), "post_mlp_norm": ("layers", "embed"),
    # The fused layout (`fuse_layer`).
    "qkv": ("layers", "embed", "kv_heads", "qkv", "head_dim"), "qkv_bias": ("layers", "kv_heads", "qkv", "head_dim"),
    "gate_up": ("layers", "embed", "gate_up", "mlp"),
    # The model dim last (`move_model_dim_last`).
    "q_t": ("layers", "heads", "head_dim", "embed"), "k_t": ("layers", "kv_heads", "head_dim", "embed"),
    "v_t": ("layers", "kv_heads", "head_dim", "embed"),
}
#: What `fuse_layer` makes of which layer parameters.
FUSED = {"qkv": ("q", "k", "v"), "qkv_bias": ("q_bias", "k_bias", "v_bias"), "gate_up": ("gate", "up")}
#: What `move_model_dim_last` makes of which: q, k and v transposed ("_t"), [..., heads, H, D].
MODEL_DIM_LAST = {"q_t": ("q",), "k_t": ("k",), "v_t": ("v",)}
#: The layouts of a layer's parameters the model reads: for each, the parameters it has in place of which of
#: `param_shapes`' ("canonical").
LAYOUTS = {"canonical": {}, "fused": FUSED, "model_dim_last": MODEL_DIM_LAST}
#: The same for the parameters outside the layers.
PARAM_AXES = {"embed": ("vocab", "embed"), "final_norm": ("embed",), "lm_head": ("embed", "vocab")}


def layout_of(layer: Params) -> str:
    """Which of `LAYOUTS` a layer's parameters (one layer's or stacked) are in."""
    return next((layout for layout, replaced in LAYOUTS.items() if replaced and next(iter(replaced)) in layer),
                "canonical")


def param_axes(config: ModelConfig, layout: str = "canonical") -> Params:
    """`param_shapes(config)` with each shape replaced by its dims' logical names (a tuple of str), the layers'
    parameters in `layout` (one of `LAYOUTS`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"parameter layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    shapes = param_shapes(config)
    named = {name: PARAM_AXES[name] for name in shapes if name != "layers"}
    replaced = LAYOUTS[layout]
    names = [n for n in shapes["layers"] if not any(n in parts for parts in replaced.values())] + [
        new_name for new_name, parts in replaced.items() if parts[0] in shapes["layers"]]
    named["layers"] = {name: LAYER_PARAM_AXES[name] for name in names}
    return named


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


def unstack_layers(params: Params, free: bool = False) -> Params:
    """`params` with "layers" as a tuple of per-layer dicts, each array without the leading [L] axis: the layout
    the unrolled layer loop (`kernels.layer_loop`, a GPU's) reads without copying. XLA:GPU reads a static slice of a
    stacked weight in place only where it fuses the slice into the matrix product (an H100 compile copied the
    output projection's slice out); a whole array it always reads in place. `free` deletes each stacked array once
    it is sliced (what `load_model` does, so the weights never sit on the device twice). Per-layer parameters
    already are returned as they are."""
    layers = params["layers"]
    if not isinstance(layers, dict):
        return params
    num_layers = len(next(iter(layers.values())))
    per_layer: list[dict[str, Any]] = [{} for _ in range(num_layers)]
    for name, stacked in layers.items():
        for index in range(num_layers):
            per_layer[index][name] = stacked[index]
        if free and isinstance(stacked, jax.Array):
            stacked.delete()
    return {**params, "layers": tuple(per_layer)}


def _grouped_by_kv_head(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """q [..., N, H], k and v [..., K, H] -> [..., K, G + 2, H]: each KV head's G query heads (query head n is
    KV head n // G's), then its key, then its value."""
    *lead, N, H = q.shape
    K = k.shape[-2]
    return jnp.concatenate([q.reshape(*lead, K, N // K, H), k[..., None, :], v[..., None, :]], axis=-2)


def _laid_out(lay_out, respec, first: jax.Array, *rest: jax.Array) -> jax.Array:
    """lay_out(first, *rest), placed as `first` is, its dims' splits over a mesh moved as respec(first's
    PartitionSpec as a tuple, one entry a dim) says: a sharded layer's weights are laid out anew on each device's
    shard, never gathered."""
    sharding = getattr(first, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return lay_out(first, *rest)
    spec = tuple(sharding.spec) + (None,) * (first.ndim - len(sharding.spec))
    placed = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*respec(spec)),
                                        memory_kind=sharding.memory_kind)
    return jax.jit(lay_out, out_shardings=placed)(first, *rest)


def _fused_spec(spec: tuple) -> tuple:
    """A fused array's splits (`fuse_layer`): its parts' dims split alike, the new dim before the last whole."""
    return (*spec[:-1], None, spec[-1])


def fuse_layer(layer: dict[str, Any], free: bool = False) -> dict[str, Any]:
    """A layer's parameters (one layer's, or stacked on [L]) with q, k and v as one array "qkv" grouped by KV head,
    [..., D, K, G + 2, H] (`_grouped_by_kv_head`; their biases likewise as "qkv_bias"), and gate and up as one
    "gate_up" [..., D, 2, F]; the rest as they are (`FUSED`). The model reads either layout.

    Why: a decode step's projections become one matrix product where there were three and two. At batch 1
    XLA:GPU turns a small vector-matrix product (Llama-3-8B's k and v projections, [4096] x [4096, 1024]) into an
    elementwise product it writes out and a reduction, a write and a reread of 8.4 MB each a layer; the fused
    [4096] x [4096, 6144] is a GEMM that reads its weight once, and the layer launches three kernels fewer
    (docs/research_log.md). A prompt's q, k and v are still products of their own, from slices of the fused weight
    (`_project_qkv`). Sharded by KV head, each device's block of the fused array holds the query, key and value
    heads of its KV heads, the split the separate arrays have. `free` deletes each separate array once fused.
    Fused layers come back as they are."""
    if "q" not in layer:
        return layer
    out = {name: array for name, array in layer.items() if not any(name in parts for parts in FUSED.values())}
    out["qkv"] = _laid_out(_grouped_by_kv_head, _fused_spec, layer["q"], layer["k"], layer["v"])
    if "q_bias" in layer:
        out["qkv_bias"] = _laid_out(_grouped_by_kv_head, _fused_spec, layer["q_bias"], layer["k_bias"],
                                    layer["v_bias"])
    out["gate_up"] = _laid_out(lambda gate, up: jnp.stack([gate, up], axis=-2), _fused_spec, layer["gate"],
                               layer["up"])
    if free:
        for name in layer.keys() - out.keys():
            if isinstance(layer[name], jax.Array):
                layer[name].delete()
    return out


def move_model_dim_last(layer: dict[str, Any], free: bool = False) -> dict[str, Any]:
    """A layer's parameters (one layer's, or stacked on [L]) with q [..., D, N, H], k and v [..., D, K, H] as
    "q_t" [..., N, H, D], "k_t" and "v_t" [..., K, H, D] (`MODEL_DIM_LAST`; HF's own [out, in] order); the rest
    as they are. The model reads either layout.

    Why: XLA:TPU lays a [D, heads, H] weight out anew before a prompt's projection reads it. In a scanned layer
    loop it copied each layer's q/k/v weights in every prefill, and where the layers run in two scans (full
    layers, then selecting ones) it relaid the whole stacks before both: ClusterKV@1024's 32k prefill of 4
    Llama-3-8B layers held 1,581 MB of device temporaries on a v5e against full KV's 1,377 MB (deviceless;
    docs/research_log.md). Stored [heads, H, D] the weights are read in place, and a one-token projection costs the
    same there. Sharded, each device transposes its own shard (split by head, as before). `free` deletes q, k and v once
    moved. Layers in another layout come back as they are."""
    if layout_of(layer) != "canonical":
        return layer
    out = {name: array for name, array in layer.items() if not any(name in parts for parts in MODEL_DIM_LAST.values())}
    for moved, (name,) in MODEL_DIM_LAST.items():
        out[moved] = _laid_out(lambda w: jnp.moveaxis(w, -3, -1), lambda spec: (*spec[:-3], *spec[-2:], spec[-3]),
                               layer[name])
        if free and isinstance(layer[name], jax.Array):
            layer[name].delete()  # one weight at a time: the weights are never twice on the device
    return out


def for_device(params: Params, free: bool = False) -> Params:
    """`params` in the layout the device reads best: on a GPU per layer (`unstack_layers`, for its unrolled layer
    loop: `kernels.layer_loop`) and fused (`fuse_layer`); on a TPU stacked, q/k/v with the model dim last
    (`move_model_dim_last`, `kernels.qkv_model_dim_last`); elsewhere as they are. `free` deletes each array given
    once it is laid out anew."""
    if kernels.layer_loop() == "unrolled":
        per_layer = unstack_layers(params, free)
        return {**per_layer, "layers": tuple(fuse_layer(layer, free) for layer in per_layer["layers"])}
    if kernels.qkv_model_dim_last():
        layers = params["layers"]
        moved = (move_model_dim_last(layers, free) if isinstance(layers, dict)
                 else tuple(move_model_dim_last(layer, free) for layer in layers))
        return {**params, "layers": moved}
    return params


def _stacked_layers(params: Params) -> Params:
    """params["layers"] as a dict of [L, ...] arrays (stacking per-layer parameters: a copy)."""
    layers = params["layers"]
    return layers if isinstance(layers, dict) else jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


# ----------------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm as HF computes it: normalise in float32, cast back, then scale by the weight (Llama); with an
    `offset`, scale by (offset + weight) in float32, then cast back (Gemma's (1 + w))."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (x32 * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def _norm(x: jax.Array, weight: jax.Array, config: ModelConfig) -> jax.Array:
    return rms_norm(x, weight, config.rms_norm_eps, config.norm_offset)


def _embed(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Token embeddings [..., D]; Gemma scales them by sqrt(D) in their own dtype, as HF does."""
    x = params["embed"][tokens]
    return x * jnp.asarray(config.hidden_size ** 0.5, x.dtype) if config.embed_scale else x


def rope_inv_freq(config: ModelConfig) -> jax.Array:
    """Inverse RoPE frequencies [rotary_dim / 2] of a RoPE type whose frequencies are fixed (`clusterkv_jax.rope`)."""
    return rope.inv_freq(config)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, interleaved: bool = False) -> jax.Array:
    """Rotates the first 2·len(inv_freq) channels of x [B, T, heads, H] by positions [B, T] (`rope.apply`)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    return rope.apply(x, jnp.cos(angles), jnp.sin(angles), interleaved)


def _qkv_parts(layer: Params, fused_name: str):
    """A layer's q [..., N, H], k and v [..., K, H] weights (fused_name "qkv") or biases ("qkv_bias") in either
    layout: the separate arrays, or static slices of the fused one (`fuse_layer`); None for biases it lacks."""
    names = FUSED[fused_name]
    if fused_name not in layer:
        return tuple(layer[name] for name in names) if names[0] in layer else None
    fused = layer[fused_name]  # [..., K, G + 2, H]
    *lead, K, parts, H = fused.shape
    G = parts - 2
    return fused[..., :G, :].reshape(*lead, K * G, H), fused[..., G, :], fused[..., G + 1, :]


def _project_qkv(layer: Params, config: ModelConfig, x: jax.Array, cos_sin: tuple[jax.Array, jax.Array]):
    """x [B, T, D] -> post-RoPE q [B, T, N, H], k [B, T, K, H] (after the per-head norms, where the family has
    them) and v [B, T, K, H]; cos_sin from `rope.tables`."""
    if "qkv" in layer and x.shape[1] == 1:
        # Fused (`fuse_layer`) and one token: one product reads the three weights, [B, 1, K, G + 2, H].
        qkv = jnp.einsum("BTD,DKPH->BTKPH", x, layer["qkv"])
        if "qkv_bias" in layer:
            qkv = qkv + layer["qkv_bias"]
        B, T, K, G, H = qkv.shape[0], qkv.shape[1], qkv.shape[2], qkv.shape[3] - 2, qkv.shape[4]
        q, k, v = qkv[:, :, :, :G].reshape(B, T, K * G, H), qkv[:, :, :, G], qkv[:, :, :, G + 1]
    else:
        # A product per part: a prompt's q, k and v are each written where the attention and the store read
        # them, not split out of one fused output (at 32k, 0.4 GB more read and written a layer).
        biases = _qkv_parts(layer, "qkv_bias")
        if "q_t" in layer:  # the model dim last (`move_model_dim_last`)
            q, k, v = (jnp.einsum("BTD,NHD->BTNH", x, layer[name]) for name in MODEL_DIM_LAST)
        else:
            q, k, v = (jnp.einsum("BTD,DNH->BTNH", x, w) for w in _qkv_parts(layer, "qkv"))
        if biases is not None:
            q, k, v = q + biases[0], k + biases[1], v + biases[2]
    if "q_norm" in layer:
        q, k = _norm(q, layer["q_norm"], config), _norm(k, layer["k_norm"], config)
    rotate = functools.partial(rope.apply, cos=cos_sin[0], sin=cos_sin[1], interleaved=config.rope_interleaved)
    q = rotate(q)
    if config.query_pre_attn_scalar is not None and config.query_pre_attn_scalar != config.head_dim:
        # Attention divides q.k by sqrt(head_dim); Gemma divides by sqrt(query_pre_attn_scalar). A positive factor
        # on q scales every score alike, so no ranking of keys by q (q.mu, q.k) changes.
        q = q * jnp.asarray((config.head_dim / config.query_pre_attn_scalar) ** 0.5, q.dtype)
    return q, rotate(k), v


#: Prompt tokens the MLP block takes at once: its hidden activations ([B, chunk, F], three of them) bound prefill's
#: memory instead of growing with the prompt (Llama-3-8B at 32k: 2.8 GB a layer at once, 0.35 GB in chunks of
#: 4,096), and each chunk's matrix products are still large.
MLP_CHUNK = 4096


def _mlp(layer: Params, config: ModelConfig, x: jax.Array) -> jax.Array:
    """The gated MLP block with its residual add: x [B, T, D] -> [B, T, D]."""
    h = _norm(x, layer["mlp_norm"], config)
    if "gate_up" in layer:  # fused (`fuse_layer`)
        gate_up = jnp.einsum("BTD,DPF->BTPF", h, layer["gate_up"])
        gate, up = gate_up[:, :, 0], gate_up[:, :, 1]
    else:
        gate = jnp.einsum("BTD,DF->BTF", h, layer["gate"])
        up = jnp.einsum("BTD,DF->BTF", h, layer["up"])
    act = jax.nn.silu(gate) if config.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
    mlp = jnp.einsum("BTF,FD->BTD", act * up, layer["down"])
    if "post_mlp_norm" in layer:
        mlp = _norm(mlp, layer["post_mlp_norm"], config)
    return x + mlp


def _output_and_mlp(layer: Params, config: ModelConfig, x: jax.Array, attn: jax.Array,
                    reread: Callable[[jax.Array], Params] | None = None) -> jax.Array:
    """Residual add of the attention output attn [B, T, N, H], then the MLP block, over at most `MLP_CHUNK`
    tokens at a time; `reread(i)`, where given, reads the layer's weights again in the loop's iteration i."""
    out = jnp.einsum("BTNH,NHD->BTD", attn.astype(x.dtype), layer["o"])
    if "o_bias" in layer:
        out = out + layer["o_bias"]
    if "post_attn_norm" in layer:
        out = _norm(out, layer["post_attn_norm"], config)
    x = x + out
    T = x.shape[1]
    if T <= MLP_CHUNK:
        return _mlp(layer, config, x)
    n = -(-T // MLP_CHUNK)

    def chunk(i, x):  # chunk i's rows are read, then overwritten: the loop updates x in place, no second buffer
        rows = jax.lax.dynamic_slice_in_dim(x, i * MLP_CHUNK, MLP_CHUNK, axis=1)
        weights = layer if reread is None else reread(i)
        return jax.lax.dynamic_update_slice_in_dim(x, _mlp(weights, config, rows), i * MLP_CHUNK, axis=1)

    x = jnp.pad(x, ((0, 0), (0, n * MLP_CHUNK - T), (0, 0)))
    return jax.lax.fori_loop(0, n, chunk, x)[:, :T]


def _logits(params: Params, config: ModelConfig, x: jax.Array) -> jax.Array:
    """Final norm and LM head: x [..., D] -> float32 logits [..., V]."""
    x = _norm(x, params["final_norm"], config)
    if config.tie_word_embeddings:
        logits = jnp.einsum("...D,VD->...V", x, params["embed"], preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("...D,DV->...V", x, params["lm_head"], preferred_element_type=jnp.float32)
    return softcap(logits, config.final_logit_softcapping)


# ----------------------------------------------------------------------------------------------------------
# Prefill and decode: one layer body, run for each layer in turn
# ----------------------------------------------------------------------------------------------------------


def _layer(layer: Params, config: ModelConfig, x: jax.Array, cos_sin, attend, reread=None):
    """One decoder layer. attend(q [B, T, N, H], k, v [B, T, K, H]) -> (attention output [B, T, N, H], *extra)
    stores the new K/V and attends; returns (x after attention and MLP, extra). `reread`: `_output_and_mlp`'s."""
    h = _norm(x, layer["attn_norm"], config)
    q, k, v = _project_qkv(layer, config, h, cos_sin)
    attn, *extra = attend(q, k, v)
    return _output_and_mlp(layer, config, x, attn, reread), extra


def _run_layer(params: Params, config: ModelConfig, step, cos_sin, x: jax.Array, group: LayerGroup, index, i):
    """Model layer `index` (an int, or traced under a scan), the `i`-th layer of `group`: its weights and policy
    state taken from the stacks, it stores its K/V and attends through `step`. Returns x and the group updated.

    The layer's policy state is written back only where the step returns one: a decode step changes none (the
    step hands back None; its windows are indexed between steps), and writing every layer's state back each step
    moves bytes that change nothing (docs/research_log.md)."""
    reread = None
    if isinstance(params["layers"], dict):  # stacked: an int index is a static slice, a traced one a dynamic slice
        stack = params["layers"]
        layer = jax.tree.map(lambda p: p[index], stack)
        if not isinstance(index, int):
            # A loop inside the layer (the MLP's chunks) that reads this slice makes it a loop operand, so XLA
            # copies the layer's weights out of the stack (Llama-3-8B's MLP: 352 MB of a TPU's prefill
            # temporaries). Sliced again in each iteration at an index tied to the loop's counter, the slice cannot
            # be hoisted and stays inside the product that reads it.
            def reread(counter):
                at = jax.lax.optimization_barrier((index, counter))[0]
                return jax.tree.map(lambda p: p[at], stack)
    else:
        layer = params["layers"][index]
    state = jax.tree.map(lambda s: s[i], group.state)
    x, (store, state) = _layer(layer, config, x, cos_sin,
                               lambda q, k, v: step.attend(group, i, group.store, state, q, k, v), reread)
    if state is None:
        return x, group.replace(store=store)
    states = jax.tree.map(lambda s, new: jax.lax.dynamic_update_index_in_dim(s, new, i, 0), group.state, state)
    return x, group.replace(store=store, state=states)


def _run_layers(params: Params, config: ModelConfig, cache: KVCache, x: jax.Array, positions: jax.Array,
                seq_lens: jax.Array, step, groups: tuple[LayerGroup, ...] | None = None
                ) -> tuple[jax.Array, tuple[LayerGroup, ...]]:
    """Runs every layer on x [B, T, D] at positions [B, T] of sequences of lengths seq_lens [B] (what RoPE types
    that depend on the length read); `step` (from `clusterkv_jax.attend`) stores and attends. `groups` replaces
    `cache.groups` (a chunked prefill carries them). Returns x and the groups with their new stores and states.

    The layers run one after another, in a Python loop or under `lax.scan`, as `kernels.layer_loop` says for the
    device: XLA:GPU copies a layer's weights out of the stack before its matrix products when the layer is a scan
    index, so on a GPU the loop is unrolled and reads per-layer parameters (`unstack_layers`, which `load_model`
    applies there); elsewhere the scan costs nothing at run time and its compile time does not grow with depth.
    Either loop takes either layout."""
    cos_sin = rope.tables(config, positions, seq_lens)
    local_cos_sin = rope.local_tables(config, positions, seq_lens) if config.local_rope_theta else cos_sin
    local = [config.local_rope_theta is not None and t == SLIDING_ATTENTION for t in config.layer_types] or (
        [False] * config.num_layers)
    groups = list(cache.groups if groups is None else groups)
    place = {layer: (g, i) for g, group in enumerate(groups) for i, layer in enumerate(group.layers)}
    if kernels.layer_loop() == "unrolled":
        for index in range(config.num_layers):
            g, i = place[index]
            with attend_module.layer_scope([index]):
                x, groups[g] = _run_layer(params, config, step, local_cos_sin if local[index] else cos_sin, x,
                                          groups[g], index, i)
        return x, tuple(groups)

    # Scanned: one scan per run of a repeated period of layers (`scan_runs`), the period's layers in its body.
    run = functools.partial(_run_layer, {**params, "layers": _stacked_layers(params)}, config, step)
    for start, period, reps in scan_runs([(place[index][0], local[index]) for index in range(config.num_layers)]):
        slots = [(index, *place[index]) for index in range(start, start + period)]  # (model layer, group, i)
        ids = sorted({g for _, g, _ in slots})
        # A group's layers in a run are in model order, `per_period` of them in each repeat.
        per_period = {g: sum(1 for _, h, _ in slots if h == g) for g in ids}

        def body(carry, r, period=period, slots=slots, ids=ids, per_period=per_period):
            x, carried = carry
            carried = dict(zip(ids, carried))
            for index, g, i in slots:
                x, carried[g] = run(local_cos_sin if local[index] else cos_sin, x, carried[g], index + r * period,
                                    i + r * per_period[g])
            return (x, tuple(carried[g] for g in ids)), None

        (x, carried), _ = jax.lax.scan(body, (x, tuple(groups[g] for g in ids)), jnp.arange(reps, dtype=jnp.int32))
        for g, group in zip(ids, carried):
            groups[g] = group
    return x, tuple(groups)


#: The longest period `scan_runs` looks for; real models repeat every 1 to 6 layers.
MAX_PERIOD = 16


def scan_runs(kinds: list) -> list[tuple[int, int, int]]:
    """`kinds` (one hashable per layer) as runs (start, period, reps) of a repeated period, chosen to make the
    scanned program smallest: the layer bodies it traces (one per slot of each period) plus one per scan.
    [F, F, S x 30] -> (0, 1, 2), (2, 1, 30); Gemma 3's (W x 5, S) x 8 -> (0, 6, 8)."""
    L = len(kinds)
    # match[p][j]: how many layers from j on equal the layer p after them.
    match = {}
    for p in range(1, min(MAX_PERIOD, L) + 1):
        run = [0] * (L + 1)
        for j in range(L - p - 1, -1, -1):
            run[j] = run[j + 1] + 1 if kinds[j] == kinds[j + p] else 0
        match[p] = run
    cost, choice = [0] * (L + 1), [None] * (L + 1)
    for s in range(L - 1, -1, -1):
        best = None
        for p in range(1, min(MAX_PERIOD, L - s) + 1):
            for reps in sorted({min(p + match[p][s], L - s) // p, 1}, reverse=True):
                total = p + 1 + cost[s + p * reps]
                if best is None or total < best[0]:
                    best = (total, p, reps)
        cost[s], choice[s] = best[0], best[1:]
    out, s = [], 0
    while s < L:
        p, reps = choice[s]
        out.append((s, p, reps))
        s += p * reps
    return out


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
    each chunk attending to the cache so far, so activations are bounded by the chunk, not the prompt; the logits
    and the cache equal the unchunked ones up to float rounding."""
    B, T = tokens.shape
    S = cache.capacity
    assert T <= S, f"prompt bucket {T} exceeds cache capacity {S}"
    if chunk is not None and chunk < T:
        if chunk % PREFILL_BLOCK or T % chunk:
            raise ValueError(f"prefill chunk {chunk} must be a multiple of {PREFILL_BLOCK} that divides the prompt "
                             f"bucket {T}")

        def run_chunk(groups, c):
            start = c * chunk
            positions = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
            step = attend_module.PrefillChunk(policy, lengths, S, start, T, config.attn_logit_softcapping)
            x = _embed(params, config, jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1))
            x, groups = _run_layers(params, config, cache, x, positions, lengths, step, groups)
            return groups, x

        groups, xs = jax.lax.scan(run_chunk, cache.groups, jnp.arange(T // chunk, dtype=jnp.int32))
        x = jnp.moveaxis(xs, 0, 1).reshape(B, T, -1)  # [n, B, chunk, D] -> [B, T, D]
        groups = attend_module.index_prompt(policy, groups, lengths, S, T)
    else:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        later = attend_module.indexed_in_one_loop(cache.groups)  # a GPU's: one loop indexes them all
        x, groups = _run_layers(params, config, cache, _embed(params, config, tokens), positions, lengths,
                                attend_module.Prefill(policy, lengths, S, config.attn_logit_softcapping, not later))
        if later:
            groups = attend_module.index_prompt(policy, groups, lengths, S, T)
    if all_logits:
        logits = _logits(params, config, x)
    else:
        last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
        logits = _logits(params, config, last)
    lengths = lengths.astype(jnp.int32)
    return logits, cache.replace(groups=groups, lengths=lengths, prompt_lengths=lengths)


def forward_decode(
    params: Params,
    config: ModelConfig,
    policy,
    tokens: jax.Array,  # [B] one new token per sequence
    cache: KVCache,
    index: bool = True,
) -> tuple[jax.Array, KVCache]:
    """Appends one token per sequence at position `cache.lengths` and returns its logits [B, V]. First the
    selecting layers index the windows that are due (`attend.index_windows`); `index=False` skips that, for a
    caller that indexes them itself before they are due (`generate`'s loop: `attend.steps_until_due`)."""
    groups = cache.groups
    if index:
        groups = attend_module.index_windows(policy, groups, cache.lengths, cache.prompt_lengths, cache.capacity)
    step = attend_module.Decode(policy, cache.lengths, cache.prompt_lengths, cache.capacity,
                                config.attn_logit_softcapping)
    x, groups = _run_layers(params, config, cache, _embed(params, config, tokens)[:, None], cache.lengths[:, None],
                            cache.lengths + 1, step, groups)
    logits = _logits(params, config, x[:, 0])
    return logits, cache.replace(groups=groups, lengths=cache.lengths + 1)
