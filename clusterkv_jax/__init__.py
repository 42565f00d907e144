"""clusterkv-jax: recallable KV-cache compression (ClusterKV) for long-context LLM inference in JAX."""

import os
import platform

# XLA:CPU flags we add to XLA_FLAGS, each unless you set it yourself. XLA reads them from the process-wide flags
# only (per-program compiler options do not reach the scheduler), so they take effect only if JAX has not started
# its backends yet; GPU and TPU ignore xla_cpu_* flags. Set CLUSTERKV_KEEP_XLA_FLAGS=1 to leave XLA_FLAGS alone.
#
# The concurrency-optimized HLO scheduler runs independent fusions side by side; on few cores (2 on the
# development machine, and on Colab's CPU runtime) that made the row gathers of a decode step 3-4x slower (one
# Llama-3-8B layer, ClusterKV at 8k: 24.1 -> 8.0 ms; full attention unchanged).
_SCHEDULER_FLAG = ("xla_cpu_enable_concurrency_optimized_scheduler", "false")
# On x86 CPUs without AVX-512 only: YNNPACK library fusions for reductions only, so float32 dots run on XLA's own
# kernels. jaxlib 0.10.2 sends dots to YNNPACK. On an AVX2 AMD EPYC its errors on SmolLM2's MLP down projections
# were 3-9x NumPy's, and the 512-token logits 2.1e-3 from a float64 HF forward (HF float32: 1.4e-4); with this
# flag 8.8e-5, for decode steps 2-4% slower. On an AVX-512 Intel Xeon, YNNPACK's dots erred within 1.5x of NumPy's
# (logits 1.4e-4 from float64; with the flag, 4.5e-4), and the flag cost full-KV decode steps 22% and prefill
# 3-5% (RESULTS.md, "YNNPACK's dots by CPU").
_YNN_FLAG = ("xla_cpu_experimental_ynn_fusion_type", "reduce")


def _cpu_features() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux); empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _with_cpu_flags(xla_flags: str, machine: str, cpu_features: frozenset[str]) -> str:
    """xla_flags with our XLA:CPU flags appended, each unless xla_flags names it already."""
    wanted = [_SCHEDULER_FLAG]
    if machine.lower() in ("x86_64", "amd64") and cpu_features and "avx512f" not in cpu_features:
        wanted.append(_YNN_FLAG)
    for name, value in wanted:
        if name not in xla_flags:
            xla_flags = f"{xla_flags} --{name}={value}".strip()
    return xla_flags


if not os.environ.get("CLUSTERKV_KEEP_XLA_FLAGS"):
    os.environ["XLA_FLAGS"] = _with_cpu_flags(os.environ.get("XLA_FLAGS", ""), platform.machine(), _cpu_features())

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
