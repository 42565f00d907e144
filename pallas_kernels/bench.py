"""Time the Pallas kernels against their pure-jnp references at realistic ClusterKV shapes.

    python -m pallas_kernels.bench [--repeats 5]

Median wall time of `--repeats` runs after a warm-up (compile) run, each ended by block_until_ready. On a
machine without a CUDA GPU (compute capability >= 8.0) only the references are timed.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.centroid_update import centroid_update, centroid_update_reference
from pallas_kernels.cluster_index import cluster_to_block_index, cluster_to_block_index_reference
from pallas_kernels.decode_attention import decode_attention, decode_attention_reference
from pallas_kernels.dispatch import kernels_supported
from pallas_kernels.kmeans_assign import kmeans_assign, kmeans_assign_reference
from pallas_kernels.selected_attention import selected_attention, selected_attention_reference

P, N, C, M = 8, 32768, 400, 1024  # KV heads (× batch 1), tokens, clusters, budget
Mb = 80  # ClusterKV's block slots at B=1024 (16 sinks, blocks of 16, 80 tokens per cluster)


def _median_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _centroid_inputs(rng: np.random.Generator, H: int, dtype):
    keys = jnp.asarray(rng.standard_normal((P, N, H), np.float32), dtype)
    labels = rng.integers(0, C, (P, N)).astype(np.int32)
    labels[:, N - N // 8 :] = C  # a padded tail, as K-means marks masked tokens
    return keys, jnp.asarray(labels)


def _index_inputs(rng: np.random.Generator):
    """Ranked cluster sizes and first blocks [P, Mb] as ClusterKV's top_k hands them over."""
    sizes = rng.integers(1, 200, (P, Mb)).astype(np.int32)
    starts = rng.permutation(np.arange(P * Mb)).reshape(P, Mb).astype(np.int32)
    return jnp.asarray(sizes), jnp.asarray(starts)


def _row(name: str, shapes: str, ref_ms: float, kernel_ms: float | None, err: str = "") -> None:
    if kernel_ms is None:
        print(f"{name:24s} {shapes:34s} reference {ref_ms:9.3f} ms   kernel      (n/a)")
    else:
        print(
            f"{name:24s} {shapes:34s} reference {ref_ms:9.3f} ms   kernel {kernel_ms:9.3f} ms   "
            f"speed-up {ref_ms / kernel_ms:6.2f}x  {err}"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    on_gpu = kernels_supported(device)
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind}); median of {args.repeats} runs")
    if not on_gpu:
        print("kernels: not timed, they need a CUDA GPU with compute capability >= 8.0 (sm80+); references only")
    rng = np.random.default_rng(0)

    for H in (128, 64):
        for dtype in (jnp.float32, jnp.bfloat16):
            keys, labels = _centroid_inputs(rng, H, dtype)
            ref = functools.partial(centroid_update_reference, num_clusters=C)
            ref_ms = _median_ms(ref, keys, labels, repeats=args.repeats)
            kernel_ms, err = None, ""
            if on_gpu:
                kern = functools.partial(centroid_update, num_clusters=C)
                kernel_ms = _median_ms(kern, keys, labels, repeats=args.repeats)
                (s, c), (rs, rc) = kern(keys, labels), ref(keys, labels)
                err = f"max|Δsum| {float(jnp.max(jnp.abs(s - rs))):.2e}, counts equal {bool(jnp.all(c == rc))}"
            _row(f"centroid_update C={C}", f"{jnp.dtype(dtype).name}[{P},{N},{H}]", ref_ms, kernel_ms, err)

    # One K-means assignment step of a 32k prompt's keys (unit vectors) to C clusters, 8 KV heads.
    for H in (128, 64):
        unit = rng.standard_normal((P, N, H)).astype(np.float32)
        unit = jnp.asarray(unit / np.linalg.norm(unit, axis=-1, keepdims=True))
        directions = jnp.asarray(np.asarray(unit)[:, :: N // C][:, :C])
        valid, allowed = jnp.ones((P, N), bool), jnp.ones((P, C), bool)
        ref_ms = _median_ms(kmeans_assign_reference, unit, valid, directions, allowed, repeats=args.repeats)
        kernel_ms, err = None, ""
        if on_gpu:
            kernel_ms = _median_ms(kmeans_assign, unit, valid, directions, allowed, repeats=args.repeats)
            same = kmeans_assign(unit, valid, directions, allowed) == kmeans_assign_reference(unit, valid, directions,
                                                                                               allowed)
            err = f"labels equal {float(jnp.mean(same)):.4f}"
        _row(f"kmeans_assign C={C}", f"float32[{P},{N},{H}]", ref_ms, kernel_ms, err)

    sizes, starts = _index_inputs(rng)
    ref = functools.partial(cluster_to_block_index_reference, tokens=M - 16, slots=Mb, block_size=16)
    ref_ms = _median_ms(ref, sizes, starts, repeats=args.repeats)
    kernel_ms, err = None, ""
    if on_gpu:
        kern = functools.partial(cluster_to_block_index, tokens=M - 16, slots=Mb, block_size=16)
        kernel_ms = _median_ms(kern, sizes, starts, repeats=args.repeats)
        (b, r), (rb, rr) = kern(sizes, starts), ref(sizes, starts)
        err = f"blocks equal {bool(jnp.all(b == rb))}, rows equal {bool(jnp.all(r == rr))}"
    _row("cluster_to_block_index", f"P={P} Mb={Mb} B={M}", ref_ms, kernel_ms, err)

    # One layer's decode attention over 101 pages of 16 rows per head (81 selected + the 20-page window) from a
    # store of 8 KV heads x 32k rows of 128, per query head (h=32, G=1) and shared (h=8, G=4).
    pages = P * N // 16
    for h, G in ((32, 1), (8, 4)):
        for dtype in (jnp.bfloat16, jnp.float32):
            q = jnp.asarray(rng.standard_normal((1, h, G, 128), np.float32), dtype)
            k, v = (jnp.asarray(rng.standard_normal((pages, 16, 128), np.float32), dtype) for _ in range(2))
            table = jnp.asarray(rng.integers(0, pages, (1, h, 101)), jnp.int32)
            mask = jnp.asarray(rng.random((1, h, 101, 16)) < 0.95)
            ref_ms = _median_ms(selected_attention_reference, q, k, v, table, mask, repeats=args.repeats)
            kernel_ms, err = None, ""
            if on_gpu:
                kernel_ms = _median_ms(selected_attention, q, k, v, table, mask, repeats=args.repeats)
                diff = jnp.abs(selected_attention(q, k, v, table, mask)
                               - selected_attention_reference(q, k, v, table, mask))
                err = f"max|Δ| {float(jnp.max(diff)):.2e}"
            _row(f"selected_attention G={G}", f"{jnp.dtype(dtype).name} h={h} 101x16 rows", ref_ms, kernel_ms, err)

    # One full layer's decode attention (Llama-3-8B: 8 KV heads of 4 query heads, 128 dims, bfloat16) over the
    # caches `bench decode` sizes for 32k and 128k, batch 1, the last 24 rows not yet written: what
    # `kernels.AUTO_ON_GPU["decode_attention"]` is to be chosen by (XLA's form, or JAX's flash-decoding kernel).
    for rows in (33280, 133120):
        q = jnp.asarray(rng.standard_normal((1, 8, 4, 128), np.float32), jnp.bfloat16)
        k, v = (jnp.asarray(rng.standard_normal((1, 8, rows, 128), np.float32), jnp.bfloat16) for _ in range(2))
        lengths = jnp.full((1, 8), rows - 24, jnp.int32)
        ref = jax.jit(decode_attention_reference)
        ref_ms = _median_ms(ref, q, k, v, lengths, repeats=args.repeats)
        kernel_ms, err = None, ""
        if on_gpu:
            kern = jax.jit(decode_attention)
            kernel_ms = _median_ms(kern, q, k, v, lengths, repeats=args.repeats)
            err = f"max|Δ| {float(jnp.max(jnp.abs(kern(q, k, v, lengths) - ref(q, k, v, lengths)))):.2e}"
        _row("decode_attention G=4", f"bfloat16 K=8 S={rows}", ref_ms, kernel_ms, err)


if __name__ == "__main__":
    main()
