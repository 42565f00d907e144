"""What the command-line tools share: argument types, checks made before any work, one line per error, and the
policy flags, built from the policy classes.

Every `option` field of a registered policy (`policies.POLICIES`) is a flag, with its type, range or choices,
default and help from the field: ClusterKV's as `--FIELD` (the library's own policy), every other policy's as
`--NAME-FIELD` (`--quest-sinks`), a field's own `flag` name where it has one (`--kmeans-seed` for ClusterKV's
K-means `seed`). The budget and offloading are each command's own flags. An unset flag keeps the class default.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import tempfile
import threading

from clusterkv_jax import handle_interrupts_in_python

#: The policy whose flags carry no prefix.
UNPREFIXED = "clusterkv"
#: Fields each command sets itself (its --budget / --budgets, --offload), not flags per policy.
COMMAND_FIELDS = ("budget", "offload")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, where it has one."""

    def _get_help_string(self, action):
        if any(action.default is v for v in (None, False, argparse.SUPPRESS)) or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


# ----------------------------------------------------------------------------------------------------------
# Argument types
# ----------------------------------------------------------------------------------------------------------


def int_at_least(minimum: int):
    """An argparse type: an integer >= minimum, else a message naming the value."""
    expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


positive_int, nonnegative_int = int_at_least(1), int_at_least(0)


def finite_float(least: float | None = None):
    """An argparse type: a finite number (>= least, when given)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or (least is not None and value < least):
            bound = "" if least is None else f" >= {least}"
            raise argparse.ArgumentTypeError(f"expected a finite number{bound}, got {text!r}")
        return value

    return parse


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def policy_list(text: str) -> list[str]:
    from clusterkv_jax.policies import parse_policies

    try:
        return parse_policies(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ----------------------------------------------------------------------------------------------------------
# Policy flags
# ----------------------------------------------------------------------------------------------------------


def _policy_fields():
    """(policy name, its class, field) for every flag a policy's fields make."""
    from clusterkv_jax.policies import POLICIES

    for name, cls in POLICIES.items():
        for field in dataclasses.fields(cls):
            if field.init and "help" in field.metadata and field.name not in COMMAND_FIELDS:
                yield name, cls, field


def _flag(name: str, field) -> str:
    own = (field.metadata.get("flag") or field.name).replace("_", "-")
    return f"--{own}" if name == UNPREFIXED else f"--{name}-{own}"


def _dest(name: str, field) -> str:
    return f"policy__{name}__{field.name}"


def add_policy_flags(parser: argparse.ArgumentParser) -> None:
    """Every policy's option flags, one argument group per policy (read back by `policy_options`)."""
    groups = {}
    for name, cls, field in _policy_fields():
        if name not in groups:
            groups[name] = parser.add_argument_group(f"{cls.__name__} options (--policy {name})")
        meta, kind = field.metadata, field.type if isinstance(field.type, str) else field.type.__name__
        kwargs = dict(dest=_dest(name, field), default=None,
                      help=f"{meta['help']} (default: {field.default})".replace("%", "%%"))
        if meta.get("choices"):
            kwargs["choices"] = list(meta["choices"])
        elif kind == "int":
            kwargs.update(type=int_at_least(int(meta["least"])) if meta.get("least") is not None else int,
                          metavar="N")
        elif kind == "float":
            kwargs.update(type=finite_float(meta.get("least")), metavar="F")
        elif kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        groups[name].add_argument(_flag(name, field), **kwargs)


def policy_options(args) -> dict[str, dict]:
    """{policy name: {field: value}} for the policy flags given on the command line."""
    options: dict[str, dict] = {}
    for name, _, field in _policy_fields():
        value = getattr(args, _dest(name, field), None)
        if value is not None:
            options.setdefault(name, {})[field.name] = value
    return options


# ----------------------------------------------------------------------------------------------------------
# Checks before any work, and errors as one line
# ----------------------------------------------------------------------------------------------------------


#: The largest text file a command reads whole (a prompt, a document, an evaluation text).
MAX_TEXT_BYTES = 1 << 30


def check_text_file(path: str, flag: str = "--text") -> None:
    """A readable regular file of at most MAX_TEXT_BYTES (not a directory, a device such as /dev/zero, or a pipe
    that never ends): checked before any work."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; give a UTF-8 text file")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{flag} file {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path!r} is not a regular file (a device or a pipe); give a UTF-8 text file")
    if os.path.getsize(path) > MAX_TEXT_BYTES:
        raise ValueError(f"{flag} {path!r} holds {os.path.getsize(path)} bytes, past {MAX_TEXT_BYTES}; give a "
                         "shorter text")


def read_text_file(path: str, flag: str = "--text", max_chars: int | None = None) -> str:
    """The UTF-8 text of `path` (its first `max_chars` characters, when given), checked by `check_text_file`;
    bytes that are not UTF-8 are an error naming the file and the offset."""
    check_text_file(path, flag)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(max_chars) if max_chars else f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path!r} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def add_mesh_flags(parser: argparse.ArgumentParser) -> None:
    """--mesh, and --distributed with where this process finds the others."""
    from clusterkv_jax.distributed import COORDINATOR_ENV, DEFAULT_TIMEOUT, NUM_PROCESSES_ENV, PROCESS_ID_ENV

    parser.add_argument("--mesh", default=None, metavar="data=D,model=M",
                        help="shard over D*M devices: batch on 'data', KV heads on 'model' (on CPU, D*M host devices "
                             "are requested automatically; with --distributed, D*M over all processes)")
    group = parser.add_argument_group("several processes (one per host), one mesh: run the same command on each")
    group.add_argument("--distributed", action="store_true",
                       help="join the other processes (jax.distributed) before starting; needs --mesh")
    group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help=f"process 0's address, the same for all (default: ${COORDINATOR_ENV}, else detected "
                            "on SLURM, Open MPI or Cloud TPU)")
    group.add_argument("--num-processes", type=positive_int, default=None, metavar="N",
                       help=f"how many processes (default: ${NUM_PROCESSES_ENV}, else detected)")
    group.add_argument("--process-id", type=nonnegative_int, default=None, metavar="I",
                       help=f"this process's number, 0 .. N-1 (default: ${PROCESS_ID_ENV}, else detected)")
    group.add_argument("--distributed-timeout", type=positive_int, default=DEFAULT_TIMEOUT, metavar="S",
                       help="seconds to wait for every process to join, and in a collective for a peer that has "
                       "not reached it (hung)")


def prepare_mesh(args) -> None:
    """Before JAX starts: checks --mesh, joins the other processes (--distributed; on CPU each process asks for its
    part of the mesh's devices) or asks for D*M CPU devices, and refuses a mesh whose copies of the parameters would
    not fit this machine's memory."""
    from clusterkv_jax import sharding
    from clusterkv_jax.distributed import (NUM_PROCESSES_ENV, _env_int, agree, initialize, native_output_to_stderr,
                                           watch_peers)

    if not args.distributed:
        given = [flag for flag in ("--coordinator", "--num-processes", "--process-id")
                 if getattr(args, flag[2:].replace("-", "_")) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --distributed")
    if args.distributed and not args.mesh:
        raise ValueError("--distributed needs --mesh (data=D,model=M over the devices of all processes)")
    if not args.mesh:
        return
    sizes = sharding.parse_mesh(args.mesh)
    devices = sizes["data"] * sizes["model"]
    if args.distributed:
        processes = args.num_processes if args.num_processes is not None else _env_int(NUM_PROCESSES_ENV)
        if processes is not None and devices % processes:
            raise ValueError(f"--mesh {args.mesh} has {devices} devices, which {processes} processes cannot share "
                             "equally")
        native_output_to_stderr()
        initialize(args.coordinator, args.num_processes, args.process_id,
                   local_cpu_devices=devices // processes if processes else None, timeout=args.distributed_timeout,
                   timeout_prefix="clusterkv: error: ", timeout_exit_code=2, lost_peer_seconds=None)
        agree(run_description(args), timeout=args.distributed_timeout)
        # Watched from here on, not before: a run the processes disagree on ends on every process with its own
        # line naming the difference, not with a peer's.
        watch_peers(prefix="clusterkv: error: ", exit_code=2, behind_after=args.distributed_timeout)
    else:
        sharding.request_host_devices(args.mesh)  # on CPU: data*model host devices (before JAX starts)
    sharding.check_mesh_for_model(args.mesh, args.model, args.dtype)


#: Arguments that may differ between the processes of one run: where each finds the others, and where each
#: writes (each process may write its own copy of the results).
PER_PROCESS_ARGS = frozenset({"process_id", "coordinator", "distributed_timeout", "out", "json", "debug"})
#: A file larger than this is described by its size alone (a text that large is refused anyway, MAX_TEXT_BYTES).
_HASHED_BYTES = 64 << 20


def _digest_path(path: str) -> str:
    """A digest of what a process reads at `path`: a file's bytes, or a directory's files (each one's relative
    path and size, and the bytes of the small ones: configs, tokenizer, checkpoint metadata). Two copies of one
    converted checkpoint agree; a different model, or a copy with a missing or truncated file, does not. (A
    flipped byte inside a large array file keeps its size: not seen here.)"""
    import hashlib

    digest = hashlib.sha256()

    def add_file(full: str, name: str) -> None:
        size = os.path.getsize(full)
        digest.update(f"{name}\0{size}\0".encode())
        if size <= (_HASHED_BYTES if name == "" else 1 << 20):
            with open(full, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)

    if os.path.isdir(path):
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(root, name)
                add_file(full, os.path.relpath(full, path))
    elif os.path.isfile(path):
        add_file(path, "")
    else:
        return "(missing)"
    return digest.hexdigest()[:16]


def _arg_flag(dest: str) -> str:
    for name, _, field in _policy_fields():
        if _dest(name, field) == dest:
            return _flag(name, field)
    return "--" + dest.replace("_", "-")


def run_description(args) -> dict[str, str]:
    """What must be alike on every process of a --distributed run: each command-line argument by its flag (the
    ones in PER_PROCESS_ARGS aside), the input files and directories by a digest of what they hold (their paths
    may differ from host to host), and the command."""
    described = {}
    for dest, value in sorted(vars(args).items()):
        if dest in PER_PROCESS_ARGS or callable(value):
            continue
        if dest in INPUT_ARGS and isinstance(value, str):
            described[INPUT_ARGS[dest]] = f"contents {_digest_path(value)}"
        elif isinstance(value, (str, int, float, bool, type(None), list, tuple)):
            described[_arg_flag(dest)] = json.dumps(value)
    return described


def model_and_text(args):
    """The model of --model and the token ids of --text (its first --max-chars characters, when given)."""
    from clusterkv_jax import load_model

    check_text_file(args.text)
    model = load_model(args.model, dtype=args.dtype, mesh=getattr(args, "mesh", None))
    if model.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json; this command reads text")
    text = read_text_file(args.text, max_chars=args.max_chars)
    return model, model.tokenizer.encode(text, add_special_tokens=False)


#: The arguments a command reads from (files or directories), by their dest and their flag: no output may be one
#: of them or lie inside one.
INPUT_ARGS = {"text": "--text", "prompt_file": "--prompt-file", "document_file": "--document", "model": "--model",
              "data_dir": "--data-dir"}


def _input_clash(path: str, args) -> str | None:
    """'FLAG VALUE' of the input that `path` is, or lies inside (a directory input), else None."""
    real = os.path.realpath(path)
    for dest, flag in INPUT_ARGS.items():
        given = getattr(args, dest, None)
        if not isinstance(given, str):
            continue
        source = os.path.realpath(given)
        if real == source or (os.path.isdir(source) and os.path.commonpath([real, source]) == source):
            return f"{flag} {given!r}"
    return None


def check_outputs(args) -> None:
    """Where results will be written (--out, --json) can be written, and is none of the command's inputs: checked
    before hours of computing, and leaving nothing behind (a command that then fails leaves no empty directory;
    the check makes a directory where the first missing one would go and removes it). A --json file may not be an
    existing directory."""
    folders = []
    if getattr(args, "out", None):
        folders.append(("--out", os.path.abspath(args.out)))
    if getattr(args, "json", None):
        if os.path.isdir(args.json):
            raise ValueError(f"--json {args.json!r} is a directory; name a file to write the results to")
        folders.append(("--json", os.path.dirname(os.path.abspath(args.json))))
    for flag, path in (("--out", getattr(args, "out", None)), ("--json", getattr(args, "json", None))):
        clash = path and _input_clash(path, args)
        if clash:
            raise ValueError(f"{flag} {path!r} would write over the input {clash}; write the results elsewhere")
    for flag, folder in folders:
        existing = folder
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise ValueError(f"cannot write results to {flag} {folder!r}: {existing!r} is a file")
        try:
            if existing == folder:
                with tempfile.TemporaryFile(dir=folder):
                    pass
            else:  # what the writer will do first: make a directory there (os.access says yes to root under /proc)
                os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".clusterkv-check-"))
        except OSError as e:
            raise ValueError(f"cannot write results to {flag} {folder!r}: {e.strerror or e}") from None


def exit_now(code: int) -> None:
    """Ends a command-line tool with `code`. After Ctrl-C (130) the process ends at once, skipping the
    interpreter's teardown: JAX's compiler and runtime threads may still be at work then, and tearing Python
    down under them crashed the process (SIGSEGV) in 3 of 7 tries."""
    sys.stdout.flush()
    sys.stderr.flush()
    distributed = sys.modules.get("clusterkv_jax.distributed")
    if code == 130 or (code != 0 and distributed is not None and distributed.watching()):
        # A failed process of several ends here: its peers were told (`_tell_peers`) and end without joining
        # JAX's shutdown, which would wait for them (300 s).
        os._exit(code)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the work is done: a late Ctrl-C must not break the teardown
    sys.exit(code)


@contextlib.contextmanager
def interrupts_redelivered():
    """A Ctrl-C or terminating signal whose exception Python cannot raise, because it landed in a callback (JAX's
    garbage collection callback, say: its exceptions are 'ignored' and printed with a traceback, and the program
    goes on), is delivered again instead, so it stops the program once Python is back in ordinary code, with no
    traceback printed. A terminating signal's exception carries its number as `signum`."""
    previous = sys.unraisablehook

    def again(signum):
        # Sent from another thread a moment later (not here: a handler that ran inside this hook would be ignored
        # the same way), so the main thread handles it back in ordinary code.
        timer = threading.Timer(0.05, os.kill, args=(os.getpid(), signum))
        timer.daemon = True
        timer.start()

    def hook(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            again(signal.SIGINT)
        elif isinstance(getattr(unraisable.exc_value, "signum", None), int):
            again(unraisable.exc_value.signum)
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous


def run_reporting_errors(run, *, debug: bool, prefix: str, error_code: int, interrupted: str) -> int:
    """run() -> exit code; an error becomes one line `{prefix}error: ...` and `error_code`, Ctrl-C the line
    `interrupted` and 130; with `debug`, both raise (the traceback). Shared by both command-line tools."""
    handle_interrupts_in_python()  # from here on a KeyboardInterrupt is ours to report
    stderr = sys.stderr
    sys.stderr = tracked = _LineTracking(stderr)
    try:
        with interrupts_redelivered():
            return run()
    except KeyboardInterrupt:
        _tell_peers(130, "interrupted")
        if debug:
            raise
        _say(tracked, interrupted)
        return 130
    except Exception as e:  # noqa: BLE001 -- one line for the user; --debug shows the traceback
        _tell_peers(error_code, f"{type(e).__name__}: {e}")
        if debug:
            raise
        kind = "" if isinstance(e, (ValueError, TypeError, OSError)) else f" ({type(e).__name__})"
        distributed = sys.modules.get("clusterkv_jax.distributed")
        hint = distributed.lost_peer_hint(str(e)) if distributed is not None else ""
        _say(tracked, f"{prefix}error{kind}: {e}{hint}")
        return error_code
    finally:
        if sys.stderr is tracked:
            sys.stderr = stderr


class _LineTracking:
    """sys.stderr as `run_reporting_errors` runs a command: the same stream, noting whether what was written last
    ended a line. A progress bar's line has none until the bar closes, and a Ctrl-C can land inside its close (CI
    once saw "recall: decode steps: 100%|...| 4/4 [...]clusterkv: interrupted"); the error's line then starts one
    of its own."""

    def __init__(self, stream):
        self._stream, self.line_ended = stream, True

    def write(self, text):
        written = self._stream.write(text)
        if text:
            self.line_ended = text.endswith("\n")
        return written

    def __getattr__(self, name):  # everything else as the stream does it (flush, fileno, isatty, encoding, ...)
        return getattr(self._stream, name)


def _say(stderr: _LineTracking, line: str) -> None:
    print(("" if stderr.line_ended else "\n") + line, file=sys.stderr)


def _tell_peers(code: int, message: str) -> None:
    """In a run of several processes, the others learn that this one failed and end too (`distributed.end_run`)."""
    distributed = sys.modules.get("clusterkv_jax.distributed")  # not imported: no peers
    if distributed is not None:
        distributed.end_run(code, message)


def attended_per_step(policy, config, prompt_length: int, max_new_tokens: int = 1) -> str:
    """What one decode step of `policy` attends, in a line, so a user sees whether a budget compressed anything:
    per kind of layer (`cache.layer_kinds`) in the cache `generate` sizes for the prompt and `max_new_tokens`, so
    windowed layers are named for what they are."""
    from clusterkv_jax.cache import SELECTING, WINDOWED, layer_kinds
    from clusterkv_jax.steps import bucket_length, cache_capacity
    from clusterkv_jax.policies import ClusterKV

    kinds = [k.attention for k in layer_kinds(config, policy, cache_capacity(bucket_length(prompt_length),
                                                                               max_new_tokens))]
    L, windowed, selecting = len(kinds), kinds.count(WINDOWED), kinds.count(SELECTING)
    full = L - windowed - selecting
    windows = (f"; {windowed} windowed layer{'s' if windowed > 1 else ''} attend{'s' if windowed == 1 else ''} "
               f"the last {config.sliding_window} tokens" if windowed else "")
    if windowed == L:
        return (f"attends the last {config.sliding_window} tokens in all {L} layers: every layer is windowed, so no "
                "layer selects")
    budget = getattr(policy, "budget", None)
    if budget is None or not selecting:
        where = f"in all {L} layers" if not windowed else f"in {full} of {L} layers"
        return f"attends all {prompt_length} prompt tokens and every generated one, {where}{windows}"
    if budget >= prompt_length and policy.name == "streaming":
        return (f"attends all {prompt_length} prompt tokens until the sequence passes B={budget} tokens, then the "
                f"first {policy.sinks} and the most recent {budget - policy.sinks}{windows}")
    if budget >= prompt_length:
        return (f"attends all {prompt_length} prompt tokens: the budget B={budget} covers the prompt, so this is "
                f"full KV{windows}")
    first = [i for i, k in enumerate(kinds) if k not in (WINDOWED, SELECTING)] == list(range(full))
    layers = f"in {selecting} of {L} layers" + (f" ({'the first ' if first else ''}{full} attend all)" if full else "")
    if policy.name == "streaming":  # the budget covers every token, generated ones included
        return (f"attends {budget} tokens per step, the first {policy.sinks} and the most recent "
                f"{budget - policy.sinks}, of the {prompt_length} prompt tokens and the generated ones, "
                f"{layers}{windows}")
    if isinstance(policy, ClusterKV):
        later = f"and the generated tokens not clustered yet (at most {policy.decode_interval})"
    elif policy.window_size(prompt_length + 1) >= prompt_length + 1:  # a budget on the prompt only
        later = "and every generated token"
    else:
        later = "and the generated tokens not indexed yet"
    how = ""
    if isinstance(policy, ClusterKV):
        how = (f" chosen by q·k among the tokens of the top clusters ({policy.token_refine}x B)"
               if policy.token_refine > 1 else " chosen by cluster")
    return f"attends {budget} of the {prompt_length} prompt tokens per step{how} {later}, {layers}{windows}"


def _subcommands(parser: argparse.ArgumentParser):
    """(name path, parser) of every command under `parser`, depth first."""
    for action in parser._actions:  # argparse keeps its subparsers here only
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield [name], sub, helps.get(name)
                for path, deeper, help in _subcommands(sub):
                    yield [name, *path], deeper, help


def finish_help(parser: argparse.ArgumentParser) -> None:
    """Every command's --help shows each flag's default (also flags declared without a help line), and the
    top-level --help lists every command, subcommands included."""
    for _, sub, _ in [([], parser, None), *_subcommands(parser)]:
        sub.formatter_class = HelpFormatter
        for action in sub._actions:
            if action.help is None and action.option_strings and not any(
                    action.default is v for v in (None, False, argparse.SUPPRESS)):
                action.help = "(default: %(default)s)"
    rows = [(" ".join(path), help or "") for path, sub, help in _subcommands(parser)
            if not any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)]
    width = max(len(name) for name, _ in rows)
    parser.epilog = "commands:\n" + "\n".join(f"  {parser.prog} {name:<{width}}  {help}" for name, help in rows)
    parser.formatter_class = RawEpilogHelpFormatter


class RawEpilogHelpFormatter(HelpFormatter):
    """HelpFormatter whose epilog keeps its lines (the command list)."""

    def _fill_text(self, text, width, indent):
        if text.startswith("commands:\n"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)
