"""A keyed map stored by columns: the checkpoint codec packs a tuple through
a Python hook (an extension type), which makes a map of 100 000 ``(key,
count)`` tuples cost ~90 ms to encode under the GIL. Stored as columns
(the keys, then each tuple field), every field of exact ints (within 64
bits) or exact floats becomes one NumPy array, encoded as one buffer; other
columns stay lists, encoded by the codec's rules as before. Exact types only
(a bool is not an int here), so a map comes back exactly as it was.

``{"keys": column, "values": column}`` or, when every value is a tuple of
the same length n > 0, ``{"keys": column, "fields": [column] * n}``.
"""
from __future__ import annotations

from operator import itemgetter

import numpy as np

from pyflowbuf.checkpoint.errors import _Corrupt


def _column(xs: list):
    if not xs:
        return xs
    types = set(map(type, xs))
    if len(types) == 1:
        t = types.pop()
        if t is int:
            try:
                return np.array(xs, dtype=np.int64)
            except OverflowError:
                return xs
        if t is float:
            return np.array(xs, dtype=np.float64)
    return xs


def encode_map(d: dict) -> dict:
    """``d`` as columns (see the module docstring)."""
    keys = _column(list(d))
    values = list(d.values())
    if values and set(map(type, values)) == {tuple}:
        lengths = set(map(len, values))
        n = lengths.pop() if len(lengths) == 1 else 0
        if n > 0:
            # (zip(*values) would pass every tuple as an argument: much slower)
            return {"keys": keys, "fields": [_column(list(map(itemgetter(j), values))) for j in range(n)]}
    return {"keys": keys, "values": _column(values)}


def _as_list(c) -> list:
    if isinstance(c, np.ndarray):
        if c.ndim != 1 or c.dtype.kind not in "if":
            raise _Corrupt(f"a map column is a {c.dtype} array of shape {c.shape}")
        return c.tolist()
    if type(c) is not list:
        raise _Corrupt(f"a map column is a {type(c).__name__}")
    return c


def decode_map(m) -> dict:
    """``encode_map`` undone."""
    if type(m) is not dict or "keys" not in m:
        raise _Corrupt("a stored map has no keys column")
    keys = _as_list(m["keys"])
    if "fields" in m:
        fields = [_as_list(c) for c in m["fields"]]
        if not fields or any(len(f) != len(keys) for f in fields):
            raise _Corrupt("the columns of a stored map differ in length")
        values = list(zip(*fields))
    else:
        values = _as_list(m["values"])
        if len(values) != len(keys):
            raise _Corrupt("the columns of a stored map differ in length")
    return dict(zip(keys, values))


def _take(c, rows, rows_list) -> list:
    if isinstance(c, np.ndarray):
        _as_list(c[:0])             # (its dtype and shape checked)
        return c[rows].tolist()
    c = _as_list(c)
    if len(rows_list) == 1:
        return [c[rows_list[0]]]
    return list(itemgetter(*rows_list)(c))


def decode_rows(m, rows) -> dict:
    """The entries at positions ``rows`` (ascending, an int64 array) of a map
    stored by columns, without decoding the others (a restore at another
    parallelism takes a subtask's key groups out of an old subtask's map)."""
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows):
        return {}
    if type(m) is not dict or "keys" not in m:
        raise _Corrupt("a stored map has no keys column")
    cols = m["fields"] if "fields" in m else [m.get("values")]
    if type(cols) is not list or not cols or any(len(c) != len(m["keys"]) for c in cols):
        raise _Corrupt("the columns of a stored map differ in length")
    if rows[-1] >= len(m["keys"]):
        raise _Corrupt("a stored map has fewer entries than its key groups")
    # (a NumPy column takes the array of positions, a list column a list of them)
    rows_list = rows.tolist() if any(not isinstance(c, np.ndarray) for c in [m["keys"], *cols]) else None
    keys = _take(m["keys"], rows, rows_list)
    fields = [_take(c, rows, rows_list) for c in cols]
    return dict(zip(keys, zip(*fields) if "fields" in m else fields[0]))
