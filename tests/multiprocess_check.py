"""Runs for tests/test_multiprocess.py, each in a process of its own (the suite's process has one device).

    python -m tests.multiprocess_check make DIR            a tiny converted checkpoint (4 / 2 heads) in DIR
    python -m tests.multiprocess_check run DIR OUT.json    generate and eval ppl on a data=2,model=2 mesh
        [--distributed --coordinator HOST:PORT --num-processes 2 --process-id I]

    python -m tests.multiprocess_check lose HOW --coordinator HOST:PORT --num-processes 2 --process-id I
        two processes join; then one is lost (HOW: "killed" kills process 1, "failed" ends it with an error as the
        CLI does, "killed0" kills process 0, the coordinator's host, "hung" stops process 1's main thread, its
        watcher thread alive) while the other waits in a collective

`run` without --distributed needs 4 CPU devices in its one process; with it, 2 per process (the test sets
XLA_FLAGS). Each process writes what it measured (tokens, perplexities, the bytes it holds); the assertions
live in the test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

# Across 2 processes of 2 devices: the batch split between the processes, heads within each ...
MESH = "data=2,model=2"
# ... and the heads split over all 4 devices, so each process holds half of them.
TENSOR_PARALLEL_MESH = "model=4"
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 8, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
}
# A batch of 4 (2 per "data" shard) of different lengths; budget 16 drops most of each prompt, and 16 new tokens
# reach a decode-time clustering (decode_interval 8).
LENGTHS = [64, 23, 50, 37]
NEW = 16
SMALL = dict(budget=16, sinks=4, tokens_per_cluster=8, decode_interval=8, decode_clusters=2, full_layers=1)


#: `lose`: how long a peer may be silent before the other ends (the library's default is 10 s).
LOST_AFTER_S = 3.0


def lose(how: str, coordinator: str, process_id: int) -> None:
    import signal
    import time

    from clusterkv_jax import commands
    from clusterkv_jax.distributed import agreed, initialize

    # A short time-out: it is also how long a process waits in a collective for a peer that does not reach it.
    initialize(coordinator, 2, process_id, timeout=60 if how != "hung" else 5, lost_peer_seconds=LOST_AFTER_S)
    agreed(1)  # a first collective: both are at work
    print(f"process {process_id} joined", file=sys.stderr, flush=True)
    if how == "killed0_in_shutdown":  # both end their run; process 0 is killed in JAX's shutdown, after its "ok"
        if process_id == 0:
            import jax

            jax.distributed.shutdown = lambda: os.kill(os.getpid(), signal.SIGKILL)
        return
    lost = 0 if how == "killed0" else 1
    if process_id == lost:
        if how == "hung":
            time.sleep(600)  # alive (its watcher thread counts on), never at the collective
        if how == "failed":
            def fail() -> int:
                raise ValueError("this process failed")

            commands.exit_now(commands.run_reporting_errors(fail, debug=False, prefix="check: ", error_code=2,
                                                            interrupted="interrupted"))
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    while True:  # collectives with a peer that no longer takes part: each waits forever
        agreed(2)
        if time.monotonic() - start > 600:
            break


def make(path: str) -> None:
    from checkpoints_convert import convert_hf
    from clusterkv_jax import checkpoint
    from tests.test_convert import tiny_tensors, write_tiny_hf

    # Chunks scaled to the tiny model (its arrays are far below the real 4 MiB): the MLP width is stored in
    # several chunks too, so a process restoring half of it reads half of them.
    checkpoint.STORAGE_CHUNK_BYTES = 8 << 10
    # Projections with std 0.06: attention peaked enough that dropping tokens changes the output.
    tensors = {name: (1.0 + 0.1 * x if "norm" in name else 0.06 * x)
               for name, x in tiny_tensors(CONFIG, seed=1).items()}
    src = write_tiny_hf(os.path.join(path, "src"), CONFIG, tensors)
    # A word per token ("w1" .. "w127"), and a text of random words for the command line's prompts and eval.
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    words = ["<unk>"] + [f"w{i}" for i in range(1, CONFIG["vocab_size"])]
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(os.path.join(src, "tokenizer.json"))
    convert_hf(src, os.path.join(path, "model"), dtype="float32")
    rng = np.random.default_rng(2)
    with open(os.path.join(path, "text.txt"), "w", encoding="utf-8") as f:
        f.write(" ".join(words[i] for i in rng.integers(1, len(words), 600)))


def _bytes_read() -> int:
    """Bytes this process has read from files so far (Linux: /proc/self/io's rchar)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def run(model_dir: str, out: str) -> None:
    import jax

    from clusterkv_jax import ClusterKV, FullKV, generate, load_model
    from clusterkv_jax.distributed import describe_share, held_bytes
    from clusterkv_jax.eval.ppl import run_ppl

    if jax.process_index() == 1:
        # A clock of its own, 1000x fast: generate's decode loop is cut into calls sized by the step time each
        # process measured, and two processes that queued different numbers of calls waited in a collective
        # forever (CI, now and then). Here they would always differ; the calls are now sized by process 0's clock.
        import time
        import types

        decode_loop = sys.modules["clusterkv_jax.decode_loop"]  # where `decode_in_chunks` reads the clock
        decode_loop.time = types.SimpleNamespace(perf_counter=lambda: 1000 * time.perf_counter())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, CONFIG["vocab_size"], n).tolist() for n in LENGTHS]
    model = load_model(model_dir, mesh=MESH)
    report = {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
              "params_held": held_bytes(model.params), "tokens": {}, "kv_held": {}}
    print(describe_share("the parameters", model.params), file=sys.stderr)
    policies = {"full": FullKV(), "clusterkv": ClusterKV(**SMALL),
                "clusterkv_offload": ClusterKV(offload=True, **SMALL)}
    for name, policy in policies.items():
        result = generate(model, prompts, NEW, policy=policy, stop_at_eos=False, return_cache=True)
        report["tokens"][name] = result.tokens
        report["kv_held"][name] = held_bytes(result.cache)
        print(describe_share(f"the {name} KV cache", result.cache), file=sys.stderr)
    read_before = _bytes_read()
    tensor_parallel = load_model(model_dir, mesh=TENSOR_PARALLEL_MESH)
    report["tensor_parallel_read"] = _bytes_read() - read_before
    report["params_files"] = sum(os.path.getsize(os.path.join(d, f))
                                 for d, _, fs in os.walk(os.path.join(model_dir, "params")) for f in fs)
    report["tensor_parallel_params_held"] = held_bytes(tensor_parallel.params)
    print(describe_share("the parameters on model=4", tensor_parallel.params), file=sys.stderr)
    result = generate(tensor_parallel, prompts, NEW, policy=policies["clusterkv"], stop_at_eos=False,
                      return_cache=True)
    report["tokens"]["clusterkv_tensor_parallel"] = result.tokens
    report["kv_held"]["clusterkv_tensor_parallel"] = held_bytes(result.cache)
    text = rng.integers(1, CONFIG["vocab_size"], 600).tolist()
    report["ppl"] = run_ppl(model, text, context=100, eval_tokens=24, budgets=[16], policy_names=["clusterkv"],
                            windows=4, policy_options={"clusterkv": {k: v for k, v in SMALL.items() if k != "budget"}},
                            progress=False)
    with open(out, "w") as f:
        json.dump(report, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["make", "run", "lose"])
    parser.add_argument("dir")
    parser.add_argument("out", nargs="?")
    parser.add_argument("--distributed", action="store_true")
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    args = parser.parse_args()
    if args.command == "make":
        make(args.dir)
        return
    if args.command == "lose":
        lose(args.dir, args.coordinator, args.process_id)
        return
    if args.distributed:
        from clusterkv_jax.distributed import initialize

        initialize(args.coordinator, args.num_processes, args.process_id, timeout=60)
    run(args.dir, args.out)


if __name__ == "__main__":
    main()
