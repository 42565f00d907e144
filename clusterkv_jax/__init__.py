"""clusterkv-jax: recallable KV-cache compression (ClusterKV) for long-context LLM inference in JAX."""

from clusterkv_jax.cache import KVCache, init_cache, kv_bytes
from clusterkv_jax.config import ModelConfig, RopeScaling
from clusterkv_jax.generate import GenerationResult, decode_step, generate, prefill, sample_tokens
from clusterkv_jax.loading import Model, load_model
from clusterkv_jax.policies import ClusterKV, FullKV, KVPolicy, OracleTopK, Quest, StreamingLLM
from clusterkv_jax.tokenizer import Tokenizer

__all__ = [
    "ClusterKV",
    "FullKV",
    "OracleTopK",
    "Quest",
    "StreamingLLM",
    "GenerationResult",
    "KVCache",
    "KVPolicy",
    "Model",
    "ModelConfig",
    "RopeScaling",
    "Tokenizer",
    "decode_step",
    "generate",
    "init_cache",
    "kv_bytes",
    "load_model",
    "prefill",
    "sample_tokens",
]
