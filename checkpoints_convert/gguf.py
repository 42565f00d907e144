"""llama.cpp GGUF files (llama, qwen2, qwen3, phi3 or glm4; byte-level BPE tokenizer) to clusterkv checkpoints,
dequantized. Tensor names are mapped by the `gguf` package's own table of each architecture."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from checkpoints_convert.common import (
    TensorSource,
    build_params,
    check_output,
    resolve_dtype,
    staging_dir,
    write_json,
)
from clusterkv_jax import checkpoint as _checkpoint
from clusterkv_jax.config import FAMILIES, ModelConfig
from clusterkv_jax.model import param_axes

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "phi3": "Phi3ForCausalLM", "glm4": "Glm4ForCausalLM"}
# Architectures whose HF class rotates part of each head (`rope.dimension_count` < head dim).
_PARTIAL_ROTARY = ("phi3", "glm4")


def _gguf_names(config: ModelConfig) -> dict[str, str]:
    """HF name -> GGUF name of every tensor the config's family reads, by the `gguf` package's table."""
    import gguf

    from checkpoints_convert.common import expected_hf_names

    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == config.model_type)
    table = gguf.get_tensor_name_map(arch, config.num_layers)
    names = {}
    for hf in expected_hf_names(config):
        mapped = table.get_name(hf, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"the gguf package names no {config.model_type} tensor for {hf!r}")
        names[hf] = mapped
    return names


def _unpermute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverts llama.cpp's `permute` of attn_q / attn_k rows (weights and biases).

    llama.cpp's convert does `w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)`, interleaving
    each head's two rotary halves for its RoPE kernel; our RoPE (like HF's) rotates the halves as blocks.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot undo the RoPE permutation: {rows} rows do not split into {n_head} heads of pairs")
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


class _GGUFSource(TensorSource):
    """Dequantized GGUF tensors under their HF names, in PyTorch [out, in] layout."""

    def __init__(self, reader, config: ModelConfig):
        self._gguf_of = _gguf_names(config)
        hf_of = {gguf_name: hf for hf, gguf_name in self._gguf_of.items()}
        self._tensors = {}
        self._unknown = []
        for tensor in reader.tensors:
            hf = hf_of.get(tensor.name)
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
        return self._gguf_of.get(name, name)

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
        weight = np.asarray(weight, np.float32)
        if weight.size != int(np.prod(self.shape(name))):
            raise ValueError(
                f"tensor {gguf_name!r} holds {weight.size} values where its header says {self.shape(name)}: "
                "the GGUF file is truncated or corrupt"
            )
        weight = weight.reshape(self.shape(name))
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
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        if name in tensor_names:
            raise ValueError(f"unsupported GGUF tensor {name!r}: LongRoPE factors (Phi-3-128k); convert the HF "
                             "checkpoint instead")
    window = None
    for name in meta.keys():
        if name == f"{arch}.attention.sliding_window" and arch == "phi3":
            window = int(meta.get(name))  # HF's Phi-3 windows every layer by it
        elif name.startswith(f"{arch}.") and "sliding_window" in name:
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
    if rope_dim != head_dim and arch not in _PARTIAL_ROTARY:
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
    elif scaling_type == "yarn":
        if (key("rope.scaling.attn_factor", 1.0) or 1.0) != 1.0:
            raise ValueError(f"unsupported GGUF {arch}.rope.scaling.attn_factor={key('rope.scaling.attn_factor')}")
        rope_scaling = {"rope_type": "yarn", "factor": float(key("rope.scaling.factor")),
                        "original_max_position_embeddings": int(key("rope.scaling.original_context_length"))}
    else:
        raise ValueError(f"unsupported GGUF {arch}.rope.scaling.type {scaling_type!r}; supported: none, linear, "
                         "yarn")

    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = key("vocab_size", None)
    if vocab_size is None:
        if tokens is None:
            raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        vocab_size = len(tokens)
    default_eps = FAMILIES[arch].rms_norm_eps
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
        "partial_rotary_factor": rope_dim / head_dim,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    if window is not None:
        hf["sliding_window"] = window
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


def _byte_level_spelling(text: str) -> str:
    """`text` in GPT-2's printable byte alphabet, as byte-level BPE vocabularies spell it (via `tokenizers`)."""
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return "".join(piece for piece, _ in byte_level.pre_tokenize_str(text))


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
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer.ggml.model {model!r}; only 'gpt2' (byte-level BPE) is supported"
        )
    tokens = meta.get("tokenizer.ggml.tokens", _REQUIRED)
    merges = meta.get("tokenizer.ggml.merges", _REQUIRED)
    token_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    # A token llama.cpp stored as raw text is respelled in the byte alphabet, as byte-level BPE looks it up.
    vocab = {
        token if set(token) <= alphabet else _byte_level_spelling(token): index
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
    """Converts a llama.cpp GGUF file (architecture llama, qwen2, qwen3, phi3 or glm4; byte-level BPE tokenizer) to
    a clusterkv checkpoint at `dst`, dequantizing every tensor."""
    import gguf

    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    dtype_name, np_dtype = resolve_dtype(dtype)
    if not os.path.isfile(src):
        raise FileNotFoundError(f"no GGUF file at {src!r}")
    check_output(src, dst, overwrite)
    try:
        reader = gguf.GGUFReader(src)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as error:
        raise ValueError(f"{src!r} is not a readable GGUF file (truncated or corrupt?): {error}") from None
    meta = _GGUFMetadata(reader)
    tensor_names = {t.name for t in reader.tensors}
    hf_config = _gguf_hf_config(meta, tensor_names)
    config = ModelConfig.from_hf_dict(hf_config)
    tokenizer, tokenizer_config = _gguf_tokenizer(meta, hf_config)

    with staging_dir(dst, overwrite, src) as staging:
        source = _GGUFSource(reader, config)
        params = build_params(source, config, np_dtype, desc="gguf tensors")
        out_config = dict(hf_config, clusterkv={"dtype": dtype_name, "source": src, "format": "gguf"})
        write_json(os.path.join(staging, "config.json"), out_config)
        tokenizer.save(os.path.join(staging, "tokenizer.json"))
        write_json(os.path.join(staging, "tokenizer_config.json"), tokenizer_config)
        _checkpoint.save_params(os.path.join(staging, _checkpoint.PARAMS_SUBDIR), params, axes=param_axes(config))
    return dst
