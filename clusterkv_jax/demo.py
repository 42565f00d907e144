"""`clusterkv demo`: what recallable KV compression is for, in a couple of minutes on a CPU.

A long document generated from a seed (a haystack of everyday sentences, RULER-style) hides one fact (the needle)
deep inside; the model is asked for it. Full KV, ClusterKV and StreamingLLM answer side by side at the same budget:
ClusterKV attends a fraction of the prompt each step, chosen by the query in semantic space, and can bring the
needle back; StreamingLLM keeps the first and the most recent tokens and has evicted it for good. The demo prints
the prompt's tokens, the tokens each policy attends per step, the answers, and the decode speed of ClusterKV
against full KV only where the budget is below the context (where it covers the context, ClusterKV is full KV).
"""

from __future__ import annotations

import dataclasses
import random
import sys

from clusterkv_jax.commands import attended_per_step

_TIMES = ["On Monday", "In the morning", "Later that week", "At noon", "In the evening", "The next day",
          "Before dawn", "After the rain"]
_PEOPLE = ["Anna", "Boris", "Clara", "David", "Elena", "Felix", "Greta", "Hugo", "Irene", "Jonas", "Karin", "Lars"]
_DOINGS = ["walked to", "painted", "visited", "swept the floor of", "wrote a letter about", "sold apples at",
           "repaired the roof of", "sang a song near", "counted the boats at", "read a book in"]
_PLACES = ["the harbour", "the mill", "the market", "the old bridge", "the bakery", "the school", "the library",
           "the station", "the orchard", "the chapel"]


@dataclasses.dataclass(frozen=True)
class Haystack:
    document: str
    question: str
    answer: str  # what a correct reply contains
    needle: str  # the sentence holding the answer
    needle_token: int  # where the needle starts, in tokens from the document's start


def haystack(tokenizer, tokens: int, *, seed: int = 0, depth: float = 0.4) -> Haystack:
    """A document of at least `tokens` tokens of random everyday sentences (from `seed`) with one needle, a
    random five-digit "special magic number", a fraction `depth` of the way in."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    rng = random.Random(seed)
    answer = str(rng.randint(10000, 99999))
    needle = f"The special magic number is {answer}."
    sentences: list[str] = []
    count = 0
    while count < tokens:  # counted a sentence at a time (with its leading space), as the document joins them
        sentences.append(f"{rng.choice(_TIMES)}, {rng.choice(_PEOPLE)} {rng.choice(_DOINGS)} {rng.choice(_PLACES)}.")
        count += len(tokenizer.encode(" " + sentences[-1], add_special_tokens=False))
    where = round(len(sentences) * depth)
    before = " ".join(sentences[:where])
    needle_token = len(tokenizer.encode(before, add_special_tokens=False)) if before else 0
    document = " ".join(sentences[:where] + [needle] + sentences[where:])
    return Haystack(document, "What is the special magic number?", answer, needle, needle_token)


def question_prompt(tokenizer, document: str, question: str) -> list[int]:
    """The demo's prompt ids: the document, a blank line and the question as one user turn of the chat template."""
    messages = [{"role": "user", "content": f"{document}\n\n{question}"}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def run_demo(model, *, context: int, budget: int, max_new_tokens: int, seed: int = 0, document: str | None = None,
             question: str | None = None, out=sys.stdout) -> dict:
    """Answers one question with full KV, ClusterKV and StreamingLLM at `budget`, printing what each attended and
    answered; returns {label: text} (and, where the budget is below the prompt, "speedup": ClusterKV's decode
    rate over full KV's, each of its compiled decode loop). The three start from one prefill (`prefill_prompts`)."""
    from clusterkv_jax import ClusterKV, FullKV, StreamingLLM, generate, prefill_prompts

    tokenizer = model.tokenizer
    if document is None:
        stack = haystack(tokenizer, context, seed=seed)
        document, answer = stack.document, stack.answer
        question = question or stack.question
        doc_tokens = len(tokenizer.encode(document, add_special_tokens=False))
        print(f"document: {doc_tokens} tokens of generated sentences (seed {seed}); the needle "
              f"\"{stack.needle}\" starts at token {stack.needle_token} ({stack.needle_token / doc_tokens:.0%} deep)",
              file=out)
    else:  # the user's document: its first `context` tokens; no known answer
        answer = None
        ids = tokenizer.encode(document, add_special_tokens=False)[:context]
        document = tokenizer.decode(ids, skip_special_tokens=False)
        print(f"document: the first {len(ids)} tokens of the given text", file=out)
    prompt = question_prompt(tokenizer, document, question)
    compressed = budget < len(prompt)
    print(f"question: {question}", file=out)
    print(f"prompt: {len(prompt)} tokens; budget B={budget}"
          + (f" (the prompt is {len(prompt) / budget:.1f}x the budget)" if compressed else
             " covers the whole prompt: every policy attends everything (give a larger --context)"), file=out)
    policies = [("full KV", FullKV()), (f"ClusterKV B={budget}", ClusterKV(budget=budget)),
                (f"StreamingLLM B={budget}", StreamingLLM(budget=budget))]
    # One prefill for the three: it attends causally to the whole prompt whatever the policy; each policy then
    # stores the prompt's K/V its own way (ClusterKV clusters the keys) and decodes.
    shared = prefill_prompts(model, prompt, max_new_tokens)
    print(f"prefill: {shared.seconds:.1f} s, once for the {len(policies)} policies below (each stores the prompt's "
          "K/V its own way: ClusterKV clusters the keys)", file=out)
    texts, rates = {}, {}
    for label, policy in policies:
        print(f"\n{label}: {attended_per_step(policy, model.config, len(prompt), max_new_tokens)}", file=out)
        # Times its compiled decode, compile apart.
        result = generate(model, prompt, max_new_tokens, policy=policy, prefilled=shared)
        texts[label] = result.texts[0].strip()
        verdict = "" if answer is None else ("   [finds " + answer + "]" if answer in texts[label] else
                                             "   [misses " + answer + "]")
        print(f"  answer: {texts[label]}{verdict}", file=out)
        if compressed and not isinstance(policy, StreamingLLM):
            rates[label] = result.decode_tokens_per_second
    print(file=out)
    if compressed:
        (full, full_rate), (ckv, ckv_rate) = rates.items()
        texts["speedup"] = ckv_rate / full_rate
        print(f"decode speed (compiled, {max_new_tokens} tokens each): {full} {full_rate:.1f} tokens/s, "
              f"{ckv} {ckv_rate:.1f} tokens/s: {texts['speedup']:.2f}x. A rough figure from a few steps; "
              "`clusterkv bench decode` measures it, and docs/results.md has its figures", file=out)
    else:
        print("no decode speed ratio: the budget covers the prompt, so ClusterKV is full KV here", file=out)
    return texts
