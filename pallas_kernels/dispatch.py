"""When to run the Pallas kernels and when their pure-jnp references, and how a one-problem kernel is mapped.

The kernels are Pallas *Triton* kernels: they compile only for an NVIDIA GPU of compute capability >= 8.0
(Ampere or newer: bfloat16 matrix units). Anywhere else they run only in interpret mode (slow; for tests).
On a TPU (`on_tpu`) their Mosaic versions (`*_tpu`) run instead.
"""

from __future__ import annotations

import jax

MODES = ("auto", "pallas", "reference")
MIN_COMPUTE_CAPABILITY = 8.0


def _compute_capability(device) -> float | None:
    cc = getattr(device, "compute_capability", None)
    if cc is None:
        return None
    try:
        return float(cc)  # jaxlib reports e.g. "9.0"
    except (TypeError, ValueError):
        return None


def kernels_supported(device=None) -> bool:
    """True only on a CUDA GPU with compute capability >= 8.0 (default: the first JAX device)."""
    if device is None:
        try:
            device = jax.devices()[0]
        except RuntimeError:
            return False
    if device.platform != "gpu":
        return False
    cc = _compute_capability(device)
    # ROCm devices also report platform "gpu" but have no CUDA compute capability.
    return cc is not None and cc >= MIN_COMPUTE_CAPABILITY


def on_tpu(device=None) -> bool:
    """True on a TPU (default: the first JAX device): the Mosaic kernels (`*_tpu`) apply there."""
    if device is None:
        try:
            device = jax.devices()[0]
        except RuntimeError:
            return False
    return device.platform == "tpu"


def use_kernels(mode: str, *, interpret: bool = False) -> bool:
    """Whether to call the Pallas kernels (True) or the pure-jnp references (False).

    mode "auto": the kernels where supported, else the references. "pallas": the kernels; raises
    RuntimeError on an unsupported device unless `interpret` (then the caller passes interpret=True to the
    kernels). "reference": the references.
    """
    if mode not in MODES:
        raise ValueError(f"kernel mode must be one of {MODES}, got {mode!r}")
    if mode == "reference":
        return False
    if mode == "auto":
        return kernels_supported()
    if not interpret and not kernels_supported():
        try:
            device = jax.devices()[0]
            where = f"{device.platform} device {device.device_kind!r}"
            cc = _compute_capability(device)
            if cc is not None:
                where += f" (compute capability {cc})"
        except RuntimeError:
            where = "no JAX device"
        raise RuntimeError(
            f"mode 'pallas' needs a CUDA GPU with compute capability >= {MIN_COMPUTE_CAPABILITY} "
            f"(Pallas Triton kernels); found {where}. Use mode 'auto' or 'reference', or interpret=True."
        )
    return True


def map_leading(fn, n: int):
    """fn vmapped over n leading dims, kept apart (not merged into one), so dims on different mesh axes
    (batch, heads) stay where they are. A kernel written for one problem gets its batch and heads this way."""
    for _ in range(n):
        fn = jax.vmap(fn)
    return fn
