"""LongBench metrics, reader and prompts; RULER-style synthetic tasks; both CLI commands end to end."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from clusterkv_jax.eval import longbench, metrics, synthetic

# ---------------------------------------------------------------------------------------------------------
# Metrics (hand-computed values)
# ---------------------------------------------------------------------------------------------------------


def test_normalize_answer():
    assert metrics.normalize_answer("The  Cat, sat!  on an\tmat.") == "cat sat on mat"
    assert metrics.normalize_answer("A theory") == "theory"  # whole-word articles only
    assert metrics.normalize_answer("U.S.A.") == "usa"


def test_qa_f1_with_normalization():
    # pred tokens [cat, sat, on, mat], truth [cat, on, mat]: P = 3/4, R = 1, F1 = 6/7
    assert metrics.qa_f1_score("The cat sat on a mat.", "cat on the mat") == pytest.approx(6 / 7)
    assert metrics.qa_f1_score("Paris", "paris!") == 1.0
    assert metrics.qa_f1_score("Berlin", "Paris") == 0
    # multiset overlap: [x, x, y] vs [x, y, y] -> 2 common, P = R = 2/3
    assert metrics.qa_f1_score("x x y", "x y y") == pytest.approx(2 / 3)


def test_rouge_l_as_the_rouge_package():
    # one sentence each: distinct words 5 and 5, LCS "the cat on the mat" -> word set {the, cat, on, mat}
    # P = R = 4/5, F = 2PR / (P + R + 1e-8)
    assert metrics.rouge_l_score("the cat sat on the mat", "the cat was on the mat") == pytest.approx(
        2 * 0.8 * 0.8 / (1.6 + 1e-8), abs=1e-12)
    # summary level: hyp sentences [a b c d], [e f]; ref [a c e], [b d f g]; m = 7, n = 6
    # union LCS over ref sentences: {a, c} + {e} then {b, d} + {f} -> 6; R = 6/7, P = 1, F = 12/13
    assert metrics.rouge_l_score("a b c d. e f", "a c e. b d f g") == pytest.approx(12 / 13, abs=1e-7)
    # sets, not counts: repeated words count once on both sides
    assert metrics.rouge_l_score("x y x y", "x y") == pytest.approx(1.0, abs=1e-7)
    assert metrics.rouge_l_score("y x", "x y") == pytest.approx(0.5, abs=1e-7)
    # what the package rejects (no sentence left) scores 0, as LongBench's `except` makes it
    assert metrics.rouge_l_score("", "a b") == 0.0
    assert metrics.rouge_l_score("...", "a b") == 0.0
    assert metrics.rouge_l_score("a b", "") == 0.0


def test_score_max_over_truths_first_line_and_rounding():
    # triviaqa keeps only the first line (after leading newlines)
    assert metrics.score("triviaqa", ["\nParis\nBerlin is big"], [["paris"]]) == 100.0
    # hotpotqa does not: [paris, berlin, is, big] vs [paris] -> P = 1/4, R = 1, F1 = 0.4
    assert metrics.score("hotpotqa", ["\nParis\nBerlin is big"], [["paris"]]) == 40.0
    assert metrics.score("2wikimqa", ["Paris"], [["London", "Paris"]]) == 100.0
    # mean over predictions, x100, rounded to 2 decimals: F1s 2/3 and 1/2 -> 58.33; 1 and 1/3 -> 66.67
    assert metrics.score("musique", ["p q", "c d e"], [["q"], ["c"]]) == 58.33
    assert metrics.score("hotpotqa", ["x", "y z w u v"], [["x"], ["y"]]) == 66.67
    assert metrics.score("gov_report", ["the cat sat on the mat"], [["the cat was on the mat"]]) == 80.0
    with pytest.raises(ValueError, match="no metric"):
        metrics.score("lcc", ["x"], [["x"]])


# ---------------------------------------------------------------------------------------------------------
# LongBench reader, prompts, truncation
# ---------------------------------------------------------------------------------------------------------


def _longbench_sample(i: int, words: int, dataset: str) -> dict:
    return {"input": f"Which city is number {i}?", "context": " ".join(f"w{j}" for j in range(words)),
            "answers": [f"city {i}"], "length": words, "dataset": dataset, "language": "en",
            "all_classes": None, "_id": f"id{i}"}


def _write_jsonl(directory, dataset: str, samples: list[dict]) -> None:
    with open(directory / f"{dataset}.jsonl", "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_converted_dir):
    from clusterkv_jax.tokenizer import Tokenizer

    return Tokenizer.from_dir(smollm2_converted_dir)


def test_longbench_reader(tmp_path):
    _write_jsonl(tmp_path, "hotpotqa", [_longbench_sample(i, 5, "hotpotqa") for i in range(3)])
    got = longbench.read_jsonl(str(tmp_path), "hotpotqa")
    assert [s["answers"] for s in got] == [["city 0"], ["city 1"], ["city 2"]]
    assert len(longbench.read_jsonl(str(tmp_path), "hotpotqa", limit=2)) == 2
    with pytest.raises(FileNotFoundError):
        longbench.read_jsonl(str(tmp_path), "qasper")
    (tmp_path / "musique.jsonl").write_text(json.dumps({"input": "q", "answers": ["a"]}) + "\n")
    with pytest.raises(ValueError, match="context"):
        longbench.read_jsonl(str(tmp_path), "musique")
    assert longbench.parse_tasks("hotpotqa, triviaqa") == ["hotpotqa", "triviaqa"]
    with pytest.raises(ValueError, match="unknown"):
        longbench.parse_tasks("hotpotqa,lcc")


def test_longbench_prompt_formats():
    assert set(longbench.DATASET2PROMPT) == set(longbench.LONGBENCH_TASKS) == set(longbench.DATASET2MAXLEN)
    s = _longbench_sample(7, 3, "hotpotqa")
    assert longbench.format_prompt("hotpotqa", s) == (
        "Answer the question based on the given passages. Only give me the answer and do not output any other "
        "words.\n\nThe following are given passages.\nw0 w1 w2\n\nAnswer the question based on the given passages. "
        "Only give me the answer and do not output any other words.\n\nQuestion: Which city is number 7?\nAnswer:")
    assert longbench.format_prompt("triviaqa", s).endswith("examples.\n\nw0 w1 w2\n\nWhich city is number 7?")
    assert longbench.format_prompt("gov_report", s).endswith("Report:\nw0 w1 w2\n\nNow, write a one-page summary "
                                                             "of the report.\n\nSummary:")
    assert "asconcisely" in longbench.DATASET2PROMPT["narrativeqa"]  # LongBench's own typo, kept verbatim
    assert longbench.DATASET2MAXLEN == {"narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32,
                                        "2wikimqa": 32, "musique": 32, "gov_report": 512, "triviaqa": 32}


def test_middle_truncation():
    assert longbench.middle_truncate(range(10), 6) == [0, 1, 2, 7, 8, 9]
    assert longbench.middle_truncate(range(10), 7) == [0, 1, 2, 7, 8, 9]  # int(7 / 2) per side, as pred.py
    assert longbench.middle_truncate(range(5), 5) == [0, 1, 2, 3, 4]


def test_longbench_prompt_ids_truncate_in_the_middle(smollm2_tokenizer):
    tok = smollm2_tokenizer
    s = _longbench_sample(3, 600, "hotpotqa")
    full = tok.encode(longbench.format_prompt("hotpotqa", s), add_special_tokens=False)
    assert len(full) > 1000
    ids = longbench.build_prompt_ids(tok, "hotpotqa", s, 200, chat=False)
    assert abs(len(ids) - 200) <= 2  # re-tokenizing the joined halves may shift a token
    text = tok.decode(ids)
    assert text.startswith("Answer the question based on the given passages.")
    assert text.endswith("Question: Which city is number 3?\nAnswer:")
    assert "w0 w1 " in text and " w599\n" in text and " w300 " not in text  # head and tail kept, middle cut
    # a short prompt is untouched
    short = _longbench_sample(1, 5, "hotpotqa")
    assert tok.decode(longbench.build_prompt_ids(tok, "hotpotqa", short, 200, chat=False)) == \
        longbench.format_prompt("hotpotqa", short)
    # chat models get the template, except on triviaqa
    chat_ids = longbench.build_prompt_ids(tok, "hotpotqa", s, 200, chat=True)
    assert tok.decode(chat_ids, skip_special_tokens=False).startswith("<|im_start|>")
    assert len(chat_ids) > len(ids)
    assert longbench.build_prompt_ids(tok, "triviaqa", s, 200, chat=True) == \
        longbench.build_prompt_ids(tok, "triviaqa", s, 200, chat=False)
    # shrunk further when prompt + generation would not fit the model's positions
    fitted = longbench.fitted_prompt_ids(tok, "hotpotqa", s, 200, True, max_positions=180, max_new_tokens=32)
    assert len(fitted) + 32 <= 180


# ---------------------------------------------------------------------------------------------------------
# Synthetic tasks
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", synthetic.SYNTHETIC_TASKS)
def test_synthetic_generation_is_deterministic(task, smollm2_tokenizer):
    a = synthetic.build_samples(smollm2_tokenizer, task, 600, 3, seed=0)
    b = synthetic.build_samples(smollm2_tokenizer, task, 600, 3, seed=0)
    c = synthetic.build_samples(smollm2_tokenizer, task, 600, 3, seed=1)
    assert [s["prompt_ids"] for s in a] == [s["prompt_ids"] for s in b]
    assert [s["answer"] for s in a] == [s["answer"] for s in b]
    assert [s["answer"] for s in a] != [s["answer"] for s in c]
    assert [s["prompt"] for s in a] != [s["prompt"] for s in c]
    assert len({s["answer"] for s in a}) == 3  # samples differ from each other too
    for s in a:
        assert 500 <= len(s["prompt_ids"]) <= 600, len(s["prompt_ids"])
        assert s["prompt"].count(s["needle"]) == 1
        assert s["prompt"].count(s["answer"]) == 1  # asked back, never given away
        assert s["prompt"].startswith("<|im_start|>")  # SmolLM2 has a chat template
    if task == "niah_multikey":
        assert len(re.findall(r"The special magic number for [a-z]+-[a-z]+ is \d{7}\.", a[0]["prompt"])) == 4


@pytest.mark.parametrize("task", synthetic.SYNTHETIC_TASKS)
@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_needle_sits_at_the_requested_depth(task, depth, smollm2_tokenizer):
    s = synthetic.make_sample(task, smollm2_tokenizer, 1500, np.random.default_rng(3), chat=True, depth=depth)
    assert s["depth"] == depth
    prompt = s["prompt"]
    if task == "kv_retrieval":
        start, end = prompt.index("JSON data:\n{") + len("JSON data:\n"), prompt.index("}\n\nKey:")
    else:
        start, end = prompt.index("afterwards.\n") + len("afterwards.\n"), prompt.index("\nWhat is the special")
    where = (prompt.index(s["needle"]) - start) / (end - start)
    assert abs(where - depth) < 0.06, where
    assert len(smollm2_tokenizer.encode(prompt, add_special_tokens=False)) <= 1500


def test_demo_needle_task_asks_the_demos_question_of_its_documents(smollm2_tokenizer):
    """`demo_needle` sample i is `clusterkv demo --seed S+i`'s question: that seed's document and number."""
    from clusterkv_jax.demo import haystack

    tok = smollm2_tokenizer
    samples = synthetic.build_samples(tok, "demo_needle", 300, 3, seed=4)
    assert synthetic.parse_tasks("demo_needle,kv_retrieval") == ["demo_needle", "kv_retrieval"]
    for i, s in enumerate(samples):
        stack = haystack(tok, 300, seed=4 + i)
        assert s["answer"] == stack.answer and s["needle"] == stack.needle and re.fullmatch(r"\d{5}", s["answer"])
        text = tok.decode(s["prompt_ids"], skip_special_tokens=False)
        assert text.startswith("<|im_start|>") and text.count(stack.needle) == 1 and text.count(s["answer"]) == 1
        assert stack.document in text and text.index(stack.document) < text.index(stack.question)
        document = len(tok.encode(stack.document, add_special_tokens=False))
        assert 300 <= document < len(s["prompt_ids"]) < document + 80
    assert len({s["answer"] for s in samples}) == 3


def test_synthetic_scoring_and_errors(smollm2_tokenizer):
    assert synthetic.is_correct(" 1234567.", "1234567")
    assert not synthetic.is_correct(" 123456", "1234567")
    assert synthetic.is_correct("\"D6EDD7A3-14ea\"", "d6edd7a3-14ea")
    with pytest.raises(ValueError, match="without any filler"):
        synthetic.build_samples(smollm2_tokenizer, "niah_single", 20, 1)
    with pytest.raises(ValueError, match="unknown"):
        synthetic.parse_tasks("niah_single,passkey")


# ---------------------------------------------------------------------------------------------------------
# CLI end to end on SmolLM2-135M. Both commands batch 4 prompts (2 tasks x 2 samples) of <= 256 tokens and
# generate 8 tokens, so the second reuses the first's compiled programs.
# ---------------------------------------------------------------------------------------------------------

COMMON = ["--budgets", "64,128", "--policies", "clusterkv,streaming", "--batch-size", "4", "--max-new-tokens", "8"]


def _check_report(out, name, first_table_heading):
    results = json.loads((out / f"{name}.json").read_text())
    table = (out / f"{name}.md").read_text()
    assert first_table_heading in table and "| clusterkv |" in table and "| full |" in table and "B=128" in table
    assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    return results, table


def test_eval_longbench_command(smollm2_converted_dir, tmp_path):
    from clusterkv_jax.cli import main

    data = tmp_path / "longbench"
    data.mkdir()
    tasks = ["hotpotqa", "triviaqa"]  # with and without the chat template
    for t in tasks:
        _write_jsonl(data, t, [_longbench_sample(i, 400, t) for i in range(3)])
    out = tmp_path / "out"
    rc = main(["eval", "longbench", "--model", smollm2_converted_dir, "--data-dir", str(data), "--tasks",
               ",".join(tasks), "--max-length", "200", "--limit", "2", "--out", str(out), *COMMON])
    assert rc == 0
    results, table = _check_report(out, "longbench", "LongBench average score")
    assert results["num_samples"] == {t: 2 for t in tasks}
    assert all(190 <= n <= 256 for t in tasks for n in results["prompt_tokens"][t])  # truncated to ~200
    assert results["max_new_tokens"] == {t: 8 for t in tasks}
    assert set(results["scores"]) == {"full", "clusterkv", "streaming"}
    for name in ("full", "clusterkv", "streaming"):
        for b in ("64", "128"):
            row = results["scores"][name][b]
            assert set(row) == {*tasks, "average"}
            assert all(0 <= row[t] <= 100 for t in tasks)
            assert row["average"] == pytest.approx(sum(row[t] for t in tasks) / 2, abs=0.01)
            assert results["average"][name][b] == row["average"]
    assert len(results["predictions"]["clusterkv@64"]["triviaqa"]) == 2
    assert "per-task scores" in table and "| hotpotqa | triviaqa | average |" in table


def test_eval_synthetic_command(smollm2_converted_dir, tmp_path):
    from clusterkv_jax.cli import main

    out = tmp_path / "out"
    tasks = ["niah_multikey", "kv_retrieval"]
    rc = main(["eval", "synthetic", "--model", smollm2_converted_dir, "--context", "250", "--samples", "2",
               "--tasks", ",".join(tasks), "--out", str(out), *COMMON])
    assert rc == 0
    results, table = _check_report(out, "synthetic", "accuracy (%), context 250")
    assert results["tasks"] == tasks and results["samples"] == 2
    assert all(n <= 250 for t in tasks for n in results["prompt_tokens"]["250"][t])
    for name in ("full", "clusterkv", "streaming"):
        for b in ("64", "128"):
            row = results["scores"][name][b]["250"]
            assert set(row) == {*tasks, "average"} and all(row[t] in (0.0, 50.0, 100.0) for t in tasks)
            assert results["accuracy"]["250"][name][b] == row["average"]
    # the same seed gives the same samples as the library call
    from clusterkv_jax.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_converted_dir)
    assert results["answers"]["250"]["kv_retrieval"] == [
        s["answer"] for s in synthetic.build_samples(tok, "kv_retrieval", 250, 2, seed=0)]
    assert "per-task accuracy" in table
