"""Several processes, one mesh: JAX's multi-controller runtime (`jax.distributed`).

Every process (one per host: a TPU slice's hosts, GPU nodes, or processes on one machine) runs the same
program: `initialize` joins them, after which `jax.devices()` lists every process's devices and a mesh over
them spans the processes. `load_model(path, mesh=...)` then restores only this process's shards of the
parameters, and `generate` / `eval ppl` take the same prompts on every process and return the same tokens and
figures on every process. Each process holds its own shards of the KV cache (offloaded ones in its own host
memory).

Where a process finds its place: the arguments of `initialize`, else the environment, `JAX_COORDINATOR_ADDRESS`
(read by JAX itself), `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`; else JAX's own detection (SLURM, Open MPI, Cloud
TPU), which needs none of them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

#: The environment variables `initialize` reads for what its arguments leave out.
COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
#: Seconds a process waits for all the others to join before giving up.
DEFAULT_TIMEOUT = 300
#: Seconds without a sign of life from a peer (once all have joined) after which a process ends, naming it.
LOST_PEER_SECONDS = 10.0


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    if not value.strip().isdigit():
        raise ValueError(f"${name} must be a non-negative integer, got {value!r}")
    return int(value)


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, local_cpu_devices: int | None = None, timeout: int = DEFAULT_TIMEOUT,
               timeout_prefix: str = "clusterkv_jax.distributed: ", timeout_exit_code: int = 1,
               lost_peer_seconds: float | None = LOST_PEER_SECONDS) -> None:
    """Joins this process to the others (`jax.distributed.initialize`), before JAX starts its backends.

    `coordinator` ("HOST:PORT", reachable from every process; process 0 listens there), `num_processes` and
    `process_id` (0 .. num_processes-1) default to `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
    `JAX_PROCESS_ID`, else to JAX's cluster detection. `local_cpu_devices`: CPU devices this process gets
    (XLA_FLAGS, when it does not name a count already). CPU processes exchange data over gloo.

    When not every process has joined after `timeout` seconds, the process ends with `timeout_exit_code` after
    one line on stderr saying so (JAX's runtime would abort it a little later with a C++ stack trace). Once all
    have joined, each process watches the others (`watch_peers`, unless `lost_peer_seconds` is None): one that
    ends with an error, or gives no sign of life for `lost_peer_seconds`, ends this one too, with one line; so does
    one that this process has waited `timeout` seconds for in a collective it has not reached (hung).
    """
    coordinator = coordinator or os.environ.get(COORDINATOR_ENV) or None
    num_processes = num_processes if num_processes is not None else _env_int(NUM_PROCESSES_ENV)
    process_id = process_id if process_id is not None else _env_int(PROCESS_ID_ENV)
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"the number of processes must be >= 1, got {num_processes}")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is not in 0..{num_processes - 1} ({num_processes} processes)")
    if (num_processes is None) != (process_id is None) and coordinator is not None:
        missing = "the number of processes" if num_processes is None else "this process's id"
        raise ValueError(f"{missing} is not given (--num-processes / ${NUM_PROCESSES_ENV}, --process-id / "
                         f"${PROCESS_ID_ENV})")
    if coordinator is not None:
        host, colon, port = coordinator.rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ValueError(f"the coordinator address must be HOST:PORT (e.g. 10.0.0.1:1234), got {coordinator!r}")
        if not 1 <= int(port) <= 65535:
            raise ValueError(f"the coordinator's port must be in 1..65535, got {port} in {coordinator!r}")
        try:  # a name no process can resolve would only show as a join that never happens
            socket.getaddrinfo(host.strip("[]"), int(port))
        except (OSError, UnicodeError) as error:
            raise ValueError(f"the coordinator's host {host!r} (in {coordinator!r}) cannot be resolved here: "
                             f"{getattr(error, 'strerror', None) or error}") from None
    if local_cpu_devices is not None:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={local_cpu_devices}".strip()
    # CPU devices of different processes talk over gloo (the default, none, cannot cross processes); GPU and TPU
    # backends ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    where = f"process {process_id if process_id is not None else '?'} of {num_processes or '?'}"
    joined = threading.Event()

    def give_up() -> None:
        # JAX's client aborts the whole process (C++ fatal error) when its connect deadline passes, so nothing
        # can be caught in Python: this watchdog says what happened first, and ends the process itself.
        if not joined.wait(timeout):
            sys.stderr.write(
                f"{timeout_prefix}{where}: not every process joined the coordinator at "
                f"{coordinator or '(detected)'} within {timeout} s; start the same command on each of the "
                f"{num_processes or 'N'} processes, each with its own process id and the same coordinator\n")
            sys.stderr.flush()
            os._exit(timeout_exit_code)

    if coordinator is not None and num_processes is not None and num_processes > 1:
        # Before JAX's join, which cannot tell two processes given one id apart (one of them is aborted from C++,
        # the other waits the whole time-out): a roll call at the coordinator's port that names such a mistake.
        roll_call(coordinator, num_processes, process_id, timeout, where)
    threading.Thread(target=give_up, name="distributed-timeout", daemon=True).start()
    bind = {}
    if coordinator is not None and num_processes is not None and num_processes > 1 and process_id == 0:
        # JAX's service runs beside process 0, not in it (it would bind an unused loopback port there).
        _start_service(int(coordinator.rpartition(":")[2]), num_processes, 2 * (lost_peer_seconds or 10) + 5)
        bind = dict(coordinator_bind_address="127.0.0.1:0")
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=timeout + 60, **bind)
    except ValueError as error:
        if coordinator is None and "coordinator_address" in str(error):
            raise ValueError(
                f"no coordinator given and none detected; pass --coordinator HOST:PORT --num-processes N "
                f"--process-id I (or set ${COORDINATOR_ENV}, ${NUM_PROCESSES_ENV}, ${PROCESS_ID_ENV})") from None
        raise
    finally:
        joined.set()
    if lost_peer_seconds is not None:
        watch_peers(lost_peer_seconds, prefix=timeout_prefix, exit_code=timeout_exit_code, behind_after=timeout)


#: The coordination service's own process (`clusterkv_jax.coordination_service`), started by process 0.
_service: dict[str, Any] = {}


def _start_service(port: int, num_processes: int, grace: float) -> None:
    """Starts JAX's coordination service in a process of its own at `port` (every address), which outlives this
    process 0 by `grace` seconds where it ends without shutting down (killed, or failed), so that the peers end
    with one line each instead of being aborted from C++ when the service goes."""
    import subprocess

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "coordination_service.py")  # no package import
    helper = subprocess.Popen([sys.executable, script, str(port),
                               str(num_processes), f"{grace:g}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True,
                              start_new_session=True)  # a Ctrl-C of the run is not its to take
    if helper.stdout.readline().strip() != "ready":
        helper.kill()
        raise ValueError(f"the coordination service could not start at port {port} (exit {helper.wait()})")
    _service["process"] = helper
    atexit.register(_stop_service)


def _stop_service() -> None:
    """At a normal exit of process 0 (after `_at_exit`, before JAX's own shutdown, which then has nothing to do):
    shuts JAX's runtime down here, which waits for every peer at its barrier, then ends the service."""
    helper = _service.pop("process", None)
    if helper is None:
        return
    jax.distributed.shutdown()
    try:
        helper.stdin.write("done\n")
        helper.stdin.flush()
        helper.wait(timeout=10)
    except Exception:  # noqa: BLE001 -- gone already, or not ending: it ends itself after its grace
        pass


#: What each process says at the roll call (`roll_call`): the run's number of processes and its own id.
_ROLL_CALL = "clusterkv-roll-call"


def roll_call(coordinator: str, num_processes: int, process_id: int, timeout: float, where: str) -> None:
    """Before joining JAX's runtime, the processes answer a roll call at the coordinator's address, so that every
    process ends within seconds with one line (ValueError) where JAX's join would wait or abort: two processes given
    the same id (the second process 0 finds the port taken; process 0 hears any other id twice), a different
    number of processes, or processes that do not come within `timeout` seconds (process 0 names them). Process 0
    listens on the coordinator's port, hears every other process say its id, answers each "ok" and closes the port
    for JAX's service; the others connect (again and again until process 0 listens) and wait for that answer."""
    host, _, port = coordinator.rpartition(":")
    host, port, deadline = host.strip("[]"), int(port), time.monotonic() + timeout
    late = f"not every process joined the coordinator at {coordinator} within {timeout:g} s ({{}}); start the same " \
           f"command on each of the {num_processes} processes, each with its own process id and the same coordinator"
    if process_id == 0:
        _call_the_roll(port, num_processes, deadline, late, where)
        return
    conn = None
    while conn is None:
        try:
            conn = socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic())))
        except OSError:
            if time.monotonic() >= deadline:
                raise ValueError(f"{where}: " + late.format("nothing listens there: is process 0 running?")) from None
            time.sleep(0.2)
    with conn:
        try:
            conn.sendall(f"{_ROLL_CALL} {num_processes} {process_id}\n".encode())
            conn.settimeout(max(1.0, deadline - time.monotonic()) + 5)  # process 0 names the missing ones first
            answer = conn.makefile("r", encoding="utf-8", errors="replace").readline().strip()
        except TimeoutError:
            raise ValueError(f"{where}: " + late.format("process 0 did not answer")) from None
        except OSError as error:
            answer = f"failed the roll call's connection broke ({error.strerror or error})"
    if answer == "ok":
        return
    verdict, _, why = answer.partition(" ")
    if verdict == "failed" and why:
        raise ValueError(f"{where}: process 0 ended the roll call: {why}")
    raise ValueError(f"{where}: the coordinator at {coordinator} did not answer the roll call (another process "
                     "with this id may have joined already, or another program listens there)")


def _call_the_roll(port: int, num_processes: int, deadline: float, late: str, where: str) -> None:
    """Process 0's side of `roll_call`."""
    import errno

    dual = socket.has_dualstack_ipv6()
    try:  # every address, as JAX's service binds; no SO_REUSEPORT, so a port that is taken refuses this
        server = socket.create_server(("", port), family=socket.AF_INET6 if dual else socket.AF_INET,
                                      dualstack_ipv6=dual)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            try:  # tell the process 0 that listens there, so that it ends at once too, not after its time-out
                with socket.create_connection(("localhost", port), timeout=1) as conn:
                    conn.sendall(f"{_ROLL_CALL} {num_processes} 0\n".encode())
            except OSError:
                pass
            raise ValueError(f"{where}: the coordinator's port {port} is taken on this host: two processes were "
                             "given process id 0 (each process needs its own id), or another program listens there"
                             ) from None
        raise
    present: dict[int, tuple[socket.socket, str]] = {}

    def fail(why: str, newcomer: socket.socket | None = None) -> None:
        for conn in [c for c, _ in present.values()] + ([newcomer] if newcomer else []):
            try:
                conn.sendall(f"failed {why}\n".encode())
            except OSError:
                pass
        if newcomer is not None:
            newcomer.close()
        raise ValueError(f"{where}: {why}")

    try:
        server.settimeout(0.2)
        while len(present) < num_processes - 1:
            if time.monotonic() >= deadline:
                missing = ", ".join(str(i) for i in range(1, num_processes) if i not in present)
                fail(late.format(f"process {missing} did not" if "," not in missing else
                                 f"processes {missing} did not"))
            try:
                conn, address = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(5)
            try:
                said = conn.makefile("r", encoding="utf-8", errors="replace").readline().split()
            except OSError:
                said = []
            if len(said) != 3 or said[0] != _ROLL_CALL or not (said[1] + said[2]).isdigit():
                conn.close()  # not one of ours (a port scan, a health check): ignored
                continue
            count, other = int(said[1]), int(said[2])
            address = f"{address[0].removeprefix('::ffff:')}:{address[1]}"  # an IPv4 peer on a dual-stack socket
            if count != num_processes:
                fail(f"a process (from {address}) was started with --num-processes {count}, process 0 with "
                     f"{num_processes}", conn)
            if other in present or other == 0:
                which = (f"from {present[other][1]} and {address}" if other else
                         f"this one, and one from {address} that found the port taken")
                fail(f"two processes were given process id {other} ({which}); each process needs its own id in "
                     f"0..{num_processes - 1}", conn)
            present[other] = (conn, address)
        for conn, _ in present.values():
            try:
                conn.sendall(b"ok\n")
            except OSError:
                pass  # gone since: JAX's join will wait for it, and time out
    finally:
        for conn, _ in present.values():
            conn.close()
        server.close()


#: Keys of the coordination service's key-value store through which the processes watch each other.
_ALIVE_KEY, _ENDED_KEY = "clusterkv/alive/", "clusterkv/ended/"
_watch: dict[str, Any] = {}


#: Where this process's main thread is: how many waits for its peers (`waiting_for_peers`) it has entered, and
#: since when (None: not waiting) it waits in the latest, named what. The watcher thread reads it.
_progress: dict[str, Any] = {"entered": 0, "since": None, "what": ""}


@contextlib.contextmanager
def waiting_for_peers(what: str):
    """Marks a point where this process waits for its peers (a collective, or a program holding collectives, whose
    result it waits for): every process enters the same such points in the same order, so a peer that has entered
    fewer of them while this process waits is behind (`watch_peers` ends the wait when it stays behind too long)."""
    _progress["entered"] += 1
    _progress["what"], _progress["since"] = what, time.monotonic()
    try:
        yield
    finally:
        _progress["since"] = None


def watch_peers(lost_after: float = LOST_PEER_SECONDS, *, prefix: str = "clusterkv_jax.distributed: ",
                exit_code: int = 1, interval: float = 1.0, behind_after: float | None = DEFAULT_TIMEOUT) -> None:
    """After joining: this process and its peers watch each other through the coordination service, so that none
    waits on a lost one. Without this, a collective whose peer died waits until JAX's heartbeat gives up (100 s)
    and then aborts the process from C++ with a stack trace; a peer that ended with an error leaves the others
    waiting in their next collective.

    A daemon thread puts a count in the key-value store every `interval` seconds and reads every peer's. This
    process ends at once (`os._exit(exit_code)`) with one line on stderr when a peer has said it ended with an
    error (`end_run`), when a peer's count has not moved for `lost_after` seconds (killed, or hung), or when the
    coordination service (process 0's) has not answered for `lost_after` seconds. A peer that ended its work
    normally (it says so at exit) is no longer expected to count. A peer alive but stuck (its main thread hung, or
    waiting in another collective) counts on: with it, this process ends when it has waited `behind_after` seconds
    at a point (`waiting_for_peers`) that the peer has not reached, and has not moved towards in that time (None:
    never). Nothing happens with one process."""
    from jax._src import distributed as jax_distributed

    state = jax_distributed.global_state
    client, me, count = state.client, state.process_id, state.num_processes
    if client is None or count <= 1 or _watch:
        return
    stop, peers_ended = threading.Event(), threading.Event()
    answered = [time.monotonic()]
    _watch.update(client=client, me=me, count=count, stop=stop, peers_ended=peers_ended, prefix=prefix,
                  exit_code=exit_code, lost_after=lost_after)

    def end(why: str) -> None:
        if stop.is_set():  # this process is ending already
            return
        sys.stderr.write(f"{prefix}process {me} of {count}: {why}; this process ends too instead of waiting for it "
                         "(in a collective, or in JAX's shutdown)\n")
        sys.stderr.flush()
        sys.stdout.flush()
        # That line is the last: while this thread lingers below, the main thread may fail in a collective the
        # peers leave, and its traceback would follow.
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        try:  # the others learn why, and end with their own line
            client.key_value_set(f"{_ENDED_KEY}{me}", why[:300], allow_overwrite=True)
        except Exception:  # noqa: BLE001 -- the service is gone: they find this process silent instead
            pass
        _linger_for_peers()
        os._exit(exit_code)

    def beat() -> None:
        seen = {peer: (None, time.monotonic()) for peer in range(count) if peer != me}
        reached = {peer: (0, time.monotonic()) for peer in seen}  # waits each peer entered, and since when
        beats = 0
        while not stop.wait(interval):
            beats += 1
            entered, waiting_since, waiting_in = _progress["entered"], _progress["since"], _progress["what"]
            try:
                client.key_value_set(f"{_ALIVE_KEY}{me}", f"{beats} {entered}", allow_overwrite=True)
                alive = dict(client.key_value_dir_get(_ALIVE_KEY))
                ended = dict(client.key_value_dir_get(_ENDED_KEY))
            except Exception:  # noqa: BLE001 -- the service is gone or failing: `silence` decides when to end
                continue
            answered[0] = now = time.monotonic()
            for peer, (last, since) in list(seen.items()):
                how = ended.get(f"{_ENDED_KEY}{peer}")
                if how == "ok":
                    del seen[peer]
                elif how is not None:
                    end(f"process {peer} ended with an error ({how})")
                elif alive.get(f"{_ALIVE_KEY}{peer}") != last:
                    seen[peer] = (alive.get(f"{_ALIVE_KEY}{peer}"), now)
                    theirs = int(seen[peer][0].split()[-1])
                    if theirs != reached[peer][0]:
                        reached[peer] = (theirs, now)
                    if (behind_after is not None and waiting_since is not None and theirs < entered
                            and min(now - waiting_since, now - reached[peer][1]) > behind_after):
                        end(f"waited {behind_after:g} s in {waiting_in} for process {peer}, which has not reached it "
                            "(it is hung, or slower by that much: --distributed-timeout sets this wait)")
                elif now - since > lost_after:
                    end(f"process {peer} has given no sign of life for {lost_after:g} s (killed, or hung)")
            if not seen:
                peers_ended.set()

    def silence() -> None:
        while not stop.wait(interval):
            if time.monotonic() - answered[0] > lost_after:
                end(f"the coordination service (process 0's) has not answered for {lost_after:g} s (process 0 "
                    "ended, or its host is unreachable)")

    for target in (beat, silence):
        threading.Thread(target=target, name=f"distributed-{target.__name__}", daemon=True).start()
    previous_hook = sys.excepthook

    def failed(kind, error, traceback) -> None:  # an uncaught exception ends this process
        previous_hook(kind, error, traceback)
        end_run(1, f"{kind.__name__}: {error}")

    sys.excepthook = failed
    atexit.register(_at_exit)


def _at_exit() -> None:
    """At exit, before JAX's own shutdown (atexit runs the later registration first), which waits at a barrier for
    every peer: a lost one never comes, and after its heartbeat time-out (100 s) the runtime aborts from C++. So a
    process that failed ends here; one that ended normally says so, then waits until every peer has ended its run
    as well (at most `DEFAULT_TIMEOUT` seconds), still watching them (a peer lost meanwhile ends this one with its
    line), and only then shuts down (`_shut_down_watched`)."""
    if "ended" not in _watch:
        end_run(0)
    if _watch["ended"] != 0:
        sys.stdout.flush()
        sys.stderr.flush()
        _linger_for_peers()
        os._exit(_watch["ended"])
    everyone_ended = _watch["peers_ended"].wait(DEFAULT_TIMEOUT)
    _watch["stop"].set()
    _shut_down_watched(_watch["lost_after"], "for a process that had said it ended its run (it was lost in its "
                       "shutdown: killed, or hung)" if everyone_ended else
                       f"after waiting {DEFAULT_TIMEOUT:g} s for a process alive that has not ended its run")


def _shut_down_watched(seconds: float, waiting: str) -> None:
    """JAX's shutdown, run here rather than in JAX's own exit hook (which then has nothing left to do), watched: it
    waits at a barrier for every process, and a peer lost after it said it ended (killed in its own shutdown) never
    comes; when the coordination service then goes, the runtime aborts this process from C++. Every peer has said it
    ended, so each reaches the barrier within a beat or two: after `seconds` without the shutdown returning, this
    process ends with one line (its own run is complete; `waiting` says for whom) and the run's error exit code."""
    returned = threading.Event()

    def guard() -> None:
        if returned.wait(seconds):
            return
        sys.stderr.write(f"{_watch['prefix']}process {_watch['me']} of {_watch['count']}: JAX's shutdown waited "
                         f"{seconds:g} s {waiting}; this process ended its own run and ends now\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(_watch["exit_code"])

    threading.Thread(target=guard, name="distributed-shutdown", daemon=True).start()
    jax.distributed.shutdown()
    returned.set()


def _linger_for_peers(seconds: float = 5.0) -> None:
    """Before process 0 ends with an error where it hosts the coordination service itself (JAX found the cluster;
    with a coordinator given, the service runs beside it, `_start_service`, and outlives it): a peer whose service
    is gone is aborted by JAX's runtime from C++ with a stack trace, before it reads why. So process 0 waits until
    every peer has ended (each says so in the store as it ends) or `seconds` have passed. Others end at once."""
    client, me = _watch.get("client"), _watch.get("me")
    if client is None or me != 0 or "process" in _service:
        return
    from jax._src import distributed as jax_distributed

    peers = {f"{_ENDED_KEY}{peer}" for peer in range(jax_distributed.global_state.num_processes) if peer != me}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if peers <= set(dict(client.key_value_dir_get(_ENDED_KEY))):
                time.sleep(0.5)  # each wrote before its exit: let it finish exiting first
                return
        except Exception:  # noqa: BLE001 -- the service is failing: nothing to wait for
            return
        time.sleep(0.1)


def watching() -> bool:
    """Whether this process is one of several that watch each other (`watch_peers`)."""
    return bool(_watch)


def lost_peer_hint(message: str) -> str:
    """What to add to an error's `message` in a run of several processes when it is a collective's connection to a
    peer that broke (gloo says "Connection closed by peer"): the cause is in the peer's output."""
    if watching() and ("connection closed" in message.lower() or "connection reset" in message.lower()):
        return " (another process of this run ended or was lost: see its output)"
    return ""


def end_run(code: int, message: str = "") -> None:
    """This process ends with exit `code`: its peers stop watching it (`watch_peers`), and with a nonzero code,
    learn that it failed (`message`, its first line, is named to them) and end too instead of waiting for it in a
    collective; this process then ends at exit without JAX's shutdown (`_at_exit`). With 0, it keeps watching its
    peers until they have ended too (at exit). Call before exiting (an uncaught
    exception calls it); a no-op with one process or without `watch_peers`."""
    if not _watch or "ended" in _watch:
        return
    _watch["ended"] = code
    if code != 0:  # no longer watching: this process ends at once
        _watch["stop"].set()
    how = "ok" if code == 0 else (message.strip().splitlines() or [f"exit status {code}"])[0][:300]
    try:
        _watch["client"].key_value_set(f"{_ENDED_KEY}{_watch['me']}", how, allow_overwrite=True)
    except Exception:  # noqa: BLE001 -- the service is gone: the peers will find this process silent instead
        pass


#: The key under which each process describes its run in the coordination service's key-value store.
_RUN_KEY = "clusterkv/run/{}"


def agree(description: dict[str, str], timeout: float) -> None:
    """Checks that every process describes its run alike, before any collective: each process puts its
    `description` ({what: value}, e.g. each command-line argument) into the coordination service's key-value store
    and reads every other process's, waiting at most `timeout` seconds for each. Raises ValueError naming the
    first process and the entries that differ from this one's, on every process whose run differs (so on all of
    them: each compares itself with every other), or naming a process that described nothing in time. A collective
    started with different meshes, programs or shapes waits forever or aborts the process from C++; this is a key
    lookup with a deadline. Call after `initialize`; a single process returns at once."""
    from jax._src import distributed as jax_distributed

    state = jax_distributed.global_state
    client, me, count = state.client, state.process_id, state.num_processes
    if client is None or count <= 1:
        return
    client.key_value_set(_RUN_KEY.format(me), json.dumps(description, sort_keys=True))
    for other in range(count):
        if other == me:
            continue
        try:
            theirs = json.loads(client.blocking_key_value_get(_RUN_KEY.format(other), max(1, int(timeout * 1000))))
        except Exception as error:  # the runtime raises its own error type on a deadline
            if "DEADLINE" not in str(error).upper() and "TIMED OUT" not in str(error).upper():
                raise
            raise ValueError(f"process {other} did not describe its run within {timeout:g} s (this is process "
                             f"{me}); is it running this same command?") from None
        differ = [key for key in sorted(set(description) | set(theirs)) if description.get(key) != theirs.get(key)]
        if differ:
            shown = "; ".join(f"{key}: {theirs.get(key, '(not given)')} there, {description.get(key, '(not given)')} "
                              "here" for key in differ[:3])
            more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
            raise ValueError(f"process {other} was not started with the same command as this process {me}: "
                             f"{shown}{more}; run the same command, with the same inputs, on every process")


def native_output_to_stderr() -> None:
    """Sends what native libraries print on stdout (gloo reports each connection there) to stderr, and keeps
    Python's `print` on the real stdout: stdout holds only the command's results."""
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(real_stdout, "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors)


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def agreed(value: int) -> int:
    """Process 0's `value` on every process where JAX runs several (a broadcast: every process must call it at the
    same point); `value` itself in one process. For a decision a process makes from its own clock, which must be the
    same everywhere: a different number of calls to a program holding collectives leaves the peers waiting forever."""
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    with waiting_for_peers("a broadcast from process 0"):
        return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def to_host(tree: Any) -> Any:
    """Every array of `tree` as one numpy array on every process (a global array's shards of all processes
    gathered; a local array as it is)."""
    from jax.experimental import multihost_utils

    def fetch(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return multihost_utils.process_allgather(x, tiled=True)
        return np.asarray(x)

    if jax.process_count() == 1:
        return jax.tree.map(fetch, tree)
    with waiting_for_peers("gathering results to every process"):
        return jax.tree.map(fetch, tree)


def held_bytes(tree: Any) -> dict[str, int]:
    """Bytes of `tree`'s arrays: "held", the distinct parts on this process's devices (a part copied on two of
    them counts once); "with_copies", every copy on them; "whole", one copy of everything."""
    held = with_copies = whole = 0
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.Array):
            parts = {}
            for shard in x.addressable_shards:
                key = tuple((s.start, s.stop) for s in shard.index)
                parts[key] = shard.data.nbytes
                with_copies += shard.data.nbytes
            held += sum(parts.values())
            whole += x.nbytes
    return {"held": held, "with_copies": with_copies, "whole": whole}


def describe_share(what: str, tree: Any) -> str:
    """"process 0 of 2 holds 0.26 of the 0.51 MB of the parameters (51%; 0.52 MB with the copies on its 2
    devices)"."""
    b = held_bytes(tree)
    share = f"{100 * b['held'] / b['whole']:.0f}%" if b["whole"] else "-"
    mb = lambda n: f"{n / 1e6:.2f}"  # noqa: E731
    return (f"process {jax.process_index()} of {jax.process_count()} holds {mb(b['held'])} of the {mb(b['whole'])} MB "
            f"of {what} ({share}; {mb(b['with_copies'])} MB with the copies on its {jax.local_device_count()} "
            "devices)")
