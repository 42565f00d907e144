"""The interface every KV selection policy implements: what it declares, how it indexes, what it selects.

A policy is a frozen dataclass of `option` fields (hashable, so it is a static argument of `jax.jit`; each field
carries its help text, so the command line builds its flags from the class). A policy never attends and never
touches a store: `clusterkv_jax.attend` calls its hooks inside the model's `lax.scan` over the selecting
layers [full_layers, L), one layer at a time, so everything is traced (static shapes, no Python branching on
array values), reads the rows it selects from the layer's store and attends. A new policy is one module
implementing `init_state`, `select` and the declarations below.

Prefill, per selecting layer: `observe_queries` (only with `prompt_queries` > 0: the prompt's last queries, as
SnapKV and InfiniGen need), then `after_prefill` (index the prompt's keys).

Decode: before the step's layers, each selecting layer whose window of recent tokens the policy has not indexed
yet is due (`recent_due`) indexes it (`index_due`, under one branch for every layer:
`clusterkv_jax.attend.index_windows`; `add_indexed` writes the result in outside the branch; the layout's
`recent_moves` says which store rows that moves; `generate`'s loop does this between runs of steps that need none,
`attend.steps_until_due`); then, per selecting layer, `select` returns
a `Selection` of the rows to attend beside the window. `covers` (static) and `covers_now` (traced; not asked on a
GPU, where a branch waits for the host) say when the selection would hold every token: attention then reads the
whole layer, as full KV does, and costs what it costs.

Layout: which store rows hold which tokens is the row layout's business (`layout`, a
`clusterkv_jax.policies.layout.RowLayout` the policy names), not its hooks'. By default row r of a layer's store
holds position r; ClusterKV names a layout that keeps each cluster's members in consecutive rows, so a selection
reads whole blocks.

Budget rule (the same for every policy): a budget B counts every token attended from the prompt and from
already-indexed generated tokens, attention sinks included; generated tokens a policy has not yet indexed
(its window) are attended in full and reported separately.

State arrays declare their logical axes (`clusterkv_jax.axes.field`), so a sharded cache lays them out by name.

Shapes: B batch, N query heads, K KV heads, G = N // K, S capacity, R store rows, H head dim, h selection heads
(N, or K for one selection per KV head shared by its G query heads), M selected slots, W window slots.
"""

from __future__ import annotations

import dataclasses
import math
from numbers import Integral, Real
from typing import Any, ClassVar, Sequence

import jax
import jax.numpy as jnp

from clusterkv_jax.config import ModelConfig
from clusterkv_jax.policies.layout import Positions, RowLayout
from clusterkv_jax.selection import Selection


#: The help of every policy's `full_layers`.
FULL_LAYERS_HELP = "the model's first layers attend to every token (windowed layers keep their window)"


def option(default: Any, help: str, *, least: float | None = None, choices: tuple | None = None,
           flag: str | None = None) -> Any:
    """A policy field: its default, what it does (the command line's help), the least value it takes or the
    values it may take (checked by `KVPolicy.__post_init__`), and its flag's name when not the field's own."""
    return dataclasses.field(default=default, metadata={"help": help, "least": least, "choices": choices,
                                                        "flag": flag})


class KVPolicy:
    """Base class. Subclasses are `@dataclasses.dataclass(frozen=True)` of `option` fields."""

    #: The name on the command line and in the results ("clusterkv"); "" for a policy the command line does not
    #: offer.
    name: ClassVar[str] = ""
    #: Layers [0, full_layers) attend to every token; the policy selects in layers [full_layers, L). A windowed
    #: (sliding-attention) layer does neither: it attends to its window (`clusterkv_jax.cache`).
    full_layers: int = 0
    #: Keep the K/V of the layers this policy selects in host memory (`pinned_host`; see clusterkv_jax.offload).
    offload: bool = False
    #: Offload only: the device keeps the chunks selected in the last `recall_steps` steps (0: none).
    recall_steps: int = 0
    #: Which kernels run its ops (`clusterkv_jax.kernels.MODES`); a policy with kernels of its own declares the
    #: field.
    kernels: str = "auto"
    #: `select` scores every cached key (it gets the layer's keys [B, K, S, H]; others get None). Such a policy
    #: cannot offload: it would read the whole host store every step.
    reads_all_keys: ClassVar[bool] = False
    #: `select` scores some blocks of keys exactly: it gets a function (starts [B, K, n], chunk) -> keys
    #: [B, K, n, chunk, H] reading whole blocks of the layer's store (`LayerView.key_blocks`) instead of None.
    reads_key_blocks: bool = False
    #: n > 0: prefill hands `observe_queries` the post-RoPE queries of each prompt's last n tokens before
    #: `after_prefill` (SnapKV scores the prompt by them, InfiniGen skews its channels by them).
    prompt_queries: int = 0

    def __post_init__(self):
        """Checks every field against its declaration: an int field holds an integer and a float field a finite
        number (a budget of 512.0 or a NaN tolerance is refused here instead of failing deep inside JAX), a bool
        field a bool, and each value its `option`'s least value or choices. Subclasses that check more call this
        first."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
            where = f"{type(self).__name__}.{field.name}"
            if kind == "int" and (isinstance(value, bool) or not isinstance(value, Integral)):
                raise TypeError(f"{where} must be an int, got {value!r}")
            if kind == "int" and not -2**31 <= value < 2**31:  # sizes and indexes are int32 under jit
                raise ValueError(f"{where} must fit in 32 bits (at most {2**31 - 1}), got {value!r}")
            if kind == "float" and (isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value)):
                raise TypeError(f"{where} must be a finite number, got {value!r}")
            if kind == "bool" and not isinstance(value, bool):
                raise TypeError(f"{where} must be True or False, got {value!r}")
            least, choices = field.metadata.get("least"), field.metadata.get("choices")
            if least is not None and value < least:
                raise ValueError(f"{field.name} must be >= {least}, got {value}")
            if choices is not None and value not in choices:
                raise ValueError(f"{field.name} must be one of {', '.join(map(repr, choices))}, got {value!r}")

    # ---- What the model, the offload path and the benchmarks need to know (static) ----------------------

    @property
    def layout(self) -> RowLayout:
        """Where this policy's layers keep each token in their stores (default: row r holds position r)."""
        return Positions()

    def offloads(self, selecting: bool) -> bool:
        """Whether a group of layers (selecting ones, or full ones) keeps its K/V in host memory."""
        return self.offload and selecting

    def selection_shape(self, config: ModelConfig, batch_size: int, capacity: int) -> tuple[int, int, int, int]:
        """(B, h, n, chunk): `select` picks n chunks of `chunk` rows per selection head (chunk 1 for rows)."""
        raise NotImplementedError

    def window_size(self, capacity: int) -> int:
        """Static slots of the window of unindexed recent tokens [window_start, length) (0: no window)."""
        return 0

    def metadata_bytes(self, config: ModelConfig, context: int) -> int:
        """Bytes of index (centroids, page bounds) one decode step reads per sequence and selecting layer."""
        return 0

    def covers(self, capacity: int) -> bool:
        """Whether the selection holds every token of any cache of `capacity` positions (then nothing is selected:
        a decode step attends the whole layer). Default: never."""
        return False

    # ---- Traced hooks, one layer at a time -------------------------------------------------------------

    def init_state(self, config: ModelConfig, batch_size: int, capacity: int) -> Any:
        """One layer's empty state: a pytree of arrays."""
        raise NotImplementedError

    def init_states(self, config: ModelConfig, batch_size: int, capacity: int, layers: Sequence[int]) -> Any:
        """The states of model layers `layers` (a group's), stacked on a leading axis (the scan hands each layer
        its own)."""
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

    def window_start(self, state: Any, lengths: jax.Array, prompt_lengths: jax.Array) -> jax.Array:
        """[B] first position of the window (positions below it are indexed, or sinks)."""
        return lengths

    def recent_due(self, state: Any, lengths: jax.Array) -> jax.Array | None:
        """[B] whether each sequence's window is due for indexing, `lengths` [B] the tokens it has stored (the window
        is indexed before the step that adds a token to it: it holds at most W tokens, the new one included).
        None (the default): the policy never indexes a window. A window is due only once it holds `window_size`
        tokens (lengths - window_start >= W): `generate` runs the steps before that without asking
        (`clusterkv_jax.attend.steps_until_due`)."""
        return None

    def index_due(self, state: Any, recent_keys, due: jax.Array, prompt_lengths: jax.Array) -> Any:
        """What indexing the window adds (a pytree of arrays: new clusters, a page's bounds), computed for every
        sequence and written in by `add_indexed` where due [B] (`recent_due`). It runs only on a step where some
        sequence is due, inside a branch; keep what it returns small: on the other steps the branch returns
        zeros of its shapes. `recent_keys()` returns the keys of positions [window_start, window_start + W) as
        [B, K, W, H]."""
        return None

    def add_indexed(self, state: Any, added: Any, due: jax.Array) -> Any:
        """The state with `added` (`index_due`'s) written in where due [B], the other sequences' as they were. It
        runs outside the branch, on every `index_windows` call (a branch that returned the whole state would be
        copied whole when nothing is due): write only what indexing adds, in place (slices, scatters).
        `generate`'s steps do not run it: its loop indexes once per window, between steps."""
        return state

    def index_recent(self, state: Any, recent_keys, lengths: jax.Array, prompt_lengths: jax.Array) -> Any:
        """`index_due` and `add_indexed` for the sequences `recent_due` says, skipped (a `lax.cond`) when none is
        due. (A decode step indexes every layer under one branch instead: `clusterkv_jax.attend.index_windows`.)"""
        due = self.recent_due(state, lengths)
        if due is None:
            return state
        return jax.lax.cond(
            jnp.any(due), lambda s: self.add_indexed(s, self.index_due(s, recent_keys, due, prompt_lengths), due),
            lambda s: s, state)

    def covers_now(self, state: Any, lengths: jax.Array, prompt_lengths: jax.Array) -> jax.Array | None:
        """[B, ...] whether this step's selection would hold every indexed token of each sequence (and head); where
        all do, the step attends the whole layer instead. None: never decided here. (Reduced whole, to one bool:
        under a mesh a scalar crosses devices, not one per sequence.)"""
        return None

    def select(
        self,
        state: Any,
        q: jax.Array,  # [B, N, H] post-RoPE queries of the new token
        keys: Any,  # [B, K, S, H] the layer's keys when `reads_all_keys`; a block reader when `reads_key_blocks`
        lengths: jax.Array,  # [B] valid rows, the new token included
        prompt_lengths: jax.Array,  # [B]
    ) -> Selection:
        """The budgeted selection (the B tokens counted by the budget, sinks included; not the window), per
        selection head h = N (a selection per query head) or h = K (one per KV head, shared by its query heads).
        Rows and a mask [B, h, M] are `Selection.of_rows(rows, mask)`."""
        raise NotImplementedError

    def selected_positions(self, state: Any, q: jax.Array, keys: jax.Array | None, lengths: jax.Array,
                           prompt_lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`select` as token positions and a mask, [B, h, M], whatever the store layout (evaluation, tests)."""
        selection = self.select(state, q, keys, lengths, prompt_lengths)
        return self.layout.positions(state, selection), selection.flat_mask()


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

    def covers(self, capacity: int) -> bool:
        return self.budget >= capacity

    def covers_now(self, state: Any, lengths: jax.Array, prompt_lengths: jax.Array) -> jax.Array:
        return prompt_lengths <= self.budget  # every prompt token selected; generated ones are the window


class StatelessPolicy(KVPolicy):
    """A policy that keeps no index: a placeholder state (the scan needs a leaf per layer)."""

    def init_state(self, config: ModelConfig, batch_size: int, capacity: int) -> Any:
        return jnp.zeros((), jnp.int32)
