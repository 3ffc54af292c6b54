"""Checks of the job API's arguments, shared by the environment, the stream
classes and the window vocabulary: each names the argument and what it takes.
Below the API layer, so that the windows package can use them too."""
from __future__ import annotations

import inspect
import math
import numbers
import os

import numpy as np

from pyflowbuf._core.serde import stable_hash
from pyflowbuf.config import _number, _positive_int  # noqa: F401 - _positive_int: shared with the API modules
from pyflowbuf.errors import ConfigurationError, KeyTypeError
from pyflowbuf.serializers import get_serializer, kind_label, short_repr


def check_timeout(timeout):
    """A job timeout: None (wait as long as it takes) or a number of seconds > 0."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0 \
            or math.isnan(timeout):
        raise ConfigurationError(
            f"timeout must be None or a number of seconds > 0, got {timeout!r}")
    return timeout


_INT64 = (-(1 << 63), (1 << 63) - 1)

_FIXED_WIDTH = {"int64": 8, "float64": 8}


def _output_path(path, name):
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigurationError(f"{name!r}: path must be a directory path, got {path!r}")
    return os.fspath(path)


def _parallelism(env, parallelism) -> int:
    if parallelism is None:
        return env.parallelism
    _positive_int("parallelism", parallelism)
    return parallelism


def _kind_identity(kind):
    """What makes two declared kinds the same: a dtype itself, else the
    serializer's name ('int64' and get_serializer('int64') are one kind)."""
    if isinstance(kind, np.dtype):
        return kind

    return get_serializer(kind).name


def _common_kind(streams, what):
    """The kind the streams declare (None when none does); streams declaring
    different kinds are refused, as they would be at their first record."""

    known = [s for s in streams if s.node.kind is not None]
    if not known:
        return None
    first = known[0]
    for s in known[1:]:
        if _kind_identity(s.node.kind) != _kind_identity(first.node.kind):
            raise ConfigurationError(
                f"{what}: the streams carry different record kinds: {first.node.name!r} carries "
                f"{kind_label(first.node.kind)} and {s.node.name!r} carries {kind_label(s.node.kind)}; "
                "a union carries one kind: map the streams to one kind first, or connect() them")
    return first.node.kind


def _job_name(param, v, optional=False):
    if v is None and optional:
        return
    if not isinstance(v, str) or not v:
        raise ConfigurationError(f"{param} must be a non-empty str, got {v!r}")


def _check_kind(kind, what):
    """kind= as a declaration takes it: None (inferred from the first record),
    a NumPy dtype (a rows stream), a Serializer instance or a registered name.
    The serializers' registry decides what a name means."""
    if kind is None or isinstance(kind, np.dtype):
        return kind
    if isinstance(kind, type) and issubclass(kind, np.generic):
        raise ConfigurationError(
            f"{what}: kind={kind.__name__} is a NumPy scalar type; a rows stream takes a dtype: "
            f"kind=np.dtype(np.{kind.__name__})")

    try:
        get_serializer(kind)
    except ValueError as exc:
        raise ConfigurationError(f"{what}: kind={kind!r} is not a record kind: {exc}") from None
    except TypeError:        # unhashable: no name can match it
        raise ConfigurationError(
            f"{what}: kind={kind!r} is not a record kind: give None (inferred), a NumPy dtype, a "
            "Serializer instance or a registered name such as 'int64', 'str', 'bytes'") from None
    return kind


def _sequence_args(start, stop, step):
    def as_int(name, v):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ConfigurationError(f"from_sequence: {name} must be an int, got {v!r}")
        return int(v)

    start = as_int("start", start)
    step = as_int("step", step)
    if stop is not None:
        stop = as_int("stop", stop)
    if step == 0:
        raise ConfigurationError("from_sequence: step must not be 0")
    lo, hi = _INT64
    if not lo <= start <= hi:
        raise ConfigurationError(f"from_sequence: start={start} does not fit the stream's kind, int64")
    if stop is not None:
        r = range(start, stop, step)
        if r and not lo <= r[-1] <= hi:
            raise ConfigurationError(
                f"from_sequence: stop={stop} makes values up to {r[-1]}, which do not fit the "
                "stream's kind, int64")
    return start, stop, step


def _execute_args(job_name, timeout):
    """execute(job_name=None, timeout=None), where a number in job_name's place
    is the timeout: execute(30) has always meant execute(timeout=30)."""
    if _number(job_name):
        if timeout is not None:
            raise ConfigurationError(
                f"execute() got a timeout twice ({job_name!r} and timeout={timeout!r}); "
                "execute(job_name, timeout) takes the name first")
        job_name, timeout = None, job_name
    _job_name("job_name", job_name, optional=True)
    return job_name, check_timeout(timeout)


def _callable(fn, what):
    if not callable(fn):
        raise TypeError(f"{what} takes a function, got {type(fn).__name__}")


def _check_arity(fn, what, call, *counts):
    """Refuse, where the operator is declared, a function that cannot take the
    positional arguments its operator will pass (``counts``: the accepted
    numbers; ``call`` shows them); otherwise its first record fails the job.
    A callable without a signature (some builtins) is left to that call."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    for n in counts:
        try:
            sig.bind(*range(n))
            return
        except TypeError:
            pass
    label = getattr(fn, "__qualname__", None) or type(fn).__name__
    raise ConfigurationError(f"{what}: the function is called as {call}, but {label}{sig} cannot take "
                             f"{' or '.join(map(str, counts))} positional arguments")


def check_node_kind(node, segment_size: int, max_record_size: int) -> None:
    """A declared or inferred kind the settings cannot carry: every record
    of the stream would fail where it is serialized, and in a chained job
    perhaps never, so it is refused where the stream is declared."""
    kind = node.kind
    if kind is None:
        return
    what = f"{node.name!r}"
    if isinstance(kind, np.dtype):
        if kind.hasobject:
            raise ConfigurationError(
                f"{what}: rows of dtype {kind} hold Python object references, which cannot travel as "
                "bytes; use a dtype of fixed-width fields, or a record kind ('pickle', 'numpy')")
        if kind.itemsize == 0:
            raise ConfigurationError(f"{what}: rows of dtype {kind} are 0 bytes wide; give the dtype fields")
        if kind.itemsize > segment_size:
            raise ConfigurationError(
                f"{what}: rows of dtype {kind} are {kind.itemsize} bytes wide and a row must fit one "
                f"segment: raise segment_size (now {segment_size}) to at least {kind.itemsize} "
                "rounded up to a power of two, or send the rows as records (kind='numpy')")
        return
    core = getattr(get_serializer(kind), "core_kind", None)
    width = _FIXED_WIDTH.get(core)
    if width is not None and max_record_size < width:
        raise ConfigurationError(
            f"{what}: its {core} records are {width} bytes each, over max_record_size="
            f"{max_record_size}: every record would be refused; raise max_record_size")


def check_graph(nodes) -> None:
    """A job that could do nothing visible is refused: with nothing
    declared, or without a sink, it would run (perhaps for a long time)
    and every record would vanish without a word."""
    if not nodes:
        raise ConfigurationError(
            "this Environment has nothing to run: declare a source (from_collection, read_text, ..), "
            "the operators and a sink (collect(), print(), write_text(), sink(fn), to_iterator()) "
            "before execute()")
    if not any(n.is_sink for n in nodes):
        ends = [n.name for n in nodes if not n.consumers]
        raise ConfigurationError(
            f"this job has no sink: the records of {', '.join(repr(e) for e in ends)} would go nowhere; "
            "end the stream with collect(), print(), write_text(), write_parquet(), sink(fn) or "
            "to_iterator()")


# ---- what a key_by key may be ----

_KEY_TYPES = ("str, int, float, bool, bytes, None, or tuples and frozensets of them "
              "(NumPy integers and floats too)")


def _type_label(value) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def key_fn_label(key_fn) -> str:
    """The key_by declaration as a user finds it: the key function's name and
    where it is defined."""
    name = getattr(key_fn, "__qualname__", None) or type(key_fn).__name__
    code = getattr(key_fn, "__code__", None)
    if code is not None:
        return f"key_by({name}) at {os.path.basename(code.co_filename)}:{code.co_firstlineno}"
    return f"key_by({name})"


def check_keys(keys, operator: str, key_fn, codec_error=None) -> None:
    """Refuse, at the first batch a key_by routes, keys that would give a
    wrong answer or fail later: unhashable ones (a list, a dict), ones
    without a hash that is the same in every process (``object()``, a
    dataclass: equal keys would reach different subtasks, or every record
    be a key of its own), and, with checkpoints, ones the checkpoint codec
    cannot write (an IntEnum, a namedtuple), which would fail the first
    checkpoint. The stable hash (``stable_hash``) and the codec decide
    (``codec_error(key)``: why the job's checkpoints cannot store the key,
    or None; None where the job takes no checkpoints); a ``KeyTypeError``
    names the keyed operator, the key_by and the key. Called once per
    output side (the routing path), not per record."""
    where = f"{key_fn_label(key_fn)} into {operator!r}"
    encoded: set = set()
    for k in keys:
        try:
            hash(k)
        except TypeError:
            raise KeyTypeError(
                f"{where}: the key function returned {short_repr(k)} (type {_type_label(k)}), which is not "
                f"hashable, so it cannot be a key. Keys are hashable values with a stable hash: {_KEY_TYPES} "
                "(e.g. tuple(...) instead of a list)") from None
        try:
            stable_hash(k)
        except KeyTypeError:
            raise KeyTypeError(
                f"{where}: the key function returned {short_repr(k)} (type {_type_label(k)}), whose hash() "
                "is not the same in every process (based on identity, or salted per process): equal keys would reach different subtasks and "
                "restored state (an object() makes every record a key of its own). Keys are hashable "
                f"values with a stable hash: {_KEY_TYPES}; return e.g. a field, an id, or a tuple of "
                "the fields") from None
        if codec_error is not None and type(k) not in encoded:
            why = codec_error(k)
            if why is not None:
                raise KeyTypeError(
                    f"{where}: the key {short_repr(k)} (type {_type_label(k)}) cannot be written into a "
                    f"checkpoint ({why}); the job takes checkpoints, so return a plain key: {_KEY_TYPES} "
                    "(e.g. int(k) for an IntEnum, tuple(k) for a namedtuple)")
            if type(k) is not tuple:        # a tuple's items may differ between keys
                encoded.add(type(k))
