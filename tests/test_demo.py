"""`clusterkv demo`: the generated document (a needle in a haystack) and the demo itself on SmolLM2-135M."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from clusterkv_jax.demo import haystack
from tests.helpers import REPO_ROOT


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_converted_dir):
    from clusterkv_jax.tokenizer import Tokenizer

    return Tokenizer.from_dir(smollm2_converted_dir)


@pytest.mark.parametrize("tokens,seed,depth", [(300, 0, 0.4), (2000, 1, 0.4), (4096, 2, 0.1), (1000, 3, 0.9)])
def test_haystack_holds_one_needle_where_it_says(smollm2_tokenizer, tokens, seed, depth):
    """The document has the tokens asked for (a sentence more at most), the answer once, inside the needle, which
    starts at `needle_token` (checked by decoding the document's tokens from there) `depth` of the way in; the same
    seed gives the same document, another seed another answer."""
    stack = haystack(smollm2_tokenizer, tokens, seed=seed, depth=depth)
    ids = smollm2_tokenizer.encode(stack.document, add_special_tokens=False)
    assert tokens <= len(ids) <= tokens + 40
    assert stack.document.count(stack.answer) == 1 and stack.answer in stack.needle
    assert re.fullmatch(r"\d{5}", stack.answer)
    at = smollm2_tokenizer.decode(ids[stack.needle_token:stack.needle_token + 16]).strip()
    assert at.startswith(stack.needle), at
    assert abs(stack.needle_token / len(ids) - depth) < 0.03
    assert haystack(smollm2_tokenizer, tokens, seed=seed, depth=depth) == stack
    assert haystack(smollm2_tokenizer, tokens, seed=seed + 10, depth=depth).answer != stack.answer
    with pytest.raises(ValueError, match="depth"):
        haystack(smollm2_tokenizer, tokens, depth=1.5)


def _demo(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop("CLUSTERKV_DEMO_DOCUMENT", None)
    proc = subprocess.run([sys.executable, "-m", "clusterkv_jax.cli", "demo", *args], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_demo_full_kv_and_clusterkv_find_the_needle_in_a_prompt_8x_the_budget(smollm2_converted_dir):
    """`make demo`'s command with its defaults (the bundled model): a prompt at least 8x ClusterKV's budget; full KV
    and ClusterKV answer with the needle's number, StreamingLLM's answer is printed beside them (it has evicted the
    needle: measured 0 of 6 seeds, docs/results.md); the decode speed ratio is printed, as the budget is below the
    context."""
    out = _demo("--model", smollm2_converted_dir)
    prompt, budget = map(int, re.search(r"prompt: (\d+) tokens; budget B=(\d+) \(the prompt is", out).groups())
    assert prompt >= 8 * budget, out
    answer = re.search(r'the needle "The special magic number is (\d{5})\."', out).group(1)
    assert re.search(rf"full KV: attends all {prompt} prompt tokens.*\n  answer: .*{answer}.*\[finds {answer}\]", out)
    assert re.search(rf"ClusterKV B={budget}: attends {budget} of the {prompt} prompt tokens per step chosen by "
                     rf"cluster.*\n  answer: .*{answer}.*\[finds {answer}\]", out), out
    assert re.search(rf"StreamingLLM B={budget}: attends {budget} tokens per step.*\n  answer: .*\[(finds|misses) "
                     rf"{answer}\]", out), out
    assert re.search(rf"full KV [0-9.]+ tokens/s, ClusterKV B={budget} [0-9.]+ tokens/s: [0-9.]+x", out), out


def test_demo_prints_no_speed_ratio_where_the_budget_covers_the_prompt(smollm2_converted_dir):
    """A budget over the prompt: ClusterKV is full KV there, so no decode speed ratio (it was noise shown as a
    speed-up)."""
    out = _demo("--model", smollm2_converted_dir, "--context", "200", "--budget", "512", "--max-new-tokens", "4")
    assert "budget B=512 covers the whole prompt" in out
    assert "no decode speed ratio: the budget covers the prompt" in out
    assert "tokens/s" not in out
