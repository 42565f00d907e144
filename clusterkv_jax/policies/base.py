"""The interface every KV selection policy implements.

A policy is a frozen dataclass (hashable, so it is a static argument of `jax.jit`). Layers [0, full_layers)
attend to the whole cache and never reach it; in layers [full_layers, L) the model calls its hooks inside a
`lax.scan` over those layers, one layer at a time, so everything is traced (static shapes, no Python branching
on array values). A new policy is one module implementing `init_state`, `select` and the declarations below.

At prefill, per selecting layer: `observe_queries` (only with `prompt_queries` > 0: the prompt's last queries,
as SnapKV and InfiniGen need), then `after_prefill` (index the prompt's keys), then `prompt_rows` (layout).

Per decode step, for each selecting layer, `decode_attention` (generic, below) runs:

1. `index_recent`: the policy may index the window of recent tokens it has not indexed yet (and
   `commit_recent` move them in its store);
2. `select`: the budgeted selection, a `store.Selection` of chunks of rows (or rows and a mask [B, h, M]);
3. the layer's store reads the selected rows and the window rows (`clusterkv_jax.store`: device memory or,
   with `offload`, host memory with a device recall cache: the policy does not see the difference);
4. one softmax over the selection and the window (`attention.selection_and_window_attention`).

Layout: by default row r of a layer's store holds position r. A policy may arrange its layers otherwise
(ClusterKV keeps each cluster's members in consecutive rows, so a selection reads whole blocks) through
`store_rows`, `prompt_rows`, `token_rows`, `commit_recent` and `selection_positions`; the defaults keep
positions.

Budget rule (the same for every policy): a budget B counts every token attended from the prompt and from
already-indexed generated tokens, attention sinks included; generated tokens a policy has not yet indexed
(its window) are attended in full and reported separately.

Shapes: B batch, N query heads, K KV heads, G = N // K, S capacity, H head dim, h selection heads (N, or K
for one selection per KV head shared by its G query heads), M selected slots, W window slots.
"""

from __future__ import annotations

import dataclasses
import math
from numbers import Integral, Real
from typing import Any

import jax
import jax.numpy as jnp

from clusterkv_jax.attention import selection_and_window_attention
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.ops import multi_device_axes
from clusterkv_jax.policies.common import recent_window, ring_window_mask
from clusterkv_jax.store import Selection, as_selection


class KVPolicy:
    """Base class. Subclasses are `@dataclasses.dataclass(frozen=True)`."""

    #: Layers [0, full_layers) attend to every token; the policy selects in layers [full_layers, L).
    full_layers: int = 0
    #: Keep the K/V of the layers this policy selects in host memory (`pinned_host`; see clusterkv_jax.offload).
    offload: bool = False
    #: Offload only: the device keeps the rows selected in the last `cache_steps` steps (0: no cache).
    cache_steps: int = 0
    #: `select` scores every cached key (it gets the layer's keys [B, K, S, H]; others get None). Such a policy
    #: cannot offload: it would read the whole host store every step.
    reads_all_keys: bool = False
    #: The window's tokens sit in store rows [0, W), row = position % W (see `token_rows`), so a step reads the
    #: window as one slice of the store (`view.ring`) instead of gathering its rows.
    ring_window: bool = False
    #: n > 0: prefill hands `observe_queries` the post-RoPE queries of each prompt's last n tokens before
    #: `after_prefill` (SnapKV scores the prompt by them, InfiniGen skews its channels by them).
    prompt_queries: int = 0

    #: The least value of the common int fields a policy declares (checked by `__post_init__`).
    _AT_LEAST = {"budget": 1, "full_layers": 0, "cache_steps": 0}

    def __post_init__(self):
        """Checks that every field declared int holds an integer and every float field a finite number, so a
        budget of 512.0 or a NaN tolerance is refused here instead of failing deep inside JAX, and the common
        fields' ranges (`_AT_LEAST`). Subclasses that check more call this first."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
            if kind == "int" and (isinstance(value, bool) or not isinstance(value, Integral)):
                raise TypeError(f"{type(self).__name__}.{field.name} must be an int, got {value!r}")
            if kind == "float" and (isinstance(value, bool) or not isinstance(value, Real)
                                    or not math.isfinite(value)):
                raise TypeError(f"{type(self).__name__}.{field.name} must be a finite number, got {value!r}")
            least = self._AT_LEAST.get(field.name)
            if least is not None and value < least:
                raise ValueError(f"{field.name} must be >= {least}, got {value}")

    # ---- What the model, the offload path and the benchmarks need to know (static) ----------------------

    def offloads(self, selecting: bool) -> bool:
        """Whether a group of layers (selecting ones, or full ones) keeps its K/V in host memory."""
        return self.offload and selecting

    def selection_shape(self, config: ModelConfig, batch_size: int, capacity: int) -> tuple[int, int, int, int]:
        """(B, h, n, chunk): `select` picks n chunks of `chunk` rows per selection head (chunk 1 for rows)."""
        raise NotImplementedError

    def store_rows(self, capacity: int) -> int:
        """Rows of a selecting layer's store for a capacity of `capacity` positions (default: one per position)."""
        return capacity

    def window_size(self, capacity: int) -> int:
        """Static slots of the window of unindexed recent tokens [window_start, length) (0: no window)."""
        return 0

    def metadata_bytes(self, config: ModelConfig, context: int) -> int:
        """Bytes of index (centroids, page bounds) one decode step reads per sequence and selecting layer."""
        return 0

    # ---- Traced hooks, one layer at a time -------------------------------------------------------------

    def init_state(self, config: ModelConfig, batch_size: int, capacity: int) -> Any:
        """One layer's empty state: a pytree of arrays."""
        raise NotImplementedError

    def init_states(self, config: ModelConfig, batch_size: int, capacity: int, layers: range) -> Any:
        """The states of model layers `layers`, stacked on a leading axis (the scan hands each layer its own)."""
        one = self.init_state(config, batch_size, capacity)
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (len(layers),) + x.shape), one)

    def observe_queries(self, state: Any, queries: jax.Array, found: jax.Array) -> Any:
        """Only when `prompt_queries` = n > 0: queries [B, N, n, H] (post-RoPE) whose slot j holds position
        prompt_length - n + j where found [B, n] (slots before position 0 are never found). A prefill calls it
        once before `after_prefill`, a chunked prefill once per chunk with the slots that chunk computed: keep
        the found slots, leave the others as they were. Returns the state."""
        return state

    def after_prefill(self, state: Any, keys: jax.Array, lengths: jax.Array) -> Any:
        """Indexes one layer's prompt keys [B, K, S, H] (rows >= lengths[b] are padding); returns its state."""
        return state

    def prompt_rows(self, state: Any) -> jax.Array | None:
        """After `after_prefill`: the position each store row holds, [B, K, R] (-1: empty), or None for row =
        position."""
        return None

    def token_rows(self, state: Any, positions: jax.Array, capacity: int) -> jax.Array:
        """The store rows of tokens at positions [B, ...] (same shape; a position past `capacity` maps out of
        range, so its write is dropped)."""
        return positions

    def commit_recent(self, old_state: Any, new_state: Any, kv):
        """After `index_recent` changed the state: move what it indexed in the store; returns the store view."""
        return kv

    def selection_positions(self, state: Any, selection: Selection) -> jax.Array:
        """The positions [B, h, n * chunk] of a selection's rows (the recall evaluation compares positions)."""
        return selection.rows()

    def window_start(self, state: Any, lengths: jax.Array, prompt_lengths: jax.Array) -> jax.Array:
        """[B] first position of the window (positions below it are indexed, or sinks)."""
        return lengths

    def index_recent(self, state: Any, recent_keys, lengths: jax.Array, prompt_lengths: jax.Array) -> Any:
        """Indexes the window's tokens once enough have accumulated. `recent_keys()` returns the keys of
        positions [window_start, window_start + W) as [B, K, W, H]; call it only when needed."""
        return state

    def decode_changed_state(self, old_state: Any, new_state: Any) -> jax.Array | None:
        """Whether a decode step's `decode_attention` changed a layer's state (a traced bool), so the model
        writes the state back only then; None (the default): it may have, write it every step."""
        return None

    def select(
        self,
        state: Any,
        q: jax.Array,  # [B, N, H] post-RoPE queries of the new token
        keys: jax.Array | None,  # [B, K, S, H] the layer's keys when `reads_all_keys`, else None
        lengths: jax.Array,  # [B] valid rows, the new token included
        prompt_lengths: jax.Array,  # [B]
    ) -> Selection | tuple[jax.Array, jax.Array]:
        """The budgeted selection (the B tokens counted by the budget, sinks included; not the window), per
        selection head h = N (a selection per query head) or h = K (one per KV head, shared by its query heads):
        a `store.Selection` of chunks of store rows, or rows idx [B, h, M] and a validity mask [B, h, M].
        Used by `decode_attention` and the recall evaluation."""
        raise NotImplementedError

    def selected_positions(self, state: Any, q: jax.Array, keys: jax.Array | None, lengths: jax.Array,
                           prompt_lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`select` as token positions and a mask, [B, h, M], whatever the store layout (evaluation, tests)."""
        selection = as_selection(self.select(state, q, keys, lengths, prompt_lengths))
        return self.selection_positions(state, selection), selection.flat_mask()

    # ---- The decode step of a selecting layer (generic) ------------------------------------------------

    def index_window(self, state: Any, kv, lengths: jax.Array, prompt_lengths: jax.Array, rows_of=None) -> Any:
        """`index_recent` with the window's keys read from the layer's store view `kv`; `rows_of(positions)` gives
        their rows (default: `token_rows`, this policy's own layout)."""
        W = self.window_size(kv.positions)
        if not W:
            return state
        start = self.window_start(state, lengths, prompt_lengths)
        if rows_of is None:
            rows_of = lambda p: self.token_rows(state, p, kv.positions)  # noqa: E731

        def recent_keys():
            positions = jnp.minimum(start[:, None] + jnp.arange(W), kv.positions - 1)  # [B, W]
            return kv.window(rows_of(positions))[0]

        return self.index_recent(state, recent_keys, lengths, prompt_lengths)

    def _attends_in_place(self, kv, selection: Selection, window: int) -> bool:
        """On the Pallas kernel path (a policy with a `kernel` switch resolved to "pallas", "tpu", or "interpret" in
        tests), a device store, a ring window (or none) and no multi-device mesh (the page table addresses the
        whole store; under a mesh the rows are gathered per shard as before): attend straight from the store
        (`DeviceLayer.attend_in_place`) instead of gathering the rows first."""
        return (getattr(self, "kernel", None) in ("pallas", "tpu", "interpret") and hasattr(kv, "attend_in_place")
                and (not window or self.ring_window) and kv.can_attend_in_place(selection, window)
                and multi_device_axes() is None)

    def _attends_tiled(self, kv, selection: Selection, window: int) -> bool:
        """Off the kernel path, a device store whose selected rows outgrow two tiles (`DeviceLayer.tiles_for`), a
        ring window (or none), no multi-device mesh: on the CPU, read and attend a tile of (sequence, KV head)
        pairs at a time (`DeviceLayer.attend_tiled`)."""
        return (hasattr(kv, "attend_tiled") and (not window or self.ring_window) and multi_device_axes() is None
                and kv.tiles_for(selection) > 1)

    def decode_attention(self, state: Any, q: jax.Array, kv, lengths: jax.Array, prompt_lengths: jax.Array):
        """One layer's decode attention over the selection and the window, from the store view `kv` (this
        layer, the new token's row written). Returns (output [B, N, H] float32, state, kv)."""
        with jax.named_scope("index"):
            indexed = self.index_window(state, kv, lengths, prompt_lengths)
            kv, state = self.commit_recent(state, indexed, kv), indexed
        with jax.named_scope("select"):
            keys = kv.keys() if self.reads_all_keys else None
            selection = as_selection(self.select(state, q, keys, lengths, prompt_lengths))
        W = self.window_size(kv.positions)
        start = self.window_start(state, lengths, prompt_lengths) if W else None
        ring_mask = ring_window_mask(lengths, start, W, kv.positions) if W and self.ring_window else None
        if self._attends_in_place(kv, selection, W):
            with jax.named_scope("attend"):
                return kv.attend_in_place(q, selection, W, ring_mask, kernel=self.kernel), state, kv

        def gathered(kv):  # read the selected rows and the window's, then one softmax over both
            k_sel, v_sel, sel_mask, kv = kv.read(selection)
            k_win = v_win = w_mask = None
            if W:
                with jax.named_scope("window"):
                    if self.ring_window:
                        (k_win, v_win), w_mask = kv.ring(W), ring_mask
                    else:
                        positions, w_mask = recent_window(lengths, start, W)
                        k_win, v_win = kv.window(self.token_rows(state, positions, kv.positions))
            with jax.named_scope("attend"):
                return selection_and_window_attention(q, k_sel, v_sel, sel_mask, k_win, v_win, w_mask), kv

        if self._attends_tiled(kv, selection, W):
            # A platform choice at lowering: tiles are for a CPU's cache; elsewhere a loop only serializes the work.
            out = jax.lax.platform_dependent(cpu=lambda: kv.attend_tiled(q, selection, W, ring_mask),
                                             default=lambda: gathered(kv)[0])
            return out, state, kv
        out, kv = gathered(kv)
        return out, state, kv


class PromptBudgetPolicy(KVPolicy):
    """A policy whose budget covers prompt tokens only (`budget` field): `select` picks min(budget, S) prompt
    tokens per query head, and it never indexes generated tokens, so all of them, [prompt_length, length), are
    attended outside the budget through a static window of the whole capacity (masked past the length)."""

    def selection_shape(self, config: ModelConfig, batch_size: int, capacity: int) -> tuple[int, int, int, int]:
        return (batch_size, config.num_heads, min(self.budget, capacity), 1)

    def window_size(self, capacity: int) -> int:
        return capacity  # the generated region is bounded only by the capacity

    def window_start(self, state: Any, lengths: jax.Array, prompt_lengths: jax.Array) -> jax.Array:
        return prompt_lengths


class StatelessPolicy(KVPolicy):
    """A policy that keeps no index: a placeholder state (the scan needs a leaf per layer)."""

    def init_state(self, config: ModelConfig, batch_size: int, capacity: int) -> Any:
        return jnp.zeros((), jnp.int32)
