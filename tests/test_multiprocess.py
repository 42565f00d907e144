"""Several JAX processes, one mesh (`clusterkv_jax.distributed`): two processes on this machine, 2 CPU devices each,
joined over gloo, against one process with 4 devices and the same mesh. They must generate the same tokens (full
KV, ClusterKV, ClusterKV offloaded, and ClusterKV with the heads split over all 4 devices) and score the same
perplexities, each process holding (and reading from the checkpoint) only its shards. The command line's
`--distributed` gives what one process gives, and a process whose peer never joins ends with one line.

Each run is a subprocess of its own (`tests/multiprocess_check.py`, the CLI) with a time limit: a hung peer
fails the test instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from unittest import mock

import pytest

from tests.conftest import MOST_OPTIMIZATIONS_OFF_ENV
from tests.test_reliability import assert_one_line_error

# Slow (not in make test-fast): starts JAX processes.
pytestmark = pytest.mark.slow

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT_S = 300  # each group of processes; one run takes about a minute here
KV_POLICIES = ("full", "clusterkv", "clusterkv_offload", "clusterkv_tensor_parallel")
SMALL_FLAGS = ["--sinks", "4", "--tokens-per-cluster", "8", "--decode-interval", "8", "--decode-clusters", "2",
               "--full-layers", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_with_devices(n: int) -> dict:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()  # the suite's too
    env = dict(os.environ, XLA_FLAGS=flags, PYTHONUNBUFFERED="1", **MOST_OPTIMIZATIONS_OFF_ENV)  # a tiny model
    env.pop("JAX_PLATFORMS", None)
    # No persistent compilation cache (tests/conftest.py): its reads would count in the checkpoint bytes a process
    # reads (test_each_process_reads_only_its_chunks_of_the_checkpoint).
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def run_together(commands: list[list[str]], env: dict, limit: float = LIMIT_S) -> list[subprocess.CompletedProcess]:
    """Runs the commands at once; all are killed if they have not all ended within `limit` seconds."""
    procs = [subprocess.Popen(c, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    deadline = time.monotonic() + limit
    results = []
    try:
        for c, p in zip(commands, procs):
            out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            results.append(subprocess.CompletedProcess(c, p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        tails = [f"--- process {i}, exit {r.returncode} ---\n{r.stderr[-1500:]}" for i, r in enumerate(results)]
        for i, p in enumerate(procs[len(results):], start=len(results)):
            try:
                err = p.communicate(timeout=10)[1]
            except (subprocess.TimeoutExpired, ValueError):
                err = ""
            tails.append(f"--- process {i}, killed ---\n{(err or '')[-1500:]}")
        pytest.fail(f"{commands[0][:6]}... did not end within {limit} s; the end of each one's stderr:\n"
                    + "\n".join(tails))
    return results


def distributed(i: int, port: int) -> list[str]:
    return ["--distributed", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]


def check_ok(results):
    for r in results:
        assert r.returncode == 0, f"{r.args[:8]} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-5000:]}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("multiprocess")
    check_ok(run_together([[sys.executable, "-m", "tests.multiprocess_check", "make", str(root)]], env_with_devices(1)))
    return str(root / "model")


@pytest.fixture(scope="module")
def reports(tiny, tmp_path_factory):
    """(one process's report, [process 0's, process 1's])."""
    out = tmp_path_factory.mktemp("reports")
    check = [sys.executable, "-m", "tests.multiprocess_check", "run", tiny]
    check_ok(run_together([check + [str(out / "one.json")]], env_with_devices(4)))
    port = free_port()
    check_ok(run_together([check + [str(out / f"p{i}.json"), "--distributed", "--coordinator", f"127.0.0.1:{port}",
                                    "--num-processes", "2", "--process-id", str(i)] for i in range(2)],
                          env_with_devices(2)))
    load = lambda name: json.loads((out / name).read_text())  # noqa: E731
    return load("one.json"), [load("p0.json"), load("p1.json")]


def test_two_processes_generate_the_same_tokens_as_one(reports):
    one, two = reports
    assert one["devices"] == 4 and one["processes"] == 1
    assert [r["process"] for r in two] == [0, 1] and all(r["devices"] == 4 and r["processes"] == 2 for r in two)
    for name in KV_POLICIES:
        assert two[0]["tokens"][name] == one["tokens"][name], name
        assert two[1]["tokens"][name] == one["tokens"][name], name
    # The comparison can fail: ClusterKV's budget of 16 changes what these prompts generate.
    assert one["tokens"]["clusterkv"] != one["tokens"]["full"]
    assert one["tokens"]["clusterkv_offload"] == one["tokens"]["clusterkv"]


def test_two_processes_score_the_same_perplexity(reports):
    one, two = reports
    for r in two:
        for metric in ("ppl", "delta_vs_full", "top1_agreement", "kl_vs_full"):
            for policy, by_budget in one["ppl"][metric].items():
                assert r["ppl"][metric][policy] == pytest.approx(by_budget, rel=1e-6), (metric, policy)
    assert one["ppl"]["ppl"]["clusterkv"]["16"] != pytest.approx(one["ppl"]["ppl"]["full"]["16"], rel=1e-3)


def test_each_process_holds_its_shards(reports):
    one, two = reports
    for r in two:
        for name in KV_POLICIES:
            held = r["kv_held"][name]
            # The batch (data=2) is split between the processes; only the [B] lengths are replicated.
            assert held["whole"] == one["kv_held"][name]["whole"]
            assert 0.5 * held["whole"] <= held["held"] < 0.52 * held["whole"], (name, held)
        # data=2,model=2: the parameters are replicated over "data", which crosses the processes, and split over
        # "model" inside each: each process holds one whole copy, half on each of its devices.
        assert r["params_held"]["held"] == r["params_held"]["whole"]
        assert r["params_held"]["with_copies"] < 1.2 * r["params_held"]["whole"]
        # model=4: the heads and the MLP width over all 4 devices: each process holds half of them (and the
        # replicated embeddings and norms).
        tp = r["tensor_parallel_params_held"]
        assert tp["held"] < 0.6 * tp["whole"], tp
    assert one["tensor_parallel_params_held"]["held"] == one["tensor_parallel_params_held"]["whole"]


def test_each_process_reads_only_its_chunks_of_the_checkpoint(reports):
    one, two = reports
    # Linux's count of bytes read while load_model(mesh="model=4") ran: one process reads all of params/, each of
    # two only the chunks its heads and MLP columns lie in.
    assert one["tensor_parallel_read"] >= 0.95 * one["params_files"]
    for r in two:
        assert r["tensor_parallel_read"] < 0.65 * r["params_files"], r["tensor_parallel_read"]


def test_cli_generate_and_eval_ppl_with_distributed(tiny):
    text = os.path.join(os.path.dirname(tiny), "text.txt")
    with open(text, encoding="utf-8") as f:
        prompt = " ".join(f.read().split()[:40])
    cli = [sys.executable, "-m", "clusterkv_jax.cli"]
    generate = cli + ["generate", "--model", tiny, "--prompt", prompt, "--max-new-tokens", "12", "--policy",
                      "clusterkv", "--budget", "16", *SMALL_FLAGS, "--mesh", "data=2,model=2"]
    ppl = cli + ["eval", "ppl", "--model", tiny, "--text", text, "--context", "100", "--eval-tokens", "24",
                 "--budgets", "16", "--policies", "clusterkv", *SMALL_FLAGS, "--mesh", "data=2,model=2"]
    for command in (generate, ppl):
        [alone] = run_together([command], env_with_devices(4))
        check_ok([alone])
        port = free_port()
        pair = run_together([command + distributed(i, port) for i in range(2)], env_with_devices(2))
        check_ok(pair)
        for i, r in enumerate(pair):
            # stdout holds the same results as one process's (gloo's connection reports went to stderr).
            assert r.stdout == alone.stdout, (command[3], r.stdout, alone.stdout)
            assert f"process {i} of 2 holds" in r.stderr and "the parameters" in r.stderr
            if command is generate:
                kv = next(line for line in r.stderr.splitlines() if "of the KV cache" in line)
                assert "(50%;" in kv, kv


@pytest.mark.parametrize("process_id", [0, 1])
def test_a_peer_that_never_joins_ends_with_one_line(tiny, process_id):
    start = time.monotonic()
    [r] = run_together([[sys.executable, "-m", "clusterkv_jax.cli", "generate", "--model", tiny, "--prompt", "word",
                         "--mesh", "data=2,model=2", "--distributed-timeout", "3",
                         *distributed(process_id, free_port())]],
                       env_with_devices(2), limit=120)
    assert time.monotonic() - start < 90
    assert_one_line_error(r, f"process {process_id} of 2: not every process joined", "within 3 s")


@pytest.mark.parametrize("ids", [(0, 0), (0, 1, 1)])
def test_processes_given_the_same_id_each_end_with_one_line_at_once(tiny, ids):
    """Two processes given one `--process-id`: JAX's join aborted one of them from C++ and left the other waiting the
    whole `--distributed-timeout`. Now every process of the run ends within seconds with one line naming the id."""
    port = free_port()
    command = [sys.executable, "-m", "clusterkv_jax.cli", "generate", "--model", tiny, "--prompt", "word", "--mesh",
               f"data={len(ids)}", "--distributed-timeout", "120", "--distributed", "--coordinator",
               f"127.0.0.1:{port}", "--num-processes", str(len(ids)), "--process-id"]
    start = time.monotonic()
    results = run_together([command + [str(i)] for i in ids], env_with_devices(1), limit=150)
    assert time.monotonic() - start < 60  # the processes start in turn; each waited 120 s and more before
    for r in results:
        assert_one_line_error(r, f"two processes were given process id {ids[-1]}")


@pytest.mark.parametrize("how", ["killed", "failed", "hung", "killed0", "killed0_in_shutdown"])
def test_a_peer_lost_after_joining_ends_the_other_in_seconds(how):
    """Two processes join; then process 1 is killed, ends with an error as the CLI ends one, or hangs (its main
    thread stops, its watcher thread counts on), or process 0 is killed, while the other waits in a collective
    with it. Process 0 once
    waited for JAX's heartbeat time-out (about 100 s) and was then aborted from C++ with a stack trace (exit 134),
    or waited forever for a hung peer; the failed one waited as long at JAX's shutdown. Now process 0 ends within
    seconds with its error (the collective's broken connection, the peer's failure named, or the hung peer named
    after the time-out, 5 s here), and a failed process ends at once with its own line. Process 0 killed in JAX's
    shutdown, after it said it ended its run: process 1 ends after 3 s with a line saying so (it was aborted from C++
    as the service went)."""
    start = time.monotonic()
    port = free_port()
    p0, p1 = run_together([[sys.executable, "-m", "tests.multiprocess_check", "lose", how, "--coordinator",
                            f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)] for i in range(2)],
                          env_with_devices(1), limit=150)
    assert time.monotonic() - start < 60
    if how.startswith("killed0"):  # the survivor is process 1; once JAX's runtime aborted it from C++ as process 0 went
        p0, p1 = p1, p0
        assert p1.returncode == -9, p1.stderr[-3000:]
    if how == "killed0_in_shutdown":
        # Process 0 said it ended its run, then was killed in JAX's shutdown: process 1, done too, once waited at
        # the shutdown's barrier until the coordination service went (11 s later) and was aborted from C++.
        assert_one_line_error(p0, "process 1 of 2: JAX's shutdown waited 3 s for a process that had said it ended")
        return
    assert p0.returncode == 1 and "Terminating process" not in p0.stderr, p0.stderr[-3000:]
    # gloo's error from the broken collective (its words vary: "closed by peer", "reset by peer"), or the watcher's.
    if how == "hung":
        assert_one_line_error(p0, "process 0 of 2: waited 5 s in a broadcast from process 0 for process 1, which "
                                  "has not reached it")
        # The hung one ends too, told why: not aborted from C++ as the coordination service goes with process 0.
        assert_one_line_error(p1, "process 1 of 2: process 0 ended with an error (waited 5 s")
        return
    lost = 0 if how == "killed0" else 1
    assert any(said in p0.stderr for said in ("Connection closed by peer", "Connection reset by peer",
                                              f"process {lost} ended with an error",
                                              f"process {lost} has given no sign of life")), p0.stderr[-3000:]
    if how == "failed":
        assert_one_line_error(p1, "check: error: this process failed")


@pytest.mark.parametrize("killed", [1, 0])
def test_a_peer_killed_before_its_end_ends_the_other_with_one_line(tiny, killed):
    """The CLI: one process is killed once it has generated (when it prints what it holds), before it ends. The
    other, done too, once waited at JAX's shutdown for it until the runtime aborted from C++ (about 100 s, exit 134),
    or, where process 0 (the coordination service's host) was killed, was aborted from C++ at once. Now it ends with
    one line naming the silent process, in seconds."""
    import threading

    port = free_port()
    commands = [[sys.executable, "-m", "clusterkv_jax.cli", "generate", "--model", tiny, "--prompt", "word " * 40,
                 "--max-new-tokens", "40", "--mesh", "data=2", *distributed(i, port)] for i in range(2)]
    env = env_with_devices(1)
    survivor = 1 - killed
    start = time.monotonic()
    procs = [subprocess.Popen(c, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    errs, killed_at = ["", ""], []

    def read(i):
        for line in procs[i].stderr:
            errs[i] += line
            if i == killed and "of the parameters" in line:
                procs[killed].kill()
                killed_at.append(time.monotonic())

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
    for r in readers:
        r.start()
    try:
        procs[survivor].wait(timeout=150)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"process {survivor} did not end after its peer was killed:\n{errs[survivor][-3000:]}")
    ended = time.monotonic()
    procs[killed].wait(timeout=30)
    for r in readers:
        r.join(timeout=10)
    assert procs[killed].returncode == -9 and killed_at, (procs[killed].returncode, errs[killed][-2000:])
    # From the kill: loading and compiling before it took from 10 s alone to 60 s beside the rest of the suite.
    assert ended - killed_at[0] < 60, (ended - killed_at[0], ended - start, errs[survivor][-3000:])
    r = subprocess.CompletedProcess(commands[survivor], procs[survivor].returncode, procs[survivor].stdout.read(),
                                    errs[survivor])
    # Silent since the kill, or (where the survivor was still in the run's last collective) its connection broken.
    assert_one_line_error(r, "clusterkv: error: ")
    last = r.stderr.strip().splitlines()[-1]
    # Or (killed after it said it ended, while in JAX's shutdown) the survivor's shutdown waited for it.
    assert (f"process {survivor} of 2: process {killed} has given no sign of life" in last
            or "another process of this run ended or was lost" in last
            or f"process {survivor} of 2: JAX's shutdown waited 10 s for a process that had said it ended"
            in last), last


def test_processes_started_with_different_commands_each_name_the_difference(tiny, tmp_path):
    """Two processes of one run given different meshes, prompts or checkpoints once hung in a collective, aborted
    with a C++ stack trace (gloo's "collective mismatch") or generated from different models without a word. Now
    each describes its run to the coordinator before any collective, and every process names what differs, in
    seconds."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    config = other / "config.json"
    config.write_text(config.read_text(encoding="utf-8").replace("}", ', "comment": "edited"}', 1), encoding="utf-8")
    cli = [sys.executable, "-m", "clusterkv_jax.cli", "generate", "--max-new-tokens", "2", "--distributed-timeout",
           "60"]
    runs = (
        (["--model", tiny, "--prompt", "word", "--mesh", "data=2"], ["--model", tiny, "--prompt", "word", "--mesh",
                                                                       "data=1,model=2"], '--mesh: "data'),
        (["--model", tiny, "--prompt", "word", "--mesh", "data=2"], ["--model", tiny, "--prompt", "other words",
                                                                       "--mesh", "data=2"], '--prompt: "'),
        (["--model", tiny, "--prompt", "word", "--mesh", "data=2"], ["--model", str(other), "--prompt", "word",
                                                                       "--mesh", "data=2"], "--model: contents"),
    )
    for first, second, named in runs:
        port = free_port()
        start = time.monotonic()
        pair = run_together([cli + args + distributed(i, port) for i, args in enumerate((first, second))],
                            env_with_devices(1), limit=120)
        assert time.monotonic() - start < 60
        for i, r in enumerate(pair):
            assert_one_line_error(r, f"process {1 - i} was not started with the same command as this process {i}",
                                  named)


def test_what_the_processes_of_a_run_compare():
    """The run's description: the inputs by their contents, not their paths; where each process writes, not."""
    import argparse

    from clusterkv_jax.commands import run_description

    def described(tmp, prompt_text, out):
        os.makedirs(tmp, exist_ok=True)
        path = os.path.join(tmp, "prompt.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(prompt_text)
        return run_description(argparse.Namespace(prompt_file=path, mesh="data=2", out=out, process_id=int(out[-1]),
                                                   policy__clusterkv__sinks=4, run=print))

    import tempfile

    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        here = described(a, "the same words", "out0")
        assert described(b, "the same words", "out1") == here
        assert described(b, "other words", "out1")["--prompt-file"] != here["--prompt-file"]
        assert here["--sinks"] == "4" and here["--mesh"] == '"data=2"' and "--out" not in here


def test_distributed_flags_are_checked_before_anything_starts(tiny):
    cli = [sys.executable, "-m", "clusterkv_jax.cli", "generate", "--model", tiny, "--prompt", "word"]
    for extra, message in ((["--process-id", "1"], "--process-id needs --distributed"),
                           (["--distributed"], "--distributed needs --mesh"),
                           (["--distributed", "--mesh", "data=3", "--num-processes", "2", "--process-id", "0",
                             "--coordinator", "127.0.0.1:1"], "3 devices, which 2 processes cannot share"),
                           (["--distributed", "--mesh", "data=2", "--num-processes", "2", "--process-id", "2",
                             "--coordinator", "127.0.0.1:1"], "process id 2 is not in 0..1"),
                           (["--distributed", "--mesh", "data=2", "--num-processes", "2", "--process-id", "0",
                             "--coordinator", "localhost"], "must be HOST:PORT"),
                           # Once each waited the whole --distributed-timeout (300 s) to say "not every process
                           # joined".
                           (["--distributed", "--mesh", "data=2", "--num-processes", "2", "--process-id", "0",
                             "--coordinator", "localhost:99999"], "port must be in 1..65535, got 99999"),
                           (["--distributed", "--mesh", "data=2", "--num-processes", "2", "--process-id", "0",
                             "--coordinator", "no-such-host.invalid:1234"],
                            "host 'no-such-host.invalid' (in 'no-such-host.invalid:1234') cannot be resolved")):
        [r] = run_together([cli + extra], env_with_devices(1), limit=60)
        assert_one_line_error(r, message)


def test_a_failed_restore_is_called_corrupt_only_for_damaged_files(tiny):
    """A restore that fails for another reason (here: a peer process gone, as gloo reports it) says what failed
    and does not blame the files; damaged files are tested in test_reliability."""
    import orbax.checkpoint as ocp

    from clusterkv_jax import checkpoint

    gone = RuntimeError("Gloo context initialization failed: Timed out waiting for peer 1")
    with mock.patch.object(ocp.StandardCheckpointer, "restore", side_effect=gone):
        with pytest.raises(RuntimeError, match="failed: Gloo context initialization failed") as info:
            checkpoint.load_params(os.path.join(tiny, "params"))
    assert "corrupt" not in str(info.value) and "not found damaged" in str(info.value)
