"""Multiple devices with JAX's own SPMD (GSPMD): a ("data", "model") mesh, batch on "data", KV heads on "model".

Nothing here changes the math. Parameters and the KV cache get `NamedSharding`s, `generate` (or your own loop
over `prefill` / `decode_step` with `sharding=`) pins the cache to them inside the jit, and XLA partitions the
rest. Each (sequence, KV head) problem is independent, so prefill attention, K-means, cluster selection, the
selected attention and the host-offloaded KV all run per shard; the only collectives are the Megatron ones
(an all-reduce after the attention output projection and after the MLP down projection) and the logits.

What each array gets (`data` / `model` are the mesh axes; "-" is replicated):

| array | spec |
|---|---|
| embed, lm_head, norms, o_bias | replicated |
| q / k / v [L, D, heads, H], their biases | heads on model |
| a GPU's fused qkv [D, K, G + 2, H] (per layer), its bias | K on model |
| o [L, N, H, D] | N on model |
| gate / up [L, D, F], down [L, F, D]; a GPU's fused gate_up [D, 2, F] | F on model |
| a group's store k / v [n, B, K, S, H] | (-, data, model, -, -) |
| lengths, prompt_lengths [B] | (data) |
| policy state, window ring and recall cache leaves | the B dim on data, the KV / selection-head dim on model |
| a host store's k / v [n, B, K, S, H] | (-, data, model, -, -), memory kind pinned_host |

Every cache array declares its logical axes where it is defined (`clusterkv_jax.axes`), and every parameter in
`model.param_axes`: a tree map turns them into specs (`LOGICAL_RULES`: "batch" on the batch's mesh axis,
"kv_heads" and "heads" on the heads', "mlp" on the MLP width's; every other dim replicated), and the cache's
memory into memory kinds (`cache.memory_kinds`). A policy state array that declares nothing (a custom policy's
bare array) is replicated.

The Pallas kernels are custom calls the partitioner cannot split; `ops.per_shard` runs them under `shard_map`,
once per device on its shard of the batch and heads, so a sharded ClusterKV keeps its kernels.

Fallbacks (results never change, only the layout): when the query or the KV heads do not divide the "model"
axis (SmolLM2: 9 / 3 heads), attention weights, the KV cache and the policy state are replicated over
"model" for the whole model (a warning says so once); the MLP is still split over F if F divides it. When
the batch does not divide "data", `generate` pads it with copies of the first prompt and drops them from
the results; `init_cache_sharded` and `sharding_rules` replicate over "data" instead (with a warning).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from clusterkv_jax import axes, kernels
from clusterkv_jax.cache import KVCache, init_cache, memory_kinds
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.model import layout_of, param_axes
from clusterkv_jax.offload import host_memory_kind
from clusterkv_jax.ops import ShardAxes

AXES = ("data", "model")
_warned: set = set()


def _warn_once(key, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


# ----------------------------------------------------------------------------------------------------------
# Meshes
# ----------------------------------------------------------------------------------------------------------


def parse_mesh(spec: str | Mapping[str, int]) -> dict[str, int]:
    """"data=2,model=2" (or a dict) -> {"data": 2, "model": 2}; an axis left out has size 1."""
    if isinstance(spec, Mapping):
        items = list(spec.items())
    else:
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"mesh spec must look like 'data=2,model=2', got {spec!r}")
        items = []
        for part in spec.split(","):
            name, eq, size = part.partition("=")
            if not eq:
                raise ValueError(f"mesh spec {spec!r}: {part.strip()!r} is not AXIS=SIZE (e.g. 'data=2,model=2')")
            items.append((name.strip(), size.strip()))
    sizes = {a: 1 for a in AXES}
    seen = set()
    for name, size in items:
        if name not in AXES:
            raise ValueError(f"mesh spec {spec!r}: unknown axis {name!r}; the axes are 'data' and 'model'")
        if name in seen:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} given twice")
        seen.add(name)
        if isinstance(size, str):
            ok = size.isdigit()
        else:
            ok = isinstance(size, (int, np.integer)) and not isinstance(size, bool)
        if not ok or int(size) < 1:
            raise ValueError(f"mesh spec {spec!r}: size of {name!r} must be an integer >= 1, got {size!r}")
        sizes[name] = int(size)
    return sizes


def make_mesh(spec, devices=None) -> Mesh:
    """A ("data", "model") mesh over `devices` (default: all of `jax.devices()`), whose sizes multiply to
    the number of devices. `spec`: "data=2,model=2", a dict, a `Mesh` (which must have those two axes; it
    is returned with Auto axes) or `ShardingRules` (its mesh)."""
    if isinstance(spec, ShardingRules):
        return spec.mesh
    if isinstance(spec, Mesh):
        if tuple(spec.axis_names) != AXES:
            raise ValueError(f"mesh axes must be {AXES}, got {tuple(spec.axis_names)}")
        if all(t == AxisType.Auto for t in spec.axis_types):
            return spec
        return Mesh(spec.devices, AXES, axis_types=(AxisType.Auto,) * 2)
    sizes = parse_mesh(spec)
    devices = list(jax.devices() if devices is None else devices)
    need = sizes["data"] * sizes["model"]
    if need != len(devices):
        text = ",".join(f"{a}={sizes[a]}" for a in AXES)
        hint = ""
        if devices and devices[0].platform == "cpu":
            hint = (f"; on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={need} before JAX starts "
                    f"(before the first `import jax` touches a device)")
        platform = devices[0].platform if devices else "none"
        raise ValueError(f"mesh {text} needs data*model = {need} devices, but {len(devices)} "
                         f"{'is' if len(devices) == 1 else 'are'} available ({platform}){hint}")
    grid = np.array(devices, dtype=object).reshape(sizes["data"], sizes["model"])
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 2)


def request_host_devices(spec: str | Mapping[str, int]) -> None:
    """Asks XLA for data*model CPU devices (appends --xla_force_host_platform_device_count to XLA_FLAGS
    unless it is set). Only works before JAX has started its backends (the first `jax.devices()` or array);
    GPU and TPU device counts are unaffected."""
    sizes = parse_mesh(spec)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        n = sizes["data"] * sizes["model"]
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_replicas_fit(spec, param_bytes: int, available: int | None = None,
                            held_bytes: int | None = None) -> None:
    """On CPU the mesh's devices share this machine's memory: refuse a mesh whose parameters would not fit in the
    memory available now (the loaded copy besides), rather than be OOM-killed half way through placing them.
    `held_bytes`: what this process's devices of the mesh would hold (`held_param_bytes`); default the "data"
    axis's copies alone. A model axis that does not divide the heads or the MLP width leaves those weights whole on
    every one of its devices. Call after JAX has started, for CPU devices only."""
    sizes = parse_mesh(spec)
    available = available_memory_bytes() if available is None else available
    held = param_bytes * sizes["data"] if held_bytes is None else held_bytes
    need = held + param_bytes
    if available is not None and need > 0.9 * available:
        gb = lambda n: f"{n / 1e9:.1f} GB"  # noqa: E731
        copies = held / param_bytes if param_bytes else 0.0
        hint = ("use a smaller data axis" if held <= 1.01 * param_bytes * sizes["data"] else
                f"use a smaller model axis (one that divides the model's heads and MLP width splits them instead "
                f"of copying them to each of its {sizes['model']} devices) or a smaller data axis")
        raise ValueError(
            f"mesh data={sizes['data']},model={sizes['model']} on CPU would hold {copies:.1f} copies of the "
            f"{gb(param_bytes)} parameters plus the loaded one ({gb(need)}) in this machine's memory, "
            f"{gb(available)} available: {hint}"
        )


def held_param_bytes(config, dtype, spec) -> int:
    """Bytes of `config`'s parameters in `dtype` that this process's devices of the mesh `spec` hold, each device
    its shard of every array (a whole copy of an array the mesh does not split)."""
    from clusterkv_jax.model import param_shapes

    mesh = make_mesh(spec)
    local = sum(1 for d in mesh.devices.flat if d.process_index == jax.process_index())
    shapes = jax.tree_util.tree_leaves(param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    shardings = jax.tree_util.tree_leaves(param_shardings(config, mesh))
    itemsize = np.dtype(dtype).itemsize
    return local * itemsize * sum(math.prod(sharding.shard_shape(shape))
                                  for shape, sharding in zip(shapes, shardings, strict=True))


def param_bytes(config, dtype) -> int:
    """Bytes of the parameters of `config` in `dtype`."""
    from clusterkv_jax.model import param_shapes

    shapes = jax.tree_util.tree_leaves(param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    return sum(math.prod(shape) for shape in shapes) * np.dtype(dtype).itemsize


def check_mesh_for_model(spec, model_dir: str, dtype) -> None:
    """`check_host_replicas_fit` for the converted model in `model_dir` (at `dtype`, default its stored one),
    when JAX's devices are CPUs; before any parameter is read."""
    if jax.devices()[0].platform != "cpu":
        return
    from clusterkv_jax.config import ModelConfig, read_json_object

    config = ModelConfig.from_dir(model_dir)
    if dtype is None:
        stored = read_json_object(os.path.join(model_dir, "config.json")).get("clusterkv")
        dtype = stored.get("dtype", "float32") if isinstance(stored, dict) else "float32"
    check_host_replicas_fit(spec, param_bytes(config, dtype), held_bytes=held_param_bytes(config, dtype, spec))


# ----------------------------------------------------------------------------------------------------------
# Rules: which mesh axis each logical dimension uses for one (model, batch size)
# ----------------------------------------------------------------------------------------------------------


#: The logical axes that are split, and the `ShardingRules` field naming the mesh axis each one uses.
LOGICAL_RULES = {"batch": "batch", "kv_heads": "heads", "heads": "heads", "mlp": "mlp"}


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Hashable (a static argument of `jax.jit`): the mesh, and the axis (or None: replicated) used for the
    batch, the attention heads (query and KV heads together) and the MLP width."""

    mesh: Mesh
    batch: str | None
    heads: str | None
    mlp: str | None

    def named(self, spec: P, memory_kind: str | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, spec, memory_kind=memory_kind)

    def spec(self, logical: axes.Axes) -> P:
        """The PartitionSpec of an array with these logical axes (`LOGICAL_RULES`)."""
        return P(*(getattr(self, LOGICAL_RULES[name]) if name in LOGICAL_RULES else None for name in logical.names))

    @property
    def shard_axes(self) -> ShardAxes:
        """What `ops.sharded_trace` needs: the mesh and the axes of the batch and head dims."""
        return ShardAxes(self.mesh, self.batch, self.heads)


def sharding_rules(config: ModelConfig, mesh: Mesh | str | Mapping[str, int], batch_size: int | None = None,
                   ) -> ShardingRules:
    """The rules for `config` on `mesh`, batch sizes not dividing "data" replicated over it (warned)."""
    mesh = make_mesh(mesh)
    data, model = mesh.shape["data"], mesh.shape["model"]
    heads = "model"
    if config.num_heads % model or config.num_kv_heads % model:
        heads = None
        if model > 1:
            _warn_once(("heads", config.num_heads, config.num_kv_heads, model),
                       f"{config.num_heads} query / {config.num_kv_heads} KV heads do not divide the mesh axis "
                       f"model={model}: attention weights, the KV cache and the policy state are replicated "
                       f"over 'model' (the MLP is still split there when its width divides it)")
    mlp = "model" if config.intermediate_size % model == 0 else None
    if mlp is None and model > 1:
        _warn_once(("mlp", config.intermediate_size, model),
                   f"intermediate_size={config.intermediate_size} does not divide model={model}: MLP replicated")
    batch = "data"
    if batch_size is not None and batch_size % data:
        batch = None
        _warn_once(("batch", batch_size, data),
                   f"batch {batch_size} does not divide the mesh axis data={data}: replicated over 'data' "
                   f"(generate() pads the batch instead)")
    return ShardingRules(mesh=mesh, batch=batch, heads=heads, mlp=mlp)


def _as_rules(config, mesh_or_rules, batch_size=None) -> ShardingRules:
    if isinstance(mesh_or_rules, ShardingRules):
        return mesh_or_rules
    return sharding_rules(config, mesh_or_rules, batch_size)


# ----------------------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------------------


def param_specs(config: ModelConfig, rules: ShardingRules, layout: str = "canonical") -> dict[str, Any]:
    """PartitionSpecs in the layout of `model.param_shapes`, the layers' parameters in `layout` (one of
    `model.LAYOUTS`), from the logical axes `model.param_axes` names: Megatron-style heads / MLP width split on
    "model"."""
    return jax.tree.map(lambda names: rules.spec(axes.Axes(names)), param_axes(config, layout),
                        is_leaf=lambda x: isinstance(x, tuple))


def param_shardings(config: ModelConfig, mesh_or_rules, per_layer: bool = False, layout: str = "canonical"
                    ) -> dict[str, Any]:
    """NamedShardings in the layout of `model.param_shapes`, or with `per_layer` in that of `model.unstack_layers`
    (each layer's arrays without the leading "layers" dim, which is never split); the layers' parameters in
    `layout` (`model.LAYOUTS`: "fused" is what `model.for_device` gives a GPU, "model_dim_last" a TPU)."""
    rules = _as_rules(config, mesh_or_rules)
    specs = param_specs(config, rules, layout)
    if per_layer:
        layer = {name: P(*spec[1:]) for name, spec in specs["layers"].items()}
        specs = {**specs, "layers": tuple(dict(layer) for _ in range(config.num_layers))}
    return jax.tree.map(rules.named, specs, is_leaf=lambda x: isinstance(x, P))


def shard_params(params, config: ModelConfig, mesh) -> Any:
    """Places `params` (stacked or per layer, in any of `model.LAYOUTS`) on `mesh` (a Mesh, a spec such as
    "data=2,model=2", or ShardingRules). Arrays that already have their sharding are not copied."""
    per_layer = not isinstance(params["layers"], dict)
    layout = layout_of(params["layers"][0] if per_layer else params["layers"])
    shardings = param_shardings(config, mesh, per_layer=per_layer, layout=layout)
    return jax.tree.map(lambda x, s: x if getattr(x, "sharding", None) == s else jax.device_put(x, s),
                        params, shardings)


# ----------------------------------------------------------------------------------------------------------
# The KV cache
# ----------------------------------------------------------------------------------------------------------


def _cache_shapes(config, policy, batch_size, capacity, dtype):
    return jax.eval_shape(lambda: init_cache(config, policy, batch_size, capacity, dtype))


def cache_specs(config: ModelConfig, policy, batch_size: int, capacity: int, dtype, rules: ShardingRules,
                ) -> KVCache:
    """A KVCache of PartitionSpecs, from the logical axes every array declares (`clusterkv_jax.axes`)."""
    return jax.tree.map(rules.spec, axes.of(_cache_shapes(config, policy, batch_size, capacity, dtype)))


def cache_shardings(config: ModelConfig, policy, batch_size: int, capacity: int, dtype, mesh) -> KVCache:
    """A KVCache of NamedShardings, each with the memory kind its store gives it (host stores: pinned_host)."""
    rules = _as_rules(config, mesh, batch_size)
    specs = cache_specs(config, policy, batch_size, capacity, dtype, rules)
    kinds = memory_kinds(_cache_shapes(config, policy, batch_size, capacity, dtype))
    if any(k != "device" for k in jax.tree_util.tree_leaves(kinds)) and host_memory_kind() != "pinned_host":
        raise NotImplementedError(
            f"host offload on a mesh needs the pinned_host memory kind; {jax.devices()[0].platform} only "
            f"has {host_memory_kind()}. Use offload=False, or no mesh")
    return jax.tree.map(lambda spec, kind: rules.named(spec, kind), specs, kinds,
                        is_leaf=lambda x: isinstance(x, P))


def constrain_cache(cache: KVCache, shardings: KVCache) -> KVCache:
    """Inside jit: pins every cache leaf to its sharding (host leaves by a transfer that keeps them on the host)."""
    def pin(x, s):
        if s.memory_kind not in (None, "device"):
            return jax.device_put(x, s)
        return jax.lax.with_sharding_constraint(x, s)

    return jax.tree.map(pin, cache, shardings)


def init_cache_sharded(config: ModelConfig, policy, batch_size: int, capacity: int, dtype=jnp.bfloat16,
                       mesh=None) -> KVCache:
    """`init_cache`, created directly in its shards (no full-size copy on one device) on `mesh` (a Mesh, a
    spec string or ShardingRules). For your own loop over `prefill` / `decode_step`: pass them
    `sharding=sharding_rules(config, mesh, batch_size)` so the cache they return keeps this layout."""
    if mesh is None:
        raise ValueError("init_cache_sharded needs a mesh; use init_cache without one")
    shardings = cache_shardings(config, policy, batch_size, capacity, dtype, mesh)
    make = jax.jit(lambda: init_cache(config, policy, batch_size, capacity, dtype), out_shardings=shardings)
    return make()


def shard_batch(x, mesh_or_rules):
    """Places a batch-leading array (tokens [B, T], lengths [B], ...) on the mesh with its batch dim on
    "data" (replicated when B does not divide it, or when the rules replicate the batch)."""
    mesh = make_mesh(mesh_or_rules)
    batch = "data" if np.shape(x)[0] % mesh.shape["data"] == 0 else None
    if isinstance(mesh_or_rules, ShardingRules) and mesh_or_rules.batch is None:
        batch = None
    return jax.device_put(x, NamedSharding(mesh, P(batch, *([None] * (np.ndim(x) - 1)))))


def padded_batch(batch_size: int, mesh) -> int:
    """The batch size `generate` runs on `mesh`: rounded up to a multiple of the "data" axis."""
    data = make_mesh(mesh).shape["data"]
    return math.ceil(batch_size / data) * data


def cached_cache_shardings(config: ModelConfig, policy, batch_size: int, capacity: int, dtype,
                           rules: ShardingRules) -> KVCache:
    """`cache_shardings`, memoised on its (hashable) arguments and on the layer loop, which decides the cache's
    groups (`cache.plan_layers`; a test may force a GPU's loop on the CPU): the jitted steps call it while
    tracing."""
    return _cached_cache_shardings(config, policy, batch_size, capacity, dtype, rules, kernels.layer_loop())


@functools.lru_cache(maxsize=256)
def _cached_cache_shardings(config, policy, batch_size, capacity, dtype, rules, layer_loop) -> KVCache:
    return cache_shardings(config, policy, batch_size, capacity, dtype, rules)
