"""`generate` against HF greedy decoding, batching, compile counts, sampling against a NumPy oracle, errors."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from clusterkv_jax import generate, load_model, sample_tokens
from clusterkv_jax.sampling import Sampling
from tests.helpers import generation_programs, long_text_ids


@pytest.fixture(scope="module")
def smollm2(smollm2_converted_dir):
    return load_model(smollm2_converted_dir)


def test_greedy_32_tokens_identical_to_hf(smollm2, hf_smollm2):
    hf_model, hf_tok = hf_smollm2
    # A continuation of real prose whose greedy path has no near-tie: the top-2 logit margin is >= 0.048 at
    # every step (measured with HF), 100x our logit error. Where margins fall under 0.01 (after an EOS, say),
    # even HF's cached and uncached forward passes pick different tokens.
    ids = long_text_ids(smollm2.tokenizer, 300, offset=8000)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                eos_token_id=None, pad_token_id=2, min_new_tokens=32)[0, len(ids):].tolist()
    ours = generate(smollm2, ids, max_new_tokens=32, stop_at_eos=False)
    assert ours.tokens[0] == ref
    assert len(ref) == 32


def test_chat_template_matches_transformers(smollm2, hf_smollm2):
    _, hf_tok = hf_smollm2
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    for msgs in (messages, messages[1:]):
        ref = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert smollm2.tokenizer.apply_chat_template(msgs) == ref


def test_ragged_batch_equals_each_prompt_alone(smollm2):
    prompts = [long_text_ids(smollm2.tokenizer, n, offset=o) for n, o in ((40, 0), (97, 500), (13, 2000))]
    batch = generate(smollm2, prompts, max_new_tokens=12, stop_at_eos=False)
    for p, got in zip(prompts, batch.tokens):
        alone = generate(smollm2, p, max_new_tokens=12, stop_at_eos=False)
        assert got == alone.tokens[0]


def test_generate_stops_each_sequence_at_eos(smollm2):
    q = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}])
    ids = smollm2.tokenizer.encode(q, add_special_tokens=False)
    free = generate(smollm2, ids, max_new_tokens=64, stop_at_eos=False).tokens[0]
    eos = smollm2.config.eos_token_ids[0]
    assert eos in free, "the instruct model should end its answer within 64 tokens"
    stopped = generate(smollm2, [ids, long_text_ids(smollm2.tokenizer, 30)], max_new_tokens=64)
    assert stopped.tokens[0] == free[: free.index(eos) + 1]
    assert len(stopped.tokens[1]) == 64 or stopped.tokens[1][-1] == eos


def test_generate_compiles_once_per_bucket(smollm2):
    before = generation_programs()
    for n, temperature, seed in ((20, 0.0, 0), (33, 0.7, 1), (50, 1.0, 2)):
        generate(smollm2, long_text_ids(smollm2.tokenizer, n), max_new_tokens=8, temperature=temperature,
                 top_k=5, top_p=0.9, seed=seed)
    assert generation_programs() - before == 2


def test_text_and_chat_prompts(smollm2):
    out = generate(smollm2, ["The capital of France is", "One, two, three,"], max_new_tokens=6)
    assert len(out.texts) == 2 and all(isinstance(t, str) for t in out.texts)
    assert "four" in out.texts[1].lower()
    chat = generate(smollm2, "What is 2 + 2?", max_new_tokens=16, chat=True)
    assert "4" in chat.texts[0]


# --------------------------------------------------------------------------------------------------
# Sampling against a NumPy oracle
# --------------------------------------------------------------------------------------------------


def _numpy_filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The distribution HF's TopK then TopP warpers define, computed independently."""
    z = logits.astype(np.float64) / temperature
    if top_k:
        kth = np.sort(z)[::-1][top_k - 1]
        z = np.where(z >= kth, z, -np.inf)
    order = np.argsort(-z, kind="stable")
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    kept = order[before < top_p]
    out = np.zeros_like(z)
    out[kept] = np.exp(z[kept] - z[kept].max())
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.6), (1.0, 5, 0.8)])
def test_sampling_distribution_matches_numpy(temperature, top_k, top_p):
    logits = np.random.default_rng(0).normal(size=(12,)).astype(np.float32) * 1.5
    expected = _numpy_filtered_probs(logits, temperature, top_k, top_p)
    n = 20000
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    draw = jax.jit(jax.vmap(lambda k: sample_tokens(jnp.asarray(logits)[None], Sampling.make(temperature, top_k, top_p), k)[0]))
    counts = np.bincount(np.asarray(draw(keys)), minlength=12) / n
    assert np.all(counts[expected == 0] == 0), "sampled a token the filters exclude"
    np.testing.assert_allclose(counts, expected, atol=0.015)


def test_greedy_and_degenerate_filters_pick_argmax():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(4, 50)), jnp.float32)
    want = np.asarray(logits).argmax(-1)
    key = jax.random.PRNGKey(0)
    for s in (Sampling.make(0.0), Sampling.make(1.0, top_k=1), Sampling.make(1.0, top_p=1e-6)):
        np.testing.assert_array_equal(np.asarray(sample_tokens(logits, s, key)), want)


def test_same_seed_same_sample_different_seed_differs(smollm2):
    ids = long_text_ids(smollm2.tokenizer, 24)
    a = generate(smollm2, ids, max_new_tokens=16, temperature=1.0, seed=7).tokens
    b = generate(smollm2, ids, max_new_tokens=16, temperature=1.0, seed=7).tokens
    c = generate(smollm2, ids, max_new_tokens=16, temperature=1.0, seed=8).tokens
    assert a == b and a != c


# --------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------


def test_bad_generate_input_is_refused(smollm2):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(smollm2, ["hello", ""], max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds the capacity"):
        generate(smollm2, [1, 2, 3], max_new_tokens=smollm2.config.max_position_embeddings)
    with pytest.raises(ValueError, match="exceeds the capacity"):
        generate(smollm2, [1] * 100, max_new_tokens=30, max_length=128)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(smollm2, "hi", max_new_tokens=0)
    with pytest.raises(ValueError, match="outside"):
        generate(smollm2, [1, 10**7], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        generate(smollm2, "hi", max_new_tokens=2, temperature=1.0, top_p=0.0)
    with pytest.raises(TypeError, match="KVPolicy"):
        generate(smollm2, "hi", max_new_tokens=2, policy="clusterkv")
    no_tok = dataclasses.replace(smollm2, tokenizer=None)
    with pytest.raises(ValueError, match="tokenizer"):
        generate(no_tok, "hi", max_new_tokens=2)


def test_cli_generate_runs_each_policy_and_times_prefill_and_decode(tiny_text_model, capsys):
    """`clusterkv generate --policy P --budget N`: ClusterKV with a budget over the prompt writes full KV's text;
    a budget under it runs the method (here other text, or the same). Each run says the prompt's tokens and what
    a step attends, prefill s and decode tokens/s (of the compiled programs), and a call that compiled them how long
    that took (--timing: a warm-up call first). A policy that cannot offload is refused with exit 2."""
    import re

    from clusterkv_jax.cli import main

    model, text = tiny_text_model
    with open(text, encoding="utf-8") as f:
        prompt = " ".join(f.read().split()[:400])
    n = 400  # a word a token
    base = ["generate", "--model", model, "--prompt", prompt, "--max-new-tokens", "6"]
    texts = {}
    attends = {"full": f"full KV attends all {n} prompt tokens and every generated one, in all 4 layers",
               "clusterkv-all": f"clusterkv B=4096 attends all {n} prompt tokens: the budget B=4096 covers the prompt",
               "clusterkv": f"clusterkv B=64 attends 64 of the {n} prompt tokens per step chosen by cluster"}
    for name, flags in (("full", []), ("clusterkv-all", ["--policy", "clusterkv", "--budget", "4096"]),
                        ("clusterkv", ["--policy", "clusterkv", "--budget", "64", "--kmeans-tol", "0"])):
        assert main(base + flags) == 0
        out, err = capsys.readouterr()
        texts[name] = out
        assert f"prompt: {n} tokens; {attends[name]}" in err, err
        timing = rf"prefill of {n} tokens [0-9.]+ s, decode [0-9.]+ tokens/s"
        assert re.search(rf"{timing}( \(compiling took [0-9.]+ s more\))?$", err.strip()), err
    assert main(base + ["--policy", "clusterkv", "--budget", "64", "--kmeans-tol", "0"]) == 0  # compiled now
    err = capsys.readouterr().err
    assert re.search(rf"{timing}$", err.strip()) and "compil" not in err, err
    assert main(base + ["--policy", "quest", "--budget", "96", "--timing"]) == 0  # compiles in its warm-up call
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("warm-up call") and re.fullmatch(rf"quest B=96: 6 tokens; {timing}", lines[-1]), lines
    assert texts["clusterkv-all"] == texts["full"]
    assert main(base + ["--policy", "streaming", "--offload"]) == 2
    assert "--offload works with" in capsys.readouterr().err


_X64_SCRIPT = """
import json, sys
import jax, numpy as np
from clusterkv_jax import ClusterKV, generate
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.loading import Model
from clusterkv_jax.model import init_params
cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=16, max_position_embeddings=4096)
model = Model(cfg, init_params(cfg, jax.random.PRNGKey(0)), None)
prompts = np.random.default_rng(0).integers(0, 128, size=(2, 700)).tolist()
prompts[1] = prompts[1][:500]
out = {}
for name, policy in [("clusterkv", ClusterKV(budget=128, decode_interval=64, tokens_per_cluster=16)),
                     ("clusterkv_offload", ClusterKV(budget=128, decode_interval=64, tokens_per_cluster=16, offload=True))]:
    out[name] = generate(model, prompts, 70, policy=policy, stop_at_eos=False).tokens
print(json.dumps({"x64": bool(jax.config.jax_enable_x64), "tokens": out}))
"""


@pytest.mark.slow  # starts a Python process
def test_generation_is_the_same_with_jax_enable_x64():
    """JAX_ENABLE_X64=1 (64-bit default ints and floats) once broke decoding (`dynamic_update_slice` with int32
    and int64 indices; K-means seeds drawn in float64): ClusterKV, on device and offloaded, its decode-time
    clustering included (70 new tokens past a 64-token interval), gives the same tokens with and without it."""
    import json
    import subprocess
    import sys

    from tests.conftest import MOST_OPTIMIZATIONS_OFF_ENV
    from tests.helpers import REPO_ROOT

    runs = {}
    for flag in ("0", "1"):
        env = {**os.environ, "JAX_ENABLE_X64": flag, "PYTHONPATH": REPO_ROOT, **MOST_OPTIMIZATIONS_OFF_ENV}
        proc = subprocess.run([sys.executable, "-c", _X64_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=600, cwd=REPO_ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[flag] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["1"]["x64"] and not runs["0"]["x64"]
    assert runs["1"]["tokens"] == runs["0"]["tokens"]
