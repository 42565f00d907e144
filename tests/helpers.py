"""Helpers shared by tests: real long text, and tiny random HF checkpoints converted to our format."""

from __future__ import annotations

import os

import numpy as np
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRIDE_AND_PREJUDICE = os.path.join(REPO_ROOT, "..", "shared", "data", "pride_and_prejudice.txt")


def triton_interpret() -> bool:
    """Whether tests run the Pallas Triton kernels in interpret mode: yes, except on a CUDA GPU that runs them,
    where the compiled kernel is what users get (and interpret mode on XLA:GPU is not the kernel: XLA may keep
    excess precision through the kernel's exact bfloat16 split of float32 keys)."""
    from pallas_kernels import dispatch

    return not dispatch.kernels_supported()


def triton_mode() -> str:
    """The kernel mode (`clusterkv_jax.kernels.MODES`) that runs the Triton kernels: see `triton_interpret`."""
    return "interpret" if triton_interpret() else "pallas"


# llama.cpp's names for HF tensors (its convert_hf_to_gguf.py), written out here as the reference the
# converter's use of the `gguf` package's table must agree with.
GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.qkv_proj.weight": "attn_qkv.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_self_attn_layernorm.weight": "post_attention_norm.weight",
    "post_mlp_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}


def assert_same_rows(got, got_mask, want, want_mask):
    """The rows a store read returned, got [B, h, M, H] where got_mask [B, h, M], hold per (sequence, head) the
    same rows as want [B, h, M', H] where want_mask: as multisets, since a read may return its rows in any order
    (a host store's recall cache returns them in slot order; attention does not care)."""
    got, want = np.asarray(got), np.asarray(want)
    got_mask, want_mask = np.asarray(got_mask, bool), np.asarray(want_mask, bool)
    assert got.shape[:2] == want.shape[:2]
    for b in range(got.shape[0]):
        for h in range(got.shape[1]):
            a, w = got[b, h][got_mask[b, h]], want[b, h][want_mask[b, h]]
            assert a.shape == w.shape, (b, h, a.shape, w.shape)
            np.testing.assert_array_equal(a[np.lexsort(a.T[::-1])], w[np.lexsort(w.T[::-1])])


def long_text() -> str:
    """Pride and Prejudice (public domain) when the workspace's shared data is present, else built-in text."""
    if os.path.isfile(PRIDE_AND_PREJUDICE):
        with open(PRIDE_AND_PREJUDICE, encoding="utf-8") as f:
            return f.read()
    from clusterkv_jax.demo_text import DEMO_DOCUMENT

    return DEMO_DOCUMENT * 200


def long_text_ids(tokenizer, n: int, offset: int = 0) -> list[int]:
    ids = tokenizer.encode(long_text()[: 8 * (n + offset) + 100_000], add_special_tokens=False)
    assert len(ids) >= n + offset, "text too short"
    return ids[offset : offset + n]


def tiny_hf_config(kind: str):
    """Small random configs exercising one feature each."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    if kind == "llama3_rope":
        # original_max_position_embeddings small so positions < 300 already cross every frequency band.
        return LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if kind == "qwen2_bias":
        return Qwen2Config(**common, tie_word_embeddings=False, rms_norm_eps=1e-6)
    if kind == "untied_linear_rope":
        return LlamaConfig(**common, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    raise ValueError(kind)


def tiny_hf_checkpoint(kind: str, tmp_path, dtype: str = "float32"):
    """A random HF model of `kind`, saved as safetensors and converted; returns (hf_model, converted_dir)."""
    from transformers import AutoModelForCausalLM

    from checkpoints_convert import convert_hf

    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(tiny_hf_config(kind), dtype=torch.float32).eval()
    # Random init leaves biases at zero; give them values so the bias path is exercised.
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    src = os.path.join(tmp_path, f"hf_{kind}")
    hf_model.save_pretrained(src)
    dst = os.path.join(tmp_path, f"converted_{kind}")
    import pytest

    with pytest.warns(UserWarning, match="no tokenizer.json"):  # a bare random model has no tokenizer
        convert_hf(src, dst, dtype=dtype)
    return hf_model, dst


def generation_programs() -> int:
    """Programs `generate` has compiled so far (prefill + first token, and the decode loop)."""
    from clusterkv_jax.decode_loop import decode_generation, start_generation

    return start_generation._cache_size() + decode_generation._cache_size()
