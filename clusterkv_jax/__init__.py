"""clusterkv-jax: recallable KV-cache compression (ClusterKV) for long-context LLM inference in JAX."""

import os

# XLA:CPU flags we add to XLA_FLAGS, each unless you set it yourself. XLA reads them from the process-wide flags
# only (per-program compiler options do not reach the scheduler), so they take effect only if JAX has not started
# its backends yet; GPU and TPU ignore xla_cpu_* flags. Set CLUSTERKV_KEEP_XLA_FLAGS=1 to leave XLA_FLAGS alone.
_CPU_FLAGS = {
    # The concurrency-optimized HLO scheduler runs independent fusions side by side; on few cores (2 on the
    # development machine, and on Colab's CPU runtime) that made the row gathers of a decode step 3-4x slower
    # (one Llama-3-8B layer, ClusterKV at 8k: 24.1 -> 8.0 ms; full attention unchanged).
    "xla_cpu_enable_concurrency_optimized_scheduler": "false",
    # YNNPACK library fusions for reductions only, so float32 dots run on XLA's own kernels. jaxlib 0.10.2 sends
    # dots to YNNPACK by default; on an AVX2 AMD EPYC its errors on SmolLM2's MLP down projections were 3-9x
    # NumPy's and torch's, and the 512-token logits were 2.1e-3 from a float64 HF forward (HF float32: 1.4e-4);
    # with this flag, 8.8e-5. Its cost there: prefill unchanged, decode steps 2-4% slower (RESULTS.md).
    "xla_cpu_experimental_ynn_fusion_type": "reduce",
}
if not os.environ.get("CLUSTERKV_KEEP_XLA_FLAGS"):
    _flags = os.environ.get("XLA_FLAGS", "")
    for _name, _value in _CPU_FLAGS.items():
        if _name not in _flags:
            _flags = f"{_flags} --{_name}={_value}".strip()
    os.environ["XLA_FLAGS"] = _flags
    del _flags, _name, _value

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
