"""Decode attention straight from the KV store through a page table, as a Pallas Mosaic (TPU) kernel.

The TPU version of `selected_attention` (same arguments, same result): each selection head attends to its
pages of the store (ClusterKV's blocks, the window's ring as more pages) with one online softmax, reading each
page where it lies. On a TPU the store stays in HBM and the page table is a scalar-prefetch operand: grid step
(b, s, i) DMAs page pages[b, s, i] into VMEM through its BlockSpec's index map (Pallas double-buffers the
next page while this one is scored), as jax's `pallas/ops/tpu/paged_attention` does per sequence; here every
selection head has its own table. The running max, sum and output live in VMEM scratch across the page axis
("arbitrary"); the scores and the weighted sum are matrix-unit dots ([G, H] x [c, H]^T and [G, c] x [c, H]).
The running max and sum are kept lane-replicated ([G, 128]), as jax's TPU flash attention keeps them.

`selected_attention_tpu(..., interpret=True)` runs Pallas's TPU interpreter (any device; tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.selected_attention import _check

_NEG = -1e30  # finite: a fully masked page keeps m finite (exp(-inf + inf) would be NaN)
_LANES = 128


def _selected_attention_tpu_kernel(
    pages_ref,  # [B, h, n] int32 in SMEM (scalar prefetch): the page table, read by the index maps
    q_ref,  # [G, H] this head's query rows
    k_ref,  # [c, H] page pages[b, s, i] of the store
    v_ref,  # [c, H]
    mask_ref,  # [n, c] int32 this head's row mask (1: the row counts)
    o_ref,  # [G, H] float32
    m_ref,  # [G, 128] float32 scratch: running max, lane-replicated
    l_ref,  # [G, 128] float32 scratch: running sum of weights, lane-replicated
    acc_ref,  # [G, H] float32 scratch: running weighted sum of values
    *,
    scale: float,
):
    del pages_ref  # used by the index maps only
    i = pl.program_id(2)

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    q = q_ref[...].astype(jnp.float32) * scale
    k = k_ref[...].astype(jnp.float32)
    v = v_ref[...].astype(jnp.float32)
    valid = mask_ref[pl.ds(i, 1), :] > 0  # [1, c]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [G, c]
    s = jnp.where(valid, s, _NEG)
    m_prev = m_ref[...]  # [G, 128]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [G, 128]
    correction = jnp.exp(m_prev - m_next)  # [G, 128]
    p = jnp.where(valid, jnp.exp(s - m_next[:, :1]), 0.0)  # [G, c]
    l_ref[...] = correction * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    pv = lax.dot_general(p, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)  # [G, H]
    acc_ref[...] = correction[:, :1] * acc_ref[...] + pv
    m_ref[...] = m_next

    @pl.when(i == pl.num_programs(2) - 1)
    def _finish():
        l = l_ref[...][:, :1]  # [G, 1]
        o_ref[...] = jnp.where(l > 0, acc_ref[...] / jnp.maximum(l, 1e-30), 0.0)


@functools.partial(jax.jit, static_argnames=("interpret",))
def selected_attention_tpu(
    q: jax.Array,  # [B, h, G, H] the query rows of each selection head
    k_pages: jax.Array,  # [P, c, H] the store as pages of c rows
    v_pages: jax.Array,  # [P, c, H]
    pages: jax.Array,  # [B, h, n] int32 in [0, P)
    mask: jax.Array,  # [B, h, n, c] bool: the rows that count
    *,
    interpret: bool = False,
) -> jax.Array:
    """[B, h, G, H] float32: each selection head's queries attended over its pages' valid rows, one softmax
    (zeros where no row is valid). Equal to `selected_attention_reference` up to float32 rounding."""
    _check(q, k_pages, v_pages, pages, mask)
    B, h, G, H = q.shape
    n, c = pages.shape[2], k_pages.shape[1]
    g_pad = max(8, -(-G // 8) * 8)  # whole sublane tiles
    q = jnp.pad(q, ((0, 0), (0, 0), (0, g_pad - G), (0, 0)))
    pages = jnp.clip(pages.astype(jnp.int32), 0, k_pages.shape[0] - 1)
    page_spec = pl.BlockSpec((None, c, H), lambda b, s, i, pages_ref: (pages_ref[b, s, i], 0, 0))
    out = pl.pallas_call(
        functools.partial(_selected_attention_tpu_kernel, scale=1.0 / H ** 0.5),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, h, n),
            in_specs=[
                pl.BlockSpec((None, None, g_pad, H), lambda b, s, i, pages_ref: (b, s, 0, 0)),  # q
                page_spec,  # k: one page per step, chosen by the table
                page_spec,  # v
                pl.BlockSpec((None, None, n, c), lambda b, s, i, pages_ref: (b, s, 0, 0)),  # this head's mask
            ],
            out_specs=pl.BlockSpec((None, None, g_pad, H), lambda b, s, i, pages_ref: (b, s, 0, 0)),
            scratch_shapes=[pltpu.VMEM((g_pad, _LANES), jnp.float32), pltpu.VMEM((g_pad, _LANES), jnp.float32),
                            pltpu.VMEM((g_pad, H), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((B, h, g_pad, H), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="selected_attention_tpu",
    )(pages, q, k_pages, v_pages, mask.astype(jnp.int32))
    return out[:, :, :G]
