"""Quest (Tang et al., 2024): query-aware page selection from per-page key bounds.

Tokens are grouped into pages of `page_size` consecutive positions. Each page keeps the element-wise minimum
and maximum of its keys; a query's upper bound on any q·k inside the page is Σ_d max(q_d·kmax_d, q_d·kmin_d),
and each query head attends to the tokens of its top-scoring pages.

Shapes: B batch, N query heads, K KV heads, G = N // K, S capacity, H head dim, P page capacity,
M selected slots per head.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from clusterkv_jax import axes
from clusterkv_jax.ops import top_k_indices
from clusterkv_jax.policies.base import FULL_LAYERS_HELP, KVPolicy, option
from clusterkv_jax.policies.common import put_at_slot
from clusterkv_jax.policies.layout import Positions
from clusterkv_jax.selection import Selection


@flax.struct.dataclass
class QuestState:
    """One layer's page index."""

    # [B, K, P, H] float32: element-wise min of the page's keys (0 for unused pages)
    kmin: jax.Array = axes.field("batch", "kv_heads", "pages", "head_dim")
    kmax: jax.Array = axes.field("batch", "kv_heads", "pages", "head_dim")  # [B, K, P, H] float32: element-wise max
    page_start: jax.Array = axes.field("batch", "pages")  # [B, P] int32: first position of the page
    page_len: jax.Array = axes.field("batch", "pages")  # [B, P] int32: tokens in the page, 0 = unused slot
    indexed_upto: jax.Array = axes.field("batch")  # [B] int32: positions [0, indexed_upto) are paged


@dataclasses.dataclass(frozen=True)
class Quest(KVPolicy):
    """Quest page selection.

    Prefill pages the prompt [0, prompt_length) (the last page may be partial). During decoding, as soon as
    `page_size` generated tokens lie past `indexed_upto` they become a new page. Each query head scores every
    page with the upper bound Σ_d max(q_d·kmax_d, q_d·kmin_d) (query head n reads KV head n // G) and attends
    to the tokens of its top `budget // page_size` pages, plus the not-yet-paged generated tokens
    [indexed_upto, length) (fewer than `page_size`, a static window of `page_size` slots).

    `sinks` > 0 always selects the pages holding positions [0, sinks) (they count against the budget). The
    Quest paper has no sinks (sinks=0, the default); models whose first token is an attention sink whatever
    its content need them (docs/research_log.md, "Quest and the attention sink").

    Budget accounting: pages are selected whole, so at most `budget // page_size` pages, i.e. at most
    `budget` tokens (a partial prompt page counts its real tokens only), come from the prompt and from
    already-paged generated tokens, sink pages included. The unpaged tail is attended in full and is not
    counted. With a budget covering every page, every token is attended.
    """

    name = "quest"
    budget: int = option(1024, "tokens attended per step from paged tokens, in whole pages", least=1)
    page_size: int = option(16, "tokens per page", least=1)
    sinks: int = option(0, "always select the pages of the first N tokens (0: none, as in the Quest paper)",
                        least=0)
    full_layers: int = option(2, FULL_LAYERS_HELP, least=0)
    offload: bool = option(False, "keep the selecting layers' K/V in host memory")
    recall_steps: int = option(1, "offload: the device keeps the pages selected in the last N steps", least=0)

    def __post_init__(self):
        super().__post_init__()
        if self.budget < self.page_size:
            raise ValueError(f"budget={self.budget} must be >= page_size={self.page_size} (one whole page)")
        sink_pages = -(-self.sinks // self.page_size)
        if sink_pages > self.budget // self.page_size:
            raise ValueError(f"sinks={self.sinks} need {sink_pages} pages of {self.page_size}; budget={self.budget} "
                             f"holds {self.budget // self.page_size}")

    def num_pages(self, capacity: int) -> int:
        """Static page capacity: prompt pages plus generated pages never exceed ceil(S / page_size) + 1."""
        return -(-capacity // self.page_size) + 1

    def init_state(self, config, batch_size, capacity):
        B, K, H = batch_size, config.num_kv_heads, config.head_dim
        P = self.num_pages(capacity)
        return QuestState(
            kmin=jnp.zeros((B, K, P, H), jnp.float32),
            kmax=jnp.zeros((B, K, P, H), jnp.float32),
            page_start=jnp.zeros((B, P), jnp.int32),
            page_len=jnp.zeros((B, P), jnp.int32),
            indexed_upto=jnp.zeros((B,), jnp.int32),
        )

    def selection_shape(self, config, batch_size, capacity):
        return (batch_size, config.num_heads, min(self.budget // self.page_size, self.num_pages(capacity)),
                self.page_size)

    @property
    def layout(self):
        return Positions(unit=self.page_size)  # whole pages: a page never reads past the store's end

    def metadata_bytes(self, config, context):
        pages = -(-context // self.page_size)
        return config.num_kv_heads * pages * 2 * config.head_dim * 4  # float32 kmin and kmax

    def after_prefill(self, state: QuestState, keys, lengths):
        B, K, S, H = keys.shape
        P, ps = state.kmin.shape[2], self.page_size
        # Pad the store to P whole pages (P * ps >= S + ps) so it reshapes into [B, K, P, ps, H].
        k32 = jnp.pad(keys.astype(jnp.float32), ((0, 0), (0, 0), (0, P * ps - S), (0, 0)))
        pages = k32.reshape(B, K, P, ps, H)
        pos = jnp.arange(P * ps, dtype=jnp.int32).reshape(P, ps)
        valid = pos[None] < lengths[:, None, None]  # [B, P, ps]
        vmask = valid[:, None, :, :, None]  # [B, 1, P, ps, 1]
        kmin = jnp.min(jnp.where(vmask, pages, jnp.inf), axis=3)  # [B, K, P, H]
        kmax = jnp.max(jnp.where(vmask, pages, -jnp.inf), axis=3)
        page_len = jnp.sum(valid, axis=-1, dtype=jnp.int32)  # [B, P]
        used = page_len > 0
        # Unused pages hold 0 rather than ±inf, so scoring them never produces inf * 0 = NaN.
        kmin = jnp.where(used[:, None, :, None], kmin, 0.0)
        kmax = jnp.where(used[:, None, :, None], kmax, 0.0)
        page_start = jnp.where(used, pos[:, 0][None], 0)
        return QuestState(kmin=kmin, kmax=kmax, page_start=page_start, page_len=page_len,
                          indexed_upto=lengths.astype(jnp.int32))

    def window_size(self, capacity: int) -> int:
        return self.page_size

    def window_start(self, state: QuestState, lengths, prompt_lengths):
        return state.indexed_upto

    def recent_due(self, state: QuestState, lengths) -> jax.Array:
        """A sequence with `page_size` stored tokens past `indexed_upto` and a free page slot pages them (before
        the step, so the window holds at most page_size tokens, the new one included)."""
        slot = jnp.sum(state.page_len > 0, axis=-1, dtype=jnp.int32)  # [B] first free page slot
        return (lengths - state.indexed_upto >= self.page_size) & (slot < state.kmin.shape[2])

    def index_due(self, state: QuestState, recent_keys, due, prompt_lengths):
        """The bounds of the page of the `page_size` tokens past `indexed_upto`: what `add_indexed` writes in."""
        rows = recent_keys().astype(jnp.float32)  # [B, K, ps, H]
        return {"kmin": jnp.min(rows, axis=2), "kmax": jnp.max(rows, axis=2)}  # [B, K, H] each

    def add_indexed(self, state: QuestState, added, due) -> QuestState:
        """Each due sequence's new page in its first free slot (in place: one [K, H] slice of the bounds each)."""
        P, ps = state.kmin.shape[2], self.page_size
        start = state.indexed_upto  # [B]
        slot = jnp.minimum(jnp.sum(state.page_len > 0, axis=-1, dtype=jnp.int32), P - 1)  # [B]

        hit = (jnp.arange(P)[None, :] == slot[:, None]) & due[:, None]  # [B, P]
        return QuestState(  # the bounds [B, K, P, H] get the page's [B, K, H] at its slot
            kmin=put_at_slot(state.kmin, added["kmin"][:, :, None], slot, due),
            kmax=put_at_slot(state.kmax, added["kmax"][:, :, None], slot, due),
            page_start=jnp.where(hit, start[:, None], state.page_start),
            page_len=jnp.where(hit, ps, state.page_len),
            indexed_upto=jnp.where(due, start + ps, start),
        )

    def covers(self, capacity: int) -> bool:
        return self.budget // self.page_size >= self.num_pages(capacity)

    def covers_now(self, state: QuestState, lengths, prompt_lengths):
        # Every page is selected; the unpaged tail is the window.
        return jnp.sum(state.page_len > 0, axis=-1) <= self.budget // self.page_size

    def page_scores(self, state: QuestState, q) -> jax.Array:
        """Upper bounds Σ_d max(q_d·kmax_d, q_d·kmin_d) per query head and page -> [B, N, P] (-inf if unused)."""
        B, N, H = q.shape
        K, P = state.kmin.shape[1], state.kmin.shape[2]
        qg = q.astype(jnp.float32).reshape(B, K, N // K, H)  # [B, K, G, H]
        # kmax >= kmin, so max(q_d·kmax_d, q_d·kmin_d) takes kmax where q_d > 0 and kmin where q_d < 0:
        # two einsums instead of a [B, K, G, P, H] product.
        pos = jnp.einsum("BKGH,BKPH->BKGP", jnp.maximum(qg, 0.0), state.kmax)
        neg = jnp.einsum("BKGH,BKPH->BKGP", jnp.minimum(qg, 0.0), state.kmin)
        scores = (pos + neg).reshape(B, N, P)
        return jnp.where(state.page_len[:, None, :] > 0, scores, -jnp.inf)

    def select(self, state: QuestState, q, keys, lengths, prompt_lengths) -> Selection:
        """Each query head's top pages, as chunks of `page_size` rows starting at each page's first position:
        [B, N, n_pages] starts, [B, N, n_pages, page_size] mask (partial and unused pages masked)."""
        B, N, _ = q.shape
        P, ps = state.kmin.shape[2], self.page_size
        n_pages = min(self.budget // ps, P)
        scores = self.page_scores(state, q)  # [B, N, P]
        if self.sinks:
            # Sink pages outrank every other page (unused slots keep -inf).
            sink = (state.page_start < self.sinks) & (state.page_len > 0)  # [B, P]
            scores = jnp.where(sink[:, None, :], jnp.inf, scores)
        top = top_k_indices(scores, n_pages)  # [B, N, n_pages]
        start = jnp.take_along_axis(jnp.broadcast_to(state.page_start[:, None, :], (B, N, P)), top, axis=2)
        plen = jnp.take_along_axis(jnp.broadcast_to(state.page_len[:, None, :], (B, N, P)), top, axis=2)
        mask = jnp.arange(ps, dtype=jnp.int32) < plen[..., None]  # [B, N, n_pages, ps]
        return Selection(starts=start, mask=mask, chunk=ps)
