"""Model configuration read from an HF `config.json`.

Only fields that change the math are read. A field whose value we do not implement is refused with a
`ValueError` naming it, so a checkpoint never runs with silently wrong numerics.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


@dataclasses.dataclass(frozen=True)
class Family:
    """What an HF `model_type` changes in the one decoder layer (the way HF's `modeling_<family>.py` files differ)
    and how its checkpoints name the weights (read by `checkpoints_convert`).

    qkv_bias / o_bias: "config" (the config's `attention_bias`), "always" or "never". qk_norm: per-head RMSNorm of
    q and k before RoPE (Qwen3). post_norms: RMSNorm of the attention output and of the MLP output before each
    residual add (GLM-4-0414). rope_interleaved: RoPE rotates pairs of adjacent channels (GLM) instead of the two
    halves. fused_qkv / fused_gate_up: the checkpoint stores q, k, v (or gate, up) as one matrix, split at
    conversion."""

    qkv_bias: str = "config"
    o_bias: str = "config"
    qk_norm: bool = False
    post_norms: bool = False
    rope_interleaved: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    # HF's defaults where config.json says nothing.
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    # Which layers a config.json's `sliding_window` applies to: "none" (the family has no windows), "all" (Mistral,
    # Phi-3: every layer), "layer_types" (Qwen2, Qwen3: `use_sliding_window` turns it on, `layer_types` or
    # `max_window_layers` say which layers).
    windows: str = "none"
    sliding_window: int | None = None  # HF's default when config.json has no sliding_window key
    # Gemma: embeddings scaled by sqrt(hidden_size); norms scale by (1 + w) in float32; GeGLU (tanh GELU); norms
    # named input / post_attention / pre_feedforward / post_feedforward; scores scaled by query_pre_attn_scalar
    # and, where the config says, soft-capped (Gemma 2: attention 50, final logits 30); Gemma 3's sliding layers
    # use their own RoPE base. Defaults where config.json says nothing, as HF's configs have them.
    gemma: bool = False
    window_pattern: int = 0  # "pattern" windows: every window_pattern-th layer is full attention
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(windows="all", sliding_window=4096),
    "qwen2": Family(qkv_bias="always", o_bias="never", rms_norm_eps=1e-6, windows="layer_types"),
    "qwen3": Family(qk_norm=True, rms_norm_eps=1e-6, windows="layer_types"),
    "glm": Family(o_bias="never", rope_interleaved=True, fused_gate_up=True, rms_norm_eps=1.5625e-07,
                  attention_bias=True),
    "glm4": Family(o_bias="never", rope_interleaved=True, fused_gate_up=True, post_norms=True,
                   rms_norm_eps=1.5625e-07, attention_bias=True),
    "phi3": Family(qkv_bias="never", o_bias="never", fused_qkv=True, fused_gate_up=True, windows="all"),
    "gemma2": Family(post_norms=True, rms_norm_eps=1e-6, windows="pattern", sliding_window=4096, gemma=True,
                     window_pattern=2, tie_word_embeddings=True, head_dim=256, attn_logit_softcapping=50.0,
                     final_logit_softcapping=30.0),
    "gemma3_text": Family(qk_norm=True, post_norms=True, rms_norm_eps=1e-6, windows="pattern", sliding_window=4096,
                          gemma=True, window_pattern=6, tie_word_embeddings=True, head_dim=256),
}

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF `rope_scaling` / `rope_parameters`)."""

    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # llama3, yarn, longrope: the context the model was pretrained at.
    original_max_position_embeddings: int = 8192
    # yarn only: the band of dims between interpolation and extrapolation.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # yarn, longrope: cos and sin are scaled by it (1 for the other types).
    attention_factor: float = 1.0
    # longrope only: per-frequency divisors for sequences within / past the original context.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder of one of `FAMILIES`. Frozen and hashable: a static argument under `jax.jit`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (weights q_norm, k_norm [H])
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs before their residual adds
    rope_interleaved: bool = False  # RoPE rotates channel pairs (2i, 2i + 1), not halves
    partial_rotary_factor: float = 1.0  # RoPE rotates the first int(head_dim * this) channels
    # Layer types (HF's `layer_types`): a "sliding_attention" layer attends to the last `sliding_window` positions
    # (its own included), a "full_attention" layer to every position. Empty: every layer is full attention.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    local_rope_theta: float | None = None  # RoPE base of sliding layers (default RoPE; Gemma 3), else rope_theta's
    # Gemma (see `Family.gemma`):
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + w), in float32 when nonzero
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), in the parameters' dtype
    query_pre_attn_scalar: float | None = None  # scores are q.k / sqrt(this) (default: head_dim)
    attn_logit_softcapping: float | None = None  # scores become c * tanh(scores / c)
    final_logit_softcapping: float | None = None  # logits likewise
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            check_size(getattr(self, name), name)
        if self.num_layers > MAX_LAYERS:
            raise ValueError(f"num_layers={self.num_layers} is past {MAX_LAYERS}, more than any model has; the "
                             "config is wrong")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {', '.join(HIDDEN_ACTS)}, got {self.hidden_act!r}")
        for name in ("local_rope_theta", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a positive finite number or None, got {value!r}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
                raise ValueError(f"layer_types must give one of {', '.join(LAYER_TYPES)} for each of the "
                                 f"{self.num_layers} layers, got {list(self.layer_types)!r}")
            if SLIDING_ATTENTION in self.layer_types:
                check_size(self.sliding_window, "sliding_window")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or not self.rotary_dim:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must rotate an even, nonzero number "
                             f"of the head's {self.head_dim} channels")
        s = self.rope_scaling
        if s.rope_type == "longrope" and not len(s.short_factor) == len(s.long_factor) == self.rotary_dim // 2:
            raise ValueError(f"longrope short_factor and long_factor need {self.rotary_dim // 2} values each (half "
                             f"the rotated channels), got {len(s.short_factor)} and {len(s.long_factor)}")
        if s.rope_type == "dynamic" and self.rotary_dim <= 2:
            raise ValueError("dynamic rope scaling needs more than 2 rotated channels")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def windowed_layers(self, capacity: int) -> tuple[bool, ...]:
        """Per layer, whether its window binds in a cache of `capacity` positions: a sliding-attention layer whose
        window is shorter than the capacity. A window that never binds is full attention (Phi-3-128k's 262,144)."""
        return tuple(t == SLIDING_ATTENTION and self.sliding_window < capacity
                     for t in (self.layer_types or (FULL_ATTENTION,) * self.num_layers))

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (the first ones; HF's int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Builds a config from a parsed HF `config.json`, refusing any math-changing field we lack."""
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        family = FAMILIES[model_type]
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in hf:
                raise ValueError(f"config.json lacks required field {key!r}")
            check_size(hf[key], key)
        for key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
            if hf.get(key) is not None:
                check_size(hf[key], key)
        act = hf.get("hidden_activation") or hf.get("hidden_act") or ("gelu_pytorch_tanh" if family.gemma else "silu")
        act = "silu" if act == "swish" else act
        if act != ("gelu_pytorch_tanh" if family.gemma else "silu"):
            raise ValueError(f"unsupported hidden_act {act!r} for model_type {model_type!r}; implemented: "
                             f"{'gelu_pytorch_tanh (GeGLU)' if family.gemma else 'silu (SwiGLU)'}")
        if hf.get("use_bidirectional_attention"):
            raise ValueError("unsupported use_bidirectional_attention=True; only causal attention is implemented")
        if hf.get("mlp_bias"):
            raise ValueError("unsupported mlp_bias=True; MLP biases are not implemented")
        max_positions = int(hf.get("max_position_embeddings", 8192))
        window, layer_types = _layer_types(hf, family)
        if hf.get("quantization_config"):
            method = hf["quantization_config"].get("quant_method", "?")
            raise ValueError(f"unsupported quantization_config (quant_method={method!r}); convert from unquantized weights")

        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim") or family.head_dim or hidden // num_heads
        if hf.get("rope_scaling") and hf.get("rope_parameters"):
            # Both keys: transformers uses `rope_scaling` in place of `rope_parameters`, its theta the top-level
            # `rope_theta` or the default, never `rope_parameters`' (`PreTrainedConfig.convert_rope_params_to_dict`);
            # ignoring the scaling here left logits up to 3.2 away from HF's.
            hf = {**hf, "rope_parameters": None}
        rope_theta, rope_scaling, local_rope_theta = _parse_layer_ropes(hf, family)

        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        attention_bias = bool(hf.get("attention_bias", family.attention_bias))
        bias = lambda rule: {"config": attention_bias, "always": True, "never": False}[rule]  # noqa: E731
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=_number(hf.get("rms_norm_eps", family.rms_norm_eps), "rms_norm_eps"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", family.tie_word_embeddings)),
            qkv_bias=bias(family.qkv_bias),
            o_bias=bias(family.o_bias),
            qk_norm=family.qk_norm,
            post_norms=family.post_norms,
            rope_interleaved=family.rope_interleaved,
            partial_rotary_factor=_partial_rotary_factor(hf),
            layer_types=layer_types,
            sliding_window=window,
            local_rope_theta=local_rope_theta,
            hidden_act=act,
            norm_offset=1.0 if family.gemma else 0.0,
            embed_scale=family.gemma,
            query_pre_attn_scalar=(_number(hf.get("query_pre_attn_scalar", 256), "query_pre_attn_scalar")
                                   if family.gemma else None),
            attn_logit_softcapping=_optional_number(hf, "attn_logit_softcapping", family.attn_logit_softcapping),
            final_logit_softcapping=_optional_number(hf, "final_logit_softcapping", family.final_logit_softcapping),
            model_type=model_type,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=hf.get("pad_token_id"),
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "ModelConfig":
        """Reads `config.json` from a checkpoint directory."""
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in {os.fspath(path)!r}: not an HF or clusterkv checkpoint directory")
        return cls.from_hf_dict(read_json_object(cfg_path))


def read_json_object(path: str) -> dict[str, Any]:
    """A JSON object from `path`; a ValueError naming the file when it is not valid JSON or not an object."""
    with open(path, encoding="utf-8") as f:
        try:
            obj = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path!r} is not valid JSON: {error}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path!r} holds {type(obj).__name__} where a JSON object was expected")
    return obj


def _layer_types(hf: dict[str, Any], family: Family) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) as HF's model for the family reads them: () where every layer is full."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if family.windows == "none":
        if types and any(t != FULL_ATTENTION for t in types):
            raise ValueError(f"unsupported layer_types {sorted(set(map(str, types)))} for model_type "
                             f"{hf.get('model_type')!r}: its layers attend in full")
        return None, ()
    window = hf.get("sliding_window", family.sliding_window)
    if family.windows == "layer_types" and not hf.get("use_sliding_window", False):
        window = None  # HF's Qwen2/Qwen3 configs drop the window unless use_sliding_window
    if window is None and family.windows != "pattern":
        return None, ()
    check_size(window, "sliding_window")
    if family.windows == "all":
        return window, (SLIDING_ATTENTION,) * n
    if types is None and family.windows == "pattern":
        pattern = hf.get("sliding_window_pattern", family.window_pattern)
        check_size(pattern, "sliding_window_pattern")
        types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(n)]
    if types is None:
        first = hf.get("max_window_layers", 28)  # HF's rule: layers from max_window_layers on are windowed
        if isinstance(first, bool) or not isinstance(first, numbers.Integral) or first < 0:
            raise ValueError(f"max_window_layers must be an int >= 0, got {first!r}")
        types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(n)]
    if not isinstance(types, (list, tuple)):
        raise ValueError(f"layer_types must be a list, got {types!r}")
    return window, tuple(types)


def _optional_number(hf: dict[str, Any], key: str, default: float | None) -> float | None:
    value = hf.get(key, default)
    return None if value is None else _number(value, key)


def _parse_layer_ropes(hf: dict[str, Any], family: Family) -> tuple[float, RopeScaling, float | None]:
    """(rope_theta, rope_scaling, local_rope_theta): Gemma 3 gives its full and its sliding layers their own RoPE
    (transformers>=5: `rope_parameters` keyed by layer type; before: `rope_theta`, `rope_scaling` and
    `rope_local_base_freq`); other families one for all layers (local_rope_theta None)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and FULL_ATTENTION in params:
        local = params.get(SLIDING_ATTENTION) or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope_type {local.get('rope_type')!r} for sliding_attention layers; only "
                             "default")
        theta, scaling = _parse_rope({**hf, "rope_parameters": params[FULL_ATTENTION]})
        local_theta = local.get("rope_theta")
    elif hf.get("model_type") == "gemma3_text":
        theta, scaling = _parse_rope({"rope_theta": 1_000_000.0, **hf})
        local_theta = hf.get("rope_local_base_freq", 10_000.0)
    else:
        theta, scaling = _parse_rope(hf)
        return theta, scaling, None
    return theta, scaling, _number(local_theta if local_theta is not None else 10_000.0, "local rope_theta")


def _partial_rotary_factor(hf: dict[str, Any]) -> float:
    """transformers>=5 keeps it in `rope_parameters`; older configs (GLM-4-9B-chat-hf) at the top level."""
    params = hf.get("rope_parameters")
    value = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if value is None:
        value = hf.get("partial_rotary_factor", 1.0)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"partial_rotary_factor must be a number, got {value!r}") from None


def _parse_rope(hf: dict[str, Any]) -> tuple[float, RopeScaling]:
    """Reads RoPE settings from either transformers<5 (`rope_theta`, `rope_scaling`) or >=5 (`rope_parameters`)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = _number(params["rope_theta"], "rope_theta")
        scaling = params
    else:
        theta = _number(hf.get("rope_theta", 10000.0), "rope_theta")
        scaling = hf.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, RopeScaling()
    max_positions = int(hf.get("max_position_embeddings", 8192))
    original = scaling.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    if rope_type in ("yarn", "longrope") and original is None:
        raise ValueError(f"{rope_type} rope scaling lacks original_max_position_embeddings")
    factor = scaling.get("factor")
    if factor is None and rope_type in ("yarn", "longrope"):
        factor = max_positions / int(original)  # HF's rule when the factor is not given
    factor = _number(factor if factor is not None else 1.0, "rope scaling factor")
    if not factor > 0 or math.isinf(factor):
        raise ValueError(f"rope scaling factor must be positive, got {factor}")
    if rope_type in ("linear", "dynamic"):
        return theta, RopeScaling(rope_type=rope_type, factor=factor)
    if rope_type == "llama3":
        missing = [k for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                   if k not in scaling]
        if missing:
            raise ValueError(f"llama3 rope scaling lacks {', '.join(missing)}")
        return theta, RopeScaling(
            rope_type="llama3",
            factor=factor,
            low_freq_factor=_number(scaling["low_freq_factor"], "low_freq_factor"),
            high_freq_factor=_number(scaling["high_freq_factor"], "high_freq_factor"),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    attention_factor = scaling.get("attention_factor")
    if rope_type == "yarn":
        if attention_factor is None:
            mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
            yarn_mscale = lambda m=1.0: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0  # noqa: E731
            attention_factor = (yarn_mscale(mscale) / yarn_mscale(mscale_all_dim) if mscale and mscale_all_dim
                                else yarn_mscale())
        return theta, RopeScaling(
            rope_type="yarn", factor=factor, original_max_position_embeddings=int(original),
            beta_fast=_number(scaling.get("beta_fast") or 32, "beta_fast"),
            beta_slow=_number(scaling.get("beta_slow") or 1, "beta_slow"),
            truncate=bool(scaling.get("truncate", True)),
            attention_factor=_number(attention_factor, "attention_factor"))
    # longrope
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(int(original)))
    short, long = scaling.get("short_factor"), scaling.get("long_factor")
    if not isinstance(short, (list, tuple)) or not isinstance(long, (list, tuple)):
        raise ValueError("longrope rope scaling needs short_factor and long_factor lists")
    return theta, RopeScaling(
        rope_type="longrope", factor=factor, original_max_position_embeddings=int(original),
        attention_factor=_number(attention_factor, "attention_factor"),
        short_factor=tuple(_number(f, "short_factor") for f in short),
        long_factor=tuple(_number(f, "long_factor") for f in long))


#: More layers than any model has: a config past it is wrong (10**9 once made the converter build 8 GB of names).
MAX_LAYERS = 10_000
#: Sizes index int32 arrays.
MAX_SIZE = 2**31 - 1


def check_size(value: Any, name: str) -> None:
    """A size field: an integer (a JSON integer, not a bool, float or string) in [1, MAX_SIZE]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= MAX_SIZE:
        raise ValueError(f"{name} must be an int from 1 to {MAX_SIZE}, got {value!r}")


def _number(value: Any, name: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return number


# Published geometries (the models' HF config.json values) for benchmarks with random weights, where no small
# real model reaches the context or the head layout: `synthetic_config("llama3-8b", layers=4)`.
SYNTHETIC_GEOMETRIES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=131072,
                      rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)),
    "mistral-7b": dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, rope_theta=1000000.0, max_position_embeddings=32768),
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                      num_kv_heads=32, head_dim=128, max_position_embeddings=4096),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
                         tie_word_embeddings=True),
    # GLM-4-9B-chat-hf, the paper's accuracy model: 32 query heads share 2 KV heads; half of each head rotates.
    "glm4-9b": dict(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_layers=40, num_heads=32,
                    num_kv_heads=2, head_dim=128, rms_norm_eps=1.5625e-07, max_position_embeddings=131072,
                    qkv_bias=True, rope_interleaved=True, partial_rotary_factor=0.5, model_type="glm"),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                       num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       max_position_embeddings=32768, qkv_bias=True, model_type="qwen2"),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                     num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     max_position_embeddings=40960, qk_norm=True, model_type="qwen3"),
    # Gemma 3 12B (text): five local layers (window 1024, RoPE base 10^4) to each global one (base 10^6, linear x8).
    "gemma3-12b": dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_layers=48, num_heads=16,
                       num_kv_heads=8, head_dim=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       rope_scaling=RopeScaling("linear", 8.0), max_position_embeddings=131072,
                       tie_word_embeddings=True, qk_norm=True, post_norms=True,
                       layer_types=((SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,)) * 8, sliding_window=1024,
                       local_rope_theta=10000.0, hidden_act="gelu_pytorch_tanh", norm_offset=1.0, embed_scale=True,
                       query_pre_attn_scalar=256.0, model_type="gemma3_text"),
}


def synthetic_config(name: str, layers: int | None = None) -> ModelConfig:
    """The named geometry, optionally cut to `layers` layers (random weights make depth a free choice)."""
    if name not in SYNTHETIC_GEOMETRIES:
        raise ValueError(f"unknown geometry {name!r}; choose from {', '.join(SYNTHETIC_GEOMETRIES)}")
    fields = dict(SYNTHETIC_GEOMETRIES[name])
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        fields["num_layers"] = layers
        if fields.get("layer_types"):
            fields["layer_types"] = (fields["layer_types"] * layers)[:layers]  # the pattern, from layer 0 on
    return ModelConfig(**fields)
