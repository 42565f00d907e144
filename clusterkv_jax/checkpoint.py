"""Saving and restoring the parameter pytree (see `model.param_shapes`) as an orbax checkpoint.

A converted checkpoint directory holds `config.json`, the tokenizer files and `params/`, the orbax
directory these functions read and write.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

PARAMS_SUBDIR = "params"
#: Signals that end a process by default and that a save or a conversion turns into a clean stop.
TERMINATING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name))


#: Stored arrays are split into chunks of at most this many bytes, and the dims named here into one index per
#: chunk: a process restoring its shards (its heads, its part of the MLP width) reads only the chunks they
#: cover, not the whole array. (The MLP width is the largest dim, which orbax's chunking splits first anyway;
#: naming it too would make one chunk per column.)
STORAGE_CHUNK_BYTES = 4 << 20
STORAGE_SPLIT_AXES = ("heads", "kv_heads")
#: Beside orbax's files in the params directory: each array's checksum (`checksum_numpy`) as saved, so a load
#: names an array whose bytes changed since (a flipped byte in a file mostly decodes to finite, wrong weights).
CHECKSUMS_FILE = "clusterkv_checksums.json"
#: Odd, so every position's weight is odd and any change of one element changes the sum mod 2^32.
_CHECKSUM_MULTIPLIER = 2654435761


def save_params(path: str | os.PathLike, params: Any, axes: Any = None) -> str:
    """Writes `params` (numpy or jax arrays) to the orbax directory `path`, which must not exist yet. `axes`: the
    logical names of each array's dims (`model.param_axes`), so the head dims are stored one head per chunk."""
    path = os.path.abspath(os.fspath(path))
    if os.path.lexists(path):
        raise FileExistsError(f"refusing to overwrite existing params directory {path!r}")

    def save_args(names) -> ocp.SaveArgs:
        split = tuple(i for i, name in enumerate(names or ()) if name in STORAGE_SPLIT_AXES)
        return ocp.SaveArgs(chunk_byte_size=STORAGE_CHUNK_BYTES, shard_axes=split)

    if axes is None:
        args = jax.tree.map(lambda _: save_args(None), params)
    else:
        args = jax.tree.map(save_args, axes, is_leaf=lambda x: isinstance(x, tuple))
    # Orbax writes from background threads: stopped half way by Ctrl-C or SIGTERM (SIGHUP, SIGQUIT), they would go
    # on writing into a directory the caller is deleting. So the signals wait until the save has finished (seconds).
    checksums = {_name(key_path): checksum_numpy(np.asarray(x))
                 for key_path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    with signals_held(), ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, params, save_args=args)
        # Saving is asynchronous; the checkpoint is only complete once this returns.
        checkpointer.wait_until_finished()
        with open(os.path.join(path, CHECKSUMS_FILE), "w", encoding="utf-8") as f:
            json.dump(checksums, f, indent=0, sort_keys=True)
    return path


def _name(key_path) -> str:
    return jax.tree_util.keystr(key_path, simple=True, separator="/")


def checksum_numpy(x: np.ndarray) -> int:
    """Σ_i bits_i · w_i mod 2^32 over the array's elements in row-major order, bits_i an element's bit pattern
    (2- or 4-byte types, as an unsigned integer) and w_i = (2i + 1) · 2654435761 mod 2^32, odd: a change to any
    one element changes the sum. `_checksums` computes the same on the devices holding the array."""
    flat = np.ascontiguousarray(x).reshape(-1)
    bits = flat.view({2: np.uint16, 4: np.uint32}[flat.dtype.itemsize]).astype(np.uint64)
    total, step = 0, 1 << 22
    for start in range(0, bits.size, step):
        index = np.arange(start, min(start + step, bits.size), dtype=np.uint64)
        weights = ((2 * index + 1) * _CHECKSUM_MULTIPLIER) & 0xFFFFFFFF
        total = (total + int(np.sum((bits[start:start + step] * weights) & 0xFFFFFFFF))) & 0xFFFFFFFF
    return total


@jax.jit
def _checksums(arrays: list) -> list:
    def one(x):
        bits = jax.lax.bitcast_convert_type(x, {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]).astype(jnp.uint32)
        index = jax.lax.broadcasted_iota(jnp.uint32, (x.size,), 0).reshape(x.shape)
        weights = (2 * index + 1) * jnp.uint32(_CHECKSUM_MULTIPLIER)
        return jnp.sum(bits * weights, dtype=jnp.uint32)

    return [one(x) for x in arrays]


def check_checksums(params: Any, path: str) -> None:
    """Raises ValueError naming the first array whose checksum differs from the one saved beside it (checkpoints
    saved before checksums were written are not checked; call it on arrays in their saved dtype). One
    reduction per array on the devices holding it; for arrays split over processes, a collective."""
    listed = os.path.join(path, CHECKSUMS_FILE)
    if not os.path.isfile(listed):
        return
    from clusterkv_jax.config import read_json_object

    saved = read_json_object(listed)
    leaves = [(key_path, x) for key_path, x in jax.tree_util.tree_flatten_with_path(params)[0]
              if isinstance(saved.get(_name(key_path)), int) and x.dtype.itemsize in (2, 4)]
    on_device = [x for _, x in leaves if not isinstance(x, np.ndarray)]
    sums = iter(_checksums(on_device))
    for key_path, x in leaves:
        got = checksum_numpy(x) if isinstance(x, np.ndarray) else int(next(sums))
        if got != saved[_name(key_path)]:
            raise ValueError(f"params checkpoint {path!r}: parameter {_name(key_path)!r} does not match the checksum "
                             "saved with it; the files are damaged: convert the model again")


@contextlib.contextmanager
def signals_held():
    """SIGINT, SIGTERM, SIGHUP and SIGQUIT arriving inside the block are delivered when it ends (to the handlers in
    place before it), so whatever the block starts has finished first: a save, or a constructor an exception must
    not leave half done. Main thread only (elsewhere: no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    held = (signal.SIGINT, *TERMINATING_SIGNALS)
    previous = {signum: signal.signal(signum, lambda signum, frame: received.append(signum)) for signum in held}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)


def load_params(
    path: str | os.PathLike,
    dtype: Any = None,
    *,
    sharding: jax.sharding.Sharding | Any = None,
    as_numpy: bool = False,
) -> Any:
    """Restores the parameter pytree from `path` (the orbax directory, or a checkpoint directory holding
    `params/`). Arrays are cast to `dtype` when given, and come back as jax arrays placed with `sharding` (one
    sharding for all, or a pytree of them in the params' layout; default: this process's first device), or as
    numpy arrays when `as_numpy`. With shardings over a mesh that spans processes each process reads only the
    parts of the files its own shards need."""
    path = os.path.abspath(os.fspath(path))
    nested = os.path.join(path, PARAMS_SUBDIR)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no params checkpoint at {path!r}")
    if os.path.isdir(nested) and os.path.isfile(os.path.join(path, "config.json")):
        path = nested
    cast = None if dtype is None else np.dtype(dtype)
    if sharding is None and not as_numpy:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def leaf_sharding(key_path) -> jax.sharding.Sharding:
        if isinstance(sharding, jax.sharding.Sharding):
            return sharding
        node = sharding
        for key in key_path:
            node = node[key.key]
        return node

    def target(key_path, meta):
        leaf_dtype = cast or meta.dtype
        if as_numpy:
            # A numpy target makes orbax restore to host memory, casting while it reads.
            return np.empty(meta.shape, leaf_dtype)
        return jax.ShapeDtypeStruct(meta.shape, leaf_dtype, sharding=leaf_sharding(key_path))

    if not os.listdir(path):
        raise ValueError(f"params checkpoint {path!r} is empty: the conversion did not finish; convert again")
    damaged = f"params checkpoint {path!r} is truncated or corrupt ({{}}); convert the model again"
    # Silenced from before the restore: a damaged file fails one read, orbax's loop closes, and the other reads
    # still in flight fail after it, some before our error is raised.
    remove_silencers = _silence_failed_restore_echoes()
    with ocp.StandardCheckpointer() as checkpointer:
        metadata = checkpointer.metadata(path)
        if metadata is None or metadata.item_metadata is None:  # orbax could not read _METADATA (logged)
            raise ValueError(damaged.format("its metadata cannot be read"))
        try:
            targets = jax.tree_util.tree_map_with_path(target, metadata.item_metadata.tree)
        except KeyError as missing:
            raise ValueError(f"params checkpoint {path!r} holds parameter {missing} that the model does not "
                             "have; convert the model again") from None
        try:
            params = checkpointer.restore(path, targets)
        except Exception as error:  # noqa: BLE001 -- TensorStore raises bare Exceptions for damaged data
            # orbax and TensorStore explain a damaged file in a long spec dump; the first line says what failed.
            text = str(error).split("See full TensorStore details")[0].strip()
            first = text.splitlines()[0][:300] if text else type(error).__name__
            if "TensorStore" in str(error) or "reading array" in text:
                raise ValueError(damaged.format(first)) from None
            # Anything else (a device this process cannot address, a peer process gone, memory) is not the files'
            # fault: say what failed, and that the checkpoint is not blamed.
            raise RuntimeError(f"restoring params checkpoint {path!r} failed: {first} (the files were not found "
                               "damaged)") from error
    remove_silencers()
    check_finite(params, path)
    if cast is None:  # a cast changes the bytes the checksums were taken of
        check_checksums(params, path)
    return params


@jax.jit
def _all_finite(arrays: list) -> list:
    return [jnp.all(jnp.isfinite(x)) for x in arrays]


def check_finite(params: Any, where: str) -> None:
    """Raises ValueError naming the first parameter that holds NaN or inf (damaged data decodes to such values,
    and the model then emits token 0 forever). One reduction per tensor, on the device holding it."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    finite = _all_finite([x for _, x in leaves if not isinstance(x, np.ndarray)])
    flags = iter(finite)
    for path, x in leaves:
        ok = bool(np.isfinite(x).all()) if isinstance(x, np.ndarray) else bool(next(flags))
        if not ok:
            name = jax.tree_util.keystr(path, simple=True, separator="/")
            raise ValueError(f"params checkpoint {where!r}: parameter {name!r} holds NaN or inf; the checkpoint is "
                             "damaged (convert the model again) or was saved from a diverged model")


def _silence_failed_restore_echoes() -> Callable[[], None]:
    """Drops the echoes of a restore that failed on damaged data (other reports go on as before); returns the
    function that removes the filters again.

    When one read of a damaged checkpoint fails, orbax's event loop closes while its other reads are in flight.
    Each of those would print a traceback around our one-line error: an unawaited coroutine
    (`_read_array_index_and_device_put`) or a future whose exception nobody retrieved (asyncio's logger), and
    TensorStore's threads completing a read call `call_soon_threadsafe` on the closed loop, which raises "Event
    loop is closed" as an unraisable exception with no object.
    """
    import asyncio
    import logging
    import sys

    previous = sys.unraisablehook

    def is_echo(unraisable) -> bool:
        if getattr(unraisable.object, "__qualname__", "") == "_read_array_index_and_device_put":
            return True
        error = unraisable.exc_value
        return (unraisable.object is None and isinstance(error, RuntimeError)
                and str(error) == "Event loop is closed")

    def hook(unraisable):
        if not is_echo(unraisable):
            previous(unraisable)

    def not_a_lost_read(record: logging.LogRecord) -> bool:
        # "Future exception was never retrieved", "_GatheringFuture ...", "Task ...": the failed reads' futures.
        return "exception was never retrieved" not in record.getMessage()

    sys.unraisablehook = hook
    asyncio.log.logger.addFilter(not_a_lost_read)

    def remove() -> None:
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous
        asyncio.log.logger.removeFilter(not_a_lost_read)

    return remove
