"""Rotary position embeddings, as HF transformers computes them (`modeling_rope_utils.py`): the frequencies of each
RoPE type, the attention factor that scales cos and sin, and the rotation of the first `rotary_dim` channels
(halves, or GLM's interleaved pairs).

Types: "default", "linear", "llama3" and "yarn" have fixed frequencies. "longrope" (Phi-3-128k) and "dynamic"
(NTK) depend on the sequence's length: HF chooses them per forward call from the largest position in it, which
for one sequence is its length in a prefill and its position + 1 in a decode step; here that is decided per
sequence (`seq_lens`), so a sequence rotates alike alone or in a batch. Keys stay as they were rotated when
stored, as in HF's cache.

Shapes: B batch, T tokens, r = rotary_dim / 2 frequencies.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from clusterkv_jax.config import ModelConfig, RopeScaling

#: RoPE types whose frequencies depend on the sequence's length.
LENGTH_DEPENDENT = ("longrope", "dynamic")


def inv_freq(config: ModelConfig, seq_lens: jax.Array | None = None) -> jax.Array:
    """Inverse frequencies: [r] for the fixed types; [B, r] for the length-dependent ones (`seq_lens` [B]: each
    sequence's length as HF would see it in this call)."""
    s, dim = config.rope_scaling, config.rotary_dim
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    base = config.rope_theta ** exponents  # [r]
    if s.rope_type == "linear":
        return 1.0 / (s.factor * base)
    if s.rope_type == "llama3":
        freq = 1.0 / base
        old_len = s.original_max_position_embeddings
        low_freq_wavelen = old_len / s.low_freq_factor
        high_freq_wavelen = old_len / s.high_freq_factor
        wavelen = 2 * math.pi / freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
        scaled = jnp.where(wavelen > low_freq_wavelen, freq / s.factor, freq)
        smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return jnp.where(is_medium, smoothed, scaled)
    if s.rope_type == "yarn":
        return _yarn(config, base)
    if s.rope_type in LENGTH_DEPENDENT:
        if seq_lens is None:
            raise ValueError(f"RoPE type {s.rope_type!r} needs each sequence's length")
        seq_lens = seq_lens.astype(jnp.float32)[:, None]
        if s.rope_type == "longrope":
            short = 1.0 / (jnp.asarray(s.short_factor, jnp.float32) * base)
            long = 1.0 / (jnp.asarray(s.long_factor, jnp.float32) * base)
            return jnp.where(seq_lens > s.original_max_position_embeddings, long, short)
        # dynamic NTK: the base grows with the sequence past max_position_embeddings
        limit = float(config.max_position_embeddings)
        grown = config.rope_theta * ((s.factor * jnp.maximum(seq_lens, limit) / limit) - (s.factor - 1)) ** (
            dim / (dim - 2))
        return 1.0 / (grown ** exponents)
    return 1.0 / base


def _yarn(config: ModelConfig, base: jax.Array) -> jax.Array:
    """YaRN: frequencies interpolated by `factor` below a band of dims, kept above it, a linear ramp between."""
    s, dim = config.rope_scaling, config.rotary_dim

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(config.rope_theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp
    return (1.0 / (s.factor * base)) * (1.0 - extrapolation) + (1.0 / base) * extrapolation


def tables(config: ModelConfig, positions: jax.Array, seq_lens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B, T, r] (float32, times the RoPE type's attention factor) for positions [B, T] of sequences
    whose lengths, as HF sees them in this call, are seq_lens [B]."""
    freq = inv_freq(config, seq_lens)
    if freq.ndim == 2:
        freq = freq[:, None, :]
    angles = positions[..., None].astype(jnp.float32) * freq
    factor = config.rope_scaling.attention_factor
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def local_tables(config: ModelConfig, positions: jax.Array, seq_lens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`tables` for the sliding layers of a model that gives them their own RoPE base (Gemma 3:
    `local_rope_theta`, default RoPE); the global tables where it does not."""
    if config.local_rope_theta is None:
        return tables(config, positions, seq_lens)
    local = dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=RopeScaling())
    return tables(local, positions, seq_lens)


def apply(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool = False) -> jax.Array:
    """Rotates the first 2r channels of x [B, T, heads, H] by cos, sin [B, T, r]: channel i of the first half with
    channel i of the second (HF's rotate-half layout) or, `interleaved`, channel 2i with 2i + 1 (GLM's); the
    other channels pass unchanged."""
    cos, sin = cos[..., None, :], sin[..., None, :]
    rot = 2 * cos.shape[-1]
    x32 = x.astype(jnp.float32)
    x_rot, x_pass = x32[..., :rot], x32[..., rot:]
    if interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x_rot.shape)
    else:
        x1, x2 = jnp.split(x_rot, 2, axis=-1)
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rotated, x_pass], axis=-1).astype(x.dtype)
