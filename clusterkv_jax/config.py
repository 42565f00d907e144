"""Model configuration read from an HF `config.json`.

Only fields that change the math are read. A field whose value we do not implement is refused with a
`ValueError` naming it, so a checkpoint never runs with silently wrong numerics.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF `rope_scaling` / `rope_parameters`)."""

    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder. Frozen and hashable: a static argument under `jax.jit`."""

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
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Builds a config from a parsed HF `config.json`, refusing any math-changing field we lack."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in hf:
                raise ValueError(f"config.json lacks required field {key!r}")
        act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is implemented")
        if hf.get("mlp_bias"):
            raise ValueError("unsupported mlp_bias=True; MLP biases are not implemented")
        if hf.get("use_sliding_window") or (model_type == "mistral" and hf.get("sliding_window")):
            raise ValueError(
                f"unsupported sliding_window={hf.get('sliding_window')!r}; sliding-window attention is not implemented"
            )
        if hf.get("layer_types") and any(t != "full_attention" for t in hf["layer_types"]):
            raise ValueError(f"unsupported layer_types {sorted(set(hf['layer_types']))}; only full_attention")
        if hf.get("quantization_config"):
            method = hf["quantization_config"].get("quant_method", "?")
            raise ValueError(f"unsupported quantization_config (quant_method={method!r}); convert from unquantized weights")

        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden // num_heads
        rope_theta, rope_scaling = _parse_rope(hf)

        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6 if model_type == "qwen2" else 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
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


def _parse_rope(hf: dict[str, Any]) -> tuple[float, RopeScaling]:
    """Reads RoPE settings from either transformers<5 (`rope_theta`, `rope_scaling`) or >=5 (`rope_parameters`)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = params
    else:
        theta = float(hf.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, RopeScaling()
    factor = float(scaling.get("factor", 1.0))
    if not factor > 0 or math.isinf(factor):
        raise ValueError(f"rope scaling factor must be positive, got {factor}")
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=factor)
    missing = [k for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings") if k not in scaling]
    if missing:
        raise ValueError(f"llama3 rope scaling lacks {', '.join(missing)}")
    return theta, RopeScaling(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


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
    return ModelConfig(**fields)
