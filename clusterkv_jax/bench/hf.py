"""HF transformers' full-KV decode of the same weights, for `clusterkv bench decode --compare-hf`.

Needs torch and transformers (the test extras). The HF model is built from our parameters, so both sides run
the same weights in the same dtype; `tests/test_bench.py` checks that its logits match ours.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from checkpoints_convert import params_to_hf_state_dict

from clusterkv_jax.config import ModelConfig


def hf_config(config: ModelConfig):
    """A transformers LlamaConfig with our config's geometry (Llama / Mistral layouts: no biases)."""
    from transformers import LlamaConfig

    if config.qkv_bias or config.o_bias or config.model_type not in ("llama", "mistral") or config.layer_types:
        raise ValueError("--compare-hf supports Llama and Mistral models without attention biases or sliding "
                         "windows")
    rope: dict[str, Any] = {"rope_type": config.rope_scaling.rope_type, "rope_theta": config.rope_theta}
    s = config.rope_scaling
    if s.rope_type == "linear":
        rope["factor"] = s.factor
    elif s.rope_type == "llama3":
        rope.update(factor=s.factor, low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position_embeddings)
    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters=rope,
    )


def hf_model_from_params(config: ModelConfig, params, dtype: str = "float32"):
    """transformers LlamaForCausalLM holding our parameters (`params_to_hf_state_dict`: the converter's
    HF layout, inverted)."""
    import torch
    from transformers import LlamaForCausalLM

    torch_dtype = getattr(torch, dtype)
    params32 = jax.tree.map(lambda x: np.asarray(x, np.float32), params)  # torch takes no ml_dtypes bfloat16
    state = {name: torch.tensor(w, dtype=torch_dtype) for name, w in params_to_hf_state_dict(params32, config).items()}
    model = LlamaForCausalLM(hf_config(config)).to(torch_dtype)
    result = model.load_state_dict(state, strict=False)
    missing = [n for n in result.missing_keys if not (config.tie_word_embeddings and n == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise ValueError(f"HF model parameters not matched: missing {missing[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


class HFDecoder:
    """Greedy decode with HF's own KV cache, one step per call, so the benchmark can interleave it with ours."""

    def __init__(self, model, prompts: np.ndarray):
        import torch

        self.model, self.torch = model, torch
        ids = torch.from_numpy(np.asarray(prompts, np.int64))
        self.batch = ids.shape[0]
        with torch.inference_mode():
            start = time.perf_counter()
            # The last position's logits only, as transformers' own `generate` computes a prompt (ours does too):
            # all of them would add a [T, V] LM-head product (a few seconds at 8k tokens) to HF's prefill.
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            self.prefill_s = time.perf_counter() - start
        self.past, self.token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        self.tokens = [int(self.token[0, 0])]

    def step(self) -> float:
        """One decode step; returns its seconds."""
        with self.torch.inference_mode():
            start = time.perf_counter()
            out = self.model(input_ids=self.token, past_key_values=self.past, use_cache=True)
            seconds = time.perf_counter() - start
        self.past, self.token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        self.tokens.append(int(self.token[0, 0]))
        return seconds

