"""Logical axes of the cache's arrays, declared where each array is defined.

Every array of a cache (a store's keys and values, a policy's index, host offload's recall cache) is a field of
a `flax.struct` dataclass declared with `field(...)`: the name of each of its dims, and whether it lives in host
memory. `of(tree)` reads those declarations for a whole pytree into a tree of `Axes` of the same structure;
`clusterkv_jax.sharding` maps the names to mesh axes by a tree map, and `cache.memory_kinds` the memory.

Names: "layers" (a layer group's stacked layers), "batch", "kv_heads", "heads" (selection heads: query heads,
or KV heads when a selection is shared), and names of dims that are never split ("rows", "clusters", ...; or
None). A field declared `stacked()` holds per-layer pytrees stacked on a leading "layers" dim (a layer group's
policy state): the layer dim is prepended to whatever its leaves declare. An array nothing declares (a custom
policy's bare-array state) is replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Axes:
    """The logical name of each dim of one array (None: unnamed), and whether it lives in host memory."""

    names: tuple[str | None, ...]
    host: bool = False


def field(*names: str | None, host: bool = False, **kwargs) -> Any:
    """A `flax.struct` dataclass field holding an array (or None) whose dims are `names`."""
    return flax.struct.field(metadata={"axes": Axes(tuple(names), host)}, **kwargs)


def stacked(**kwargs) -> Any:
    """A field holding a pytree of per-layer arrays stacked on a leading "layers" dim."""
    return flax.struct.field(metadata={"stacked": True}, **kwargs)


def of(tree: Any, lead: tuple[str | None, ...] = ()) -> Any:
    """`tree` with every array replaced by its `Axes` (None stays None)."""
    if tree is None:
        return None
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        updates = {}
        for f in dataclasses.fields(tree):
            if not f.metadata.get("pytree_node", True):
                continue
            value = getattr(tree, f.name)
            if "axes" in f.metadata:
                declared = f.metadata["axes"]
                updates[f.name] = jax.tree.map(
                    lambda x, d=declared, name=f.name: _checked(x, Axes(lead + d.names, d.host), name), value)
            else:
                updates[f.name] = of(value, lead + (("layers",) if f.metadata.get("stacked") else ()))
        return dataclasses.replace(tree, **updates)
    if isinstance(tree, (tuple, list)):
        return type(tree)(of(x, lead) for x in tree)
    if isinstance(tree, dict):
        return {k: of(v, lead) for k, v in tree.items()}
    return Axes(lead + (None,) * (_ndim(tree) - len(lead)))


def _ndim(x) -> int:
    return len(x.shape) if hasattr(x, "shape") else np.ndim(x)  # arrays and jax.ShapeDtypeStruct alike


def _checked(x, axes: Axes, name: str) -> Axes:
    if _ndim(x) != len(axes.names):
        raise ValueError(f"field {name!r} declares dims {axes.names} but holds an array of {_ndim(x)} dims")
    return axes
