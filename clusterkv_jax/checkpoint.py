"""Saving and restoring the parameter pytree (see `model.param_shapes`) as an orbax checkpoint.

A converted checkpoint directory holds `config.json`, the tokenizer files and `params/`, the orbax
directory these functions read and write.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

PARAMS_SUBDIR = "params"


def save_params(path: str | os.PathLike, params: Any) -> str:
    """Writes `params` (numpy or jax arrays) to the orbax directory `path`, which must not exist yet."""
    path = os.path.abspath(os.fspath(path))
    if os.path.lexists(path):
        raise FileExistsError(f"refusing to overwrite existing params directory {path!r}")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, params)
        # Saving is asynchronous; the checkpoint is only complete once this returns.
        checkpointer.wait_until_finished()
    return path


def load_params(
    path: str | os.PathLike,
    dtype: Any = None,
    *,
    sharding: jax.sharding.Sharding | None = None,
    as_numpy: bool = False,
) -> Any:
    """Restores the parameter pytree from `path` (the orbax directory, or a checkpoint directory holding
    `params/`). Arrays are cast to `dtype` when given, and come back as jax arrays placed with `sharding`
    (default: the first device), or as numpy arrays when `as_numpy`."""
    path = os.path.abspath(os.fspath(path))
    nested = os.path.join(path, PARAMS_SUBDIR)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no params checkpoint at {path!r}")
    if os.path.isdir(nested) and os.path.isfile(os.path.join(path, "config.json")):
        path = nested
    cast = None if dtype is None else np.dtype(dtype)
    if sharding is None and not as_numpy:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def target(meta):
        leaf_dtype = cast or meta.dtype
        if as_numpy:
            # A numpy target makes orbax restore to host memory, casting while it reads.
            return np.empty(meta.shape, leaf_dtype)
        return jax.ShapeDtypeStruct(meta.shape, leaf_dtype, sharding=sharding)

    with ocp.StandardCheckpointer() as checkpointer:
        metadata = checkpointer.metadata(path).item_metadata.tree
        return checkpointer.restore(path, jax.tree.map(target, metadata))
