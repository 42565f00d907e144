"""Lower every Pallas kernel for CUDA at realistic ClusterKV shapes, without a GPU.

    python -m pallas_kernels.check_lowering

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` runs the Pallas → Triton lowering on the host:
each kernel becomes a `__gpu$xla.gpu.triton` custom call carrying the Triton IR (TTIR) as MLIR bytecode.
This script also parses that TTIR back and runs the MLIR verifier on it. What it cannot do without the CUDA
plugin (jax-cuda*-plugin): the TTIR → TTGIR → PTX compilation, which XLA:GPU runs at compile time (register
allocation, shared-memory limits and the like are only checked there).

Prints one line per kernel and shape; exits 1 if any lowering fails.
"""

from __future__ import annotations

import functools
import sys
import time
import traceback

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect

from pallas_kernels.centroid_update import centroid_update
from pallas_kernels.cluster_index import cluster_to_token_index

TRITON_TARGET = "__gpu$xla.gpu.triton"


def _triton_modules(lowered) -> list[bytes]:
    """TTIR bytecode of every Triton custom call in a lowered StableHLO module."""
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
                            found.append(ir.StringAttr(config["ir"]).value_bytes)
                    walk(child)

    walk(lowered.compiler_ir("stablehlo").operation)
    return found


def _verify_ttir(bytecode: bytes) -> dict[str, int]:
    """Parse TTIR bytecode, run the MLIR verifier, count a few op kinds."""
    ctx = mlir.make_ir_context()
    tt_dialect.register_dialect(ctx)
    ctx.load_all_available_dialects()
    with ctx:
        module = ir.Module.parse(bytecode)
        if not module.operation.verify():
            raise RuntimeError("Triton IR failed verification")
        text = str(module)
    # Ops print either as `tt.op ...` or in generic form `"tt.op"(...)`.
    ops = ("tt.dot", "tt.load", "tt.store", "tt.scan", "tt.reduce")
    return {op: text.count(f"{op} ") + text.count(f'"{op}"') for op in ops}


def _check(name: str, fn, *specs) -> bool:
    shapes = ", ".join(f"{s.dtype.name}{list(s.shape)}" for s in specs)
    start = time.perf_counter()
    try:
        lowered = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
        text = lowered.as_text()
        modules = _triton_modules(lowered)
        if not modules:
            raise RuntimeError(f"no {TRITON_TARGET} custom call in the lowered module")
        counts = [_verify_ttir(m) for m in modules]
    except Exception:  # noqa: BLE001 - report every failure, then exit non-zero
        print(f"{name:38s} {shapes:52s} FAILED")
        traceback.print_exc()
        return False
    ops = " ".join(f"{k}={sum(c[k] for c in counts)}" for k in counts[0] if any(c[k] for c in counts))
    seconds = time.perf_counter() - start
    print(
        f"{name:38s} {shapes:52s} OK  stablehlo {len(text):6d} chars, "
        f"{len(modules)} triton kernel(s), ttir {sum(map(len, modules)):6d} B verified [{ops}] ({seconds:.2f}s)"
    )
    return True


def main() -> int:
    print(f"jax {jax.__version__}, host backend {jax.default_backend()}; lowering for platform cuda")
    S = jax.ShapeDtypeStruct
    i32 = jnp.int32
    ok = True
    # P = KV heads 8 (× batch 1), N = S = 32768 tokens, C = 400 clusters, M = budget 1024.
    P, N, C, M = 8, 32768, 400, 1024
    for H in (128, 64):
        for dtype in (jnp.float32, jnp.bfloat16):
            ok &= _check(
                f"centroid_update C={C}",
                functools.partial(centroid_update, num_clusters=C),
                S((P, N, H), dtype),
                S((P, N), i32),
            )
    # Per KV head (gqa "shared"), and per query head (gqa "per_head", 4 query heads per KV head).
    for group in (1, 4):
        ok &= _check(
            f"cluster_to_token_index M={M} group={group}",
            functools.partial(cluster_to_token_index, slots=M, group=group),
            S((group * P, C), i32),
            S((group * P, C), i32),
            S((P, N), i32),
        )
    print("all kernels lowered for cuda" if ok else "LOWERING FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
