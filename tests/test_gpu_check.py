"""The GPU check (../shared/gpu_check.sh and gpu_probe.py, run where a GPU is lent) runs against this tree: every
name its probe imports from the project exists, and every `clusterkv` command line it runs parses. A device session
is short, and the check is run nowhere else: when `bucket_length` left `clusterkv_jax.generate` (#57), the prefill
probe's import broke, unseen while no GPU was lent."""

from __future__ import annotations

import ast
import importlib
import os
import re
import shlex

import pytest

from tests.helpers import REPO_ROOT

SHARED = os.path.join(REPO_ROOT, "..", "shared")
OURS = ("clusterkv_jax", "pallas_kernels", "checkpoints_convert")


def _read(name: str) -> str:
    path = os.path.join(SHARED, name)
    if not os.path.isfile(path):
        pytest.skip(f"{path} is not beside this checkout")
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_what_the_probe_imports_from_the_project_exists():
    tree = ast.parse(_read("gpu_probe.py"))
    modules, names = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(a.name for a in node.names if a.name.split(".")[0] in OURS)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS:
            names += [(node.module, a.name) for a in node.names]
    assert names, "the probe imports nothing from the project: this test would check nothing"
    for module in modules:
        importlib.import_module(module)
    missing = [f"{module}.{name}" for module, name in names if not hasattr(importlib.import_module(module), name)]
    assert not missing, f"gpu_probe.py imports names this tree lacks: {missing}"


def test_the_checks_command_lines_parse():
    from clusterkv_jax.cli import build_parser

    text = _read("gpu_check.sh")
    command = shlex.split(re.search(r'^B="([^"]+)"', text, re.M).group(1))
    assert command[:3] == ["python3", "-m", "clusterkv_jax.cli"], command
    runs = re.findall(r"\$B ([^\n]*?) 2>&1", text)  # `$B --context 32000 --policies full,clusterkv 2>&1 | ...`
    assert len(runs) >= 4, runs
    parser = build_parser()
    for run in runs:
        line = command[3:] + shlex.split(run)
        try:
            args = parser.parse_args(line)
        except SystemExit:
            pytest.fail(f"the GPU check's command does not parse: clusterkv {shlex.join(line)}")
        assert (args.command, args.synthetic) == ("bench", "llama3-8b"), line
