"""Benchmarks measure what they claim: the decode they time is real decoding (the tokens `generate` gives),
the synthetic cache decodes alike on device and offloaded, the roofline byte count matches a NumPy count,
and HF's model rebuilt from our weights gives our logits. Nothing here is timed."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from clusterkv_jax.bench.attention import bench_attention
from clusterkv_jax.bench.decode import bench_decode, make_policies
from clusterkv_jax.bench.hf import HFDecoder, hf_model_from_params
from clusterkv_jax.bench.roofline import step_bytes
from clusterkv_jax.bench.synthetic import synthetic_kv, synthetic_prefill
from clusterkv_jax.config import ModelConfig, synthetic_config
from clusterkv_jax.generate import generate
from clusterkv_jax.steps import decode_step
from clusterkv_jax.loading import Model
from clusterkv_jax.model import forward_prefill, init_params
from clusterkv_jax.cache import init_cache
from clusterkv_jax.policies import ClusterKV, FullKV, Quest
from tests.conftest import MOST_OPTIMIZATIONS_OFF_ENV

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position_embeddings=1024)
PARAMS = init_params(CFG, jax.random.PRNGKey(0))
SMALL = dict(sinks=4, tokens_per_cluster=8, decode_interval=16, decode_clusters=2)


def test_bench_decode_times_the_tokens_generate_produces():
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, CFG.vocab_size, (2, 200)).astype(np.int32)
    policies = {"full": FullKV(), "clusterkv@32": ClusterKV(budget=32, **SMALL),
                "quest@32": Quest(budget=32, page_size=8)}
    results = bench_decode(PARAMS, CFG, policies, [120, 200], decode=20, batch=2,
                           prompt_fn=lambda c, b: prompts[:b, :c], bandwidth_Bps=1e10,
                           hf_model=hf_model_from_params(CFG, PARAMS), progress=False)
    model = Model(config=CFG, params=PARAMS, tokenizer=None)
    for context in (120, 200):
        row = results["contexts"][str(context)]
        assert set(row) == set(policies) | {"hf-full"}
        # HF transformers, interleaved step by step, decodes the same greedy tokens as our full KV.
        assert row["hf-full"]["tokens"] == row["full"]["tokens"]
        for name, policy in policies.items():
            expected = generate(model, prompts[0, :context].tolist(), 21, policy=policy, stop_at_eos=False)
            assert row[name]["tokens"] == expected.tokens[0], (context, name)
            r = row[name]
            assert r["decode_ms"] > 0 and r["x_roofline"] > 0
            assert r["decode_tokens_per_s"] == pytest.approx(2e3 / r["decode_ms"])
        assert row["clusterkv@32"]["indexing_s"] > 0  # the clustering, timed alone
        assert row["full"]["speedup_vs_full"] == 1.0


def test_bench_prefill_times_the_prefill_generate_runs_and_hf_alike(tmp_path):
    """`bench prefill` times real prefills: each contender's timed run gives the first token `generate` gives for
    that policy, HF's prefill of the same weights the same token as full KV; the ratios are of the medians; the
    clustering is timed alone beside the prefill that includes it. The CLI writes JSON, markdown and a plot for a
    synthetic geometry (random tokens, HF built from the same random weights)."""
    from clusterkv_jax.bench.prefill import bench_prefill
    from clusterkv_jax.cli import main

    prompts = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 300)).astype(np.int32)
    policies = {"full": FullKV(), "clusterkv@32": ClusterKV(budget=32, **SMALL)}
    results = bench_prefill(PARAMS, CFG, policies, [150, 300], batch=2, repeats=2,
                            prompt_fn=lambda c, b: prompts[:b, :c], hf_model=hf_model_from_params(CFG, PARAMS),
                            progress=False)
    model = Model(config=CFG, params=PARAMS, tokenizer=None)
    for context in (150, 300):
        row = results["contexts"][str(context)]
        assert set(row) == {"full", "clusterkv@32", "hf-full"}
        for name, policy in policies.items():
            expected = generate(model, prompts[0, :context].tolist(), 1, policy=policy, stop_at_eos=False)
            assert row[name]["first_token"] == expected.tokens[0][0], (context, name)
        assert row["hf-full"]["first_token"] == row["full"]["first_token"]
        for r in row.values():
            assert len(r["runs_s"]) == 2 and r["prefill_s"] == pytest.approx(np.median(r["runs_s"]))
            assert r["vs_hf"] == pytest.approx(r["prefill_s"] / row["hf-full"]["prefill_s"])
        assert row["clusterkv@32"]["vs_full"] == pytest.approx(row["clusterkv@32"]["prefill_s"]
                                                               / row["full"]["prefill_s"])
        assert row["clusterkv@32"]["indexing_s"] > 0 and "indexing_s" not in row["full"]
    out = tmp_path / "prefill"
    assert main(["bench", "prefill", "--synthetic", "smollm2-135m", "--layers", "2", "--context", "600",
                 "--budgets", "64", "--repeats", "1", "--out", str(out)]) == 0
    data = json.loads((out / "prefill.json").read_text())
    assert set(data["contexts"]["600"]) == {"full", "clusterkv@64", "hf-full"} and data["hf"]
    assert (out / "prefill.png").stat().st_size > 0 and "| hf-full |" in (out / "prefill.md").read_text()
    assert main(["bench", "prefill", "--model", str(tmp_path), "--layers", "1"]) == 2  # --layers: synthetic only


def test_bench_decode_offloaded_runs_beside_its_on_device_twin_and_reports_the_recall_hit_rate():
    from clusterkv_jax.bench.report import format_decode_context
    from clusterkv_jax.offload import hit_rates

    prompt = np.random.default_rng(1).integers(0, CFG.vocab_size, (1, 150)).astype(np.int32)
    policies = make_policies(["clusterkv"], [32], offload_kv=True, policy_options={"clusterkv": SMALL})
    assert {name: p.offload for name, p in policies.items()} == {
        "full": False, "clusterkv@32": False, "full offloaded": True, "clusterkv@32 offloaded": True}
    results = bench_decode(PARAMS, CFG, policies, [150], decode=12, batch=1, prompt_fn=lambda c, b: prompt[:b, :c],
                           bandwidth_Bps=1e10, progress=False)
    row = results["contexts"]["150"]
    # The same decoding through generate: 12 decode steps after the prefill's token.
    offloaded = row["clusterkv@32 offloaded"]
    expected = generate(Model(config=CFG, params=PARAMS, tokenizer=None), prompt[0].tolist(), 13,
                        policy=policies["clusterkv@32 offloaded"], stop_at_eos=False, return_cache=True)
    assert offloaded["tokens"] == expected.tokens[0] == row["clusterkv@32"]["tokens"]  # offloading changes nothing
    rates = [r for r in hit_rates(expected.cache) if r is not None]
    assert offloaded["recall_hit_rate"] == pytest.approx(np.mean(rates))
    assert 0 < offloaded["recall_hit_rate"] < 1
    assert "recall_hit_rate" not in row["full offloaded"]  # FullKV offloaded selects nothing: no recall cache
    # Each offloaded twin's speed relative to its on-device twin, from the same run.
    for name in ("full", "clusterkv@32"):
        twin = row[name + " offloaded"]
        assert twin["speedup_vs_on_device"] == pytest.approx(row[name]["decode_ms"] / twin["decode_ms"])
        assert "speedup_vs_on_device" not in row[name]
    table = format_decode_context(150, row)
    assert "recall hit rate" in table and f"{offloaded['recall_hit_rate']:.3f} |" in table
    assert f"| {offloaded['speedup_vs_on_device']:.2f}x |" in table
    with pytest.raises(ValueError, match="--offload supports full, clusterkv and quest, not 'streaming'"):
        make_policies(["streaming"], [32], offload_kv=True)


def test_synthetic_cache_decodes_alike_on_device_and_offloaded():
    kv = synthetic_kv(jax.random.PRNGKey(1), CFG, 2, 150, 256, jnp.float32)
    token = jnp.array([3, 7], jnp.int32)
    for on, off in [(ClusterKV(budget=40, **SMALL), ClusterKV(budget=40, offload=True, **SMALL)),
                    (FullKV(), FullKV(offload=True))]:
        logits = []
        for policy in (on, off):
            cache, _, info = synthetic_prefill(CFG, policy, kv, 150, 256, jnp.float32)
            assert info["indexing_s"] > 0
            assert cache.offloaded == policy.offload
            out, cache = decode_step(PARAMS, token, cache, config=CFG, policy=policy)
            logits.append(np.asarray(out))
        np.testing.assert_allclose(logits[0], logits[1], atol=1e-5)


@pytest.mark.parametrize("offload", [False, True])
def test_synthetic_cache_equals_the_state_a_prefill_leaves(offload):
    """Feeding write_prompt the K/V a real prefill stored reproduces the prefill's cache: same index, same KV."""
    from clusterkv_jax.attend import write_prompt

    policy = ClusterKV(budget=40, offload=offload, **SMALL)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 128, (1, 160)), jnp.int32)
    lengths = jnp.array([150], jnp.int32)
    _, real = forward_prefill(PARAMS, CFG, policy, tokens, lengths, init_cache(CFG, policy, 1, 256, jnp.float32))
    # The prompt's K/V by position (what any prefill computes: prefill attention is exact), from full KV's store.
    _, full = forward_prefill(PARAMS, CFG, FullKV(), tokens, lengths, init_cache(CFG, FullKV(), 1, 256, jnp.float32))
    keys, values = (jnp.stack(kv) for kv in zip(*(full.layer_kv(layer) for layer in range(CFG.num_layers))))
    built = write_prompt(init_cache(CFG, policy, 1, 256, jnp.float32), keys, values, lengths, policy=policy)
    for a, b in zip(jax.tree_util.tree_leaves(real), jax.tree_util.tree_leaves(built)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_step_bytes_match_a_numpy_count():
    L, K, N, H, ctx, B = CFG.num_layers, CFG.num_kv_heads, CFG.num_heads, CFG.head_dim, 300, 2
    all_params = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(PARAMS))
    # Untied: the LM head is read whole, the embedding table only at the B new tokens.
    weights = all_params - np.asarray(PARAMS["embed"]).nbytes + B * CFG.hidden_size * 4
    row = 2 * H * 4
    full = step_bytes(CFG, PARAMS, FullKV(), ctx, B, 0, 4)
    assert full == {"weights": weights, "kv": L * B * K * ctx * row, "metadata": 0,
                    "total": weights + L * B * K * ctx * row}
    # Streaming every layer from the host reads the same KV: per KV head, not per query head.
    assert step_bytes(CFG, PARAMS, FullKV(offload=True), ctx, B, 0, 4) == full
    policy = ClusterKV(budget=64, full_layers=1, **SMALL)
    ckv = step_bytes(CFG, PARAMS, policy, ctx, B, 10, 4)
    # A selection head reads whole blocks: the sink block and the block slots, 16 rows each.
    blocks = -(-policy.sinks // 16) + policy.layout.block_slots()
    kv = 1 * B * K * ctx * row + 3 * B * (N * min(blocks * 16, ctx) + K * 10) * row
    assert ckv["kv"] == kv
    assert ckv["metadata"] == 3 * B * K * ((ctx - 4) // 8) * H * 4


def test_bench_attention_reports_every_policy():
    names = ["clusterkv", "quest", "snapkv", "infinigen"]
    policies = make_policies(["full", *names], [32], policy_options={"clusterkv": {"gqa": "per_head"},
                                                                      "snapkv": {"window": 8}})
    results = bench_attention(CFG, policies, [100], batch=2, repeats=2, progress=False)
    row = results["contexts"]["100"]
    assert set(row) == {"full"} | {f"{n}@32{s}" for n in names for s in ("", " select")}
    assert row["clusterkv@32"]["indexing_ms"] > 0
    for name in names:
        info = row[f"{name}@32"]
        assert info["given_selection_ms"] > 0
        assert info["select_in_step_ms"] == pytest.approx(info["ms"] - info["given_selection_ms"])


@pytest.mark.parametrize("policy", [ClusterKV(budget=32, full_layers=0), Quest(budget=32, full_layers=0)],
                         ids=["clusterkv", "quest"])
def test_step_given_its_selection_is_the_step(policy):
    """The step `bench attention` subtracts to cost the selection does everything else the same: given the
    selection the policy makes, it returns the same output, state and store."""
    from clusterkv_jax.attend import decode_selecting, write_prompt_layer
    from clusterkv_jax.bench.attention import _given_selection
    from clusterkv_jax.store import DeviceKV

    one = dataclasses.replace(CFG, num_layers=1)
    B, ctx, cap = 2, 100, 128
    k, v = (x[0] for x in synthetic_kv(jax.random.PRNGKey(0), one, B, ctx, cap, jnp.float32))
    lengths = jnp.array([ctx, ctx - 30], jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(1), (B, CFG.num_heads, CFG.head_dim), jnp.float32)
    empty = (DeviceKV.create(1, B, CFG.num_kv_heads, policy.layout.store_rows(cap), CFG.head_dim, jnp.float32),
             policy.init_state(one, B, cap))
    store, state = write_prompt_layer(policy, *empty, jnp.int32(0), k, v, lengths, cap)
    selection = policy.select(state, q, None, lengths, lengths)
    own = decode_selecting(policy, state, q, store.layer(jnp.int32(0), cap), lengths, lengths)
    given = decode_selecting(_given_selection(policy, selection), state, q, store.layer(jnp.int32(0), cap), lengths,
                             lengths)
    assert type(policy).select is not type(_given_selection(policy, selection)).select
    jax.tree.map(np.testing.assert_array_equal, (own[0], own[1].store), (given[0], given[1].store))


@pytest.mark.parametrize("tie", [True, False])
def test_hf_model_from_our_params_gives_our_logits(tie):
    import dataclasses

    config = dataclasses.replace(CFG, tie_word_embeddings=tie, rope_theta=500000.0)
    params = init_params(config, jax.random.PRNGKey(3))
    if tie:
        params.pop("lm_head", None)
    tokens = np.random.default_rng(4).integers(0, 128, (1, 40))
    ours, _ = forward_prefill(params, config, FullKV(), jnp.asarray(tokens, jnp.int32), jnp.array([40]),
                              init_cache(config, FullKV(), 1, 64, jnp.float32), all_logits=True)
    hf = hf_model_from_params(config, params)
    with torch.no_grad():
        theirs = hf(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=2e-4)
    decoder = HFDecoder(hf, tokens)
    assert decoder.tokens == [int(np.argmax(theirs[0, -1]))]  # prefill keeps the last position's logits
    assert decoder.step() > 0 and len(decoder.tokens) == 2


def test_synthetic_geometries_and_bad_names():
    cfg = synthetic_config("llama3-8b", layers=3)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.num_layers) == (32, 8, 128, 4096, 3)
    glm, qwen3 = synthetic_config("glm4-9b", layers=2), synthetic_config("qwen3-8b", layers=2)
    assert (glm.num_heads, glm.num_kv_heads, glm.rotary_dim, glm.rope_interleaved, glm.qkv_bias) == (
        32, 2, 64, True, True)
    assert (qwen3.num_heads, qwen3.num_kv_heads, qwen3.qk_norm, qwen3.model_type) == (32, 8, True, "qwen3")
    assert synthetic_config("qwen2.5-7b").qkv_bias
    with pytest.raises(ValueError, match="unknown geometry"):
        synthetic_config("llama9")
    with pytest.raises(ValueError, match="must include 'full'"):
        bench_decode(PARAMS, CFG, {"ckv": ClusterKV()}, [100], prompt_fn=lambda c, b: None)


BENCH_DECODE_ARGS = ["--context", "100,200", "--decode", "4", "--budgets", "64", "--batch", "2"]


@pytest.fixture(scope="module")
def cli_bench_decode(tiny_text_model, tmp_path_factory):
    """`clusterkv bench decode` on the tiny checkpoint in this process, once for the tests below: (what it printed,
    the directory it wrote)."""
    import contextlib
    import io

    from clusterkv_jax.cli import main

    model, text = tiny_text_model
    root = tmp_path_factory.mktemp("bench_cli")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["bench", "decode", "--model", model, *BENCH_DECODE_ARGS, "--text", str(text),
                   "--out", str(root / "one")])
    assert rc == 0
    return printed.getvalue(), root


def test_cli_bench_decode_and_attention_write_tables_and_plots(cli_bench_decode, tiny_text_model, tmp_path):
    from clusterkv_jax.cli import main

    printed, root = cli_bench_decode
    out = root / "one"
    assert "clusterkv@64" in printed and "quest@64" in printed and "measured bandwidth" in printed
    data = json.loads((out / "decode.json").read_text())
    assert set(data["contexts"]) == {"100", "200"} and data["batch"] == 2
    assert data["bandwidth_Bps"] > 0
    assert (out / "decode.png").stat().st_size > 0 and (out / "decode.md").read_text().count("| full |") == 2
    out = tmp_path / "attention"
    assert main(["bench", "attention", "--model", tiny_text_model[0], "--context", "300", "--budgets", "64",
                 "--repeats", "2", "--out", str(out)]) == 0
    assert json.loads((out / "attention.json").read_text())["geometry"]["num_kv_heads"] == 2
    assert main(["bench", "decode", "--synthetic", "llama3-8b", "--compare-hf", "--layers", "1"]) == 2


def test_cli_bench_decode_on_a_mesh_decodes_the_unsharded_tokens(cli_bench_decode, tiny_text_model):
    """`--mesh data=2` (2 host devices, a subprocess) times the same greedy decoding as one device (the run above)."""
    import subprocess
    import sys

    _, root = cli_bench_decode
    out = root / "mesh"
    cmd = [sys.executable, "-m", "clusterkv_jax.cli", "bench", "decode", "--model", tiny_text_model[0],
           *BENCH_DECODE_ARGS, "--text", str(tiny_text_model[1]), "--out", str(out), "--mesh", "data=2"]
    # At the optimization level of the run above (a tiny model's test: conftest.MOST_OPTIMIZATIONS_OFF_ENV).
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, **MOST_OPTIMIZATIONS_OFF_ENV))
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = {}
    for name in ("one", "mesh"):
        data = json.loads((root / name / "decode.json").read_text())
        tokens[name] = {(c, p): r["tokens"] for c, row in data["contexts"].items() for p, r in row.items()}
    assert data["mesh"] == {"data": 2, "model": 1} and data["devices"] == 2
    assert len(tokens["one"]) >= 6  # 2 contexts x (full, clusterkv, quest)
    assert tokens["mesh"] == tokens["one"]
