"""Deviceless ahead-of-time compilation for an H100 and a TPU v5e (`clusterkv_jax.aot`).

The compile tests are opt-in: they need jax's CUDA plugin and ptxas, or libtpu, which the project environment
does not install (`make aot-cuda` / `make aot-tpu` install them into a venv of their own and run this file with
CLUSTERKV_AOT_REQUIRED=cuda / tpu, which turns that platform's skip into a failure). `abstract`, which they
build on, and the CLI's error without a plugin are tested everywhere.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clusterkv_jax import aot
from clusterkv_jax.cache import init_cache
from clusterkv_jax.config import synthetic_config
from clusterkv_jax.steps import cache_capacity
from clusterkv_jax.policies import ClusterKV, FullKV, Quest

# What these compile for an H100 or a TPU v5e is what users get: XLA's optimizations on (tests/conftest.py).
pytestmark = pytest.mark.optimized

CONFIG = synthetic_config("llama3-8b", layers=4)  # 2 full layers + 2 selecting layers (a loop over them)
CONTEXT, BATCH = 2048, 2


def _memory_kinds(tree):
    return [(jax.tree_util.keystr(path), leaf.shape, leaf.dtype, leaf.sharding.memory_kind)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


@pytest.mark.parametrize("policy", [ClusterKV(budget=256, offload=True), Quest(budget=256, offload=True),
                                    ClusterKV(budget=256)], ids=["clusterkv-offloaded", "quest-offloaded", "clusterkv"])
def test_abstract_cache_has_the_shapes_and_memory_kinds_of_the_real_one(policy):
    config = synthetic_config("smollm2-135m", layers=4)
    real = init_cache(config, policy, 2, 700, jnp.float32)
    structs = aot.abstract(init_cache, config, policy, 2, 700, jnp.float32)
    assert jax.tree.structure(structs) == jax.tree.structure(real)
    assert _memory_kinds(structs) == _memory_kinds(real)
    assert any(kind == "pinned_host" for *_, kind in _memory_kinds(real)) == policy.offload


def test_cli_without_the_cuda_plugin_says_what_to_install(monkeypatch, capsys):
    def missing():
        raise RuntimeError(aot.INSTALL_HINT.format(v=jax.__version__))

    monkeypatch.setattr(aot, "cuda_target", missing)
    assert aot.main([]) == 2
    err = capsys.readouterr().err
    assert f"jax-cuda12-plugin=={jax.__version__}" in err and "make aot-cuda" in err


@pytest.fixture(scope="module", params=["cuda", "tpu"])
def target(request):
    """A compile-only H100 (platform cuda) or TPU v5e core (platform tpu), where its compiler is installed."""
    try:
        return aot.cuda_target() if request.param == "cuda" else aot.tpu_target()
    except RuntimeError as e:
        if os.environ.get("CLUSTERKV_AOT_REQUIRED") == request.param:
            raise
        pytest.skip(f"opt-in (make aot-{request.param}): {str(e)[:200]}")


def _named(kernels, device):
    """Kernel function names as they appear on `device`: the Mosaic versions are the `*_tpu` ones."""
    return tuple(k + "_tpu" for k in kernels) if device.platform == "tpu" else tuple(kernels)


def _compile(policy, device, prefill=False, context=CONTEXT, index=False):
    return {r.name.split()[0]: r for r in aot.model_programs(CONFIG, {"p": policy}, device=device, batch=BATCH,
                                                              context=context, prefill=("p",) if prefill else (),
                                                              index=("p",) if index else ())}


def _host_bytes(policy, context=CONTEXT):
    """Bytes of the cache arrays that the real cache, built on this CPU, keeps in pinned_host memory."""
    cache = init_cache(CONFIG, policy, BATCH, cache_capacity(context, 64), jnp.bfloat16)
    return sum(leaf.nbytes for leaf in jax.tree.leaves(cache) if leaf.sharding.memory_kind == "pinned_host")


def test_targets_are_an_sm90_gpu_and_a_v5e(target):
    if target.platform == "gpu":
        assert float(target.compute_capability) == 9.0 and "H100" in target.device_kind
    else:
        assert target.platform == "tpu" and target.device_kind == "TPU v5 lite"


#: What kernels="auto" keeps in a ClusterKV decode step on sm90: the block indexing only (on an H200 XLA's segment sum
#: and gathered attention beat the centroid-update and page-table attention kernels, docs/research_log.md).
AUTO_ON_SM90 = ("cluster_to_block_index",)
#: The full layers' decode attention with kernels="pallas": JAX's flash-decoding kernel (its function, `mqa`) on sm90;
#: on a TPU XLA's form.
DECODE_ATTENTION = {"gpu": ("mqa",), "tpu": ()}


#: The fused attention a prompt runs through (`kernels.prompt_attention`): cuDNN's on sm90, splash on a TPU.
PROMPT_KERNEL = {"gpu": "cudnn_fmha", "tpu": "splash_mqa_fwd_no_residuals"}


def test_prefill_attends_through_the_platforms_flash_kernel(target):
    """An 8k-token prefill's attention runs in the platform's fused kernel (cuDNN's flash attention on sm90, JAX's
    Pallas splash attention on a TPU) and holds no [T, T] score matrix: its device temporaries are below one
    eighth of the [N, T, T] float32 scores of one layer (XLA's own `dot_product_attention` held 12 GB at 8k). On
    sm90 they are below those of the same program with the prompt attending in XLA's ops (the flash loop of
    `attention.causal_attention`), which held 2.4 times as much at 32k (docs/research_log.md)."""
    from clusterkv_jax import kernels

    context = 8192
    program = aot.model_programs(CONFIG, {"p": FullKV()}, device=target, batch=1, context=context,
                                 prefill=("p",))[1]
    assert program.name == "prefill p" and PROMPT_KERNEL[target.platform] in program.kernels
    assert program.device_temp_bytes < CONFIG.num_heads * context ** 2 * 4 / 8, program.device_temp_bytes
    if target.platform == "gpu":
        with kernels.forced_prompt_attention("xla"):
            in_xla = aot.model_programs(CONFIG, {"p": FullKV()}, device=target, batch=1, context=context,
                                        prefill=("p",))[1]
        assert in_xla.kernels == () and program.device_temp_bytes < in_xla.device_temp_bytes


def _no_store_copy(program, policy, device):
    """No copy of the selecting layers' whole store in a decode step (a `lax.cond` returning the store made XLA:GPU
    copy it on every layer of every step)."""
    store = aot.target_cache(CONFIG, policy, device=device, batch=BATCH, context=CONTEXT).groups[-1].store.k
    shape = f"{jnp.dtype(store.dtype).name.replace('bfloat16', 'bf16')}[{','.join(map(str, store.shape))}]"
    assert shape in program.hlo
    assert not re.search(re.escape(shape) + r"\{[^}]*\} copy\(", program.hlo)


def test_quest_reads_its_pages_in_place(target):
    """Quest's pages start anywhere, so they are not read as blocks of the store. A gather of 16-row slices from
    any start made XLA:TPU lay both selecting layers' keys and values out anew, every step (138 MB of a decode
    step's temporaries at 32k, 4 layers); its pages are now read an index per row there
    (`kernels.chunks_read_row_by_row`), in place (2 MB)."""
    policy = Quest(budget=256)
    _no_store_copy(_compile(policy, target)["decode"], policy, target)


@pytest.mark.parametrize("policy", [FullKV(), ClusterKV(budget=256)], ids=["full", "clusterkv"])
def test_decode_reads_every_weight_in_place(target, policy):
    """No decode step holds a copy of a layer's weights. Under a `lax.scan` over the stacked weights XLA:GPU copied
    each layer's out of the stack before its matrix products (352 MB of device temporaries at the aot geometry, and
    on an H200 the weights read about 2.6 times a step); on a GPU the layers now run unrolled over per-layer arrays
    (`kernels.layer_loop`, `model.unstack_layers`); a static slice of the stack still had the output projection
    copied (33.6 MB). At a 1k context, batch 1, a step's whole scratch is now smaller than one layer's q projection
    (33.5 MB). Nor does a GPU's step write a weight-sized product: XLA:GPU turned the k and v projections,
    vector-matrix products of 8.4 MB weights, into products it wrote out and reread (16.8 MB of full KV's
    scratch); on a GPU they are one fused q/k/v product (`model.fuse_layer`), and full KV's scratch is under one
    layer's k projection (0.2 MB on sm90; docs/research_log.md)."""
    program = aot.model_programs(CONFIG, {"p": policy}, device=target, batch=1, context=1024)[0]
    q_projection = CONFIG.hidden_size * CONFIG.num_heads * CONFIG.head_dim * 2  # bfloat16
    assert program.device_temp_bytes < q_projection, (program.device_temp_bytes, q_projection)
    if isinstance(policy, FullKV):
        k_projection = CONFIG.hidden_size * CONFIG.num_kv_heads * CONFIG.head_dim * 2
        assert program.device_temp_bytes < k_projection, (program.device_temp_bytes, k_projection)


def test_a_scanned_prefill_reads_the_mlp_weights_in_place(target):
    """A prompt longer than `model.MLP_CHUNK` runs the MLP block in a loop over chunks of tokens. Under a scanned
    layer loop (a TPU's, `kernels.layer_loop`) the layer's weights were a dynamic slice of the stack that the chunk
    loop read, so XLA copied them out of the stack to be its operands: 471 MB of an 8k prefill's temporaries on a
    v5e, and 2,201 MB of the offloaded ClusterKV prefill's at 32k where now 1,849. Each iteration now slices the
    stack at an index it cannot hoist (docs/research_log.md): no loop carries a layer's MLP weight, and the
    temporaries are below one layer's MLP weights (352 MB; 269 MB here)."""
    if target.platform != "tpu":
        pytest.skip("a GPU unrolls its layers over per-layer arrays (kernels.layer_loop): nothing is sliced")
    from clusterkv_jax import model

    context = 8192
    assert context > model.MLP_CHUNK
    program = aot.model_programs(CONFIG, {"p": FullKV()}, device=target, batch=1, context=context,
                                 prefill=("p",))[1]
    D, F = CONFIG.hidden_size, CONFIG.intermediate_size
    loops = [line.split(" while(")[0] for line in program.hlo.splitlines() if re.search(r"\) while\(", line)]
    assert loops, "the prefill has no loop to check"
    assert not [loop for loop in loops if f"bf16[{D},{F}]{{" in loop or f"bf16[{F},{D}]{{" in loop]
    mlp_weights = 3 * D * F * 2  # bfloat16
    assert program.device_temp_bytes < mlp_weights, (program.device_temp_bytes, mlp_weights)


def _top_level(hlo: str, op: str) -> int:
    """How many `op` instructions (conditional, while) the entry computation runs on every call."""
    entry = re.search(r"\nENTRY [^\n]*\{\n(.*?)\n\}", hlo, re.S).group(1)
    return len(re.findall(rf"\) {op}\(|\] {op}\(|\}} {op}\(", entry))


@pytest.mark.parametrize("policy", [FullKV(), ClusterKV(budget=256), Quest(budget=256),
                                    ClusterKV(budget=256, offload=True)],
                         ids=["full", "clusterkv", "quest", "clusterkv-offloaded"])
def test_a_gpu_decode_step_never_waits_for_the_host(target, policy):
    """XLA:GPU runs a conditional by copying its predicate to the host and waiting for it (`ConditionalThunk`; a
    while loop likewise, each iteration), so each drains the device's queue before the next kernels are launched.
    On sm90 the decode step `generate`'s loop runs holds no conditional and no while loop: the windows' indexing
    runs between runs of steps (`attend.steps_until_due`), once per window. With two conditionals per selecting
    layer (indexing, and whether the selection held every token) and a third for ranking, ClusterKV@1024 stepped in
    19.1 ms against full KV's 12.5 on an H200 at 32k (docs/research_log.md); one branch for every layer's
    indexing, with its writes outside it, was the step until then. An offloaded store's host reads and writes are
    loops over what misses (`offload`), not bounded here. On a TPU branches are decided on the device: not bounded
    there."""
    if target.platform != "gpu":
        pytest.skip("a TPU decides its branches on the device")
    program = _compile(policy, target)["decode"]
    assert _top_level(program.hlo, "conditional") == 0
    if not policy.offload:
        assert _top_level(program.hlo, "while") == 0


#: K-means' assignment kernel, where there is one: Triton's on sm90; on a TPU XLA's product on the MXU (a Mosaic
#: version saved 0.3% of the prefill's bytes by XLA's count at 16k: docs/research_log.md).
KMEANS_ASSIGN = {"gpu": ("kmeans_assign",), "tpu": ()}


def test_kmeans_keeps_its_similarities_on_chip_on_sm90(target, monkeypatch):
    """On sm90 kernels="auto" assigns K-means' keys in the Triton kernel (`kmeans_assign`), in the prefill and in
    the program that indexes generated tokens. XLA's form writes each iteration's [B, K, N, C] float32
    similarities and reads them back for the max: the kernel's prefill accesses less, by more than those
    similarities written once per selecting layer (XLA's count holds a while loop's body once). The other ops
    run as "auto" has them in both."""
    from clusterkv_jax import kernels

    if target.platform != "gpu":
        pytest.skip("the assignment kernel is Triton's; on a TPU XLA's product runs on the MXU")
    policy = ClusterKV(budget=256)
    auto = _compile(policy, target, prefill=True, index=True)
    kernel = KMEANS_ASSIGN[target.platform][0]
    assert kernel in auto["prefill"].kernels and kernel in auto["index"].kernels
    resolve = kernels.resolve
    monkeypatch.setattr(kernels, "resolve", lambda mode, op=None: "reference" if op == "kmeans_assign"
                        else resolve(mode, op))
    jax.clear_caches()  # the programs above were traced with the kernel
    in_xla = _compile(policy, target, prefill=True)["prefill"]
    jax.clear_caches()
    assert kernel not in in_xla.kernels
    selecting = CONFIG.num_layers - policy.full_layers
    similarities = BATCH * CONFIG.num_kv_heads * CONTEXT * policy.prompt_cluster_slots(CONTEXT) * 4
    saved = in_xla.bytes_accessed - auto["prefill"].bytes_accessed
    assert saved > selecting * similarities, (saved, selecting * similarities)


def test_a_prefill_that_only_keeps_queries_holds_what_full_kvs_holds(target):
    """The shared prefill for SnapKV and InfiniGen (`FullKVKeepingQueries`) keeps each layer's last queries and
    indexes no keys, so it holds FullKV's device temporaries at 32k: its selecting layers' keys are not read for an
    index (`attend.indexes_keys`; on sm90 the unrolled loop's `kernels.layer_values` barrier held each layer's
    padded keys though nothing read them: 1,896 MB against FullKV's 1,376 MB), and the kept rows are taken before
    the layer's attention reads q (`attend.observe_prompt_queries`' barrier; XLA took them after it, holding q:
    1,645 MB against 1,377 on the v5e, and in 8k-token chunks 1,096 MB against 894 on sm90)."""
    from clusterkv_jax.policies.full import FullKVKeepingQueries

    chunks = (None, 8192) if target.platform == "gpu" else (None,)  # a TPU's chunks hold more: research log
    held = {(name, chunk): aot.model_programs(CONFIG, {"p": policy}, device=target, batch=1, context=32768,
                                              prefill=("p",), chunk=chunk)[1].device_temp_bytes
            for name, policy in (("full", FullKV()), ("keeping", FullKVKeepingQueries(prompt_queries=32)))
            for chunk in chunks}
    for chunk in chunks:
        assert held["keeping", chunk] <= held["full", chunk] * 1.01, held


def test_clusterkvs_prefill_holds_what_full_kvs_holds(target):
    """ClusterKV@1024's 32k prefill (the CLI's) holds full KV's device temporaries: its indexing fits in what the
    prompt's attention and MLP hold anyway. On a v5e it held 1,581 MB against full KV's 1,377 while q/k/v were
    stored [D, heads, H]: XLA:TPU lays such a weight out anew before a prompt's projection, and before ClusterKV's
    two scans (full layers, then selecting ones) it relaid the whole stacks. Stored with the model dim last
    (`model.move_model_dim_last`, what `for_device` gives a TPU) they are read in place: 1,379 MB. On sm90 1,388
    MB against 1,376 (docs/research_log.md)."""
    held = {name: aot.model_programs(CONFIG, {name: policy}, device=target, batch=1, context=32768,
                                     prefill=(name,))[1].device_temp_bytes
            for name, policy in (("full", FullKV()), ("clusterkv", ClusterKV(budget=1024)))}
    assert held["clusterkv"] <= held["full"] * 1.02, held


def _while_loops(hlo: str) -> list[str]:
    """The while loops of a program, in any computation, each as its HLO line."""
    return [line for line in hlo.splitlines() if re.search(r"[)\]}] while\(", line)]


def test_a_gpu_prefill_clusters_without_waiting_for_the_host(target):
    """On sm90 K-means runs all its iterations as a loop of known trip count (`fixed_iterations`: settled problems
    frozen, the same result), so neither the prefill nor the index program waits for the host once per iteration
    of each selecting layer's K-means (as the early-stopping while loop did: 30 layers x 12 at Llama-3-8B's 32k). The
    index program keeps its one branch, taken once per window."""
    if target.platform != "gpu":
        pytest.skip("a TPU decides its loops on the device")
    programs = _compile(ClusterKV(budget=256), target, prefill=True, index=True)
    for name in ("prefill", "index"):
        loops = _while_loops(programs[name].hlo)
        # XLA:GPU's `WhileThunk` copies the predicate to the host at each iteration unless the trip count is known.
        assert loops and [line for line in loops if "known_trip_count" not in line] == [], name
    assert _top_level(programs["prefill"].hlo, "conditional") == 0


def test_prefill_sorts_once_for_all_selecting_layers(target):
    """A prefill's selecting layers share their sorts: K-means' seeds come from one random order of the positions
    (`kmeans.random_order`), and one loop over the layers indexes them all (`attend.index_prompt`), so one layout
    sort. XLA:GPU compiles every sort anew (a 33k-row sort is 14 kernels for ptxas): with a layout sort per layer the
    32-layer ClusterKV prefill took 47 s to compile here, 10.5 s with one (docs/research_log.md). On a TPU the
    selecting layers are one scanned body: one of each there too."""
    program = _compile(ClusterKV(budget=256), target, prefill=True)["prefill"]
    sorts = re.findall(r' sort\([^\n]*op_name="([^"]*)"', program.hlo)
    assert sum("kmeans" in name for name in sorts) == 1, sorts
    assert len(sorts) == 2, sorts


@pytest.mark.parametrize("gqa", ["per_head", "shared"])
def test_clusterkv_decode_and_prefill_compile_with_the_pallas_kernels(target, gqa):
    """kernels="pallas": on sm90 the Triton kernels, on a TPU their Mosaic versions: the decode step holds the
    cluster-to-block indexing and the page-table attention (on sm90 the full layers' flash-decoding kernel too,
    without a copy of their stores), the decode-time clustering between steps
    (`index_due_windows`) K-means' centroid update; prefill holds the centroid update (and the prompt's flash
    attention). kernels="auto": on a TPU the same; on sm90 the block indexing alone. kernels="reference" compiles to
    none."""
    policy = ClusterKV(budget=256, gqa=gqa, kernels="pallas")
    programs = _compile(policy, target, prefill=True, index=True)
    assert programs["decode"].kernels == tuple(sorted(
        _named(("cluster_to_block_index", "selected_attention"), target) + DECODE_ATTENTION[target.platform]))
    kmeans = _named(("centroid_update",), target) + KMEANS_ASSIGN[target.platform]
    assert programs["index"].kernels == tuple(sorted(kmeans))
    assert programs["prefill"].kernels == tuple(sorted(kmeans + (PROMPT_KERNEL[target.platform],)))
    assert programs["decode"].host_argument_bytes == 0 and programs["decode"].host_buffers == 0
    _no_store_copy(programs["decode"], policy, target)
    auto = _compile(ClusterKV(budget=256, gqa=gqa), target)["decode"]
    assert auto.kernels == (AUTO_ON_SM90 if target.platform == "gpu" else programs["decode"].kernels)
    _no_store_copy(auto, policy, target)
    assert _compile(ClusterKV(budget=256, gqa=gqa, kernels="reference"), target)["decode"].kernels == ()


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offloaded"])
def test_token_refined_decode_compiles_and_reads_its_candidates_in_place(target, offload):
    """token_refine reads its candidates' keys block by block (`key_blocks`): on sm90 from a device store where it
    lies (no copy of the layer's keys), from a host store as rows reaching the device."""
    policy = ClusterKV(budget=256, token_refine=4, offload=offload)
    decode = _compile(policy, target)["decode"]
    if offload:
        assert decode.host_argument_bytes == _host_bytes(policy)
    elif target.platform == "tpu":
        # Known, left for a Mosaic key reader: XLA:TPU's gather copies the layer group's keys (172 MB at 32k, 4
        # layers of Llama-3-8B geometry), as its gather of whole blocks does for the paper's rule with
        # kernels="reference" (docs/research_log.md, "The budget's edge"). Fails once fixed: then check as on sm90.
        with pytest.raises(AssertionError):
            _no_store_copy(decode, policy, target)
    else:
        _no_store_copy(decode, policy, target)


@pytest.mark.parametrize("policy", [ClusterKV(budget=256, offload=True), Quest(budget=256, offload=True),
                                    FullKV(offload=True)], ids=["clusterkv", "quest", "full"])
def test_offloaded_decode_compiles_with_the_store_in_pinned_host_memory(target, policy):
    """The offloaded store stays a pinned_host argument of the compiled program (XLA did not move it to the
    device), and device memory holds that much less than the on-device program's."""
    host = _host_bytes(policy)
    offloaded = _compile(policy, target)["decode"]
    on_device = _compile(dataclasses.replace(policy, offload=False), target)["decode"]
    assert host > 0 and offloaded.host_argument_bytes == host
    assert offloaded.host_buffers > 0
    # The offloaded program adds device buffers of its own (window ring, recall cache): less than it moved out.
    assert offloaded.device_argument_bytes < on_device.device_argument_bytes
    if isinstance(policy, ClusterKV):  # the selection runs on the device; the attention reads gathered rows
        assert offloaded.kernels == (AUTO_ON_SM90 if target.platform == "gpu"
                                     else _named(("cluster_to_block_index",), target))


@pytest.mark.parametrize("policy", [ClusterKV(budget=256, offload=True), Quest(budget=256, offload=True)],
                         ids=["clusterkv", "quest"])
def test_offloaded_decode_does_not_stage_the_host_store_on_the_device(target, policy):
    """The device scratch that offloading adds to a decode step does not grow with the host store: rows reach host
    memory as DMAs (a row, or a plane of one sequence and KV head), never as a host computation returning the store,
    whose result XLA converted in device memory (the whole store, on both targets). Between two contexts the added
    scratch grows by less than half of what the host store grows by."""
    def added(context):
        offloaded = _compile(policy, target, context=context)["decode"]
        on_device = _compile(dataclasses.replace(policy, offload=False), target, context=context)["decode"]
        return offloaded.device_temp_bytes - on_device.device_temp_bytes

    grown = _host_bytes(policy, 2 * CONTEXT) - _host_bytes(policy)
    assert grown > 0
    assert added(2 * CONTEXT) - added(CONTEXT) < grown / 2


@pytest.mark.parametrize("geometry", ["glm4-9b", "qwen3-8b", "gemma3-12b"])
def test_family_geometries_compile_with_the_pallas_kernels(target, geometry):
    """GLM-4-9B (partial interleaved RoPE, 16 query heads a KV head), Qwen3-8B (per-head q/k norms) and Gemma 3 12B
    (five windowed layers, then a global one that selects): ClusterKV's decode step compiles with the Pallas kernels
    (Triton or Mosaic) on the target."""
    config = synthetic_config(geometry, layers=6 if geometry == "gemma3-12b" else 3)
    programs = aot.model_programs(config, {"p": ClusterKV(budget=256, kernels="pallas")}, device=target, batch=1,
                                  context=CONTEXT, index=("p",))
    # Gemma 3's first two layers, ClusterKV's full ones, are windowed: no layer attends to its whole cache.
    full = DECODE_ATTENTION[target.platform] if geometry != "gemma3-12b" else ()
    assert programs[0].kernels == tuple(sorted(_named(("cluster_to_block_index", "selected_attention"), target) + full))
    assert programs[1].name == "index p" and programs[1].kernels == tuple(sorted(
        _named(("centroid_update",), target) + KMEANS_ASSIGN[target.platform]))


def test_cli_prints_one_row_per_program(target, capsys):
    """`python -m clusterkv_jax.aot` at its defaults (4 layers of Llama-3-8B, 32k, batch 1): one row per program, all
    compiled. The table is the one `make aot-cuda` / `make aot-tpu` shows: printed here, not compiled again by a run
    of its own; programs that it and other tests of this process both compile are compiled once (`aot._COMPILED`)."""
    platform = "cuda" if target.platform == "gpu" else "tpu"
    assert aot.main(["--platform", platform]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| decode", "| prefill", "| index"))]
    assert len(rows) == 14 and out.rstrip().endswith("all programs compiled")
    assert np.all(["FAILED" not in r for r in rows])
    with capsys.disabled():
        print(f"\n{out}", flush=True)


def _layers_merged(hlo: str, min_elements: int = 1024) -> list[tuple[str, set[str]]]:
    """The fused kernels of a program that hold reductions to at least `min_elements` values of more than one model
    layer (by the `layerN` named scope in their op names: `attend.layer_scope`), each with those layers. Smaller
    ones do merge (a few [B, K, 4] sums of decode-time clusters share a constant zero) and cost nothing."""
    bodies: dict[str, set[str]] = {}
    name = None
    for line in hlo.splitlines():
        if not line.startswith(" "):
            head = re.match(r"(?:ENTRY )?%(\S+) ", line)
            name = head.group(1) if head else None
            if name:
                bodies[name] = set()
        elif name and (reduce := re.search(r"= \w+\[([\d,]*)\]\S* reduce\(", line)):
            if np.prod([int(d) for d in reduce.group(1).split(",") if d]) >= min_elements:
                bodies[name] |= set(re.findall(r'op_name="[^"]*?/(layers?\d+[-\d]*)/', line))
    merged = []
    for line in hlo.splitlines():
        call = re.match(r"\s*%(\S+) = .*? fusion\(.*?calls=%([\w.\-]+)", line)
        if call and len(bodies.get(call.group(2), ())) > 1:
            merged.append((call.group(1), bodies[call.group(2)]))
    return merged


def test_a_shared_prefill_fills_a_policys_cache_reading_the_full_one_in_place(target):
    """`generate(..., prefilled=)`'s first program (`decode_loop.start_prefilled`: ClusterKV's cache stored and
    indexed from a full-KV prefill's) compiles for the target and holds under half the device temporaries of
    ClusterKV's own prefill at 32k: it reads each layer of the full cache in place. Reading them as a stacked copy
    held 1,092 MB on the v5e, against 1,806 MB for the own prefill (in place: 411 MB)."""
    policy = ClusterKV(budget=1024)
    copied = aot.prefilled_program(CONFIG, policy, device=target, batch=1, context=32768)
    own = aot.model_programs(CONFIG, {"p": policy}, device=target, batch=1, context=32768, prefill=("p",))[1]
    assert own.name == "prefill p"
    assert copied.device_temp_bytes < own.device_temp_bytes / 2, (copied.device_temp_bytes, own.device_temp_bytes)


def _write_prompt_program(config, policy, device, context: int):
    """`attend.write_prompt` (the synthetic benchmark's prefill: the prompt's K/V written, its layers indexed) of a
    `context`-token prompt, batch 1, compiled for `device`."""
    from clusterkv_jax.attend import write_prompt
    from clusterkv_jax.bench.synthetic import synthetic_kv

    cache = aot.target_cache(config, policy, device=device, batch=1, context=context)
    keys, values = jax.eval_shape(lambda: synthetic_kv(jax.random.key(0), config, 1, context, cache.capacity,
                                                       jnp.bfloat16))
    return aot.compile_for_device("write_prompt", write_prompt, device, cache, keys, values,
                                  jax.ShapeDtypeStruct((1,), jnp.int32), policy=policy)


def test_no_kernel_reduces_for_several_layers(target):
    """Each layer's indexing runs in kernels of its own (`kernels.layer_values`). Every layer's K-means starts from
    the same PRNG keys and every layer reads the same lengths, and XLA:GPU fused the consumers of such a shared
    operand across an unrolled program's layers into one kernel: Quest's page bounds of 30 layers became one
    60-output kernel of the 32-layer prefill that ptxas compiled for 8 minutes, holding 3.2 GB of temporaries
    where full KV's prefill holds 1.2 GB (docs/research_log.md, "Kernels merged across layers"). The geometries
    are the smallest found to merge before the change: 6 layers at 32k for ClusterKV's prefill, 8 layers for
    Quest's written prompt. A TPU's program scans its layers (`kernels.layer_loop`): one body serves them all."""
    if target.platform != "gpu":
        pytest.skip("a TPU scans its layers")
    config = synthetic_config("llama3-8b", layers=6)
    programs = aot.model_programs(config, {"p": ClusterKV(budget=1024)}, device=target, batch=1, context=32768,
                                  prefill=("p",), index=("p",))
    programs.append(_write_prompt_program(synthetic_config("llama3-8b", layers=8), Quest(budget=1024), target, 32768))
    for program in programs:
        assert _layers_merged(program.hlo) == [], program.name


def test_centroid_update_holds_one_copy_of_the_keys_on_a_tpu(target):
    """The Mosaic centroid accumulation at a 32k prompt (8 KV heads, 128 wide, float32, as K-means runs it) holds
    at most one copy of its keys (zeroed where ignored) as device temporaries. It once appended a column of ones
    to count the members with the same product: 129 columns lie in a TPU's HBM padded to 256 lanes, twice the
    keys (272 MB here), and ClusterKV's v5e prefill at 32k held 1,806 MB of temporaries where now 1,581
    (docs/research_log.md)."""
    if target.platform != "tpu":
        pytest.skip("the Mosaic kernel; a GPU runs XLA's segment sum (kernels.AUTO_ON_GPU)")
    from pallas_kernels.centroid_update_tpu import centroid_update_tpu

    keys = jax.ShapeDtypeStruct((1, 8, 33280, 128), jnp.float32)
    program = aot.compile_for_device("centroid_update_tpu", jax.jit(lambda k, lab: centroid_update_tpu(k, lab, 415)),
                                     target, keys, jax.ShapeDtypeStruct(keys.shape[:-1], jnp.int32))
    assert "centroid_update_tpu" in program.kernels
    key_bytes = np.prod(keys.shape) * 4
    assert program.device_temp_bytes <= 1.01 * key_bytes, (program.device_temp_bytes, key_bytes)
