"""Sampling the next token from a step's logits: greedy, temperature, top-k and nucleus (top-p).

The settings are traced values (`Sampling`), so changing them does not recompile a program that samples.
"""

from __future__ import annotations

import numbers

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Sampling:
    """Traced sampling settings. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @classmethod
    def make(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> "Sampling":
        for name, value in (("temperature", temperature), ("top_p", top_p)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {value!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
            raise TypeError(f"top_k must be an int (0: no top-k filter), got {top_k!r}")
        if not temperature >= 0:  # NaN too
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))


def sample_tokens(logits: jax.Array, sampling: Sampling, key: jax.Array) -> jax.Array:
    """logits [B, V] -> next tokens [B]: greedy, or temperature sampling within top-k and nucleus top-p."""
    V = logits.shape[-1]
    scaled = logits / jnp.maximum(sampling.temperature, 1e-6)
    # [B, V] descending
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(sampling.top_k > 0, jnp.minimum(sampling.top_k, V), V)
    kth_largest = sorted_desc[:, k - 1][:, None]
    sorted_topk = jnp.where(jnp.arange(V) < k, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_topk, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always).
    keep = (jnp.cumsum(probs, axis=-1) - probs) < sampling.top_p
    nucleus_min = jnp.min(jnp.where(keep, sorted_topk, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.maximum(kth_largest, nucleus_min)
    filtered = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    sampled = jax.random.categorical(key, filtered, axis=-1)
    return jnp.where(sampling.temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
