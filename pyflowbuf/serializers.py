"""Serializers: how records of a typed stream become bytes in segments.

The core (RecordWriter/RecordReader) encodes seven kinds in C, a batch per
call: ``bytes``, ``int64``, ``float64``, ``number``, ``str``, ``struct`` and
``pickle``.
Other kinds (Arrow RecordBatches, pandas DataFrames, NumPy arrays) are
Serializer objects that turn a batch of records into bytes-like objects for the
``bytes`` kind and back; the reader hands them zero-copy views when
``zero_copy_min`` is 0.

``struct`` carries the structured records Python code emits: None, bool, int
(any size), float, str, bytes, and tuples, lists and dicts of them, nested. A
record reads back as exactly the types it was written with, and decoding runs
no code the sender chose, so unlike ``pickle`` it crosses processes without
``allow_pickle``. It is inferred for tuples, lists and dicts that hold only
such values.

``number`` carries Python ints (any size) and floats with their exact types
(the struct codec's scalars): it is inferred when the first record is an int
or a float, so a stream whose first records are ints may later carry floats
(``0 if x == 0 else x / 2``) and every value comes back as it was emitted.
``int64`` and ``float64`` are the fixed-width fast paths, taken when declared,
for NumPy scalars, and for a collection known to hold only ints (only floats):
a float64 stream turns ints into floats and an int64 stream refuses floats,
chained or not.
"""
from __future__ import annotations

import reprlib
from typing import Any, Callable

import numpy as np

from pyflowbuf import errors
from pyflowbuf._core.serde import conform_batch, pack_struct, struct_fits
# the struct codec on its own, for struct records kept or sent outside a stream
from pyflowbuf._core.serde import pack_struct_batch, unpack_struct, unpack_struct_batch  # noqa: F401
# the Serializer interface and the registry live in kinds; importable from here as before
from pyflowbuf.kinds import (CORE_KINDS, CoreSerializer, Serializer, kind_names, register_serializer,  # noqa: F401
                             serializer_factory)


def get_serializer(kind: Any) -> Serializer:
    """A Serializer for ``kind``: a registered name or a Serializer instance."""
    if isinstance(kind, Serializer):
        return kind
    factory = serializer_factory(kind)
    if factory is None:
        _load_optional()
        factory = serializer_factory(kind)
    if factory is None:
        raise ValueError(f"unknown record kind {kind!r}; known: {kind_names()} or a Serializer instance")
    return factory()


def _load_optional() -> None:
    """Register the batch kinds (arrow, pandas, numpy): their module imports
    pyarrow and pandas, optional dependencies, so it is loaded on first need."""
    try:
        from pyflowbuf import serializers_arrow  # noqa: F401  (optional dependencies; registers on import)
    except ImportError:
        pass


def infer_kind(value: Any) -> str:
    """The kind a stream of ``value``-like records should use."""
    t = type(value)
    if t is int or t is float:
        # not int64/float64: the first record cannot tell whether later ones
        # are ints or floats, and number carries both exactly
        return "number"
    if t is tuple or t is list or t is dict:
        # one walk of the first record, in C; a record the struct kind cannot
        # carry exactly (a set, a custom class, a namedtuple) stays pickle
        return "struct" if struct_fits(value) else "pickle"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes"
    if isinstance(value, np.generic):
        # NumPy scalars: integers and floats travel as int64/float64 and come
        # back as Python int/float (chained too); the rest (np.bool_,
        # datetime64, timedelta64, longdouble...) as pickle, exactly
        if isinstance(value, np.integer) and not isinstance(value, np.timedelta64):
            return "int64" if -(1 << 63) <= int(value) < (1 << 63) else "pickle"
        if isinstance(value, np.floating) and value.dtype.itemsize <= 8:
            return "float64"
        return "pickle"
    if isinstance(value, bool):
        return "pickle"
    if isinstance(value, int):          # int subclasses (IntEnum): as int
        return "int64" if -(1 << 63) <= value < (1 << 63) else "pickle"
    if isinstance(value, float):
        return "float64"
    mod = t.__module__
    if mod.startswith("pyarrow"):
        return "arrow" if t.__name__ in ("RecordBatch", "Table") else "pickle"
    if mod.startswith("pandas"):
        # DataFrames and Series are batches; scalars (Timestamp, Timedelta,
        # Period, NaT...) are single values, carried exactly by pickle
        return "pandas" if t.__name__ in ("DataFrame", "Series") else "pickle"
    if t is np.ndarray:
        return "numpy"
    return "pickle"


# ---- checking records against a kind, where they are not serialized ----

def kind_label(kind: Any) -> str:
    """A kind as error messages name it."""
    if isinstance(kind, np.dtype):
        return f"rows of dtype {kind}"
    return repr(kind.name if isinstance(kind, Serializer) else kind)


def _batch_record_types(name: str):
    """The record types of the batch kinds serializers_arrow registers."""
    if name == "arrow":
        import pyarrow as pa  # optional dependency, present: the kind is registered
        return (pa.RecordBatch, pa.Table)
    if name == "pandas":
        import pandas as pd  # optional dependency, present: the kind is registered
        return (pd.DataFrame, pd.Series)
    if name == "numpy":
        return (np.ndarray, np.generic)
    return None


def _first_not_of(types):
    def find(records: list) -> int:
        for i, r in enumerate(records):
            if not isinstance(r, types):
                return i
        return -1
    return find


def misfit_finder(kind: Any) -> Callable[[list], int] | None:
    """``find(records)``: the index of the first record a stream of ``kind``
    cannot carry, -1 when all fit; None when every record fits (pickle). It
    accepts what the stream's writer accepts, so a record is refused the same
    way whether it is serialized or handed to the next chained operator; and
    for the core kinds it turns records that fit into what a reader returns
    (an int in a float64 stream becomes a float), so values agree too."""
    if isinstance(kind, np.dtype):
        return lambda records: next((i for i, a in enumerate(records) if np.asarray(a).dtype != kind), -1)
    ser = get_serializer(kind)
    if type(ser) is CoreSerializer:
        if ser.core_kind == "pickle":
            return None
        core = ser.core_kind
        return lambda records: conform_batch(records, core)
    if ser.name == "numpy":
        return _numpy_conform
    types = _batch_record_types(ser.name)
    return None if types is None else _first_not_of(types)


def _numpy_conform(records: list) -> int:
    """A numpy stream's check: NumPy scalars become the 0-d arrays its
    serializer sends them as, so a chained operator sees what a reader gives."""
    for i, r in enumerate(records):
        if type(r) is not np.ndarray:
            if isinstance(r, np.generic):
                records[i] = np.asarray(r)
            elif not isinstance(r, np.ndarray):
                return i
    return -1


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 120
_SHORT.maxlong = 60


def short_repr(value: Any) -> str:
    """``repr(value)``, bounded, for error messages."""
    try:
        return _SHORT.repr(value)
    except Exception as exc:  # a broken __repr__ must not hide the real error
        return f"<{type(value).__qualname__} object; repr() raised {type(exc).__name__}>"


def misfit_reason(kind: Any, value: Any) -> str:
    """Why a value does not fit a kind, when there is more to say than its type."""
    if isinstance(kind, Serializer) and kind.core_kind == "struct":
        try:
            pack_struct(value)
        except (TypeError, ValueError) as exc:
            return str(exc)
    return ""


def record_type_error(kind: Any, value: Any, *, operator: str | None = None, origin: str = "",
                      reason: str = "") -> errors.RecordTypeError:
    """The error for a record that does not fit its stream's kind."""
    t = type(value)
    tname = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    who = f"operator {operator!r} emitted" if operator else "a record"
    verb = "into" if operator else "does not fit"
    reason = reason or misfit_reason(kind, value)
    hint = "" if "kind=" in reason else (
        ". Every record of a stream has the stream's kind: convert the value, or declare the operator's "
        "kind= (e.g. 'float64' for numbers, 'struct' for tuples/lists/dicts of plain values, 'pickle' "
        "for any object)")
    return errors.RecordTypeError(
        f"{who} {short_repr(value)} ({tname}) {verb} a stream of kind {kind_label(kind)}"
        f"{f' ({origin})' if origin else ''}{f': {reason}' if reason else ''}{hint}")
