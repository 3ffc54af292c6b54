"""Operators work on batches: a list of records in, a list of records out.

Batching is what keeps the Python layer thin: a chain of operators runs a list
comprehension per operator per batch, and the batch crosses into the C core in
one call on each side of an exchange.

Every operator that makes records checks its output batch against its output
stream's kind (declared, or inferred from its first record), whether the next
step is a chained operator or a RecordWriter: a record that does not fit fails
the same way with chaining on or off, naming the operator and the value.

On a stream that carries timestamps the task calls ``process_ts(batch, ts)``
instead, ``ts`` the batch's times (an array('d'), one per record): it returns
the output and its times. One output per input keeps the times as they are
(no work per record); a filter, a flat_map or a process function derive
them in one C loop (``ts_select``, ``ts_repeat``): each output record gets the
time of the input it came from.

This module holds the operators that keep no state: map, filter, flat_map,
map_batches, the head of a side output's chain (``Forward``), union and the
two-input ``CoMap``. The contract they follow is ``contracts.py``; the keyed
reduce is ``keyed.py``; the process operators, which keep timers, are
``pyflowbuf/time/process.py`` (see this package's README).
"""
from __future__ import annotations

from itertools import compress
from typing import Callable

from pyflowbuf._core.serde import ts_repeat, ts_select
from pyflowbuf.operators.contracts import Operator


class Map(Operator):
    def __init__(self, name, fn: Callable):
        super().__init__(name)
        self.fn = fn

    def process_batch(self, batch):
        fn = self.fn
        return self._checked([fn(x) for x in batch])

    def process_ts(self, batch, ts):
        fn = self.fn
        return self._checked([fn(x) for x in batch]), ts


class Filter(Operator):
    def __init__(self, name, fn):
        super().__init__(name)
        self.fn = fn

    def process_batch(self, batch):
        fn = self.fn
        return [x for x in batch if fn(x)]

    def process_ts(self, batch, ts):
        if ts is None:
            return self.process_batch(batch), None
        fn = self.fn
        keep = [fn(x) for x in batch]
        return list(compress(batch, keep)), ts_select(ts, keep)


class FlatMap(Operator):
    def __init__(self, name, fn):
        super().__init__(name)
        self.fn = fn

    def process_batch(self, batch):
        fn, add = self.fn, self._extend
        out: list = []
        for x in batch:
            res = fn(x)
            if res is None:         # process() may return None; flat_map returns an iterable
                raise self._not_records(res)
            add(out, res)
        return self._checked(out)

    def process_ts(self, batch, ts):
        if ts is None:
            return self.process_batch(batch), None
        fn, add = self.fn, self._extend
        out: list = []
        counts: list = []
        for x in batch:
            res = fn(x)
            if res is None:
                raise self._not_records(res)
            n = len(out)
            add(out, res)
            counts.append(len(out) - n)
        return self._checked(out), ts_repeat(ts, counts)


class MapBatch(Operator):
    """Calls ``fn`` once per whole batch (a NumPy array chunk of a rows stream,
    or each Arrow/pandas record of a batch stream)."""

    def __init__(self, name, fn, per_record: bool):
        super().__init__(name)
        self.fn = fn
        self.per_record = per_record

    def process_batch(self, batch):
        # A rows stream's batch is a list of array chunks, an arrow/pandas
        # stream's a list of RecordBatches/DataFrames: fn sees each one.
        fn = self.fn
        return self._checked([fn(b) for b in batch])

    def process_ts(self, batch, ts):
        return self.process_batch(batch), ts      # one output per record (a chunk, a batch)


# ---- operators with several inputs: the head of their task, fed by input index ----

class Forward(Operator):
    """The records as they came: the head of the chain that reads a side
    output (the writer that sent them checked them against its kind), with
    their times where the side output carries them."""

    def process_batch(self, batch):
        return batch

    def process_ts(self, batch, ts):
        return batch, ts


class Union(Operator):
    """The records of every input, in the order they arrive. Still an
    operator: records of an input whose kind was inferred are checked here
    against the union's kind, as any operator's output is."""

    def process_batch(self, batch):
        return self._checked(batch)

    def process_ts(self, batch, ts):
        return self._checked(batch), ts

    def process_input_ts(self, batch, ts, input_index):
        return self._checked(batch), ts


class _TwoInput(Operator):
    """``fns[i]`` handles the records of input ``i``."""

    def __init__(self, name, fn1: Callable, fn2: Callable):
        super().__init__(name)
        self.fns = (fn1, fn2)

    def process_batch(self, batch):
        raise TypeError(f"operator {self.name!r} has two inputs: it takes batches with their input index")


class CoMap(_TwoInput):
    def process_input(self, batch, input_index):
        fn = self.fns[input_index]
        return self._checked([fn(x) for x in batch])

    def process_input_ts(self, batch, ts, input_index):
        return self.process_input(batch, input_index), ts


