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
    """This device's memory bandwidth in bytes/s, the best of a read (sum) and a read+write (scale) of
    `nbytes`, each the fastest of `repeats` runs."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    read = jax.jit(lambda a: jnp.sum(a))
    scale = jax.jit(lambda a: a * 1.5)

    def best(fn, moved):
        jax.block_until_ready(fn(x))  # compile
        return moved / min(timed(fn, x)[1] for _ in range(repeats))

    out = {"read_Bps": best(read, nbytes), "copy_Bps": best(scale, 2 * nbytes)}
    out["bandwidth_Bps"] = max(out.values())
    return out
