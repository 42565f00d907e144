"""RULER-style synthetic retrieval tasks, generated locally from a seed and sized with the model's tokenizer.

* `niah_single`: one needle "The special magic number for KEY is NUMBER." hidden at a random depth in
  RULER's noise haystack ("The grass is green. The sky is blue. ..."); the question asks for KEY's number.
* `niah_multikey`: four needles with different keys at random depths; the question asks for one of them.
* `kv_retrieval`: a JSON object of uuid keys and uuid values; the question asks for one key's value (the
  queried pair sits at a random depth).
* `demo_needle` (not among the default three): `clusterkv demo`'s question, sample i asked of the demo's document
  for seed `seed + i` (everyday sentences around one five-digit number, 40% deep; `demo.haystack`). Its context
  is the document's tokens, as the demo's `--context` (the prompt is about 60 more): `--tasks demo_needle
  --context 4096 --samples 20 --budgets 512 --max-new-tokens 16` asks what `clusterkv demo --seed S` asks, S = 0..19.

Each prompt is built (chat template and answer prefix included) to the largest size whose token count is at
most the requested context. A sample is correct when its expected value appears in the generated text
(RULER's string match). Everything is a function of (seed, task, context, sample index).
"""

from __future__ import annotations

import json
import sys
import uuid
from typing import Any, Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

from clusterkv_jax.eval.longbench import _runs, generate_batched
from clusterkv_jax.policies import make_policy, parse_choices

SYNTHETIC_TASKS = ("niah_single", "niah_multikey", "kv_retrieval")  # RULER's, the default
DEMO_TASK = "demo_needle"
TASKS = SYNTHETIC_TASKS + (DEMO_TASK,)
MULTIKEY_NEEDLES = 4

HAYSTACK = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
NEEDLE = "The special magic number for {key} is {value}."
NIAH_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the numbers afterwards.\n{context}\nWhat is the special magic number for {key} mentioned in the "
    "provided text?"
)
NIAH_ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"
KV_INSTRUCTION = (
    "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n{context}\n\n"
    "Key: \"{key}\"\nWhat is the value associated with the specified key?"
)
KV_ANSWER_PREFIX = "The value associated with the specified key is:"

_ADJECTIVES = ("amber", "bold", "brisk", "calm", "clever", "crimson", "curious", "dusty", "eager", "fancy",
               "gentle", "golden", "hollow", "humble", "icy", "jolly", "lively", "lucky", "mellow", "misty",
               "noble", "odd", "pale", "quiet", "rapid", "rusty", "shy", "silent", "silver", "sleepy", "sturdy",
               "sunny", "tiny", "vivid", "wandering", "wild", "witty", "young", "zealous", "wonderful")
_NOUNS = ("anchor", "badger", "beacon", "canyon", "castle", "cedar", "comet", "falcon", "fjord", "garden",
          "glacier", "harbor", "heron", "island", "lantern", "maple", "meadow", "otter", "panther", "pebble",
          "pepper", "quartz", "raven", "river", "saddle", "salmon", "spruce", "summit", "thimble", "tiger",
          "tulip", "valley", "violin", "walrus", "willow", "wizard", "yacht", "zebra", "orchid", "kettle")


def _key(rng: np.random.Generator) -> str:
    return f"{_ADJECTIVES[rng.integers(len(_ADJECTIVES))]}-{_NOUNS[rng.integers(len(_NOUNS))]}"


def _number(rng: np.random.Generator) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def _uuid(rng: np.random.Generator) -> str:
    return str(uuid.UUID(bytes=rng.bytes(16), version=4))


def render_prompt(tokenizer, instruction: str, answer_prefix: str, chat: bool) -> tuple[str, list[int]]:
    """The prompt text and ids: the instruction as a user turn (when `chat`), then the answer prefix."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": instruction}]) + answer_prefix
        return text, tokenizer.encode(text, add_special_tokens=False)
    text = instruction + "\n" + answer_prefix
    return text, tokenizer.encode(text, add_special_tokens=True)


def _fit(render: Callable[[int], tuple[str, list[int]]], context: int, what: str) -> tuple[int, str, list[int]]:
    """The largest unit count n whose rendered prompt has at most `context` tokens (exponential, then binary
    search), with that prompt."""
    text, ids = render(0)
    if len(ids) > context:
        raise ValueError(f"{what}: the prompt without any filler has {len(ids)} tokens > context {context}")
    lo, lo_out, hi = 0, (text, ids), 1
    while True:
        out = render(hi)
        if len(out[1]) > context:
            break
        lo, lo_out, hi = hi, out, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        out = render(mid)
        if len(out[1]) <= context:
            lo, lo_out = mid, out
        else:
            hi = mid
    return lo, lo_out[0], lo_out[1]


def _haystack(n: int, needles: Sequence[tuple[float, str]]) -> str:
    """n filler sentences with each needle inserted after round(depth * n) of them."""
    sentences = [HAYSTACK[i % len(HAYSTACK)] for i in range(n)]
    for depth, needle in sorted(needles, key=lambda x: -x[0]):
        sentences.insert(int(round(depth * n)), needle)
    return " ".join(sentences)


def make_sample(task: str, tokenizer, context: int, rng: np.random.Generator, *, chat: bool,
                depth: float | None = None) -> dict[str, Any]:
    """One sample of `task` whose prompt has at most `context` tokens. `depth` (0..1) fixes the queried
    item's position instead of drawing it."""
    if task in ("niah_single", "niah_multikey"):
        count = 1 if task == "niah_single" else MULTIKEY_NEEDLES
        keys: list[str] = []
        while len(keys) < count:
            k = _key(rng)
            if k not in keys:
                keys.append(k)
        values = [_number(rng) for _ in keys]
        depths = [float(rng.uniform(0.0, 1.0)) for _ in keys]
        target = int(rng.integers(count))
        if depth is not None:
            depths[target] = float(depth)
        key, answer = keys[target], values[target]
        needles = [(d, NEEDLE.format(key=k, value=v)) for d, k, v in zip(depths, keys, values)]

        def render(n):
            haystack = _haystack(n, needles)
            return render_prompt(tokenizer, NIAH_INSTRUCTION.format(context=haystack, key=key),
                                 NIAH_ANSWER_PREFIX.format(key=key), chat)

        needle = NEEDLE.format(key=key, value=answer)
    elif task == "kv_retrieval":
        query_depth = float(rng.uniform(0.0, 1.0)) if depth is None else float(depth)
        pairs: list[tuple[str, str]] = []

        def pairs_upto(n):
            while len(pairs) < n:  # drawn in order, so pair i is the same however many are drawn
                pairs.append((_uuid(rng), _uuid(rng)))
            return pairs[:n]

        def query_index(n):
            return int(round(query_depth * (n - 1)))

        def render(n):
            n = max(n, 1)
            items = pairs_upto(n)
            qk = items[query_index(n)][0]
            body = "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in items) + "}"
            return render_prompt(tokenizer, KV_INSTRUCTION.format(context=body, key=qk), KV_ANSWER_PREFIX, chat)
    else:
        raise ValueError(f"unknown synthetic task {task!r}; choose from {', '.join(SYNTHETIC_TASKS)}")

    n, text, ids = _fit(render, context, f"{task} at context {context}")
    if task == "kv_retrieval":
        n = max(n, 1)
        key, answer = pairs[query_index(n)]
        needle = f"{json.dumps(key)}: {json.dumps(answer)}"
        depths = [query_depth]
        target = 0
    return {"task": task, "context": context, "prompt": text, "prompt_ids": ids, "answer": answer, "key": key,
            "needle": needle, "depth": depths[target], "units": n}


def build_samples(tokenizer, task: str, context: int, samples: int, seed: int = 0,
                  chat: bool | None = None) -> list[dict[str, Any]]:
    """`samples` samples of `task`; sample i depends only on (seed, task, context, i)."""
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; choose from {', '.join(TASKS)}")
    if chat is None:
        chat = bool(tokenizer.chat_template)
    if task == DEMO_TASK:
        return [demo_sample(tokenizer, context, seed + i, chat=chat) for i in range(samples)]
    t = SYNTHETIC_TASKS.index(task)
    return [make_sample(task, tokenizer, context, np.random.default_rng([seed, t, context, i]), chat=chat)
            for i in range(samples)]


def demo_sample(tokenizer, context: int, seed: int, *, chat: bool) -> dict[str, Any]:
    """The demo's question of its document for `seed` with `context` document tokens, prompted as `clusterkv demo`
    prompts it (`demo.question_prompt`; without a chat template, the document, a blank line and the question)."""
    from clusterkv_jax.demo import haystack, question_prompt

    stack = haystack(tokenizer, context, seed=seed)
    if chat:
        ids = question_prompt(tokenizer, stack.document, stack.question)
        text = tokenizer.decode(ids, skip_special_tokens=False)
    else:
        text, ids = render_prompt(tokenizer, f"{stack.document}\n\n{stack.question}", "", chat)
    return {"task": DEMO_TASK, "context": context, "prompt": text, "prompt_ids": ids, "answer": stack.answer,
            "key": None, "needle": stack.needle, "depth": 0.4, "units": None, "seed": seed}


def is_correct(prediction: str, answer: str) -> bool:
    """RULER's string match: the expected value appears in the generated text (case-insensitive)."""
    return answer.lower() in prediction.lower()


def parse_tasks(text: str) -> list[str]:
    return parse_choices(text, list(TASKS), "synthetic task")


def run_synthetic(model, contexts: Sequence[int], samples: int, budgets: list[int], policy_names: list[str],
                  policy_options: dict[str, dict] | None = None, seed: int = 0, progress: bool = True, *,
                  tasks: Sequence[str] = SYNTHETIC_TASKS, batch_size: int = 1, max_new_tokens: int = 48,
                  chat: bool | None = None) -> dict[str, Any]:
    """Accuracy (%) of full KV and of every (policy, budget) on each task at each context length.

    Returns {"scores": {policy: {budget: {context: {task: acc, "average": mean}}}}, "accuracy": {context:
    {policy: {budget: mean over tasks}}}, ...}; full KV's entry is repeated under every budget.
    """
    if model.tokenizer is None:
        raise ValueError("synthetic tasks need a model with a tokenizer")
    if samples < 1:
        raise ValueError("--samples must be >= 1")
    tasks = parse_tasks(",".join(tasks))  # validates the names
    limit = model.config.max_position_embeddings
    if chat is None:
        chat = bool(model.tokenizer.chat_template)
    runs = _runs(policy_names, budgets)
    data = {c: {t: build_samples(model.tokenizer, t, c, samples, seed, chat) for t in tasks} for c in contexts}
    longest = max(len(s["prompt_ids"]) for by_task in data.values() for group in by_task.values() for s in group)
    if longest + max_new_tokens > limit:
        raise ValueError(f"a prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the model's {limit} "
                         "positions")
    n = len(tasks) * samples
    calls = len(contexts) * len(runs) * -(-n // max(1, min(batch_size, n)))
    results: dict[str, Any] = {
        "benchmark": "synthetic", "tasks": tasks, "contexts": list(contexts), "samples": samples, "seed": seed,
        "chat_template": chat, "max_new_tokens": max_new_tokens, "budgets": budgets,
        "policy_options": policy_options or {},
        "prompt_tokens": {str(c): {t: [len(s["prompt_ids"]) for s in data[c][t]] for t in tasks} for c in contexts},
        "answers": {str(c): {t: [s["answer"] for s in data[c][t]] for t in tasks} for c in contexts},
        "depths": {str(c): {t: [round(s["depth"], 4) for s in data[c][t]] for t in tasks} for c in contexts},
        "scores": {}, "accuracy": {}, "predictions": {},
    }
    bar = tqdm(total=calls, desc="synthetic: context x batch x policy", disable=not progress, file=sys.stderr)
    policies = [make_policy(name, budget or 0, **(policy_options or {}).get(name, {})) for name, budget in runs]
    for c in contexts:
        members = [(t, i) for t in tasks for i in range(samples)]
        prompts = [data[c][t][i]["prompt_ids"] for t, i in members]
        texts = generate_batched(model, prompts, max_new_tokens, policies, batch_size, bar)
        for (name, budget), run_texts in zip(runs, texts):
            preds: dict[str, list[str]] = {t: [] for t in tasks}
            for (t, i), text in zip(members, run_texts):
                preds[t].append(text)
            row: dict[str, float] = {}
            for t in tasks:
                hits = [is_correct(p, s["answer"]) for p, s in zip(preds[t], data[c][t])]
                row[t] = round(100.0 * float(np.mean(hits)), 2)
            row["average"] = round(sum(row[t] for t in tasks) / len(tasks), 2)
            for b in (budgets if name == "full" else [budget]):
                results["scores"].setdefault(name, {}).setdefault(str(b), {})[str(c)] = row
                results["accuracy"].setdefault(str(c), {}).setdefault(name, {})[str(b)] = row["average"]
            results["predictions"].setdefault(str(c), {})[name if name == "full" else f"{name}@{budget}"] = preds
    bar.close()
    return results


def task_table(results: dict[str, Any]) -> str:
    """Markdown: one row per (policy, budget, context), one column per task, plus the average."""
    tasks = results["tasks"]
    lines = ["| policy | budget | context | " + " | ".join(tasks) + " | average |",
             "|---|---|---|" + "---|" * (len(tasks) + 1)]
    for name, by_budget in results["scores"].items():
        for b, by_context in (list(by_budget.items())[:1] if name == "full" else by_budget.items()):
            for c, row in by_context.items():
                label = "-" if name == "full" else b
                lines.append(f"| {name} | {label} | {c} | " + " | ".join(f"{row[t]:.1f}" for t in tasks)
                             + f" | {row['average']:.1f} |")
    return "\n".join(lines)
