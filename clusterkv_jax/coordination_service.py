"""JAX's coordination service in a process of its own, started by process 0 of a run (`distributed.initialize`).

Inside process 0, as JAX starts it, the service ends with that process: every peer's runtime then aborts from C++
with a stack trace at once, before any peer can say what happened. Here it outlives a process 0 that was killed
or failed by `grace` seconds, so that the peers' watchers (`distributed.watch_peers`) end them with one line.

    python clusterkv_jax/coordination_service.py PORT NUM_PROCESSES GRACE   (by path: it imports jax only)

It prints "ready" once it listens on every address at PORT, then reads its standard input: "done" (process 0 has
shut its runtime down, after every peer) ends it at once; the end of input (process 0 ended otherwise) ends it
after GRACE seconds.
"""

from __future__ import annotations

import os
import sys
import time


def main(argv: list[str]) -> None:
    port, num_processes, grace = int(argv[0]), int(argv[1]), float(argv[2])
    from jax._src.lib import _jax  # where jax.distributed starts its own service

    service = _jax.get_distributed_runtime_service(f"[::]:{port}", num_processes, heartbeat_timeout=100,
                                                   shutdown_timeout=300)  # jax.distributed.initialize's defaults
    print("ready", flush=True)
    if sys.stdin.readline().strip() == "done":
        service.shutdown()
    else:
        time.sleep(grace)
    os._exit(0)  # no Python teardown: nothing else runs here


if __name__ == "__main__":
    main(sys.argv[1:])
