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
from pyflowbuf.errors import ConfigurationError, KeyTypeError, SaltedHashError
from pyflowbuf.serializers import get_serializer, kind_label, short_repr


def check_timeout(timeout, zero_ok=False):
    """A job timeout: None (wait as long as it takes) or a number of seconds > 0
    (>= 0 where ``zero_ok``: ``join(0)`` asks "has it ended?" without waiting,
    as ``Thread.join(0)`` does)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or math.isnan(timeout) \
            or not (timeout >= 0 if zero_ok else timeout > 0):
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigurationError(
            f"timeout must be None or a number of seconds {bound}, got {timeout!r}")
    return timeout


_INT64 = (-(1 << 63), (1 << 63) - 1)

_FIXED_WIDTH = {"int64": 8, "float64": 8}


def _output_path(path, name):
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigurationError(f"{name!r}: path must be a directory path, got {path!r}")
    return os.fspath(path)


def _parallelism(default: int, parallelism) -> int:
    if parallelism is None:
        return default
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


# ---- key functions whose result depends on the per-process str/bytes hash ----
# (kept apart from the other key-function checks: these look at the code, not at a result)

_STABLE_KEY_MARK = "__pyflowbuf_stable_key__"
_FOLLOW_DEPTH = 4       # functions a key function calls, followed this deep


def stable_key(fn):
    """Declare that key function ``fn`` gives the same key in every process
    although its code calls ``hash()`` (it hashes ints, or tuples of them,
    whose hash is not salted): pyflowbuf then does not refuse it where keys
    must agree across processes and runs. Returns ``fn`` (marked).

    Example::

        from pyflowbuf import stable_key
        s.key_by(stable_key(lambda r: hash((r.x, r.y)) % 64))   # ints only
    """
    _callable(fn, "stable_key")
    try:
        setattr(fn, _STABLE_KEY_MARK, True)
        return fn
    except (AttributeError, TypeError):        # a builtin or a partial of one: wrap it
        def key(record, _fn=fn):
            return _fn(record)
        setattr(key, _STABLE_KEY_MARK, True)
        return key


def salted_hash_use(fn) -> str | None:
    """Where key function ``fn`` calls the builtin ``hash`` (or a
    ``__hash__``), whose result for a str or bytes is salted per process
    (PYTHONHASHSEED): the code it is in, else None. Looks through lambdas,
    nested functions, ``functools.partial``, methods, callable objects and
    the module-level functions the code calls."""
    if getattr(fn, _STABLE_KEY_MARK, False):
        return None
    return _hash_use(fn, {}, 0)


def _hash_use(fn, seen, depth):
    import builtins
    import functools
    import types

    if fn is builtins.hash:
        return "the builtin hash itself"
    if id(fn) in seen or depth > _FOLLOW_DEPTH:
        return None
    seen[id(fn)] = fn       # (held: an id is unique only while its object lives)
    if getattr(fn, _STABLE_KEY_MARK, False):
        return None
    if isinstance(fn, functools.partial):
        return _hash_use(fn.func, seen, depth) or _first(_hash_use(a, seen, depth + 1)
                                                          for a in (*fn.args, *fn.keywords.values()) if callable(a))
    if isinstance(fn, types.MethodType):
        return _hash_use(fn.__func__, seen, depth) or _held(fn.__self__, seen, depth)
    if isinstance(fn, (staticmethod, classmethod)):
        return _hash_use(fn.__func__, seen, depth)
    if isinstance(fn, types.FunctionType):
        # functions handed in as default arguments (def key(u, _f=fn)) are called too
        held = [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
        return _code_hash_use(fn, fn.__code__, seen, depth) or _first(
            _hash_use(d, seen, depth + 1) for d in held if callable(d) and _user_code(d))
    call = getattr(type(fn), "__call__", None)
    if isinstance(call, types.FunctionType):       # a callable object of a Python class
        return _hash_use(call, seen, depth) or _held(fn, seen, depth)
    return None


def _held(obj, seen, depth):
    """A hash use in the functions an object holds (``self.fn`` called by its method)."""
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return None
    return _first(_hash_use(v, seen, depth + 1) for v in list(attrs.values()) if callable(v) and _user_code(v))


def _first(it):
    return next((x for x in it if x), None)


def _code_hash_use(fn, code, seen, depth):
    import builtins
    import dis
    import types

    g = getattr(fn, "__globals__", {})
    cells = {}
    if getattr(fn, "__closure__", None):
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__):
            try:
                cells[name] = cell.cell_contents
            except ValueError:      # an empty cell
                pass
    where = f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"
    prev = None
    for ins in dis.get_instructions(code):
        op, name = ins.opname, ins.argval
        loaded = False
        if op in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(name, str):
            target, loaded = (g[name] if name in g else getattr(builtins, name, None)), True
        elif op in ("LOAD_DEREF", "LOAD_CLOSURE") and isinstance(name, str) and name in cells:
            target, loaded = cells[name], True
        if loaded:      # a name's value: the builtin hash itself, or user code that may call it
            if target is builtins.hash:
                return f"hash() in {where}"
            if callable(target) and _user_code(target):
                got = _hash_use(target, seen, depth + 1)
                if got:
                    return got
            prev = target
            continue
        if op in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(name, str):
            if name == "__hash__":
                return f"a __hash__() call in {where}"
            if name == "hash" and prev is builtins:
                return f"builtins.hash() in {where}"
        prev = None
    for const in code.co_consts:
        if isinstance(const, types.CodeType):       # a nested lambda, function or comprehension
            got = _code_hash_use(fn, const, seen, depth)
            if got:
                return got
    return None


def _user_code(fn) -> bool:
    """Whether ``fn`` is worth looking into: Python code that is not
    pyflowbuf's or the standard library's (their key-like helpers do not
    hash str with the process's salt, and looking would cost at every
    declaration)."""
    import builtins
    import functools
    import types
    import sys
    if fn is builtins.hash:
        return True
    if isinstance(fn, functools.partial):
        return _user_code(fn.func) or any(callable(a) and _user_code(a) for a in fn.args)
    code = getattr(fn, "__code__", None)
    if isinstance(fn, (types.FunctionType, types.MethodType)) and code is not None:
        path = code.co_filename
    elif isinstance(fn, type):
        return False
    else:
        call = getattr(type(fn), "__call__", None)
        if not isinstance(call, types.FunctionType):
            return False
        path = call.__code__.co_filename
    here = os.path.dirname(os.path.abspath(__file__))
    stdlib = os.path.dirname(os.__file__)
    return not (path.startswith(here) or path.startswith(stdlib) or path.startswith(sys.base_prefix)
                or "site-packages" in path)


def note_key_function(found: list, fn, what: str) -> None:
    """At declaration: remember in ``found`` (the job's list) a key function
    that calls ``hash()``; the job's settings decide at ``execute`` whether
    it can be right (``check_key_hashes``)."""
    use = salted_hash_use(fn)
    if use is not None:
        found.append((what, use))


def _fixed_seed(value) -> bool:
    return isinstance(value, str) and value.strip().isdigit()


def check_key_hashes(found: list, *, checkpoints: bool, cluster=None) -> None:
    """Before a job runs: refuse a key function that calls ``hash()`` where
    keys must agree across processes or runs, unless PYTHONHASHSEED is
    fixed (in this process's environment, and for a SparkCluster in
    ``spark.executorEnv.PYTHONHASHSEED`` too). In one process, and in
    worker processes forked from it (they share its hash salt), without
    checkpoints, a str's hash is the same everywhere the job runs: allowed.
    ``found``: what ``note_key_function`` noted."""
    if not found:
        return
    why, fix = [], []
    seed = os.environ.get("PYTHONHASHSEED")
    if checkpoints and not _fixed_seed(seed):
        why.append("checkpoints are on, and a restore (a resume, a `pyflowbuf run --restore`) runs in a new "
                   "process whose str/bytes hashes differ, so each key's state would be under another key")
        fix.append("set PYTHONHASHSEED to a fixed number in the environment of every run")
    if cluster is not None:
        conf = getattr(cluster, "_conf", None)
        executor_seed = conf("spark.executorEnv.PYTHONHASHSEED") if callable(conf) else None
        if not (_fixed_seed(seed) and _fixed_seed(executor_seed)) or seed.strip() != executor_seed.strip():
            why.append("the cluster's workers are separate Python processes, each hashing str/bytes "
                       "with its own salt, so one key would go to different key groups")
            fix.append("set the same fixed PYTHONHASHSEED in the driver's environment and in "
                       "spark.executorEnv.PYTHONHASHSEED")
    if not why:
        return
    what, use = found[0]
    more = f" (and {len(found) - 1} more key function(s))" if len(found) > 1 else ""
    raise SaltedHashError(
        f"{what}: the key function calls {use}{more}; the hash of a str or bytes is salted per process, and "
        f"{'; and '.join(why)}. Key by the value itself (pyflowbuf hashes keys the same in every process: "
        f"key_by(lambda u: u) rather than key_by(lambda u: hash(u))), or {' and '.join(fix)}. A key function "
        "that hashes only ints (whose hash is not salted) can say so: key_by(pyflowbuf.stable_key(fn))")

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
