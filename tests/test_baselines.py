"""Quest, StreamingLLM, SnapKV, InfiniGen and OracleTopK against NumPy references, on a tiny random model (no
checkpoint).

Selections are checked set-wise against NumPy, each policy with an unlimited budget against FullKV's logits,
ragged batches against each sequence alone, Quest's page index against NumPy min/max of the keys, and
`generate` for a single compile per shape.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clusterkv_jax.cache import KVCache, init_cache
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.generate import generate
from clusterkv_jax.steps import decode_step, prefill
from clusterkv_jax.loading import Model
from clusterkv_jax.model import apply_rope, init_params, rope_inv_freq
from clusterkv_jax.policies import ClusterKV, FullKV, InfiniGen, OracleTopK, Quest, SnapKV, StreamingLLM
from tests.helpers import generation_programs

CONFIG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=16)
G = CONFIG.num_heads // CONFIG.num_kv_heads
T, CAPACITY, STEPS = 64, 128, 20  # prompt bucket, cache capacity, decode steps
PROMPT_LENGTHS = np.array([50, 37, 23], np.int32)
_rng = np.random.default_rng(0)
PROMPTS = _rng.integers(0, CONFIG.vocab_size, (3, T)).astype(np.int32)  # [3, T] junk past each length
DECODE_TOKENS = _rng.integers(0, CONFIG.vocab_size, (3, STEPS)).astype(np.int32)  # [3, STEPS] fed, not sampled

# Budgets below every context (70 / 57 / 43 tokens after decoding), so selection really drops tokens.
QUEST = Quest(budget=24, page_size=8, full_layers=1)
STREAMING = StreamingLLM(budget=20, sinks=4, full_layers=1)
ORACLE = OracleTopK(budget=16, full_layers=1)
SNAPKV = SnapKV(budget=20, window=8, pool_size=3, full_layers=1)
INFINIGEN = InfiniGen(budget=16, partial_ratio=0.25, sample=8, full_layers=1)
SMALL = (QUEST, STREAMING, ORACLE, SNAPKV, INFINIGEN)
# Budgets above the capacity: every token is attended, in every layer.
LARGE = (Quest(budget=1024, page_size=8, full_layers=0), StreamingLLM(budget=1024, sinks=4, full_layers=0),
         OracleTopK(budget=1024, full_layers=0), SnapKV(budget=1024, window=8, full_layers=0),
         InfiniGen(budget=1024, sample=8, full_layers=0))


@functools.cache
def params():
    return init_params(CONFIG, jax.random.PRNGKey(0))


@dataclasses.dataclass
class Run:
    logits: np.ndarray  # [B, 1 + STEPS, V]: at the last prompt token, then after each decode step
    states: list  # policy state (NumPy) after prefill and after each decode step
    cache: KVCache  # after the last step


@functools.lru_cache(maxsize=None)
def run(policy, seqs=(0, 1, 2), zero_padding=False) -> Run:
    """Prefill the prompts `seqs` (right-padded with junk, or zeros) and decode STEPS fixed tokens."""
    rows = list(seqs)
    tokens = PROMPTS[rows].copy()  # [B, T]
    lengths = PROMPT_LENGTHS[rows]  # [B]
    if zero_padding:
        tokens[np.arange(T)[None, :] >= lengths[:, None]] = 0
    cache = init_cache(CONFIG, policy, len(rows), CAPACITY, jnp.float32)
    logits, cache = prefill(params(), jnp.asarray(tokens), jnp.asarray(lengths), cache, config=CONFIG,
                            policy=policy)
    out, states = [np.asarray(logits)], [jax.tree.map(np.asarray, cache.policy_state)]
    for t in range(STEPS):
        logits, cache = decode_step(params(), jnp.asarray(DECODE_TOKENS[rows, t]), cache, config=CONFIG,
                                    policy=policy)
        out.append(np.asarray(logits))
        states.append(jax.tree.map(np.asarray, cache.policy_state))
    return Run(np.stack(out, axis=1), states, cache)


def layer_inputs(policy, layer: int, seed: int = 1):
    """One selecting layer's (state, random q [B, N, H], keys [B, K, S, H], lengths, prompt_lengths)."""
    cache = run(policy).cache
    group, i = cache.group_of(layer)
    state = jax.tree.map(lambda x: x[i], group.state)
    q = jax.random.normal(jax.random.PRNGKey(seed), (3, CONFIG.num_heads, CONFIG.head_dim), jnp.float32)
    return state, q, cache.layer_kv(layer)[0], cache.lengths, cache.prompt_lengths


def selected_sets(idx, mask) -> list[list[list[int]]]:
    """[B, N, M] selection -> the list of valid positions per sequence and head (duplicates kept)."""
    idx, mask = np.asarray(idx), np.asarray(mask)
    return [[idx[b, n][mask[b, n]].tolist() for n in range(idx.shape[1])] for b in range(idx.shape[0])]


def np_quest_pages(prompt_len: int, length: int, ps: int) -> tuple[list[tuple[int, int]], int]:
    """Quest's pages in slot order as (start, length): the prompt's, then whole pages of generated tokens."""
    pages = [(s, min(ps, prompt_len - s)) for s in range(0, prompt_len, ps)]
    s = prompt_len
    while s + ps <= length:
        pages.append((s, ps))
        s += ps
    return pages, s


# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda: Quest(budget=0), lambda: Quest(budget=-16), lambda: Quest(page_size=0),
    lambda: Quest(page_size=-4), lambda: Quest(budget=8, page_size=16), lambda: Quest(full_layers=-1),
    lambda: Quest(sinks=-1), lambda: Quest(budget=32, page_size=16, sinks=33),
    lambda: StreamingLLM(budget=0), lambda: StreamingLLM(budget=8, sinks=16), lambda: StreamingLLM(sinks=-1),
    lambda: StreamingLLM(full_layers=-1), lambda: OracleTopK(budget=0), lambda: OracleTopK(full_layers=-2),
    lambda: SnapKV(window=0), lambda: SnapKV(budget=16, window=32), lambda: SnapKV(pool_size=4),
    lambda: SnapKV(pool_size=0), lambda: InfiniGen(partial_ratio=0.0), lambda: InfiniGen(partial_ratio=1.5),
    lambda: InfiniGen(sample=0), lambda: InfiniGen(budget=0),
])
def test_invalid_settings_raise(make):
    with pytest.raises(ValueError):
        make()


def test_policies_are_hashable_static_args():
    assert hash(Quest()) == hash(Quest()) and Quest(budget=64) != Quest(budget=128)
    assert {StreamingLLM(), StreamingLLM(), OracleTopK(), OracleTopK()} == {StreamingLLM(), OracleTopK()}


# --------------------------------------------------------------------------------------------------
# Selections against NumPy
# --------------------------------------------------------------------------------------------------


def test_quest_page_scores_and_top_pages_match_numpy():
    ps, n_top = QUEST.page_size, QUEST.budget // QUEST.page_size
    for layer in range(QUEST.full_layers, CONFIG.num_layers):
        state, q, keys, lengths, prompt_lengths = layer_inputs(QUEST, layer, seed=layer)
        scores = np.asarray(QUEST.page_scores(state, q))  # [B, N, P]
        chosen = selected_sets(*QUEST.selected_positions(state, q, keys, lengths, prompt_lengths))
        keys_np, q_np = np.asarray(keys), np.asarray(q)
        for b in range(3):
            pages, _ = np_quest_pages(int(prompt_lengths[b]), int(lengths[b]), ps)
            n_used = len(pages)
            assert np.all(np.isneginf(scores[b, :, n_used:])), "unused page slots must score -inf"
            for n in range(CONFIG.num_heads):
                ref = np.array([
                    np.maximum(q_np[b, n] * keys_np[b, n // G, s:s + m].max(0),
                               q_np[b, n] * keys_np[b, n // G, s:s + m].min(0)).sum()
                    for s, m in pages])  # [n_used] Σ_d max(q_d kmax_d, q_d kmin_d)
                np.testing.assert_allclose(scores[b, n, :n_used], ref, rtol=1e-5, atol=1e-5)
                top = np.argsort(-ref)[:n_top]
                want = sorted(p for i in top for p in range(pages[i][0], pages[i][0] + pages[i][1]))
                assert sorted(chosen[b][n]) == want, (layer, b, n)


def test_quest_sinks_select_the_first_pages_then_the_top_scoring_ones():
    """sinks=10 with pages of 8: pages 0 and 1 always, then the best of the rest by the NumPy bound; the selection
    never repeats a page, and the sink pages are taken even when their bound is the lowest."""
    quest = dataclasses.replace(QUEST, sinks=10)
    ps, n_top, n_sink = quest.page_size, quest.budget // quest.page_size, 2
    state, q, keys, lengths, prompt_lengths = layer_inputs(QUEST, CONFIG.num_layers - 1)
    # Make the sink pages score lowest for every head: zero keys bound every q·k by 0, and every other page of
    # these random keys has a positive bound.
    kmin = state.kmin.at[:, :, :n_sink].set(0.0)
    state = state.replace(kmin=kmin, kmax=state.kmax.at[:, :, :n_sink].set(0.0))
    scores = np.asarray(quest.page_scores(state, q))  # [B, N, P]
    chosen = selected_sets(*quest.selected_positions(state, q, keys, lengths, prompt_lengths))
    plain = selected_sets(*QUEST.selected_positions(state, q, keys, lengths, prompt_lengths))
    for b in range(3):
        pages, _ = np_quest_pages(int(prompt_lengths[b]), int(lengths[b]), ps)
        for n in range(CONFIG.num_heads):
            rest = np.arange(n_sink, len(pages))
            top = list(range(n_sink)) + list(rest[np.argsort(-scores[b, n, rest], kind="stable")][:n_top - n_sink])
            want = sorted(p for i in top for p in range(pages[i][0], pages[i][0] + pages[i][1]))
            assert sorted(chosen[b][n]) == want, (b, n)
            assert not set(range(2 * ps)) <= set(plain[b][n]), "without sinks the low-scoring pages 0-1 are dropped"


def test_streaming_selection_is_sinks_plus_recent():
    state, q, keys, lengths, prompt_lengths = layer_inputs(STREAMING, CONFIG.num_layers - 1)
    chosen = selected_sets(*STREAMING.selected_positions(state, q, keys, lengths, prompt_lengths))
    recent = STREAMING.budget - STREAMING.sinks
    for b, L in enumerate(np.asarray(lengths).tolist()):
        want = set(range(min(STREAMING.sinks, L))) | set(range(max(L - recent, 0), L))
        for n in range(CONFIG.num_heads):
            assert sorted(chosen[b][n]) == sorted(want)


def test_oracle_selection_is_numpy_top_k_of_prompt_scores():
    for layer in range(ORACLE.full_layers, CONFIG.num_layers):
        state, q, keys, lengths, prompt_lengths = layer_inputs(ORACLE, layer, seed=10 + layer)
        chosen = selected_sets(*ORACLE.selected_positions(state, q, keys, lengths, prompt_lengths))
        keys_np, q_np = np.asarray(keys), np.asarray(q)
        for b, Lp in enumerate(np.asarray(prompt_lengths).tolist()):
            for n in range(CONFIG.num_heads):
                scores = keys_np[b, n // G, :Lp] @ q_np[b, n]  # [Lp] raw q·k over the prompt only
                assert sorted(chosen[b][n]) == sorted(np.argsort(-scores)[:ORACLE.budget].tolist())


def np_layer0_queries(tokens: np.ndarray) -> np.ndarray:
    """[B, T, N, H] post-RoPE queries of layer 0, from the embeddings, RMSNorm, W_q and RoPE in float64."""
    layer = jax.tree.map(lambda p: np.asarray(p[0], np.float64), params()["layers"])
    x = np.asarray(params()["embed"], np.float64)[tokens]  # [B, T, D]
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + CONFIG.rms_norm_eps) * layer["attn_norm"]
    q = np.einsum("btd,dnh->btnh", x, layer["q"])
    H = CONFIG.head_dim
    inv_freq = 1.0 / CONFIG.rope_theta ** (np.arange(0, H, 2) / H)
    angles = np.arange(tokens.shape[1])[:, None] * inv_freq  # [T, H/2]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    q1, q2 = q[..., :H // 2], q[..., H // 2:]
    return np.concatenate([q1 * cos - q2 * sin, q2 * cos + q1 * sin], axis=-1)


@pytest.mark.parametrize("window", [8, 32])
def test_policies_observe_the_prompts_last_queries(window):
    """Layer 0's stored observation window holds the queries of positions [L - n, L) (zeros before position 0:
    the 23-token prompt under a 32-query window), recomputed in NumPy from the weights."""
    policy = SnapKV(budget=40, window=window, full_layers=0)
    observed = run(policy).states[0].queries[0]  # [B, N, n, H] of layer 0 after prefill
    want = np_layer0_queries(PROMPTS)
    for b, L in enumerate(PROMPT_LENGTHS.tolist()):
        for j in range(window):
            p = L - window + j
            expected = want[b, p] if p >= 0 else np.zeros_like(want[b, 0])
            np.testing.assert_allclose(observed[b, :, j], expected, rtol=1e-4, atol=1e-4, err_msg=f"{b}, {j}")


def np_snapkv(queries, keys, L, budget, window, kernel) -> list[list[int]]:
    """SnapKV's kept positions per query head, as its PyTorch code computes them: softmax(q k^T / sqrt(H)) of the
    window queries under the causal mask, summed over the window for the earlier tokens, avg_pool1d(kernel,
    padding=kernel // 2), top (budget - window), plus the window. queries [N, n, H], keys [K, S, H]."""
    N, n, H = queries.shape
    kept = []
    for head in range(N):
        logits = queries[head] @ keys[head // G, :L].T / np.sqrt(H)  # [n, L]
        positions = L - n + np.arange(n)
        logits = np.where(np.arange(L)[None, :] <= positions[:, None], logits, -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        votes = probs[positions >= 0].sum(0)[: max(L - n, 0)]
        pooled = np.convolve(np.pad(votes, kernel // 2), np.ones(kernel) / kernel, mode="valid")
        top = np.argsort(-pooled, kind="stable")[: budget - min(n, budget)]
        kept.append(sorted(top.tolist() + list(range(max(L - n, 0), L))))
    return kept


def test_snapkv_keeps_what_numpy_snapkv_keeps():
    for layer in range(SNAPKV.full_layers, CONFIG.num_layers):
        state, q, keys, lengths, prompt_lengths = layer_inputs(SNAPKV, layer)
        chosen = selected_sets(*SNAPKV.selected_positions(state, q, keys, lengths, prompt_lengths))
        for b, L in enumerate(np.asarray(prompt_lengths).tolist()):
            want = np_snapkv(np.asarray(state.queries[b], np.float64), np.asarray(keys[b], np.float64), L,
                             SNAPKV.budget, SNAPKV.window, SNAPKV.pool_size)
            assert [sorted(c) for c in chosen[b]] == want, (layer, b)
            # The decode query does not matter: the choice was made at prefill, for good.
            again = selected_sets(*SNAPKV.selected_positions(state, -q, keys, lengths, prompt_lengths))
            assert again == chosen


def np_infinigen(queries, keys, q, L, budget, ratio) -> list[list[int]]:
    """InfiniGen's top tokens per query head: skew A = right singular vectors of the KV head's sample queries
    (np.linalg.svd), the ceil(ratio H) channels with the largest sum |Q A|, top `budget` of (q A_r)·(k A_r)."""
    N, n, H = queries.shape
    K = keys.shape[0]
    r = int(np.ceil(ratio * H))
    kept = []
    for head in range(N):
        kv = head // G
        sample = queries[kv * G:(kv + 1) * G].reshape(G * n, H)
        A = np.linalg.svd(sample)[2].T  # [H, H] columns: right singular vectors (complete with full_matrices)
        channels = np.argsort(-np.abs(sample @ A).sum(0), kind="stable")[:r]
        scores = (keys[kv, :L] @ A[:, channels]) @ (q[head] @ A[:, channels])
        kept.append(sorted(np.argsort(-scores, kind="stable")[:budget].tolist()))
    assert K * G == N
    return kept


def test_infinigen_selects_what_numpy_infinigen_selects():
    # Sample queries with well-separated singular values, so the kept channels are not a near-tie.
    rng = np.random.default_rng(3)
    for layer in range(INFINIGEN.full_layers, CONFIG.num_layers):
        state, q, keys, lengths, prompt_lengths = layer_inputs(INFINIGEN, layer, seed=20 + layer)
        scale = 2.0 ** -np.arange(CONFIG.head_dim)  # channel c of the sample has scale 2^-c before the rotation
        rotation = np.linalg.qr(rng.normal(size=(CONFIG.head_dim, CONFIG.head_dim)))[0]
        sample = rng.normal(size=state.queries.shape) * scale @ rotation.T
        state = INFINIGEN.after_prefill(state.replace(queries=jnp.asarray(sample, jnp.float32)), keys, prompt_lengths)
        chosen = selected_sets(*INFINIGEN.selected_positions(state, q, keys, lengths, prompt_lengths))
        for b, L in enumerate(np.asarray(prompt_lengths).tolist()):
            want = np_infinigen(sample[b], np.asarray(keys[b], np.float64), np.asarray(q[b], np.float64), L,
                                INFINIGEN.budget, INFINIGEN.partial_ratio)
            assert [sorted(c) for c in chosen[b]] == want, (layer, b)


def test_infinigen_with_every_channel_is_the_oracle():
    """partial_ratio=1 keeps all H skewed channels: (qA)·(kA) = q·k, so it selects what OracleTopK selects."""
    every = dataclasses.replace(INFINIGEN, partial_ratio=1.0)
    for layer in range(every.full_layers, CONFIG.num_layers):
        state, q, keys, lengths, prompt_lengths = layer_inputs(every, layer, seed=30 + layer)
        chosen = selected_sets(*every.selected_positions(state, q, keys, lengths, prompt_lengths))
        oracle = selected_sets(*dataclasses.replace(ORACLE, budget=every.budget).selected_positions(
            None, q, keys, lengths, prompt_lengths))
        assert [[sorted(h) for h in b] for b in chosen] == [[sorted(h) for h in b] for b in oracle]


@pytest.mark.parametrize("policy", SMALL + LARGE, ids=lambda p: repr(p))
def test_selection_invariants(policy):
    """Distinct, inside the counted region, and exactly min(budget, available) (Quest: whole pages)."""
    layer = CONFIG.num_layers - 1
    state, q, keys, lengths, prompt_lengths = layer_inputs(policy, layer)
    idx, mask = policy.selected_positions(state, q, keys, lengths, prompt_lengths)
    assert idx.shape == mask.shape and idx.shape[:2] == (3, CONFIG.num_heads)
    chosen = selected_sets(idx, mask)
    for b in range(3):
        L, Lp = int(lengths[b]), int(prompt_lengths[b])
        for n in range(CONFIG.num_heads):
            sel = chosen[b][n]
            assert len(set(sel)) == len(sel), "a token selected twice"
            assert all(0 <= p < L for p in sel)
            if isinstance(policy, Quest):
                pages, indexed_upto = np_quest_pages(Lp, L, policy.page_size)
                assert int(state.indexed_upto[b]) == indexed_upto
                assert all(p < indexed_upto for p in sel), "Quest selects only paged tokens"
                whole = [m for s, m in pages if s in sel]
                assert all(set(range(s, s + m)) <= set(sel) for s, m in pages if s in sel), "partial page"
                assert len(sel) == sum(whole) <= policy.budget
                n_pages = min(policy.budget // policy.page_size, len(pages))
                assert len(whole) == n_pages
            elif isinstance(policy, StreamingLLM):
                assert len(sel) == min(policy.budget, L)
            else:
                assert all(p < Lp for p in sel) and len(sel) == min(policy.budget, Lp)


# --------------------------------------------------------------------------------------------------
# Through the model
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", LARGE, ids=lambda p: type(p).__name__)
def test_unlimited_budget_equals_full_kv(policy):
    full, ours = run(FullKV()).logits, run(policy).logits
    assert np.all(np.isfinite(ours))
    np.testing.assert_allclose(ours, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("policy", SMALL, ids=lambda p: type(p).__name__)
def test_small_budget_changes_the_output(policy):
    """Guards the comparisons above: a budget below the context really attends fewer tokens."""
    full, ours = run(FullKV()).logits, run(policy).logits
    assert np.all(np.isfinite(ours))
    np.testing.assert_array_equal(ours[:, 0], full[:, 0])  # prefill is exact attention for every policy
    assert np.abs(ours[:, 1:] - full[:, 1:]).max() > 1e-4


@pytest.mark.parametrize("policy", SMALL, ids=lambda p: type(p).__name__)
def test_ragged_batch_equals_each_sequence_alone(policy):
    batch = run(policy)  # junk after each prompt; alone, zeros: padding must not leak either way
    for i in range(3):
        alone = run(policy, (i,), zero_padding=True)
        np.testing.assert_allclose(batch.logits[i], alone.logits[0], atol=1e-5, rtol=0, err_msg=f"sequence {i}")


def test_quest_pages_generated_tokens_every_page_size_steps():
    ps = QUEST.page_size
    result = run(QUEST)
    # [L, B, K, S, H]; rows below each length never change
    keys = np.stack([np.asarray(result.cache.layer_kv(layer)[0]) for layer in range(CONFIG.num_layers)])
    first = QUEST.full_layers
    for t, state in enumerate(result.states):  # t decode steps done
        # A step pages the tokens stored before it (`attend.index_windows`): t steps paged the first t - 1.
        paged = max(t - 1, 0)
        # Full layers never reach the policy: the state covers the selecting layers only.
        assert state.kmin.shape[0] == CONFIG.num_layers - first
        for layer in range(first, CONFIG.num_layers):
            kmin, kmax = state.kmin[layer - first], state.kmax[layer - first]  # [B, K, P, H]
            i = layer - first
            start, plen, upto = state.page_start[i], state.page_len[i], state.indexed_upto[i]
            for b, Lp in enumerate(PROMPT_LENGTHS.tolist()):
                pages, indexed_upto = np_quest_pages(Lp, Lp + paged, ps)
                n_prompt = -(-Lp // ps)
                assert len(pages) == n_prompt + paged // ps, "one new page every page_size steps"
                assert int(upto[b]) == indexed_upto
                assert [(int(s), int(m)) for s, m in zip(start[b], plen[b]) if m > 0] == pages
                assert not plen[b, len(pages):].any()
                for slot, (s, m) in enumerate(pages):
                    if slot >= n_prompt:
                        assert s >= Lp and s + m <= Lp + t, "a generated page holds only generated tokens"
                    rows = keys[layer, b, :, s:s + m]  # [K, m, H]
                    np.testing.assert_allclose(kmin[b, :, slot], rows.min(1), rtol=0, atol=0)
                    np.testing.assert_allclose(kmax[b, :, slot], rows.max(1), rtol=0, atol=0)


@pytest.mark.parametrize("policy", [Quest(budget=48, page_size=16, full_layers=1),
                                    StreamingLLM(budget=40, sinks=8, full_layers=1),
                                    OracleTopK(budget=24, full_layers=1), SnapKV(budget=24, window=8, full_layers=1),
                                    InfiniGen(budget=24, sample=8, full_layers=1)], ids=lambda p: type(p).__name__)
def test_generate_compiles_once(policy):
    model = Model(CONFIG, params(), tokenizer=None)
    before = generation_programs()
    first = generate(model, [PROMPTS[0, :50].tolist(), PROMPTS[1, :37].tolist()], max_new_tokens=12,
                     policy=policy)
    second = generate(model, [PROMPTS[2, :23].tolist(), PROMPTS[0, :41].tolist()], max_new_tokens=12,
                      policy=policy)
    assert generation_programs() - before == 2  # same (batch, bucket, max_new_tokens, policy)
    for result in (first, second):
        assert [len(t) for t in result.tokens] == [12, 12]
        assert all(0 <= tok < CONFIG.vocab_size for t in result.tokens for tok in t)


@pytest.mark.parametrize("policy", [QUEST, ORACLE, INFINIGEN,
                                    ClusterKV(budget=24, sinks=4, tokens_per_cluster=8, full_layers=1)],
                         ids=lambda p: type(p).__name__)
def test_gemmas_score_selects_what_q_dot_k_selects(policy):
    """Gemma scores q.k / sqrt(query_pre_attn_scalar), soft-capped (Gemma 2): a positive factor on q and the
    monotone cap. The model hands policies q times that factor (`model._project_qkv`), so each selection must be
    the one the unscaled q makes; and the keys the capped score ranks first are the ones q.k ranks first."""
    for layer in range(policy.full_layers, CONFIG.num_layers):
        state, q, keys, lengths, prompt_lengths = layer_inputs(policy, layer, seed=layer)
        plain = selected_sets(*policy.selected_positions(state, q, keys, lengths, prompt_lengths))
        for factor in (0.25, (16 / 24) ** 0.5, 3.0):
            scaled = selected_sets(*policy.selected_positions(state, q * factor, keys, lengths, prompt_lengths))
            assert [[sorted(h) for h in b] for b in scaled] == [[sorted(h) for h in b] for b in plain], factor
    q_np, keys_np = np.asarray(q, np.float64), np.repeat(np.asarray(keys, np.float64), G, axis=1)
    raw = np.einsum("bnh,bnsh->bns", q_np, keys_np)
    capped = 5.0 * np.tanh(raw * (16 / 24) ** 0.5 / np.sqrt(CONFIG.head_dim) / 5.0)
    for b in range(3):
        n = int(lengths[b])
        for h in range(CONFIG.num_heads):
            assert set(np.argsort(-raw[b, h, :n])[:16]) == set(np.argsort(-capped[b, h, :n])[:16])


@pytest.mark.parametrize("n, T, start", [(8, 32, 0), (8, 32, 20), (8, 32, 40), (40, 32, 0), (40, 32, 16)])
def test_the_kept_prompt_queries_are_each_prompts_last_n(n, T, start):
    """`attend.observe_prompt_queries` (a prefill, or one chunk of positions [start, start + T)) hands the policy the
    queries of each prompt's last n positions that the chunk holds, and says which: against a NumPy walk over ragged
    lengths, with the last n straddling the chunk's edges and n longer than the chunk. q comes back unchanged."""
    from clusterkv_jax.attend import observe_prompt_queries

    @dataclasses.dataclass(frozen=True)
    class Keeping:
        prompt_queries: int

        def observe_queries(self, state, queries, found):
            return queries, found

    B, N, H = 4, 2, 3
    q = np.random.default_rng(0).standard_normal((B, T, N, H)).astype(np.float32)
    lengths = np.array([5, start + 3, start + T - 2, start + T + 30], np.int32)
    observe = jax.jit(lambda q_, lengths_: observe_prompt_queries(Keeping(n), None, q_, start, lengths_))
    (got, found), q_after = observe(jnp.asarray(q), jnp.asarray(lengths))
    got, found = np.asarray(got), np.asarray(found)
    np.testing.assert_array_equal(np.asarray(q_after), q)  # q as it was, for the layer's attention
    assert got.shape == (B, N, n, H) and found.shape == (B, n)
    for b in range(B):
        for j in range(n):
            at = lengths[b] - n + j - start
            assert found[b, j] == (lengths[b] - n + j >= 0 and 0 <= at < T), (b, j)
            if found[b, j]:
                np.testing.assert_array_equal(got[b, :, j], q[b, at])
    assert found.any() and not found.all()
