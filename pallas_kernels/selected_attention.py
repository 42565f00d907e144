"""Decode attention straight from the KV store through a page table, as a Pallas Triton kernel.

A decode step of a selecting policy attends, per selection head, to a few dozen pages (ClusterKV's blocks of a
cluster's members, Quest's pages, the window's ring) scattered over the layer's store. The pure-JAX path gathers
those rows into a new array and then attends (two passes over the bytes through memory); this kernel reads each
page where it lies, through the page table, with an online softmax (one softmax over all the pages, as jax's
`pallas/ops/gpu/paged_attention.py` does; unlike there, every selection head has its own table).

Per program (sequence b, selection head s): the G query rows of that head (G = 1 for a selection per query
head, the KV head's G query heads for a shared one), pages[b, s, :] (indices into the store seen as pages
[P, c, H]) and which of each page's c rows count (mask). Pages are visited `block_pages` at a time. The scores
are multiply-reduce products (G is 1-8 at decode: below the 16 rows a matrix-unit dot needs). Rows whose mask is
off get no weight; a head with no row at all gets zeros.

`selected_attention` maps the kernel over (B, h) as its grid; `selected_attention_reference` is the pure-jnp
semantics (gather, then one masked softmax).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dispatch import next_pow2

_NEG = -1e30  # finite: a fully masked block keeps m finite (exp(-inf + inf) would be NaN)


def _selected_attention_kernel(
    q_ref,  # [G, H] this head's query rows (padded to a power of two)
    k_ref,  # [P, c, H] the store as pages
    v_ref,  # [P, c, H]
    pages_ref,  # [n] int32 the pages this head reads (padded to whole groups of block_pages)
    mask_ref,  # [n, c] int32 1 for the rows that count
    o_ref,  # [G, H] float32
    *,
    block_pages: int,
    scale: float,
):
    G, H = q_ref.shape
    c = k_ref.shape[1]
    rows = block_pages * c
    q = q_ref[...].astype(jnp.float32) * scale

    def body(i, carry):
        o, m, l = carry
        group = pl.ds(i * block_pages, block_pages)
        pages = pages_ref[group]  # [block_pages]
        k = k_ref[pages].reshape(rows, H).astype(jnp.float32)
        v = v_ref[pages].reshape(rows, H).astype(jnp.float32)
        valid = mask_ref[group, :].reshape(rows) > 0
        s = jnp.where(valid[None, :], jnp.sum(q[:, None, :] * k[None, :, :], axis=-1), _NEG)  # [G, rows]
        m_next = jnp.maximum(m, jnp.max(s, axis=-1))
        correction = jnp.exp(m - m_next)
        p = jnp.where(valid[None, :], jnp.exp(s - m_next[:, None]), 0.0)
        l_next = correction * l + jnp.sum(p, axis=-1)
        o_next = correction[:, None] * o + jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
        return o_next, m_next, l_next

    init = (jnp.zeros((G, H), jnp.float32), jnp.full((G,), _NEG, jnp.float32), jnp.zeros((G,), jnp.float32))
    o, _, l = lax.fori_loop(0, pages_ref.shape[0] // block_pages, body, init)
    o_ref[...] = jnp.where(l[:, None] > 0, o / jnp.maximum(l, 1e-30)[:, None], 0.0)


def _check(q, k_pages, v_pages, pages, mask):
    B, h, G, H = q.shape
    assert k_pages.shape == v_pages.shape and k_pages.ndim == 3 and k_pages.shape[2] == H, (k_pages.shape, q.shape)
    assert pages.shape[:2] == (B, h) and mask.shape == (*pages.shape, k_pages.shape[1]), (pages.shape, mask.shape)


@functools.partial(jax.jit, static_argnames=("block_pages", "num_warps", "interpret"))
def selected_attention(
    q: jax.Array,  # [B, h, G, H] the query rows of each selection head
    k_pages: jax.Array,  # [P, c, H] the store as pages of c rows
    v_pages: jax.Array,  # [P, c, H]
    pages: jax.Array,  # [B, h, n] int32 in [0, P)
    mask: jax.Array,  # [B, h, n, c] bool: the rows that count
    *,
    block_pages: int = 4,
    num_warps: int = 4,
    interpret: bool = False,
) -> jax.Array:
    """[B, h, G, H] float32: each selection head's queries attended over its pages' valid rows, one softmax
    (zeros where no row is valid). Equal to `selected_attention_reference` up to float32 rounding."""
    _check(q, k_pages, v_pages, pages, mask)
    B, h, G, H = q.shape
    n, c = pages.shape[2], k_pages.shape[1]
    assert c >= 1 and c & (c - 1) == 0 and H & (H - 1) == 0, f"page rows c={c} and head dim H={H}: powers of two"
    assert block_pages >= 1 and block_pages & (block_pages - 1) == 0, f"block_pages={block_pages}"
    g_pad, n_pad = next_pow2(G), pl.cdiv(n, block_pages) * block_pages
    q = jnp.pad(q, ((0, 0), (0, 0), (0, g_pad - G), (0, 0)))
    pages = jnp.pad(jnp.clip(pages.astype(jnp.int32), 0, k_pages.shape[0] - 1), ((0, 0), (0, 0), (0, n_pad - n)))
    mask = jnp.pad(mask.astype(jnp.int32), ((0, 0), (0, 0), (0, n_pad - n), (0, 0)))
    P = k_pages.shape[0]
    out = pl.pallas_call(
        functools.partial(_selected_attention_kernel, block_pages=block_pages, scale=1.0 / H ** 0.5),
        grid=(B, h),
        in_specs=[
            pl.BlockSpec((None, None, g_pad, H), lambda b, s: (b, s, 0, 0)),  # q
            pl.BlockSpec((P, c, H), lambda b, s: (0, 0, 0)),  # k pages: the whole store, read through the table
            pl.BlockSpec((P, c, H), lambda b, s: (0, 0, 0)),  # v pages
            pl.BlockSpec((None, None, n_pad), lambda b, s: (b, s, 0)),  # this head's page table
            pl.BlockSpec((None, None, n_pad, c), lambda b, s: (b, s, 0, 0)),  # its row mask
        ],
        out_specs=pl.BlockSpec((None, None, g_pad, H), lambda b, s: (b, s, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, h, g_pad, H), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="selected_attention",
    )(q, k_pages, v_pages, pages, mask)
    return out[:, :, :G]


@jax.jit
def selected_attention_reference(q, k_pages, v_pages, pages, mask):
    """Pure jnp, the same problem: gather each head's pages, one masked softmax -> [B, h, G, H] float32."""
    _check(q, k_pages, v_pages, pages, mask)
    B, h, G, H = q.shape
    n, c = pages.shape[2], k_pages.shape[1]
    k = k_pages[pages].reshape(B, h, n * c, H).astype(jnp.float32)
    v = v_pages[pages].reshape(B, h, n * c, H).astype(jnp.float32)
    valid = mask.reshape(B, h, 1, n * c)
    s = jnp.where(valid, jnp.einsum("BhGH,BhRH->BhGR", q.astype(jnp.float32), k) / H ** 0.5, -jnp.inf)
    p = jnp.where(valid, jax.nn.softmax(s, axis=-1), 0.0)  # a head with no valid row: NaN -> 0
    return jnp.einsum("BhGR,BhRH->BhGH", jnp.nan_to_num(p), v)
