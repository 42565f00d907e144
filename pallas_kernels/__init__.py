"""Pallas (Triton) GPU kernels for ClusterKV's two hot spots, each beside a pure-jnp reference and a Mosaic TPU
version (`*_tpu`).

- `centroid_update`: per-cluster key sums and member counts (the K-means centroid accumulation);
  `centroid_update_tpu` the same on a TPU (a one-hot matrix product on the MXU).
- `cluster_to_block_index`: budget slots → store blocks (and rows read in each) from clusters in score order;
  `cluster_to_block_index_tpu` the same with triangular products and [slots, clusters] masks.
- `kmeans_assign`: K-means' assignment, each key's most similar cluster, with the similarities kept on chip (GPU
  only: on a TPU XLA's product runs).
- `decode_attention`: full decode attention split over the sequence (flash-decoding), JAX's own Pallas GPU kernel
  mapped over the (sequence, KV head) pairs.
- `selected_attention`: decode attention straight from the store through a page table per selection head
  (online softmax over the selected pages and the window; no gathered copy); `selected_attention_tpu` the same
  on a TPU (the page table as a scalar-prefetch operand, one page per grid step).

`dispatch` says which device the kernels are chosen for and what it supports (`clusterkv_jax.kernels` picks an
implementation from that, in one place); `check_lowering` lowers every kernel for CUDA (and the TPU ones for
TPU) without either device; `bench` times kernels against references.
"""

from pallas_kernels.centroid_update import centroid_update, centroid_update_reference
from pallas_kernels.centroid_update_tpu import centroid_update_tpu
from pallas_kernels.cluster_index import cluster_to_block_index, cluster_to_block_index_reference
from pallas_kernels.cluster_index_tpu import cluster_to_block_index_tpu
from pallas_kernels.decode_attention import decode_attention, decode_attention_reference
from pallas_kernels.dispatch import kernels_supported, on_tpu
from pallas_kernels.kmeans_assign import kmeans_assign, kmeans_assign_reference
from pallas_kernels.selected_attention import selected_attention, selected_attention_reference
from pallas_kernels.selected_attention_tpu import selected_attention_tpu

__all__ = [
    "centroid_update",
    "centroid_update_reference",
    "centroid_update_tpu",
    "cluster_to_block_index",
    "cluster_to_block_index_reference",
    "cluster_to_block_index_tpu",
    "decode_attention",
    "decode_attention_reference",
    "kernels_supported",
    "kmeans_assign",
    "kmeans_assign_reference",
    "on_tpu",
    "selected_attention",
    "selected_attention_reference",
    "selected_attention_tpu",
]
