"""Operators work on batches: a list of records in, a list of records out.

Batching is what keeps the Python layer thin: a chain of operators runs a list
comprehension per operator per batch, and the batch crosses into the C core in
one call on each side of an exchange.

Every operator that makes records checks its output batch against its output
stream's kind (declared, or inferred from its first record), whether the next
step is a chained operator or a RecordWriter: a record that does not fit fails
the same way with chaining on or off, naming the operator and the value.
"""
from __future__ import annotations

import os

from typing import Any, Callable

import numpy as np

from pyflowbuf import errors
from pyflowbuf.serializers import get_serializer, infer_kind, misfit_finder, record_type_error, short_repr

_ANY = object()       # a kind every record fits (pickle): nothing to check
_NOT_RECORDS = (str, bytes, bytearray, memoryview)  # iterable, but never an iterable of records


class Operator:
    """One step of a chain. ``name`` shows in metrics and errors.

    out_kind
        The declared kind of the output stream (a kind name, Serializer or
        NumPy dtype); None: the kind of the first record emitted. The job
        sets it from the graph.
    check_output
        False where a RecordWriter takes the output straight away (the task
        sets it for the last operator of a chain with outputs): the writer
        checks every record as it serializes it, so checking here too would
        be paid twice.
    """

    kind = "operator"
    out_kind: Any = None
    check_output = True
    _find_misfit: Any = None

    def __init__(self, name: str):
        self.name = name

    def open(self, subtask: int, parallelism: int) -> None:
        self.subtask = subtask
        self.parallelism = parallelism

    def process_batch(self, batch: list) -> list:
        raise NotImplementedError

    def process_input(self, batch: list, input_index: int) -> list:
        """A batch read from input ``input_index`` of a task with several
        inputs (union, connect); only the operator heading such a task gets
        these. One-input operators do not care where a batch came from."""
        return self.process_batch(batch)

    def finish(self) -> list:
        """Records to emit at end of input."""
        return []

    def snapshot_state(self) -> Any:
        """Operator state for a checkpoint (None when stateless): a copy, since
        the task goes on processing while it is written out."""
        return None

    def restore_state(self, state: Any) -> None:
        """Called before ``open`` when the job restores from a checkpoint."""

    def prepare_commit(self, checkpoint_id: int) -> list:
        """Sinks: close the transaction that checkpoint ``checkpoint_id`` covers
        and return the idempotent actions that commit it (and any earlier ones
        not known to be committed). -1 is the end of input."""
        return []

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` is complete: its actions were carried out."""

    # ---- the one kind check ----
    def _checked(self, out: list) -> list:
        """``out``, once every record in it fits the output stream's kind."""
        find = self._find_misfit
        if find is None:
            if not out:
                return out
            find = self._init_check(out[0])
        if find is _ANY:
            return out
        i = find(out)
        if i >= 0:
            raise record_type_error(self._kind, out[i], operator=self.name, origin=self._kind_origin)
        return out

    def _init_check(self, first):
        if not self.check_output:
            self._find_misfit = _ANY
            return _ANY
        if self.out_kind is not None:
            kind = self.out_kind
            self._kind_origin = "declared"
        else:
            kind = infer_kind(first)
            self._kind_origin = f"inferred from its first record, {short_repr(first)}"
        self._kind = kind if isinstance(kind, np.dtype) else get_serializer(kind)
        self._find_misfit = misfit_finder(self._kind) or _ANY
        return self._find_misfit

    def _extend(self, out: list, res) -> None:
        """Add what a process function returned (an iterable of records, or None) to ``out``."""
        if res is None:
            return
        if isinstance(res, _NOT_RECORDS):
            raise self._not_records(res)
        try:
            out.extend(res)
        except TypeError:
            if hasattr(res, "__iter__"):
                raise  # the iteration itself failed, inside the user's iterable
            raise self._not_records(res) from None

    def _not_records(self, value) -> errors.RecordTypeError:
        t = type(value).__name__
        why = f"; a {t} would be split into its items" if isinstance(value, _NOT_RECORDS) else ""
        return errors.RecordTypeError(
            f"operator {self.name!r}: its function returned {short_repr(value)} ({t}) where an "
            f"iterable of records belongs{why}. Return a list of records (e.g. [value]), or use map() "
            "for one record per input")


class Map(Operator):
    def __init__(self, name, fn: Callable):
        super().__init__(name)
        self.fn = fn

    def process_batch(self, batch):
        fn = self.fn
        return self._checked([fn(x) for x in batch])


class Filter(Operator):
    def __init__(self, name, fn):
        super().__init__(name)
        self.fn = fn

    def process_batch(self, batch):
        fn = self.fn
        return [x for x in batch if fn(x)]


class FlatMap(Operator):
    def __init__(self, name, fn):
        super().__init__(name)
        self.fn = fn

    def process_batch(self, batch):
        fn = self.fn
        out: list = []
        extend = out.extend
        for x in batch:
            res = fn(x)
            if isinstance(res, _NOT_RECORDS):
                raise self._not_records(res)
            try:
                extend(res)
            except TypeError:
                if hasattr(res, "__iter__"):
                    raise  # the iteration itself failed, inside the user's iterable
                raise self._not_records(res) from None
        return self._checked(out)


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


class _Keyed(Operator):
    """Keyed operators: ``fn`` applied with per-key state held in the task."""

    def __init__(self, name, key_fn, fn):
        super().__init__(name)
        self.key_fn = key_fn
        self.fn = fn
        self.state: dict = {}


class KeyedReduce(_Keyed):
    """Rolling reduce per key; emits the updated aggregate for every input."""

    def process_batch(self, batch):
        key_fn, fn, state = self.key_fn, self.fn, self.state
        out = []
        for x in batch:
            k = key_fn(x)
            if k in state:
                x = fn(state[k], x)
            state[k] = x
            out.append(x)
        return self._checked(out)

    def snapshot_state(self):
        return dict(self.state)

    def restore_state(self, state):
        self.state = dict(state or {})


class KeyedProcess(_Keyed):
    """``fn(key, value, state) -> iterable`` with ``state`` a per-key dict that
    lives in the task (and goes into checkpoints)."""

    def process_batch(self, batch):
        key_fn, fn, state = self.key_fn, self.fn, self.state
        out = []
        for x in batch:
            k = key_fn(x)
            st = state.get(k)
            if st is None:
                st = state[k] = {}
            res = fn(k, x, st)
            if res is not None:
                if isinstance(res, _NOT_RECORDS):
                    raise self._not_records(res)
                try:
                    out.extend(res)
                except TypeError:
                    if hasattr(res, "__iter__"):
                        raise
                    raise self._not_records(res) from None
        return self._checked(out)

    def snapshot_state(self):
        return {k: dict(v) for k, v in self.state.items()}

    def restore_state(self, state):
        self.state = {k: dict(v) for k, v in (state or {}).items()}


# ---- operators with several inputs: the head of their task, fed by input index ----

class Union(Operator):
    """The records of every input, in the order they arrive. Still an
    operator: records of an input whose kind was inferred are checked here
    against the union's kind, as any operator's output is."""

    def process_batch(self, batch):
        return self._checked(batch)


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


class CoProcess(_TwoInput):
    """``fn_i(record, state) -> iterable`` with one ``state`` dict per
    subtask, shared by both inputs (and going into checkpoints)."""

    def __init__(self, name, fn1, fn2):
        super().__init__(name, fn1, fn2)
        self.state: dict = {}

    def process_input(self, batch, input_index):
        fn, state = self.fns[input_index], self.state
        out: list = []
        for x in batch:
            self._extend(out, fn(x, state))
        return self._checked(out)

    def snapshot_state(self):
        return dict(self.state)

    def restore_state(self, state):
        self.state = dict(state or {})


class KeyedCoProcess(_TwoInput):
    """``fn_i(key, record, state) -> iterable`` where ``key = key_fn_i(record)``
    and ``state`` is the per-key dict both inputs share: both inputs are hash
    partitioned with the same stable hash, so equal keys meet in one subtask."""

    def __init__(self, name, key_fn1, key_fn2, fn1, fn2):
        super().__init__(name, fn1, fn2)
        self.key_fns = (key_fn1, key_fn2)
        self.state: dict = {}

    def process_input(self, batch, input_index):
        key_fn, fn, state = self.key_fns[input_index], self.fns[input_index], self.state
        out: list = []
        for x in batch:
            k = key_fn(x)
            st = state.get(k)
            if st is None:
                st = state[k] = {}
            self._extend(out, fn(k, x, st))
        return self._checked(out)

    def snapshot_state(self):
        return {k: dict(v) for k, v in self.state.items()}

    def restore_state(self, state):
        self.state = {k: dict(v) for k, v in (state or {}).items()}


# ---- sinks: the last operator of a chain; they return nothing downstream ----

class CollectSink(Operator):
    kind = "sink"

    def __init__(self, name, target: list):
        super().__init__(name)
        self.target = target

    _keep = 0

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        # After a restore, the records the checkpoint covers stay and the rest
        # (emitted by the failed attempt after it) go: they will come again.
        self.out = self.target.setdefault(subtask, [])
        del self.out[self._keep:]

    def snapshot_state(self):
        return {"records": len(self.out)}

    def restore_state(self, state):
        self._keep = state["records"] if state else 0

    def process_batch(self, batch):
        if batch and type(batch[0]) in _PLAIN:
            self.out.extend(batch)
        else:
            # Records read zero-copy (memoryviews of large bytes records, NumPy
            # views of rows) hold their segment: keeping them would pin the
            # producer's pool until it runs dry, so the result keeps copies.
            self.out.extend(map(_detach, batch))
        return []


_PLAIN = (int, float, str)


def _detach(x):
    t = type(x)
    if t is memoryview:
        return x.tobytes()
    if t is np.ndarray and x.base is not None:
        return x.copy()
    if t.__module__.startswith("pyarrow") and hasattr(x, "schema"):
        return _copy_arrow(x)
    return x


def _copy_arrow(x):
    """A RecordBatch/Table whose buffers are the Arrow library's own (one copy)."""
    import pyarrow as pa

    out = pa.BufferOutputStream()
    with pa.ipc.new_stream(out, x.schema) as w:
        w.write(x)
    reader = pa.ipc.open_stream(out.getvalue())
    return reader.read_next_batch() if isinstance(x, pa.RecordBatch) else reader.read_all()


class FunctionSink(Operator):
    kind = "sink"

    def __init__(self, name, fn, batched: bool):
        super().__init__(name)
        self.fn = fn
        self.batched = batched

    def process_batch(self, batch):
        if self.batched:
            self.fn(batch)
        else:
            fn = self.fn
            for x in batch:
                fn(x)
        return []


class TextFileSink(Operator):
    """``write_text``. Without checkpoints: one file (``path``, or ``path.i``
    for subtask i of p > 1). With checkpoints: ``path`` is a directory of part
    files ``part-<subtask>-<seq>``, each written under a hidden name and
    renamed into place only when a checkpoint covering it completes (or the
    job ends): Flink's two-phase commit, so readers never see records a
    recovery will write again."""

    kind = "sink"

    def __init__(self, name, path, encoding="utf-8", transactional=False):
        super().__init__(name)
        self.path = path
        self.encoding = encoding
        self.transactional = transactional
        self.fh = None
        self.seq = 0
        self.uncommitted: list = []     # (checkpoint id, action) until a checkpoint covering it completes

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        if not self.transactional:
            path = str(self.path) if parallelism == 1 else f"{self.path}.{subtask}"
            self.fh = open(path, "w", encoding=self.encoding)
            return
        self.dir = os.fspath(self.path)
        os.makedirs(self.dir, exist_ok=True)
        # what an earlier attempt left uncommitted will be written again
        prefix = f".part-{subtask:05d}-"
        for name in os.listdir(self.dir):
            if name.startswith(prefix):
                os.remove(os.path.join(self.dir, name))

    def _part(self, hidden: bool) -> str:
        name = f"part-{self.subtask:05d}-{self.seq:06d}"
        return os.path.join(self.dir, f".{name}.inprogress" if hidden else name)

    def process_batch(self, batch):
        if self.fh is None:
            self.fh = open(self._part(True), "w", encoding=self.encoding)
        self.fh.write("".join(f"{x}\n" for x in batch))
        return []

    def _close_part(self, checkpoint_id):
        if self.fh is None:
            return
        self.fh.close()
        self.fh = None
        self.uncommitted.append((checkpoint_id, ("rename", self._part(True), self._part(False))))
        self.seq += 1

    def prepare_commit(self, checkpoint_id):
        if not self.transactional:
            return []
        self._close_part(checkpoint_id)
        return [action for _, action in self.uncommitted]

    def notify_checkpoint_complete(self, checkpoint_id):
        self.uncommitted = [(n, a) for n, a in self.uncommitted if not 0 <= n <= checkpoint_id]

    def snapshot_state(self):
        return {"seq": self.seq} if self.transactional else None

    def restore_state(self, state):
        if self.transactional and state:
            self.seq = state["seq"]

    def finish(self):
        if not self.transactional and self.fh is not None:
            self.fh.close()
            self.fh = None
        return []
