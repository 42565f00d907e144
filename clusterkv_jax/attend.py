"""Where a layer attends: prefill and decode, to every token or to what a policy selects, from its store.

The model's one layer body hands each layer's new q, k, v to a step's `attend(group, i, store, state, q, k, v)`
and gets back the attention output, the layer group's store and the layer's policy state. A step carries what it
is about (the lengths, the capacity, the policy); how a layer stores its K/V and attends in that step is its
group's kind's: `WindowedLayers` (a ring of the last W positions), `FullLayers` (row = position, every token
attended) and `SelectingLayers` (the policy's layout and selection), each with `prefill`, `prefill_chunk`,
`decode` and `store_prompt` (`LAYERS`). The steps:

- `Prefill`: a prompt from an empty cache. The prompt's K/V are stored (in a selecting layer, where the policy's
  layout puts each position, once it has indexed the keys) and attention is causal over the prompt.
- `PrefillChunk`: one chunk of a longer prompt: its K/V are written in position order and it attends to the
  rows so far; `index_prompt` then indexes the selecting layers as `Prefill` would have.
- `Decode`: one new token per sequence. Before the layers, the selecting layers index their windows where due
  (`index_windows`, one branch for the step; `generate`'s loop instead indexes between runs of steps that
  `steps_until_due` says need none). The token is written where the policy keeps it; a full layer attends
  to every row; a selecting layer (`decode_selecting`) attends
    - to every token its store holds, when the selection would hold them all (`KVPolicy.covers` decided
      statically from the capacity, `covers_now` at run time for a store in device memory, except on a GPU:
      `kernels.branches_wait_for_host`), as full KV does;
    - otherwise to the policy's `Selection` and the window, read one of three ways: in place through a page table
      (`kernels.selected_attention`: kernels "pallas", "tpu" or "interpret", a device store, a ring window, no
      mesh), a tile of (sequence, KV head) pairs at a time (a CPU whose selected rows outgrow its cache), or
      gathered, then one softmax (`attention.selection_and_window_attention`).

Policies select; stores hold and read rows; this module decides how the rows meet the queries.

Shapes: B batch, T tokens, N query heads, K KV heads, G = N // K, S capacity (positions), R store rows, H head
dim, h selection heads, W window slots.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from clusterkv_jax import attention, kernels
from clusterkv_jax.cache import FULL, SELECTING, WINDOWED
from clusterkv_jax.policies.base import KVPolicy
from clusterkv_jax.policies.common import last_positions, recent_window
from clusterkv_jax.selection import Selection
from clusterkv_jax.store import DeviceLayer

#: Queries per block in prefill attention: bounds the [B, N, block, T] score tensor for long prompts.
PREFILL_BLOCK = 512

#: A tile of `attend_tiled`: the K and V rows gathered at once, kept well inside a CPU's last-level cache
#: (docs/research_log.md, "Tiles on the CPU").
GATHER_TILE_BYTES = 8 << 20


class DecodeProbe:
    """A policy that measures each decode step rather than selects (the recall evaluation's probe,
    `clusterkv_jax.eval.recall`, the notebook's record of ClusterKV's selections): before a selecting layer attends,
    `SelectingLayers.decode` hands it the step's queries, and the layer's state is written back after every step.
    No other policy's step calls anything for it."""

    def observe_decode(self, state: Any, q: jax.Array, view, lengths: jax.Array, prompt_lengths: jax.Array) -> Any:
        """The step's queries q [B, N, H] and the layer's store `view` (see `clusterkv_jax.store`), before the
        layer attends; returns the layer's state."""
        raise NotImplementedError


# ----------------------------------------------------------------------------------------------------------
# The steps: what each carries; a layer's group says how it stores and attends (`LAYERS`)
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Prefill:
    """Prompts [B, T] from an empty cache of `capacity` positions; lengths [B] their true lengths."""

    policy: Any
    lengths: jax.Array
    capacity: int
    cap: float | None = None  # scores soft-capped (`attention.softcap`)
    #: False: the selecting layers' K/V are stored in position order, for `index_prompt` after the layers.
    index: bool = True

    def attend(self, group, i, store, state, q, k, v):
        """-> (causal attention [B, T, N, H] (`kernels.prompt_attention`), store, state)."""
        return LAYERS[group.attention].prefill(self, i, store, state, q, k, v)


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """One chunk of prompts [B, T]: positions [start, start + chunk) (start traced), attending to rows [0, T) of
    each layer (later rows are masked or still empty). The chunk's K/V go to rows [start, start + chunk) in
    position order, in the cache's dtype; `index_prompt` lays the selecting layers out afterwards."""

    policy: Any
    lengths: jax.Array
    capacity: int
    start: jax.Array
    prompt: int  # T
    cap: float | None = None

    def attend(self, group, i, store, state, q, k, v):
        return LAYERS[group.attention].prefill_chunk(self, i, store, state, q, k, v)


@dataclasses.dataclass(frozen=True)
class Decode:
    """One new token per sequence at position lengths[b] (lengths before it), in a cache of `capacity`
    positions."""

    policy: Any
    lengths: jax.Array
    prompt_lengths: jax.Array
    capacity: int
    cap: float | None = None

    def attend(self, group, i, store, state, q, k, v):
        """-> (attention [B, 1, N, H] float32, store, state or None: the step left the layer's state as it was, so
        nothing is written back; only a `DecodeProbe`'s state changes in a decode step, since windows are indexed
        between steps, `index_windows`)."""
        return LAYERS[group.attention].decode(self, i, store, state, q, k, v)


def _as_rows(store, k, v):
    """k, v [B, T, K, H] as store rows [B, K, T, H] in the store's dtype."""
    return jnp.swapaxes(k, 1, 2).astype(store.k.dtype), jnp.swapaxes(v, 1, 2).astype(store.v.dtype)


class WindowedLayers:
    """A sliding-attention layer whose window W is shorter than the capacity: its store is a ring of the last W
    positions (row = position % W). It never selects and keeps no policy state."""

    def store_prompt(self, policy, store, state, i, k_rows, v_rows, lengths, capacity: int):
        """A prompt's K/V rows [B, K, T, H] (positions [0, T), those before each length) stored in layer i's ring.
        Returns (store, state)."""
        return write_ring(store, i, k_rows, v_rows, 0, lengths), state

    def prefill(self, step: Prefill, i, store, state, q, k, v):
        store, state = self.store_prompt(step.policy, store, state, i, *_as_rows(store, k, v), step.lengths,
                                         step.capacity)
        out = kernels.prompt_attention(q, k, v, block=PREFILL_BLOCK, window=store.capacity, cap=step.cap)
        return out, store, state

    def prefill_chunk(self, step: PrefillChunk, i, store, state, q, k, v):
        """The chunk attends to the ring (the positions before it) and to itself."""
        W, (B, T) = store.capacity, q.shape[:2]
        k_rows, v_rows = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
        view = store.layer(i)
        q_positions = jnp.broadcast_to(step.start + jnp.arange(T, dtype=jnp.int32), (B, T))
        k_positions = jnp.concatenate([ring_positions(jnp.broadcast_to(step.start, (B,)), W), q_positions], 1)
        keys = jnp.concatenate([view.keys(), k_rows.astype(store.k.dtype)], 2)  # [B, K, W + T, H]
        values = jnp.concatenate([view.values(), v_rows.astype(store.v.dtype)], 2)
        out = attention.window_attention(q, q_positions, keys, values, k_positions, W, step.cap)
        return out, write_ring(store, i, k_rows, v_rows, step.start, step.lengths), state

    def decode(self, step: Decode, i, store, state, q, k, v):
        """The ring holds the last W positions, this one included."""
        W, lengths = store.capacity, step.lengths + 1
        view = store.write_token(i, step.lengths % W, k[:, 0], v[:, 0]).layer(i)
        with jax.named_scope("attend"):
            held = (ring_positions(lengths, W) >= 0)[:, None]  # [B, 1, W]
            out = attention.rows_attention(q[:, 0], view.keys(), view.values(), held, step.cap)
        return out[:, None], view.store, None


class FullLayers:
    """A layer that attends to every cached token: row = position. It keeps no policy state."""

    def store_prompt(self, policy, store, state, i, k_rows, v_rows, lengths, capacity: int):
        """A prompt's K/V rows [B, K, T, H] stored as rows [0, T) of layer i. Returns (store, state)."""
        return store.write_prompt(i, k_rows, v_rows), state

    def prefill(self, step: Prefill, i, store, state, q, k, v):
        store, state = self.store_prompt(step.policy, store, state, i, *_as_rows(store, k, v), step.lengths,
                                         step.capacity)
        return kernels.prompt_attention(q, k, v, block=PREFILL_BLOCK, cap=step.cap), store, state

    def prefill_chunk(self, step: PrefillChunk, i, store, state, q, k, v):
        written = store.write_prompt(i, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), start=step.start)
        view = written.layer(i)
        out = attention.causal_attention_over_rows(q, view.keys()[:, :, :step.prompt],
                                                   view.values()[:, :, :step.prompt], step.start, block=PREFILL_BLOCK,
                                                   cap=step.cap)
        return out, written, state

    def decode(self, step: Decode, i, store, state, q, k, v):
        view = store.write_token(i, step.lengths, k[:, 0], v[:, 0]).layer(i, step.capacity)
        with jax.named_scope("attend"):
            out = kernels.decode_attention(q[:, 0], view.keys(), view.values(), step.lengths + 1, cap=step.cap,
                                           impl=kernels.resolve(step.policy.kernels, "decode_attention"))
        return out[:, None], view.store, None


class SelectingLayers(FullLayers):
    """A layer the policy selects for: its store holds every token where the policy's layout puts it, the policy
    indexes it (a state per layer), and a decode step attends to what the policy selects (`decode_selecting`).
    A chunked prompt is written as a full layer's and indexed afterwards (`index_prompt`)."""

    def store_prompt(self, policy, store, state, i, k_rows, v_rows, lengths, capacity: int):
        """The policy indexes the prompt's keys, and its K/V rows [B, K, T, H] go where the layout puts each position
        (`write_prompt_layer`). Returns (store, state)."""
        return write_prompt_layer(policy, store, state, i, k_rows, v_rows, lengths, capacity)

    def prefill(self, step: Prefill, i, store, state, q, k, v):
        state, q = observe_prompt_queries(step.policy, state, q, 0, step.lengths)
        rows = _as_rows(store, k, v)
        if step.index:
            store, state = self.store_prompt(step.policy, store, state, i, *rows, step.lengths, step.capacity)
        else:  # in position order, for `index_prompt` after the layers
            store = store.write_prompt(i, *rows)
        return kernels.prompt_attention(q, k, v, block=PREFILL_BLOCK, cap=step.cap), store, state

    def prefill_chunk(self, step: PrefillChunk, i, store, state, q, k, v):
        state, q = observe_prompt_queries(step.policy, state, q, step.start, step.lengths)
        return super().prefill_chunk(step, i, store, state, q, k, v)

    def decode(self, step: Decode, i, store, state, q, k, v):
        """This token's K/V [B, K, H] go to the row the policy's layout keeps its position in."""
        policy, S = step.policy, step.capacity
        view = store.write_token(i, policy.layout.token_rows(state, step.lengths, S), k[:, 0], v[:, 0]).layer(i, S)
        probing = isinstance(policy, DecodeProbe)
        if probing:  # measures the step before the layer attends; its state changes each step
            with jax.named_scope("probe"):
                state = policy.observe_decode(state, q[:, 0], view, step.lengths + 1, step.prompt_lengths)
        out, view = decode_selecting(policy, state, q[:, 0], view, step.lengths + 1, step.prompt_lengths, step.cap)
        # Selecting leaves the index as it was (windows are indexed between steps): only a probe's state is new.
        return out[:, None], view.store, state if probing else None


#: How each kind of layer group (`clusterkv_jax.cache.LayerGroup.attention`) stores and attends in each step.
LAYERS = {WINDOWED: WindowedLayers(), FULL: FullLayers(), SELECTING: SelectingLayers()}


# ----------------------------------------------------------------------------------------------------------
# Prefill of a layer
# ----------------------------------------------------------------------------------------------------------


def ring_positions(end: jax.Array, window: int) -> jax.Array:
    """end [B] -> [B, window]: the position ring row r holds once positions [0, end) are written (row = position
    % window): the latest p < end with p % window = r; negative where none has been."""
    rows = jnp.arange(window, dtype=jnp.int32)
    last = end[:, None].astype(jnp.int32) - 1
    return last - (last - rows) % window


def write_ring(store, i, k_rows: jax.Array, v_rows: jax.Array, start, lengths: jax.Array):
    """A windowed layer's ring (row = position % W) after positions [start, start + T) of k_rows, v_rows
    [B, K, T, H], those before each sequence's length: a row takes the latest such position it holds, or keeps
    what it had (earlier chunks; a padded position never overwrites a real one). Returns the store."""
    W, T = store.capacity, k_rows.shape[2]
    end = jnp.minimum(start + T, lengths)  # [B]
    positions = ring_positions(end, W)  # [B, W]
    new = (positions >= start)[:, None, :, None]
    offsets = jnp.clip(positions - start, 0, T - 1)[:, None, :, None]
    view = store.layer(i)
    k = jnp.where(new, jnp.take_along_axis(k_rows.astype(store.k.dtype), offsets, axis=2), view.keys())
    v = jnp.where(new, jnp.take_along_axis(v_rows.astype(store.v.dtype), offsets, axis=2), view.values())
    return store.write_layer(i, k, v)


def observe_prompt_queries(policy, state, q: jax.Array, start, lengths: jax.Array):
    """Prefill of a selecting layer: hands the policy those of the queries q [B, T, N, H] (positions
    [start, start + T)) that lie among each prompt's last `policy.prompt_queries` tokens. Returns (state, q), the
    two behind an optimization barrier, so the rows are taken before the layer's attention reads q: XLA took them
    after it, holding q beside the attention's operands (at 32k, Llama-3-8B geometry: a query-keeping prefill held
    1,645 MB of temporaries on a TPU v5e where FullKV holds 1,377, a chunked one 1,096 MB on an H100 against 894;
    docs/research_log.md)."""
    n = policy.prompt_queries
    if not n:
        return state, q
    T = q.shape[1]
    positions = last_positions(lengths, n)
    offsets = positions - start
    found = (positions >= 0) & (offsets >= 0) & (offsets < T)
    rows = jnp.take_along_axis(q, jnp.clip(offsets, 0, T - 1)[:, :, None, None], axis=1)  # [B, n, N, H]
    state = policy.observe_queries(state, jnp.swapaxes(rows, 1, 2).astype(jnp.float32), found)
    return jax.lax.optimization_barrier((state, q))


def layer_scope(layers):
    """The named scope of a group's model layers (`layer3`, or `layers2-31`) as the unrolled model loop names
    its layers: profiles show each layer apart, and tests/test_aot.py finds kernels merged across layers."""
    layers = list(layers)
    return jax.named_scope(f"layer{layers[0]}" if len(layers) == 1 else f"layers{layers[0]}-{layers[-1]}")


def write_prompt_layer(policy, store, state, i, k_rows, v_rows, lengths, capacity: int, indexed: bool = False):
    """What prefill does with selecting layer i of a store once its K/V are computed: let the policy index the keys
    (unless `indexed`: the state has indexed them already); store the prompt's K/V [B, K, T, H] as rows [0, T), or
    where the policy's layout puts each position (`RowLayout.prompt_rows`). Returns (store, state)."""
    T = k_rows.shape[2]
    pad = ((0, 0), (0, 0), (0, capacity - T), (0, 0))
    keys = jnp.pad(k_rows.astype(store.k.dtype), pad)
    if not indexed and indexes_keys(policy):
        with jax.named_scope("index"):
            state = _index_keys(policy, state, keys, lengths)
    layout = policy.layout.prompt_rows(state)  # [B, K, R] position of each row, or None: row = position
    if layout is None:  # (`indexed`: the rows are in the store in position order already)
        return (store if indexed else store.write_prompt(i, k_rows, v_rows)), state
    with jax.named_scope("layout"):
        held = (layout >= 0)[..., None]
        rows = jnp.clip(layout, 0, capacity - 1)[..., None]
        k = jnp.where(held, jnp.take_along_axis(keys, rows, axis=2), 0)
        v = jnp.where(held, jnp.take_along_axis(jnp.pad(v_rows.astype(store.v.dtype), pad), rows, axis=2), 0)
    return store.write_layer(i, k, v), state


def indexes_keys(policy) -> bool:
    """Whether the policy indexes a prompt's keys: it overrides `after_prefill` (KVPolicy's returns the state as
    it is). Where it does not, no layer's keys are read for it: in a GPU's unrolled prefill `kernels.layer_values`'
    barrier would hold them though nothing reads them (FullKVKeepingQueries' prefill held 520 MB more than FullKV's
    at 32k on an H100, deviceless)."""
    return type(policy).after_prefill is not KVPolicy.after_prefill


def _index_keys(policy, state, keys, lengths):
    """A selecting layer's state after the policy indexed its prompt keys [B, K, S, H] (rows >= lengths are
    padding), in the store's dtype."""
    return policy.after_prefill(*kernels.layer_values(state, keys, lengths))


def indexed_in_one_loop(groups) -> bool:
    """Whether one loop over the selecting layers indexes them all, each step reading its layer's keys out of that
    layer's store (`lax.switch`): where each is a group of its own in device memory (a GPU's unrolled layer loop,
    `cache.plan_layers`). A prefill then stores their prompts in position order and indexes them after the layers
    (`index_prompt`); a decode step indexes their windows so (`index_windows`). Indexed layer by layer, every
    layer's K-means and layout sort were kernels of their own, and XLA:GPU compiles every sort anew: 30 layout sorts,
    most of the 47 s a 32-layer ClusterKV prefill took to compile for an H100 (docs/research_log.md)."""
    picked = [group for group in groups if group.selecting]
    return (kernels.layer_loop() == "unrolled" and len(picked) > 1
            and all(group.num_layers == 1 and not group.store.on_host for group in picked))


def _in_one_loop(groups, states, read, index, *xs):
    """index(keys, state, *x) for every selecting layer of `groups` (`indexed_in_one_loop`), in one `lax.map`:
    keys() reads that layer's keys (`read(group, state)`) out of its own store by a `lax.switch`, so no array holds
    every layer's keys at once. states and each of xs: a tuple with an entry [1, ...] per selecting layer. Returns
    the results stacked over those layers [n, ...]."""
    picked = [group for group in groups if group.selecting]
    readers = [functools.partial(read, group) for group in picked]

    def step(args):
        n, state, *x = args
        return index(functools.partial(jax.lax.switch, n, readers, state), state, *x)

    stack = lambda parts: jax.tree.map(lambda *p: jnp.concatenate(p), *parts)  # noqa: E731
    return jax.lax.map(step, (jnp.arange(len(picked)), stack(states), *(stack(x) for x in xs)))


def index_prompt(policy, groups, lengths: jax.Array, capacity: int, prompt: int):
    """After a chunked prefill, or one that left it for later (`indexed_in_one_loop`): the selecting
    groups' layers indexed and laid out from their stored prompt rows [0, prompt), as `Prefill` does after a
    layer's K/V. Returns the groups.

    A group's layers are indexed in a loop over them. Where each selecting layer is a group of its own
    (`indexed_in_one_loop`), one loop indexes them all: each step copies its layer's prompt keys out of that
    layer's store (`lax.switch`), so no array holds every layer's keys at once; then each layer is laid out."""
    pad = ((0, 0), (0, 0), (0, capacity - prompt), (0, 0))
    if indexed_in_one_loop(groups):
        picked = [j for j, group in enumerate(groups) if group.selecting]
        states = [jax.tree.map(lambda x: x[0], groups[j].state) for j in picked]  # each layer's own
        if indexes_keys(policy):
            with jax.named_scope("index"):
                stacked = _in_one_loop(groups, [groups[j].state for j in picked],
                                       lambda group, state: group.store.layer(0).keys()[:, :, :prompt],
                                       lambda keys, state: _index_keys(policy, state, jnp.pad(keys(), pad), lengths))
            states = [jax.tree.map(lambda x: x[n], stacked) for n in range(len(picked))]
        groups = list(groups)
        done = None  # the last layer laid out
        for n, j in enumerate(picked):
            group = groups[j]
            # Laid out in place, a layer needs its rows twice for a moment (a gather out of the store it writes):
            # one layer after another, so one layer's copy is alive at a time, not the scheduler's choice of them.
            if done is not None:
                group = group.replace(store=jax.lax.optimization_barrier((done, group.store))[1])
            view = group.store.layer(0)
            with layer_scope(group.layers):
                store, state = write_prompt_layer(policy, group.store, states[n], 0,
                                                  view.keys()[:, :, :prompt], view.values()[:, :, :prompt], lengths,
                                                  capacity, indexed=True)
            groups[j] = group.replace(store=store, state=jax.tree.map(lambda x: x[None], state))
            done = store
        return tuple(groups)

    def index(group):
        def body(store, xs):
            i, state = xs
            view = store.layer(i)
            return write_prompt_layer(policy, store, state, i, view.keys()[:, :, :prompt],
                                      view.values()[:, :, :prompt], lengths, capacity)

        store, state = jax.lax.scan(body, group.store, (jnp.arange(group.num_layers, dtype=jnp.int32), group.state))
        return group.replace(store=store, state=state)

    return tuple(index(g) if g.selecting else g for g in groups)


@functools.partial(jax.jit, static_argnames=("policy",), donate_argnames=("cache",))
def write_prompt(cache, keys: jax.Array, values: jax.Array, lengths: jax.Array, *, policy):
    """An empty cache filled as a prefill of a prompt with these K/V [L, B, K, T, H] would fill it (its
    attention outputs are not needed): the stores hold the rows, the policy has indexed the selecting layers.
    Not for policies that index by the prompt's queries (`prompt_queries`): it has none to give them."""
    _check_keys_suffice(policy, "write_prompt")
    groups = tuple(_store_prompt(policy, group, keys, values, group.layers, lengths, cache.capacity)
                   for group in cache.groups)
    lengths = lengths.astype(jnp.int32)
    return cache.replace(groups=groups, lengths=lengths, prompt_lengths=lengths)


def copy_prompt(cache, full, *, policy):
    """The empty cache `cache` (laid out for `policy`) holding the prompt a full-KV cache `full` of the same
    capacity holds after its prefill (`clusterkv_jax.generate.prefill_prompts`): what `policy`'s own prefill of
    that prompt would store, without running the model again. The prefill's attention is causal over the prompt
    whatever the policy, so its K/V are too. A windowed layer's ring is the same in both; every other layer's
    rows [0, S) are stored as a prefill stores them (`store_prompt`: a selecting layer's indexed by the policy
    first), read from `full`'s store in place. A policy that indexes by the prompt's last n queries
    (`prompt_queries`) is handed them from `full`'s layer states first, which must keep at least n
    (`policies.full.FullKVKeepingQueries`)."""
    if full.capacity != cache.capacity or full.batch_size != cache.batch_size:
        raise ValueError(f"the prefilled cache holds {full.batch_size} sequence(s) of {full.capacity} positions, "
                         f"the new one {cache.batch_size} of {cache.capacity}")
    groups = []
    for group in cache.groups:
        source, layers = _source_of(full, group.layers)  # keys and values [n', B, K, R, H], and each layer's index
        if group.windowed:  # the same ring under every policy
            at = jnp.asarray(layers, jnp.int32)
            groups.append(group.replace(store=group.store.replace(k=jnp.take(source.store.k, at, axis=0),
                                                                  v=jnp.take(source.store.v, at, axis=0))))
        else:
            queries = _kept_queries(source, policy.prompt_queries) if group.selecting else None
            groups.append(_store_prompt(policy, group, source.store.k, source.store.v, layers, full.lengths,
                                        cache.capacity, queries))
    return cache.replace(groups=tuple(groups), lengths=full.lengths, prompt_lengths=full.prompt_lengths)


def _kept_queries(source, n: int):
    """The last n prompt queries that a prefilled group's layers kept, [n', B, N, n, H] (slot j: position
    L - n + j), or None for n = 0."""
    if not n:
        return None
    kept = getattr(source.state, "queries", None)
    held = 0 if kept is None else kept.shape[-2]
    if held < n:
        raise ValueError(f"the policy indexes the prompt by its last {n} queries; the shared prefill kept {held} "
                         f"(prefill_prompts(..., prompt_queries={n}) keeps them)")
    return kept[..., held - n:, :]


def _check_keys_suffice(policy, what: str) -> None:
    if policy.prompt_queries:
        raise ValueError(f"{type(policy).__name__} indexes the prompt by its queries; {what} has only keys and "
                         "values (run a prefill for it instead)")


def _source_of(full, layers):
    """(the group of the device cache `full` holding model layers `layers`, each one's index in that group)."""
    places = [full.group_of(layer) for layer in layers]
    group = places[0][0]
    if any(g is not group for g, _ in places):
        raise ValueError(f"layers {layers} lie in several groups of the prefilled cache")
    if group.on_host:
        raise ValueError("the prefilled cache keeps its K/V in host memory; prefill it without offloading")
    return group, tuple(i for _, i in places)


def _store_prompt(policy, group, keys, values, layers, lengths, capacity: int, queries=None):
    """The group with a prompt's K/V stored as a prefill stores them (its kind's `store_prompt`, one scanned
    layer at a time): layer j of the group's from keys[layers[j]], values[layers[j]] ([L, B, K, T, H]), read
    inside the loop, so the group's K/V are not copied out first. queries [L', B, N, n, H] (the prompt's last
    n, for a policy with `prompt_queries` n): layer j's, queries[layers[j]], are observed first, as a prefill
    observes them (`observe_prompt_queries`)."""
    def body(store, xs):
        i, at, state = xs
        k, v = (jax.lax.dynamic_index_in_dim(x, at, keepdims=False) for x in (keys, values))
        if queries is not None:
            n = queries.shape[-2]
            found = last_positions(lengths, n) >= 0  # [B, n] slots inside the prompt
            state = policy.observe_queries(state, jax.lax.dynamic_index_in_dim(queries, at, keepdims=False), found)
        return LAYERS[group.attention].store_prompt(policy, store, state, i, k, v, lengths, capacity)

    n = group.num_layers
    with layer_scope(group.layers):
        store, state = jax.lax.scan(body, group.store, (jnp.arange(n, dtype=jnp.int32),
                                                        jnp.asarray(layers, jnp.int32), group.state))
    return group.replace(store=store, state=state)


# ----------------------------------------------------------------------------------------------------------
# Decode of a selecting layer
# ----------------------------------------------------------------------------------------------------------


def window_keys(policy, state, view, lengths: jax.Array, prompt_lengths: jax.Array, rows_of=None):
    """A function returning the keys [B, K, W, H] of the window's positions [window_start, window_start + W) from
    the layer's store `view`; `rows_of(positions)` gives their rows (default: the policy's layout's `token_rows`)."""
    W = policy.window_size(view.positions)
    start = policy.window_start(state, lengths, prompt_lengths)
    if rows_of is None:
        rows_of = lambda p: policy.layout.token_rows(state, p, view.positions)  # noqa: E731

    def recent_keys():
        positions = jnp.minimum(start[:, None] + jnp.arange(W), view.positions - 1)  # [B, W]
        return view.window(rows_of(positions))[0]

    return recent_keys


def index_window(policy, state, view, lengths: jax.Array, prompt_lengths: jax.Array, rows_of=None):
    """`policy.index_recent` (under its own branch) with the window's keys read from the layer's store `view`
    (`window_keys`), `lengths` [B] the tokens stored. Returns the state."""
    if not policy.window_size(view.positions):
        return state
    return policy.index_recent(state, window_keys(policy, state, view, lengths, prompt_lengths, rows_of), lengths,
                               prompt_lengths)


def index_windows(policy, groups, lengths: jax.Array, prompt_lengths: jax.Array, capacity: int):
    """Before a decode step's layers: every selecting layer whose window is due (`KVPolicy.recent_due`, lengths
    [B] the tokens stored before this step) indexes it (`index_due`: ClusterKV's decode-time clusters, Quest's
    pages), the state takes what that adds (`add_indexed`) and the store moves those rows where the policy's layout
    puts them (`RowLayout.recent_moves`). Returns the groups.

    All layers are indexed under one `lax.cond` for the step, skipped on the steps where none is due: on a GPU
    each branch waits for the host (`kernels.branches_wait_for_host`), and one per layer cost a wait per layer on
    every step. The window's tokens are all stored already, so no layer needs this step's own token. The branch
    returns only what indexing adds (zeros on the other steps), written in place outside it, and the rows move
    outside it: a branch that returns its operand, a state or a store, makes XLA:GPU copy it whole
    (`LayerView.commit_window`)."""
    if not indexes_windows(policy, groups, lengths, capacity):
        return groups
    picked = [j for j, group in enumerate(groups) if group.selecting]
    states = tuple(groups[j].state for j in picked)
    dues = tuple(jax.vmap(lambda s: policy.recent_due(s, lengths))(state) for state in states)  # [n, B] each

    def index_all(states):  # what each layer's indexing adds, stacked per group
        if indexed_in_one_loop(groups):
            added = _in_one_loop(
                groups, states, lambda group, state: window_keys(policy, state, group.store.layer(0, capacity), lengths,
                                                         prompt_lengths)(),
                lambda keys, state, due: policy.index_due(*kernels.layer_values(state, keys, due, prompt_lengths)),
                dues)
            return tuple(jax.tree.map(lambda x: x[n:n + 1], added) for n in range(len(picked)))
        out = []
        for j, state, due in zip(picked, states, dues):
            store = groups[j].store

            def index_layer(i, store=store, state=state, due=due):
                layer_state = jax.tree.map(lambda s: s[i], state)
                keys = window_keys(policy, layer_state, store.layer(i, capacity), lengths, prompt_lengths)
                return policy.index_due(*kernels.layer_values(layer_state, keys, due[i], prompt_lengths))

            n = groups[j].num_layers  # one layer: unrolled; more: a loop
            with layer_scope(groups[j].layers):
                out.append(jax.tree.map(lambda x: x[None], index_layer(0)) if n == 1
                           else jax.lax.map(index_layer, jnp.arange(n)))
        return tuple(out)

    with jax.named_scope("index"):
        shapes = jax.eval_shape(index_all, states)
        added = jax.lax.cond(jnp.any(jnp.stack([jnp.any(d) for d in dues])), index_all,
                             lambda s: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes), states)
        groups = list(groups)
        for j, old, add, due in zip(picked, states, added, dues):
            new = jax.vmap(policy.add_indexed)(old, add, due)

            def commit(i, store, old=old, new=new):
                moves = policy.layout.recent_moves(jax.tree.map(lambda s: s[i], old), jax.tree.map(lambda s: s[i], new))
                return store if moves is None else store.layer(i, capacity).commit_window(*moves).store

            n, store = groups[j].num_layers, groups[j].store
            store = commit(0, store) if n == 1 else jax.lax.fori_loop(0, n, commit, store)
            groups[j] = groups[j].replace(store=store, state=new)
    return tuple(groups)


def indexes_windows(policy, groups, lengths: jax.Array, capacity: int) -> bool:
    """Whether some selecting layer indexes windows of generated tokens (known when tracing)."""
    picked = [group for group in groups if group.selecting]
    if not picked or not policy.window_size(capacity):
        return False
    return policy.recent_due(jax.tree.map(lambda s: s[0], picked[0].state), lengths) is not None


def steps_until_due(policy, groups, lengths: jax.Array, prompt_lengths: jax.Array, capacity: int):
    """[] int32: how many decode steps can run, from `lengths` [B] tokens stored, before a selecting layer's window
    may fall due (`KVPolicy.recent_due` needs `window_size` tokens past `window_start`, and each step stores one
    token per sequence); at least 1. None where no layer indexes a window. `generate`'s decode loop runs that many
    steps without `index_windows`, then indexes every layer once, so its steps hold no branch and none of the
    writes that indexing adds."""
    if not indexes_windows(policy, groups, lengths, capacity):
        return None
    picked = [group for group in groups if group.selecting]
    held = [jnp.max(lengths - jax.vmap(lambda s: policy.window_start(s, lengths, prompt_lengths))(group.state))
            for group in picked]  # the most tokens any layer's window holds
    return jnp.maximum(policy.window_size(capacity) - functools.reduce(jnp.maximum, held), 1).astype(jnp.int32)


def decode_selecting(policy, state, q: jax.Array, view, lengths: jax.Array, prompt_lengths: jax.Array,
                     cap: float | None = None):
    """One selecting layer's decode attention, from its store `view` (this layer, the new token's row written;
    its window indexed before the step: `index_windows`): q [B, N, H], lengths [B] the new token included,
    scores soft-capped by `cap`. Returns (output [B, N, H] float32, view); the state is only read."""
    if policy.covers(view.positions):
        return attend_everything(policy, state, q, view, lengths, cap), view
    # Whether every indexed token fits the selection is known only on the device. Where a branch waits for the
    # host (a GPU), the selection is attended anyway: with every cluster selected whole it holds the same tokens.
    # A view whose reads change it (a host store's recall cache) is not read inside a branch.
    everything = (None if not view.read_only or kernels.branches_wait_for_host()
                  else policy.covers_now(state, lengths, prompt_lengths))
    if everything is None:
        return attend_selected(policy, state, q, view, lengths, prompt_lengths, cap)
    # The view is only read here (`read_only`), so the branches return the output alone.
    out = jax.lax.cond(jnp.all(everything), lambda: attend_everything(policy, state, q, view, lengths, cap),
                       lambda: attend_selected(policy, state, q, view, lengths, prompt_lengths, cap)[0])
    return out, view


def attend_everything(policy, state, q: jax.Array, view, lengths: jax.Array, cap: float | None = None) -> jax.Array:
    """Every row of the layer that holds a token (the layout's `held_rows`, within `covered_rows`), as full KV
    attends."""
    n = policy.layout.covered_rows(view.positions)
    with jax.named_scope("attend"):
        mask = policy.layout.held_rows(state, lengths, view.positions)[..., :n]
        return attention.rows_attention(q, *view.read_all(n), mask, cap)


def attend_selected(policy, state, q: jax.Array, view, lengths: jax.Array, prompt_lengths: jax.Array,
                    cap: float | None = None):
    """The policy's selection and its window, one softmax -> (output [B, N, H] float32, view). The page-table
    kernel has no soft-capping: capped scores take the other ways."""
    S = view.positions
    with jax.named_scope("select"):
        keys = view.keys() if policy.reads_all_keys else view.key_blocks if policy.reads_key_blocks else None
        selection = policy.select(state, q, keys, lengths, prompt_lengths)
    W, ring = policy.window_size(S), policy.layout.ring_window
    start = policy.window_start(state, lengths, prompt_lengths) if W and not ring else None
    ring_mask = policy.layout.ring_mask(state, lengths, S) if W and ring else None
    # The store rows can be read where they lie: a view that reads in place (a device store), a ring window (or
    # none), no multi-device mesh (the page table and the tiles address the whole store; under a mesh the rows are
    # gathered per shard).
    whole_store = view.reads_in_place and (not W or ring) and not kernels.on_a_mesh()
    impl = kernels.resolve(policy.kernels, "selected_attention")
    if whole_store and impl != "reference" and cap is None and can_attend_in_place(view, selection, W):
        with jax.named_scope("attend"):
            return attend_in_place(q, view, selection, W, ring_mask, impl), view

    def gathered(view):  # read the selected rows and the window's, then one softmax over both
        k_sel, v_sel, sel_mask, view = view.read(selection)
        k_win = v_win = w_mask = None
        if W:
            with jax.named_scope("window"):
                if ring:
                    (k_win, v_win), w_mask = view.ring(W), ring_mask
                else:
                    positions, w_mask = recent_window(lengths, start, W)
                    k_win, v_win = view.window(policy.layout.token_rows(state, positions, S))
        with jax.named_scope("attend"):
            return (attention.selection_and_window_attention(q, k_sel, v_sel, sel_mask, k_win, v_win, w_mask, cap),
                    view)

    if whole_store and tiles_for(view, selection) > 1:
        # A platform choice at lowering: tiles are for a CPU's cache; elsewhere a loop only serializes the work.
        out = kernels.by_platform(cpu=lambda: attend_tiled(q, view, selection, W, ring_mask, cap),
                                  default=lambda: gathered(view)[0])
        return out, view
    return gathered(view)


def can_attend_in_place(view: DeviceLayer, selection: Selection, window: int) -> bool:
    """Whether `attend_in_place` applies: pages of a power-of-two number of rows (> 1) that tile the store and
    the window, and a power-of-two head dim."""
    c, R, H = selection.chunk, view.store.k.shape[3], view.store.k.shape[4]
    pow2 = lambda x: x & (x - 1) == 0  # noqa: E731
    return c > 1 and pow2(c) and pow2(H) and R % c == 0 and window % c == 0


def attend_in_place(q: jax.Array, view: DeviceLayer, selection: Selection, window: int, window_mask, impl: str):
    """One softmax over each head's selection and (window > 0) the ring of rows [0, window), read where they lie
    through a page table (`kernels.selected_attention`; no gathered copy): q [B, N, H] -> [B, N, H] float32, as
    `attention.selection_and_window_attention` over `read` and `ring` gives it. Pages are chunks of
    `selection.chunk` rows; the store's rows and the window are whole pages (`can_attend_in_place`)."""
    B, h, _ = selection.starts.shape
    K, c = view.store.k.shape[2], selection.chunk
    k_pages, v_pages, first = view.pages(c)  # first [B, K]
    first = jnp.repeat(first, h // K, axis=1)  # [B, h]: selection head -> its KV head's first page
    pages = first[..., None] + selection.starts // c  # [B, h, n]
    mask = selection.mask  # [B, h, n, c]
    if window:
        pages = jnp.concatenate([pages, first[..., None] + jnp.arange(window // c, dtype=jnp.int32)], axis=-1)
        ring = jnp.broadcast_to(window_mask.reshape(B, 1, window // c, c), (B, h, window // c, c))
        mask = jnp.concatenate([mask, ring], axis=2)
    out = kernels.selected_attention(q.reshape(B, h, q.shape[1] // h, q.shape[2]), k_pages, v_pages, pages, mask,
                                     impl=impl)
    return out.reshape(q.shape)


def tiles_for(view: DeviceLayer, selection: Selection) -> int:
    """How many tiles of (sequence, KV head) pairs `attend_tiled` splits a selection's rows into: 1 while the
    gathered K and V fit in two tiles (`GATHER_TILE_BYTES`: there the loop costs more than it saves), else the
    fewest (a divisor of B·K) that keep a tile within one."""
    L, B, K, R, H = view.store.k.shape
    rows = selection.starts.shape[1] * selection.starts.shape[2] * selection.chunk  # per sequence
    total = 2 * B * rows * H * view.store.k.dtype.itemsize
    if total <= 2 * GATHER_TILE_BYTES:
        return 1
    return next(d for d in range(1, B * K + 1) if (B * K) % d == 0 and (total <= d * GATHER_TILE_BYTES or d == B * K))


def attend_tiled(q: jax.Array, view: DeviceLayer, selection: Selection, window: int, window_mask,
                 cap: float | None = None) -> jax.Array:
    """`attention.selection_and_window_attention` over the selection's rows and the ring, a tile of (sequence, KV
    head) pairs at a time (`tiles_for`, a `lax.map`): q [B, N, H] -> [B, N, H] float32. XLA:CPU cannot read
    gathered rows inside the score product: the gather writes them out and the product reads them back. All
    heads' rows at once make that round trip through memory; a tile's stay in the cache between the two."""
    L, B, K, R, H = view.store.k.shape
    N, h, c = q.shape[1], selection.starts.shape[1], selection.chunk
    tiles = tiles_for(view, selection)
    p = B * K // tiles  # pairs a tile
    tiled = lambda x: x.reshape((tiles, p, -1) + x.shape[2:])  # noqa: E731  [tiles, p, h/K (or G), ...]
    qs, starts, mask = tiled(q), tiled(selection.starts), tiled(selection.mask)
    w_masks = jnp.repeat(window_mask, K, axis=0).reshape(tiles, p, -1) if window else jnp.zeros((tiles, p, 0), bool)

    def one_tile(args):
        t, q_t, starts_t, mask_t, w_mask = args  # [p, G, H], [p, h/K, n], [p, h/K, n, c], [p, W]
        pairs = t * p + jnp.arange(p, dtype=jnp.int32)
        k_sel, v_sel = (x.reshape(p, h // K, -1, H) for x in
                        view.read_pairs(pairs, starts_t.reshape(p, -1), c, selection.aligned))
        k_win = v_win = None
        if window:
            k_win, v_win = (x[:, None] for x in view.ring_pairs(t * p, p, window))  # [p, 1, W, H]
        return attention.selection_and_window_attention(q_t, k_sel, v_sel, mask_t.reshape(p, h // K, -1), k_win,
                                                        v_win, w_mask if window else None, cap)

    with jax.named_scope("attend_tiled"):
        out = jax.lax.map(one_tile, (jnp.arange(tiles, dtype=jnp.int32), qs, starts, mask, w_masks))
    return out.reshape(B, N, H)
