"""HF safetensors checkpoints (single-file or sharded) to clusterkv checkpoints."""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from typing import Any

import numpy as np

from checkpoints_convert.common import (
    TensorSource,
    build_params,
    check_output,
    read_json,
    resolve_dtype,
    staging_dir,
    write_json,
)
from clusterkv_jax import checkpoint as _checkpoint
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.model import param_axes

# Tokenizer and generation files an HF checkpoint may carry; copied as they are.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


class _DictSource(TensorSource):
    """An in-memory HF state dict."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self._tensors = tensors

    def names(self):
        return self._tensors.keys()

    def shape(self, name):
        return tuple(np.shape(self._tensors[name]))

    def read(self, name):
        return np.asarray(self._tensors[name])


def hf_state_dict_to_params(
    tensors: dict[str, np.ndarray], config: ModelConfig | dict, dtype: Any = np.float32
) -> dict:
    """Maps an HF Llama/Qwen2 state dict (numpy arrays, PyTorch layout) to the param pytree (numpy, `dtype`)."""
    if isinstance(config, dict):
        config = ModelConfig.from_hf_dict(config)
    return build_params(_DictSource(tensors), config, np.dtype(dtype))


class _SafetensorsSource(TensorSource):
    """Tensors of a single-file or sharded (`model.safetensors.index.json`) safetensors checkpoint."""

    def __init__(self, src: str, stack: contextlib.ExitStack):
        from safetensors import safe_open

        index_path = os.path.join(src, "model.safetensors.index.json")
        single_path = os.path.join(src, "model.safetensors")
        if os.path.isfile(index_path):
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index_path!r} has no weight_map")
            shard_of = {name: os.path.join(src, shard) for name, shard in weight_map.items()}
        elif os.path.isfile(single_path):
            shard_of = None
        else:
            raise FileNotFoundError(
                f"no safetensors weights in {src!r}: expected model.safetensors or model.safetensors.index.json"
            )
        shard_paths = sorted(set(shard_of.values())) if shard_of else [single_path]
        for path in shard_paths:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"safetensors shard {path!r} listed in the index does not exist")
        self._files = {}
        for path in shard_paths:
            try:
                self._files[path] = stack.enter_context(safe_open(path, framework="numpy"))
            except Exception as error:  # SafetensorError, a Rust-side type: name the file instead
                raise ValueError(f"{path!r} is not a readable safetensors file (truncated or corrupt?): {error}") from None
        if shard_of is None:
            shard_of = {name: single_path for name in self._files[single_path].keys()}
        for name, path in shard_of.items():
            if name not in self._files[path].keys():
                raise ValueError(f"tensor {name!r} is listed in the index but absent from {path!r}")
        self._shard_of = shard_of

    def names(self):
        return self._shard_of.keys()

    def shape(self, name):
        return tuple(self._files[self._shard_of[name]].get_slice(name).get_shape())

    def read(self, name):
        path = self._shard_of[name]
        try:
            return self._files[path].get_tensor(name)
        except Exception as error:  # noqa: BLE001 -- SafetensorError and friends: name the tensor and the file
            raise ValueError(f"cannot read tensor {name!r} from {path!r} (truncated or corrupt?): {error}") from None


def convert_hf(src: str | os.PathLike, dst: str | os.PathLike, dtype: Any = "bfloat16", overwrite: bool = False) -> str:
    """Converts an HF Llama/Qwen2/Mistral safetensors checkpoint directory to a clusterkv checkpoint at `dst`."""
    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    dtype_name, np_dtype = resolve_dtype(dtype)
    config_path = os.path.join(src, "config.json")
    check_output(src, dst, overwrite)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in {src!r}: not an HF checkpoint directory")
    hf_config = read_json(config_path)
    if hf_config.get("quantization_config"):
        method = hf_config["quantization_config"].get("quant_method", "?")
        raise ValueError(f"unsupported quantization_config (quant_method {method!r}): quantized HF checkpoints")
    # Refuses unsupported configs before any tensor is touched.
    config = ModelConfig.from_hf_dict(hf_config)
    if not os.path.isfile(os.path.join(src, "tokenizer.json")):
        warnings.warn(f"no tokenizer.json in {src!r}; the converted checkpoint will have no tokenizer", stacklevel=2)

    with staging_dir(dst, overwrite, src) as staging, contextlib.ExitStack() as stack:
        tensors = _SafetensorsSource(src, stack)
        params = build_params(tensors, config, np_dtype, desc="hf tensors")
        out_config = dict(hf_config, clusterkv={"dtype": dtype_name, "source": src, "format": "hf"})
        write_json(os.path.join(staging, "config.json"), out_config)
        for name in HF_TOKENIZER_FILES:
            if os.path.isfile(os.path.join(src, name)):
                shutil.copyfile(os.path.join(src, name), os.path.join(staging, name))
        _checkpoint.save_params(os.path.join(staging, _checkpoint.PARAMS_SUBDIR), params, axes=param_axes(config))
    return dst
