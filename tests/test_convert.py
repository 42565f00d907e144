"""Checkpoint converters: HF safetensors and GGUF against transformers' own loading, plus error handling."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from checkpoints_convert import convert_gguf, convert_hf, hf_state_dict_to_params, params_to_hf_state_dict
from checkpoints_convert.__main__ import main as cli_main
from clusterkv_jax import checkpoint
from clusterkv_jax.checkpoint import load_params
from clusterkv_jax.config import ModelConfig
from tests.helpers import GGUF_GLOBAL, GGUF_NAMES

# Slow (not in make test-fast): converts checkpoints.
pytestmark = pytest.mark.slow

# ----------------------------------------------------------------------------------------------------------
# Tiny random checkpoints
# ----------------------------------------------------------------------------------------------------------

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 259,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}


def tiny_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """A random HF state dict (PyTorch layout) for `cfg`."""
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    N, K, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (V, D)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (N * H, D),
            p + "self_attn.k_proj.weight": (K * H, D),
            p + "self_attn.v_proj.weight": (K * H, D),
            p + "self_attn.o_proj.weight": (D, N * H),
            p + "post_attention_layernorm.weight": (D,),
            p + "mlp.gate_proj.weight": (F, D),
            p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F),
        })
        if cfg["model_type"] == "qwen2":
            shapes.update({p + "self_attn.q_proj.bias": (N * H,), p + "self_attn.k_proj.bias": (K * H,),
                           p + "self_attn.v_proj.bias": (K * H,)})
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_tiny_hf(path, cfg: dict | None = None, tensors: dict | None = None, shards: int = 1) -> str:
    """Writes config.json and safetensors (one file, or `shards` files with an index) to `path`."""
    cfg = dict(TINY_CONFIG) if cfg is None else cfg
    tensors = tiny_tensors(cfg) if tensors is None else tensors
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    # Any tokenizer will do: the converter copies it as it is.
    Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(os.path.join(path, "tokenizer.json"))
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return str(path)
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: tensors[n] for n in part}, os.path.join(path, shard))
        weight_map.update({n: shard for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(path)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (the reference we must invert)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


TINY_MERGES = ["h e", "l l"]


def write_tiny_gguf(path, cfg: dict | None = None, tensors: dict | None = None, *, rope_scaling: str | None = None,
                    extra_tensors: dict | None = None, tokenizer_model: str = "gpt2", arch: str | None = None,
                    add_bos: bool = True) -> str:
    """A float32 GGUF holding `tensors` (HF names and layout) the way llama.cpp's converter writes them."""
    import gguf
    from gguf.vocab import bytes_to_unicode

    cfg = dict(TINY_CONFIG) if cfg is None else cfg
    tensors = tiny_tensors(cfg) if tensors is None else tensors
    arch = arch or cfg["model_type"]
    N, K = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(N)
    writer.add_head_count_kv(K)
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if rope_scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling))
        writer.add_rope_scaling_factor(4.0)
    # 256 byte tokens, two merges, one control token.
    tokens = list(bytes_to_unicode().values()) + ["he", "ll", "<|endoftext|>"]
    assert len(tokens) == cfg["vocab_size"]
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(TINY_MERGES)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    renames = {**GGUF_GLOBAL, **GGUF_NAMES}
    for name, w in tensors.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            gguf_name = f"blk.{i}.{renames[rest]}"
        else:
            gguf_name = renames[name]
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            w = llama_cpp_permute(w, N if ".attn_q." in gguf_name else K)
        writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    for gguf_name, w in (extra_tensors or {}).items():
        writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def assert_params_equal(a: dict, b: dict, **allclose):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_params_equal(a[key], b[key], **allclose)
        elif allclose:
            np.testing.assert_allclose(np.asarray(a[key]), np.asarray(b[key]), err_msg=key, **allclose)
        else:
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


def sibling_names(path) -> set[str]:
    return set(os.listdir(os.path.dirname(os.path.abspath(path))))


# ----------------------------------------------------------------------------------------------------------
# SmolLM2 against transformers
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_gguf_converted_dir(smollm2_gguf_path, tmp_path_factory) -> str:
    return convert_gguf(smollm2_gguf_path, tmp_path_factory.mktemp("smollm2_gguf_ckpt") / "converted")


def test_hf_converter_params_equal_torch_tensors(smollm2_converted_dir, hf_smollm2):
    import torch

    model, _ = hf_smollm2
    config = ModelConfig.from_dir(smollm2_converted_dir)
    params = load_params(smollm2_converted_dir, as_numpy=True)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    D, N, K, H = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    assert "lm_head" not in params  # tied
    np.testing.assert_array_equal(params["embed"], state["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["final_norm"], state["model.norm.weight"])
    layers = params["layers"]
    for i in (0, 13, config.num_layers - 1):
        p = f"model.layers.{i}."
        assert layers["q"].dtype == np.float32
        np.testing.assert_array_equal(layers["q"][i], state[p + "self_attn.q_proj.weight"].T.reshape(D, N, H))
        np.testing.assert_array_equal(layers["k"][i], state[p + "self_attn.k_proj.weight"].T.reshape(D, K, H))
        np.testing.assert_array_equal(layers["v"][i], state[p + "self_attn.v_proj.weight"].T.reshape(D, K, H))
        np.testing.assert_array_equal(layers["o"][i], state[p + "self_attn.o_proj.weight"].T.reshape(N, H, D))
        np.testing.assert_array_equal(layers["down"][i], state[p + "mlp.down_proj.weight"].T)
        np.testing.assert_array_equal(layers["attn_norm"][i], state[p + "input_layernorm.weight"])
        np.testing.assert_array_equal(layers["mlp_norm"][i], state[p + "post_attention_layernorm.weight"])

    # The layout means what HF computes: project a random input with both and compare per head.
    attn = model.model.layers[13].self_attn
    x = np.random.default_rng(0).standard_normal((3, D)).astype(np.float32)
    heads = np.random.default_rng(1).standard_normal((3, N, H)).astype(np.float32)
    with torch.no_grad():
        ref_q = attn.q_proj(torch.from_numpy(x)).view(3, N, H).numpy()
        ref_k = attn.k_proj(torch.from_numpy(x)).view(3, K, H).numpy()
        ref_o = attn.o_proj(torch.from_numpy(heads).reshape(3, N * H)).numpy()
        ref_mlp = model.model.layers[13].mlp(torch.from_numpy(x)).numpy()
    # float32 sums in a different order: compare relative to each output's scale.
    def assert_close(ours, ref):
        assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max()

    assert_close(np.einsum("TD,DNH->TNH", x, layers["q"][13]), ref_q)
    assert_close(np.einsum("TD,DKH->TKH", x, layers["k"][13]), ref_k)
    assert_close(np.einsum("TNH,NHD->TD", heads, layers["o"][13]), ref_o)
    gate, up = x @ layers["gate"][13], x @ layers["up"][13]
    assert_close((gate / (1 + np.exp(-gate)) * up) @ layers["down"][13], ref_mlp)


def test_hf_converter_writes_config_and_tokenizer(smollm2_converted_dir, smollm2_hf_dir):
    with open(os.path.join(smollm2_converted_dir, "config.json")) as f:
        out = json.load(f)
    assert out["clusterkv"]["dtype"] == "float32"
    assert out["clusterkv"]["source"] == os.path.abspath(smollm2_hf_dir)
    assert ModelConfig.from_dir(smollm2_converted_dir) == ModelConfig.from_dir(smollm2_hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(smollm2_hf_dir, name), "rb") as source:
            with open(os.path.join(smollm2_converted_dir, name), "rb") as copied:
                assert source.read() == copied.read()


def test_gguf_converter_matches_hf_path(smollm2_gguf_converted_dir, smollm2_converted_dir):
    # Both hold the same dequantized numbers, so transformers' loader (with its own q/k un-permutation) and
    # ours agree exactly.
    ours = load_params(smollm2_gguf_converted_dir, as_numpy=True)
    ref = load_params(smollm2_converted_dir, as_numpy=True)
    assert_params_equal(ours, ref)
    assert ModelConfig.from_dir(smollm2_gguf_converted_dir) == ModelConfig.from_dir(smollm2_converted_dir)


TOKENIZER_TEXTS = [
    "Hello world! How are you today?",
    "  leading spaces,\ttabs and\n\nnewlines   ",
    "Unicode: héllo wörld — 你好，世界 🤗 ñ Ωμέγα",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "numbers 1234567 and 3.14159; don't I'LL we've",
    "<|endoftext|>code: def f(x):\n    return x**2  # square",
]


def test_gguf_tokenizer_matches_transformers(smollm2_gguf_converted_dir, hf_smollm2):
    _, hf_tokenizer = hf_smollm2
    ours = Tokenizer.from_file(os.path.join(smollm2_gguf_converted_dir, "tokenizer.json"))
    assert ours.get_vocab_size() == len(hf_tokenizer)
    for text in TOKENIZER_TEXTS:
        ids = ours.encode(text).ids
        assert ids == hf_tokenizer(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
    assert ours.encode("<|im_start|>").ids == [hf_tokenizer.convert_tokens_to_ids("<|im_start|>")]

    with open(os.path.join(smollm2_gguf_converted_dir, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    assert tokenizer_config["chat_template"] == hf_tokenizer.chat_template
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert tokenizer_config[key] == getattr(hf_tokenizer, key), key
    assert tokenizer_config["add_bos_token"] is False



@pytest.mark.parametrize("model_type,tied", [("llama", False), ("llama", True), ("qwen2", False)])
def test_params_to_hf_state_dict_inverts_the_converter(model_type, tied):
    """Back to the HF layout, tensor by tensor equal to the state dict the params were built from."""
    cfg = dict(TINY_CONFIG, model_type=model_type, tie_word_embeddings=tied)
    tensors = tiny_tensors(cfg, seed=3)
    back = params_to_hf_state_dict(hf_state_dict_to_params(tensors, cfg), ModelConfig.from_hf_dict(cfg))
    assert sorted(back) == sorted(tensors)
    for name, w in tensors.items():
        np.testing.assert_array_equal(back[name], w, err_msg=name)

# ----------------------------------------------------------------------------------------------------------
# Tiny GGUF files: RoPE un-permutation, biases, refusals
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_tiny_gguf_round_trip(tmp_path, model_type):
    cfg = dict(TINY_CONFIG, model_type=model_type)
    tensors = tiny_tensors(cfg)
    src = write_tiny_gguf(tmp_path / "tiny.gguf", cfg, tensors)
    dst = convert_gguf(src, tmp_path / "out")
    # Undoing llama.cpp's permutation (llama only) gives back the HF tensors exactly.
    assert_params_equal(load_params(dst, as_numpy=True), hf_state_dict_to_params(tensors, cfg))
    # GGUF stores the epsilon as float32, and the token ids with the tokenizer.
    expected = dataclasses.replace(ModelConfig.from_hf_dict(cfg), rms_norm_eps=float(np.float32(1e-5)),
                                   bos_token_id=258, eos_token_ids=(258,))
    assert ModelConfig.from_dir(dst) == expected
    # add_bos_token puts BOS in front; the merges apply.
    tokenizer = Tokenizer.from_file(os.path.join(dst, "tokenizer.json"))
    assert tokenizer.encode("hello").tokens == ["<|endoftext|>", "he", "ll", "o"]


def test_gguf_yarn_needs_its_original_context_and_longrope_is_refused(tmp_path):
    src = write_tiny_gguf(tmp_path / "yarn.gguf", rope_scaling="yarn")
    with pytest.raises(ValueError, match="rope.scaling.original_context_length"):
        convert_gguf(src, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")
    src = write_tiny_gguf(tmp_path / "longrope.gguf", rope_scaling="longrope")
    with pytest.raises(ValueError, match="rope.scaling.type 'longrope'"):
        convert_gguf(src, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


def test_gguf_refuses_rope_freqs_tensor(tmp_path):
    src = write_tiny_gguf(tmp_path / "freqs.gguf", extra_tensors={"rope_freqs.weight": np.ones(2, np.float32)})
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        convert_gguf(src, tmp_path / "out")


def test_gguf_refuses_other_tokenizer_models(tmp_path):
    src = write_tiny_gguf(tmp_path / "spm.gguf", tokenizer_model="llama")
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'llama'"):
        convert_gguf(src, tmp_path / "out")


def test_gguf_refuses_other_architectures(tmp_path):
    src = write_tiny_gguf(tmp_path / "gemma.gguf", arch="gemma")
    with pytest.raises(ValueError, match="general.architecture 'gemma'"):
        convert_gguf(src, tmp_path / "out")


def test_gguf_names_missing_tensor_in_gguf_spelling(tmp_path):
    tensors = tiny_tensors(TINY_CONFIG)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    src = write_tiny_gguf(tmp_path / "missing.gguf", tensors=tensors)
    with pytest.raises(ValueError, match=r"missing tensor 'blk\.1\.ffn_up\.weight'"):
        convert_gguf(src, tmp_path / "out")


# ----------------------------------------------------------------------------------------------------------
# Tiny HF checkpoints: errors, atomicity, shards, dtypes, CLI
# ----------------------------------------------------------------------------------------------------------


def test_hf_missing_config(tmp_path):
    src = write_tiny_hf(tmp_path / "src")
    os.remove(os.path.join(src, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        convert_hf(src, tmp_path / "out")


def test_hf_no_safetensors(tmp_path):
    src = write_tiny_hf(tmp_path / "src")
    os.remove(os.path.join(src, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        convert_hf(src, tmp_path / "out")


def test_hf_missing_tensor_is_named(tmp_path):
    tensors = tiny_tensors(TINY_CONFIG)
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    src = write_tiny_hf(tmp_path / "src", tensors=tensors)
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.o_proj\.weight'"):
        convert_hf(src, tmp_path / "out")


def test_hf_wrong_shape_is_named(tmp_path):
    tensors = tiny_tensors(TINY_CONFIG)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 16), np.float32)
    src = write_tiny_hf(tmp_path / "src", tensors=tensors)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(16, 16\), "
                                         r"expected \(8, 16\)"):
        convert_hf(src, tmp_path / "out")


def test_hf_unexpected_tensor_is_refused(tmp_path):
    tensors = tiny_tensors(TINY_CONFIG)
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(4, np.float32)
    src = write_tiny_hf(tmp_path / "src", tensors=tensors)
    with pytest.raises(ValueError, match="q_norm"):
        convert_hf(src, tmp_path / "out")


@pytest.mark.parametrize("override, message", [
    ({"model_type": "gpt_neox"}, "unsupported model_type 'gpt_neox'"),
    ({"rope_scaling": {"rope_type": "proportional", "factor": 4.0}}, "unsupported rope scaling type 'proportional'"),
])
def test_hf_unsupported_config_is_refused(tmp_path, override, message):
    src = write_tiny_hf(tmp_path / "src", cfg=dict(TINY_CONFIG, **override), tensors=tiny_tensors(TINY_CONFIG))
    with pytest.raises(ValueError, match=message):
        convert_hf(src, tmp_path / "out")
    assert sibling_names(tmp_path / "out") == {"src"}


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    src = write_tiny_hf(tmp_path / "src")

    def failing_save(path, params, axes=None):
        os.makedirs(path)
        open(os.path.join(path, "partial"), "w").close()
        raise RuntimeError("disk full")

    monkeypatch.setattr(checkpoint, "save_params", failing_save)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_hf(src, tmp_path / "out")
    assert sibling_names(tmp_path / "out") == {"src"}

    # Failing to overwrite keeps the old checkpoint whole.
    monkeypatch.undo()
    convert_hf(src, tmp_path / "out", dtype="float32")
    before = sorted(os.listdir(tmp_path / "out"))
    monkeypatch.setattr(checkpoint, "save_params", failing_save)
    with pytest.raises(RuntimeError):
        convert_hf(src, tmp_path / "out", overwrite=True)
    assert sibling_names(tmp_path / "out") == {"src", "out"}
    assert sorted(os.listdir(tmp_path / "out")) == before


def test_existing_destination_needs_overwrite(tmp_path):
    src = write_tiny_hf(tmp_path / "src")
    dst = convert_hf(src, tmp_path / "out", dtype="float32")
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert_hf(src, dst)
    other = write_tiny_hf(tmp_path / "src2", tensors=tiny_tensors(TINY_CONFIG, seed=1))
    convert_hf(other, dst, dtype="float32", overwrite=True)
    expected = hf_state_dict_to_params(tiny_tensors(TINY_CONFIG, seed=1), TINY_CONFIG)
    assert_params_equal(load_params(dst, as_numpy=True), expected)
    assert sibling_names(dst) == {"src", "src2", "out"}


def test_sharded_checkpoint_converts(tmp_path):
    tensors = tiny_tensors(TINY_CONFIG)
    src = write_tiny_hf(tmp_path / "src", tensors=tensors, shards=2)
    assert len([n for n in os.listdir(src) if n.endswith(".safetensors")]) == 2
    params = load_params(convert_hf(src, tmp_path / "out", dtype="float32"), as_numpy=True)
    assert_params_equal(params, hf_state_dict_to_params(tensors, TINY_CONFIG))
    np.testing.assert_array_equal(params["lm_head"], tensors["lm_head.weight"].T)
    np.testing.assert_array_equal(params["layers"]["up"][1], tensors["model.layers.1.mlp.up_proj.weight"].T)

    os.remove(os.path.join(src, "model-00002-of-00002.safetensors"))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        convert_hf(src, tmp_path / "out2")


def test_bfloat16_output(tmp_path):
    tensors = tiny_tensors(TINY_CONFIG)
    dst = convert_hf(write_tiny_hf(tmp_path / "src", tensors=tensors), tmp_path / "out")  # default bfloat16
    with open(os.path.join(dst, "config.json")) as f:
        assert json.load(f)["clusterkv"]["dtype"] == "bfloat16"
    params = load_params(dst, as_numpy=True)
    assert params["layers"]["q"].dtype == ml_dtypes.bfloat16
    assert params["embed"].dtype == ml_dtypes.bfloat16
    expected = hf_state_dict_to_params(tensors, TINY_CONFIG, dtype=ml_dtypes.bfloat16)
    assert_params_equal(params, expected)
    # Restoring as jax arrays, cast on the way.
    restored = load_params(dst, dtype="float32")
    assert restored["layers"]["o"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(restored["layers"]["o"]), params["layers"]["o"].astype(np.float32))


def test_bfloat16_source_converts_exactly(tmp_path):
    # Most HF checkpoints are stored in bfloat16; widening to float32 and keeping bfloat16 are both exact.
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tiny_tensors(TINY_CONFIG).items()}
    src = write_tiny_hf(tmp_path / "src", tensors=tensors)
    as_f32 = load_params(convert_hf(src, tmp_path / "f32", dtype="float32"), as_numpy=True)
    as_bf16 = load_params(convert_hf(src, tmp_path / "bf16"), as_numpy=True)
    q_proj = tensors["model.layers.1.self_attn.q_proj.weight"].astype(np.float32)
    np.testing.assert_array_equal(as_f32["layers"]["q"][1], q_proj.T.reshape(16, 4, 4))
    assert_params_equal(as_bf16, hf_state_dict_to_params(tensors, TINY_CONFIG, dtype=ml_dtypes.bfloat16))
    assert as_bf16["layers"]["q"].dtype == ml_dtypes.bfloat16


def test_integer_tensor_is_refused(tmp_path):
    tensors = tiny_tensors(TINY_CONFIG)
    tensors["model.norm.weight"] = np.ones(16, np.int8)
    src = write_tiny_hf(tmp_path / "src", tensors=tensors)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has dtype int8"):
        convert_hf(src, tmp_path / "out")


def test_cli(tmp_path, capsys):
    src = write_tiny_hf(tmp_path / "src")
    assert cli_main(["hf", src, str(tmp_path / "out"), "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert load_params(tmp_path / "out", as_numpy=True)["embed"].dtype == np.float32
    assert cli_main(["hf", src, str(tmp_path / "out")]) == 1
    assert "already exists" in capsys.readouterr().err
    assert cli_main(["hf", str(tmp_path / "nowhere"), str(tmp_path / "out2")]) == 1
    assert "config.json" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------
# Nothing lost, nothing left behind
# ----------------------------------------------------------------------------------------------------------


def tree_snapshot(root) -> dict[str, bytes]:
    """Every file under root with its bytes (the whole tree, to show nothing was lost or added)."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def test_destination_overlapping_the_source_is_refused(tmp_path):
    """dst = src, dst inside src, dst containing src (its parent, with unrelated files): refused before anything
    is read or written, even with --overwrite; every file stays as it was (once, dst = src deleted the source)."""
    src = write_tiny_hf(tmp_path / "parent" / "src")
    (tmp_path / "parent" / "notes.txt").write_text("unrelated")
    before = tree_snapshot(tmp_path)
    for dst, message in [(src, "is the source"), (os.path.join(src, "out"), "lies inside the source"),
                         (str(tmp_path / "parent"), "contains the source")]:
        with pytest.raises(ValueError, match=message):
            convert_hf(src, dst, overwrite=True)
        assert cli_main(["hf", src, dst, "--overwrite"]) == 1
    gguf_file = write_tiny_gguf(tmp_path / "model.gguf")
    gguf_bytes = open(gguf_file, "rb").read()
    with pytest.raises(ValueError, match="is the source"):
        convert_gguf(gguf_file, gguf_file, overwrite=True)
    assert open(gguf_file, "rb").read() == gguf_bytes
    os.remove(gguf_file)
    assert tree_snapshot(tmp_path) == before


def test_overwrite_replaces_only_an_earlier_conversion(tmp_path, capsys):
    src = write_tiny_hf(tmp_path / "src")
    other = tmp_path / "photos"
    other.mkdir()
    (other / "holiday.jpg").write_bytes(b"\xff\xd8 not ours")
    with pytest.raises(FileExistsError, match="not a converted checkpoint"):
        convert_hf(src, other, overwrite=True)
    assert cli_main(["hf", src, str(other), "--overwrite"]) == 1
    assert "not a converted checkpoint" in capsys.readouterr().err
    assert (other / "holiday.jpg").read_bytes() == b"\xff\xd8 not ours"
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    with pytest.raises(FileExistsError, match="not a converted checkpoint"):
        convert_hf(src, a_file, overwrite=True)
    assert a_file.read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    convert_hf(src, empty, dtype="float32", overwrite=True)  # an empty directory may be replaced
    convert_hf(src, empty, dtype="float32", overwrite=True)  # and so may an earlier conversion
    assert_params_equal(load_params(empty, as_numpy=True), hf_state_dict_to_params(tiny_tensors(TINY_CONFIG), TINY_CONFIG))


def test_stale_staging_directories_of_dead_runs_are_swept(tmp_path):
    """A killed conversion (SIGKILL, power loss) leaves `.NAME.tmp-PID-*`; the next conversion to NAME deletes
    those whose process is gone and leaves a live run's and other names' alone."""
    import subprocess
    import sys

    src = write_tiny_hf(tmp_path / "src")
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    dead, alive, unrelated = (tmp_path / f".out.tmp-{finished.pid}-abc", tmp_path / f".out.tmp-{os.getpid()}-def",
                              tmp_path / f".other.tmp-{finished.pid}-ghi")
    for d in (dead, alive, unrelated):
        (d / "params").mkdir(parents=True)
        (d / "params" / "chunk").write_bytes(b"0" * 100)
    convert_hf(src, tmp_path / "out", dtype="float32")
    assert sibling_names(tmp_path / "out") == {"src", "out", alive.name, unrelated.name}


@pytest.fixture(scope="module")
def larger_hf_dir(tmp_path_factory) -> str:
    """About 150 MB of float32 weights: saving takes long enough to be interrupted at several points."""
    cfg = dict(TINY_CONFIG, vocab_size=16000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
               num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    return write_tiny_hf(tmp_path_factory.mktemp("larger") / "src", cfg=cfg)


@pytest.fixture(params=["renameat2", "mkdir-then-rename"])
def publishing(request, monkeypatch):
    """Publishing with Linux's renameat2(RENAME_NOREPLACE), and without it (the C library lookup fails)."""
    if request.param == "mkdir-then-rename":
        import ctypes

        def no_libc(*args, **kwargs):
            raise OSError("no C library here")

        monkeypatch.setattr(ctypes, "CDLL", no_libc)
    return request.param


def _staged_checkpoint(staging):
    with open(os.path.join(staging, "config.json"), "w") as f:
        json.dump({"clusterkv": {"format": 1}}, f)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_destination_that_appears_during_the_conversion_is_not_replaced(tmp_path, publishing, overwrite):
    """A user's directory created at DST while the conversion ran stays as it was (with or without --overwrite:
    it is not an earlier conversion), and the conversion fails saying so, leaving nothing else behind."""
    from checkpoints_convert.common import staging_dir

    dst = tmp_path / "out"
    with pytest.raises(FileExistsError, match="while the conversion ran"):
        with staging_dir(str(dst), overwrite=overwrite) as staging:
            _staged_checkpoint(staging)
            dst.mkdir()
            (dst / "mine.txt").write_text("user data")
    assert (dst / "mine.txt").read_text() == "user data" and os.listdir(dst) == ["mine.txt"]
    assert os.listdir(tmp_path) == ["out"]


def test_two_conversions_racing_to_one_destination(tmp_path, publishing):
    """Both start while DST is free; the first to finish publishes, the second fails and removes its staging."""
    from checkpoints_convert.common import is_converted_checkpoint, staging_dir

    dst = tmp_path / "out"
    with pytest.raises(FileExistsError, match="appeared while the conversion ran"):
        with staging_dir(str(dst), overwrite=False) as first:
            _staged_checkpoint(first)
            with staging_dir(str(dst), overwrite=False) as second:
                _staged_checkpoint(second)
                (tmp_path / "marker").write_text("second")
                os.rename(tmp_path / "marker", os.path.join(second, "marker"))
    assert is_converted_checkpoint(str(dst)) and (dst / "marker").read_text() == "second"
    assert os.listdir(tmp_path) == ["out"]


def test_overwrite_does_not_replace_what_took_an_earlier_conversions_place(tmp_path, publishing):
    """DST was an earlier conversion when the conversion started (so --overwrite may replace it), and a user's
    directory took its place meanwhile: that directory is kept, not replaced."""
    from checkpoints_convert.common import is_converted_checkpoint, staging_dir

    dst = tmp_path / "out"
    dst.mkdir()
    _staged_checkpoint(str(dst))
    with pytest.raises(FileExistsError, match="not a converted checkpoint"):
        with staging_dir(str(dst), overwrite=True) as staging:
            _staged_checkpoint(staging)
            shutil.rmtree(dst)
            dst.mkdir()
            (dst / "mine.txt").write_text("user data")
    assert (dst / "mine.txt").read_text() == "user data"
    assert os.listdir(tmp_path) == ["out"]
    # An earlier conversion still there at the end is replaced.
    shutil.rmtree(dst)
    dst.mkdir()
    _staged_checkpoint(str(dst))
    with staging_dir(str(dst), overwrite=True) as staging:
        _staged_checkpoint(staging)
        open(os.path.join(staging, "new"), "w").close()
    assert is_converted_checkpoint(str(dst)) and os.path.exists(dst / "new") and os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_interrupt_inside_a_gc_callback_still_stops_the_conversion(signame, tmp_path, capfd):
    """A signal whose handler runs inside a garbage-collection callback (where JAX keeps one) raises there, where
    Python can only print the exception as 'ignored' and go on: the conversion's staging delivers it again, so it
    stops the block once Python is back in ordinary code, cleans up, and nothing is printed. (A CI run's
    SIGTERM landed in JAX's gc callback: 'Exception ignored in: <function _xla_gc_callback ...>'.)"""
    import gc
    import signal
    import time

    from checkpoints_convert.common import staging_dir

    fired = []

    def callback(phase, info):
        if phase == "start" and not fired:
            fired.append(1)
            signal.raise_signal(getattr(signal, signame))  # its handler runs inside this callback

    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    gc.callbacks.append(callback)
    staged = []
    try:
        with pytest.raises(SystemExit if signame == "SIGTERM" else KeyboardInterrupt):
            with staging_dir(str(tmp_path / "out"), overwrite=False) as staging:
                staged.append(staging)
                gc.collect()
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:  # ordinary code: the interrupt arrives here
                    pass
                raise AssertionError("the interrupt was lost")
    finally:
        gc.callbacks.remove(callback)
        signal.signal(signal.SIGINT, previous_int)
    assert fired and staged and not os.path.exists(staged[0]) and not os.path.exists(tmp_path / "out")
    assert "Exception ignored" not in capfd.readouterr().err


@pytest.mark.parametrize("signum,stage,delay", [
    ("SIGTERM", "reading", 0.0),
    ("SIGINT", "saving", 0.0),
    ("SIGINT", "saving", 0.4),
    ("SIGTERM", "saving", 0.2),
    ("SIGTERM", "saving", 1.0),
    ("SIGHUP", "saving", 0.2),
    ("SIGQUIT", "reading", 0.0),
])
def test_interrupted_conversion_leaves_nothing_behind(larger_hf_dir, tmp_path, signum, stage, delay):
    """The CLI in a subprocess, interrupted while reading tensors (the staging directory exists) or `delay` s
    into the orbax save (its params directory exists): it exits with a message and no traceback, and nothing of
    it is left beside the destination (the save finishes its writes before the cleanup runs)."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    # The CLI as a user's shell starts it: SIGINT raising KeyboardInterrupt. A test run started in the background
    # (`cmd &`, nohup) passes SIGINT on ignored, and a process that inherits an ignored SIGINT rightly keeps
    # ignoring it; so the child restores Python's handler before it runs the module.
    start = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "sys.argv[0] = 'checkpoints_convert'; runpy.run_module('checkpoints_convert', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", start, "hf", larger_hf_dir, str(out), "--dtype", "float32"],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    deadline = time.monotonic() + 120
    sent = saved = False
    while proc.poll() is None and time.monotonic() < deadline:
        staging = [n for n in os.listdir(tmp_path) if n.startswith(".out.tmp-")]
        # orbax writes `params.orbax-checkpoint-tmp-*` and renames it to `params` at the end.
        reached = staging and (stage == "reading" or any(
            n.startswith("params") for n in os.listdir(tmp_path / staging[0]) if os.path.exists(tmp_path / staging[0])))
        if reached:
            time.sleep(delay)
            proc.send_signal(getattr(signal, signum))
            sent = True
            # Whether the save had already ended (orbax renamed its tmp directory to `params`, or the checkpoint
            # was published) just after the signal went out: on a loaded machine the conversion can get there
            # between the poll above and the signal, and then publishing is right.
            saved = os.path.exists(out) or any(os.path.isdir(tmp_path / n / "params") for n in os.listdir(tmp_path)
                                               if n.startswith(".out.tmp-"))
            break
        time.sleep(0.005)
    _, err = proc.communicate(timeout=120)
    assert sent, f"the conversion ended before reaching {stage}: {err}"
    assert "Traceback" not in err, err
    if os.path.exists(out):  # the signal came after the publish: a whole checkpoint, nothing else
        assert delay > 0 or saved, "a signal before the save ended must stop the conversion"
        assert os.listdir(tmp_path) == ["out"]
        load_params(out, as_numpy=True)
    else:
        assert proc.returncode == 128 + getattr(signal, signum), (proc.returncode, err)
        assert err.rstrip().endswith("interrupted: nothing was written") or signum != "SIGINT", err
        assert os.listdir(tmp_path) == [], os.listdir(tmp_path)
    time.sleep(1.0)  # nothing still writing in the background recreates anything
    assert set(os.listdir(tmp_path)) <= {"out"}
