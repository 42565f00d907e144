"""Multi-device sharding (clusterkv_jax.sharding): sharded generation against the unsharded run and against
each prompt alone, the shardings arrays end up with, the collectives in the compiled program, the fallback
for heads that do not divide the mesh, and mesh specs that are refused.

The sharded runs need 4 devices, which on CPU means XLA_FLAGS set before JAX starts; this process already
has JAX running on one device, so they run once in a subprocess (tests/sharding_check.py, ~2 min) whose
JSON report the tests below check.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from clusterkv_jax import sharding as sh
from tests.conftest import MOST_OPTIMIZATIONS_OFF_ENV

# Slow (not in make test-fast): the sharded runs are a process of their own.
pytestmark = pytest.mark.slow

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharding") / "report.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", **MOST_OPTIMIZATIONS_OFF_ENV,
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip())
    proc = subprocess.run([sys.executable, "-m", "tests.sharding_check", str(out)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"sharding_check failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    with open(out) as f:
        res = json.load(f)
    assert res["devices"] == 4
    return res


@pytest.mark.parametrize("policy", ["full", "full_offload", "clusterkv", "clusterkv_offload", "clusterkv_kernels",
                                    "snapkv", "infinigen", "model_dim_last"])
def test_sharded_generation_equals_unsharded(report, policy):
    """clusterkv_kernels: the Pallas kernels (interpret mode) run per shard under shard_map. model_dim_last:
    ClusterKV from q/k/v stored as a TPU stores them (`model.move_model_dim_last`)."""
    got = report["tokens"][policy]
    assert len(got["plain"]) == 8 and all(len(t) == 16 for t in got["plain"])
    assert got["sharded"] == got["plain"]


def test_a_shared_prefill_on_the_mesh_gives_each_policy_its_unsharded_tokens(report):
    """`prefill_prompts(..., mesh=, prompt_queries=8)` once, then ClusterKV on the device and offloaded from it,
    SnapKV and InfiniGen (handed the kept queries): the ragged batch's tokens of each policy's own unsharded
    prefill."""
    got = report["tokens"]["prefilled"]
    assert got["sharded"] == got["plain"]


def test_clusterkv_selection_really_drops_tokens(report):
    """Otherwise the ClusterKV comparisons above would only re-test full attention; the kernels decode as the
    pure-JAX path does."""
    assert report["tokens"]["clusterkv"]["plain"] != report["tokens"]["full"]["plain"]
    assert report["tokens"]["clusterkv_kernels"]["plain"] == report["tokens"]["clusterkv"]["plain"]


def test_ragged_batch_equals_each_prompt_alone(report):
    """The batch of 8 prompts of 20..64 tokens (ClusterKV, offload on), generated together, equals each
    generated alone; alone on the mesh, the batch of 1 is padded to data=2."""
    batch = report["tokens"]["clusterkv_offload"]
    alone = report["tokens"]["alone"]
    assert alone["plain"] == batch["plain"]
    assert alone["sharded"] == batch["plain"]
    assert batch["sharded"] == batch["plain"]


def test_own_loop_with_sharded_cache_matches_generate(report):
    """shard_params + init_cache_sharded + prefill / decode_step(sharding=...) (the benchmark path), greedy,
    gives generate's unsharded tokens."""
    got = report["tokens"]["steps_loop"]
    assert got["sharded"] == got["plain"]


def test_arrays_have_the_intended_shardings(report):
    bad = {k: v for k, v in report["shardings"].items() if not v["ok"]}
    assert not bad
    assert {"cache.k", "cache.host_k", "clusterkv.centroids", "offload.cache_ids", "params.q", "params.down",
            "params.per_layer.q", "decode_step.host_k"} <= set(report["shardings"])
    assert report["params_reused"], "a second generate() on the same mesh placed the parameters again"
    assert report["per_layer_values_equal"], "per-layer parameters placed on the mesh differ from the stacked ones"
    assert report["fused_values_equal"], "fused parameters placed on the mesh differ from the separate ones"
    assert report["fused_placed_as_sharded"], "fusing sharded parameters did not keep their split"
    assert report["moved_values_equal"], "q/k/v with the model dim last differ from the separate ones"
    assert report["moved_placed_as_sharded"], "moving sharded q/k/v's model dim last did not keep their split"


def test_compiled_program_has_no_gather_of_kv(report):
    """Only the Megatron all-reduces (attention output and MLP down projections, activation-sized) and
    scalar loop conditions / bucket choices cross devices: no all-gather, all-to-all or permute at all."""
    s = report["sizes"]
    activation = s["B"] * s["T"] * s["D"]
    for name, ops in report["collectives"].items():
        assert ops, f"{name}: no collectives at all, so nothing was sharded"
        for op in ops:
            kind, shape, where = op.split("|", 2)
            assert kind == "all-reduce", f"{name}: {op}"
            for dims in re.findall(r"\w+\[([\d,]*)\]", shape):  # a tuple when XLA combined several
                size = int(np.prod([int(d) for d in dims.split(",")])) if dims else 1
                assert size == 1 or (where.endswith("dot_general") and size <= activation), f"{name}: {op}"


def test_sharded_clusterkv_keeps_its_kernels_per_shard(report):
    """Lowered for CUDA, the sharded ClusterKV program holds the Pallas kernels as Triton calls inside
    shard_map regions (K-means centroid sums at prefill and decode, cluster -> token indexing)."""
    got = report["cuda_lowering"]
    assert got["triton_calls"] >= 3 and got["manual_regions"] >= got["triton_calls"]


@pytest.mark.parametrize("policy", ["full", "clusterkv_offload"])
def test_heads_not_dividing_model_axis_fall_back_to_replicated(report, policy):
    """6 query / 3 KV heads on model=2: attention and KV replicated over "model", the MLP still split, the
    batch of 3 padded to 4 for data=2; tokens as without a mesh."""
    got = report["fallback"][policy]
    assert got["sharded"] == got["plain"]
    assert len(got["sharded"]) == 3 and got["cache_batch"] == 4
    bad = {k: v for k, v in got.items() if isinstance(v, dict) and not v["ok"]}
    assert not bad


def test_the_mesh_memory_check_counts_what_placing_holds(report):
    """`--mesh`'s memory check on CPU (sharding.held_param_bytes) counts the bytes the placed parameters hold on
    the devices, also where the heads do not divide "model" and are copied to each of its devices (`--mesh
    model=64` once filled 15 GB unchecked: only the "data" copies were counted)."""
    for name, got in report["held_param_bytes"].items():
        assert got["counted"] == got["placed"], name
    copies = {name: got["placed"] / got["whole"] for name, got in report["held_param_bytes"].items()}
    assert copies["heads_copied"] > copies["split"], copies


# --------------------------------------------------------------------------------------------------
# Mesh specs (this process: one device)
# --------------------------------------------------------------------------------------------------


def test_parse_mesh():
    assert sh.parse_mesh("data=2,model=2") == {"data": 2, "model": 2}
    assert sh.parse_mesh(" model=4 ") == {"data": 1, "model": 4}
    assert sh.parse_mesh({"data": 3}) == {"data": 3, "model": 1}


@pytest.mark.parametrize("spec,match", [
    ("data=2,batch=2", "unknown axis 'batch'"),
    ("data=two", "must be an integer"),
    ("data=0", "must be an integer >= 1"),
    ("data=2,data=2", "given twice"),
    ("data2", "not AXIS=SIZE"),
    ("", "must look like"),
    ({"model": 1.5}, "must be an integer"),
])
def test_bad_mesh_spec_is_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        sh.make_mesh(spec)


def test_mesh_needing_more_devices_than_exist_is_refused():
    import jax

    n = len(jax.devices())
    with pytest.raises(ValueError, match=rf"needs data\*model = {4 * n} devices, but {n}.*xla_force_host_platform"):
        sh.make_mesh(f"data=2,model={2 * n}")
    mesh = sh.make_mesh(f"data={n}")
    assert dict(mesh.shape) == {"data": n, "model": 1}


def test_cli_generate_accepts_mesh():
    from clusterkv_jax.cli import build_parser

    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "hi", "--mesh", "data=2,model=2"])
    assert args.mesh == "data=2,model=2"
