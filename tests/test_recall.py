"""The recall probe: exact-oracle and full-budget sanity, ordering of policies, and the CLI end to end."""

from __future__ import annotations

import dataclasses
import json

import flax.struct
import jax
import jax.numpy as jnp
import pytest
import numpy as np

import clusterkv_jax as ckv
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.eval.recall import format_table, run_recall
from clusterkv_jax.loading import Model
from clusterkv_jax.model import init_params
from clusterkv_jax.policies.cluster_index import ClusterIndex

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=16)


def _model():
    return Model(CFG, init_params(CFG, jax.random.PRNGKey(0)), tokenizer=None)


def test_oracle_is_exact_and_full_budget_recalls_everything():
    ids = np.random.default_rng(0).integers(0, 128, 400).tolist()
    res = run_recall(_model(), ids, context=300, steps=3, budgets=[32, 512],
                     policy_names=["clusterkv", "quest", "streaming", "snapkv", "infinigen", "oracle"],
                     policy_options={"clusterkv": dict(tokens_per_cluster=8, sinks=4), "snapkv": dict(window=16)},
                     progress=False)
    for name in ("clusterkv", "quest", "streaming", "snapkv", "infinigen", "oracle"):
        assert abs(res["token_recall"][name]["512"] - 1.0) < 1e-6, name
        assert abs(res["mass_recall"][name]["512"] - 1.0) < 1e-5, name
        assert res["mass_recall"][name]["32"] <= res["mass_recall"]["oracle"]["32"] + 1e-6
    assert abs(res["token_recall"]["oracle"]["32"] - 1.0) < 1e-6
    assert 0 < res["token_recall"]["streaming"]["32"] < 1
    assert "clusterkv" in format_table(res)


def test_probe_hands_wrapped_policies_their_observation_windows():
    """Each wrapped policy gets the last `prompt_queries` of the probe's (largest) window: its state after the
    probe's prefill equals its state after its own prefill."""
    import jax.numpy as jnp

    from clusterkv_jax.cache import init_cache
    from clusterkv_jax.eval.recall import RecallProbe
    from clusterkv_jax.steps import prefill
    from clusterkv_jax.policies import InfiniGen, SnapKV

    model = _model()
    inner = (SnapKV(budget=32, window=8), InfiniGen(budget=32, sample=24))
    probe = RecallProbe(policies=inner, budgets=(32, 32))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 128, (2, 128)), jnp.int32)
    lengths = jnp.array([128, 90], jnp.int32)

    def state_after_prefill(policy):
        cache = init_cache(CFG, policy, 2, 160, jnp.float32)
        return prefill(model.params, tokens, lengths, cache, config=CFG, policy=policy)[1].policy_state

    probed = state_after_prefill(probe).inner
    for policy, got in zip(inner, probed):
        want = state_after_prefill(policy)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_eval_recall_cli_on_smollm2(smollm2_converted_dir, tmp_path, capsys):
    from clusterkv_jax.cli import main
    from tests.helpers import long_text

    text = tmp_path / "text.txt"
    text.write_text(long_text()[:40_000])
    out = tmp_path / "recall.json"
    rc = main(["eval", "recall", "--model", smollm2_converted_dir, "--text", str(text), "--context", "1000",
               "--steps", "2", "--budgets", "128,256", "--policies", "clusterkv,streaming,oracle",
               "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["token_recall"]) == {"clusterkv", "streaming", "oracle"}
    assert res["token_recall"]["oracle"]["256"] > 0.999
    # On real text, semantic clusters keep more attention mass than a recency window.
    assert res["mass_recall"]["clusterkv"]["256"] > res["mass_recall"]["streaming"]["256"]
    assert "| clusterkv |" in capsys.readouterr().out


def test_probe_scores_the_selection_made_after_indexing_due_tokens():
    """At the step decode-time clustering is due (the first with W generated tokens stored before it), the probe
    scores what the policy would attend: the selection made after the new clusters exist (they can displace prompt
    clusters), not before."""
    import jax.numpy as jnp

    from clusterkv_jax.attend import index_window
    from clusterkv_jax.eval.recall import RecallProbe
    from clusterkv_jax.policies import ClusterKV
    from clusterkv_jax.store import DeviceKV

    B, K, N, H, S, P0, W = 1, 2, 4, 16, 128, 80, 16
    policy = ClusterKV(budget=24, sinks=4, tokens_per_cluster=8, decode_interval=W, decode_clusters=2)
    probe = RecallProbe(policies=(policy,), budgets=(24,))
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, N, H)), jnp.float32)
    keys = rng.normal(size=(B, K, S, H)).astype(np.float32)
    # The W generated tokens point along each KV head's queries: once clustered they outrank every prompt cluster.
    keys[:, :, P0:P0 + W] = 3.0 * np.asarray(q).reshape(B, K, 2, H).sum(2)[:, :, None, :] + 0.1 * keys[:, :, P0:P0 + W]
    keys[:, :, P0 + W:] = 0.0
    prompt, lengths = jnp.array([P0], jnp.int32), jnp.array([P0 + W + 1], jnp.int32)  # this step's token included
    cfg = ModelConfig(vocab_size=8, hidden_size=N * H, intermediate_size=8, num_layers=3, num_heads=N,
                      num_kv_heads=K, head_dim=H)
    state = jax.tree.map(lambda x: x[0], probe.init_states(cfg, B, S, range(2, 3)))
    prompt_keys = jnp.where(jnp.arange(S)[None, None, :, None] < P0, keys, 0.0)
    state = probe.after_prefill(state, prompt_keys, prompt)
    kv = DeviceKV(k=jnp.asarray(keys)[None], v=jnp.asarray(keys)[None]).layer(jnp.int32(0))
    after = probe.observe_decode(state, q, kv, lengths, prompt)

    def token_recall(inner):
        idx, mask = policy.selected_positions(inner, q, None, lengths, prompt)
        scores = np.einsum("bkgh,bksh->bkgs", np.asarray(q).reshape(B, K, 2, H), keys).reshape(B, N, S)[:, :, :P0]
        top = np.argsort(-scores, axis=-1)[:, :, :24]
        idx, mask = np.asarray(idx), np.asarray(mask)
        return np.mean([len(set(top[0, n]) & set(idx[0, n][mask[0, n]].tolist())) / 24 for n in range(N)])

    indexed = index_window(policy, state.inner[0], kv, lengths - 1, prompt, rows_of=lambda x: x)  # a position store
    assert int(indexed.clustered_upto[0]) == P0 + W  # the generated tokens were clustered at this step
    now, late = token_recall(indexed), token_recall(state.inner[0])
    assert now < late, "the due clusters displace prompt clusters at this step"
    assert float(after.token_recall[0]) == pytest.approx(now, abs=1e-6)


@flax.struct.dataclass
class _CountedIndex(ClusterIndex):
    observed: jax.Array  # [B] decode steps this layer's probe saw


@dataclasses.dataclass(frozen=True)
class _CountingClusterKV(ckv.ClusterKV, ckv.DecodeProbe):
    """ClusterKV that counts, in its index, the decode steps it observed."""

    def init_state(self, config, batch_size, capacity):
        index = super().init_state(config, batch_size, capacity)
        return _CountedIndex(**{f.name: getattr(index, f.name) for f in dataclasses.fields(index)},
                             observed=jnp.zeros((batch_size,), jnp.int32))

    def observe_decode(self, state, q, view, lengths, prompt_lengths):
        return state.replace(observed=state.observed + 1)


def test_a_decode_probes_state_is_kept_after_every_step():
    """A decode step writes no layer's state back (windows are indexed between steps), except a probe's, which
    changes every step: a ClusterKV that is a `DecodeProbe` (the notebook's record of its selections) must count
    every decode step of every selecting layer, one per generated token after the first."""
    policy = _CountingClusterKV(budget=32, sinks=4, tokens_per_cluster=8, full_layers=1)
    prompts = [np.random.default_rng(3).integers(0, 128, n).tolist() for n in (90, 70)]
    result = ckv.generate(_model(), prompts, max_new_tokens=7, policy=policy, stop_at_eos=False, return_cache=True)
    counts = np.asarray(result.cache.policy_state.observed)  # [selecting layers, B]
    assert counts.shape == (CFG.num_layers - 1, 2)
    steps = [len(t) - 1 for t in result.tokens]
    assert steps == [6, 6]
    np.testing.assert_array_equal(counts, np.broadcast_to(steps, counts.shape))
