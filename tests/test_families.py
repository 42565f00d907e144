"""Every supported family and RoPE type against HF transformers: a tiny random checkpoint built and saved by
transformers here (norms and biases perturbed away from their init), converted, equals HF (float32, eager attention)
in the logits at every position and in 32 greedy tokens; ClusterKV with a budget covering the context equals full KV
token for token; ClusterKV, Quest and the host offload run on each architecture, and a ragged batch equals each
prompt alone; a prefill shared by the policies gives each the tokens of its own. ClusterKV's clusters are made of the
keys HF caches (after q/k norm and RoPE); a GGUF of each family llama.cpp names converts to the same parameters."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import clusterkv_jax as ckv  # noqa: E402
from checkpoints_convert import convert_hf  # noqa: E402
from clusterkv_jax.steps import bucket_length  # noqa: E402
from tests.conftest import release_compiled_programs  # noqa: E402
from tests.helpers import GGUF_GLOBAL, GGUF_NAMES  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
LONGROPE = {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)]}
# (model_type, config overrides, prompt length). Each prompt stays on one side of a length-dependent RoPE's switch
# for all 32 new tokens (see README, "Families": HF's Phi-3 recomputes its cache when a generation crosses it).
CASES = {
    "qwen3": ("qwen3", {}, 100),
    "glm": ("glm", {}, 100),  # partial (half) interleaved RoPE, q/k/v biases, fused gate/up
    "glm4": ("glm4", {}, 100),  # and norms after the attention and the MLP
    # Phi-3's sliding_window as the 128k models set it, where it never binds (>= max_position_embeddings)
    "phi3": ("phi3", {"head_dim": None, "sliding_window": 256}, 100),  # fused qkv and gate/up
    "qwen2-yarn": ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 64}}, 100),
    "phi3-longrope-long": ("phi3", {"head_dim": None, "rope_scaling": LONGROPE,
                                    "original_max_position_embeddings": 64, "sliding_window": 256}, 100),
    "phi3-longrope-short": ("phi3", {"head_dim": None, "rope_scaling": LONGROPE,
                                     "original_max_position_embeddings": 64, "sliding_window": 256}, 24),
    "llama-dynamic": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0},
                                "max_position_embeddings": 64}, 100),
    # Sliding windows that bind: every layer (Mistral), and interleaved with full layers (Qwen2's layer_types);
    # prompts several windows long.
    "mistral-window": ("mistral", {"sliding_window": 40}, 150),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 40, "num_hidden_layers": 4,
                               "layer_types": ["sliding_attention", "full_attention"] * 2}, 150),
    # Gemma 2: local and global layers alternate, scores and logits soft-capped (caps lowered from 50 and 30 so
    # that they bind), query_pre_attn_scalar != head_dim.
    "gemma2": ("gemma2", {"sliding_window": 40, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0,
                          "final_logit_softcapping": 10.0}, 150),
    # Gemma 3: two local layers to each global one here, q/k norms, local RoPE base, linear scaling on global layers.
    "gemma3": ("gemma3_text", {"sliding_window": 40, "query_pre_attn_scalar": 24, "num_hidden_layers": 6,
                               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
                               "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                      "rope_theta": 1e6},
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
               150),
}
NEW = 32
# Cases whose architecture another case has, with a RoPE of their own. The RoPE is applied before a key is cached, so
# what ClusterKV, Quest and the offload do after it is the architecture's: these cases check the logits and greedy
# tokens against HF and a covering budget against full KV; the policies' other runs are their architecture's case's.
ROPE_VARIANTS = ("qwen2-yarn", "phi3-longrope-long", "phi3-longrope-short", "llama-dynamic")
ARCHITECTURES = [name for name in CASES if name not in ROPE_VARIANTS]
# Slow (not in make test-fast): converts a checkpoint of each family.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:no tokenizer.json")]
SMALL = dict(sinks=4, tokens_per_cluster=8, decode_interval=16, decode_clusters=2, full_layers=1)


_CASE_COMPILED = [None]  # the case whose programs jax holds


@pytest.fixture(autouse=True)
def _release_compiled_programs_between_cases(request):
    """Every case is a model of its own with its own programs (~25 per test): kept for the whole module they passed
    the kernel's vm.max_map_count (65,530 memory maps) at the 32nd test and XLA segfaulted while compiling. They are
    dropped before a test of another model (pytest runs a case's tests one after another), so the tests of one case
    trace and compile the programs they share (full KV's and ClusterKV's generate) once."""
    callspec = getattr(request.node, "callspec", None)
    case = callspec.params.get("case") if callspec else None
    if case is None or case != _CASE_COMPILED[0]:
        release_compiled_programs()
    _CASE_COMPILED[0] = case
    yield


def _hf_model(model_type: str, overrides: dict):
    fields = {**TINY, **overrides}
    fields = {k: v for k, v in fields.items() if v is not None}
    config = transformers.AutoConfig.for_model(model_type, **fields)
    config.pad_token_id = config.eos_token_id = config.bos_token_id = None
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.3 * torch.randn_like(p))
            p.mul_(3.0)  # peaked attention: dropping tokens shows in the output
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    model_type, overrides, prompt_length = CASES[request.param]
    hf = _hf_model(model_type, overrides)
    root = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(root / "hf")
    convert_hf(root / "hf", root / "ours", dtype="float32")
    ours = ckv.load_model(root / "ours")
    ids = np.random.default_rng(prompt_length).integers(0, TINY["vocab_size"], prompt_length).tolist()
    return request.param, hf, ours, ids


def _generate(model, prompts, policy=ckv.FullKV(), **kw):
    return ckv.generate(model, prompts, NEW, policy=policy, stop_at_eos=False, max_length=256, **kw).tokens


def test_logits_and_greedy_tokens_equal_hf(case):
    name, hf, ours, ids = case
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].double().numpy()
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    tokens = np.zeros((1, 128 if len(ids) <= 128 else 256), np.int32)
    tokens[0, :len(ids)] = ids
    cache = ckv.init_cache(ours.config, ckv.FullKV(), 1, 256)
    logits, _ = ckv.prefill(ours.params, tokens, np.array([len(ids)], np.int32), cache, config=ours.config,
                            policy=ckv.FullKV(), all_logits=True)
    got = np.asarray(logits)[0, :len(ids)]
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max()), name
    # q/k/v stored as a TPU stores them (the model dim last, `model.move_model_dim_last`): HF's logits too.
    tpu_layout = {**ours.params, "layers": ckv.model.move_model_dim_last(ours.params["layers"])}
    logits, _ = ckv.prefill(tpu_layout, tokens, np.array([len(ids)], np.int32),
                            ckv.init_cache(ours.config, ckv.FullKV(), 1, 256), config=ours.config,
                            policy=ckv.FullKV(), all_logits=True)
    got = np.asarray(logits)[0, :len(ids)]
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max()), name
    assert _generate(ours, ids)[0] == greedy[0, len(ids):].tolist(), name


def test_a_covering_budget_equals_full_kv(case):
    name, _, ours, ids = case
    full = _generate(ours, ids)[0]
    assert _generate(ours, ids, ckv.ClusterKV(budget=512, **SMALL))[0] == full, name


@pytest.mark.parametrize("case", ARCHITECTURES, indirect=True)
def test_policies_run_and_offloading_changes_nothing(case):
    name, _, ours, ids = case
    small = ckv.ClusterKV(budget=24, **SMALL)
    on_device = _generate(ours, ids, small)[0]
    assert _generate(ours, ids, ckv.ClusterKV(budget=24, offload=True, **SMALL))[0] == on_device, name
    quest = ckv.Quest(budget=32, page_size=8, full_layers=1)
    by_pages = _generate(ours, ids, quest)[0]
    assert len(by_pages) == NEW
    # One full-KV prefill shared by the policies: each stores and indexes its K/V (a windowed layer's ring copied)
    # and generates what it does after its own prefill.
    shared = ckv.prefill_prompts(ours, ids, NEW, max_length=256)
    assert _generate(ours, ids, small, prefilled=shared)[0] == on_device, name
    assert _generate(ours, ids, quest, prefilled=shared)[0] == by_pages, name
    # The layers as a GPU runs them (a Python loop over per-layer parameters, q/k/v and gate/up fused, not the
    # CPU's scan over stacked ones): the same tokens, with the KV in device and in host memory.
    with ckv.kernels.forced_layer_loop("unrolled"):
        gpu_layout = dataclasses.replace(ours, params=ckv.model.for_device(ours.params))
        assert "qkv" in gpu_layout.params["layers"][0], name
        assert _generate(gpu_layout, ids, small)[0] == on_device, name
        assert _generate(gpu_layout, ids, ckv.ClusterKV(budget=24, offload=True, **SMALL))[0] == on_device, name
        shared = ckv.prefill_prompts(gpu_layout, ids, NEW, max_length=256)  # a group per layer
        assert _generate(gpu_layout, ids, ckv.ClusterKV(budget=24, offload=True, **SMALL),
                         prefilled=shared)[0] == on_device, name


@pytest.mark.parametrize("case", ARCHITECTURES, indirect=True)
def test_ragged_batch_equals_each_prompt_alone(case):
    name, _, ours, ids = case
    # The shorter prompt stays in the longer one's shape bucket (65-128, 129-256 tokens): each prompt alone runs the
    # program the test above compiled for the case's prompt; only the batch of two compiles here.
    prompts = [ids, ids[: len(ids) - 17]]
    assert bucket_length(len(prompts[1])) == bucket_length(len(ids))
    policy = ckv.ClusterKV(budget=24, **SMALL)
    assert _generate(ours, prompts, policy) == [_generate(ours, p, policy)[0] for p in prompts], name



def test_windowed_layers_hold_their_window_whatever_the_context():
    """Gemma 3 12B's pattern (48 layers, five windowed to each full one): each windowed layer holds W rows at a 4k
    and a 32k capacity; a full layer grows with the capacity; the windowed layers share one store, the others
    another."""
    config = ckv.ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=48, num_heads=4,
                             num_kv_heads=2, head_dim=16, max_position_embeddings=32768, sliding_window=1024,
                             layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8)
    row = 2 * config.num_kv_heads * config.head_dim * 4  # K and V, float32
    for capacity in (4096, 32768):
        for policy in (ckv.FullKV(), ckv.ClusterKV(budget=256, full_layers=0)):
            layers = ckv.layer_kv_bytes(ckv.init_cache(config, policy, 1, capacity))
            for i, layer in enumerate(layers):
                windowed = config.layer_types[i] == "sliding_attention"
                assert layer["attention"] == ("windowed" if windowed else "full" if policy.full_layers else "selecting")
                want = row * (config.sliding_window if windowed else policy.layout.store_rows(capacity))
                assert layer["device"] == want, (capacity, i)
    cache = ckv.init_cache(config, ckv.ClusterKV(budget=256, full_layers=0), 1, 4096)
    # One group per kind: the windowed layers in one store, the global ones in another, each in model order.
    assert [(g.attention, g.layers) for g in cache.groups] == [
        ("windowed", tuple(i for i in range(48) if i % 6 != 5)), ("selecting", tuple(range(5, 48, 6)))]
    assert [cache.group_of(i)[1] for i in (0, 4, 5, 6, 11)] == [0, 4, 0, 5, 1]
    # The scanned layer loop: one scan of 8 repeats of the 6-layer period.
    assert ckv.model.scan_runs([(cache.group_of(i)[0].attention, i % 6 == 5) for i in range(48)]) == [(0, 6, 8)]
    # Runs where a period would trace more layers: two full layers, then selecting ones.
    assert ckv.model.scan_runs(["F", "F"] + ["S"] * 30) == [(0, 1, 2), (2, 1, 30)]
    # Gemma 3 with its first full layer kept whole: runs of W and F, then (W5 S) seven times.
    assert ckv.model.scan_runs((["W"] * 5 + ["F"]) + (["W"] * 5 + ["S"]) * 7) == [(0, 1, 5), (5, 1, 1), (6, 6, 7)]
    # A window as long as the capacity never binds: the layer attends in full (and selects).
    assert {g.attention for g in ckv.init_cache(config, ckv.ClusterKV(full_layers=0), 1, 1024).groups} == {"selecting"}


def test_a_long_prompt_through_windowed_layers_equals_hf(tmp_path):
    """A prompt of 1,100 tokens, 11 windows: the blocked prefill (query blocks of 512 visit only the key blocks in
    their window) and a prefill in chunks of 512 (each chunk over the ring and itself) equal HF's logits at every
    position; decoding on from either cache gives HF's greedy tokens; a ragged batch in chunks equals each prompt
    alone."""
    hf = _hf_model("qwen2", {"use_sliding_window": True, "sliding_window": 100, "max_position_embeddings": 2048,
                             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]})
    hf.save_pretrained(tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "ours", dtype="float32")
    ours = ckv.load_model(tmp_path / "ours")
    ids = np.random.default_rng(7).integers(0, TINY["vocab_size"], 1100).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].double().numpy()
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    tokens = np.zeros((1, 1536), np.int32)
    tokens[0, :len(ids)] = ids
    for chunk in (None, 512):
        cache = ckv.init_cache(ours.config, ckv.FullKV(), 1, 2048)
        logits, _ = ckv.prefill(ours.params, tokens, np.array([len(ids)], np.int32), cache, config=ours.config,
                                policy=ckv.FullKV(), all_logits=True, chunk=chunk)
        got = np.asarray(logits)[0, :len(ids)]
        assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max()), chunk
        out = ckv.generate(ours, ids, 8, stop_at_eos=False, max_length=2048, prefill_chunk=chunk).tokens[0]
        assert out == greedy[0, len(ids):].tolist(), chunk
    # A ragged batch in chunks: the shorter prompt's padded positions never reach its ring.
    prompts = [ids, ids[:700]]
    batch = ckv.generate(ours, prompts, 8, stop_at_eos=False, max_length=2048, prefill_chunk=512).tokens
    assert batch == [ckv.generate(ours, p, 8, stop_at_eos=False, max_length=2048).tokens[0] for p in prompts]


@pytest.mark.parametrize("case", ["qwen3", "glm", "glm4"], indirect=True)
def test_clusters_are_made_of_hfs_cached_keys(case):
    """What clustering sees is what HF caches: post-RoPE keys after any q/k norm (Qwen3), partial interleaved RoPE
    (GLM). After a ClusterKV prefill, every selecting layer's stored rows equal HF's cached keys at their positions
    and each cluster's centroid is the mean of HF's keys of its members."""
    import jax

    name, hf, ours, ids = case
    with torch.no_grad():
        cached = hf(torch.tensor([ids]), use_cache=True).past_key_values
    policy = ckv.ClusterKV(budget=24, **SMALL)
    tokens = np.zeros((1, 128 if len(ids) <= 128 else 256), np.int32)
    tokens[0, :len(ids)] = ids
    cache = ckv.init_cache(ours.config, policy, 1, 256)
    _, cache = ckv.prefill(ours.params, tokens, np.array([len(ids)], np.int32), cache, config=ours.config,
                           policy=policy)
    checked = 0
    for layer in range(policy.full_layers, ours.config.num_layers):
        want = cached.layers[layer].keys[0].double().numpy()  # [K, L, H]
        group, i = cache.group_of(layer)
        state = jax.tree.map(lambda x: x[i], group.state)
        rows, where = np.asarray(cache.layer_kv(layer)[0])[0], np.asarray(state.row_positions)[0]  # [K, R, H]
        scale = np.abs(want).max()
        for h in range(want.shape[0]):
            held = where[h] >= 0
            assert np.abs(rows[h][held] - want[h, where[h][held]]).max() < 1e-4 * scale, (name, layer, h)
            sizes, first = np.asarray(state.sizes[0, h]), np.asarray(state.block_start[0, h])
            for c in np.flatnonzero(sizes):
                start = first[c] * policy.block_size
                members = where[h, start:start + sizes[c]]
                centroid = np.asarray(state.centroids[0, h, c])
                assert np.abs(centroid - want[h, members].mean(0)).max() < 1e-4 * scale, (name, layer, h, c)
                checked += 1
    assert checked >= (ours.config.num_layers - 1) * 2 * (len(ids) - 4) // 8 // 2, checked


def _write_gguf(path, hf, model_type: str) -> str:
    """The HF model as llama.cpp writes a GGUF of it (float32; a byte-level BPE vocabulary of its size)."""
    import gguf
    from gguf.vocab import bytes_to_unicode

    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rotary = int(head_dim * c.rope_parameters.get("partial_rotary_factor", 1.0))
    writer = gguf.GGUFWriter(str(path), model_type)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(rotary)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if getattr(c, "sliding_window", None):
        writer.add_sliding_window(c.sliding_window)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    byte_tokens = list(bytes_to_unicode().values())  # '!', '"', ...
    writer.add_token_list(byte_tokens[: c.vocab_size - 1] + [byte_tokens[0] + byte_tokens[1]])
    writer.add_token_merges([f"{byte_tokens[0]} {byte_tokens[1]}"])
    for name, w in hf.state_dict().items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            gguf_name = f"blk.{i}.{GGUF_NAMES[rest]}"
        else:
            gguf_name = GGUF_GLOBAL[name]
        writer.add_tensor(gguf_name, np.ascontiguousarray(w.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("name", ["qwen3", "glm4", "phi3"])
def test_gguf_of_the_family_converts_to_the_same_params(name, tmp_path):
    """A GGUF of the family, named as llama.cpp names it, converts to the parameters and the layer math the HF
    checkpoint converts to."""
    from checkpoints_convert import convert_gguf

    model_type, overrides, _ = CASES[name]
    hf = _hf_model(model_type, overrides)
    hf.save_pretrained(tmp_path / "hf")
    from_hf = ckv.load_model(convert_hf(tmp_path / "hf", tmp_path / "from_hf", dtype="float32"))
    from_gguf = ckv.load_model(convert_gguf(_write_gguf(tmp_path / "m.gguf", hf, model_type), tmp_path / "from_gguf"))
    fields = ("qkv_bias", "o_bias", "qk_norm", "post_norms", "rope_interleaved", "rotary_dim", "head_dim",
              "sliding_window")
    assert [getattr(from_gguf.config, f) for f in fields] == [getattr(from_hf.config, f) for f in fields]
    import jax

    leaves = zip(jax.tree_util.tree_leaves_with_path(from_hf.params), jax.tree_util.tree_leaves(from_gguf.params))
    for (path, a), b in leaves:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
