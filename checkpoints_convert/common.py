"""What both converters share: the param layout they map onto (named as HF names it), the tensor-source
interface they read through, dtype resolution, and the atomic staging and publishing of the output
directory."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import secrets
import shutil
import signal
import threading
from typing import Any, Callable, Iterable

import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from clusterkv_jax.checkpoint import TERMINATING_SIGNALS, signals_held
from clusterkv_jax.commands import interrupts_redelivered
from clusterkv_jax.config import FAMILIES, ModelConfig, read_json_object
from clusterkv_jax.model import param_shapes

DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}

# Source tensor dtypes we read; bfloat16 is ml_dtypes', which numpy does not count as np.floating.
_FLOAT_DTYPES = tuple(np.dtype(t) for t in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16))

# Tensors in HF files that hold no parameters of ours.
_HF_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


# ----------------------------------------------------------------------------------------------------------
# HF tensor layout
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where one leaf of the param pytree comes from in an HF state dict."""

    path: tuple[str, ...]  # key path in the param pytree
    hf_name: str  # with "{i}" for the layer index when `stacked`
    hf_shape: tuple[int, ...]  # per layer, PyTorch order
    to_ours: Callable[[np.ndarray], np.ndarray] | None  # None: same layout
    stacked: bool


def _hf_sources(config: ModelConfig) -> list[_Source]:
    """The HF origin of every param leaf. HF Linear weights are [out, in]; ours are [in, ..., out]. A family that
    fuses q, k, v (Phi-3) or gate and up (GLM, Phi-3) into one matrix gives several leaves one tensor, each its
    rows of it (`FAMILIES`)."""
    c, family = config, FAMILIES[config.model_type]
    D, N, K, H, F, V = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size
    layer = "model.layers.{i}."

    def stacked(name, hf_name, hf_shape, to_ours=None):
        return _Source(("layers", name), layer + hf_name, hf_shape, to_ours, True)

    def rows(lo, hi, then):  # rows [lo, hi) of a fused [out, in] matrix, then `then`
        return lambda w: then(w[lo:hi])

    if family.fused_qkv:
        qkv = "self_attn.qkv_proj.weight", ((N + 2 * K) * H, D)
        attention = [
            stacked("q", *qkv, rows(0, N * H, lambda w: w.T.reshape(D, N, H))),
            stacked("k", *qkv, rows(N * H, (N + K) * H, lambda w: w.T.reshape(D, K, H))),
            stacked("v", *qkv, rows((N + K) * H, (N + 2 * K) * H, lambda w: w.T.reshape(D, K, H))),
        ]
    else:
        attention = [
            stacked("q", "self_attn.q_proj.weight", (N * H, D), lambda w: w.T.reshape(D, N, H)),
            stacked("k", "self_attn.k_proj.weight", (K * H, D), lambda w: w.T.reshape(D, K, H)),
            stacked("v", "self_attn.v_proj.weight", (K * H, D), lambda w: w.T.reshape(D, K, H)),
        ]
    # Where a norm's weights are: Gemma's "post_attention_layernorm" follows the attention (Llama's precedes the MLP).
    if family.gemma:
        mlp_norm, post_attn_norm, post_mlp_norm = ("pre_feedforward_layernorm", "post_attention_layernorm",
                                                   "post_feedforward_layernorm")
    else:
        mlp_norm, post_attn_norm, post_mlp_norm = ("post_attention_layernorm", "post_self_attn_layernorm",
                                                   "post_mlp_layernorm")
    if family.fused_gate_up:
        gate_up = "mlp.gate_up_proj.weight", (2 * F, D)
        mlp = [stacked("gate", *gate_up, rows(0, F, lambda w: w.T)),
               stacked("up", *gate_up, rows(F, 2 * F, lambda w: w.T))]
    else:
        mlp = [stacked("gate", "mlp.gate_proj.weight", (F, D), lambda w: w.T),
               stacked("up", "mlp.up_proj.weight", (F, D), lambda w: w.T)]
    sources = [
        _Source(("embed",), "model.embed_tokens.weight", (V, D), None, False),
        stacked("attn_norm", "input_layernorm.weight", (D,)),
        *attention,
        stacked("o", "self_attn.o_proj.weight", (D, N * H), lambda w: w.T.reshape(N, H, D)),
        stacked("mlp_norm", f"{mlp_norm}.weight", (D,)),
        *mlp,
        stacked("down", "mlp.down_proj.weight", (D, F), lambda w: w.T),
    ]
    if c.qkv_bias:
        sources += [
            stacked("q_bias", "self_attn.q_proj.bias", (N * H,), lambda b: b.reshape(N, H)),
            stacked("k_bias", "self_attn.k_proj.bias", (K * H,), lambda b: b.reshape(K, H)),
            stacked("v_bias", "self_attn.v_proj.bias", (K * H,), lambda b: b.reshape(K, H)),
        ]
    if c.o_bias:
        sources.append(stacked("o_bias", "self_attn.o_proj.bias", (D,)))
    if c.qk_norm:
        sources += [stacked("q_norm", "self_attn.q_norm.weight", (H,)),
                    stacked("k_norm", "self_attn.k_norm.weight", (H,))]
    if c.post_norms:
        sources += [stacked("post_attn_norm", f"{post_attn_norm}.weight", (D,)),
                    stacked("post_mlp_norm", f"{post_mlp_norm}.weight", (D,))]
    sources.append(_Source(("final_norm",), "model.norm.weight", (D,), None, False))
    if not c.tie_word_embeddings:
        sources.append(_Source(("lm_head",), "lm_head.weight", (V, D), lambda w: w.T, False))
    return sources


def _hf_names(source: _Source, config: ModelConfig) -> list[str]:
    if source.stacked:
        return [source.hf_name.format(i=i) for i in range(config.num_layers)]
    return [source.hf_name]


def expected_hf_names(config: ModelConfig) -> list[str]:
    """Every HF tensor name the config's family reads, each once."""
    return list(dict.fromkeys(name for s in _hf_sources(config) for name in _hf_names(s, config)))


def _to_hf_layout(source: _Source, ours: np.ndarray, hf: np.ndarray | None) -> np.ndarray:
    """One layer's leaf written into its HF tensor `hf` (a new one when None): `to_ours` only slices rows,
    transposes and reshapes, so applying it to the element indices of an HF-shaped array tells where every element
    of ours comes from; write it back there (a fused tensor gathers its leaves this way)."""
    size = int(np.prod(source.hf_shape))
    if source.to_ours is None:
        return np.asarray(ours).reshape(source.hf_shape)
    where = np.asarray(source.to_ours(np.arange(size).reshape(source.hf_shape))).ravel()
    flat = np.empty(size, ours.dtype) if hf is None else hf.ravel()
    flat[where] = np.asarray(ours).ravel()
    return flat.reshape(source.hf_shape)


def params_to_hf_state_dict(params: dict, config: ModelConfig) -> dict[str, np.ndarray]:
    """The param pytree as an HF state dict of the config's family (numpy, PyTorch layout): the inverse of
    `hf_state_dict_to_params`. A tied model has no lm_head.weight."""
    out: dict[str, np.ndarray] = {}
    for source in _hf_sources(config):
        leaf = np.asarray(_lookup(params, source.path))
        for i, name in enumerate(_hf_names(source, config)):
            out[name] = _to_hf_layout(source, leaf[i] if source.stacked else leaf, out.get(name))
    return out


def _is_ignorable_hf_name(name: str, config: ModelConfig) -> bool:
    # A tied checkpoint may still store the (duplicate) head; the model reads the embedding instead.
    return bool(_HF_IGNORED.fullmatch(name)) or (config.tie_word_embeddings and name == "lm_head.weight")


class TensorSource:
    """Named tensors in PyTorch layout, readable one at a time."""

    def names(self) -> Iterable[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def describe(self, name: str) -> str:
        """The name as the user's file spells it, for error messages."""
        return name


def build_params(source: TensorSource, config: ModelConfig, dtype: np.dtype, desc: str = "tensors") -> dict:
    """Checks names and shapes of every tensor first, then reads them into the param pytree of `dtype`."""
    sources = _hf_sources(config)
    present = set(source.names())
    expected = expected_hf_names(config)
    missing = [name for name in expected if name not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint is missing tensor {source.describe(missing[0])!r}{more}")
    unexpected = sorted(n for n in present - set(expected) if not _is_ignorable_hf_name(n, config))
    if unexpected:
        shown = ", ".join(repr(source.describe(n)) for n in unexpected[:5])
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise ValueError(
            f"checkpoint has tensors this {config.model_type} config does not use: {shown}{more}; "
            "the architecture variant is not supported"
        )
    for s in sources:
        for name in _hf_names(s, config):
            got = tuple(source.shape(name))
            if got != s.hf_shape:
                raise ValueError(f"tensor {source.describe(name)!r} has shape {got}, expected {s.hf_shape}")

    tree_shapes = param_shapes(config)
    params: dict[str, Any] = {}
    reads = sum(len(_hf_names(s, config)) for s in sources)  # a fused tensor is read once per leaf it feeds
    # Built with signals held: a SIGQUIT inside tqdm's constructor (CI) left a half-built bar whose __del__ printed an
    # AttributeError traceback while the conversion ended.
    with signals_held():
        bar = tqdm(total=reads, desc=desc, unit="tensor", leave=False)
    with bar:
        for s in sources:
            node, key = params, s.path[-1]
            for part in s.path[:-1]:
                node = node.setdefault(part, {})
            shape = _lookup(tree_shapes, s.path)
            out = np.empty(shape, dtype)
            for index, name in enumerate(_hf_names(s, config)):
                weight = source.read(name)
                if weight.dtype not in _FLOAT_DTYPES:
                    raise ValueError(f"tensor {source.describe(name)!r} has dtype {weight.dtype}, not floating point")
                weight = s.to_ours(weight) if s.to_ours else weight
                if s.stacked:
                    out[index] = weight.astype(dtype, copy=False)
                else:
                    out[...] = weight.astype(dtype, copy=False)
                bar.update()
            node[key] = out
    _check_layout(params, tree_shapes)
    return params


def _lookup(tree: dict, path: tuple[str, ...]):
    for part in path:
        tree = tree[part]
    return tree


def _flatten(tree: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


def _check_layout(params: dict, shapes: dict) -> None:
    """Guards the converter against drifting from `param_shapes`, the model's contract."""
    got = {path: tuple(leaf.shape) for path, leaf in _flatten(params).items()}
    want = _flatten(shapes)
    assert got == want, f"converter layout {got} does not match param_shapes {want}"


# ----------------------------------------------------------------------------------------------------------
# Output directory
# ----------------------------------------------------------------------------------------------------------


def resolve_dtype(dtype: Any) -> tuple[str, np.dtype]:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return name, DTYPES[name]


def check_destination(src: str, dst: str) -> None:
    """Refuses a destination that is the source, lies inside it or contains it: publishing there would delete
    the source (with --overwrite) or write into it."""
    source, target = os.path.realpath(src), os.path.realpath(dst)
    if target == source:
        raise ValueError(f"destination {dst!r} is the source {src!r}; choose a new directory for the output")
    if os.path.commonpath([source, target]) == source:
        raise ValueError(f"destination {dst!r} lies inside the source {src!r}; choose a directory outside it")
    if os.path.commonpath([source, target]) == target:
        raise ValueError(f"destination {dst!r} contains the source {src!r}; choose a directory beside it")


def is_converted_checkpoint(path: str) -> bool:
    """A directory this package wrote: its config.json has a "clusterkv" entry."""
    config = os.path.join(path, "config.json")
    if os.path.islink(path) or not os.path.isdir(path) or not os.path.isfile(config):
        return False
    try:
        return isinstance(read_json(config).get("clusterkv"), dict)
    except (OSError, ValueError, AttributeError):
        return False


def check_output(src: str, dst: str, overwrite: bool) -> None:
    """What a converter checks before reading anything: `dst` does not overlap `src`, and exists only if it may
    be replaced (`overwrite`, and an earlier conversion or an empty directory)."""
    check_destination(src, dst)
    _check_replaceable(dst, overwrite)


def _check_replaceable(dst: str, overwrite: bool) -> None:
    if not os.path.lexists(dst):
        return
    if not overwrite:
        raise FileExistsError(f"destination {dst!r} already exists; pass overwrite=True (--overwrite) to replace it")
    if not _replaceable(dst):
        raise FileExistsError(
            f"destination {dst!r} exists and is not a converted checkpoint (no config.json with a 'clusterkv' "
            "entry): --overwrite only replaces an earlier conversion; remove it yourself or choose another path"
        )


def _staging_prefix(dst: str) -> str:
    return f".{os.path.basename(dst)}.tmp-"


def sweep_stale_staging(dst: str) -> list[str]:
    """Deletes staging directories of `dst` (`.NAME.tmp-PID-*`, and `*.old` from publishing) left by a
    conversion whose process no longer runs (killed, or the machine went down); returns what it deleted."""
    parent, prefix = os.path.dirname(dst), _staging_prefix(dst)
    pattern = re.compile(re.escape(prefix) + r"(\d+)-[^/]*")
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        match = pattern.fullmatch(name)
        path = os.path.join(parent, name)
        if match and not _process_alive(int(match.group(1))) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process, or not a pid we can ask about: leave it alone
    return True


class _Terminated(SystemExit):
    """What a terminating signal (`TERMINATING_SIGNALS`) raises inside `_termination_raises`; exit status 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


@contextlib.contextmanager
def _termination_raises():
    """SIGTERM, SIGHUP and SIGQUIT raise SystemExit (instead of ending the process on the spot), so cleanup code
    runs. Only signals that still have their default action (a caller's own handler is left alone), from the main
    thread. Any interrupt landing in a callback that cannot raise is delivered again
    (`clusterkv_jax.commands.interrupts_redelivered`)."""
    main = threading.current_thread() is threading.main_thread()
    ours = [s for s in TERMINATING_SIGNALS if main and signal.getsignal(s) == signal.SIG_DFL]

    def stop(signum, frame):
        raise _Terminated(signum)

    for s in ours:
        signal.signal(s, stop)
    try:
        with interrupts_redelivered():
            yield
    finally:
        for s in ours:
            signal.signal(s, signal.SIG_DFL)


@contextlib.contextmanager
def staging_dir(dst: str, overwrite: bool, src: str | None = None):
    """Yields an empty temporary sibling of `dst`, renamed to `dst` when the block succeeds, deleted if it fails
    or is interrupted (an exception, Ctrl-C, SIGTERM, SIGHUP, SIGQUIT). Refuses a `dst` that overlaps `src`, or
    that exists and is not an earlier conversion; first deletes staging directories that earlier, killed runs
    left. Publishing checks again: it never replaces what appeared at `dst` meanwhile (`_publish`)."""
    if src is not None:
        check_destination(src, dst)
    _check_replaceable(dst, overwrite)
    parent = os.path.dirname(dst)
    with _termination_raises():
        try:  # before any reading: an unwritable place fails at once, naming the destination
            os.makedirs(parent, exist_ok=True)
            sweep_stale_staging(dst)
        except OSError as e:
            why = _why_not_a_directory(parent) or e.strerror or e
            raise OSError(e.errno, f"cannot write the destination {dst!r}: {why}") from None
        staging = _make_staging(dst)
        try:
            yield staging
            _publish(staging, dst, overwrite)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def _why_not_a_directory(path: str) -> str | None:
    """'X is a file, not a directory' for the first existing ancestor of `path` (itself included) that is not a
    directory (os.makedirs says only "File exists" or "Not a directory"); None if there is none."""
    path = os.path.abspath(path)
    ancestors = []
    while path not in ancestors:
        ancestors.append(path)
        path = os.path.dirname(path)
    for ancestor in reversed(ancestors):
        if os.path.lexists(ancestor) and not os.path.isdir(ancestor):
            return f"{ancestor!r} is a file, not a directory"
    return None


def _make_staging(dst: str) -> str:
    """Creates `dst`'s staging directory, named before it exists, so a signal that lands just after the mkdir
    (CI caught a SIGTERM there, inside tempfile.mkdtemp, before its name was returned) still knows what to delete.
    The name carries our pid and a random part: nothing else makes it, and a clash is retried."""
    prefix = os.path.join(os.path.dirname(dst), f"{_staging_prefix(dst)}{os.getpid()}-")
    while True:
        staging = prefix + secrets.token_hex(4)
        try:
            os.mkdir(staging)
            os.chmod(staging, 0o755)  # whatever the umask: a checkpoint is readable like any other output
            return staging
        except FileExistsError:
            continue
        except OSError as e:
            shutil.rmtree(staging, ignore_errors=True)
            raise OSError(e.errno, f"cannot write the destination {dst!r}: {e.strerror or e}") from None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


_RENAME_NOREPLACE = 1  # linux/fs.h
_AT_FDCWD = -100


def _rename_noreplace(src: str, dst: str) -> None:
    """Renames src to dst, failing with FileExistsError if dst exists, atomically: Linux's renameat2 with
    RENAME_NOREPLACE where the C library and the file system have it; elsewhere dst is first claimed by creating
    it as an empty directory (atomic too), which the rename then replaces (rename replaces only an empty one)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        renameat2 = None
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), dst)
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # those three: no such flag here
            raise OSError(err, os.strerror(err), dst)
    os.mkdir(dst)  # FileExistsError if anything is there
    try:
        os.rename(src, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rmdir(dst)
        raise


def _publish(staging: str, dst: str, overwrite: bool) -> None:
    """Moves `staging` to `dst`. What is at `dst` now is replaced only with `overwrite` and only if it is an
    earlier conversion or an empty directory (checked on what was moved aside, so nothing that appeared since the
    first check is replaced); the old one is deleted once the new one is in place. A `dst` that appeared while the
    conversion ran, without `overwrite`, is a FileExistsError and stays as it is."""
    appeared = (f"destination {dst!r} appeared while the conversion ran; it was left as it is and nothing was "
                "written (pass --overwrite to replace an earlier conversion)")
    if not os.path.lexists(dst) or not overwrite:
        try:
            _rename_noreplace(staging, dst)
        except FileExistsError:
            raise FileExistsError(appeared) from None
        return
    old = staging + ".old"
    os.rename(dst, old)
    try:
        _check_replaceable_at(old, dst)
        _rename_noreplace(staging, dst)
    except BaseException as e:
        with contextlib.suppress(OSError):
            _rename_noreplace(old, dst)  # back where it was, unless something took its place meanwhile
        if os.path.lexists(old):
            raise FileExistsError(f"{e}; what was at {dst!r} is now at {old!r}") from e
        raise
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.remove(old)


def _replaceable(path: str) -> bool:
    """What --overwrite may replace: an earlier conversion or an empty directory."""
    empty_dir = os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)
    return empty_dir or is_converted_checkpoint(path)


def _check_replaceable_at(path: str, dst: str) -> None:
    """`_check_replaceable` of what was at `dst`, now at `path`."""
    if not _replaceable(path):
        raise FileExistsError(f"destination {dst!r} changed while the conversion ran and now holds something that is "
                              "not a converted checkpoint; it was left as it is and nothing was written")


def write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


read_json = read_json_object
