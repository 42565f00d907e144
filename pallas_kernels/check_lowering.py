"""Lower every Pallas kernel for CUDA (and the Mosaic kernels for TPU) at realistic ClusterKV shapes, without a
GPU or TPU.

    python -m pallas_kernels.check_lowering

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` runs the Pallas → Triton lowering on the host:
each kernel becomes a `__gpu$xla.gpu.triton` custom call carrying the Triton IR (TTIR) as MLIR bytecode.
This script also parses that TTIR back and runs the MLIR verifier on it. The TTIR → TTGIR → PTX compilation
is XLA:GPU's, at compile time, and needs the CUDA plugin (jax-cuda*-plugin); see `--ptx` below for an
offline substitute.

The TPU kernels (`*_tpu`) are lowered with `lowering_platforms=("tpu",)`: each becomes one `tpu_custom_call`
carrying its Mosaic module (compiled by XLA:TPU at compile time, on a TPU).

Prints one line per kernel and shape; exits 1 if any lowering fails.

    python -m pallas_kernels.check_lowering --ptx /path/to/python-with-triton

goes one step further without a GPU: it hands the TTIR (as text) to `ttir_to_ptx.py` run by an interpreter
that has the PyPI `triton` package, which compiles it to PTX and cubin for sm80 and sm90 and reports
registers, spills, shared memory and tensor-core instructions.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect

from pallas_kernels.centroid_update import centroid_update
from pallas_kernels.centroid_update_tpu import centroid_update_tpu
from pallas_kernels.cluster_index import cluster_to_block_index
from pallas_kernels.cluster_index_tpu import cluster_to_block_index_tpu
from pallas_kernels.kmeans_assign import kmeans_assign
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.selected_attention import selected_attention
from pallas_kernels.selected_attention_tpu import selected_attention_tpu

TRITON_TARGET = "__gpu$xla.gpu.triton"


@dataclasses.dataclass
class TritonKernel:
    bytecode: bytes  # TTIR as MLIR bytecode
    num_warps: int
    num_stages: int
    text: str = ""  # TTIR as text, filled in by _verify_ttir


def _triton_kernels(lowered) -> list[TritonKernel]:
    """Every Triton custom call in a lowered StableHLO module: its TTIR and launch parameters."""
    found = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    if child.name == "stablehlo.custom_call":
                        target = ir.StringAttr(child.attributes["call_target_name"]).value
                        if target == TRITON_TARGET:
                            config = child.attributes["mhlo.backend_config"]
                            found.append(
                                TritonKernel(
                                    ir.StringAttr(config["ir"]).value_bytes,
                                    ir.IntegerAttr(config["num_warps"]).value,
                                    ir.IntegerAttr(config["num_stages"]).value,
                                )
                            )
                    walk(child)

    walk(lowered.compiler_ir("stablehlo").operation)
    return found


def _verify_ttir(kernel: TritonKernel) -> dict[str, int]:
    """Parse the TTIR, run the MLIR verifier, count a few op kinds."""
    ctx = mlir.make_ir_context()
    tt_dialect.register_dialect(ctx)
    ctx.load_all_available_dialects()
    with ctx:
        module = ir.Module.parse(kernel.bytecode)
        if not module.operation.verify():
            raise RuntimeError("Triton IR failed verification")
        kernel.text = str(module)
    # Ops print either as `tt.op ...` or in generic form `"tt.op"(...)`.
    ops = ("tt.dot", "tt.load", "tt.store", "tt.scan", "tt.reduce")
    return {op: kernel.text.count(f"{op} ") + kernel.text.count(f'"{op}"') for op in ops}


def _check(name: str, fn, *specs) -> list[TritonKernel] | None:
    shapes = ", ".join(f"{s.dtype.name}{list(s.shape)}" for s in specs)
    start = time.perf_counter()
    try:
        lowered = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
        text = lowered.as_text()
        kernels = _triton_kernels(lowered)
        if not kernels:
            raise RuntimeError(f"no {TRITON_TARGET} custom call in the lowered module")
        counts = [_verify_ttir(k) for k in kernels]
    except Exception:  # noqa: BLE001 - report every failure, then exit non-zero
        print(f"{name:38s} {shapes:52s} FAILED")
        traceback.print_exc()
        return None
    ops = " ".join(f"{k}={sum(c[k] for c in counts)}" for k in counts[0] if any(c[k] for c in counts))
    seconds = time.perf_counter() - start
    print(
        f"{name:38s} {shapes:52s} OK  stablehlo {len(text):6d} chars, {len(kernels)} triton kernel(s), "
        f"ttir {sum(len(k.bytecode) for k in kernels):6d} B verified [{ops}] ({seconds:.2f}s)"
    )
    return kernels


def _check_tpu(name: str, fn, *specs) -> bool:
    shapes = ", ".join(f"{s.dtype.name}{list(s.shape)}" for s in specs)
    start = time.perf_counter()
    try:
        text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("tpu",)).as_text()
        calls = text.count("tpu_custom_call")
        if not calls:
            raise RuntimeError("no tpu_custom_call in the lowered module")
    except Exception:  # noqa: BLE001 - report every failure, then exit non-zero
        print(f"{name:38s} {shapes:52s} FAILED (tpu)")
        traceback.print_exc()
        return False
    print(f"{name:38s} {shapes:52s} OK  stablehlo {len(text):6d} chars, {calls} mosaic kernel(s) for tpu "
          f"({time.perf_counter() - start:.2f}s)")
    return True


def _compile_ptx(python: str, named: list[tuple[str, TritonKernel]]) -> bool:
    """TTIR → PTX → cubin for sm80 and sm90 in `python` (an interpreter with the PyPI triton package)."""
    script = Path(__file__).with_name("ttir_to_ptx.py")
    sys.stdout.flush()
    with tempfile.TemporaryDirectory() as tmp:
        specs = []
        for i, (name, kernel) in enumerate(named):
            path = Path(tmp) / f"kernel{i}.ttir"
            path.write_text(kernel.text)
            specs.append(f"{name}={kernel.num_warps}/{kernel.num_stages}={path}")
        proc = subprocess.run([python, str(script), "--arch", "80,90", *specs], text=True)
    return proc.returncode == 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ptx",
        metavar="PYTHON",
        help="also compile the TTIR to PTX and cubin for sm80/sm90 with this interpreter (needs PyPI triton)",
    )
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, host backend {jax.default_backend()}; lowering for platform cuda")
    S = jax.ShapeDtypeStruct
    i32 = jnp.int32
    results = []  # (name, kernels or None)
    # P = KV heads 8 (× batch 1), N = S = 32768 tokens, C = 400 clusters, M = budget 1024.
    P, N, C, M = 8, 32768, 400, 1024
    for H in (128, 64):
        for dtype in (jnp.float32, jnp.bfloat16):
            name = f"centroid_update C={C}"
            fn = functools.partial(centroid_update, num_clusters=C)
            kernels = _check(name, fn, S((1, P, N, H), dtype), S((1, P, N), i32))  # [B, K, N, H]
            results.append((f"centroid_update {jnp.dtype(dtype).name} H={H}", kernels))
    # K-means' assignment of a 32k prompt's keys (float32 unit vectors) to 415 clusters (32,768 / 80 + slack).
    for H in (128, 64):
        for passes in (1, 3):
            fn = functools.partial(kmeans_assign, passes=passes)
            name = f"kmeans_assign C=415 passes={passes}"
            kernels = _check(name, fn, S((1, P, N, H), jnp.float32), S((1, P, N), jnp.bool_),
                             S((1, P, 415, H), jnp.float32), S((1, P, 415), jnp.bool_))
            results.append((f"{name} H={H}", kernels))
    # Per KV head (gqa "shared": ranked clusters [B, K, Mb]) and per query head (gqa "per_head": [B, K, G, Mb], 4 query
    # heads per KV head). B=1024 with 16 sinks, blocks of 16, 80 tokens per cluster: Mb = 63 + 13 + 4 = 80 slots.
    Mb = 80
    for group in (1, 4):
        name = f"cluster_to_block_index Mb={Mb} group={group}"
        fn = functools.partial(cluster_to_block_index, tokens=M - 16, slots=Mb, block_size=16)
        ranked = (1, P, group, Mb) if group > 1 else (1, P, Mb)
        kernels = _check(name, fn, S(ranked, i32), S(ranked, i32))
        results.append((name, kernels))
    # One layer's decode attention at Llama-3-8B geometry, 32k: the store of 8 KV heads as pages of 16 rows,
    # per query head (32 heads, 1 query each) and shared (8 heads, 4 queries each), 81 selected + 20 window pages.
    pages = 8 * (32768 + 4096) // 16
    for h, G in ((32, 1), (8, 4)):
        for dtype in (jnp.float32, jnp.bfloat16):
            name = f"selected_attention h={h} G={G}"
            kernels = _check(name, selected_attention, S((1, h, G, 128), dtype), S((pages, 16, 128), dtype),
                             S((pages, 16, 128), dtype), S((1, h, 101), i32), S((1, h, 101, 16), jnp.bool_))
            results.append((f"{name} {jnp.dtype(dtype).name}", kernels))
    # A full layer's decode attention (JAX's flash-decoding kernel) over `bench decode`'s 32k cache, both dtypes.
    for dtype in (jnp.float32, jnp.bfloat16):
        name = "decode_attention G=4 S=33280"
        kernels = _check(name, decode_attention, S((1, 8, 4, 128), dtype), S((1, 8, 33280, 128), dtype),
                         S((1, 8, 33280, 128), dtype), S((1, 8), i32))
        results.append((f"{name} {jnp.dtype(dtype).name}", kernels))
    ok = all(k is not None for _, k in results)
    print("all kernels lowered for cuda" if ok else "LOWERING FAILED")
    print("lowering for platform tpu")
    tpu_ok = True
    for H in (128, 64):
        for dtype in (jnp.float32, jnp.bfloat16):
            fn = functools.partial(centroid_update_tpu, num_clusters=C)
            tpu_ok &= _check_tpu(f"centroid_update_tpu {jnp.dtype(dtype).name} H={H}", fn,
                                 S((1, P, N, H), dtype), S((1, P, N), i32))
    for group in (1, 4):
        fn = functools.partial(cluster_to_block_index_tpu, tokens=M - 16, slots=Mb, block_size=16)
        ranked = (1, P, group, Mb) if group > 1 else (1, P, Mb)
        tpu_ok &= _check_tpu(f"cluster_to_block_index_tpu Mb={Mb} group={group}", fn, S(ranked, i32), S(ranked, i32))
    for h, G in ((32, 1), (8, 4)):
        for dtype in (jnp.float32, jnp.bfloat16):
            tpu_ok &= _check_tpu(f"selected_attention_tpu h={h} G={G} {jnp.dtype(dtype).name}", selected_attention_tpu,
                                 S((1, h, G, 128), dtype), S((pages, 16, 128), dtype), S((pages, 16, 128), dtype),
                                 S((1, h, 101), i32), S((1, h, 101, 16), jnp.bool_))
    print("all kernels lowered for tpu" if tpu_ok else "TPU LOWERING FAILED")
    if ok and args.ptx:
        ok = _compile_ptx(args.ptx, [(name, k) for name, ks in results for k in ks])
        print("all kernels compiled to cubin" if ok else "PTX COMPILATION FAILED")
    return 0 if ok and tpu_ok else 1


if __name__ == "__main__":
    sys.exit(main())
