"""Perplexity and agreement evaluations: against independent computations, and the CLI end to end."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clusterkv_jax import FullKV, init_cache, prefill
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.eval.agreement import run_agreement
from clusterkv_jax.eval.ppl import run_ppl, window_offsets, window_scores
from clusterkv_jax.loading import Model
from clusterkv_jax.model import init_params

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=16)
TINY = Model(CFG, init_params(CFG, jax.random.PRNGKey(0)), tokenizer=None)
IDS = np.random.default_rng(0).integers(0, 128, 2000).tolist()


def _numpy_nll_from_prefill(model, seq, context):
    """Independent: one prefill over the whole sequence, log-softmax in NumPy (float64)."""
    seq = np.asarray([seq])
    cache = init_cache(model.config, FullKV(), 1, seq.shape[1], jnp.float32)
    logits, _ = prefill(model.params, jnp.asarray(seq), jnp.array([seq.shape[1]]), cache, config=model.config,
                        policy=FullKV(), all_logits=True)
    z = np.asarray(logits[0], np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    targets = seq[0, context:]
    return -logp[np.arange(context - 1, seq.shape[1] - 1), targets]


def test_full_kv_perplexity_equals_prefill_computation():
    context, eval_tokens = 150, 40
    nll = window_scores(TINY, IDS, [0, 700], context, eval_tokens, FullKV())["nll"]
    for row, offset in zip(nll, [0, 700]):
        ref = _numpy_nll_from_prefill(TINY, IDS[offset : offset + context + eval_tokens], context)
        np.testing.assert_allclose(row, ref, atol=2e-5)


def _numpy_log_probs_from_prefill(model, seq, context):
    """[eval tokens, V] full-KV next-token log-probabilities from one prefill, log-softmax in NumPy (float64)."""
    seq = np.asarray([seq])
    cache = init_cache(model.config, FullKV(), 1, 512, jnp.float32)
    logits, _ = prefill(model.params, jnp.asarray(seq), jnp.array([seq.shape[1]]), cache, config=model.config,
                        policy=FullKV(), all_logits=True)
    z = np.asarray(logits[0], np.float64)[context - 1 : seq.shape[1] - 1]
    z -= z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_top1_agreement_and_kl_equal_numpy():
    """Against full KV's distributions from an independent prefill: KL(full || policy) and top-1 agreement at every
    position, from the policy's own log-probabilities, in NumPy; and run_ppl's averages of them."""
    from clusterkv_jax.policies import StreamingLLM

    context, eval_tokens = 150, 40
    offsets = window_offsets(len(IDS), context + eval_tokens, 2)  # the windows run_ppl takes below
    full = np.stack([_numpy_log_probs_from_prefill(TINY, IDS[o : o + context + eval_tokens], context)
                     for o in offsets])  # [2, E, V]
    policy = StreamingLLM(budget=16, sinks=4)
    got = window_scores(TINY, IDS, offsets, context, eval_tokens, policy, full.astype(np.float32),
                        keep_log_probs=True)
    mine = got["log_probs"].astype(np.float64)  # [2, E, V]
    kl = (np.exp(full) * (full - mine)).sum(-1)
    top1 = mine.argmax(-1) == full.argmax(-1)
    np.testing.assert_allclose(got["kl"], kl, atol=1e-5)
    np.testing.assert_array_equal(got["top1"], top1)
    assert 0.05 < top1.mean() < 1 and kl.mean() > 1e-3  # a 16-token budget really changes the distributions
    res = run_ppl(TINY, IDS, context=context, eval_tokens=eval_tokens, budgets=[16, 512], policy_names=["streaming"],
                  windows=2, policy_options={"streaming": {"sinks": 4}}, progress=False)
    assert abs(res["top1_agreement"]["streaming"]["16"] - top1.mean()) < 1e-6
    assert abs(res["kl_vs_full"]["streaming"]["16"] - kl.mean()) < 1e-5
    assert res["top1_agreement"]["streaming"]["512"] == 1.0 and abs(res["kl_vs_full"]["streaming"]["512"]) < 1e-5


def test_windows_are_disjoint_and_spread():
    offsets = window_offsets(1000, 200, 4)
    assert offsets == [0, 266, 532, 798]
    assert all(b - a >= 200 for a, b in zip(offsets, offsets[1:]))
    with pytest.raises(ValueError, match="do not fit"):
        window_offsets(1000, 300, 4)


def test_budget_covering_everything_matches_full_ppl_and_agreement():
    small = dict(sinks=4, tokens_per_cluster=8, decode_interval=16, decode_clusters=2)
    res = run_ppl(TINY, IDS, context=150, eval_tokens=40, budgets=[512, 16], policy_names=["clusterkv", "streaming"],
                  windows=2, policy_options={"clusterkv": small, "streaming": {"sinks": 4}}, progress=False)
    assert abs(res["delta_vs_full"]["clusterkv"]["512"]) < 1e-4
    assert abs(res["delta_vs_full"]["streaming"]["512"]) < 1e-4
    assert res["delta_vs_full"]["streaming"]["16"] != 0
    full = math.exp(np.mean([_numpy_nll_from_prefill(TINY, IDS[o : o + 190], 150) for o in window_offsets(2000, 190, 2)]))
    assert abs(res["ppl"]["full"]["512"] - full) < 1e-3
    agree = run_agreement(TINY, IDS, context=150, new_tokens=12, samples=2, budgets=[512, 8],
                          policy_names=["streaming"], policy_options={"streaming": {"sinks": 4}}, progress=False)
    assert agree["token_agreement"]["streaming"]["512"] == 1.0
    assert agree["sequence_agreement"]["streaming"]["512"] == 1.0
    assert 0 <= agree["token_agreement"]["streaming"]["8"] <= 1


@pytest.mark.parametrize("command", ["ppl", "agreement", "recall"])
def test_eval_commands_write_json_table_and_plot(command, tiny_text_model, tmp_path):
    from clusterkv_jax.cli import main

    model, text = tiny_text_model
    extra = {"ppl": ["--context", "300", "--eval-tokens", "8", "--windows", "2"],
             "agreement": ["--context", "300", "--new-tokens", "6", "--samples", "2"],
             "recall": ["--context", "300", "--steps", "2"]}[command]
    out = tmp_path / "out"
    # One policy at two budgets: what the table and the plot show per budget; the other policies' scores are
    # test_budget_covering_everything_matches_full_ppl_and_agreement's.
    rc = main(["eval", command, "--model", model, "--text", text, "--budgets", "64,128",
               "--policies", "clusterkv", "--out", str(out), *extra])
    assert rc == 0
    results = json.loads((out / f"{command}.json").read_text())
    assert results["metric" if command != "recall" else "context"]
    table = (out / f"{command}.md").read_text()
    assert "| clusterkv |" in table and "B=128" in table
    assert (out / f"{command}.png").read_bytes()[:4] == b"\x89PNG"
