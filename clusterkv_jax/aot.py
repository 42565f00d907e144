"""Compile for an accelerator that is not attached (XLA's deviceless ahead-of-time compilation). Nothing runs.

    python -m clusterkv_jax.aot [--platform cuda|tpu] [--geometry llama3-8b --layers 4 --context 32768
                                --budget 1024 --batch 1]

compiles, for an H100 (sm90; `--platform cuda`) or a TPU v5e core (`--platform tpu`), the decode step of full
KV, ClusterKV and Quest as `generate` runs it, each with its KV in device memory and offloaded to pinned host
memory, the program that indexes their generated tokens between steps (once per window), and full KV's and
ClusterKV's prefill, with the kernels `kernels="auto"` picks there (on a TPU the Mosaic kernels, on an H100 the
Triton block indexing: `clusterkv_jax.kernels.AUTO_ON_GPU`; a prompt's attention in cuDNN's fused attention on the
H100 and in splash attention on the TPU: `kernels.prompt_attention`), and ClusterKV's decode step with every Pallas
kernel (`kernels="pallas"`), and prints one row per program: compile seconds, the fused kernels in it, device and host
memory, and the bytes XLA's cost analysis counts it accessing. This is the target's whole XLA pipeline (Triton
and ptxas for the GPU, Mosaic for the TPU): what would fail to compile on the device fails here. `make aot-cuda` / `make aot-tpu` install what each needs into a venv of its own (jax's
CUDA plugin of the same version, `jax-cuda12-pjrt`, ptxas from `nvidia-cuda-nvcc-cu12` and cuDNN from
`nvidia-cudnn-cu12`, without which cuDNN's attention does not lower and prompts attend in XLA; or libtpu via
`jax[tpu]`) and run this and `tests/test_aot.py`.

How: `jax.experimental.topologies.get_topology_desc` gives compile-only devices: for CUDA from an XLA GPU target
description (`H100_SXM`), for TPU from libtpu's topology names. In jaxlib 0.10.2 the CUDA ones have no memory
kinds, so a `pinned_host` argument cannot be placed on them (a sharding on them drops the kind). So we lower for
the target's platform from abstract values that carry their memory space (traced on the host CPU backend, which
has pinned_host), and compile that module with the target's compile-only client.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# XLA's GpuTargetConfigProto for an H100 SXM (from XLA's backends/gpu/target_config/specs/h100_sxm.txtpb), cut
# to the fields jaxlib 0.10.2's proto knows. Only what codegen reads matters: compute capability, limits, sizes.
H100_SXM = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

INSTALL_HINT = (
    "deviceless CUDA compilation needs jax's CUDA plugin of the installed jax version and ptxas: "
    "pip install jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v} nvidia-cuda-nvcc-cu12 nvidia-cudnn-cu12 (or run "
    "`make aot-cuda`)"
)


@functools.cache  # one device per target in a process: `compile_for_device` keeps programs by device
def cuda_target(spec: str = H100_SXM):
    """A compile-only CUDA device described by `spec` (GpuTargetConfigProto text). RuntimeError, saying what to
    install, when jax has no CUDA plugin here."""
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=spec, topology="1x1x1")
    except Exception as e:  # no plugin: RuntimeError / NotImplementedError / JaxRuntimeError, by version
        raise RuntimeError(f"{INSTALL_HINT.format(v=jax.__version__)} ({type(e).__name__}: {e})") from e
    return topology.devices[0]


@functools.cache  # and libtpu's topology takes seconds to describe
def tpu_target(topology: str = "v5e:2x2"):
    """A compile-only TPU core of `topology` (its first), from libtpu (`pip install jax[tpu]==<jax version>`)."""
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(topology, "tpu").devices[0]
    except Exception as e:
        raise RuntimeError(f"deviceless TPU compilation needs libtpu: pip install 'jax[tpu]=={jax.__version__}' "
                           f"(or run `make aot-tpu`) ({type(e).__name__}: {str(e)[:300]})") from e


def abstract(fn, *args, **kwargs):
    """The pytree fn(*args, **kwargs) would return (all arguments static), as `jax.ShapeDtypeStruct`s that keep
    their memory kind, pinned_host or device, on the host CPU backend: `jax.eval_shape` drops the kind. Allocates
    nothing. (Only a `NamedSharding` gives a struct's traced value its memory space.)"""
    # A fresh function each call: what it builds may depend on the target being compiled for (`compile_for`).
    traced = jax.jit(lambda *a, **k: fn(*a, **k), static_argnums=tuple(range(len(args))),
                     static_argnames=tuple(kwargs)).trace(*args, **kwargs)
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("host",))

    def struct(aval):
        kind = "pinned_host" if aval.memory_space == jax.memory.Space.Host else "device"
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                                    sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), kind))

    return jax.tree.unflatten(jax.tree.structure(traced.out_info), [struct(a) for a in traced.jaxpr.out_avals])


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One program compiled for the target: what it took and what it holds."""

    name: str
    seconds: float
    kernels: tuple[str, ...]  # the fused kernels in the program (`_kernels`; sorted, distinct)
    device_argument_bytes: int
    device_temp_bytes: int
    host_argument_bytes: int
    hlo: str  # the optimized HLO
    bytes_accessed: float | None = None  # XLA's cost analysis of the optimized program (None where it has none)

    @property
    def host_buffers(self) -> int:
        """How many instructions of the optimized HLO produce a buffer in host memory (memory space 5)."""
        return len(re.findall(r"\{[^{}]*S\(5\)[^{}]*\}", self.hlo))


def _kernels(hlo: str) -> tuple[str, ...]:
    """The fused kernels in a program: each Pallas custom call (Triton or Mosaic) by the function it was traced in
    (the innermost `jit(NAME)` or named call before `pallas_call` in its op_name, else its instruction's name:
    splash attention's), cuDNN's fused attention as "cudnn_fmha"."""
    names = set()
    for line in hlo.splitlines():
        if "__cudnn$fmha" in line:
            names.add("cudnn_fmha")
            continue
        if "__gpu$xla.gpu.triton" not in line and "tpu_custom_call" not in line:
            continue
        op = re.search(r'op_name="([^"]*)/pallas_call', line)
        if op:
            scopes = [s for s in op.group(1).split("/") if not s.startswith(("vmap(", "while", "cond", "branch"))]
            name = scopes[-1] if scopes else op.group(1)
            names.add(re.sub(r"^jit\((.*)\)$", r"\1", name))
        elif instruction := re.match(r"\s*(?:ROOT )?%([\w-]+?)(?:\.\d+)? = ", line):
            names.add(instruction.group(1))
    return tuple(sorted(names))


#: What `compile_for_device` compiled in this process, by target and StableHLO module: the same module compiled for
#: the same target again gives the same program, and compiling is most of a deviceless check's time (tests/test_aot.py
#: compiles ClusterKV's decode step in seven tests). Keyed by the lowered text, so a program traced under another
#: kernel choice or option is another entry. Bounded: the oldest entries go first.
_COMPILED: dict[tuple, Compiled] = {}
_COMPILED_KEPT = 64


def compile_for_device(name: str, jitted, device, *args, **kwargs) -> Compiled:
    """Traces `jitted` (a `jax.jit` function) on abstract args, choosing kernels for `device`, lowers it for the
    device's platform (cuda, tpu) and compiles it with the device's compile-only client (once per distinct module
    and target in a process: `_COMPILED`; `seconds` is then the first compile's)."""
    from jax._src.lib import xla_client  # the compile-only client's API is not public in jax 0.10.2

    from pallas_kernels.dispatch import compile_for

    start = time.perf_counter()
    with compile_for(device):
        platform = {"gpu": "cuda"}.get(device.platform, device.platform)
        lowered = jitted.trace(*args, **kwargs).lower(lowering_platforms=(platform,))
    module = lowered.compiler_ir("stablehlo")
    key = (device, str(module))  # the device object: its target description, not only its kind
    if key in _COMPILED:
        return dataclasses.replace(_COMPILED[key], name=name)
    options = xla_client.CompileOptions()
    executable = device.client.compile(module, executable_devices=xla_client.DeviceList((device,)),
                                       compile_options=options)
    seconds = time.perf_counter() - start
    stats = executable.get_compiled_memory_stats()
    hlo = "\n".join(m.to_string() for m in executable.hlo_modules())
    compiled = Compiled(name=name, seconds=seconds, kernels=_kernels(hlo),
                        device_argument_bytes=stats.argument_size_in_bytes, device_temp_bytes=stats.temp_size_in_bytes,
                        host_argument_bytes=stats.host_argument_size_in_bytes, hlo=hlo,
                        bytes_accessed=_bytes_accessed(executable))
    _COMPILED[key] = compiled
    while len(_COMPILED) > _COMPILED_KEPT:
        del _COMPILED[next(iter(_COMPILED))]
    return compiled


def _bytes_accessed(executable) -> float | None:
    """The "bytes accessed" of XLA's cost analysis (`HloCostAnalysis`) of the optimized program: what its
    instructions read and write, each fusion counted by its operands and results, a custom call (a Pallas kernel
    among them) likewise. XLA's count, not the device's traffic: an in-place update counts its whole buffer read and
    written, and a while loop's body (the scanned layers on a TPU) counts once. The compile-only client has no cost
    analysis of its own, so the host CPU backend's runs on the target's optimized HLO (sizes are the same on every
    backend). None where that fails."""
    from jax._src.lib import _jax  # not public in jax 0.10.2

    try:
        cpu = jax.devices("cpu")[0].client
        return float(sum(_jax.hlo_module_cost_analysis(cpu, m).get("bytes accessed", 0.0)
                         for m in executable.hlo_modules()))
    except Exception:  # noqa: BLE001 -- a jax without this entry point, or a module it cannot analyse
        return None


def target_cache(config, policy, *, device, batch: int, context: int, decode_room: int = 64, dtype=jnp.bfloat16):
    """The abstract cache `model_programs` compiles a decode step with: `context + decode_room` tokens sized as
    `generate` sizes them (`cache_capacity`), laid out for `device` (a GPU's holds each layer in a group of its
    own: `cache.plan_layers`)."""
    from clusterkv_jax.cache import init_cache
    from clusterkv_jax.steps import cache_capacity
    from pallas_kernels.dispatch import compile_for

    with compile_for(device):
        return abstract(init_cache, config, policy, batch, cache_capacity(context, decode_room), dtype)


def model_programs(config, policies: dict, *, device, batch: int, context: int, decode_room: int = 64,
                   dtype=jnp.bfloat16, prefill: tuple[str, ...] = (), index: tuple[str, ...] = (),
                   chunk: int | None = None) -> list[Compiled]:
    """Compiles `steps.decode_step` for each named policy as `generate`'s decode loop runs it (`index=False`:
    the windows of generated tokens are indexed between runs of steps, once per `window_size` steps; a cache of
    `context + decode_room` tokens, sized as `generate` sizes it: `cache_capacity`), for the names in `index` the
    program that indexes them between steps (`steps.index_due_windows`: ClusterKV's decode-time K-means), and
    `steps.prefill` of a `context`-token prompt for the names in `prefill` (in chunks of `chunk` tokens, if given)."""
    from clusterkv_jax.steps import decode_step, index_due_windows
    from clusterkv_jax.steps import prefill as prefill_step
    from clusterkv_jax.model import for_device, init_params
    from pallas_kernels.dispatch import compile_for

    with compile_for(device):  # the parameters and the cache in the layout the target's layer loop reads
        params = jax.eval_shape(lambda: for_device(init_params(config, jax.random.key(0), dtype)))
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    out = []
    for name, policy in policies.items():
        cache = target_cache(config, policy, device=device, batch=batch, context=context, decode_room=decode_room,
                             dtype=dtype)
        out.append(compile_for_device(f"decode {name}", decode_step, device, params, tokens, cache,
                                      config=config, policy=policy, index=False))
        if name in index:
            out.append(compile_for_device(f"index {name}", index_due_windows, device, cache, config=config,
                                          policy=policy))
        if name in prefill:
            prompt = jax.ShapeDtypeStruct((batch, context), jnp.int32)
            out.append(compile_for_device(f"prefill {name}", prefill_step, device, params, prompt, tokens, cache,
                                          config=config, policy=policy, chunk=chunk))
    return out


def prefilled_program(config, policy, *, device, batch: int, context: int, decode_room: int = 64,
                      dtype=jnp.bfloat16) -> Compiled:
    """Compiles `decode_loop.start_prefilled` for `policy`: its cache filled from a full-KV prefill of a
    `context`-token prompt (`generate(..., prefilled=)`) and the first token sampled."""
    from clusterkv_jax.decode_loop import start_prefilled
    from clusterkv_jax.policies import FullKV
    from clusterkv_jax.policies.full import FullKVKeepingQueries
    from clusterkv_jax.sampling import Sampling

    n = policy.prompt_queries
    source = FullKVKeepingQueries(prompt_queries=n) if n else FullKV()
    full = target_cache(config, source, device=device, batch=batch, context=context, decode_room=decode_room,
                        dtype=dtype)
    logits = jax.ShapeDtypeStruct((batch, config.vocab_size), jnp.float32)
    sampling = jax.eval_shape(lambda: Sampling.make(0.0, 0, 1.0))
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    ids = jax.ShapeDtypeStruct((1,), jnp.int32)
    return compile_for_device(f"prefilled {type(policy).__name__}", start_prefilled, device, full, logits, sampling,
                              key, ids, jax.ShapeDtypeStruct((), jnp.int32), config=config, policy=policy,
                              max_new_tokens=decode_room)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", default="llama3-8b", help="a synthetic geometry (clusterkv_jax.config)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--platform", choices=("cuda", "tpu"), default="cuda",
                        help="cuda: an H100 (jax's CUDA plugin); tpu: a v5e core (libtpu)")
    args = parser.parse_args(argv)

    from clusterkv_jax.config import synthetic_config
    from clusterkv_jax.policies import ClusterKV, FullKV, Quest

    try:
        device = cuda_target() if args.platform == "cuda" else tpu_target()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = synthetic_config(args.geometry, layers=args.layers)
    B = args.budget
    policies = {
        "full": FullKV(), "full offloaded": FullKV(offload=True),
        f"clusterkv@{B}": ClusterKV(budget=B), f"clusterkv@{B} shared": ClusterKV(budget=B, gqa="shared"),
        f"clusterkv@{B} offloaded": ClusterKV(budget=B, offload=True),
        f"clusterkv@{B} kernels=pallas": ClusterKV(budget=B, kernels="pallas"),
        f"quest@{B}": Quest(budget=B), f"quest@{B} offloaded": Quest(budget=B, offload=True),
    }
    cc = f" (compute capability {device.compute_capability})" if args.platform == "cuda" else ""
    print(f"target {device.device_kind}{cc}, jax {jax.__version__}; "
          f"{args.geometry} x {args.layers} layers, batch {args.batch}, context {args.context}, bfloat16")
    print("| program | compile s | fused kernels | host-memory buffers | device args MB | device temp MB | host args MB "
          "| MB accessed |")
    print("|---|---|---|---|---|---|---|---|")
    failed = 0
    for name, policy in policies.items():
        try:
            results = model_programs(config, {name: policy}, device=device, batch=args.batch, context=args.context,
                                     prefill=("full", f"clusterkv@{B}", f"clusterkv@{B} offloaded"),
                                     index=(f"clusterkv@{B}", f"clusterkv@{B} kernels=pallas",
                                            f"quest@{B}"))
        except Exception as e:  # report every program, then fail
            failed += 1
            print(f"| decode {name} | FAILED: {type(e).__name__}: {str(e)[:500]} |", flush=True)
            continue
        for r in results:
            print(f"| {r.name} | {r.seconds:.1f} | {', '.join(r.kernels) or '-'} | {r.host_buffers} | "
                  f"{r.device_argument_bytes / 1e6:.0f} | {r.device_temp_bytes / 1e6:.0f} | "
                  f"{r.host_argument_bytes / 1e6:.0f} | "
                  f"{'-' if r.bytes_accessed is None else f'{r.bytes_accessed / 1e6:.0f}'} |", flush=True)
    print("all programs compiled" if not failed else f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
