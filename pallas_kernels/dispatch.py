"""Which device the kernels are chosen for, what it can run, and how a one-problem kernel is mapped.

The kernels are Pallas *Triton* kernels: they compile only for an NVIDIA GPU of compute capability >= 8.0
(Ampere or newer: bfloat16 matrix units). Anywhere else they run only in interpret mode (slow; for tests).
On a TPU (`on_tpu`) their Mosaic versions (`*_tpu`) run instead. The choice itself is made in one place,
`clusterkv_jax.kernels.resolve`.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

MIN_COMPUTE_CAPABILITY = 8.0

_compile_targets: list = []  # innermost last; see `compile_for`


@contextlib.contextmanager
def compile_for(device):
    """Choose kernels for `device` instead of the first JAX device while tracing inside this block: for
    ahead-of-time compilation to a device that is not attached, e.g. a compile-only H100 from
    `jax.experimental.topologies.get_topology_desc` (see `clusterkv_jax.aot`). Trace with `jit(...).trace`
    in a process that has not traced the same function for the attached device (a jit cache hit would keep
    the kernels chosen then)."""
    _compile_targets.append(device)
    try:
        yield device
    finally:
        _compile_targets.pop()


def _target_device():
    """The device kernels are chosen for: the innermost `compile_for` device, else the first JAX device
    (RuntimeError when there is none)."""
    return _compile_targets[-1] if _compile_targets else jax.devices()[0]


def _compute_capability(device) -> float | None:
    cc = getattr(device, "compute_capability", None)
    if cc is None:
        return None
    try:
        return float(cc)  # jaxlib reports e.g. "9.0"
    except (TypeError, ValueError):
        return None


def kernels_supported(device=None) -> bool:
    """True only on a CUDA GPU with compute capability >= 8.0 (default: the first JAX device, or the
    `compile_for` device)."""
    if device is None:
        try:
            device = _target_device()
        except RuntimeError:
            return False
    if device.platform != "gpu":
        return False
    cc = _compute_capability(device)
    # ROCm devices also report platform "gpu" but have no CUDA compute capability.
    return cc is not None and cc >= MIN_COMPUTE_CAPABILITY


def on_tpu(device=None) -> bool:
    """True on a TPU (default: the first JAX device, or the `compile_for` device): the Mosaic kernels
    (`*_tpu`) apply there."""
    if device is None:
        try:
            device = _target_device()
        except RuntimeError:
            return False
    return device.platform == "tpu"


def on_gpu(device=None) -> bool:
    """True on any GPU, CUDA or ROCm, whatever it can run (default: the first JAX device, or the `compile_for`
    device)."""
    if device is None:
        try:
            device = _target_device()
        except RuntimeError:
            return False
    return device.platform in ("gpu", "cuda", "rocm")


def describe_target() -> str:
    """The device kernels are chosen for, in words (for error messages)."""
    try:
        device = _target_device()
    except RuntimeError:
        return "no JAX device"
    where = f"{device.platform} device {device.device_kind!r}"
    cc = _compute_capability(device)
    return where + (f" (compute capability {cc})" if cc is not None else "")


def map_leading(fn, n: int):
    """fn vmapped over n leading dims, kept apart (not merged into one), so dims on different mesh axes
    (batch, heads) stay where they are. A kernel written for one problem gets its batch and heads this way."""
    for _ in range(n):
        fn = jax.vmap(fn)
    return fn


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): Triton's block shapes are powers of two."""
    return 1 << max(0, int(x) - 1).bit_length()


def bf16_terms(x: jax.Array, passes: int) -> list[jax.Array]:
    """x ≈ Σ terms, each bfloat16, largest first: `passes` terms of float32 x (3 carry all 24 mantissa bits, so
    products with exact factors stay exact); bfloat16 / float16 x is one term already."""
    if x.dtype in (jnp.bfloat16, jnp.float16):
        return [x]
    terms = []
    rest = x.astype(jnp.float32)
    for i in range(passes):
        t = rest.astype(jnp.bfloat16)
        terms.append(t)
        if i + 1 < passes:
            rest = rest - t.astype(jnp.float32)
    return terms
