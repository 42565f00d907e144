"""The recall probe: exact-oracle and full-budget sanity, ordering of policies, and the CLI end to end."""

from __future__ import annotations

import json

import jax
import numpy as np

from clusterkv_jax.config import ModelConfig
from clusterkv_jax.eval.recall import format_table, run_recall
from clusterkv_jax.loading import Model
from clusterkv_jax.model import init_params

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=16)


def _model():
    return Model(CFG, init_params(CFG, jax.random.PRNGKey(0)), tokenizer=None)


def test_oracle_is_exact_and_full_budget_recalls_everything():
    ids = np.random.default_rng(0).integers(0, 128, 400).tolist()
    res = run_recall(_model(), ids, context=300, steps=3, budgets=[32, 512],
                     policy_names=["clusterkv", "quest", "streaming", "oracle"],
                     policy_options={"clusterkv": dict(tokens_per_cluster=8, sinks=4)}, progress=False)
    for name in ("clusterkv", "quest", "streaming", "oracle"):
        assert abs(res["token_recall"][name]["512"] - 1.0) < 1e-6, name
        assert abs(res["mass_recall"][name]["512"] - 1.0) < 1e-5, name
        assert res["mass_recall"][name]["32"] <= res["mass_recall"]["oracle"]["32"] + 1e-6
    assert abs(res["token_recall"]["oracle"]["32"] - 1.0) < 1e-6
    assert 0 < res["token_recall"]["streaming"]["32"] < 1
    assert "clusterkv" in format_table(res)


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
