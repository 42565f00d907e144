"""Converters from HF safetensors and llama.cpp GGUF checkpoints to clusterkv checkpoints.

A clusterkv checkpoint is a directory holding `config.json` (the HF config, plus a "clusterkv" entry
recording the dtype and source), `tokenizer.json`, `tokenizer_config.json` and `params/`, an orbax
checkpoint of the pytree laid out by `clusterkv_jax.model.param_shapes`.

Each converter checks the config and the tensor names and shapes before reading any weights, builds the
whole output in a temporary sibling directory and renames it into place last, so a failed conversion
leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import tempfile
import warnings
from typing import Any, Callable, Iterable

import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from clusterkv_jax import checkpoint as _checkpoint
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.model import param_shapes

__all__ = ["convert_hf", "convert_gguf", "hf_state_dict_to_params", "DTYPES"]

DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}

# Tokenizer and generation files an HF checkpoint may carry; copied as they are.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)

# Source tensor dtypes we read; bfloat16 is ml_dtypes', which numpy does not count as np.floating.
_FLOAT_DTYPES = tuple(np.dtype(t) for t in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16))

# Tensors in HF files that hold no parameters of ours.
_HF_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


# ----------------------------------------------------------------------------------------------------------
# HF tensor layout
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where one leaf of the param pytree comes from in an HF state dict."""

    path: tuple[str, ...]  # key path in the param pytree
    hf_name: str  # with "{i}" for the layer index when `stacked`
    hf_shape: tuple[int, ...]  # per layer, PyTorch order
    to_ours: Callable[[np.ndarray], np.ndarray] | None  # None: same layout
    stacked: bool


def _hf_sources(config: ModelConfig) -> list[_Source]:
    """The HF origin of every param leaf. HF Linear weights are [out, in]; ours are [in, ..., out]."""
    c = config
    D, N, K, H, F, V = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size
    layer = "model.layers.{i}."

    def stacked(name, hf_name, hf_shape, to_ours=None):
        return _Source(("layers", name), layer + hf_name, hf_shape, to_ours, True)

    sources = [
        _Source(("embed",), "model.embed_tokens.weight", (V, D), None, False),
        stacked("attn_norm", "input_layernorm.weight", (D,)),
        stacked("q", "self_attn.q_proj.weight", (N * H, D), lambda w: w.T.reshape(D, N, H)),
        stacked("k", "self_attn.k_proj.weight", (K * H, D), lambda w: w.T.reshape(D, K, H)),
        stacked("v", "self_attn.v_proj.weight", (K * H, D), lambda w: w.T.reshape(D, K, H)),
        stacked("o", "self_attn.o_proj.weight", (D, N * H), lambda w: w.T.reshape(N, H, D)),
        stacked("mlp_norm", "post_attention_layernorm.weight", (D,)),
        stacked("gate", "mlp.gate_proj.weight", (F, D), lambda w: w.T),
        stacked("up", "mlp.up_proj.weight", (F, D), lambda w: w.T),
        stacked("down", "mlp.down_proj.weight", (D, F), lambda w: w.T),
    ]
    if c.qkv_bias:
        sources += [
            stacked("q_bias", "self_attn.q_proj.bias", (N * H,), lambda b: b.reshape(N, H)),
            stacked("k_bias", "self_attn.k_proj.bias", (K * H,), lambda b: b.reshape(K, H)),
            stacked("v_bias", "self_attn.v_proj.bias", (K * H,), lambda b: b.reshape(K, H)),
        ]
    if c.o_bias:
        sources.append(stacked("o_bias", "self_attn.o_proj.bias", (D,)))
    sources.append(_Source(("final_norm",), "model.norm.weight", (D,), None, False))
    if not c.tie_word_embeddings:
        sources.append(_Source(("lm_head",), "lm_head.weight", (V, D), lambda w: w.T, False))
    return sources


def _hf_names(source: _Source, config: ModelConfig) -> list[str]:
    if source.stacked:
        return [source.hf_name.format(i=i) for i in range(config.num_layers)]
    return [source.hf_name]


def _is_ignorable_hf_name(name: str, config: ModelConfig) -> bool:
    # A tied checkpoint may still store the (duplicate) head; the model reads the embedding instead.
    return bool(_HF_IGNORED.fullmatch(name)) or (config.tie_word_embeddings and name == "lm_head.weight")


class _TensorSource:
    """Named tensors in PyTorch layout, readable one at a time."""

    def names(self) -> Iterable[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def describe(self, name: str) -> str:
        """The name as the user's file spells it, for error messages."""
        return name


class _DictSource(_TensorSource):
    def __init__(self, tensors: dict[str, np.ndarray]):
        self._tensors = tensors

    def names(self):
        return self._tensors.keys()

    def shape(self, name):
        return tuple(np.shape(self._tensors[name]))

    def read(self, name):
        return np.asarray(self._tensors[name])


def _build_params(source: _TensorSource, config: ModelConfig, dtype: np.dtype, desc: str = "tensors") -> dict:
    """Checks names and shapes of every tensor first, then reads them into the param pytree of `dtype`."""
    sources = _hf_sources(config)
    present = set(source.names())
    expected = [name for s in sources for name in _hf_names(s, config)]
    missing = [name for name in expected if name not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint is missing tensor {source.describe(missing[0])!r}{more}")
    unexpected = sorted(n for n in present - set(expected) if not _is_ignorable_hf_name(n, config))
    if unexpected:
        shown = ", ".join(repr(source.describe(n)) for n in unexpected[:5])
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise ValueError(
            f"checkpoint has tensors this {config.model_type} config does not use: {shown}{more}; "
            "the architecture variant is not supported"
        )
    for s in sources:
        for name in _hf_names(s, config):
            got = tuple(source.shape(name))
            if got != s.hf_shape:
                raise ValueError(f"tensor {source.describe(name)!r} has shape {got}, expected {s.hf_shape}")

    tree_shapes = param_shapes(config)
    params: dict[str, Any] = {}
    with tqdm(total=len(expected), desc=desc, unit="tensor", leave=False) as bar:
        for s in sources:
            node, key = params, s.path[-1]
            for part in s.path[:-1]:
                node = node.setdefault(part, {})
            shape = _lookup(tree_shapes, s.path)
            out = np.empty(shape, dtype)
            for index, name in enumerate(_hf_names(s, config)):
                weight = source.read(name)
                if weight.dtype not in _FLOAT_DTYPES:
                    raise ValueError(f"tensor {source.describe(name)!r} has dtype {weight.dtype}, not floating point")
                weight = s.to_ours(weight) if s.to_ours else weight
                if s.stacked:
                    out[index] = weight.astype(dtype, copy=False)
                else:
                    out[...] = weight.astype(dtype, copy=False)
                bar.update()
            node[key] = out
    _check_layout(params, tree_shapes)
    return params


def _lookup(tree: dict, path: tuple[str, ...]):
    for part in path:
        tree = tree[part]
    return tree


def _flatten(tree: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


def _check_layout(params: dict, shapes: dict) -> None:
    """Guards the converter against drifting from `param_shapes`, the model's contract."""
    got = {path: tuple(leaf.shape) for path, leaf in _flatten(params).items()}
    want = _flatten(shapes)
    assert got == want, f"converter layout {got} does not match param_shapes {want}"


def hf_state_dict_to_params(
    tensors: dict[str, np.ndarray], config: ModelConfig | dict, dtype: Any = np.float32
) -> dict:
    """Maps an HF Llama/Qwen2 state dict (numpy arrays, PyTorch layout) to the param pytree (numpy, `dtype`)."""
    if isinstance(config, dict):
        config = ModelConfig.from_hf_dict(config)
    return _build_params(_DictSource(tensors), config, np.dtype(dtype))


# ----------------------------------------------------------------------------------------------------------
# Output directory
# ----------------------------------------------------------------------------------------------------------


def _resolve_dtype(dtype: Any) -> tuple[str, np.dtype]:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return name, DTYPES[name]


@contextlib.contextmanager
def _staging_dir(dst: str, overwrite: bool):
    """Yields an empty temporary sibling of `dst`, renamed to `dst` when the block succeeds, deleted if it fails."""
    if os.path.lexists(dst) and not overwrite:
        raise FileExistsError(f"destination {dst!r} already exists; pass overwrite=True (--overwrite) to replace it")
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp-", dir=parent)
    try:
        # mkdtemp makes the directory private (0700); a checkpoint should be readable like any other output.
        os.chmod(staging, 0o755)
        yield staging
        _publish(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _publish(staging: str, dst: str) -> None:
    """Moves `staging` to `dst`, replacing an existing `dst` only once the new one is in place."""
    if not os.path.lexists(dst):
        os.rename(staging, dst)
        return
    old = staging + ".old"
    os.rename(dst, old)
    try:
        os.rename(staging, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.remove(old)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ----------------------------------------------------------------------------------------------------------
# HF safetensors
# ----------------------------------------------------------------------------------------------------------


class _SafetensorsSource(_TensorSource):
    """Tensors of a single-file or sharded (`model.safetensors.index.json`) safetensors checkpoint."""

    def __init__(self, src: str, stack: contextlib.ExitStack):
        from safetensors import safe_open

        index_path = os.path.join(src, "model.safetensors.index.json")
        single_path = os.path.join(src, "model.safetensors")
        if os.path.isfile(index_path):
            weight_map = _read_json(index_path).get("weight_map")
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
        self._files = {path: stack.enter_context(safe_open(path, framework="numpy")) for path in shard_paths}
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
        return self._files[self._shard_of[name]].get_tensor(name)


def convert_hf(src: str | os.PathLike, dst: str | os.PathLike, dtype: Any = "bfloat16", overwrite: bool = False) -> str:
    """Converts an HF Llama/Qwen2/Mistral safetensors checkpoint directory to a clusterkv checkpoint at `dst`."""
    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    dtype_name, np_dtype = _resolve_dtype(dtype)
    config_path = os.path.join(src, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in {src!r}: not an HF checkpoint directory")
    hf_config = _read_json(config_path)
    if hf_config.get("quantization_config"):
        method = hf_config["quantization_config"].get("quant_method", "?")
        raise ValueError(f"unsupported quantization_config (quant_method {method!r}): quantized HF checkpoints")
    # Refuses unsupported configs before any tensor is touched.
    config = ModelConfig.from_hf_dict(hf_config)
    if not os.path.isfile(os.path.join(src, "tokenizer.json")):
        warnings.warn(f"no tokenizer.json in {src!r}; the converted checkpoint will have no tokenizer", stacklevel=2)

    with _staging_dir(dst, overwrite) as staging, contextlib.ExitStack() as stack:
        tensors = _SafetensorsSource(src, stack)
        params = _build_params(tensors, config, np_dtype, desc="hf tensors")
        out_config = dict(hf_config, clusterkv={"dtype": dtype_name, "source": src, "format": "hf"})
        _write_json(os.path.join(staging, "config.json"), out_config)
        for name in HF_TOKENIZER_FILES:
            if os.path.isfile(os.path.join(src, name)):
                shutil.copyfile(os.path.join(src, name), os.path.join(staging, name))
        _checkpoint.save_params(os.path.join(staging, _checkpoint.PARAMS_SUBDIR), params)
    return dst


# ----------------------------------------------------------------------------------------------------------
# GGUF
# ----------------------------------------------------------------------------------------------------------

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# GGUF tensor name -> HF name; "{i}" is the block index.
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_HF_TO_GGUF = {hf: gguf for gguf, hf in _GGUF_TO_HF.items()}


def _template_and_index(name: str) -> tuple[str, str | None]:
    """'blk.3.attn_q.weight' -> ('blk.{i}.attn_q.weight', '3'); global names come back unchanged."""
    match = re.match(r"^(blk|model\.layers)\.(\d+)\.(.*)$", name)
    if not match:
        return name, None
    return f"{match.group(1)}.{{i}}.{match.group(3)}", match.group(2)


def _gguf_name_to_hf(name: str) -> str | None:
    template, index = _template_and_index(name)
    hf = _GGUF_TO_HF.get(template)
    return None if hf is None else hf.format(i=index)


def _hf_name_to_gguf(name: str) -> str:
    template, index = _template_and_index(name)
    gguf_template = _HF_TO_GGUF.get(template)
    return name if gguf_template is None else gguf_template.format(i=index)


def _unpermute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverts llama.cpp's `permute` of attn_q / attn_k rows (weights and biases).

    llama.cpp's convert does `w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)`, interleaving
    each head's two rotary halves for its RoPE kernel; our RoPE (like HF's) rotates the halves as blocks.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot undo the RoPE permutation: {rows} rows do not split into {n_head} heads of pairs")
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


class _GGUFSource(_TensorSource):
    """Dequantized GGUF tensors under their HF names, in PyTorch [out, in] layout."""

    def __init__(self, reader, config: ModelConfig):
        self._tensors = {}
        self._unknown = []
        for tensor in reader.tensors:
            hf = _gguf_name_to_hf(tensor.name)
            if hf is None:
                self._unknown.append(tensor.name)
            else:
                self._tensors[hf] = tensor
        self._heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
        # Only llama.cpp's LlamaModel (and its subclasses) permutes q/k; Qwen2 is stored as in HF.
        self._permuted = config.model_type == "llama"

    def names(self):
        # Unknown GGUF names are passed through so the unexpected-tensor check names them.
        return [*self._tensors, *self._unknown]

    def describe(self, name):
        return _hf_name_to_gguf(name)

    def shape(self, name):
        # GGUF lists dimensions innermost first.
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def read(self, name):
        from gguf.quants import dequantize

        tensor = self._tensors[name]
        gguf_name = tensor.name
        try:
            weight = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ValueError(
                f"tensor {gguf_name!r} has GGUF type {tensor.tensor_type.name}, which gguf cannot dequantize"
            ) from None
        weight = np.asarray(weight, np.float32).reshape(self.shape(name))
        kind = gguf_name.split(".")[-2]
        if self._permuted and kind in self._heads:
            weight = _unpermute_rope_rows(weight, self._heads[kind])
        return weight


_REQUIRED = object()


class _GGUFMetadata:
    """The key/value metadata of a GGUF file, read as plain Python values."""

    def __init__(self, reader):
        self._fields = reader.fields

    def __contains__(self, key):
        return key in self._fields

    def get(self, key, default=None):
        if key not in self._fields:
            if default is _REQUIRED:
                raise ValueError(f"GGUF metadata lacks required key {key!r}")
            return default
        return self._fields[key].contents()

    def keys(self):
        return self._fields.keys()


def _uniform(value, key: str) -> int:
    """Per-layer GGUF values (lists) are accepted only when all layers agree."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"unsupported per-layer values in GGUF {key!r}: {sorted(set(value))}")
        return value[0]
    return value


def _gguf_hf_config(meta: _GGUFMetadata, tensor_names: set[str]) -> dict:
    """An HF-style config dict from GGUF metadata, refusing features the model does not implement."""
    arch = meta.get("general.architecture", _REQUIRED)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF general.architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )

    def key(name, default=_REQUIRED):
        return meta.get(f"{arch}.{name}", default)

    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            "unsupported GGUF tensor 'rope_freqs.weight': per-frequency RoPE factors (e.g. Llama 3.1 rope scaling)"
        )
    for name in meta.keys():
        if name.startswith(f"{arch}.") and "sliding_window" in name:
            raise ValueError(f"unsupported GGUF key {name!r}: sliding-window attention is not implemented")
    if (key("expert_count", 0) or 0) > 0:
        raise ValueError(f"unsupported GGUF {arch}.expert_count={key('expert_count')}: mixture-of-experts")

    hidden = int(key("embedding_length"))
    num_heads = int(_uniform(key("attention.head_count"), f"{arch}.attention.head_count"))
    num_kv_heads = int(_uniform(key("attention.head_count_kv", num_heads), f"{arch}.attention.head_count_kv"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    value_dim = int(key("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ValueError(f"unsupported GGUF {arch}.attention.value_length={value_dim} != key_length={head_dim}")
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(
            f"unsupported GGUF {arch}.rope.dimension_count={rope_dim}: partial rotary (head_dim {head_dim})"
        )

    rope_scaling = None
    scaling_type = key("rope.scaling.type", None)
    if scaling_type in (None, "none"):
        if (key("rope.scale_linear", 1.0) or 1.0) != 1.0:  # older files' spelling of linear scaling
            rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scale_linear"))}
    elif scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    else:
        raise ValueError(f"unsupported GGUF {arch}.rope.scaling.type {scaling_type!r}; supported: none, linear")

    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = key("vocab_size", None)
    if vocab_size is None:
        if tokens is None:
            raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        vocab_size = len(tokens)
    default_eps = 1e-6 if arch == "qwen2" else 1e-5
    hf = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(_uniform(key("feed_forward_length"), f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length", 8192)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", default_eps)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    if arch == "llama":
        hf["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    else:
        hf["use_sliding_window"] = False
    for field, gguf_key in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        value = meta.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            hf[field] = int(value)
    # llama.cpp stops at end-of-turn / end-of-message tokens too (e.g. Llama 3's <|eot_id|>).
    eos_ids = []
    for gguf_key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    if eos_ids:
        hf["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    return hf


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet byte-level BPE vocabularies are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


# llama.cpp's pre-tokenizer regexes by `tokenizer.ggml.pre`: the split the BPE merges were learned on.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZER_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "tekken": _TEKKEN_SPLIT,
}
# Pre-tokenizers that are GPT-2's byte-level regex, "smollm" after splitting digits one by one.
_GPT2_STYLE_PRE = ("default", "gpt-2", "gpt2", "smollm")


def _gguf_pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    if pre in GGUF_PRE_TOKENIZER_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre is None or pre in _GPT2_STYLE_PRE:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre == "smollm":
            return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        return byte_level
    supported = ", ".join(sorted([*GGUF_PRE_TOKENIZER_SPLITS, *_GPT2_STYLE_PRE]))
    raise ValueError(f"unsupported GGUF tokenizer.ggml.pre {pre!r}; supported: {supported}")


def _gguf_tokenizer(meta: _GGUFMetadata, hf_config: dict):
    """Builds the HF `tokenizers` tokenizer and the tokenizer_config.json dict from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, processors
    from tokenizers.models import BPE

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer.ggml.model {model!r}; only 'gpt2' (byte-level BPE) is supported"
        )
    tokens = meta.get("tokenizer.ggml.tokens", _REQUIRED)
    merges = meta.get("tokenizer.ggml.merges", _REQUIRED)
    token_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token llama.cpp stored as raw text is respelled in the byte alphabet, as byte-level BPE looks it up.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"malformed GGUF tokenizer.ggml.merges entry {merge!r}")
        pairs.append(tuple(parts))
    tokenizer = Tokenizer(
        BPE(vocab, pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    tokenizer.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens (type 3) are special and never split. One spelled outside the byte alphabet is a
    # llama.cpp mislabel; adding it would grow the vocabulary past the embedding, so it is skipped.
    special = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types)
        if kind == 3 and set(token) <= alphabet
    ]
    tokenizer.add_special_tokens(special)
    # User-defined tokens (type 4, e.g. <think>) are matched whole too, but are ordinary text. As above, only
    # ones already in the vocabulary, so no new ids appear.
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(tokens, token_types)
            if kind == 4 and token in vocab
        ]
    )

    def token_id(gguf_key):
        index = meta.get(f"tokenizer.ggml.{gguf_key}")
        if index is not None and not 0 <= index < len(tokens):
            raise ValueError(f"GGUF tokenizer.ggml.{gguf_key}={index} is outside the vocabulary of {len(tokens)}")
        return index

    def token_text(gguf_key):
        index = token_id(gguf_key)
        return None if index is None else tokens[index]

    bos, eos = token_text("bos_token_id"), token_text("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos is None) or (add_eos and eos is None):
        raise ValueError("GGUF asks to add a BOS/EOS token (tokenizer.ggml.add_*_token) but gives no token id")
    if add_bos or add_eos:

        def wrap(sequence, type_id):
            return (
                ([f"{bos}:{type_id}"] if add_bos else [])
                + [f"${sequence}:{type_id}"]
                + ([f"{eos}:{type_id}"] if add_eos else [])
            )

        special_tokens = [(bos, token_id("bos_token_id"))] if add_bos else []
        if add_eos and eos != bos:
            special_tokens.append((eos, token_id("eos_token_id")))
        tokenizer.post_processor = processors.TemplateProcessing(
            single=wrap("A", 0), pair=wrap("A", 0) + wrap("B", 1), special_tokens=special_tokens
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": token_text("padding_token_id"),
        "unk_token": token_text("unknown_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": hf_config["max_position_embeddings"],
    }
    chat_template = meta.get("tokenizer.chat_template")
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    return tokenizer, tokenizer_config


def convert_gguf(
    src: str | os.PathLike, dst: str | os.PathLike, dtype: Any = "float32", overwrite: bool = False
) -> str:
    """Converts a llama.cpp GGUF file (architecture llama or qwen2, byte-level BPE tokenizer) to a clusterkv
    checkpoint at `dst`, dequantizing every tensor."""
    import gguf

    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    dtype_name, np_dtype = _resolve_dtype(dtype)
    if not os.path.isfile(src):
        raise FileNotFoundError(f"no GGUF file at {src!r}")
    if os.path.lexists(dst) and not overwrite:
        raise FileExistsError(f"destination {dst!r} already exists; pass overwrite=True (--overwrite) to replace it")
    reader = gguf.GGUFReader(src)
    meta = _GGUFMetadata(reader)
    tensor_names = {t.name for t in reader.tensors}
    hf_config = _gguf_hf_config(meta, tensor_names)
    config = ModelConfig.from_hf_dict(hf_config)
    tokenizer, tokenizer_config = _gguf_tokenizer(meta, hf_config)

    with _staging_dir(dst, overwrite) as staging:
        source = _GGUFSource(reader, config)
        params = _build_params(source, config, np_dtype, desc="gguf tensors")
        out_config = dict(hf_config, clusterkv={"dtype": dtype_name, "source": src, "format": "gguf"})
        _write_json(os.path.join(staging, "config.json"), out_config)
        tokenizer.save(os.path.join(staging, "tokenizer.json"))
        _write_json(os.path.join(staging, "tokenizer_config.json"), tokenizer_config)
        _checkpoint.save_params(os.path.join(staging, _checkpoint.PARAMS_SUBDIR), params)
    return dst
