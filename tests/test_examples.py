"""The examples run end to end: every script in examples/ as a subprocess and the Colab notebook through nbclient,
all on SmolLM2-135M (the `smollm2_converted_dir` fixture) with CLUSTERKV_EXAMPLE_FAST=1 (tiny contexts,
budgets and step counts). Each prints how long it took (`pytest -s` shows it).

The subprocesses and the notebook kernel inherit the test run's JAX persistent compilation cache (tests/conftest.py),
so a program compiled by one example (the same policy, prompt bucket and length) is not compiled again.
"""

from __future__ import annotations

import ast
import json
import os
import resource
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO_ROOT, long_text

# Slow (not in make test-fast): runs the examples and the notebook in processes of their own.
pytestmark = pytest.mark.slow

EXAMPLES = os.path.join(REPO_ROOT, "examples")
NOTEBOOK = os.path.join(EXAMPLES, "clusterkv_colab.ipynb")


@pytest.fixture(scope="module")
def example_env(smollm2_converted_dir, tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("examples")
    text = tmp / "text.txt"
    text.write_text(long_text()[:60_000], encoding="utf-8")
    pythonpath = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    return {
        "CLUSTERKV_EXAMPLE_MODEL": str(smollm2_converted_dir),
        "CLUSTERKV_EXAMPLE_FAST": "1",
        "CLUSTERKV_EXAMPLE_TEXT": str(text),
        "CLUSTERKV_CACHE": str(tmp / "cache"),  # nothing may convert into the user's cache
        "PYTHONPATH": pythonpath,
    }


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _report_time(name: str, t0: float, cpu0: float) -> None:
    """Wall time, and the CPU time of the finished child processes (the CPU here may be shared)."""
    print(f"\n[examples] {name}: {time.perf_counter() - t0:.1f}s wall, {_children_cpu_seconds() - cpu0:.1f}s CPU")


def run_example(name: str, env: dict[str, str], *args: str) -> str:
    t0, cpu0 = time.perf_counter(), _children_cpu_seconds()
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], cwd=REPO_ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    _report_time(name, t0, cpu0)
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_convert_and_generate(example_env):
    out = run_example("convert_and_generate.py", example_env)
    assert "[full KV]" in out and "[ClusterKV B=" in out
    assert out.count("tokens/s") == 2


def test_custom_policy(example_env):
    out = run_example("custom_policy.py", example_env)
    # A budget covering every token attends exactly what full KV does, so greedy decoding agrees throughout.
    line = out[out.index("[LowKeyNorm B=everything]"):].splitlines()[1]
    assert line.endswith("(identical)"), out


def test_custom_policy_is_under_50_lines():
    with open(os.path.join(EXAMPLES, "custom_policy.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    (policy,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LowKeyNorm"]
    first = min([policy.lineno] + [d.lineno for d in policy.decorator_list])
    assert policy.end_lineno - first + 1 < 50


def test_jit_generate_matches_generate(example_env):
    out = run_example("jit_generate.py", example_env)
    assert "identical tokens" in out


def test_eval_sweep_writes_reports(example_env, tmp_path):
    out_dir = tmp_path / "sweep"
    run_example("eval_sweep.py", example_env, "--out", str(out_dir))
    for name in ("recall", "ppl"):
        for ext in ("json", "md", "png"):
            assert (out_dir / f"{name}.{ext}").stat().st_size > 0
    recall = json.loads((out_dir / "recall.json").read_text())
    assert set(recall["token_recall"]) == {"clusterkv", "quest", "streaming", "oracle"}
    assert all(v == pytest.approx(1.0) for v in recall["token_recall"]["oracle"].values())
    ppl = json.loads((out_dir / "ppl.json").read_text())
    assert set(ppl["ppl"]) == {"full", "clusterkv"}


def _ensure_python3_kernelspec() -> None:
    """nbclient starts the kernel spec `python3`; register this interpreter's ipykernel if none is found."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3"],
                       check=True, capture_output=True)


def test_colab_notebook_runs(example_env, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    _ensure_python3_kernelspec()
    for key, value in example_env.items():  # the kernel inherits this process's environment
        monkeypatch.setenv(key, value)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=600, allow_errors=False,
                            resources={"metadata": {"path": str(tmp_path)}})
    t0, cpu0 = time.perf_counter(), _children_cpu_seconds()
    client.execute()  # raises CellExecutionError on the first cell that fails
    _report_time("clusterkv_colab.ipynb", t0, cpu0)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "path: pure JAX" in text or "path: Pallas" in text
    assert "[full KV]" in text and "[ClusterKV B=" in text and "tokens/s" in text
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2  # the selected clusters and the sweep


def test_readme_python_snippet_runs_and_its_loop_matches_generate(smollm2_converted_dir):
    """The README's Python block, run as written (model path replaced, 8 new tokens): its own prefill /
    decode_step loop gives the greedy tokens `generate` gives (once, its default bfloat16 cache did not)."""
    import re

    import clusterkv_jax as ckv

    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    block = re.search(r"## Python\n\n```python\n(.*?)```", readme, re.S).group(1)
    block = block.replace('"checkpoints/smollm2"', repr(str(smollm2_converted_dir)))
    block = block.replace("max_new_tokens=64", "max_new_tokens=4").replace('"Hi!", 32', '"Hi!", 4')
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    model = namespace["model"]
    want = ckv.generate(model, "The capital of France is", 8, policy=ckv.ClusterKV(budget=256),
                        stop_at_eos=False).tokens[0]
    assert namespace["new_ids"] == want


def _install_cell() -> str:
    with open(NOTEBOOK, encoding="utf-8") as f:
        cells = json.load(f)["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    return next(source for source in sources if "_install_source" in source)


def _venv_with_our_dependencies(path) -> str:
    """A fresh venv where clusterkv_jax is not importable but everything it needs is (pip included): a .pth names a
    directory of links to this environment's site-packages, our own package's entries left out. So the notebook's
    pip installs clusterkv-jax alone, without a network."""
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    ours = ("clusterkv_jax", "clusterkv-jax", "__editable__", "checkpoints_convert", "pallas_kernels")
    site = sysconfig.get_paths()["purelib"]
    links = path / "dependencies"
    links.mkdir()
    for name in os.listdir(site):
        if not name.startswith(ours) and not name.endswith(".pth"):
            os.symlink(os.path.join(site, name), links / name)
    python = str(path / "bin" / "python")
    fresh_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(fresh_site, "dependencies.pth"), "w") as f:
        f.write(str(links) + "\n")
    return python


def test_notebook_install_cell_installs_from_a_wheel_and_from_a_checkout(tmp_path):
    """The notebook's first code cell, run where clusterkv_jax is not installed: from a wheel in the working
    directory (as uploaded to Colab) and from the checkout it sits in (opened from examples/); afterwards
    clusterkv_jax imports, in a new process too, from where it was installed."""
    import shutil

    checkout = tmp_path / "checkout"
    shutil.copytree(REPO_ROOT, checkout, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "__pycache__", "build", "dist", "*.egg-info", ".pytest_cache", ".hypothesis", "out"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_NO_BUILD_ISOLATION"] = "1"  # setuptools from the environment: no download
    where = "import clusterkv_jax; print(clusterkv_jax.__version__, clusterkv_jax.__file__)"
    cell = _install_cell()

    wheels = tmp_path / "colab"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(checkout)],
                   check=True, env=env, timeout=300, capture_output=True)
    (wheel,) = [n for n in os.listdir(wheels) if n.endswith(".whl")]
    assert wheel.startswith("clusterkv_jax-") and "OWNER" not in cell
    for name, cwd in (("wheel", wheels), ("checkout", checkout / "examples")):
        python = _venv_with_our_dependencies(tmp_path / f"venv-{name}")
        assert subprocess.run([python, "-c", "import clusterkv_jax"], cwd=cwd, env=env,
                              capture_output=True).returncode != 0  # not importable before the cell
        ran = subprocess.run([python, "-c", cell + "\n" + where], cwd=cwd, env=env, capture_output=True, text=True,
                             timeout=600)
        assert ran.returncode == 0, (name, ran.stdout[-2000:], ran.stderr[-4000:])
        again = subprocess.run([python, "-c", where], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert again.returncode == 0, (name, again.stderr[-2000:])
        import clusterkv_jax

        version, path = again.stdout.split()
        assert version == clusterkv_jax.__version__
        home = str(tmp_path / f"venv-{name}") if name == "wheel" else str(checkout)
        assert os.path.realpath(path).startswith(os.path.realpath(home)), (name, path)


def test_no_placeholder_url_or_workspace_path_where_users_read():
    """A fresh clone has nothing beside it: no default, help text or document may point at the development
    workspace's `../shared`, and no install line at a placeholder URL. Every command's --help shows defaults."""
    import glob

    from clusterkv_jax.cli import build_parser
    from clusterkv_jax.commands import _subcommands

    files = [os.path.join(REPO_ROOT, name) for name in ("README.md", "Makefile", "pyproject.toml", "docs/guide.md",
                                                       "docs/results.md")]
    for package in ("clusterkv_jax", "checkpoints_convert", "pallas_kernels", "examples"):
        files += glob.glob(os.path.join(REPO_ROOT, package, "**", "*.py"), recursive=True)
    files.append(NOTEBOOK)
    parser = build_parser()
    helps = {"clusterkv --help": parser.format_help()}
    for path, sub, _ in _subcommands(parser):
        helps["clusterkv " + " ".join(path) + " --help"] = sub.format_help()
    texts = {path: open(path, encoding="utf-8").read() for path in files} | helps
    for where, text in texts.items():
        for banned in ("OWNER", "../shared", "shared/data"):
            assert banned not in text, (where, banned)
    top = helps["clusterkv --help"]
    for command in ("generate", "demo", "eval recall", "eval ppl", "eval longbench", "bench decode", "bench attention"):
        assert f"clusterkv {command} " in top, command
    assert "(default: 4096)" in helps["clusterkv demo --help"] and "(default: 0)" in helps["clusterkv demo --help"]
    assert "(default: [256, 512, 1024, 2048])" in helps["clusterkv eval ppl --help"]
