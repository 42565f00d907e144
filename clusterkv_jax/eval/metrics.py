"""LongBench's scoring, re-implemented without its dependencies (THUDM/LongBench `metrics.py` and `eval.py`).

`normalize_answer`, `f1_score` and `qa_f1_score` are LongBench's functions line for line. `rouge_l_score` is
LongBench's `rouge_score`, i.e. `Rouge().get_scores([pred], [gt], avg=True)["rouge-l"]["f"]` of the `rouge`
package (pltrdy/rouge 1.0.1, the version pip installs), reproduced here because the package is not a
dependency. What that package computes, exactly:

* each text is split into "sentences" on ".", dropping empty pieces, and each sentence's whitespace is
  collapsed (`" ".join(s.split())`); words are `sentence.split(" ")`;
* for every reference sentence r and every hypothesis sentence c it reconstructs one LCS of r's and c's
  words (table walk: equal words are taken, else go up when `T[i-1][j] > T[i][j-1]`, else left) and adds
  the LCS's *words* to a running union **set** (`exclusive=True`: sets, not multisets);
* LCS = |union|, m = number of distinct reference words, n = number of distinct hypothesis words,
  R = LCS / m, P = LCS / n, and  F = 2·P·R / (P + R + 1e-8)  (a plain F1: since 1.0.0 the package no longer
  uses the older  F = (1 + β²)·P·R / (R + β²·P)  with β = P / R of 0.3.x);
* an empty hypothesis or reference (no sentence left) raises inside the package, and LongBench's bare
  `except` turns that into a score of 0.0; so does this function.
One deliberate difference: the package reconstructs the LCS recursively, so a sentence pair longer than
~1000 words together hits Python's recursion limit (LongBench then scores 0.0); this version is iterative.

`score` is LongBench's `scorer`: for triviaqa (and trec / samsum / lsht, not among our tasks) the prediction
is cut at its first line (`prediction.lstrip('\\n').split('\\n')[0]`), each prediction gets the max of the
metric over its ground truths, and the task score is `round(100 * mean, 2)`.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Callable, Sequence


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace."""

    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s))))


def f1_score(prediction: Sequence[str], ground_truth: Sequence[str], **kwargs) -> float:
    """Token-multiset F1 of two token lists (0 when nothing overlaps)."""
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction)
    recall = 1.0 * num_same / len(ground_truth)
    return (2 * precision * recall) / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """F1 over the whitespace tokens of the normalized answers."""
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


# ---------------------------------------------------------------------------------------------------------
# ROUGE-L as computed by the `rouge` package (see the module docstring)
# ---------------------------------------------------------------------------------------------------------


def _rouge_sentences(text: str) -> list[str]:
    return [" ".join(s.split()) for s in text.split(".") if len(s) > 0]


def _rouge_words(sentences: list[str]) -> list[str]:
    return [w for s in sentences for w in s.split(" ")]


def _lcs_words(x: list[str], y: list[str]) -> list[str]:
    """The words of one longest common subsequence of x (reference) and y (hypothesis), chosen as the
    `rouge` package's `_recon_lcs` chooses it."""
    n, m = len(x), len(y)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        xi, row, prev = x[i - 1], table[i], table[i - 1]
        for j in range(1, m + 1):
            row[j] = prev[j - 1] + 1 if xi == y[j - 1] else max(prev[j], row[j - 1])
    words = []
    i, j = n, m
    while i > 0 and j > 0:
        if x[i - 1] == y[j - 1]:
            words.append(x[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words[::-1]


def rouge_l_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F (summary level, union LCS) as `rouge.Rouge().get_scores(...)["rouge-l"]["f"]`; 0.0 where
    the package would raise (an empty hypothesis or reference)."""
    hyp, ref = _rouge_sentences(prediction), _rouge_sentences(ground_truth)
    if not hyp or not ref:
        return 0.0
    m = len(set(_rouge_words(ref)))
    n = len(set(_rouge_words(hyp)))
    union: set[str] = set()
    for r in ref:
        r_words = r.split(" ")
        for c in hyp:
            union.update(_lcs_words(r_words, c.split(" ")))
    lcs = len(union)
    recall, precision = lcs / m, lcs / n
    return 2.0 * ((precision * recall) / (precision + recall + 1e-8))


# ---------------------------------------------------------------------------------------------------------
# Per-dataset scoring (LongBench eval.py)
# ---------------------------------------------------------------------------------------------------------

DATASET2METRIC: dict[str, Callable[..., float]] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "gov_report": rouge_l_score,
    "triviaqa": qa_f1_score,
}

# LongBench scores only the first line of the prediction on these datasets.
FIRST_LINE_DATASETS = ("trec", "triviaqa", "samsum", "lsht")


def sample_score(dataset: str, prediction: str, ground_truths: Sequence[str], all_classes=None) -> float:
    """One prediction's score in [0, 1]: the metric's max over the ground truths."""
    if dataset not in DATASET2METRIC:
        raise ValueError(f"no metric for dataset {dataset!r}; known: {', '.join(DATASET2METRIC)}")
    if dataset in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    best = 0.0
    for ground_truth in ground_truths:
        best = max(best, DATASET2METRIC[dataset](prediction, ground_truth, all_classes=all_classes))
    return best


def score(dataset: str, predictions: Sequence[str], answers_list: Sequence[Sequence[str]], all_classes=None) -> float:
    """LongBench's `scorer`: 100 × the mean per-prediction score, rounded to 2 decimals."""
    if len(predictions) != len(answers_list):
        raise ValueError(f"{len(predictions)} predictions for {len(answers_list)} answer lists")
    if not predictions:
        raise ValueError("no predictions to score")
    total = sum(sample_score(dataset, p, gts, all_classes) for p, gts in zip(predictions, answers_list))
    return round(100 * total / len(predictions), 2)
