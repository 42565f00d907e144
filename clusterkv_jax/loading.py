"""`load_model`: a converted checkpoint directory -> config, params and tokenizer."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp

from clusterkv_jax.checkpoint import load_params
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.model import for_device, param_shapes
from clusterkv_jax.tokenizer import Tokenizer


@dataclasses.dataclass
class Model:
    config: ModelConfig
    params: Any
    tokenizer: Tokenizer | None
    path: str | None = None
    #: The mesh the parameters were restored on (`load_model(mesh=...)`); `generate` runs there by default.
    mesh: Any = None


def check_params(params: Any, config: ModelConfig) -> None:
    """Raises ValueError naming the first parameter that is missing or has the wrong shape."""
    expected = param_shapes(config)
    flat_expected = dict(jax.tree_util.tree_flatten_with_path(expected, is_leaf=lambda x: isinstance(x, tuple))[0])
    flat_got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for path, shape in flat_expected.items():
        name = jax.tree_util.keystr(path)
        if path not in flat_got:
            raise ValueError(f"checkpoint lacks parameter {name} (expected shape {shape})")
        if tuple(flat_got[path].shape) != tuple(shape):
            raise ValueError(f"parameter {name} has shape {tuple(flat_got[path].shape)}, expected {shape}")


def check_model_dir(path: str) -> None:
    """A clear error for a model path that is a file or is missing (before anything is read)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"model {path!r} is a file; give the directory `python -m checkpoints_convert` wrote "
                         "(convert a GGUF or HF checkpoint first)")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")


def _unconverted_advice(path: str) -> str | None:
    """What to do with a directory that has no params/ and holds a Hugging Face or GGUF checkpoint (None if it holds
    neither): convert it into a new directory beside it (the converter never writes into its source)."""
    names = os.listdir(path)
    target = os.path.normpath(path) + "-clusterkv"
    if any(n.endswith((".safetensors", ".bin")) for n in names):
        return (f"{path!r} is a Hugging Face checkpoint, not a converted one; convert it into a new directory: "
                f"python -m checkpoints_convert hf {path} {target}, then pass --model {target}")
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    if ggufs:
        src = os.path.join(path, ggufs[0])
        return (f"{path!r} holds a GGUF, not a converted checkpoint; convert it into a new directory: "
                f"python -m checkpoints_convert gguf {src} {target}, then pass --model {target}")
    return None


#: What the parameters may be cast to.
PARAM_DTYPES = ("float32", "bfloat16", "float16", "float64")


def _param_dtype(dtype: Any):
    """A floating parameter dtype this JAX can hold: float64 only with x64 enabled (else JAX would silently make
    it float32)."""
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in PARAM_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(PARAM_DTYPES)}, got {dtype!r}")
    if resolved == jnp.float64 and not jax.config.read("jax_enable_x64"):
        raise ValueError("dtype float64 needs 64-bit JAX (jax.config.update('jax_enable_x64', True) or "
                         "JAX_ENABLE_X64=1 before JAX starts); without it the parameters would be float32")
    return resolved


def load_model(path: str | os.PathLike, dtype: Any = None, mesh: Any = None) -> Model:
    """Loads a directory written by `python -m checkpoints_convert` (config.json, tokenizer, params/).

    `dtype` (e.g. "float32", "bfloat16") casts the parameters; by default they keep the stored dtype.
    `mesh` (a `jax.sharding.Mesh` with axes ("data", "model"), or a spec such as "data=2,model=2"): the
    parameters are restored straight into their shards there (`clusterkv_jax.sharding`), each process reading
    only its own; `generate` then runs on that mesh by default. When JAX runs several processes
    (`clusterkv_jax.distributed`) and no mesh is given, the mesh is data=<all devices>: every device holds the
    whole parameters.
    """
    path = os.fspath(path)
    if dtype is not None:
        dtype = _param_dtype(dtype)
    check_model_dir(path)
    converted = os.path.isdir(os.path.join(path, "params"))
    if not converted and (advice := _unconverted_advice(path)):
        raise FileNotFoundError(advice)  # before config.json, which a source checkpoint may hold in any form
    config = ModelConfig.from_dir(path)
    if not converted:
        raise FileNotFoundError(f"{path!r} has no params/ checkpoint; convert a checkpoint into it first: "
                                f"python -m checkpoints_convert hf|gguf SRC {path}")
    shardings = None
    if mesh is None and jax.process_count() > 1:
        mesh = f"data={jax.device_count()}"
    if mesh is not None:
        from clusterkv_jax import sharding

        mesh = sharding.make_mesh(mesh)
        shardings = sharding.param_shardings(config, mesh)
    params = load_params(os.path.join(path, "params"), dtype=dtype, sharding=shardings)
    check_params(params, config)
    params = for_device(params, free=True)  # on a GPU, each layer's weights arrays of their own
    tokenizer = Tokenizer.from_dir(path) if os.path.isfile(os.path.join(path, "tokenizer.json")) else None
    return Model(config=config, params=params, tokenizer=tokenizer, path=path, mesh=mesh)
