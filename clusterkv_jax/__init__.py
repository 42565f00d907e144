"""clusterkv-jax: recallable KV-cache compression (ClusterKV) for long-context LLM inference in JAX."""

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it from here)

# The Ctrl-C handler of our command-line tools goes in first, before any import that takes time (`signal` builds its
# enums, `platform` reads the system): a SIGINT 50 ms after start landed in `import signal` and printed a traceback.
# `_signal` is the builtin module `signal` wraps.
import _signal
import os
import sys

#: What each command-line tool prints on Ctrl-C, whenever it comes.
CLUSTERKV_INTERRUPTED = "clusterkv: interrupted"
CONVERT_INTERRUPTED = "interrupted: nothing was written"
#: The command-line tools, as `python -m MODULE` or as a console script's name, and their Ctrl-C lines.
_COMMANDS = {"checkpoints_convert": CONVERT_INTERRUPTED, "clusterkv_jax.cli": CLUSTERKV_INTERRUPTED,
             "clusterkv": CLUSTERKV_INTERRUPTED}


_start_up_handler = None


def _exit_on_interrupt_until_running() -> None:
    """Inside one of our command-line tools (without --debug): from here until the command starts its work
    (`commands.run_reporting_errors` calls `handle_interrupts_in_python`), Ctrl-C ends the process at once with
    the tool's one line and 130, as it does once running. This covers the imports (JAX takes a second or more) and
    Python compiling the command's own modules on a first run, where a KeyboardInterrupt becomes a traceback, an
    ImportError from an extension, or a crash. Elsewhere (a library user) nothing changes."""
    global _start_up_handler
    argv = list(getattr(sys, "orig_argv", sys.argv))
    module = next((b for a, b in zip(argv, argv[1:]) if a == "-m"), None)
    line = _COMMANDS.get(module or os.path.basename(sys.argv[0]))
    if line is None or "--debug" in argv:
        return
    if _signal.getsignal(_signal.SIGINT) is not _signal.default_int_handler:  # the caller chose otherwise
        return

    def exit_now(signum, frame):
        os.write(2, (line + "\n").encode())
        os._exit(130)

    try:
        _signal.signal(_signal.SIGINT, exit_now)
    except ValueError:  # not the main thread: a library import, nothing to do
        return
    _start_up_handler = exit_now


def handle_interrupts_in_python() -> None:
    """Ctrl-C raises KeyboardInterrupt again (the running command catches it), where the start-up handler is set."""
    if _start_up_handler is not None and _signal.getsignal(_signal.SIGINT) is _start_up_handler:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)


_exit_on_interrupt_until_running()


import platform  # noqa: E402

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
# than XLA's (README, "On CPU"; docs/research_log.md, "YNNPACK's dots by CPU").
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



from clusterkv_jax.attend import DecodeProbe  # noqa: E402
from clusterkv_jax.cache import KVCache, init_cache, kv_bytes, layer_kv_bytes  # noqa: E402
from clusterkv_jax.config import ModelConfig, RopeScaling  # noqa: E402
from clusterkv_jax.generate import GenerationInterrupted, GenerationResult, generate  # noqa: E402
from clusterkv_jax.prompts import Prefilled, prefill_prompts  # noqa: E402
from clusterkv_jax.sampling import sample_tokens  # noqa: E402
from clusterkv_jax.steps import decode_step, prefill  # noqa: E402
from clusterkv_jax.loading import Model, load_model  # noqa: E402
from clusterkv_jax.policies import (ClusterKV, ClusterKVPaper, FullKV, InfiniGen, KVPolicy, OracleTopK, Quest,  # noqa: E402
                                    SnapKV, StreamingLLM)
from clusterkv_jax.selection import Selection  # noqa: E402
from clusterkv_jax.tokenizer import Tokenizer  # noqa: E402

__all__ = [
    "__version__",
    "ClusterKV",
    "ClusterKVPaper",
    "DecodeProbe",
    "FullKV",
    "InfiniGen",
    "OracleTopK",
    "Prefilled",
    "Quest",
    "SnapKV",
    "StreamingLLM",
    "GenerationInterrupted",
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
    "prefill_prompts",
    "sample_tokens",
]
