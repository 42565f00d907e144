"""Bad input as a new user would give it: each case ends in a one-line error that names the input and what was
expected (exit 1 or 2, no traceback unless --debug) and leaves nothing behind; library calls raise a clear
exception. The CLI cases run as subprocesses, as a user runs them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoints_convert import convert_gguf, convert_hf
from tests.helpers import REPO_ROOT
from tests.test_convert import TINY_CONFIG, write_tiny_gguf, write_tiny_hf


# Slow (not in make test-fast): most tests run the command-line tools as processes.
pytestmark = pytest.mark.slow

def run_cli(*args: str, module: str = "clusterkv_jax.cli", timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
                          cwd=REPO_ROOT, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str, codes=(1, 2)) -> None:
    err = proc.stderr
    assert proc.returncode in codes, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    for fragment in fragments:
        assert fragment in last, f"{fragment!r} not in the error line {last!r}"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A converted tiny checkpoint (128 positions, a word-level tokenizer) and a text file beside it."""
    root = tmp_path_factory.mktemp("tiny")
    src = write_tiny_hf(root / "src")
    dst = convert_hf(src, root / "model", dtype="float32")
    (root / "text.txt").write_text("word " * 400, encoding="utf-8")
    return dst


# ---- the clusterkv command ----------------------------------------------------------------------------------


def test_model_path_that_is_a_file(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("not a model")
    assert_one_line_error(run_cli("generate", "--model", str(f), "--prompt", "hi"), "file.txt", "is a file")


def test_eval_arguments_are_checked(tiny_model, tmp_path):
    text = os.path.join(os.path.dirname(tiny_model), "text.txt")
    base = ["eval", "recall", "--model", tiny_model, "--budgets", "16"]
    # --text a directory
    assert_one_line_error(run_cli(*base, "--text", str(tmp_path)), str(tmp_path), "is a directory")
    # --context 0 and -5: refused by the parser (once: exit 0 with NaN tables and NaN in recall.json)
    for bad in ("0", "-5"):
        proc = run_cli(*base, "--text", text, "--context", bad)
        assert_one_line_error(proc, "--context", f"expected a positive integer, got '{bad}'", codes=(2,))
    # an unknown policy lists the valid ones
    proc = run_cli(*base, "--text", text, "--policies", "nosuch")
    assert_one_line_error(proc, "'nosuch'", "clusterkv", "quest", "streaming", codes=(2,))
    # context + steps past max_position_embeddings (128 here)
    proc = run_cli(*base, "--text", text, "--context", "120", "--steps", "16")
    assert_one_line_error(proc, "--context 120 + --steps 16 = 136", "max_position_embeddings (128)")
    proc = run_cli("eval", "ppl", "--model", tiny_model, "--text", text, "--context", "100", "--eval-tokens", "64",
                   "--budgets", "16")
    assert_one_line_error(proc, "--eval-tokens 64", "max_position_embeddings (128)")


def test_unwritable_out_is_refused_before_any_work(tiny_model, tmp_path):
    text = os.path.join(os.path.dirname(tiny_model), "text.txt")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    proc = run_cli("eval", "recall", "--model", tiny_model, "--text", text, "--context", "64", "--steps", "2",
                   "--budgets", "16", "--out", str(blocker / "results"))
    assert_one_line_error(proc, "--out", "a_file")
    assert "recall" not in proc.stdout  # nothing was computed first
    # Under /proc every permission check says yes to root; `eval ppl` ran 20 s, then failed without naming --out.
    proc = run_cli("eval", "ppl", "--model", tiny_model, "--text", text, "--context", "64", "--eval-tokens", "16",
                   "--budgets", "16", "--out", "/proc/clusterkv-results")
    assert_one_line_error(proc, "cannot write results to --out '/proc/clusterkv-results'")
    assert "ppl" not in proc.stdout and not os.path.exists("/proc/clusterkv-results")


def test_outputs_never_write_over_inputs_or_into_directories(tiny_text_model, tiny_model, tmp_path):
    """`--json` naming the input text once overwrote it with the results (exit 0); `--json` naming a directory ran
    the whole evaluation, then failed writing nothing; `--out` inside the checkpoint would write into it. Each is
    refused before any work, and the input is unchanged (a run that would otherwise succeed)."""
    model, words = tiny_text_model
    text = tmp_path / "book.txt"
    with open(words, encoding="utf-8") as f:
        original = f.read()
    text.write_text(original, encoding="utf-8")
    base = ["eval", "recall", "--model", model, "--text", str(text), "--context", "256", "--steps",
            "2", "--budgets", "64", "--policies", "streaming"]
    proc = run_cli(*base, "--json", str(text))
    assert_one_line_error(proc, "--json", "book.txt", "would write over the input --text")
    assert text.read_text(encoding="utf-8") == original and "recall" not in proc.stdout
    proc = run_cli(*base, "--json", str(tmp_path))
    assert_one_line_error(proc, "--json", "is a directory")
    assert "recall" not in proc.stdout
    tiny_text = os.path.join(os.path.dirname(tiny_model), "text.txt")
    proc = run_cli("eval", "recall", "--model", tiny_model, "--text", tiny_text, "--context", "64", "--steps", "2",
                   "--budgets", "16", "--out", os.path.join(tiny_model, "results"))
    assert_one_line_error(proc, "--out", "would write over the input --model")
    assert not os.path.exists(os.path.join(tiny_model, "results"))
    assert sorted(os.listdir(tmp_path)) == ["book.txt"]
    # The same run with the results elsewhere works (what the refusals above stopped was a real run).
    proc = run_cli(*base, "--json", str(tmp_path / "recall.json"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "streaming" in json.loads((tmp_path / "recall.json").read_text())["token_recall"]


def test_non_finite_parameters_are_named_when_loading(tmp_path):
    """A checkpoint holding NaN or inf (damaged data decodes to such values) loaded, and generate returned token 0
    forever (exit 0). Loading now names the tensor; the CLI says it in one line."""
    from clusterkv_jax.checkpoint import load_params, save_params
    from tests.test_convert import tiny_tensors

    params = {"embed": np.ones((4, 3), np.float32), "layers": {"q": np.ones((2, 3), np.float32)}}
    params["layers"]["q"][1, 2] = np.inf
    save_params(tmp_path / "p", params)
    for as_numpy in (False, True):
        with pytest.raises(ValueError, match="parameter 'layers/q' holds NaN or inf"):
            load_params(tmp_path / "p", as_numpy=as_numpy)
    tensors = tiny_tensors(TINY_CONFIG)
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = np.nan
    model = convert_hf(write_tiny_hf(tmp_path / "src", tensors=tensors), tmp_path / "model", dtype="float32")
    proc = run_cli("generate", "--model", model, "--prompt", "hi", "--max-new-tokens", "4")
    assert_one_line_error(proc, "layers/down", "holds NaN or inf")


def test_generation_that_meets_non_finite_logits_stops_with_an_error():
    """Finite parameters whose logits are not finite for some input (here: one token's embedding is NaN) stop the
    generation at that token with an error naming where, instead of returning tokens sampled from NaN."""
    import jax

    from clusterkv_jax import FullKV, generate
    from clusterkv_jax.config import ModelConfig
    from clusterkv_jax.loading import Model
    from clusterkv_jax.model import init_params

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16, max_position_embeddings=64)
    params = init_params(config, jax.random.PRNGKey(0))
    prompt = [1, 2, 3, 4]
    first = generate(Model(config, params, None), [prompt], 3, FullKV(), stop_at_eos=False).tokens[0]
    assert first[0] not in prompt  # the first generated token, fed to decode step 1
    bad = dict(params, embed=params["embed"].at[first[0]].set(np.nan))
    with pytest.raises(FloatingPointError, match="NaN or inf at generated token 1"):
        generate(Model(config, bad, None), [prompt], 3, FullKV(), stop_at_eos=False)
    bad = dict(params, final_norm=params["final_norm"].at[0].set(np.inf))
    with pytest.raises(FloatingPointError, match="at the prompt's last position"):
        generate(Model(config, bad, None), [prompt], 3, FullKV(), stop_at_eos=False)


def test_library_arguments_of_the_wrong_kind_are_refused_by_name(tiny_model):
    """Each was accepted and quietly meant something else: top_k=2.5 (truncated), max_length=0 (the default),
    max_length=-1 ("a capacity of -1 positions"), dtype="float64" without x64 (float32), dtype="int8" (failed
    later, in generate), cosine_kmeans(max_clusters=0) and (num_clusters=0) (ran)."""
    import jax
    import jax.numpy as jnp

    from clusterkv_jax import generate, load_model
    from clusterkv_jax.kmeans import cosine_kmeans, problem_keys

    model = load_model(tiny_model)
    with pytest.raises(TypeError, match="top_k must be an int"):
        generate(model, [1, 2, 3], 2, temperature=1.0, top_k=2.5)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="max_length must be a positive int"):
            generate(model, [1, 2, 3], 2, max_length=bad)
    assert len(generate(model, [1, 2, 3], 2, max_length=5, stop_at_eos=False).tokens[0]) == 2
    for bad, message in (("float64", "needs 64-bit JAX"), ("int8", "dtype must be one of")):
        with pytest.raises(ValueError, match=message):
            load_model(tiny_model, dtype=bad)
    for bad in (512.0, "512"):  # 512.0 ran as 512; "512" was "'<=' not supported between 'str' and 'int'"
        with pytest.raises(TypeError, match="prefill_chunk must be an int"):
            generate(model, [1, 2, 3], 2, prefill_chunk=bad)
    for bad in ("abc", 1.5, 2**40):  # "abc": "Value 'abc' with dtype <U3 is not a valid JAX array type"
        with pytest.raises(TypeError, match="seed must be an int"):
            generate(model, [1, 2, 3], 2, seed=bad)
    with pytest.raises(ValueError, match="chat=True wraps text in the chat template; prompt 0 is token ids"):
        generate(model, [1, 2, 3], 2, chat=True)  # was ignored
    keys, valid = jnp.ones((1, 10, 4)), jnp.ones((1, 10), bool)
    with pytest.raises(ValueError, match="max_clusters must be a positive int"):
        cosine_kmeans(keys, valid, jnp.array([0]), problem_keys(jax.random.PRNGKey(0), 1), max_clusters=0)
    for bad in ([0], [5]):
        with pytest.raises(ValueError, match=r"num_clusters must be in \[1, max_clusters=4\]"):
            cosine_kmeans(keys, valid, jnp.array(bad), problem_keys(jax.random.PRNGKey(0), 1), max_clusters=4)
    result = cosine_kmeans(keys, valid, jnp.array([4]), problem_keys(jax.random.PRNGKey(0), 1), max_clusters=4)
    assert int(result.sizes.sum()) == 10


def test_text_inputs_that_are_devices_or_not_utf8(tiny_model, tmp_path):
    """`--prompt-file /dev/zero` once read past 8 GB; `--text /dev/zero` said "does not exist"; binary text said
    "'utf-8' codec can't decode" without naming the file. Each is one line naming the flag and the file, at once."""
    import time

    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"ok \xff\xfe" * 10)
    start = time.monotonic()
    proc = run_cli("generate", "--model", tiny_model, "--prompt-file", "/dev/zero")
    assert_one_line_error(proc, "--prompt-file", "/dev/zero", "not a regular file")
    assert time.monotonic() - start < 60
    assert_one_line_error(run_cli("generate", "--model", tiny_model, "--prompt-file", str(binary)),
                          "--prompt-file", "binary.txt", "not UTF-8 text (byte 3")
    assert_one_line_error(run_cli("eval", "recall", "--model", tiny_model, "--text", "/dev/zero", "--budgets", "16"),
                          "--text", "/dev/zero", "not a regular file")
    assert_one_line_error(run_cli("demo", "--document", str(binary), "--model", tiny_model),
                          "--document", "binary.txt", "not UTF-8")


def test_debug_shows_the_traceback(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    proc = run_cli("generate", "--model", str(f), "--prompt", "hi", "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_mesh_larger_than_the_machine_is_refused_before_placing_parameters(smollm2_converted_dir):
    """`--mesh data=100` on CPU once copied 100 x 540 MB of parameters and was OOM-killed: now the replicas are
    counted against the available memory first."""
    from clusterkv_jax.sharding import available_memory_bytes, check_host_replicas_fit

    with pytest.raises(ValueError, match="use a smaller data axis"):
        check_host_replicas_fit("data=100", param_bytes=540_000_000, available=24_000_000_000)
    check_host_replicas_fit("data=2,model=2", param_bytes=540_000_000, available=24_000_000_000)
    # model=64 over heads it cannot split: 27 copies' worth held (SmolLM2: 14.4 GB, counted by held_param_bytes).
    with pytest.raises(ValueError, match="use a smaller model axis"):
        check_host_replicas_fit("model=64", param_bytes=540_000_000, available=12_000_000_000,
                                held_bytes=14_400_000_000)
    if available_memory_bytes() is None or available_memory_bytes() > 100 * 540e6:
        pytest.skip("this machine has the memory for 100 replicas")
    proc = run_cli("generate", "--model", smollm2_converted_dir, "--prompt", "hi", "--mesh", "data=100",
                   "--max-new-tokens", "2", timeout=120)
    assert_one_line_error(proc, "data=100", "copies of the", "use a smaller data axis")


def test_json_results_never_hold_nan(tmp_path):
    from clusterkv_jax.eval.recall import write_json

    path = tmp_path / "r.json"
    write_json({"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": np.float32("nan")}}, str(path))
    assert json.loads(path.read_text()) == {"a": None, "b": [1.0, None], "c": {"d": None}}


# ---- damaged checkpoints --------------------------------------------------------------------------------------


def _copy_model(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


@pytest.mark.parametrize("damage,message", [
    ("config_null", "holds NoneType where a JSON object was expected"),
    ("config_invalid", "config.json' is not valid JSON"),
    ("params_empty", "is empty: the conversion did not finish"),
    ("metadata_truncated", "truncated or corrupt"),
    ("data_truncated", "truncated or corrupt"),
])
def test_damaged_checkpoint_gives_one_line(tiny_model, tmp_path, damage, message):
    model = _copy_model(tiny_model, tmp_path / "model")
    params = os.path.join(model, "params")
    if damage == "config_null":
        open(os.path.join(model, "config.json"), "w").write("null")
    elif damage == "config_invalid":
        open(os.path.join(model, "config.json"), "w").write('{"model_type": "llama",')
    elif damage == "params_empty":
        import shutil

        shutil.rmtree(params)
        os.mkdir(params)
    elif damage == "metadata_truncated":
        path = os.path.join(params, "_METADATA")
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 3])
    else:  # the largest data file of the checkpoint, cut in half
        files = [os.path.join(d, f) for d, _, fs in os.walk(params) for f in fs]
        path = max(files, key=os.path.getsize)
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    proc = run_cli("generate", "--model", model, "--prompt", "hi", "--max-new-tokens", "2")
    assert_one_line_error(proc, message)
    if damage == "data_truncated":
        # Only our line, none of the echoes of orbax's other failed reads (they come in some runs only: the
        # filter is tested directly below).
        assert proc.stderr.count("clusterkv: error:") == 1 and "Exception" not in proc.stderr, proc.stderr[-2000:]


def test_flipped_bytes_in_a_weight_file_are_named(tiny_model, tmp_path):
    """Four bytes flipped in the largest data file: once, 3 of 4 such tries loaded finite, wrong weights and
    generated garbage with exit 0. Each array's checksum is now saved with it and checked on load, so a try ends
    with one line naming the array (or the NaN check or the reader names it), or, where the flip hit bytes no
    array reads, loads weights equal to the undamaged ones."""
    import jax

    from clusterkv_jax.checkpoint import load_params

    whole = jax.tree_util.tree_leaves(load_params(tiny_model, as_numpy=True))
    named = 0
    # Which arrays sit where in the data file varies between conversions (the writes are concurrent): in one CI run
    # none of the first four flips landed where the checksum was the one to tell (a NaN, or bytes no array reads).
    # Every flip is checked; more places are tried until one is named by its checksum (12 at most).
    places = (0.2, 0.4, 0.6, 0.8, 0.1, 0.3, 0.5, 0.7, 0.9, 0.15, 0.45, 0.75)
    for i, where in enumerate(places):
        if i >= 4 and named:
            break
        model = _copy_model(tiny_model, tmp_path / f"model{i}")
        files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(model, "params")) for f in fs]
        path = max(files, key=os.path.getsize)
        data = bytearray(open(path, "rb").read())
        at = int(len(data) * where)
        data[at:at + 4] = bytes(b ^ 0x5A for b in data[at:at + 4])
        open(path, "wb").write(bytes(data))
        proc = run_cli("generate", "--model", model, "--prompt", "hi", "--max-new-tokens", "2")
        if proc.returncode == 0:
            loaded = jax.tree_util.tree_leaves(load_params(model, as_numpy=True))
            assert all(np.array_equal(a, b) for a, b in zip(loaded, whole, strict=True)), where
            continue
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("clusterkv: error: params checkpoint") and any(
            said in last for said in ("truncated or corrupt", "does not match the checksum saved with it",
                                      "holds NaN or inf; the checkpoint is damaged")), last
        named += "parameter '" in last and "checksum" in last
    assert named >= 1


def test_checksums_on_the_device_equal_numpy_and_see_one_flipped_bit():
    import ml_dtypes

    import jax.numpy as jnp

    from clusterkv_jax.checkpoint import _checksums, checksum_numpy

    rng = np.random.default_rng(0)
    for dtype in (np.float32, ml_dtypes.bfloat16, np.int32):
        x = (rng.standard_normal((37, 53)) * 100).astype(dtype)
        assert checksum_numpy(x) == int(_checksums([jnp.asarray(x)])[0])
        y = x.copy()
        y.reshape(-1).view(np.uint8)[1001] ^= 0x04
        assert checksum_numpy(y) != checksum_numpy(x)
    # The weights by hand: Σ bits_i (2i + 1) 2654435761 mod 2^32.
    x = np.array([1.0, -2.0], np.float32)
    bits = x.view(np.uint32).astype(object)
    assert checksum_numpy(x) == (bits[0] * 2654435761 + bits[1] * 3 * 2654435761) % 2**32


def test_failed_restore_silences_only_its_own_echoes():
    # In a subprocess, so that the hooks do not outlive the test.
    code = """
import asyncio, logging, sys, types
from clusterkv_jax import checkpoint
seen = []
sys.unraisablehook = lambda u: seen.append(repr(u.exc_value))
def unraisable(error, obj=None):
    sys.unraisablehook(types.SimpleNamespace(exc_type=type(error), exc_value=error, exc_traceback=None,
                                             err_msg=None, object=obj))
async def _read_array_index_and_device_put(): pass
logging.basicConfig()
remove = checkpoint._silence_failed_restore_echoes()
coroutine = _read_array_index_and_device_put()
unraisable(RuntimeError("Event loop is closed"))
unraisable(ValueError("boom"), obj=coroutine)
unraisable(RuntimeError("Event loop is closed"), obj=object())
unraisable(RuntimeError("something else"))
asyncio.log.logger.error("_GatheringFuture exception was never retrieved")
asyncio.log.logger.error("another asyncio error")
remove()  # as after a restore that succeeded: nothing is filtered any more
unraisable(RuntimeError("Event loop is closed"))
asyncio.log.logger.error("Future exception was never retrieved")
coroutine.close()
print(seen)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("[\"RuntimeError('Event loop is closed')\", \"RuntimeError('something else')\", "
                                   "\"RuntimeError('Event loop is closed')\"]")
    lines = proc.stderr.strip().splitlines()
    assert [line.split(":")[-1] for line in lines] == ["another asyncio error", "Future exception was never retrieved"]


def test_truncated_sources_are_named(tmp_path):
    src = write_tiny_hf(tmp_path / "src")
    path = os.path.join(src, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    proc = run_cli("hf", src, str(tmp_path / "out"), module="checkpoints_convert")
    assert_one_line_error(proc, "model.safetensors", "truncated or corrupt")
    gguf_path = write_tiny_gguf(tmp_path / "m.gguf")
    data = open(gguf_path, "rb").read()
    open(gguf_path, "wb").write(data[: len(data) - 4000])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        convert_gguf(gguf_path, tmp_path / "out2")
    assert sorted(os.listdir(tmp_path)) == ["m.gguf", "src"]


def test_destination_in_an_unwritable_place(tmp_path):
    src = write_tiny_hf(tmp_path / "src")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    proc = run_cli("hf", src, str(blocker / "out"), module="checkpoints_convert")
    assert_one_line_error(proc, "a_file")
    assert blocker.read_text() == "x"


# ---- the library ---------------------------------------------------------------------------------------------


def test_generate_refuses_malformed_prompts(tiny_model):
    from clusterkv_jax import generate, load_model

    model = load_model(tiny_model)
    with pytest.raises(TypeError, match="prompts must be a string"):
        generate(model, None, 2)
    with pytest.raises(TypeError, match="prompt 1 must be a string or a list of int token ids"):
        generate(model, [[1, 2], [1.5, 2]], 2)
    with pytest.raises(ValueError, match=r"prompt 0 is not valid Unicode text: surrogates not allowed at character 2"):
        generate(model, "ab\ud800c", 2)
    assert TINY_CONFIG["max_position_embeddings"] == 128


def test_policy_fields_are_checked():
    from clusterkv_jax import FullKV
    from clusterkv_jax.policies import make_policy

    with pytest.raises(TypeError, match="full_layers"):
        FullKV(full_layers=3)  # not a setting of FullKV (every layer is full)
    for bad in ("abc", None, 512.0):
        with pytest.raises(TypeError, match="ClusterKV.budget must be an int"):
            make_policy("clusterkv", bad)


def test_policy_flags_build_the_policies_they_name():
    from clusterkv_jax.cli import build_parser
    from clusterkv_jax.commands import policy_options
    from clusterkv_jax.policies import ClusterKV, ClusterKVPaper, InfiniGen, Quest, SnapKV, make_policy
    from clusterkv_jax.policies.clusterkv import PAPER_RULE

    args = build_parser().parse_args(
        ["eval", "recall", "--model", "m", "--text", "t", "--policies",
         "clusterkv,clusterkv-paper,quest,snapkv,infinigen",
         "--score", "density", "--block-refine", "4", "--tokens-per-cluster", "40", "--block-size", "4",
         "--quest-sinks", "16", "--gqa", "shared", "--kmeans-seed", "3", "--clusterkv-paper-gqa", "shared"])
    options = policy_options(args)
    built = {name: make_policy(name, 512, **options.get(name, {})) for name in args.policies}
    assert built == {"clusterkv": ClusterKV(budget=512, score="density", block_refine=4, tokens_per_cluster=40,
                                            block_size=4, gqa="shared", seed=3),
                     "clusterkv-paper": ClusterKVPaper(budget=512, gqa="shared"),
                     "quest": Quest(budget=512, sinks=16), "snapkv": SnapKV(budget=512),
                     "infinigen": InfiniGen(budget=512)}
    # The paper's preset holds its rule whatever ClusterKV's defaults and flags say; the rule makes no flags.
    assert {f: getattr(built["clusterkv-paper"], f) for f in PAPER_RULE} == PAPER_RULE == {
        "sinks": 16, "tokens_per_cluster": 80, "decode_interval": 320, "decode_clusters": 4, "score": "dot",
        "block_refine": 1, "token_refine": 1}
    assert built["clusterkv-paper"].full_layers == 2
    with pytest.raises(ValueError, match="tokens_per_cluster=40: use ClusterKV"):
        ClusterKVPaper(budget=512, tokens_per_cluster=40)
    for bad in (["--block-size", "0"], ["--clusterkv-paper-tokens-per-cluster", "40"]):
        with pytest.raises(SystemExit):  # argparse's one-line usage error
            build_parser().parse_args(["eval", "recall", "--model", "m", "--text", "t", *bad])


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), nonfinite=st.sampled_from([np.nan, np.inf, -np.inf]))
def test_policy_indexes_stay_finite_with_nonfinite_padding(seed, nonfinite):
    """ClusterKV's clusters and Quest's pages built from prompts whose padding rows (past each length) hold
    NaN or inf and whose valid rows include zero keys: every float in the index is finite, and ClusterKV's
    clusters hold exactly the tokens past the sinks."""
    import jax
    import jax.numpy as jnp

    from clusterkv_jax import ClusterKV, Quest
    from clusterkv_jax.config import ModelConfig

    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    rng = np.random.default_rng(seed)
    B, K, S, H = 2, 2, 96, 16
    keys = rng.normal(size=(B, K, S, H)).astype(np.float32)
    lengths = rng.integers(20, S + 1, size=B).astype(np.int32)
    for b in range(B):
        keys[b, :, lengths[b]:] = nonfinite
        keys[b, :, rng.integers(0, lengths[b], size=5)] = 0.0
    for policy in (ClusterKV(budget=32, sinks=4, tokens_per_cluster=8, decode_interval=16, decode_clusters=2),
                   Quest(budget=32, page_size=8)):
        state = policy.init_state(cfg, B, 128)
        state = policy.after_prefill(state, jnp.asarray(keys), jnp.asarray(lengths))
        for leaf in jax.tree.leaves(state):
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                assert np.all(np.isfinite(np.asarray(leaf))), type(policy).__name__
        if isinstance(policy, ClusterKV):
            np.testing.assert_array_equal(np.asarray(state.sizes).sum(-1),
                                          np.broadcast_to((lengths - 4)[:, None], (B, K)))


@pytest.mark.parametrize("template, message", [
    ("{{ ('x' * 10**10)|length }}", "builds a value of 10000000000 items"),
    ("{% for i in range(10**5) %}{{ 'x' * 10**5 }}{% endfor %}", "renders more than"),
    ("{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}", "ran past"),
    ("{{ 7 ** (10**9) }}", "past 64-bit integers"),
])
def test_chat_template_bombs_stop_within_limits(template, message):
    """A checkpoint's chat template is code the sandbox runs without bounding its resources: each of these went
    past 8 GB or 120 s. Now each stops within the template limits (10^7 characters, 5 s) with an error saying which,
    and an ordinary template still renders."""
    import resource
    import time

    import tokenizers

    from clusterkv_jax.tokenizer import TEMPLATE_MAX_SECONDS, TemplateLimitError, Tokenizer

    def tokenizer(chat_template):
        words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
        return Tokenizer(words, {"chat_template": chat_template, "eos_token": "</s>"})

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(TemplateLimitError, match=message):
        tokenizer(template).apply_chat_template([{"role": "user", "content": "hi"}])
    assert time.monotonic() - start < TEMPLATE_MAX_SECONDS + 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1 << 20  # KiB: under 1 GiB more
    ordinary = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] * 2 }}{% endfor %}{{ eos_token }}"
    assert tokenizer(ordinary).apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hihi</s>"


def test_sizes_past_int32_and_bad_capacities_are_named():
    """budget=10**12 and tokens_per_cluster=10**12 came back from JAX as "OverflowError ... argument path is x2";
    init_cache(capacity=-5) as a shape error. Each is now refused naming the field, before JAX sees it."""
    from clusterkv_jax.cache import init_cache
    from clusterkv_jax.config import synthetic_config
    from clusterkv_jax.policies import ClusterKV, Quest

    for make, field in ((lambda: ClusterKV(budget=10**12), "ClusterKV.budget"),
                        (lambda: ClusterKV(tokens_per_cluster=10**12), "ClusterKV.tokens_per_cluster"),
                        (lambda: ClusterKV(max_iters=10**11), "ClusterKV.max_iters"),
                        (lambda: Quest(budget=2**31), "Quest.budget")):
        with pytest.raises(ValueError, match=f"{field} must fit in 32 bits"):
            make()
    assert ClusterKV(budget=2**31 - 1).budget == 2**31 - 1
    config = synthetic_config("smollm2-135m", layers=2)
    for bad in (-5, 0, 2**31, 1.5, True):
        with pytest.raises(ValueError, match="capacity must be an int from 1"):
            init_cache(config, ClusterKV(), 1, bad)
    with pytest.raises(ValueError, match="batch_size must be an int from 1"):
        init_cache(config, ClusterKV(), 0, 64)


def test_caches_past_the_machine_are_refused_before_allocating(tiny_model, monkeypatch):
    """init_cache(capacity=10**9) was RESOURCE_EXHAUSTED "allocating 23040000000000 bytes"; ClusterKV(decode_interval=
    10**6) on a 200-token prompt passed 8 GB and was OOM-killed (its store keeps decode_interval rows). A cache
    larger than the machine is now refused from its shapes alone, in well under a second and without memory, naming
    the largest array; the bytes it counts are the bytes init_cache allocates (checked at the limit)."""
    import resource
    import time

    import jax

    from clusterkv_jax import cache as cache_module
    from clusterkv_jax import generate, load_model
    from clusterkv_jax.config import synthetic_config
    from clusterkv_jax.policies import ClusterKV, FullKV, Quest

    model = load_model(tiny_model)
    config = synthetic_config("smollm2-135m")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for run, message in (
            (lambda: cache_module.init_cache(config, FullKV(), 1, 10**9),
             r"a cache for 1 sequence\(s\) of capacity 1000000000 \(FullKV\) needs [\d,.]+ GB of device"),
            (lambda: generate(model, [1, 2, 3], 2, ClusterKV(budget=16, decode_interval=2**31 - 1, full_layers=0)),
             r"\(ClusterKV\) needs .*\(largest array \.groups\[0\]\.store\.\w of shape \(2, 1, 2, 2147\d+, 4\)"),
            (lambda: generate(model, [1, 2, 3], 2, Quest(budget=2**30, page_size=2**30, full_layers=0)),
             r"\(Quest\) needs"),
            (lambda: generate(model, [1, 2, 3], 2, ClusterKV(budget=16, block_size=2**30, full_layers=0)),
             r"\(ClusterKV\) needs")):
        start = time.monotonic()
        with pytest.raises(ValueError, match=message) as refused:
            run()
        assert "GB this machine has" in str(refused.value)
        assert time.monotonic() - start < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1 << 20  # KiB: under 1 GiB more

    # The accounting, against the arrays init_cache returns: on device, and offloaded (host memory counted apart).
    small = synthetic_config("smollm2-135m", layers=4)
    for policy in (ClusterKV(budget=64), FullKV(offload=True)):
        monkeypatch.undo()
        built = cache_module.init_cache(small, policy, 2, 512)
        hosted = [x.nbytes for x in jax.tree.leaves(built) if x.sharding.memory_kind not in (None, "device")]
        on_device = sum(x.nbytes for x in jax.tree.leaves(built)) - sum(hosted)
        cases = [(on_device, sum(hosted), True), (on_device - 1, sum(hosted), False)]
        cases += [(on_device, sum(hosted) - 1, False)] if hosted else []
        for device, host, fits in cases:
            monkeypatch.setattr(cache_module, "memory_limits",
                                lambda d=device, h=host: {"device": d, "host": h, "shared": False})
            if fits:
                cache_module.init_cache(small, policy, 2, 512)
            else:
                with pytest.raises(ValueError, match="GB of (device|host) memory"):
                    cache_module.init_cache(small, policy, 2, 512)


def test_damaged_tokenizers_templates_and_data_name_their_file(tiny_model, tmp_path):
    """A truncated tokenizer.json said "EOF while parsing a value at line 249 column 4"; a chat template that does
    not compile "Can't compile non template nodes" (an int, HF's list of named templates) or jinja2's message alone;
    a bad LongBench JSONL line "Expecting property name enclosed in double quotes"; a model without tokenizer.json
    advised passing token ids, which the CLI cannot. Each names the file (and line) now; HF's list of named
    templates uses the one named "default", as transformers does."""
    from clusterkv_jax.tokenizer import Tokenizer

    truncated = _copy_model(tiny_model, tmp_path / "truncated")
    path = os.path.join(truncated, "tokenizer.json")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    assert_one_line_error(run_cli("generate", "--model", truncated, "--prompt", "hi"),
                          "tokenizer.json", "cannot be read by the tokenizers library")
    untokenized = _copy_model(tiny_model, tmp_path / "untokenized")
    os.remove(os.path.join(untokenized, "tokenizer.json"))
    assert_one_line_error(run_cli("generate", "--model", untokenized, "--prompt", "hi"),
                          "untokenized", "has no tokenizer.json", "copy the checkpoint's tokenizer.json")

    templated = _copy_model(tiny_model, tmp_path / "templated")
    config_path = os.path.join(templated, "tokenizer_config.json")
    config = json.load(open(config_path)) if os.path.exists(config_path) else {}

    def with_template(template):
        json.dump(dict(config, chat_template=template), open(config_path, "w"))
        return Tokenizer.from_dir(templated)

    message = [{"role": "user", "content": "hi"}]
    json.dump(dict(config, chat_template="{% for m in messages %}"), open(config_path, "w"))
    assert_one_line_error(run_cli("generate", "--model", templated, "--prompt", "hi", "--chat"),
                          "the chat template in", "tokenizer_config.json does not compile (line 1)")
    with pytest.raises(ValueError, match="chat_template in .*tokenizer_config.json must be a string or a list"):
        with_template(5).apply_chat_template(message)
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "<{{ messages[0]['content'] }}>"}]
    assert with_template(named).apply_chat_template(message) == "<hi>"
    with pytest.raises(ValueError, match="named tool_use, rag; none is named 'default'"):
        with_template(named[:1] + [{"name": "rag", "template": "R"}]).apply_chat_template(message)
    assert with_template(5).encode("word") == Tokenizer.from_dir(tiny_model).encode("word")  # loads; chat refused

    data_dir = tmp_path / "longbench"
    data_dir.mkdir()
    good = json.dumps({"input": "q", "context": "word " * 10, "answers": ["a"], "length": 10})
    (data_dir / "qasper.jsonl").write_text(good + "\n{not json\n")
    assert_one_line_error(run_cli("eval", "longbench", "--model", tiny_model, "--data-dir", str(data_dir),
                                  "--tasks", "qasper", "--budgets", "16", "--policies", "full", "--max-length", "64"),
                          "qasper.jsonl:2: not a JSON object")
    (data_dir / "qasper.jsonl").write_bytes(good.encode() + b"\n\xff\xfe\n")
    assert_one_line_error(run_cli("eval", "longbench", "--model", tiny_model, "--data-dir", str(data_dir),
                                  "--tasks", "qasper", "--budgets", "16", "--policies", "full", "--max-length", "64"),
                          "qasper.jsonl is not UTF-8 text")


def test_misleading_advice_is_gone(tiny_model, tmp_path):
    """`--model` at an HF checkpoint advised converting into that same directory (which the converter refuses);
    $CLUSTERKV_DEMO_DOCUMENT naming an empty file or a directory silently fell back to the built-in document; a
    destination under /proc named the staging path."""
    src = write_tiny_hf(tmp_path / "hf")
    target = os.path.normpath(src) + "-clusterkv"
    assert_one_line_error(run_cli("generate", "--model", src, "--prompt", "hi"), "is a Hugging Face checkpoint",
                          f"python -m checkpoints_convert hf {src} {target}, then pass --model {target}")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    for document, message in ((empty, "is empty"), (tmp_path, "is a directory")):
        proc = subprocess.run([sys.executable, "-m", "clusterkv_jax.cli", "demo", "--model", tiny_model],
                              capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
                              env={**os.environ, "PYTHONPATH": REPO_ROOT, "CLUSTERKV_DEMO_DOCUMENT": str(document)})
        assert_one_line_error(proc, "$CLUSTERKV_DEMO_DOCUMENT", str(document), message)
    assert_one_line_error(run_cli("demo", "--model", tiny_model, "--document", "nosuch.txt"),
                          "--document file 'nosuch.txt' does not exist")
    assert_one_line_error(run_cli("hf", src, "/proc/clusterkv-out", module="checkpoints_convert"),
                          "cannot write the destination '/proc/clusterkv-out'")
    afile = tmp_path / "afile"  # a destination below a file said only "File exists"
    afile.write_text("x")
    assert_one_line_error(run_cli("hf", src, str(afile / "sub" / "out"), module="checkpoints_convert"),
                          f"cannot write the destination '{afile / 'sub' / 'out'}': '{afile}' is a file, not a directory")

    # eval recall on a model whose layers all attend in full failed with "'NoneType' object has no attribute
    # 'token_recall'" after the work.
    from clusterkv_jax import load_model
    from clusterkv_jax.eval.recall import run_recall

    with pytest.raises(ValueError, match="the model has 2 layers and clusterkv attend.* no layer selects"):
        run_recall(load_model(tiny_model), list(range(200)), context=96, steps=4, budgets=[40],
                   policy_names=["clusterkv"], progress=False)


# ---- Ctrl-C ----------------------------------------------------------------------------------------------------


_STARTED_MARKER = """
import os

open(os.environ["CLUSTERKV_TEST_STARTED"], "w").close()
"""


def _interrupted(cmd: list[str], *, delay: float = 0.0, once: bytes | None = None, env=None, timeout: float = 300):
    """Runs the Python command `cmd` and sends it SIGINT `delay` seconds after the interpreter's own start-up ended
    (its `site` import, marked by a sitecustomize), or once its stderr matches the regex `once`. Counted from the
    fork instead, CI's 0.05 s landed inside `site` importing the editable install's finder: CPython's own "Fatal
    Python error: init_import_site", before any of the command's code exists to catch it.
    Returns (exit code, stdout, stderr, seconds from the signal to the exit, whether the signal was sent)."""
    import tempfile

    hooks = tempfile.mkdtemp(prefix="started-")
    with open(os.path.join(hooks, "sitecustomize.py"), "w") as f:
        f.write(_STARTED_MARKER)
    started = os.path.join(hooks, "started")
    env = {**os.environ, "PYTHONPATH": f"{hooks}{os.pathsep}{REPO_ROOT}", "CLUSTERKV_TEST_STARTED": started,
           **(env or {})}
    try:
        return _interrupted_once_started(cmd, started, delay, once, env, timeout)
    finally:
        shutil.rmtree(hooks, ignore_errors=True)


def _interrupted_once_started(cmd, started, delay, once, env, timeout):
    import re
    import signal
    import threading
    import time

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO_ROOT)
    streams = {"out": bytearray(), "err": bytearray()}

    def pump(source, sink):
        for piece in iter(lambda: source.read1(4096), b""):
            sink.extend(piece)

    readers = [threading.Thread(target=pump, args=(proc.stdout, streams["out"]), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, streams["err"]), daemon=True)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    if once is not None:
        while proc.poll() is None and not re.search(once, bytes(streams["err"])) and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        while proc.poll() is None and not os.path.exists(started) and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(delay)
    sent = proc.poll() is None
    if sent:
        proc.send_signal(signal.SIGINT)
    signalled = time.monotonic()
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 30))
    finally:
        proc.kill()
    seconds = time.monotonic() - signalled
    for reader in readers:
        reader.join(10)
    return proc.returncode, streams["out"].decode(), streams["err"].decode(errors="replace"), seconds, sent


def test_ctrl_c_stops_a_long_generation_within_seconds_and_keeps_its_text(smollm2_converted_dir):
    """`clusterkv generate --max-new-tokens 2000`: SIGINT took effect after 105 s, when the compiled decode loop
    ended, and printed no text. The loop now returns to Python about once a second: SIGINT during decoding ends the
    command within a few seconds, exit 130, after printing the text generated so far, which is what generating
    that many tokens uninterrupted gives."""
    import re

    from clusterkv_jax import generate, load_model
    from clusterkv_jax.decode_loop import INTERRUPT_SECONDS

    prompt = "The history of the kingdom, told year by year, from the first king onwards:"
    code, out, err, seconds, sent = _interrupted(
        [sys.executable, "-m", "clusterkv_jax.cli", "generate", "--model", smollm2_converted_dir, "--prompt", prompt,
         "--max-new-tokens", "3000"], once=rb"generating: .*?\b([2-9]\d|\d{3,})/3000")
    assert sent, f"generate ended before 20 tokens: {code} {err[-500:]}"
    assert code == 130, (code, err[-2000:])
    assert seconds < INTERRUPT_SECONDS + 3, seconds
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "clusterkv: interrupted"
    count = int(re.search(r"clusterkv generate: interrupted after (\d+) generated tokens", err).group(1))
    assert 20 <= count < 3000
    reference = generate(load_model(smollm2_converted_dir), prompt, count, stop_at_eos=False)
    assert len(reference.tokens[0]) == count
    assert out == reference.texts[0] + "\n"


_SIGINT_AT_EXEC = """
import os, signal, sys

_target = os.environ.get("CLUSTERKV_TEST_SIGINT_AT")


def _interrupt_there(event, args):  # SIGINT to ourselves as the module whose file ends so starts to run
    global _target
    if _target and event == "exec" and getattr(args[0], "co_filename", "").replace(os.sep, "/").endswith(_target):
        _target = None
        os.kill(os.getpid(), signal.SIGINT)


sys.addaudithook(_interrupt_there)
"""


def test_ctrl_c_between_start_and_work_ends_with_one_line_and_130(tiny_model, tmp_path):
    """CI caught a SIGINT sent 1 s into a conversion while Python compiled the converter's __main__ (after the
    package imports, before the command caught Ctrl-C itself): a KeyboardInterrupt traceback. A window of
    milliseconds, so here the signal is sent deterministically as chosen modules start to run (an audit hook in a
    sitecustomize): in JAX's import, in our modules' imports, in each command's own module and the parser's, under
    `python -m` and the console script. Each ends with the command's one line and 130, and writes nothing."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(_SIGINT_AT_EXEC)
    src = write_tiny_hf(tmp_path / "src")
    text = os.path.join(os.path.dirname(tiny_model), "text.txt")
    recall = ["eval", "recall", "--model", tiny_model, "--text", text, "--context", "96", "--steps", "4",
              "--budgets", "40", "--policies", "clusterkv", "--full-layers", "1", "--json", str(tmp_path / "r.json")]
    console_script = os.path.join(os.path.dirname(sys.executable), "clusterkv")
    commands = [([sys.executable, "-m", "checkpoints_convert", "hf", src, str(tmp_path / "out")],
                 "interrupted: nothing was written",
                 ["/jax/__init__.py", "clusterkv_jax/loading.py", "checkpoints_convert/hf.py",
                  "checkpoints_convert/__main__.py", "argparse.py"]),
                ([sys.executable, "-m", "clusterkv_jax.cli", *recall], "clusterkv: interrupted",
                 ["/jax/__init__.py", "clusterkv_jax/generate.py", "clusterkv_jax/cli.py",
                  "clusterkv_jax/eval/commands.py", "clusterkv_jax/eval/recall.py"])]
    if os.path.exists(console_script):  # installed (pip install -e .)
        commands.append(([console_script, *recall], "clusterkv: interrupted",
                         ["/jax/__init__.py", "clusterkv_jax/cli.py", "clusterkv_jax/eval/commands.py"]))
    for cmd, line, modules in commands:
        for module in modules:
            env = {**os.environ, "PYTHONPATH": f"{hooks}{os.pathsep}{REPO_ROOT}", "CLUSTERKV_TEST_SIGINT_AT": module}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
            where = (os.path.basename(cmd[0]), cmd[2], module)
            assert proc.returncode == 130, (where, proc.returncode, proc.stderr[-3000:])
            assert "Traceback" not in proc.stderr, (where, proc.stderr[-3000:])
            assert proc.stderr.strip().splitlines()[-1] == line, (where, proc.stderr[-1000:])
            assert sorted(os.listdir(tmp_path)) == ["hooks", "src"], (where, os.listdir(tmp_path))


@pytest.mark.parametrize("error", [KeyboardInterrupt, ValueError])
def test_the_error_line_after_a_progress_bar_cut_short_has_a_line_of_its_own(error, capsys):
    """A Ctrl-C inside a tqdm bar's close can land after its last state and before its newline: CI once saw
    "recall: decode steps: 100%|...| 4/4 [...]clusterkv: interrupted" as the last line. The error's line now
    starts a line of its own; after a whole line, no blank one."""
    from clusterkv_jax.commands import run_reporting_errors

    def run(cut_short: bool):
        print("steps: 100%|##########| 4/4", file=sys.stderr, end="" if cut_short else "\n")
        raise error("stopped")

    expected = "tool: interrupted" if error is KeyboardInterrupt else "tool: error: stopped"
    for cut_short in (True, False):
        code = run_reporting_errors(lambda: run(cut_short), debug=False, prefix="tool: ", error_code=2,
                                    interrupted="tool: interrupted")
        assert code == (130 if error is KeyboardInterrupt else 2)
        assert capsys.readouterr().err == f"steps: 100%|##########| 4/4\n{expected}\n"


def test_ctrl_c_at_any_point_ends_with_one_line_and_130(tiny_model, tmp_path):
    """SIGINT during `eval recall` exited with SIGSEGV after printing "clusterkv: interrupted" in 3 of 7 tries
    (Python's teardown under JAX's running threads), and during a conversion's imports it printed a
    KeyboardInterrupt traceback. At every point tried (imports, loading, compiling, running) each command now ends
    with its one line and 130, or finishes; an interrupted conversion leaves nothing on disk."""
    import tokenizers

    text = os.path.join(os.path.dirname(tiny_model), "text.txt")
    model = _copy_model(tiny_model, tmp_path / "model")
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()  # a token per word of the text
    words.save(os.path.join(model, "tokenizer.json"))
    recall = [sys.executable, "-m", "clusterkv_jax.cli", "eval", "recall", "--model", model, "--text", text,
              "--context", "96", "--steps", "4", "--budgets", "40", "--policies", "clusterkv,quest", "--full-layers", "1",
              "--quest-full-layers", "1"]
    interrupted = 0
    for delay in (0.05, 0.3, 1.0, 2.0, 3.5, 5.0):
        code, _, err, _, sent = _interrupted(recall, delay=delay)
        assert "Traceback" not in err, (delay, err[-3000:])
        if sent and code == 130:
            interrupted += 1
            assert err.strip().splitlines()[-1] == "clusterkv: interrupted", (delay, err[-1000:])
        else:
            assert code == 0, (delay, code, err[-2000:])  # finished before the signal; never a crash
    assert interrupted >= 4

    src = write_tiny_hf(tmp_path / "src")
    for delay in (0.05, 0.3, 1.0, 2.0, 3.0):
        out = tmp_path / f"out-{delay}"
        code, _, err, _, sent = _interrupted(
            [sys.executable, "-m", "checkpoints_convert", "hf", src, str(out)], delay=delay)
        assert "Traceback" not in err, (delay, err[-3000:])
        if code == 130:
            assert err.strip().splitlines()[-1] == "interrupted: nothing was written"
            assert not out.exists()
        else:
            assert code == 0 and (out / "params").is_dir(), (delay, code, err[-2000:])
        assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n], os.listdir(tmp_path)


def test_the_per_step_summary_names_windowed_layers():
    """The line after a generation ignored windows: Mistral with every layer windowed said ClusterKV "attends 32 ...
    chosen by cluster ... in 2 of 4 layers" though its tokens equal full KV's; Gemma 3 with `--quest-full-layers 6`
    said "attends all 161 ... in all 6 layers" though 5 of the 6 are windowed to 16. Counted here from the layers'
    kinds in the cache `generate` builds."""
    from clusterkv_jax import ClusterKV, FullKV, ModelConfig, Quest
    from clusterkv_jax.commands import attended_per_step

    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8,
                max_position_embeddings=4096, sliding_window=16)
    mistral = ModelConfig(num_layers=4, layer_types=("sliding_attention",) * 4, **tiny)
    line = attended_per_step(ClusterKV(budget=32, full_layers=2), mistral, 161, 16)
    assert line == "attends the last 16 tokens in all 4 layers: every layer is windowed, so no layer selects"
    gemma3 = ModelConfig(num_layers=12, layer_types=(("sliding_attention",) * 5 + ("full_attention",)) * 2, **tiny)
    assert attended_per_step(Quest(budget=32, full_layers=6), gemma3, 161, 16) == (
        "attends 32 of the 161 prompt tokens per step and the generated tokens not indexed yet, in 1 of 12 layers "
        "(1 attend all); 10 windowed layers attend the last 16 tokens")
    assert attended_per_step(FullKV(), gemma3, 161, 16) == (
        "attends all 161 prompt tokens and every generated one, in 2 of 12 layers; 10 windowed layers attend the "
        "last 16 tokens")
    # Without windows, as before.
    plain = ModelConfig(num_layers=4, **tiny)
    assert attended_per_step(ClusterKV(budget=32, full_layers=2), plain, 161, 16).endswith(
        "chosen by cluster and the generated tokens not clustered yet (at most 320), in 2 of 4 layers (the first 2 attend all)")
    assert "chosen by q·k among the tokens of the top clusters (4x B) and" in attended_per_step(
        ClusterKV(budget=32, token_refine=4), plain, 161, 16)
