"""ClusterKV against FullKV, an exact top-B oracle, and brute-force checks of its cluster index."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterkv_jax.cache import init_cache
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.decode_loop import generate_ids
from clusterkv_jax.generate import generate
from clusterkv_jax.prompts import prefill_prompts
from clusterkv_jax.sampling import Sampling
from clusterkv_jax.steps import decode_step, prefill
from clusterkv_jax.loading import Model
from clusterkv_jax.model import init_params
from clusterkv_jax.policies import FullKV, InfiniGen, Quest, SnapKV, StreamingLLM
from clusterkv_jax.policies.cluster_select import cluster_scores, rank_and_index
from clusterkv_jax.policies.clusterkv import ClusterKV, ClusterKVPaper
from clusterkv_jax.policies.full import FullKVKeepingQueries
from tests.helpers import generation_programs, triton_mode

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=16)
PARAMS = init_params(CFG, jax.random.PRNGKey(0))
SMALL = dict(sinks=4, tokens_per_cluster=8, decode_interval=16, decode_clusters=2)


def run(policy, tokens, lengths, steps, capacity=448, prompt_bucket=192):
    """Prefill then teacher-forced decode; returns logits [steps + 1, B, V] and the final cache."""
    B = tokens.shape[0]
    cache = init_cache(CFG, policy, B, capacity, jnp.float32)
    logits, cache = prefill(PARAMS, jnp.asarray(tokens[:, :prompt_bucket]), jnp.asarray(lengths), cache,
                            config=CFG, policy=policy)
    out = [np.asarray(logits)]
    for i in range(steps):
        nxt = tokens[np.arange(B), lengths + i]
        logits, cache = decode_step(PARAMS, jnp.asarray(nxt), cache, config=CFG, policy=policy)
        out.append(np.asarray(logits))
    return np.stack(out), cache


TOKENS = np.random.default_rng(0).integers(0, 128, (3, 448))
LENGTHS = np.array([180, 120, 61])


@pytest.mark.parametrize("gqa,init,branch_free", [("per_head", "random", False), ("shared", "kmeans++", False),
                                                  ("per_head", "random", True)])
def test_budget_covering_everything_equals_full_kv(gqa, init, branch_free):
    """A budget that holds every token gives full KV's logits: where the step branches (CPU, TPU) it attends the
    whole layer, and where it does not (a GPU's step, `kernels.branches_wait_for_host`, traced here) it attends
    the selection of every cluster whole."""
    import contextlib

    from clusterkv_jax import kernels

    full, _ = run(FullKV(), TOKENS, LENGTHS, steps=36)
    with kernels.forced_branches_wait_for_host(True) if branch_free else contextlib.nullcontext():
        ours, cache = run(ClusterKV(budget=512, gqa=gqa, init=init, **SMALL), TOKENS, LENGTHS, steps=36)
    np.testing.assert_allclose(ours, full, atol=1e-5)
    # Decode clustering fired twice (at 16 and 32 generated tokens) on every compressed layer (2 and 3).
    np.testing.assert_array_equal(np.asarray(cache.policy_state.clustered_upto), np.tile(LENGTHS + 32, (2, 1)))


def test_small_budget_differs_from_full_kv():
    full, _ = run(FullKV(), TOKENS, LENGTHS, steps=4)
    ours, _ = run(ClusterKV(budget=24, **SMALL), TOKENS, LENGTHS, steps=4)
    assert np.abs(ours[1:] - full[1:]).max() > 1e-3  # the test above is not vacuous


def _layer_state(cache, layer):
    """The policy state of model layer `layer` (the state is stacked over the selecting layers only)."""
    group, i = cache.group_of(layer)
    return jax.tree.map(lambda x: x[i], group.state)


def _members(state, b, h, block_size=16):
    """Cluster id -> set of positions, read from the store layout of sequence b, KV head h: a cluster's members
    are the positions held by its first `size` rows from its first block."""
    sizes, first, pos = (np.asarray(x[b, h]) for x in (state.sizes, state.block_start, state.row_positions))
    return {c: set(pos[first[c] * block_size: first[c] * block_size + sizes[c]].tolist()) for c in np.flatnonzero(sizes)}


def test_layout_sort_by_one_key_equals_the_stable_argsort(monkeypatch):
    """`_layout_rows` sorts label·n + offset as one int32 key; past int32 it falls back to a stable argsort of the
    labels: both give the same order and rows (ragged labels, unclustered keys at label C)."""
    from clusterkv_jax.policies import cluster_blocks as module

    rng = np.random.default_rng(11)
    C, n, bs = 7, 50, 4
    labels = jnp.asarray(rng.integers(0, C + 1, (2, 3, n)), jnp.int32)
    sizes = jnp.sum(labels[..., None] == jnp.arange(C), axis=-2).astype(jnp.int32)
    block_start = 3 + jnp.cumsum(-(-sizes // bs), axis=-1) - (-(-sizes // bs))
    one_key = module._layout_rows(labels, sizes, block_start, bs, C)
    monkeypatch.setattr(module, "_SORT_KEY_LIMIT", 0)
    argsorted = module._layout_rows(labels, sizes, block_start, bs, C)
    want_order = np.argsort(np.asarray(labels), axis=-1, kind="stable")
    for got in (one_key, argsorted):
        np.testing.assert_array_equal(np.asarray(got[0]), want_order)
    np.testing.assert_array_equal(np.asarray(one_key[1]), np.asarray(argsorted[1]))


def test_clusters_partition_the_prompt_past_the_sinks():
    policy = ClusterKV(budget=64, **SMALL)
    _, cache = run(policy, TOKENS, LENGTHS, steps=0)
    for layer in range(2, 4):
        state = _layer_state(cache, layer)
        for b, L in enumerate(LENGTHS):
            for h in range(CFG.num_kv_heads):
                members = _members(state, b, h)
                flat = [p for m in members.values() for p in m]
                assert sorted(flat) == list(range(4, L)), "every clustered token in exactly one cluster"
                assert len(members) <= max(1, (L - 4) // 8)
    # Layers below full_layers are never clustered: they hold no cluster index at all.
    assert cache.policy_state.sizes.shape[0] == CFG.num_layers - 2
    assert all(g.state is None for g in cache.groups if g.layers[0] < 2)


@pytest.mark.parametrize("policy", [ClusterKV(budget=40, **SMALL), ClusterKVPaper(budget=48)], ids=["small", "paper"])
def test_selection_is_ranked_clusters_with_the_last_trimmed(policy):
    """A brute-force walk of the rule: clusters by q·μ, whole until the budget, the last trimmed to its first
    members by position. The paper's preset (16 sinks, L/80 clusters) walks the same rule."""
    _, cache = run(policy, TOKENS, LENGTHS, steps=0)
    state = _layer_state(cache, 3)
    q = jax.random.normal(jax.random.PRNGKey(1), (3, CFG.num_heads, CFG.head_dim))
    lengths = jnp.asarray(LENGTHS)
    idx, mask = policy.selected_positions(state, q, None, lengths, lengths)
    idx, mask = np.asarray(idx), np.asarray(mask)
    G, B, sinks = CFG.num_heads // CFG.num_kv_heads, policy.budget, policy.sinks
    trims = 0
    for b, L in enumerate(LENGTHS):
        for n in range(CFG.num_heads):
            chosen = idx[b, n][mask[b, n]]
            assert len(chosen) == len(set(chosen)) == min(B, L), "distinct, exactly min(B, available)"
            assert chosen.min() >= 0 and chosen.max() < L
            assert set(range(sinks)) <= set(chosen.tolist()), "sinks always selected"
            members = _members(state, b, n // G)
            cent = np.asarray(state.centroids[b, n // G])
            ranked = sorted(members, key=lambda c: -float(np.dot(np.asarray(q[b, n]), cent[c])))
            rest, left = set(chosen.tolist()) - set(range(sinks)), B - sinks
            for c in ranked:
                if left <= 0:
                    assert not (members[c] & rest), "a lower-ranked cluster leaked in"
                elif len(members[c]) <= left:
                    assert members[c] <= rest, "a whole higher-ranked cluster is missing"
                    left -= len(members[c])
                else:
                    assert members[c] & rest == set(sorted(members[c])[:left]), "the last one trimmed to its first"
                    left, trims = 0, trims + 1
    assert trims, "some selection trimmed a cluster"


def _keys_by_position(cache, layer, state):
    """[B, K, S, H] the keys of a layer by position (ClusterKV's store keeps them in its own row order)."""
    rows, where = np.asarray(cache.layer_kv(layer)[0]), np.asarray(state.row_positions)  # [B, K, R, H], [B, K, R]
    keys = np.zeros(rows.shape[:2] + (cache.capacity, rows.shape[-1]), rows.dtype)
    for b, k, r in zip(*np.nonzero(where >= 0)):
        keys[b, k, where[b, k, r]] = rows[b, k, r]
    return keys


def test_one_token_per_cluster_selects_the_exact_top_b():
    policy = ClusterKV(budget=20, sinks=0, tokens_per_cluster=1, decode_interval=16, decode_clusters=2)
    _, cache = run(policy, TOKENS, LENGTHS, steps=0)
    lengths = jnp.asarray(LENGTHS)
    q = jax.random.normal(jax.random.PRNGKey(2), (3, CFG.num_heads, CFG.head_dim))
    for layer in (2, 3):
        state = _layer_state(cache, layer)
        idx, mask = policy.selected_positions(state, q, None, lengths, lengths)
        keys = _keys_by_position(cache, layer, state)
        for b, L in enumerate(LENGTHS):
            for n in range(CFG.num_heads):
                scores = keys[b, n // 2, :L] @ np.asarray(q[b, n])
                oracle = set(np.argsort(-scores)[:20].tolist())
                assert set(np.asarray(idx[b, n])[np.asarray(mask[b, n])].tolist()) == oracle


def test_decode_clusters_hold_only_generated_tokens():
    policy = ClusterKV(budget=64, **SMALL)
    _, cache = run(policy, TOKENS, LENGTHS, steps=33)  # fires at 16 and 32 generated tokens
    state = _layer_state(cache, 2)
    for b, L in enumerate(LENGTHS):
        assert int(state.clustered_upto[b]) == L + 32
        C0 = int(state.num_prompt_clusters[b])  # decode-time clusters follow the sequence's prompt clusters
        for h in range(CFG.num_kv_heads):
            members = _members(state, b, h)
            for group in range(2):
                slots = range(C0 + 2 * group, C0 + 2 * group + 2)
                got = set().union(*(members.get(c, set()) for c in slots))
                assert got == set(range(L + 16 * group, L + 16 * (group + 1)))
            assert not any(c >= C0 + 4 for c in members), "no third group before 48 tokens"


def test_ragged_batch_equals_each_sequence_alone():
    policy = ClusterKV(budget=40, **SMALL)
    batch, _ = run(policy, TOKENS, LENGTHS, steps=20)
    for b in range(3):
        alone, _ = run(policy, TOKENS[b : b + 1], LENGTHS[b : b + 1], steps=20)
        np.testing.assert_allclose(batch[:, b], alone[:, 0], atol=1e-5)


def test_generate_with_clusterkv_compiles_once():
    model = Model(CFG, PARAMS, tokenizer=None)
    policy = ClusterKV(budget=32, **SMALL)
    before = generation_programs()
    a = generate(model, [TOKENS[0, :100].tolist(), TOKENS[1, :70].tolist()], 40, policy=policy, stop_at_eos=False)
    b = generate(model, [TOKENS[2, :90].tolist(), TOKENS[0, :60].tolist()], 40, policy=policy, stop_at_eos=False)
    assert generation_programs() - before == 2
    assert all(len(t) == 40 for t in a.tokens + b.tokens)


def test_a_shared_prefill_gives_each_policy_the_tokens_of_its_own():
    """`prefill_prompts` once, then `generate(..., prefilled=)` under several policies: on a ragged batch, through
    two decode-time clusterings, each policy generates the tokens of its own prefill, greedy and sampled (the first
    token drawn from the shared prefill's logits with the call's own key). Kept with the prompt's last 24 queries
    (`prompt_queries`), it serves SnapKV (all 24 vote) and InfiniGen (the last 16 fit its basis) too."""
    model = Model(CFG, PARAMS, tokenizer=None)
    prompts = [TOKENS[0, :180].tolist(), TOKENS[1, :120].tolist()]
    shared = prefill_prompts(model, prompts, 40)
    with_queries = prefill_prompts(model, prompts, 40, prompt_queries=24)
    runs = []
    for policy in (ClusterKV(budget=40, **SMALL), StreamingLLM(budget=40), FullKV(), SnapKV(budget=48, window=24),
                   InfiniGen(budget=40, sample=16)):
        own = generate(model, prompts, 40, policy, stop_at_eos=False).tokens
        for prefilled in ([shared] if not policy.prompt_queries else []) + [with_queries]:
            assert generate(model, prompts, 40, policy, prefilled=prefilled, stop_at_eos=False).tokens == own, policy
        runs.append(own)
    assert len({str(run) for run in runs}) == len(runs)  # not one outcome twice
    sampled = dict(temperature=0.8, seed=3, stop_at_eos=False)
    policy = ClusterKV(budget=40, **SMALL)
    own = generate(model, prompts, 40, policy, **sampled).tokens
    assert generate(model, prompts, 40, policy, prefilled=shared, **sampled).tokens == own
    assert own != runs[0]


def test_a_shared_prefill_refuses_what_it_does_not_hold():
    model = Model(CFG, PARAMS, tokenizer=None)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    shared = prefill_prompts(model, prompts, 4)
    with pytest.raises(ValueError, match=r"SnapKV indexes the prompt by its last 32 queries; this prefill kept 0: "
                                         r"prefill_prompts\(..., prompt_queries=32\)"):
        generate(model, prompts, 4, SnapKV(budget=64), prefilled=shared)
    eight = prefill_prompts(model, prompts, 4, prompt_queries=8)
    with pytest.raises(ValueError, match="InfiniGen indexes the prompt by its last 64 queries; this prefill kept 8"):
        generate(model, prompts, 4, InfiniGen(budget=64), prefilled=eight)
    with pytest.raises(ValueError, match="prompt_queries must be an int >= 0"):
        prefill_prompts(model, prompts, 4, prompt_queries=-1)
    with pytest.raises(ValueError, match="other prompts.*prompt 1 differs"):
        generate(model, [[1, 2, 3, 4], [5, 6]], 4, prefilled=shared)
    with pytest.raises(ValueError, match="max_new_tokens=5 exceeds the 4"):
        generate(model, prompts, 5, prefilled=shared)
    with pytest.raises(ValueError, match="cache_dtype"):
        generate(model, prompts, 4, prefilled=shared, cache_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="another model"):
        generate(Model(dataclasses.replace(CFG, rope_theta=CFG.rope_theta * 2), PARAMS, None), prompts, 4,
                 prefilled=shared)
    other_weights = jax.tree_util.tree_map(lambda x: x * 2, PARAMS)  # the same config
    with pytest.raises(ValueError, match="another model.*other weights"):
        generate(Model(CFG, other_weights, tokenizer=None), prompts, 4, prefilled=shared)
    generate(Model(CFG, PARAMS, tokenizer=None), prompts, 4, prefilled=shared)  # another Model of the same weights
    with pytest.raises(TypeError, match="prefill_prompts"):
        generate(model, prompts, 4, prefilled="yes")


@pytest.mark.parametrize("policy", [ClusterKV(budget=40, **SMALL), Quest(budget=32, page_size=8),
                                    ClusterKV(budget=40, offload=True, **SMALL)], ids=["clusterkv", "quest", "offloaded"])
def test_generate_indexes_between_steps_what_each_step_would_index(policy):
    """`generate`'s decode loop runs the steps without indexing (`decode_step(index=False)`) and indexes every
    layer's due windows between runs of them (`attend.steps_until_due`): the tokens and the final cache (clusters or
    pages, the store's rows) equal those of `decode_step` stepping one token at a time, which indexes inside each
    step. Ragged prompts, 50 tokens: several windows of 16 (ClusterKV) or pages of 8 (Quest)."""
    from clusterkv_jax.steps import bucket_length, cache_capacity

    prompts, steps = [TOKENS[0, :150], TOKENS[1, :97], TOKENS[2, :61]], 50
    lengths = np.array([len(p) for p in prompts])
    bucket = bucket_length(int(lengths.max()))
    tokens = np.zeros((3, bucket), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    capacity = cache_capacity(bucket, steps)
    out, _, looped = generate_ids(PARAMS, jnp.asarray(tokens), jnp.asarray(lengths), Sampling.make(),
                                  jax.random.PRNGKey(0), jnp.zeros((0,), jnp.int32), jnp.int32(0), config=CFG,
                                  policy=policy, max_new_tokens=steps, capacity=capacity,
                                  cache_dtype=jnp.dtype(jnp.float32))
    cache = init_cache(CFG, policy, 3, capacity, jnp.float32)
    logits, cache = prefill(PARAMS, jnp.asarray(tokens), jnp.asarray(lengths), cache, config=CFG, policy=policy)
    stepped = [np.asarray(jnp.argmax(logits, -1))]
    for _ in range(steps - 1):
        logits, cache = decode_step(PARAMS, jnp.asarray(stepped[-1], jnp.int32), cache, config=CFG, policy=policy)
        stepped.append(np.asarray(jnp.argmax(logits, -1)))
    np.testing.assert_array_equal(np.asarray(out), np.stack(stepped, 1))
    for got, want in zip(jax.tree.leaves(looped), jax.tree.leaves(cache)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    indexed = np.asarray(cache.policy_state.clustered_upto if isinstance(policy, ClusterKV)
                         else cache.policy_state.indexed_upto)  # [selecting layers, B]
    assert np.all(indexed >= lengths + (steps - 1) // SMALL["decode_interval"] * SMALL["decode_interval"]), indexed


def test_generate_times_prefill_and_decode_apart_with_the_tokens_of_one_program():
    """`generate` runs prefill and decode as two programs, each compiled once before it runs and timed apart: the
    same tokens as `generate_ids` (one program), and compile + prefill + decode seconds make up the call's seconds;
    a second call compiles nothing."""
    from clusterkv_jax.steps import bucket_length, cache_capacity, counting_compiles
    from tests.helpers import generation_programs

    model = Model(CFG, PARAMS, tokenizer=None)
    policy = ClusterKV(budget=32, **SMALL, kmeans_tol=0.25)  # a policy no other test generates with: it compiles
    prompts = [TOKENS[0, :100].tolist(), TOKENS[1, :70].tolist()]
    before = generation_programs()
    result = generate(model, prompts, 24, policy=policy, stop_at_eos=False)
    assert generation_programs() - before == 2  # the programs it compiled ahead are the ones it ran
    assert result.compiled and result.compile_seconds > 0
    with counting_compiles() as compiles:
        again = generate(model, prompts, 24, policy=policy, stop_at_eos=False)
    assert compiles[0] == 0 and not again.compiled and again.tokens == result.tokens
    tokens = np.zeros((2, bucket_length(100)), np.int32)
    tokens[0, :100], tokens[1, :70] = prompts
    out, counts, _ = generate_ids(PARAMS, jnp.asarray(tokens), jnp.array([100, 70]), Sampling.make(),
                                  jax.random.PRNGKey(0), jnp.zeros((0,), jnp.int32), jnp.int32(0), config=CFG,
                                  policy=policy, max_new_tokens=24, capacity=cache_capacity(bucket_length(100), 24),
                                  cache_dtype=jnp.dtype(jnp.float32))
    assert result.tokens == np.asarray(out).tolist()
    assert result.prefill_seconds > 0 and result.decode_seconds > 0
    assert abs(result.compile_seconds + result.prefill_seconds + result.decode_seconds - result.seconds) < 1e-6
    assert result.decode_tokens_per_second == pytest.approx(2 * 23 / result.decode_seconds)


@pytest.mark.parametrize(
    "kwargs",
    [dict(budget=8, sinks=16), dict(tokens_per_cluster=0), dict(decode_clusters=400, decode_interval=320),
     dict(decode_clusters=0), dict(gqa="mean"), dict(init="kmeans||"), dict(max_iters=0), dict(full_layers=-1)],
)
def test_invalid_settings_raise(kwargs):
    with pytest.raises(ValueError):
        ClusterKV(**kwargs)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    tokens=st.integers(0, 120),
    slots=st.integers(1, 12),
    block=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
    first=st.sampled_from([None, 1, 2, 4]),
)
def test_rank_and_index_matches_brute_force(sizes, tokens, slots, block, seed, first):
    """Clusters by descending score (ties to the lower index), taken while `tokens` tokens and `slots` blocks
    hold, the last one trimmed: the blocks and rows a NumPy walk of the clusters gives, whether the top `first`
    clusters fill the budget (the short ranking) or not (the full one)."""
    rng = np.random.default_rng(seed)
    sizes = np.array(sizes, np.int32)
    first_block = rng.permutation(1000)[: len(sizes)].astype(np.int32) * 10  # disjoint block ranges
    scores = rng.normal(size=len(sizes)).astype(np.float32)
    scores[rng.random(len(sizes)) < 0.2] = 0.5  # some ties
    blocks, rows = rank_and_index(jnp.asarray(scores), jnp.asarray(sizes), jnp.asarray(first_block), tokens, slots,
                                  block, first=first)
    want_blocks, want_rows, taken = [], [], 0
    for c in np.argsort(-scores, kind="stable"):
        if sizes[c] == 0:
            continue
        take = min(sizes[c], tokens - taken, block * (slots - len(want_blocks)))
        if take <= 0:
            break
        taken += take
        for u in range(-(-take // block)):
            want_blocks.append(first_block[c] + u)
            want_rows.append(min(block, take - block * u))
    pad = slots - len(want_blocks)
    assert np.asarray(blocks).tolist() == want_blocks + [0] * pad
    assert np.asarray(rows).tolist() == want_rows + [0] * pad


def test_pallas_kernels_in_interpret_mode_match_the_reference_path(monkeypatch):
    """K-means (centroid_update), selection (cluster_to_block_index), the selecting layers' decode attention
    (selected_attention, straight from the store) and the full layers' (JAX's flash-decoding kernel) through the
    Pallas kernels, run in interpret mode on a CPU (compiled on a CUDA GPU), give the same clusters, layout and
    logits as the pure-jnp path."""
    from clusterkv_jax import attend as attend_module
    from clusterkv_jax import kernels

    tokens, lengths = TOKENS[:2], LENGTHS[:2]
    ref, ref_cache = run(ClusterKV(budget=40, kernels="reference", **SMALL), tokens, lengths, steps=18)
    in_place, flash = [], []
    attend = attend_module.attend_in_place
    monkeypatch.setattr(attend_module, "attend_in_place", lambda *a, **k: in_place.append(1) or attend(*a, **k))
    decode = kernels._decode_attention_pallas
    monkeypatch.setattr(kernels, "_decode_attention_pallas", lambda *a, **k: flash.append(1) or decode(*a, **k))
    pal, pal_cache = run(ClusterKV(budget=40, kernels=triton_mode(), **SMALL), tokens, lengths, steps=18)
    assert in_place, "the decode steps attend straight from the store (selected_attention)"
    assert flash, "the full layers' decode steps attend through the flash-decoding kernel"
    for field in ("sizes", "block_start", "row_positions"):
        np.testing.assert_array_equal(np.asarray(getattr(pal_cache.policy_state, field)),
                                      np.asarray(getattr(ref_cache.policy_state, field)))
    np.testing.assert_allclose(np.asarray(pal_cache.policy_state.centroids),
                               np.asarray(ref_cache.policy_state.centroids), atol=1e-5)
    np.testing.assert_allclose(pal, ref, atol=1e-5)


def test_mosaic_tpu_kernels_in_interpret_mode_match_the_reference_path(monkeypatch):
    """The same on a (pretended) TPU: kernels="auto" resolves to the Mosaic kernels, run here in Pallas's TPU
    interpreter, and gives the reference path's clusters, layout and logits."""
    import functools

    from clusterkv_jax import kernels
    from pallas_kernels import centroid_update_tpu, cluster_to_block_index_tpu, dispatch, selected_attention_tpu

    monkeypatch.setattr(dispatch, "on_tpu", lambda: True)
    monkeypatch.setattr(kernels, "centroid_update_tpu", functools.partial(centroid_update_tpu, interpret=True))
    monkeypatch.setattr(kernels, "cluster_to_block_index_tpu",
                        functools.partial(cluster_to_block_index_tpu, interpret=True))
    in_place = []
    monkeypatch.setattr(kernels, "selected_attention_tpu", lambda *a: in_place.append(1) or
                        selected_attention_tpu(*a, interpret=True))
    policy = ClusterKV(budget=40, kernels="auto", **SMALL)
    assert kernels.resolve(policy.kernels) == "tpu"
    tokens, lengths = TOKENS[:2], LENGTHS[:2]
    # The prompt attends in XLA's loop here: splash attention (a TPU's) has tests of its own (test_model.py), and
    # interpreted it doubled this test's time.
    with kernels.forced_prompt_attention("xla"):
        ref, ref_cache = run(ClusterKV(budget=40, kernels="reference", **SMALL), tokens, lengths, steps=18)
        tpu, tpu_cache = run(policy, tokens, lengths, steps=18)
    assert in_place, "the decode steps attend from the store with the Mosaic page-table kernel"
    for field in ("sizes", "block_start", "row_positions"):
        np.testing.assert_array_equal(np.asarray(getattr(tpu_cache.policy_state, field)),
                                      np.asarray(getattr(ref_cache.policy_state, field)))
    np.testing.assert_allclose(np.asarray(tpu_cache.policy_state.centroids),
                               np.asarray(ref_cache.policy_state.centroids), atol=1e-5)
    np.testing.assert_allclose(tpu, ref, atol=1e-5)


def test_kernel_switch_resolves_per_device():
    from clusterkv_jax.kernels import resolve

    assert resolve(ClusterKV(kernels="reference").kernels) == "reference"
    assert resolve(ClusterKV(kernels="interpret").kernels) == "interpret"
    platform = jax.devices()[0].platform
    assert resolve(ClusterKV(kernels="auto").kernels) == {"gpu": "pallas", "tpu": "tpu"}.get(platform, "reference")
    if platform not in ("gpu", "tpu"):
        with pytest.raises(RuntimeError):
            resolve(ClusterKV(kernels="pallas").kernels)
    with pytest.raises(ValueError):
        ClusterKV(kernels="triton")


@pytest.mark.parametrize("per_query_head", [True, False])
def test_selection_and_window_attention_matches_numpy(per_query_head):
    """One softmax over each head's selected rows and its KV head's window, read from a store, against a NumPy
    loop per head."""
    from clusterkv_jax.attention import selection_and_window_attention
    from clusterkv_jax.selection import Selection
    from clusterkv_jax.store import DeviceKV

    rng = np.random.default_rng(3)
    B, N, K, S, H, M, W = 2, 6, 2, 40, 8, 7, 5
    G = N // K
    q = rng.normal(size=(B, N, H)).astype(np.float32)
    keys, values = rng.normal(size=(2, B, K, S, H)).astype(np.float32)
    h = N if per_query_head else K
    idx = rng.integers(0, S, (B, h, M)).astype(np.int32)
    mask = rng.random((B, h, M)) < 0.7
    w_idx = rng.integers(0, S, (B, W)).astype(np.int32)
    w_mask = rng.random((B, W)) < 0.6
    w_mask[:, 0] = True  # every head attends at least one row
    view = DeviceKV(k=jnp.asarray(keys)[None], v=jnp.asarray(values)[None]).layer(jnp.int32(0))
    k_sel, v_sel, _, _ = view.read(Selection.of_rows(jnp.asarray(idx), jnp.asarray(mask)))
    k_win, v_win = view.window(jnp.asarray(w_idx))
    got = np.asarray(selection_and_window_attention(q, k_sel, v_sel, mask, k_win, v_win, w_mask))
    want = np.zeros((B, N, H), np.float32)
    for b in range(B):
        for n in range(N):
            kv, sel = n // G, (n if per_query_head else n // G)
            rows = [i for i, m in zip(idx[b, sel], mask[b, sel]) if m] + [i for i, m in zip(w_idx[b], w_mask[b]) if m]
            s = keys[b, kv, rows] @ q[b, n] / np.sqrt(H)
            p = np.exp(s - s.max())
            want[b, n] = (p / p.sum()) @ values[b, kv, rows]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_query_head, chunk, W, kernel", [
    (True, 4, 8, "interpret"), (False, 4, 8, "interpret"), (True, 8, 0, "interpret"), (False, 2, 4, "interpret"),
    (True, 4, 8, "tpu"), (False, 8, 8, "tpu")])
def test_attend_in_place_matches_numpy(per_query_head, chunk, W, kernel, monkeypatch):
    """The Pallas page-table attention (Triton kernel in interpret mode, or its Mosaic version in TPU interpret
    mode) over a layer of a multi-layer store: each head's selected chunks and the ring of rows [0, W), one
    softmax, against a NumPy loop per head."""
    import functools

    from clusterkv_jax import attend, kernels
    from clusterkv_jax.selection import Selection
    from clusterkv_jax.store import DeviceKV

    monkeypatch.setattr(kernels, "selected_attention_tpu",
                        functools.partial(kernels.selected_attention_tpu, interpret=True))

    rng = np.random.default_rng(chunk + W)
    L, B, N, K, S, H, n = 3, 2, 6, 2, 64, 16, 5
    G, layer = N // K, 1
    q = rng.normal(size=(B, N, H)).astype(np.float32)
    keys, values = rng.normal(size=(2, L, B, K, S, H)).astype(np.float32)
    h = N if per_query_head else K
    starts = rng.integers(W // chunk, S // chunk, (B, h, n)).astype(np.int32) * chunk
    mask = rng.random((B, h, n, chunk)) < 0.7
    mask[0, 0] = False  # a head whose selection is empty: only its window counts (or nothing: zeros)
    w_mask = rng.random((B, W)) < 0.6
    view = DeviceKV(k=jnp.asarray(keys), v=jnp.asarray(values)).layer(jnp.int32(layer))
    selection = Selection(starts=jnp.asarray(starts), mask=jnp.asarray(mask), chunk=chunk)
    assert attend.can_attend_in_place(view, selection, W)
    kernel = triton_mode() if kernel == "interpret" else kernel  # compiled on a CUDA GPU
    got = np.asarray(attend.attend_in_place(jnp.asarray(q), view, selection, W, jnp.asarray(w_mask) if W else None,
                                            kernel))
    want = _selected_attention_numpy(q, keys[layer], values[layer], starts, mask, w_mask, W, per_query_head)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not attend.can_attend_in_place(view, Selection(starts=selection.starts, mask=selection.mask[..., :1],
                                                          chunk=1), W)


def _selected_attention_numpy(q, keys, values, starts, mask, w_mask, W, per_query_head):
    """Each query head over its selected chunks (starts [B, h, n], mask [B, h, n, chunk]) and the ring rows [0, W)
    of its KV head where w_mask, one softmax, from one layer's keys and values [B, K, S, H]: a loop per head (zeros
    for a head that attends nothing)."""
    B, N, H = q.shape
    K, chunk = keys.shape[1], mask.shape[-1]
    G = N // K
    want = np.zeros((B, N, H), np.float32)
    for b in range(B):
        for i in range(N):
            kv, sel = i // G, (i if per_query_head else i // G)
            rows = [int(st_) + r for st_, m in zip(starts[b, sel], mask[b, sel]) for r in range(chunk) if m[r]]
            rows += [r for r in range(W) if w_mask[b, r]]
            if rows:
                s_ = keys[b, kv, rows] @ q[b, i] / np.sqrt(H)
                p = np.exp(s_ - s_.max())
                want[b, i] = (p / p.sum()) @ values[b, kv, rows]
    return want


@pytest.mark.parametrize("per_query_head, chunk, W, aligned, B", [
    (True, 4, 8, True, 2), (False, 4, 8, True, 3), (True, 8, 0, True, 2), (True, 1, 4, False, 2), (True, 4, 8, False, 1)])
def test_attend_tiled_matches_numpy(per_query_head, chunk, W, aligned, B, monkeypatch):
    """Reading and attending a tile of (sequence, KV head) pairs at a time (`attend.attend_tiled`, what a
    CPU runs when the selected rows outgrow its cache; tiles forced small here) from a layer of a multi-layer
    store, against the NumPy loop per head, and equal to the untiled read and attention."""
    from clusterkv_jax import attend
    from clusterkv_jax.attention import selection_and_window_attention
    from clusterkv_jax.selection import Selection
    from clusterkv_jax.store import DeviceKV

    rng = np.random.default_rng(chunk + W + B)
    L, N, K, S, H, n = 3, 6, 2, 64, 16, 5
    layer = 2
    q = rng.normal(size=(B, N, H)).astype(np.float32)
    keys, values = rng.normal(size=(2, L, B, K, S, H)).astype(np.float32)
    h = N if per_query_head else K
    starts = rng.integers(max(W, chunk) // chunk, S // chunk, (B, h, n)).astype(np.int32) * chunk
    if not aligned:
        starts = rng.integers(W, S - chunk + 1, (B, h, n)).astype(np.int32)
    mask = rng.random((B, h, n, chunk)) < 0.7
    mask[0, 0, :, 0] = True  # every head attends something
    w_mask = rng.random((B, W)) < 0.6
    view = DeviceKV(k=jnp.asarray(keys), v=jnp.asarray(values)).layer(jnp.int32(layer))
    selection = Selection(starts=jnp.asarray(starts), mask=jnp.asarray(mask), chunk=chunk, aligned=aligned)
    assert attend.tiles_for(view, selection) == 1, "rows this small stay in one piece"
    monkeypatch.setattr(attend, "GATHER_TILE_BYTES", 1)  # every (sequence, KV head) pair a tile of its own
    assert attend.tiles_for(view, selection) == B * K
    got = np.asarray(jax.jit(lambda q_, sel, wm: attend.attend_tiled(q_, view, sel, W, wm if W else None))(
        jnp.asarray(q), selection, jnp.asarray(w_mask)))
    want = _selected_attention_numpy(q, keys[layer], values[layer], starts, mask, w_mask, W, per_query_head)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    k_sel, v_sel, sel_mask, _ = view.read(selection)
    k_win, v_win = view.ring(W) if W else (None, None)
    untiled = selection_and_window_attention(jnp.asarray(q), k_sel, v_sel, sel_mask, k_win, v_win,
                                             jnp.asarray(w_mask) if W else None)
    np.testing.assert_allclose(got, np.asarray(untiled), rtol=1e-6, atol=1e-6)


@pytest.fixture
def fresh_traces():
    """Traces made inside the test (under monkeypatched module constants) are dropped before and after it."""
    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.mark.parametrize("gqa", ["per_head", "shared"])
def test_decode_attends_tiled_where_rows_outgrow_a_tile(gqa, monkeypatch, fresh_traces):
    """ClusterKV's decode step takes the tiled path when its selected rows outgrow two tiles (forced here with a
    tiny tile), and decodes exactly as the untiled path does (decode-time clustering included)."""
    from clusterkv_jax import attend

    policy = ClusterKV(budget=48, gqa=gqa, **SMALL)
    untiled, _ = run(policy, TOKENS, LENGTHS, steps=20)
    calls = []
    monkeypatch.setattr(attend, "GATHER_TILE_BYTES", 64)
    real = attend.attend_tiled
    monkeypatch.setattr(attend, "attend_tiled", lambda *a: calls.append(1) or real(*a))
    jax.clear_caches()  # trace again: the compiled steps above took the untiled path
    tiled, _ = run(policy, TOKENS, LENGTHS, steps=20)
    assert calls, "the tiled path ran"
    np.testing.assert_allclose(tiled, untiled, rtol=0, atol=2e-6)
    # Tiles are the CPU's: lowered for CUDA, the same step gathers every head's rows at once.
    cache = init_cache(CFG, policy, 3, 448, jnp.float32)
    step = decode_step.trace(PARAMS, jnp.zeros((3,), jnp.int32), cache, config=CFG, policy=policy)
    text = lambda platform: step.lower(lowering_platforms=(platform,)).as_text(debug_info=True)  # noqa: E731
    assert "attend_tiled" in text("cpu") and "attend_tiled" not in text("cuda")


@given(W=st.integers(1, 12), start=st.integers(0, 60), count=st.integers(0, 12), capacity=st.integers(1, 80))
@settings(max_examples=60, deadline=None)
def test_ring_window_mask_marks_the_slots_holding_the_window(W, start, count, capacity):
    """A ring slot r is in the window iff the last position written to it (the largest p < length with
    p % W == r, p inside the capacity) lies in [start, length): brute force over the writes."""
    from clusterkv_jax.policies.cluster_blocks import ring_window_mask

    count = min(count, W)  # the window never holds more than W tokens
    length = start + count
    last = {}
    for p in range(min(length, capacity)):
        last[p % W] = p
    want = np.array([r in last and last[r] >= start for r in range(W)])
    got = np.asarray(ring_window_mask(jnp.array([length]), jnp.array([start]), W, capacity))[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("policy", [FullKV(), ClusterKV(budget=64, **SMALL), ClusterKV(budget=64, offload=True, **SMALL),
                                    SnapKV(budget=512, window=300)],
                         ids=["full", "clusterkv", "clusterkv-offload", "snapkv"])
def test_chunked_prefill_equals_unchunked(policy):
    """Prefill in chunks of 512 tokens, each attending to the cache so far: the same logits (at every position),
    stored K/V and policy index as one pass over the 2,048-token prompts (ragged: 2,048 and 1,300). SnapKV's
    300 observed queries of the 1,300-token prompt come from two chunks."""
    tokens = np.random.default_rng(7).integers(0, CFG.vocab_size, (2, 2048))
    lengths = jnp.array([2048, 1300])

    def run_prefill(chunk):
        cache = init_cache(CFG, policy, 2, 2112, jnp.float32)
        return prefill(PARAMS, jnp.asarray(tokens), lengths, cache, config=CFG, policy=policy, all_logits=True,
                       chunk=chunk)

    (want, want_cache), (got, got_cache) = run_prefill(None), run_prefill(512)
    valid = np.arange(2048)[None, :] < np.asarray(lengths)[:, None]
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=2e-5)
    if isinstance(policy, SnapKV):  # the same tokens kept; top_k may order near-equal votes differently
        def as_sets(cache):
            def sort(g):
                if not g.selecting:
                    return g
                kept = jnp.sort(jnp.where(g.state.mask, g.state.idx, -1), axis=-1)
                return g.replace(state=g.state.replace(idx=kept, mask=kept >= 0))
            return cache.replace(groups=tuple(sort(g) for g in cache.groups))

        got_cache, want_cache = as_sets(got_cache), as_sets(want_cache)
    for a, b in zip(jax.tree_util.tree_leaves(got_cache), jax.tree_util.tree_leaves(want_cache)):
        if jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_generate_with_prefill_chunks_gives_the_same_tokens():
    model = Model(CFG, PARAMS, tokenizer=None)
    prompt = np.random.default_rng(8).integers(0, CFG.vocab_size, 1100).tolist()
    policy = ClusterKV(budget=64, **SMALL)
    whole = generate(model, prompt, 12, policy=policy, stop_at_eos=False, max_length=4096)
    chunked = generate(model, prompt, 12, policy=policy, stop_at_eos=False, max_length=4096, prefill_chunk=512)
    assert chunked.tokens == whole.tokens
    with pytest.raises(ValueError, match="multiple of 512"):
        generate(model, prompt, 4, policy=policy, max_length=4096, prefill_chunk=300)


@pytest.mark.parametrize("policy", [ClusterKV(budget=64, **SMALL), Quest(budget=64), SnapKV(budget=64),
                                    FullKVKeepingQueries(prompt_queries=16)],
                         ids=lambda p: p.name or "keeping-queries")
def test_a_gpus_loop_indexes_all_selecting_layers_in_one_loop(policy):
    """In a GPU's unrolled layer loop each selecting layer is a group of its own, and one loop over them indexes
    them all (`attend.indexed_in_one_loop`): a prefill, whole or chunked, stores their prompts in position order and
    indexes them after the layers (`index_prompt`), and a decode step indexes their windows in one loop
    (`index_windows`). The tokens of a generation that indexes two windows, and the policy states it ends with
    (the prompt's clusters or pages, then the windows'), per selecting layer, equal the scanned loop's, where each
    layer indexes inside the loop."""
    from clusterkv_jax import attend, kernels

    model = Model(CFG, PARAMS, tokenizer=None)
    ids = np.random.default_rng(8).integers(0, CFG.vocab_size, 1000).tolist()
    results = {}
    for loop in kernels.LAYER_LOOPS:
        with kernels.forced_layer_loop(loop):
            assert attend.indexed_in_one_loop(init_cache(CFG, policy, 1, 1024).groups) == (loop == "unrolled")
            for chunk in (None, 512):
                out = generate(model, ids, 40, policy=policy, stop_at_eos=False, max_length=4096,
                               prefill_chunk=chunk, return_cache=True)
                results[loop, chunk] = jax.tree.leaves(jax.tree.map(np.asarray, out.cache.policy_state)), out.tokens
    (want_state, want_tokens) = results["scanned", None]
    assert any(np.any(leaf) for leaf in want_state)
    for key, (state, tokens) in results.items():
        assert tokens == want_tokens, key
        for got, want in zip(state, want_state, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(key))


@pytest.mark.parametrize("make", [
    lambda: ClusterKV(budget=512.0), lambda: ClusterKV(tokens_per_cluster=1.5), lambda: ClusterKV(sinks=True),
    lambda: ClusterKV(kmeans_tol=float("nan")), lambda: ClusterKV(max_iters="11"),
])
def test_policy_fields_of_the_wrong_type_are_refused(make):
    """An int field given a float (or a bool, or a string) and a float field given NaN fail at construction with
    the field's name, not deep inside JAX."""
    with pytest.raises(TypeError, match=r"ClusterKV\.\w+ must be"):
        make()


def test_generate_refuses_nan_temperature_and_fractional_token_counts():
    from clusterkv_jax.policies import Quest, StreamingLLM

    model = Model(CFG, PARAMS, tokenizer=None)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, [1, 2, 3], 4, temperature=float("nan"))
    with pytest.raises(TypeError, match="max_new_tokens"):
        generate(model, [1, 2, 3], 2.5)
    with pytest.raises(TypeError, match=r"Quest\.budget"):
        Quest(budget=64.0)
    with pytest.raises(TypeError, match=r"StreamingLLM\.budget"):
        StreamingLLM(budget=64.5)


@pytest.mark.parametrize("gqa", ["per_head", "shared"])
def test_density_scores_equal_numpy(gqa):
    """After prefill and 20 steps (decode-time clusters included), each cluster's stored per-channel variance is
    NumPy's variance of its member keys (read back from the store layout), and the score of a random query is
    NumPy's q·μ/√H + ½ Σ q²σ²/H (queries summed over the KV head's heads for "shared")."""
    policy = ClusterKV(budget=64, score="density", gqa=gqa, **SMALL)
    _, cache = run(policy, TOKENS, LENGTHS, steps=20)
    H, K, G = CFG.head_dim, CFG.num_kv_heads, CFG.num_heads // CFG.num_kv_heads
    q = np.random.default_rng(1).normal(size=(3, CFG.num_heads, H)).astype(np.float32)
    for layer in range(2, 4):
        state = _layer_state(cache, layer)
        keys = _keys_by_position(cache, layer, state)
        got = np.asarray(cluster_scores(policy, state, jnp.asarray(q)))  # [B, K, g, C]
        for b in range(3):
            for h in range(K):
                members = _members(state, b, h)
                assert len(members) > (LENGTHS[b] - 4) // 8 - 1  # prompt clusters and decode-time ones
                qh = q[b, h * G:(h + 1) * G]
                if gqa == "shared":
                    q_dot, q_sq = qh.sum(0, keepdims=True), (qh * qh).sum(0, keepdims=True)
                else:
                    q_dot, q_sq = qh, qh * qh
                for c, positions in members.items():
                    member_keys = keys[b, h, sorted(positions)].astype(np.float64)
                    mu, var = member_keys.mean(0), member_keys.var(0)
                    np.testing.assert_allclose(np.asarray(state.centroids[b, h, c]), mu, atol=1e-5)
                    np.testing.assert_allclose(np.asarray(state.variances[b, h, c]), var, atol=1e-4)
                    want = q_dot @ mu / np.sqrt(H) + 0.5 * (q_sq @ var) / H
                    np.testing.assert_allclose(got[b, h, :, c], want, rtol=1e-4, atol=1e-4)
    assert _layer_state(run(ClusterKV(budget=64, **SMALL), TOKENS, LENGTHS, steps=0)[1], 2).variances.shape[-2] == 0


def _refined_selection_problem(**options):
    """(policy, cache, layer 3's state, its keys by position [B, K, S, H], queries [B, N, H], lengths) for a refined
    selection of 36 tokens past 4 sinks out of clusters of about 32 tokens in 8-row blocks."""
    small = dict(sinks=4, tokens_per_cluster=32, decode_interval=16, decode_clusters=2, block_size=8)
    policy = ClusterKV(budget=40, **small, **options)
    _, cache = run(policy, TOKENS, LENGTHS, steps=0)
    state = _layer_state(cache, 3)
    q = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (3, CFG.num_heads, CFG.head_dim)))
    return policy, cache, state, _keys_by_position(cache, 3, state), q, jnp.asarray(LENGTHS)


@pytest.mark.parametrize("gqa", ["per_head", "shared"])
def test_block_refine_selects_what_a_numpy_walk_selects(gqa):
    """block_refine=2: NumPy takes clusters by q·μ until twice the budget (the last trimmed to its first rows),
    scores each of their blocks by q·(mean of the keys the block holds), and takes blocks until the budget (the
    last trimmed): the same positions as the policy, sinks aside."""
    policy, cache, state, keys, q, lengths = _refined_selection_problem(block_refine=2, gqa=gqa)
    idx, mask = policy.selected_positions(state, jnp.asarray(q), None, lengths, lengths)
    idx, mask = np.asarray(idx), np.asarray(mask)
    G, bs, tokens = CFG.num_heads // CFG.num_kv_heads, 8, 36
    pos = np.asarray(state.row_positions)
    for b, L in enumerate(LENGTHS):
        for n in range(CFG.num_heads if gqa == "per_head" else CFG.num_kv_heads):  # the selection's heads
            h = n // G if gqa == "per_head" else n
            qn = q[b, h * G:(h + 1) * G].sum(0) if gqa == "shared" else q[b, n]
            sizes, starts = np.asarray(state.sizes[b, h]), np.asarray(state.block_start[b, h])
            cent = np.asarray(state.centroids[b, h])
            clusters = sorted(np.flatnonzero(sizes), key=lambda c: (-float(qn @ cent[c]), c))
            candidates, left = [], 2 * tokens  # (block, rows taken) in stage-1 order
            for c in clusters:
                take = min(int(sizes[c]), left)
                for j in range(-(-take // bs)):
                    candidates.append((int(starts[c]) + j, min(bs, take - j * bs)))
                left -= take
                if left == 0:
                    break

            def block_score(block):
                held = [p for p in pos[b, h, block * bs:(block + 1) * bs] if p >= 0]
                return float(qn @ keys[b, h, held].mean(0))

            order = sorted(range(len(candidates)), key=lambda i: (-block_score(candidates[i][0]), i))
            want, left = set(), tokens
            for i in order:
                block, rows = candidates[i]
                take = min(rows, left)
                want |= {int(p) for p in pos[b, h, block * bs:block * bs + take]}
                left -= take
                if left == 0:
                    break
            chosen = set(idx[b, n][mask[b, n]].tolist()) - set(range(4))
            assert chosen == want, (b, n)
            assert len(chosen) == min(tokens, L - 4)


@pytest.mark.parametrize("gqa", ["per_head", "shared"])
def test_token_refine_selects_what_a_numpy_walk_selects(gqa):
    """token_refine=2: NumPy ranks a KV head's clusters by the best of its query heads' q·μ (gqa "shared": by
    their summed q·μ), takes them until twice the budget (the last trimmed to its first rows), and keeps each query
    head's best tokens of those by q·k (the summed queries' for gqa "shared"): the same positions as the policy,
    sinks aside, whether the keys are read from the store's rows (the decode step) or by position (the recall
    evaluation)."""
    policy, cache, state, keys, q, lengths = _refined_selection_problem(token_refine=2, gqa=gqa)
    idx, mask = policy.selected_positions(state, jnp.asarray(q), jnp.asarray(keys), lengths, lengths)
    idx, mask = np.asarray(idx), np.asarray(mask)
    group, i = cache.group_of(3)
    view = group.store.layer(jnp.int32(i), cache.capacity)
    in_step = policy.select(state, jnp.asarray(q), view.key_blocks, lengths, lengths)
    step_idx = np.asarray(policy.layout.positions(state, in_step))
    step_mask = np.asarray(in_step.flat_mask())
    G, bs, tokens = CFG.num_heads // CFG.num_kv_heads, 8, 36
    pos = np.asarray(state.row_positions)
    for b, L in enumerate(LENGTHS):
        for n in range(CFG.num_heads if gqa == "per_head" else CFG.num_kv_heads):  # the selection's heads
            h = n // G if gqa == "per_head" else n
            summed = q[b, h * G:(h + 1) * G].sum(0)
            qn = summed if gqa == "shared" else q[b, n]
            sizes, starts = np.asarray(state.sizes[b, h]), np.asarray(state.block_start[b, h])
            cent = np.asarray(state.centroids[b, h])
            group = q[b, h * G:(h + 1) * G]

            def rank_score(c):
                return float(summed @ cent[c]) if gqa == "shared" else max(float(g @ cent[c]) for g in group)

            clusters = sorted(np.flatnonzero(sizes), key=lambda c: (-rank_score(c), c))
            candidates, left = [], 2 * tokens
            for c in clusters:
                take = min(int(sizes[c]), left)
                candidates += [int(p) for p in pos[b, h, starts[c] * bs:starts[c] * bs + take]]
                left -= take
                if left == 0:
                    break
            best = sorted(candidates, key=lambda p: -float(qn.astype(np.float64) @ keys[b, h, p]))[:tokens]
            chosen = set(idx[b, n][mask[b, n]].tolist()) - set(range(4))
            assert chosen == set(best), (b, n)
            assert len(chosen) == min(tokens, L - 4)
            assert set(step_idx[b, n][step_mask[b, n]].tolist()) - set(range(4)) == chosen


def test_refining_by_tokens_and_by_blocks_at_once_is_refused():
    with pytest.raises(ValueError, match="not both"):
        ClusterKV(token_refine=2, block_refine=2)
