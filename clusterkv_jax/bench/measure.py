"""Timing helpers and this device's memory bandwidth."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def timed(fn, *args):
    """(fn(*args) once ready, its wall seconds)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def compiled(fn, *args, **static):
    """(AOT-compiled jitted fn for these argument shapes, compile seconds)."""
    start = time.perf_counter()
    exe = fn.lower(*args, **static).compile()
    return exe, time.perf_counter() - start


def measure_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> dict[str, float]:
    """This device's memory bandwidth in bytes/s: the best of a read (sum), a read+write (scale) and a
    vector-matrix product over a bfloat16 matrix (what a decode step does with its weights), each of `nbytes` and
    the fastest of `repeats` runs. On an H200 the sum read 2.4-2.8 TB/s while a decode step's unrolled weight pass
    read 3.4 TB/s: the sum alone made every row's multiple of its roofline look better than it was."""
    def best(fn, moved, *args):
        jax.block_until_ready(fn(*args))  # compile
        return moved / min(timed(fn, *args)[1] for _ in range(repeats))

    x = jnp.ones((nbytes // 4,), jnp.float32)
    out = {"read_Bps": best(jax.jit(lambda a: jnp.sum(a)), nbytes, x),
           "copy_Bps": best(jax.jit(lambda a: a * 1.5), 2 * nbytes, x)}
    del x  # one probe's array at a time
    matrix = jnp.ones((nbytes // 2 // 4096, 4096), jnp.bfloat16)
    out["matvec_Bps"] = best(jax.jit(lambda v, m: v @ m), matrix.nbytes, jnp.ones((1, matrix.shape[0]), jnp.bfloat16),
                             matrix)
    out["bandwidth_Bps"] = max(out.values())
    return out
