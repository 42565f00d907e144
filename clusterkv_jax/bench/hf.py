"""HF transformers' full-KV decode and prefill of the same weights, for `clusterkv bench decode --compare-hf` and
`clusterkv bench prefill`.

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


def hf_model_from_params(config: ModelConfig, params, dtype: str = "float32", device: str | None = None):
    """transformers LlamaForCausalLM holding our parameters (`params_to_hf_state_dict`: the converter's
    HF layout, inverted), on torch's `device` (default: the CPU)."""
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
    return model.eval() if device is None else model.eval().to(device)


def same_device_as_jax() -> str | None:
    """torch's device for the accelerator JAX runs on ("cuda" when JAX's first device is a GPU and torch sees
    one), else None (the CPU): HF's figures then compare with ours on the same hardware."""
    import torch

    return "cuda" if jax.devices()[0].platform == "gpu" and torch.cuda.is_available() else None


def hf_prefill(model, prompts: np.ndarray) -> tuple[float, int]:
    """(seconds of HF's prefill of prompts [B, T] (its own cache, the last position's logits), synchronised with
    the device; sequence 0's greedy next token)."""
    import torch

    ids = torch.from_numpy(np.asarray(prompts, np.int64)).to(model.device)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        if ids.is_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return seconds, int(out.logits[0, -1].argmax())


class HFDecoder:
    """Greedy decode with HF's own KV cache, one step per call, so the benchmark can interleave it with ours."""

    def __init__(self, model, prompts: np.ndarray):
        import torch

        self.model, self.torch = model, torch
        ids = torch.from_numpy(np.asarray(prompts, np.int64)).to(model.device)
        self.batch = ids.shape[0]
        with torch.inference_mode():
            start = time.perf_counter()
            # The last position's logits only, as transformers' own `generate` computes a prompt (ours does too):
            # all of them would add a [T, V] LM-head product (a few seconds at 8k tokens) to HF's prefill.
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            self._sync()
            self.prefill_s = time.perf_counter() - start
        self.past, self.token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        self.tokens = [int(self.token[0, 0])]

    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            self.torch.cuda.synchronize()

    def step(self) -> float:
        """One decode step; returns its seconds."""
        with self.torch.inference_mode():
            start = time.perf_counter()
            out = self.model(input_ids=self.token, past_key_values=self.past, use_cache=True)
            self._sync()
            seconds = time.perf_counter() - start
        self.past, self.token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        self.tokens.append(int(self.token[0, 0]))
        return seconds

