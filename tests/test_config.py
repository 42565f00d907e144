"""Reading HF config.json: both rope formats, and refusal of every math-changing field we do not implement."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from clusterkv_jax import ModelConfig, load_model

BASE = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def test_reads_transformers_4_and_5_rope_formats_alike():
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    v4 = ModelConfig.from_hf_dict({**BASE, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}})
    v5 = ModelConfig.from_hf_dict({**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    assert v4 == v5
    assert v4.rope_theta == 5e5 and v4.rope_scaling.rope_type == "llama3" and v4.rope_scaling.factor == 8.0
    assert v4.head_dim == 16 and v4.group_size == 2


def test_qwen2_gets_qkv_bias_and_eos_lists():
    c = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2", "eos_token_id": [5, 7]})
    assert c.qkv_bias and not c.o_bias and c.eos_token_ids == (5, 7)


def test_families_map_to_fields():
    """What each family changes in the layer, read from its model_type and config (HF's defaults where the
    config says nothing)."""
    glm = ModelConfig.from_hf_dict({**BASE, "model_type": "glm", "rope_parameters": {
        "rope_theta": 1e4, "partial_rotary_factor": 0.5}})
    assert (glm.qkv_bias, glm.o_bias, glm.rope_interleaved, glm.rotary_dim) == (True, False, True, 8)
    assert glm.rms_norm_eps == 1.5625e-07 and not glm.post_norms
    glm4 = ModelConfig.from_hf_dict({**BASE, "model_type": "glm4", "partial_rotary_factor": 0.5,
                                     "attention_bias": False})
    assert glm4.post_norms and not glm4.qkv_bias and glm4.rotary_dim == 8
    qwen3 = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen3", "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.rotary_dim == 32 and not qwen3.qkv_bias
    phi3 = ModelConfig.from_hf_dict({**BASE, "model_type": "phi3", "attention_bias": True})
    assert not (phi3.qkv_bias or phi3.o_bias or phi3.qk_norm or phi3.rope_interleaved)
    yarn = ModelConfig.from_hf_dict({**BASE, "max_position_embeddings": 128, "rope_scaling": {
        "type": "yarn", "original_max_position_embeddings": 32}}).rope_scaling
    assert yarn.factor == 4.0 and yarn.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)


@pytest.mark.parametrize(
    "override,message",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn rope scaling lacks original_max_position"),
        ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4, "factor": 2.0}}, "'proportional'"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4,
                           "original_max_position_embeddings": 32}}, "need 8 values each"),
        ({"model_type": "phi3", "sliding_window": 0}, "sliding_window must be an int"),
        ({"model_type": "glm", "partial_rotary_factor": 0.1}, "partial_rotary_factor"),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64,
          "layer_types": ["chunked_attention"] * 2}, "layer_types must give one of"),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": -1},
         "max_window_layers"),
        ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 64}, "model_type 'llama': its layers attend"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "multiple"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ],
)
def test_unsupported_fields_are_refused_by_name(override, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict({**BASE, **override})


def test_layer_types_as_hf_reads_them():
    """Which layers are windowed, as HF's model of each family decides: Mistral and Phi-3 window every layer (Mistral
    by default with 4096), Qwen2 only with use_sliding_window (layers from max_window_layers on, unless layer_types
    says); a window that never binds in a cache (>= its capacity, as Phi-3-128k's 262,144) is full attention."""
    from clusterkv_jax import FullKV, init_cache

    sliding, full = "sliding_attention", "full_attention"
    n = BASE["num_hidden_layers"]
    phi3 = ModelConfig.from_hf_dict({**BASE, "model_type": "phi3", "max_position_embeddings": 256,
                                     "sliding_window": 512})
    assert (phi3.sliding_window, phi3.layer_types) == (512, (sliding,) * n)
    assert {g.attention for g in init_cache(phi3, FullKV(), 1, 512).groups} == {"full"}
    assert {g.attention for g in init_cache(phi3, FullKV(), 1, 640).groups} == {"windowed"}
    assert ModelConfig.from_hf_dict({**BASE, "model_type": "mistral"}).sliding_window == 4096
    assert ModelConfig.from_hf_dict({**BASE, "model_type": "mistral", "sliding_window": None}).layer_types == ()
    qwen2 = {**BASE, "model_type": "qwen2", "sliding_window": 64, "max_window_layers": 1}
    assert ModelConfig.from_hf_dict(qwen2).layer_types == ()  # use_sliding_window is off
    assert ModelConfig.from_hf_dict({**qwen2, "use_sliding_window": True}).layer_types == (full,) + (sliding,) * (n - 1)
    given = (sliding, full) * (n // 2)
    assert ModelConfig.from_hf_dict({**qwen2, "use_sliding_window": True, "layer_types": given}).layer_types == given
    assert ModelConfig.from_hf_dict({**BASE, "layer_types": [full] * n}).layer_types == ()


@pytest.mark.parametrize("field, value", [
    ("vocab_size", -1), ("num_attention_heads", 0), ("intermediate_size", -5), ("num_hidden_layers", 30.5),
    ("num_hidden_layers", "30"), ("num_hidden_layers", True), ("num_hidden_layers", 10**9),
    ("max_position_embeddings", 0), ("num_key_value_heads", 0), ("head_dim", 2**40), ("rms_norm_eps", "abc"),
    ("rms_norm_eps", -1e-6), ("rope_theta", float("nan")), ("rope_theta", -1), ("rope_theta", "1e4x"),
])
def test_bad_values_are_refused_naming_the_field(field, value):
    """Each once loaded as a shape mismatch, a Python error or silent garbage (rope_theta NaN: token 0 forever);
    now a ValueError naming the field, before anything is allocated or read."""
    with pytest.raises(ValueError, match=field if field != "num_hidden_layers" or value != 10**9 else "num_layers"):
        ModelConfig.from_hf_dict({**BASE, field: value})


def test_direct_construction_checks_sizes_and_numbers():
    good = ModelConfig.from_hf_dict(BASE)
    for field, value in [("num_layers", 0), ("head_dim", 2.5), ("rope_theta", float("inf")), ("rms_norm_eps", 0)]:
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(good, **{field: value})


def test_missing_required_field_is_named():
    cfg = dict(BASE)
    del cfg["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf_dict(cfg)


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(FileNotFoundError, match="params"):
        load_model(tmp_path)


SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
YNN = "--xla_cpu_experimental_ynn_fusion_type=reduce"
AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl"}


@pytest.mark.slow  # starts Python processes
@pytest.mark.parametrize("flags, machine, features, want", [
    ("", "x86_64", AVX2, f"{SCHEDULER} {YNN}"),  # YNNPACK's dots were the inaccurate ones on AVX2
    ("", "x86_64", AVX512, SCHEDULER),  # and as good as NumPy's, and faster, with AVX-512
    ("", "AMD64", AVX2, f"{SCHEDULER} {YNN}"),
    ("", "aarch64", frozenset({"fp", "asimd"}), SCHEDULER),  # not measured: jaxlib's default
    ("", "x86_64", frozenset(), SCHEDULER),  # features unknown: jaxlib's default
    ("--xla_force_host_platform_device_count=2", "x86_64", AVX2,
     f"--xla_force_host_platform_device_count=2 {SCHEDULER} {YNN}"),
    ("--xla_cpu_enable_concurrency_optimized_scheduler=true", "x86_64", AVX2,
     f"--xla_cpu_enable_concurrency_optimized_scheduler=true {YNN}"),  # the user's choice is kept
    ("--xla_cpu_experimental_ynn_fusion_type=", "x86_64", AVX2,
     f"--xla_cpu_experimental_ynn_fusion_type= {SCHEDULER}"),  # here too
])
def test_cpu_flags_added_by_machine_unless_set(flags, machine, features, want):
    from clusterkv_jax import _with_cpu_flags

    assert _with_cpu_flags(flags, machine, features) == want


def _xla_flags_after_import(env: dict[str, str]) -> str:
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "CLUSTERKV_KEEP_XLA_FLAGS")}
    return subprocess.run([sys.executable, "-c", "import os, clusterkv_jax; print(os.environ.get('XLA_FLAGS', ''))"],
                          env={**base, **env}, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.slow  # starts Python processes
def test_import_adds_this_machines_cpu_flags_unless_told_otherwise():
    import platform

    from clusterkv_jax import _cpu_features, _with_cpu_flags

    if platform.machine() in ("x86_64", "AMD64") and os.path.exists("/proc/cpuinfo"):
        assert {"sse2", "fpu"} <= _cpu_features()  # every x86-64 CPU lists these
    user = "--xla_force_host_platform_device_count=2"
    want = _with_cpu_flags(user, platform.machine(), _cpu_features())  # the rule itself is tested above
    assert want.startswith(f"{user} {SCHEDULER}")
    assert _xla_flags_after_import({"XLA_FLAGS": user}) == want
    assert _xla_flags_after_import({"CLUSTERKV_KEEP_XLA_FLAGS": "1"}) == ""  # opted out: nothing added


@pytest.mark.slow  # converts a checkpoint
def test_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it(tmp_path):
    """A config.json with transformers 5's `rope_parameters` and also an older `rope_scaling` (yarn): loaded, the
    yarn was silently ignored and the logits were up to 3.2 from HF's. transformers uses `rope_scaling` in place of
    `rope_parameters`, with the top-level `rope_theta` (else 10,000); ours now reads the same RoPE, and a tiny random
    Llama saved that way gives HF's logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from checkpoints_convert import convert_hf
    from clusterkv_jax import FullKV, init_cache, prefill

    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    for extra in ({}, {"rope_theta": 12345.0}):
        hf = {**BASE, "max_position_embeddings": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
              "rope_scaling": dict(yarn), **extra}
        ours = ModelConfig.from_hf_dict(hf)
        path = tmp_path / f"config-{len(extra)}"
        path.mkdir()
        (path / "config.json").write_text(json.dumps(hf))
        theirs = transformers.AutoConfig.from_pretrained(path).rope_parameters
        assert (ours.rope_scaling.rope_type, ours.rope_scaling.factor, ours.rope_theta) == (
            theirs["rope_type"], theirs["factor"], theirs["rope_theta"])

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    saved["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    saved["rope_scaling"] = dict(yarn)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(saved))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with pytest.warns(UserWarning, match="no tokenizer.json"):
        convert_hf(tmp_path / "hf", tmp_path / "ours", dtype="float32")
    model = load_model(tmp_path / "ours")
    ids = np.random.default_rng(0).integers(0, 100, (1, 96))
    with torch.no_grad():
        want = hf_model(torch.tensor(ids)).logits.numpy()
    cache = init_cache(model.config, FullKV(), 1, 128)
    got, _ = prefill(model.params, ids, np.array([96], np.int32), cache, config=model.config, policy=FullKV(),
                     all_logits=True)
    np.testing.assert_allclose(np.asarray(got)[:, :96], want, atol=1e-4)
