"""Quest, StreamingLLM and OracleTopK against NumPy references, on a tiny random model (no checkpoint).

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
from clusterkv_jax.generate import decode_step, generate, prefill
from clusterkv_jax.loading import Model
from clusterkv_jax.model import init_params
from clusterkv_jax.policies import FullKV, OracleTopK, Quest, StreamingLLM
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
SMALL = (QUEST, STREAMING, ORACLE)
# Budgets above the capacity: every token is attended, in every layer.
LARGE = (Quest(budget=1024, page_size=8, full_layers=0), StreamingLLM(budget=1024, sinks=4, full_layers=0),
         OracleTopK(budget=1024, full_layers=0))


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
        # Full layers never reach the policy: the state covers the selecting layers only.
        assert state.kmin.shape[0] == CONFIG.num_layers - first
        for layer in range(first, CONFIG.num_layers):
            kmin, kmax = state.kmin[layer - first], state.kmax[layer - first]  # [B, K, P, H]
            i = layer - first
            start, plen, upto = state.page_start[i], state.page_len[i], state.indexed_upto[i]
            for b, Lp in enumerate(PROMPT_LENGTHS.tolist()):
                pages, indexed_upto = np_quest_pages(Lp, Lp + t, ps)
                n_prompt = -(-Lp // ps)
                assert len(pages) == n_prompt + t // ps, "one new page every page_size steps"
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
                                    OracleTopK(budget=24, full_layers=1)], ids=lambda p: type(p).__name__)
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
