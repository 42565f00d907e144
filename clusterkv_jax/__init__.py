"""clusterkv-jax: recallable KV-cache compression (ClusterKV) for long-context LLM inference in JAX."""

import os

# XLA:CPU's concurrency-optimized HLO scheduler runs independent fusions side by side; on few cores (2 on the
# development machine, and on Colab's CPU runtime) that made the row gathers of a decode step 3-4x slower
# (one Llama-3-8B layer, ClusterKV at 8k: 24.1 -> 8.0 ms; full attention unchanged). XLA reads it from the
# process-wide flags only (per-program compiler options do not reach the scheduler), so we add it to XLA_FLAGS
# unless you set it yourself; it takes effect only if JAX has not started its backends yet, and GPU / TPU
# ignore xla_cpu_* flags. Set CLUSTERKV_KEEP_XLA_FLAGS=1 to leave XLA_FLAGS alone.
_CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
if not os.environ.get("CLUSTERKV_KEEP_XLA_FLAGS") and "xla_cpu_enable_concurrency_optimized_scheduler" not in \
        os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_CPU_SCHEDULER_FLAG}".strip()

from clusterkv_jax.cache import KVCache, init_cache, kv_bytes  # noqa: E402
from clusterkv_jax.config import ModelConfig, RopeScaling  # noqa: E402
from clusterkv_jax.generate import GenerationResult, decode_step, generate, prefill, sample_tokens  # noqa: E402
from clusterkv_jax.loading import Model, load_model  # noqa: E402
from clusterkv_jax.policies import (  # noqa: E402
    ClusterKV, FullKV, InfiniGen, KVPolicy, OracleTopK, Quest, SnapKV, StreamingLLM)
from clusterkv_jax.tokenizer import Tokenizer  # noqa: E402

__all__ = [
    "ClusterKV",
    "FullKV",
    "InfiniGen",
    "OracleTopK",
    "Quest",
    "SnapKV",
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
