"""Joins on event time: ``a.join(b)`` (windowed) and ``a.interval_join(b)``.

The streams they make come from the streams they join (``Stream._derive``):
this module never imports ``stream.py``, which imports it."""
from __future__ import annotations

import math
from typing import Any


from pyflowbuf import errors
from pyflowbuf._validation import _callable, _check_kind, _parallelism, note_key_function
from pyflowbuf.api.windowed import _stream_timestamps
from pyflowbuf.windows.assigners import WindowAssigner
from pyflowbuf.windows.joins import IntervalJoinOperator, WindowJoinOperator


class JoinedStreams:
    """``a.join(b).where(key_a).equal_to(key_b).window(assigner).apply(fn)``.

    Both streams need timestamps; each pair of records with equal keys in
    one window gives one output.

    Example::

        pairs = (orders.join(payments)
                       .where(lambda o: o["id"]).equal_to(lambda p: p["order"])
                       .window(fb.Tumbling(60))
                       .apply(lambda o, p: (o["id"], p["amount"])))
    """

    def __init__(self, first, second):
        self.first, self.second = first, second
        self.key_a = self.key_b = None
        self.assigner = None

    def where(self, key_fn):
        """The key of the first stream's records. Returns this ``JoinedStreams``;
        a ``key_fn`` that is not callable is a ``TypeError``.

        Example::

            orders.join(payments).where(lambda o: o["id"])
        """
        _callable(key_fn, "where")
        note_key_function(self.first.env._salted_key_functions, key_fn, f"join where() on {self.first.node.name!r}")
        self.key_a = key_fn
        return self

    def equal_to(self, key_fn):
        """The key of the second stream's records, compared with ``where``'s.
        Returns this ``JoinedStreams``. Called before ``where`` it is a
        ``ConfigurationError``; a ``key_fn`` that is not callable a
        ``TypeError``.

        Example::

            orders.join(payments).where(lambda o: o["id"]).equal_to(lambda p: p["order"])
        """
        _callable(key_fn, "equal_to")
        if self.key_a is None:
            raise errors.ConfigurationError("join: call where(key_a) before equal_to(key_b)")
        note_key_function(self.second.env._salted_key_functions, key_fn, f"join equal_to() on {self.second.node.name!r}")
        self.key_b = key_fn
        return self

    def window(self, assigner):
        """The windows both streams are cut into: ``Tumbling`` or ``Sliding`` (a
        ``Session`` or anything else is a ``ConfigurationError``, as is a call
        before ``where(...).equal_to(...)``). Returns this ``JoinedStreams``.

        Example::

            joined.window(fb.Tumbling(60))
        """
        if self.key_b is None:
            raise errors.ConfigurationError("join: call where(key_a).equal_to(key_b) before window()")
        if not isinstance(assigner, WindowAssigner) or assigner.merging:
            raise errors.ConfigurationError(
                f"a window join takes Tumbling or Sliding windows, got {assigner!r}")
        self.assigner = assigner
        return self

    def apply(self, fn, *, parallelism=None, name: str = "window_join", kind: Any = None) -> "Stream":
        """``fn(left, right) -> record`` for every pair of one key in one window.

        Returns a ``Stream``. Called before ``window`` it is a
        ``ConfigurationError``; a ``fn`` that is not callable a ``TypeError``.

        Example::

            pairs = joined.window(fb.Tumbling(60)).apply(lambda o, p: (o["id"], p["amount"]))
        """
        _callable(fn, "apply")
        if self.assigner is None:
            raise errors.ConfigurationError("join: call window(...) before apply()")
        ts = (_stream_timestamps(self.first, "join"), _stream_timestamps(self.second, "join"))
        a, b = self.first.key_by(self.key_a), self.second.key_by(self.key_b)
        keys, assigner = (self.key_a, self.key_b), self.assigner
        return _two_input(a, b, name, lambda: WindowJoinOperator(name, assigner, keys, ts, fn),
                          parallelism, kind)


class IntervalJoin:
    """``a.key_by(ka).interval_join(b.key_by(kb)).between(lower, upper).process(fn)``.

    Both streams need timestamps. A record of either side is kept only as
    long as a record of the other side could still match it (the watermark
    decides); a record below the watermark is late: dropped and counted.

    Example::

        matched = (clicks.key_by(lambda c: c["ad"])
                         .interval_join(views.key_by(lambda v: v["ad"]))
                         .between(-5.0, 0.0)
                         .process(lambda click, view: [(click["ad"], click["ts"] - view["ts"])]))
    """

    def __init__(self, first, second):
        if not getattr(first, "_keyed", False) or not getattr(second, "_keyed", False):
            raise errors.ConfigurationError("interval_join joins two keyed streams: key_by both first")
        if first.env is not second.env:
            raise errors.ConfigurationError("interval_join: the streams belong to different Environments")
        self.first, self.second = first, second
        self.bounds = None

    def between(self, lower, upper):
        """Right records with time in [t + lower, t + upper] meet a left record at t.

        ``lower`` and ``upper`` are finite seconds, either sign, ``lower <=
        upper`` (else ``ConfigurationError``). Returns this ``IntervalJoin``.

        Example::

            a.interval_join(b).between(-5.0, 0.0)      # b's records from 5 s before a's up to a's
        """
        for n, v in (("lower", lower), ("upper", upper)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise errors.ConfigurationError(f"interval_join: {n} must be finite seconds, got {v!r}")
        if lower > upper:
            raise errors.ConfigurationError(f"interval_join: lower ({lower}) must be <= upper ({upper})")
        self.bounds = (float(lower), float(upper))
        return self

    def process(self, fn, *, parallelism=None, name: str = "interval_join", kind: Any = None) -> "Stream":
        """``fn(left, right) -> iterable of outputs (or None)`` per matching pair.

        Returns a ``Stream``. Called before ``between`` it is a
        ``ConfigurationError``; a ``fn`` that is not callable a ``TypeError``.

        Example::

            a.interval_join(b).between(0.0, 1.0).process(lambda l, r: [(l["id"], r["id"])])
        """
        _callable(fn, "process")
        if self.bounds is None:
            raise errors.ConfigurationError("interval_join: call between(lower, upper) before process()")
        ts = (_stream_timestamps(self.first, "interval_join"), _stream_timestamps(self.second, "interval_join"))
        keys = (self.first._key_fn, self.second._key_fn)
        lo, hi = self.bounds
        return _two_input(self.first, self.second, name,
                          lambda: IntervalJoinOperator(name, keys, ts, lo, hi, fn), parallelism, kind)


def _two_input(a, b, name, make, parallelism, kind):
    kind = _check_kind(kind, f"{name!r}")
    env = a.env
    p = _parallelism(env.parallelism, parallelism)
    node = env._add(name=name, parallelism=p, make_operator=make,
                    inputs=[a._input_to(p), b._input_to(p)], kind=kind)
    node.event_time = True
    return a._derive(node)
