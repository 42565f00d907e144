"""clusterkv-jax: recallable KV-cache compression (ClusterKV) for long-context LLM inference in JAX."""

import os
import platform

# XLA:CPU flags we add to XLA_FLAGS, each unless you set it yourself. XLA reads them from the process-wide flags
# only (per-program compiler options do not reach the scheduler), so they take effect only if JAX has not started
# its backends yet; GPU and TPU ignore xla_cpu_* flags. Set CLUSTERKV_KEEP_XLA_FLAGS=1 to leave XLA_FLAGS alone.
#
# The concurrency-optimized HLO scheduler runs independent fusions side by side; on few cores (the development
# machines, Colab's CPU runtime) that made the row gathers of a decode step several times slower.
_SCHEDULER_FLAG = ("xla_cpu_enable_concurrency_optimized_scheduler", "false")
# On x86 CPUs without AVX-512 only: YNNPACK library fusions for reductions only, so float32 dots run on XLA's own
# kernels. jaxlib 0.10.2 sends dots to YNNPACK, whose float32 dots erred several times more than NumPy's on
# an AVX2 machine (enough to move SmolLM2's logits past HF's), while on AVX-512 they were as accurate and faster
# than XLA's (README, "On CPU"; RESULTS.md, "YNNPACK's dots by CPU").
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

from clusterkv_jax.cache import KVCache, init_cache, kv_bytes, layer_kv_bytes  # noqa: E402
from clusterkv_jax.config import ModelConfig, RopeScaling  # noqa: E402
from clusterkv_jax.generate import GenerationResult, decode_step, generate, prefill, sample_tokens  # noqa: E402
from clusterkv_jax.loading import Model, load_model  # noqa: E402
from clusterkv_jax.policies import (  # noqa: E402
    ClusterKV, FullKV, InfiniGen, KVPolicy, OracleTopK, Quest, SnapKV, StreamingLLM)
from clusterkv_jax.selection import Selection  # noqa: E402
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
    "Selection",
    "Tokenizer",
    "decode_step",
    "generate",
    "init_cache",
    "kv_bytes",
    "layer_kv_bytes",
    "load_model",
    "prefill",
    "sample_tokens",
]
