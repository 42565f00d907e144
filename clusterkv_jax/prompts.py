"""Prompts as `generate`'s programs take them: token ids checked (`token_ids`) and right-padded to a shape bucket,
the batch padded to the mesh, the parameters placed on it (`prompt_batch`); and one prefill of a batch under full KV
that several policies start from (`prefill_prompts`, `Prefilled`: `generate(..., prefilled=)`).
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from clusterkv_jax import sharding as sh
from clusterkv_jax.cache import KVCache
from clusterkv_jax.config import ModelConfig
from clusterkv_jax.decode_loop import prefill_full
from clusterkv_jax.distributed import waiting_for_peers
from clusterkv_jax.model import PREFILL_BLOCK
from clusterkv_jax.policies import KVPolicy
from clusterkv_jax.steps import bucket_length, cache_capacity


def token_ids(model, prompts, chat: bool, add_special_tokens: bool) -> tuple[list[list[int]], bool]:
    """Normalises prompts (text, ids, or lists of either) into a list of id lists; says if input was single."""
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if not isinstance(prompts, (str, list, tuple)):
        raise TypeError(f"prompts must be a string, a list of token ids, or a list of either; got "
                        f"{type(prompts).__name__}")
    single = isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and len(prompts) > 0
                                          and all(isinstance(t, (int, np.integer)) for t in prompts))
    batch = [prompts] if single else list(prompts)
    if not batch:
        raise ValueError("no prompts given")
    ids: list[list[int]] = []
    for i, p in enumerate(batch):
        if isinstance(p, str):
            try:
                p.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"prompt {i} is not valid Unicode text: {e.reason} at character {e.start} "
                                 f"({p[e.start]!r})") from None
            if model.tokenizer is None:
                where = getattr(model, "path", None)
                where = f"model {where!r} has no tokenizer.json" if where else "the model has no tokenizer"
                raise ValueError(f"{where}, so text prompts cannot be tokenised: copy the checkpoint's "
                                 "tokenizer.json (and tokenizer_config.json) there, or pass token ids from Python")
            if chat:
                p = model.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                ids.append(model.tokenizer.encode(p, add_special_tokens=False))
            else:
                ids.append(model.tokenizer.encode(p, add_special_tokens=add_special_tokens))
        elif isinstance(p, (list, tuple, np.ndarray)):
            if chat:
                raise ValueError(f"chat=True wraps text in the chat template; prompt {i} is token ids (render the "
                                 "template yourself, or pass text)")
            items = p.tolist() if isinstance(p, np.ndarray) else list(p)
            if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in items):
                raise TypeError(f"prompt {i} must be a string or a list of int token ids, got {str(p)[:60]}")
            ids.append([int(t) for t in items])
        else:
            raise TypeError(f"prompt {i} must be a string or a list of int token ids, got {type(p).__name__}")
        if not ids[-1]:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in ids[-1] if not 0 <= t < model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {model.config.vocab_size}): {bad[:5]}")
    return ids, single


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Prompts as the programs take them (tokens, lengths and bucket None where a shared prefill holds them)."""

    ids: list[list[int]]  # each prompt's token ids, as given
    tokens: Any  # [B, bucket] int32 right-padded, B padded for the mesh (sharded over "data" on one)
    lengths: Any  # [B] int32
    bucket: int | None
    prefill_chunk: int | None
    rules: Any  # ShardingRules, or None without a mesh
    params: Any  # the model's parameters, placed on the mesh


def prompt_batch(model, prompts, max_new_tokens: int, chat: bool, add_special_tokens: bool, max_length, prefill_chunk,
             mesh) -> PromptBatch:
    """Checks the prompts and pads them to their shape bucket (and the batch to the mesh)."""
    ids, _ = token_ids(model, prompts, chat, add_special_tokens)
    longest = max(len(p) for p in ids)
    _check_room(longest, max_new_tokens, max_length, model.config)
    bucket, prefill_chunk = _bucket_and_chunk(longest, prefill_chunk)
    padded, rules, params = _on_mesh(model, ids, mesh)
    lengths = np.array([len(p) for p in padded], np.int32)
    tokens = np.zeros((len(padded), bucket), np.int32)
    for i, p in enumerate(padded):
        tokens[i, : len(p)] = p
    if rules is not None:
        tokens_in, lengths_in = sh.shard_batch(tokens, rules), sh.shard_batch(lengths, rules)
    else:
        tokens_in, lengths_in = jnp.asarray(tokens), jnp.asarray(lengths)
    return PromptBatch(ids, tokens_in, lengths_in, bucket, prefill_chunk, rules, params)


@dataclasses.dataclass(frozen=True)
class Prefilled:
    """One full-KV prefill of a batch of prompts that `generate(..., prefilled=)` starts from under any policy that
    indexes the prompt by its keys, or by at most its last `prompt_queries` queries (`serves`). Made by
    `prefill_prompts`."""

    ids: list[list[int]]  # each prompt's token ids
    max_new_tokens: int  # the most tokens a generate call from it may add
    prompt_queries: int  # each layer's last prompt queries kept (0: none)
    cache: KVCache  # the prompts' K/V under full KV, room for max_new_tokens more
    logits: jax.Array  # [B, V] at each prompt's last token
    config: ModelConfig
    params: Any  # the weights that made the K/V (held by reference: a generate call must run with the same)
    prefill_chunk: int | None
    rules: Any  # ShardingRules, or None without a mesh
    seconds: float  # the compiled prefill, until its result was ready
    compile_seconds: float

    def serves(self, policy: KVPolicy) -> bool:
        """Whether `policy` can start from this prefill: it indexes the prompt by its keys, or by no more of its
        last queries than the prefill kept."""
        return policy.prompt_queries <= self.prompt_queries

    def batch_for(self, model, ids, max_new_tokens: int, policy: KVPolicy, *, cache_dtype, mesh, prefill_chunk,
                   max_length) -> PromptBatch:
        """The batch a `generate` call with these arguments runs from this prefill; refuses what does not match."""
        if model.config != self.config or not _same_arrays(model.params, self.params):
            raise ValueError("prefilled was prefilled by another model (another config or other weights): "
                             "prefill_prompts with the model you generate with")
        if ids != self.ids:
            which = next((i for i, (a, b) in enumerate(zip(ids, self.ids)) if a != b), min(len(ids), len(self.ids)))
            raise ValueError(f"prefilled holds other prompts: {len(self.ids)} prompt(s) prefilled, {len(ids)} given, "
                             f"prompt {which} differs")
        if max_new_tokens > self.max_new_tokens:
            raise ValueError(f"max_new_tokens={max_new_tokens} exceeds the {self.max_new_tokens} the prompts were "
                             "prefilled for (prefill_prompts(..., max_new_tokens=))")
        if not self.serves(policy):
            n = policy.prompt_queries
            raise ValueError(f"{type(policy).__name__} indexes the prompt by its last {n} queries; this prefill kept "
                             f"{self.prompt_queries}: prefill_prompts(..., prompt_queries={n}) keeps them")
        fixed = {"cache_dtype": (cache_dtype, self.cache.dtype, lambda a, b: jnp.dtype(a) == b),
                 "prefill_chunk": (prefill_chunk, self.prefill_chunk, lambda a, b: a == b)}
        for name, (given, held, same) in fixed.items():
            if given is not None and not same(given, held):
                raise ValueError(f"{name}={given!r} differs from the prefill's {held!r}: the prefill fixes it")
        _check_room(max(len(p) for p in ids), max_new_tokens, max_length, model.config)
        if mesh is not None and self.rules is None:
            raise ValueError("mesh= given, but the prompts were prefilled without one: pass it to prefill_prompts")
        held_mesh = None if self.rules is None else self.rules.mesh
        padded, rules, params = _on_mesh(model, ids, held_mesh if mesh is None else mesh)
        if rules != self.rules:
            raise ValueError("mesh= differs from the one the prompts were prefilled on")
        return PromptBatch(ids, None, None, None, self.prefill_chunk, rules, params)  # the prompts are in the cache


def prefill_prompts(
    model,
    prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
    max_new_tokens: int = 128,
    *,
    chat: bool = False,
    add_special_tokens: bool = True,
    max_length: int | None = None,
    cache_dtype: Any = None,
    mesh: Any = None,
    prefill_chunk: int | None = None,
    prompt_queries: int = 0,
) -> Prefilled:
    """Prefills prompts once under full KV, for `generate(model, prompts, n, policy=P, prefilled=...)` under
    several policies (n <= `max_new_tokens`): each then stores and indexes the K/V held here instead of running the
    model over the prompts again, and generates the tokens it would after its own prefill. The arguments are
    `generate`'s; the result holds the prompts' K/V with room for `max_new_tokens` more, until it is dropped.
    `prompt_queries` n also keeps each layer's last n prompt queries, for the policies that index by them
    (SnapKV's `window`, InfiniGen's `sample`: `max(p.prompt_queries for p in policies)`)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if isinstance(prompt_queries, bool) or not isinstance(prompt_queries, (int, np.integer)) or prompt_queries < 0:
        raise ValueError(f"prompt_queries must be an int >= 0, got {prompt_queries!r}")
    batch = prompt_batch(model, prompts, max_new_tokens, chat, add_special_tokens, max_length, prefill_chunk, mesh)
    if cache_dtype is None:
        cache_dtype = jax.tree_util.tree_leaves(model.params)[0].dtype
    args = (batch.params, batch.tokens, batch.lengths)
    static = dict(config=model.config, capacity=cache_capacity(batch.bucket, max_new_tokens),
                  cache_dtype=jnp.dtype(cache_dtype), sharding=batch.rules, prefill_chunk=batch.prefill_chunk,
                  prompt_queries=int(prompt_queries))
    start = time.perf_counter()
    prefill_full.lower(*args, **static).compile()
    compiled = time.perf_counter()
    with waiting_for_peers("prefill"):
        logits, cache = jax.block_until_ready(prefill_full(*args, **static))
    return Prefilled(ids=batch.ids, max_new_tokens=int(max_new_tokens), prompt_queries=int(prompt_queries),
                     cache=cache, logits=logits,
                     config=model.config, params=model.params, prefill_chunk=batch.prefill_chunk, rules=batch.rules,
                     seconds=time.perf_counter() - compiled, compile_seconds=compiled - start)


def _same_arrays(a, b) -> bool:
    """Whether two parameter trees hold the very same arrays: the check is by identity, so it costs nothing, and
    weights loaded twice count as other weights (their values are not compared)."""
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(leaves_a) == len(leaves_b) and all(x is y for x, y in zip(leaves_a, leaves_b))


def _check_room(longest: int, max_new_tokens: int, max_length, config: ModelConfig) -> None:
    """Refuses a `max_length` that is not a positive int, and prompts that leave no room for `max_new_tokens`."""
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral)
                                   or max_length < 1):
        raise ValueError(f"max_length must be a positive int (prompt + new tokens) or None (the model's "
                         f"max_position_embeddings), got {max_length!r}")
    limit = config.max_position_embeddings if max_length is None else max_length
    if longest + max_new_tokens > limit:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the capacity of {limit} "
            f"positions; shorten the prompt or lower max_new_tokens"
        )


def _bucket_and_chunk(longest: int, prefill_chunk) -> tuple[int, int | None]:
    """The prompts' shape bucket and the prefill chunk that runs it (None: unchunked): a bucket longer than the
    chunk is rounded up to whole chunks; one that fits in a chunk runs unchunked."""
    bucket = bucket_length(longest)
    if prefill_chunk is None:
        return bucket, None
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, numbers.Integral):
        raise TypeError(f"prefill_chunk must be an int (a multiple of {PREFILL_BLOCK}) or None, got "
                        f"{prefill_chunk!r}")
    if prefill_chunk <= 0 or prefill_chunk % PREFILL_BLOCK:
        raise ValueError(f"prefill_chunk must be a positive multiple of {PREFILL_BLOCK}, got {prefill_chunk}")
    if bucket > prefill_chunk:
        return -(-bucket // prefill_chunk) * prefill_chunk, prefill_chunk
    return bucket, None


def _on_mesh(model, ids: list[list[int]], mesh):
    """-> (the prompts, padded with copies of the first to a batch the mesh's "data" axis divides; the sharding
    rules, None without a mesh; the parameters, placed on the mesh)."""
    if mesh is None:
        mesh = getattr(model, "mesh", None)
    if mesh is None and jax.process_count() > 1:
        raise ValueError(f"JAX runs {jax.process_count()} processes: pass mesh= (a mesh over all {jax.device_count()} "
                         "devices), or load the model with load_model(path, mesh=...)")
    if mesh is None:
        return ids, None, model.params
    mesh = sh.make_mesh(mesh)
    ids = ids + [ids[0]] * (sh.padded_batch(len(ids), mesh) - len(ids))
    rules = sh.sharding_rules(model.config, mesh, len(ids))
    return ids, rules, _placed_params(model, rules)


def _placed_params(model, rules):
    """model.params on the mesh of `rules`, placed on the first call and kept on the model object."""
    key = (rules.mesh, rules.heads, rules.mlp)
    kept = getattr(model, "_sharded_params", None)
    if kept is not None and kept[0] is model.params and kept[1] == key:
        return kept[2]
    placed = sh.shard_params(model.params, model.config, rules)
    try:
        model._sharded_params = (model.params, key, placed)
    except (AttributeError, TypeError):  # a frozen or slotted model object: place on every call
        pass
    return placed
