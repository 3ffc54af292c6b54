"""Key kinds: the kinds of the keys a keyed operator's state is held under,
recorded in every checkpoint and checked against the keys the operator
computes after a restore.

A key's state is found again only by a key equal to it: a job restored with
``key_by(lambda x: str(x % 10))`` over state kept under ``x % 10`` finds
none of it, and every key starts from zero, without an error. So each
checkpoint records, per keyed operator, the set of kinds of the keys in its
state (``kinds_of``), and a restored operator checks the first keys its key
function computes (``arm``): a key of a kind the state does not hold fails
the job with ``KeyKindError`` before its record is processed, unless the job
declares how old keys become new ones (``Stream.migrate_keys``).

A kind is what decides whether two keys can be equal: every number is one
kind (``3``, ``3.0``, ``np.int64(3)`` and ``True`` are keys equal to their
value, and hash to the same key group), ``str`` (and ``np.str_``),
``bytes``, ``None``, a tuple the kinds of its items (one level deep:
``tuple(number, str)``), anything else its class. ``None`` (and a tuple of
``None`` items) says nothing of the key function: such a key is let through
and the next one checked, so keys of several kinds (``None`` for a missing
value) are not refused.
"""
from __future__ import annotations

import numbers
from itertools import repeat
from operator import itemgetter

import numpy as np

from pyflowbuf.checkpoint.errors import KeyKindError

# keys checked after a restore while each is of no telling kind (None)
CHECKED_KEYS = 10_000

_KIND_OF_TYPE: dict = {}


def _type_kind(t) -> str:
    kind = _KIND_OF_TYPE.get(t)
    if kind is None:
        if t is type(None):
            kind = "None"
        elif issubclass(t, (numbers.Number, np.number, np.bool_)) and not issubclass(t, (complex, np.complexfloating)):
            kind = "number"
        elif issubclass(t, str):
            kind = "str"
        elif issubclass(t, (bytes, bytearray)):
            kind = "bytes"
        elif issubclass(t, tuple):
            kind = "tuple"
        else:
            kind = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
        _KIND_OF_TYPE[t] = kind
    return kind


def _tuple_kind(types) -> str:
    return "tuple(" + ", ".join(map(_type_kind, types)) + ")"


def kind_of(key) -> str:
    """The kind of one key."""
    if type(key) is tuple:
        return _tuple_kind(map(type, key))
    return _type_kind(type(key))


def kinds_of(keys) -> set:
    """The kinds of ``keys`` (a list): one C pass over their types, and one
    more over the tuples among them."""
    out = set()
    types = set(map(type, keys))
    for t in types:
        if t is tuple:
            out.update(_tuple_kinds(keys if len(types) == 1 else [k for k in keys if type(k) is tuple]))
        else:
            out.add(_type_kind(t))
    return out


def _tuple_kinds(tuples) -> set:
    # the common case in C loops: tuples of one length whose every item is of one type per place
    lengths = set(map(len, tuples))
    if len(lengths) == 1:
        columns = [set(map(type, map(itemgetter(j), tuples))) for j in range(next(iter(lengths)))]
        if all(len(c) == 1 for c in columns):
            return {_tuple_kind([next(iter(c)) for c in columns])}
    return {_tuple_kind(ts) for ts in set(map(tuple, map(map, repeat(type), tuples)))}


def _items(kind: str):
    return kind[len("tuple("):-1].split(", ") if kind.startswith("tuple(") else None


def _telling(kind: str) -> bool:
    """Whether a key of this kind says what the key function returns (None does not)."""
    if kind == "None":
        return False
    items = _items(kind)
    return items is None or any(i != "None" for i in items)


def compatible(kind: str, recorded) -> bool:
    """Whether a key of ``kind`` can be a key of state recorded with the kinds
    ``recorded`` (a tuple's ``None`` items match any item)."""
    if kind in recorded:
        return True
    items = _items(kind)
    if items is None:
        return False
    for r in recorded:
        ri = _items(r)
        if ri is not None and len(ri) == len(items) and all(
                a == b or a == "None" or b == "None" for a, b in zip(items, ri)):
            return True
    return False


class _FirstKeys:
    """Stands in for a restored operator's key function until a key of a
    telling kind was checked; then puts the function back."""

    __slots__ = ("fn", "recorded", "left", "undo", "where", "operator", "uid")

    def __init__(self, fn, recorded, undo, where, operator, uid):
        self.fn = fn
        self.recorded = recorded
        self.left = CHECKED_KEYS
        self.undo = undo
        self.where = where
        self.operator = operator
        self.uid = uid

    def __call__(self, record):
        k = self.fn(record)
        if self.left:
            self._check(k)
        return k

    def _check(self, key):
        kind = kind_of(key)
        if not _telling(kind):
            self.left -= 1
            if not self.left:
                self.undo(self.fn)
            return
        if not compatible(kind, self.recorded):
            shown = repr(key)
            if len(shown) > 60:
                shown = shown[:57] + "..."
            raise KeyKindError(
                f"{self.where}: operator {self.operator!r} (uid {self.uid!r}) holds its state under keys of "
                f"kind {', '.join(sorted(self.recorded))}, and its key function now returns keys of kind "
                f"{kind} (first: {shown}): the old state would never be found again, and every key would "
                "start from nothing. Key by the same kind as the job that wrote the checkpoint, or declare "
                f"how an old key becomes a new one on this operator: .migrate_keys(fn) (e.g. "
                f".uid({self.uid!r}).migrate_keys(str))", operator=self.operator, recorded=self.recorded,
                found=kind)
        self.left = 0
        self.undo(self.fn)


def arm(op, recorded, where: str, uid: str) -> None:
    """Check the first keys restored operator ``op`` computes against the
    kinds ``recorded`` in its checkpointed state. After the check, ``op``
    calls its own key function again: nothing is left on the record path."""
    recorded = frozenset(recorded)

    def wrap(fn, undo):
        return _FirstKeys(fn, recorded, undo, where, op.name, uid)

    inputs = getattr(op, "inputs", None)
    if isinstance(inputs, tuple) and inputs and all(isinstance(i, tuple) and len(i) == 3 for i in inputs):
        # a keyed connect with timers: (key_fn, ts_fn, fn) per input, copied into key_fn per batch
        for n in range(len(inputs)):
            def undo(fn, n=n):
                ins = list(op.inputs)
                ins[n] = (fn,) + tuple(ins[n][1:])
                op.inputs = tuple(ins)
                if op.key_fn is not fn and isinstance(op.key_fn, _FirstKeys) and op.key_fn.fn is fn:
                    op.key_fn = fn
            ins = list(op.inputs)
            ins[n] = (wrap(ins[n][0], undo),) + tuple(ins[n][1:])
            op.inputs = tuple(ins)
        return
    fns = op.key_fns
    if isinstance(fns, tuple):
        for n in range(len(fns)):
            def undo(fn, n=n):
                f = list(op.key_fns)
                f[n] = fn
                op.key_fns = tuple(f)
            f = list(op.key_fns)
            f[n] = wrap(f[n], undo)
            op.key_fns = tuple(f)
        return
    if op.key_fn is not None:
        def undo(fn):
            op.key_fn = fn
        op.key_fn = wrap(op.key_fn, undo)
