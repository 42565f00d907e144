"""The JAX model against HF transformers: the real SmolLM2-135M-Instruct and tiny random Llama-3.1 / Qwen2."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from clusterkv_jax import FullKV, decode_step, init_cache, load_model, prefill
from tests.helpers import long_text_ids, tiny_hf_checkpoint


@pytest.fixture(scope="module")
def smollm2(smollm2_converted_dir):
    return load_model(smollm2_converted_dir)


def _hf_logits(hf_model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor(ids)).logits.float().numpy()


def _jax_logits(model, ids: np.ndarray) -> np.ndarray:
    B, T = ids.shape
    cache = init_cache(model.config, FullKV(), B, T, jnp.float32)
    logits, _ = prefill(model.params, jnp.asarray(ids), jnp.full((B,), T, jnp.int32), cache,
                        config=model.config, policy=FullKV(), all_logits=True)
    return np.asarray(logits)


def test_smollm2_logits_match_hf_at_every_position(smollm2, hf_smollm2):
    """Our float32 logits against HF's forward in float64, the exact answer for these weights. SmolLM2 amplifies
    float32 rounding ~100x at its massive activation (layer 11), so a float32 forward lands 1e-4 to 6e-4 from it
    depending on how it rounds (HF's float32 included); against HF's float32, the gap would hold both roundings
    (docs/research_log.md, "YNNPACK's dots by CPU")."""
    hf_model, _ = hf_smollm2
    ids = np.asarray([long_text_ids(smollm2.tokenizer, 512)])
    ref = _hf_logits(copy.deepcopy(hf_model).double(), ids)
    hf_float32 = _hf_logits(hf_model, ids)
    ours = _jax_logits(smollm2, ids)
    max_diff = np.abs(ours - ref).max()
    print(f"SmolLM2 512-token prompt: max |logit diff| vs HF float64 = {max_diff:.2e} (HF float32: "
          f"{np.abs(hf_float32 - ref).max():.2e}; ours vs HF float32: {np.abs(ours - hf_float32).max():.2e})")
    assert max_diff <= 1e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.99


def test_decode_step_logits_equal_prefill_logits(smollm2):
    ids = np.asarray([long_text_ids(smollm2.tokenizer, 160)])
    full = _jax_logits(smollm2, ids)[0]
    cfg, policy = smollm2.config, FullKV()
    cache = init_cache(cfg, policy, 1, 256, jnp.float32)
    prompt = 128
    logits, cache = prefill(smollm2.params, jnp.asarray(ids[:, :prompt]), jnp.array([prompt]), cache,
                            config=cfg, policy=policy)
    np.testing.assert_allclose(np.asarray(logits)[0], full[prompt - 1], atol=2e-4)
    before = decode_step._cache_size()
    for pos in range(prompt, 160):
        logits, cache = decode_step(smollm2.params, jnp.asarray(ids[:, pos]), cache, config=cfg, policy=policy)
        np.testing.assert_allclose(np.asarray(logits)[0], full[pos], atol=2e-4, err_msg=f"position {pos}")
    # 32 decode steps compiled at most once (zero times if an earlier test compiled this shape).
    assert decode_step._cache_size() - before <= 1
    assert int(cache.lengths[0]) == 160


@pytest.mark.slow  # converts checkpoints
@pytest.mark.parametrize("kind", ["llama3_rope", "qwen2_bias", "untied_linear_rope"])
def test_tiny_random_models_match_hf(kind, tmp_path):
    hf_model, ckpt_dir = tiny_hf_checkpoint(kind, tmp_path)
    model = load_model(ckpt_dir)
    if kind == "llama3_rope":
        assert model.config.rope_scaling.rope_type == "llama3"
    if kind == "qwen2_bias":
        assert model.config.qkv_bias and "q_bias" in model.params["layers"]
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (2, 300))
    ref = _hf_logits(hf_model, ids)
    ours = _jax_logits(model, ids)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # converts checkpoints
def test_llama3_rope_scaling_changes_the_math(tmp_path):
    """Guards the llama3 test above: the same weights without scaling must give different logits."""
    hf_model, ckpt_dir = tiny_hf_checkpoint("llama3_rope", tmp_path)
    import dataclasses

    from clusterkv_jax.config import RopeScaling

    model = load_model(ckpt_dir)
    unscaled = dataclasses.replace(model, config=dataclasses.replace(model.config, rope_scaling=RopeScaling()))
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (1, 300))
    ref = _hf_logits(hf_model, ids)
    assert np.abs(_jax_logits(unscaled, ids) - ref).max() > 1e-3


def test_bfloat16_params_stay_close_to_float32(smollm2):
    ids = np.asarray([long_text_ids(smollm2.tokenizer, 128)])
    ref = _jax_logits(smollm2, ids)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), smollm2.params)
    import dataclasses

    ours = _jax_logits(dataclasses.replace(smollm2, params=bf16), ids)
    assert ours.dtype == np.float32  # logits accumulate in float32 whatever the params
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.9


def test_either_layer_loop_over_either_parameter_layout_gives_the_same_logits():
    """A GPU runs the layers in a Python loop over per-layer parameters, q/k/v and gate/up fused
    (`kernels.layer_loop`, `model.for_device`); elsewhere a `lax.scan` over the stacked ones, the form the HF
    comparisons check, on a TPU with q/k/v's model dim last (`kernels.qkv_model_dim_last`). On a tiny
    Gemma-3-like model (windowed layers with a RoPE base of their own among global ones; ClusterKV selecting after
    one full layer), both loops over four layouts (stacked, per layer, per layer fused, stacked with the model dim
    last) give the same prefill logits at every position and the same logits in each of 6 decode steps, which
    cross ClusterKV's decode-time clustering, and the same policy state."""
    from clusterkv_jax import ClusterKV, ModelConfig, kernels, model

    config = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=10, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=512, sliding_window=16,
                         local_rope_theta=10000.0, rope_theta=1e6,
                         layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 3 + ["sliding_attention"])
    # Layers 0, 1, 3, 4, 6, 7 and 9 windowed, 2 full, 5 and 8 selecting.
    policy = ClusterKV(budget=24, sinks=4, tokens_per_cluster=8, decode_interval=4, decode_clusters=2, full_layers=3)
    stacked = model.init_params(config, jax.random.key(3))
    per_layer = model.unstack_layers(stacked)
    assert len(per_layer["layers"]) == 10 and per_layer["layers"][2]["q"].shape == stacked["layers"]["q"].shape[1:]
    np.testing.assert_array_equal(per_layer["layers"][2]["q"], stacked["layers"]["q"][2])
    with kernels.forced_layer_loop("unrolled"):
        gpu = model.for_device(stacked)  # per layer and fused
    assert set(gpu["layers"][4]) == set(model.param_axes(config, "fused")["layers"])
    with kernels.forced_qkv_model_dim_last(True):
        tpu = model.for_device(stacked)  # stacked, q/k/v [L, heads, H, D]
    assert set(tpu["layers"]) == set(model.param_axes(config, "model_dim_last")["layers"])
    layouts = {"stacked": stacked, "per layer": per_layer, "per layer, fused": gpu, "stacked, model dim last": tpu}
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (1, 64))
    results = {}
    for loop in kernels.LAYER_LOOPS:
        with kernels.forced_layer_loop(loop):
            for layout, params in layouts.items():
                cache = init_cache(config, policy, 1, 128, jnp.float32)
                logits, cache = jax.jit(lambda p, c: model.forward_prefill(
                    p, config, policy, jnp.asarray(ids), jnp.array([64]), c, all_logits=True))(params, cache)
                step = jax.jit(lambda p, t, c: model.forward_decode(p, config, policy, t, c))
                out = [np.asarray(logits)]
                for token in range(6):
                    logits, cache = step(params, jnp.array([token]), cache)
                    out.append(np.asarray(logits))
                # A GPU's cache holds each layer in a group of its own; elsewhere one group per kind of layer.
                assert len(cache.groups) == (10 if loop == "unrolled" else 3)
                results[loop, layout] = out, jax.tree.leaves(jax.tree.map(np.asarray, cache.policy_state))
    reference, reference_state = results["scanned", "stacked"]
    for key, (out, state) in results.items():
        for got, want in zip(out, reference):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(key))
        for got, want in zip(state, reference_state, strict=True):  # the selecting layers' states, in model order
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(key))


def test_fused_layer_holds_each_kv_heads_query_key_and_value_heads():
    """`model.fuse_layer`'s layout, against a NumPy regrouping: qkv[:, j] is KV head j's G query heads (query head n
    belongs to KV head n // G, as the attention groups them), then its key, then its value; the biases alike;
    gate_up[:, 0] the gate, [:, 1] the up projection; the other parameters untouched. Stacked or one layer's."""
    from clusterkv_jax import ModelConfig, model

    config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=6,
                         num_kv_heads=2, head_dim=4, max_position_embeddings=64, qkv_bias=True)
    stacked = jax.tree.map(np.asarray, model.init_params(config, jax.random.key(0))["layers"])
    G = 3
    for layer, lead in ((stacked, (2,)), (jax.tree.map(lambda x: x[1], stacked), ())):
        fused = jax.tree.map(np.asarray, model.fuse_layer(jax.tree.map(jnp.asarray, layer)))
        assert set(fused) == set(model.param_axes(config, "fused")["layers"])
        assert fused["qkv"].shape == (*lead, 16, 2, G + 2, 4) and fused["gate_up"].shape == (*lead, 16, 2, 24)
        for j in range(2):
            for g in range(G):
                np.testing.assert_array_equal(fused["qkv"][..., j, g, :], layer["q"][..., j * G + g, :])
                np.testing.assert_array_equal(fused["qkv_bias"][..., j, g, :], layer["q_bias"][..., j * G + g, :])
            for part, name in ((G, "k"), (G + 1, "v")):
                np.testing.assert_array_equal(fused["qkv"][..., j, part, :], layer[name][..., j, :])
                np.testing.assert_array_equal(fused["qkv_bias"][..., j, part, :], layer[f"{name}_bias"][..., j, :])
        np.testing.assert_array_equal(fused["gate_up"][..., 0, :], layer["gate"])
        np.testing.assert_array_equal(fused["gate_up"][..., 1, :], layer["up"])
        for name in ("o", "down", "attn_norm", "mlp_norm"):
            np.testing.assert_array_equal(fused[name], layer[name])
    # What `load_model` does on a GPU: per layer and fused, each array it was given deleted once it is laid out anew
    # (the weights are never twice on the device), the same values.
    from clusterkv_jax import kernels

    params = model.init_params(config, jax.random.key(0))
    with kernels.forced_layer_loop("unrolled"):
        gpu = model.for_device(params, free=True)
    assert all(x.is_deleted() for x in jax.tree.leaves(params["layers"]))
    for i in range(2):
        want = jax.tree.map(np.asarray, model.fuse_layer(jax.tree.map(lambda x: jnp.asarray(x[i]), stacked)))
        assert jax.tree.structure(want) == jax.tree.structure(gpu["layers"][i])
        for got, expected in zip(jax.tree.leaves(gpu["layers"][i]), jax.tree.leaves(want)):
            np.testing.assert_array_equal(got, expected)


def test_model_dim_last_layout_holds_each_weight_transposed():
    """`model.move_model_dim_last` (a TPU's q/k/v layout), against NumPy: q_t[..., n, h, d] is q[..., d, n, h], k_t
    and v_t alike, stacked or one layer's; the biases and other parameters untouched; a layer in another layout
    comes back as it is. `for_device` on a TPU gives it and deletes each stacked array it moved."""
    from clusterkv_jax import ModelConfig, kernels, model

    config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=6,
                         num_kv_heads=2, head_dim=4, max_position_embeddings=64, qkv_bias=True)
    params = model.init_params(config, jax.random.key(0))
    stacked = jax.tree.map(np.asarray, params["layers"])
    for layer in (stacked, jax.tree.map(lambda x: x[1], stacked)):
        moved = jax.tree.map(np.asarray, model.move_model_dim_last(jax.tree.map(jnp.asarray, layer)))
        assert model.layout_of(moved) == "model_dim_last" and model.layout_of(layer) == "canonical"
        assert set(moved) == set(model.param_axes(config, "model_dim_last")["layers"])
        for name in ("q", "k", "v"):
            np.testing.assert_array_equal(moved[name + "_t"], np.einsum("...dnh->...nhd", layer[name]))
        for name in ("q_bias", "k_bias", "o", "gate", "attn_norm"):
            np.testing.assert_array_equal(moved[name], layer[name])
    fused = model.fuse_layer(params["layers"])
    assert model.move_model_dim_last(fused) is fused and model.fuse_layer(moved) is moved
    with pytest.raises(ValueError, match="layout must be one of"):
        model.param_axes(config, "transposed")
    with kernels.forced_qkv_model_dim_last(True):
        tpu = model.for_device(params, free=True)
    assert all(params["layers"][name].is_deleted() for name in ("q", "k", "v"))
    assert not params["layers"]["o"].is_deleted() and tpu["layers"]["o"] is params["layers"]["o"]
    np.testing.assert_array_equal(tpu["layers"]["q_t"], np.einsum("ldnh->lnhd", stacked["q"]))


@pytest.mark.parametrize("window, cap", [(None, None), (100, None), (None, 30.0), (300, 30.0)])
def test_prompt_attention_kernels_equal_the_reference(window, cap):
    """The prompt's attention goes through the platform's fused kernel (`kernels.prompt_attention`): JAX's Pallas
    splash attention on a TPU (run here in interpret mode), cuDNN's through `jax.nn.dot_product_attention` on a
    CUDA GPU (its arguments checked here with the same call's XLA implementation, and on such a GPU cuDNN itself in
    bfloat16). Both equal the [T, T]
    reference with grouped-query heads, a window, soft-capped scores and a prompt that is not a whole number of
    blocks."""
    from clusterkv_jax import attention, kernels
    from pallas_kernels import dispatch

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 700, 6, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 700, 2, 64)), jnp.float32) for _ in range(2))
    want = np.asarray(attention.causal_attention_reference(q, k, v, window, cap))
    if window is not None:  # the window binds: what the kernels are given matters
        assert np.abs(want - np.asarray(attention.causal_attention_reference(q, k, v, None, cap))).max() > 0.1
    got = kernels.splash_prompt_attention(q, k, v, window=window, cap=cap, block=256, interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=1e-5)
    if cap is None:  # cuDNN's attention has no soft cap: such layers fall back to XLA (`prompt_attention_impl`)
        got = kernels.dot_product_prompt_attention(q, k, v, window=window, implementation="xla")
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=1e-5)
    if cap is None and dispatch.kernels_supported():  # a CUDA GPU: cuDNN itself, in bfloat16 (all it takes)
        q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
        want = np.asarray(attention.causal_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), window))
        got = kernels.dot_product_prompt_attention(q, k, v, window=window, implementation="cudnn")
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2)  # bfloat16's output rounding


def test_prefill_through_the_tpu_kernel_gives_the_same_logits(caplog):
    """A tiny Gemma-2-like model (soft-capped scores, windowed layers among global ones): prefill logits at every
    position with the prompt's attention in splash attention (TPU's kernel, interpret mode) equal those in XLA.
    And where a GPU's kernel cannot take a layer, it falls back and says so once."""
    from clusterkv_jax import ClusterKV, ModelConfig, kernels, model
    from pallas_kernels import dispatch

    config = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=1024, sliding_window=40,
                         attn_logit_softcapping=20.0, layer_types=["sliding_attention", "full_attention"] * 2)
    policy = ClusterKV(budget=64, sinks=4, tokens_per_cluster=8, full_layers=1)
    params = model.init_params(config, jax.random.key(3))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 300)))
    out = {}
    for impl in ("xla", "splash"):
        with kernels.forced_prompt_attention(impl, interpret=True):
            logits, _ = jax.jit(lambda p, c: model.forward_prefill(
                p, config, policy, ids, jnp.array([300, 250]), c, all_logits=True))(
                params, init_cache(config, policy, 2, 320, jnp.float32))
            out[impl] = np.asarray(logits)
    np.testing.assert_allclose(out["splash"], out["xla"], rtol=1e-5, atol=1e-5)

    class CudaDevice:  # what `prompt_attention_impl` asks of a device
        platform, compute_capability = "gpu", "9.0"

    kernels._said.clear()
    with dispatch.compile_for(CudaDevice()), caplog.at_level("WARNING", logger="clusterkv_jax"):
        assert kernels.prompt_attention_impl(jnp.bfloat16, None) == ("cudnn", None)
        for _ in range(2):
            kernels.prompt_attention(*(jnp.zeros((1, 8, 2, 8), jnp.bfloat16),) * 3, cap=20.0)
            kernels.prompt_attention(*(jnp.zeros((1, 8, 2, 8), jnp.float32),) * 3)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "soft-capped" in said[0] and "float32" in said[1], said


def test_the_mlp_over_a_long_prompt_in_chunks_gives_the_same_logits(monkeypatch):
    """A prompt longer than `model.MLP_CHUNK` goes through each layer's MLP a chunk of tokens at a time (the last
    chunk padded): prefill logits at every position equal those of the whole prompt at once."""
    from clusterkv_jax import ModelConfig, model

    config = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=512)
    params = model.init_params(config, jax.random.key(5))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (2, 300)))
    out = {}
    for chunk in (64, 4096):
        monkeypatch.setattr(model, "MLP_CHUNK", chunk)
        logits, _ = jax.jit(lambda p, c: model.forward_prefill(p, config, FullKV(), ids, jnp.array([300, 200]), c,
                                                               all_logits=True))(
            params, init_cache(config, FullKV(), 2, 320, jnp.float32))
        out[chunk] = np.asarray(logits)
    np.testing.assert_allclose(out[64], out[4096], rtol=1e-5, atol=1e-5)
