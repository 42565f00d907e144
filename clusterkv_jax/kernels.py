"""The one kernel switch: which implementation of each op runs, and one entry point per op.

Implementations:

- "reference": the pure-jnp references (any device; what the CPU runs);
- "pallas": the Pallas Triton kernels (CUDA GPUs of compute capability >= 8.0);
- "interpret": the same kernels in Pallas interpret mode (any device; slow, for tests);
- "tpu": their Mosaic versions (TPUs).

A policy asks for a mode (`MODES`); `resolve` turns it into an implementation of one op for the device being
traced for (`pallas_kernels.dispatch.compile_for` picks a device that is not attached). Every op below takes the
resolved implementation and, under a multi-device mesh, runs a kernel once per device on its shard of the leading
(batch, head) dims (`ops.per_shard`): a custom call the SPMD partitioner cannot split stays local.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import jax
import jax.numpy as jnp

from clusterkv_jax import attention
from clusterkv_jax.ops import multi_device_axes, per_shard
from pallas_kernels import (
    centroid_update as _centroid_update_pallas,
    centroid_update_reference,
    centroid_update_tpu,
    cluster_to_block_index as _cluster_to_block_index_pallas,
    cluster_to_block_index_reference,
    cluster_to_block_index_tpu,
    decode_attention as _decode_attention_pallas,
    kmeans_assign as _kmeans_assign_pallas,
    kmeans_assign_reference,
    selected_attention as _selected_attention_pallas,
    selected_attention_reference,
    selected_attention_tpu,
)
from pallas_kernels import dispatch
from pallas_kernels.decode_attention import split_for

#: What a policy may ask for: "auto" (on a TPU the Mosaic kernels; on a CUDA GPU the faster of kernel and reference
#: for each op, `AUTO_ON_GPU`; elsewhere the references), "pallas" (the kernels, or an error), "reference",
#: "interpret".
MODES = ("auto", "pallas", "reference", "interpret")
#: What runs.
IMPLEMENTATIONS = ("reference", "pallas", "interpret", "tpu")
#: The ops, by the names `resolve` takes.
OPS = ("centroid_update", "cluster_to_block_index", "decode_attention", "kmeans_assign", "selected_attention")
#: What "auto" runs for each op on a CUDA GPU: the one that was faster on an H200 (`python -m pallas_kernels.bench`,
#: docs/research_log.md "First run on a GPU"): XLA's segment sum and gathered attention beat the centroid-update and
#: page-table attention kernels; the block-indexing kernel is kept. K-means' assignment kernel is chosen by the bytes,
#: not yet by a GPU's clock: XLA writes and rereads the [N, C] similarities it keeps on chip (53 MB a KV head and
#: iteration at 32k against 8 MB of keys; docs/research_log.md). Full decode attention stays XLA's until a GPU has
#: timed JAX's flash-decoding kernel against it (`python -m pallas_kernels.bench`).
AUTO_ON_GPU = {"centroid_update": "reference", "cluster_to_block_index": "pallas", "decode_attention": "reference",
               "kmeans_assign": "pallas", "selected_attention": "reference"}


def resolve(mode: str, op: str | None = None) -> str:
    """The implementation `mode` means for `op` (one of `OPS`; None: the kernels' platform choice alone) on the
    device being traced for: "tpu" on a TPU (unless "reference" or "interpret" is asked); on a CUDA GPU of compute
    capability >= 8.0 "pallas", except that "auto" takes `AUTO_ON_GPU[op]`; else "reference"; "pallas" on any
    other device is a RuntimeError naming it."""
    if mode not in MODES:
        raise ValueError(f"kernel mode must be one of {', '.join(MODES)}, got {mode!r}")
    if op is not None and op not in OPS:
        raise ValueError(f"kernel op must be one of {', '.join(OPS)}, got {op!r}")
    if mode in ("reference", "interpret"):
        return mode
    if dispatch.on_tpu():
        return "tpu"
    if dispatch.kernels_supported():
        return AUTO_ON_GPU[op] if mode == "auto" and op is not None else "pallas"
    if mode == "auto":
        return "reference"
    raise RuntimeError(
        f"kernels 'pallas' need a CUDA GPU with compute capability >= {dispatch.MIN_COMPUTE_CAPABILITY} (Pallas "
        f"Triton kernels) or a TPU; found {dispatch.describe_target()}. Use 'auto' or 'reference' (or 'interpret' "
        "for tests).")


def branches_wait_for_host() -> bool:
    """Whether a `lax.cond` in a program for the device being traced for stops the host until the device gets
    there: XLA:GPU runs a conditional by copying its predicate to the host and waiting for the copy
    (`ConditionalThunk`; a while loop's predicate likewise, each iteration), so each one drains the device's queue
    and the kernels after it start only as the host launches them. A decode step on a GPU therefore branches only
    where a branch saves more than a launch gap (docs/research_log.md). XLA:TPU and XLA:CPU decide on the device
    or in the same thread, at no such cost."""
    if _branch_override:
        return _branch_override[-1]
    return dispatch.on_gpu()


_branch_override: list[bool] = []


def chunks_read_row_by_row() -> bool:
    """Whether chunks of store rows that may start anywhere (`Selection.aligned` false: Quest's pages) are read
    with an index per row rather than one slice per chunk. For a gather of multi-row slices from any start, XLA:TPU
    lays the whole stacked store out anew first (deviceless v5e, Llama-3-8B geometry, 4 layers, 32k: Quest's
    decode step held 138 MB of temporaries, a copy of both selecting layers' keys and values, every step); single
    rows it reads in place. Elsewhere one slice per chunk copies faster (XLA:CPU, docs/research_log.md)."""
    if _row_override:
        return _row_override[-1]
    return dispatch.on_tpu()


_row_override: list[bool] = []


@contextlib.contextmanager
def _forcing(overrides: list, value):
    """A trace-time choice overridden inside the block: a jitted function's cache does not know of it, so entering
    and leaving clear JAX's caches (every program inside is traced anew)."""
    jax.clear_caches()
    overrides.append(value)
    try:
        yield
    finally:
        overrides.pop()
        jax.clear_caches()


def qkv_model_dim_last() -> bool:
    """Whether `model.for_device` stores q/k/v weights with the model dim last ([heads, H, D],
    `model.move_model_dim_last`) for the device being traced for: on a TPU. XLA:TPU lays a [D, heads, H] weight
    out anew before a prompt's projection reads it (in a scanned prefill each layer's, or the whole stacks before
    two scans: ClusterKV@1024's 32k prefill held 204 MB more than full KV's on a v5e, deviceless); [heads, H, D] it
    reads in place. A GPU reads its fused layout (`model.fuse_layer`), and XLA:CPU projected one token from
    [heads, H, D] about half as fast (SmolLM2's q/k/v, 0.15 ms against 0.08), so there they stay as they are."""
    if _model_dim_last_override:
        return _model_dim_last_override[-1]
    return dispatch.on_tpu()


_model_dim_last_override: list[bool] = []


def forced_qkv_model_dim_last(last: bool):
    """`qkv_model_dim_last()` is `last` inside this block, whatever the device (tests: the CPU reads a TPU's
    layout)."""
    return _forcing(_model_dim_last_override, bool(last))


def forced_chunks_read_row_by_row(by_row: bool):
    """Traces as if `chunks_read_row_by_row()` were `by_row` inside this block (tests)."""
    return _forcing(_row_override, bool(by_row))


def forced_branches_wait_for_host(wait: bool):
    """Traces as if `branches_wait_for_host()` were `wait` inside this block (tests: the CPU traces a GPU's
    branch-free decode step)."""
    return _forcing(_branch_override, bool(wait))


#: How the model runs its layers (`layer_loop`).
LAYER_LOOPS = ("unrolled", "scanned")
_layer_loop_override: list[str] = []


def layer_loop() -> str:
    """How `clusterkv_jax.model` runs its layers on the device being traced for: "unrolled" (a Python loop, each
    layer's weights a static slice of the stacked parameters) on a GPU, "scanned" (`lax.scan` over the layers,
    indexed by the scan) elsewhere. XLA:GPU copies a layer's weights (and its KV) out of the stacks before the
    matrix products that read them when the index is traced, so a scanned decode step on an H200 read its weights
    about 2.6 times (docs/research_log.md); a static slice it reads in place. XLA:TPU and XLA:CPU read a traced
    slice in place (a deviceless TPU compile holds no copy; on the CPU both forms step equally fast), and there the
    scan's compile time does not grow with depth, where an unrolled 30-layer ClusterKV decode step compiles about
    15 times longer on the CPU. `forced_layer_loop` overrides the choice (tests)."""
    if _layer_loop_override:
        return _layer_loop_override[-1]
    return "unrolled" if dispatch.on_gpu() else "scanned"


def forced_layer_loop(loop: str):
    """Runs the layers `loop` ("unrolled" or "scanned") inside this block, whatever the device (tests: the CPU runs
    what a GPU runs)."""
    if loop not in LAYER_LOOPS:
        raise ValueError(f"layer loop must be one of {', '.join(LAYER_LOOPS)}, got {loop!r}")
    return _forcing(_layer_loop_override, loop)


def layer_values(*args):
    """`args` (pytrees) as values of one layer's own, where the layer loop is unrolled (a GPU's). A policy's
    indexing reads operands every layer shares (the lengths, constant PRNG keys), and XLA:GPU fuses the consumers
    of a shared operand across an unrolled program's layers into one kernel: Quest's page bounds of 30 layers became
    one 60-output kernel that ptxas compiled for 8 minutes, and a merged kernel keeps every layer's keys alive until
    the last layer (docs/research_log.md, "Kernels merged across layers"). An optimization barrier gives each layer
    values of its own and computes nothing. A scanned loop has one body for all its layers, and there the barrier
    kept a layer's padded keys in memory where a TPU fused them (+137 MB at 32k), so `args` come back as they are."""
    if layer_loop() != "unrolled":
        return args
    leaves, tree = jax.tree.flatten(args)
    arrays = [j for j, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]  # a state may hold callables
    for j, value in zip(arrays, jax.lax.optimization_barrier([leaves[j] for j in arrays])):
        leaves[j] = value
    return jax.tree.unflatten(tree, leaves)


def on_a_mesh() -> bool:
    """Whether the program being traced runs under a multi-device mesh (`steps.in_mesh_scope` sets it for the
    trace: `ops.sharded_trace`). There a kernel op runs once per device on its shard (`ops.per_shard`), a layer
    attends its selection gathered rather than in place or in tiles (both read a whole store, which the mesh
    splits; `attend.attend_selected`), and a host store's rows are written by a host computation
    (`offload._write_rows`)."""
    return multi_device_axes() is not None


def written_when(due, write, operand):
    """`write(operand)` where `due()` (a traced bool, computed on the CPU only) holds, else `operand`, for a write
    that most steps skip and that changes nothing where it is not due (the window's rows on a step with none due,
    `store.LayerView.commit_window`). On the CPU a `lax.cond` skips it: XLA:CPU updates the operand in place under
    the cond, and the write's gathers and scatters are a visible part of a small model's step
    (docs/research_log.md). Elsewhere the write always runs: a conditional that returns its operand made XLA:GPU
    copy it whole (a layer group's store on every layer of every step; docs/research_log.md, "Deviceless
    compilation"). `lax.platform_dependent` picks at lowering: the compiler never sees both."""
    return by_platform(operand, cpu=lambda o: jax.lax.cond(due(), write, lambda o: o, o), default=write)


def by_platform(*operands, cpu=None, tpu=None, default):
    """`cpu(*operands)`, `tpu(*operands)` or `default(*operands)` as the platform the program is lowered for: the
    choices of a program's path that are not kernel ops meet here (`written_when`; the tiled selected attention
    of a CPU's cache, `attend.attend_selected`; the host stores' row writes, `offload._write_rows`).
    `lax.platform_dependent` picks at lowering, so a deviceless compile for a GPU or a TPU takes its own branch."""
    branches = {name: fn for name, fn in (("cpu", cpu), ("tpu", tpu)) if fn is not None}
    return jax.lax.platform_dependent(*operands, default=default, **branches)


def _check(impl: str) -> None:
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"kernel implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {impl!r}")


def centroid_update(keys: jax.Array, labels: jax.Array, num_clusters: int, *, impl: str):
    """Per-cluster sums [..., C, H] float32 and member counts [..., C] of keys [..., N, H] by labels [..., N]
    (outside [0, C): in no cluster)."""
    _check(impl)
    if impl == "reference":
        return centroid_update_reference(keys, labels, num_clusters)
    if impl == "tpu":
        run = functools.partial(centroid_update_tpu, num_clusters=num_clusters)
    else:
        run = functools.partial(_centroid_update_pallas, num_clusters=num_clusters, interpret=impl == "interpret")
    return per_shard(lambda k, l: run(k, l), keys, labels)


def kmeans_assign(keys: jax.Array, valid: jax.Array, directions: jax.Array, allowed: jax.Array, *, passes: int,
                  impl: str) -> jax.Array:
    """Each valid key's most similar allowed cluster [..., N] (C for an invalid key) from keys [..., N, H] and
    directions [..., C, H], products of operands in `passes` bfloat16 parts. `kmeans.cosine_kmeans` runs its own XLA
    form for "reference" and "tpu" (a max that XLA:CPU fuses with the product). There is no Mosaic version: on a v5e,
    deviceless, one was not worth its keys' reads (docs/research_log.md)."""
    _check(impl)
    if impl in ("reference", "tpu"):
        return kmeans_assign_reference(keys, valid, directions, allowed, passes=passes)
    run = functools.partial(_kmeans_assign_pallas, passes=passes, interpret=impl == "interpret")
    return per_shard(lambda k, v, d, a: run(k, v, d, a), keys, valid, directions, allowed)


def cluster_to_block_index(ranked_sizes: jax.Array, ranked_starts: jax.Array, *, tokens: int, slots: int,
                           block_size: int, impl: str):
    """The blocks [..., slots] a selection reads and the rows taken in each [..., slots], from clusters in
    descending score order: their sizes and first blocks [..., C] (the last cluster trimmed to `tokens`)."""
    _check(impl)
    if impl == "reference":
        return cluster_to_block_index_reference(ranked_sizes, ranked_starts, tokens, slots, block_size)
    if impl == "tpu":
        run = functools.partial(cluster_to_block_index_tpu, tokens=tokens, slots=slots, block_size=block_size)
    else:
        run = functools.partial(_cluster_to_block_index_pallas, tokens=tokens, slots=slots, block_size=block_size,
                                interpret=impl == "interpret")
    return per_shard(lambda s, st: run(s, st), ranked_sizes, ranked_starts)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *, cap: float | None = None,
                     impl: str) -> jax.Array:
    """One query per query head over the first lengths[b] rows of its KV head: q [B, N, H], k and v [B, K, S, H]
    -> [B, N, H] float32 (`attention.decode_attention`). "pallas" / "interpret": JAX's flash-decoding kernel
    (`pallas_kernels.decode_attention`), once per device's shard under a mesh; soft-capped scores (Gemma 2) and a
    capacity the kernel's blocks do not divide take XLA's form, as "reference" and "tpu" do."""
    _check(impl)
    if impl in ("pallas", "interpret") and cap is not None:
        _say_once("the flash-decoding kernel has no soft-capped scores: soft-capped layers decode in XLA")
    if impl in ("reference", "tpu") or cap is not None or split_for(k.shape[2]) is None:
        return attention.decode_attention(q, k, v, lengths, cap)
    B, N, H = q.shape
    K = k.shape[1]
    run = functools.partial(_decode_attention_pallas, interpret=impl == "interpret")
    out = per_shard(lambda q, k, v, lengths: run(q, k, v, lengths), q.reshape(B, K, N // K, H), k, v,
                    jnp.broadcast_to(lengths[:, None], (B, K)).astype(jnp.int32))
    return out.reshape(B, N, H)


def selected_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, pages: jax.Array, mask: jax.Array, *,
                       impl: str) -> jax.Array:
    """Each selection head's queries q [B, h, G, H] over its pages [B, h, n] of a store seen as pages [P, c, H]
    (rows where mask [B, h, n, c]), one softmax -> [B, h, G, H] float32. The page table addresses the whole store,
    so this op is not split over a mesh: callers attend in place only without one."""
    _check(impl)
    if impl == "reference":
        return selected_attention_reference(q, k_pages, v_pages, pages, mask)
    if impl == "tpu":
        return selected_attention_tpu(q, k_pages, v_pages, pages, mask)
    return _selected_attention_pallas(q, k_pages, v_pages, pages, mask, interpret=impl == "interpret")


# ----------------------------------------------------------------------------------------------------------
# A prompt's attention to itself: the fused flash-attention kernels JAX and cuDNN maintain, where there is one
# ----------------------------------------------------------------------------------------------------------

#: How a prompt attends to itself (`prompt_attention`): "cudnn" (cuDNN's fused flash attention through
#: `jax.nn.dot_product_attention`; CUDA GPUs of compute capability >= 8.0), "splash" (JAX's Pallas TPU splash
#: attention, its grouped-query form), "xla" (`attention.causal_attention`, a flash loop in XLA ops: the CPU,
#: and the fallback).
PROMPT_ATTENTIONS = ("xla", "cudnn", "splash")
_prompt_attention_override: list[tuple[str, bool]] = []
_said: set[str] = set()
log = logging.getLogger("clusterkv_jax")


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.warning(message)


def prompt_attention_impl(dtype, cap: float | None) -> tuple[str, str | None]:
    """Which of `PROMPT_ATTENTIONS` a prompt's attention runs on the device being traced for, and, where the
    platform's kernel cannot take this layer, why not (the layer then runs "xla"). cuDNN's fused attention takes
    bfloat16 or float16 and has no soft-capped scores (Gemma 2); splash attention takes both."""
    if _prompt_attention_override:
        return _prompt_attention_override[-1][0], None
    if dispatch.on_tpu():
        return "splash", None
    if dispatch.kernels_supported():
        if cap is not None:
            return "xla", "cuDNN's fused attention has no soft-capped scores: soft-capped layers' prompts attend in XLA"
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return "xla", (f"cuDNN's fused attention takes bfloat16 or float16: a {jnp.dtype(dtype).name} model's "
                           "prompts attend in XLA")
        return "cudnn", None
    return "xla", None


def forced_prompt_attention(impl: str, interpret: bool = False):
    """Prompts attend with `impl` inside this block whatever the device (tests: "splash" with `interpret` runs
    the TPU kernel on the CPU)."""
    if impl not in PROMPT_ATTENTIONS:
        raise ValueError(f"prompt attention must be one of {', '.join(PROMPT_ATTENTIONS)}, got {impl!r}")
    return _forcing(_prompt_attention_override, (impl, interpret))


def prompt_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None = None,
                     cap: float | None = None, block: int = 512) -> jax.Array:
    """Causal attention of a whole prompt to itself: q [B, T, N, H], k and v [B, T, K, H] -> [B, T, N, H]
    (float32 from XLA, q's dtype from a fused kernel: no float32 copy of the output is made), each query over its
    last `window` positions when given, scores soft-capped by `cap` when given, through the platform's fused kernel
    (`prompt_attention_impl`; a layer it cannot take falls back to XLA, said once in the log). No [T, T] score
    matrix exists in memory on any path."""
    impl, why_not = prompt_attention_impl(q.dtype, cap)
    if why_not:
        _say_once(why_not)
    interpret = bool(_prompt_attention_override and _prompt_attention_override[-1][1])
    if impl == "cudnn":
        try:
            return dot_product_prompt_attention(q, k, v, window=window, implementation="cudnn")
        except (RuntimeError, NotImplementedError, ValueError) as e:  # no cuDNN, or a shape it does not take
            _say_once(f"cuDNN's fused attention is not available here ({type(e).__name__}: {e}); prompts attend "
                      "in XLA")
    elif impl == "splash":
        return splash_prompt_attention(q, k, v, window=window, cap=cap, block=block, interpret=interpret)
    return attention.causal_attention(q, k, v, block=block, window=window, cap=cap)


def dot_product_prompt_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None = None,
                                 implementation: str = "cudnn") -> jax.Array:
    """`prompt_attention` through `jax.nn.dot_product_attention` (grouped-query heads and the window native:
    HF's window q - k < W is cuDNN's sliding window of length W) -> [B, T, N, H] in q's dtype. With
    implementation="xla" the same call runs anywhere, with a [T, T] score matrix (tests, short prompts)."""
    local = None if window is None else (window - 1, 0)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local,
                                       implementation=implementation)
    return out


def splash_prompt_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None = None,
                            cap: float | None = None, block: int = 512, interpret: bool = False) -> jax.Array:
    """`prompt_attention` through JAX's Pallas TPU splash attention, its grouped-query form (each KV head's G
    query heads over its keys, vmapped over batch and KV heads, once per device's shard under a mesh) -> q's dtype.
    T is padded to whole blocks of `block`: padded keys lie after every real query, so causality masks them, and
    padded queries are dropped. The mask is causal or local (window W: q - k < W), built lazily by splash."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    padded = -(-T // block) * block
    q, k, v = (jnp.pad(x, ((0, 0), (0, padded - T), (0, 0), (0, 0))) for x in (q, k, v))
    shape = (padded, padded)
    head_mask = masks.CausalMask(shape) if window is None else masks.LocalMask(shape, (window - 1, 0), 0)
    kernel = splash.make_splash_mqa_single_device(
        masks.MultiHeadMask([head_mask] * G), attn_logits_soft_cap=cap, interpret=interpret,
        block_sizes=splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block))
    # Splash takes the scale folded into q (the soft cap applies to the scaled scores, as in `attention.softcap`).
    q = (q.astype(jnp.float32) * H ** -0.5).astype(k.dtype)
    q_heads = q.reshape(B, padded, K, G, H).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    k_heads, v_heads = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, H]
    out = per_shard(lambda q, k, v: dispatch.map_leading(kernel, 2)(q, k, v), q_heads, k_heads, v_heads)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, padded, N, H)[:, :T]
