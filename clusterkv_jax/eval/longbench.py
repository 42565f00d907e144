"""LongBench (v1) on the ClusterKV paper's 8 English datasets, with each KV policy during generation.

Follows THUDM/LongBench's `pred.py` and `eval.py`: the prompt is `dataset2prompt[dataset].format(**sample)`;
when its tokens exceed `max_length` it is truncated in the middle (the text of the first `max_length // 2`
and of the last `max_length // 2` tokens, joined); chat models get their chat template except on triviaqa
(LongBench leaves few-shot tasks raw); greedy decoding of at most `dataset2maxlen[dataset]` tokens, stopping
at EOS; scores from `clusterkv_jax.eval.metrics`. Data: LongBench's JSONL files, `{data_dir}/{dataset}.jsonl`
(the `data.zip` of the THUDM/LongBench dataset repository), one object per line with `input`, `context`,
`answers`, `all_classes` and `length`.

The prompt strings and generation lengths below are copied verbatim from LongBench's
`LongBench/config/dataset2prompt.json` and `dataset2maxlen.json` (typos such as "asconcisely" included).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Sequence

from tqdm.auto import tqdm

from clusterkv_jax.eval.metrics import score
from clusterkv_jax.policies import make_policy, parse_choices
from clusterkv_jax.generate import generate
from clusterkv_jax.prompts import prefill_prompts

LONGBENCH_TASKS = ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report",
                   "triviaqa")

_MULTIHOP = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    "\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only "
    "give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
_QASPER_INSTRUCTION = (
    "Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question "
    "cannot be answered based on the information in the article, write \"unanswerable\". If the question is a "
    "yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation."
)

DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: "
        "{context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase "
        "if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. " + _QASPER_INSTRUCTION + "\n\nArticle: {context}\n\n"
        " Answer the question based on the above article as concisely as you can, using a single phrase or sentence"
        " if possible. If the question cannot be answered based on the information in the article, write "
        "\"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do "
        "not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on "
        "the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "hotpotqa": _MULTIHOP,
    "2wikimqa": _MULTIHOP,
    "musique": _MULTIHOP,
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
        "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other "
        "words. The following are some examples.\n\n{context}\n\n{input}"
    ),
}

DATASET2MAXLEN: dict[str, int] = {"narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32,
                                  "2wikimqa": 32, "musique": 32, "gov_report": 512, "triviaqa": 32}

# pred.py: "chat models are better off without build prompts on these tasks"
NO_CHAT_DATASETS = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")


def parse_tasks(text: str) -> list[str]:
    return parse_choices(text, list(LONGBENCH_TASKS), "LongBench task")


def read_jsonl(data_dir: str, dataset: str, limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` samples (all when None) of `{data_dir}/{dataset}.jsonl`."""
    path = os.path.join(data_dir, f"{dataset}.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found (LongBench's data.zip unpacked gives one JSONL per dataset)")
    samples = []
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    for line_no, line in enumerate(text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        if limit is not None and len(samples) >= limit:
            break
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{line_no}: not a JSON object ({e})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{line_no}: not a JSON object (a {type(obj).__name__})")
        missing = [k for k in ("input", "context", "answers") if k not in obj]
        if missing:
            raise ValueError(f"{path}:{line_no}: missing field(s) {', '.join(missing)}")
        if isinstance(obj["answers"], str):
            obj["answers"] = [obj["answers"]]
        obj.setdefault("all_classes", None)
        samples.append(obj)
    if not samples:
        raise ValueError(f"{path} has no samples")
    return samples


def format_prompt(dataset: str, sample: dict[str, Any]) -> str:
    return DATASET2PROMPT[dataset].format(**sample)


def middle_truncate(ids: Sequence[int], max_length: int) -> list[int]:
    """LongBench's truncation: over `max_length` tokens, keep the first and the last `int(max_length / 2)`."""
    ids = list(ids)
    if len(ids) <= max_length:
        return ids
    half = int(max_length / 2)
    return ids[:half] + ids[-half:]


def build_prompt_ids(tokenizer, dataset: str, sample: dict[str, Any], max_length: int, chat: bool) -> list[int]:
    """Token ids of the sample's prompt: formatted, truncated in the middle to `max_length` tokens (in text, as
    pred.py does: the two halves are decoded and joined), then wrapped in the chat template when `chat` and the
    dataset is not one LongBench leaves raw."""
    prompt = format_prompt(dataset, sample)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    if len(ids) > max_length:
        half = int(max_length / 2)
        prompt = tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
            ids[-half:], skip_special_tokens=True)
    if chat and dataset not in NO_CHAT_DATASETS:
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]),
                                add_special_tokens=False)
    return tokenizer.encode(prompt, add_special_tokens=True)


def fitted_prompt_ids(tokenizer, dataset: str, sample: dict[str, Any], max_length: int, chat: bool,
                      max_positions: int, max_new_tokens: int) -> list[int]:
    """`build_prompt_ids`, with the truncation length lowered when the prompt plus the generated tokens would
    not fit the model's positions (e.g. SmolLM2's 8192 with `--max-length 8000` and gov_report's 512)."""
    length = max_length
    while True:
        ids = build_prompt_ids(tokenizer, dataset, sample, length, chat)
        excess = len(ids) + max_new_tokens - max_positions
        if excess <= 0:
            return ids
        if length <= 16:
            raise ValueError(f"{dataset}: the prompt cannot be made to fit {max_positions} positions")
        length = max(16, min(length, len(ids)) - excess)


def generate_batched(model, prompts: list[list[int]], max_new_tokens: int, policies: list, batch_size: int,
                     progress_bar=None) -> list[list[str]]:
    """Greedy texts for every prompt under each policy ([policy][prompt]), in batches of similar length; the last
    batch is padded with copies of its first prompt so that every call has the same batch size (no recompilation
    for a remainder). Each batch is prefilled once for all the policies (`prefill_prompts`, keeping the prompt's
    last queries for those that index by them)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    size = max(1, min(batch_size, len(prompts)))
    texts: list[list[str | None]] = [[None] * len(prompts) for _ in policies]
    queries = max((policy.prompt_queries for policy in policies), default=0)
    for start in range(0, len(order), size):
        chunk = order[start : start + size]
        batch = [prompts[i] for i in chunk]
        batch += [batch[0]] * (size - len(batch))
        shared = prefill_prompts(model, batch, max_new_tokens, prompt_queries=queries)
        for j, policy in enumerate(policies):
            result = generate(model, batch, max_new_tokens, policy, prefilled=shared)
            for i, text in zip(chunk, result.texts):
                texts[j][i] = text
            if progress_bar is not None:
                progress_bar.update(1)
        del shared  # its K/V, before the next batch's
    return texts  # type: ignore[return-value]


def _runs(policy_names: list[str], budgets: list[int]) -> list[tuple[str, int | None]]:
    return [("full", None)] + [(n, b) for n in policy_names if n != "full" for b in budgets]


def run_longbench(model, data_dir: str, tasks: Sequence[str], max_length: int, budgets: list[int],
                  policy_names: list[str], policy_options: dict[str, dict] | None = None, limit: int | None = None,
                  progress: bool = True, *, batch_size: int = 1, max_new_tokens: int | None = None,
                  chat: bool | None = None) -> dict[str, Any]:
    """Scores of full KV and of every (policy, budget) on each task, and their average over the tasks.

    Returns {"scores": {policy: {budget: {task: score, "average": mean}}}, "average": {policy: {budget:
    mean}}, "predictions": {"full" or "policy@budget": {task: [text, ...]}}}, ...}; full KV's entry is repeated under
    every budget. `max_new_tokens` overrides LongBench's per-dataset lengths (for quick runs); `chat` defaults
    to whether the tokenizer has a chat template.
    """
    if model.tokenizer is None:
        raise ValueError("LongBench needs a model with a tokenizer")
    if max_length < 16:
        raise ValueError("--max-length must be >= 16")
    tasks = parse_tasks(",".join(tasks))  # validates the names
    if chat is None:
        chat = bool(model.tokenizer.chat_template)
    max_positions = model.config.max_position_embeddings
    data, prompts, gen_len = {}, {}, {}
    for t in tasks:
        data[t] = read_jsonl(data_dir, t, limit)
        gen_len[t] = max_new_tokens or DATASET2MAXLEN[t]
        prompts[t] = [fitted_prompt_ids(model.tokenizer, t, s, max_length, chat, max_positions, gen_len[t])
                      for s in data[t]]
    # Tasks with the same generation length share batches (and compiled programs).
    groups: dict[int, list[tuple[str, int]]] = {}
    for t in tasks:
        groups.setdefault(gen_len[t], []).extend((t, i) for i in range(len(prompts[t])))

    runs = _runs(policy_names, budgets)
    size = lambda n: max(1, min(batch_size, n))  # noqa: E731
    calls = len(runs) * sum(-(-len(g) // size(len(g))) for g in groups.values())
    results: dict[str, Any] = {
        "benchmark": "longbench", "tasks": tasks, "max_length": max_length, "chat_template": chat,
        "num_samples": {t: len(data[t]) for t in tasks},
        "prompt_tokens": {t: [len(p) for p in prompts[t]] for t in tasks},
        "max_new_tokens": gen_len, "budgets": budgets, "policy_options": policy_options or {},
        "scores": {}, "average": {}, "predictions": {},
    }
    bar = tqdm(total=calls, desc="longbench: batch x policy", disable=not progress, file=sys.stderr)
    policies = [make_policy(name, budget or 0, **(policy_options or {}).get(name, {})) for name, budget in runs]
    preds = [{t: [""] * len(data[t]) for t in tasks} for _ in runs]  # per run
    for length, members in groups.items():
        texts = generate_batched(model, [prompts[t][i] for t, i in members], length, policies, batch_size, bar)
        for run_preds, run_texts in zip(preds, texts):
            for (t, i), text in zip(members, run_texts):
                run_preds[t][i] = text
    for (name, budget), run_preds in zip(runs, preds):
        row = {t: score(t, run_preds[t], [s["answers"] for s in data[t]], data[t][0].get("all_classes"))
               for t in tasks}
        row["average"] = round(sum(row[t] for t in tasks) / len(tasks), 2)
        for b in (budgets if name == "full" else [budget]):
            results["scores"].setdefault(name, {})[str(b)] = row
            results["average"].setdefault(name, {})[str(b)] = row["average"]
        results["predictions"][name if name == "full" else f"{name}@{budget}"] = run_preds
    bar.close()
    return results


def task_table(results: dict[str, Any]) -> str:
    """Markdown: one row per (policy, budget), one column per task, plus the average."""
    tasks = results["tasks"]
    lines = ["| policy | budget | " + " | ".join(tasks) + " | average |", "|---|---|" + "---|" * (len(tasks) + 1)]
    for name, by_budget in results["scores"].items():
        for b, row in (list(by_budget.items())[:1] if name == "full" else by_budget.items()):
            label = "-" if name == "full" else b
            lines.append(f"| {name} | {label} | " + " | ".join(f"{row[t]:.2f}" for t in tasks)
                         + f" | {row['average']:.2f} |")
    return "\n".join(lines)
