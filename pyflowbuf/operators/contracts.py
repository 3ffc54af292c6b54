"""The operator contract: what the runtime asks of every operator
(``Operator``) and what an operator is given to reach its task (``Output``).

``Operator`` is the base every operator derives from. Its optional parts
(``timestamped``, ``passes_records``, ``on_watermark``, ``metrics``, the
keyed-state and sink hooks, the identity its task gives it) are declared
here with the value that means "not used", so the runtime reads them as
attributes and never probes for them. It also holds the one check of an
operator's output against its stream's kind (``_checked``) and the rule
for what a process function may return (``_extend``).

``Operator`` is an abstract base: ``process_batch`` is the one method every
operator must define (an operator with two inputs defines it to refuse a
batch without its input index). ``Output`` is a ``typing.Protocol``: the
task's chain (``runtime.task.chain.ChainOutput``) and
``pyflowbuf.testing.OperatorHarness`` derive from it, and any object with
its five methods is one (``isinstance(x, Output)``).

The contracts of what a job reads and writes at its ends (``SourceOperator``,
``SinkOperator``) are in ``pyflowbuf/connectors/contracts.py``.
"""
from __future__ import annotations

import abc
import types
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from pyflowbuf import errors
from pyflowbuf.serializers import get_serializer, infer_kind, misfit_finder, record_type_error, short_repr


_ANY = object()       # a kind every record fits (pickle): nothing to check


# Iterable, but never taken as the records a flat_map/process call emits:
# text and bytes would be split into characters, a tuple is as likely one
# record as several, and a dict (any Mapping) would give its keys.
_NOT_RECORDS = (str, bytes, bytearray, memoryview, tuple, dict)


_GENERATOR = types.GeneratorType


@runtime_checkable
class Output(Protocol):
    """What an operator is given instead of its task (``op.chain_output``, set
    before ``open``): where it sends what it makes outside of a batch, and
    how it gets called back in its task's thread. The task's chain gives each
    of its operators one (``runtime.task.chain.ChainOutput``); so does
    ``pyflowbuf.testing.OperatorHarness``. Records returned from
    ``process_batch``, ``on_watermark`` and ``finish`` never go through it.

    Example (an operator that fires on a processing-time tick)::

        def open(self, subtask, parallelism):
            super().open(subtask, parallelism)
            self.chain_output.schedule(time.time() + 1.0, self.tick)

        def tick(self):                     # in the task's thread
            self.chain_output.emit(self.flush_buffered())
    """

    def post(self, mail) -> None:
        """Run ``mail()`` in the task's thread, between batches."""
        raise NotImplementedError

    def schedule(self, deadline: float, mail):
        """Post ``mail`` at wall-clock ``deadline`` (``time.time()`` seconds);
        a handle for ``ProcessingTimeService.cancel``, or None where there is
        no wall clock (the harness)."""
        raise NotImplementedError

    def emit(self, records: list) -> None:
        """Records made outside of a batch (a processing-time timer), with
        their times in ``fired_ts`` on a timestamped stream: through the
        operators after this one, then to the task's outputs."""
        raise NotImplementedError

    def emit_watermark(self, watermark: float, force: bool = False) -> None:
        """Watermark ``watermark`` made here (an assigner): through the
        operators after this one, then downstream if it rose (or ``force``)."""
        raise NotImplementedError

    def emit_idle(self) -> None:
        """This operator's input went idle (an assigner's idle timeout)."""
        raise NotImplementedError


class Operator(abc.ABC):
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
    # set by the job: whether the output stream carries timestamps; and the
    # times of what on_watermark / finish / a timer made (see runtime.task.chain)
    timestamped = False
    fired_ts: Any = None
    # the side outputs it declared (an operators.side_outputs.SideOutputs), set
    # by its task; None for the operators that declare none
    side: Any = None
    # its Output (set by its task before open); None while not running
    chain_output: Any = None
    # The optional parts of the contract, declared with the value that means
    # "not used" so that the runtime reads them instead of probing for them
    # (``timestamped`` above is one too). An operator whose output is its
    # input, unchanged, says so: the writers then check a source's records
    # once, not the task too.
    passes_records = False
    # ``on_watermark(watermark) -> (records, watermark or None)``: an
    # operator of event time defines it (what it fired, and the watermark to
    # pass on, None to hold it back); None: watermarks go past it untouched.
    on_watermark: Any = None
    # ``metrics() -> dict``: counters of its own (late records of windows),
    # summed over a chain; None: it has none.
    metrics: Any = None
    # ``cancel_connector()``: a connector sink stops waiting for its outside
    # system when the task is cancelled (ConnectorSinkOperator); None: it never waits.
    cancel_connector: Any = None
    # Operators of event time (``TimerOperator``) say so: at end of input a
    # harness first gives them the +inf watermark, as a task's inputs do.
    event_time = False
    # ``timers``: its ``TimerService`` (an operator that keeps timers); and
    # ``fire_processing(now) -> records``: the processing-time timers due at
    # ``now``. None: it keeps no timers.
    timers: Any = None
    fire_processing: Any = None
    # ``clock() -> seconds``: the wall clock of an operator that reads it
    # (processing-time windows), replaced by an OperatorHarness's clock;
    # None: it reads none.
    clock: Any = None
    # The key functions of a keyed operator: ``key_fn`` (one input) or
    # ``key_fns`` (one per input); a restore checks the kinds of the first
    # keys they compute. None: it is not keyed that way.
    key_fn: Any = None
    key_fns: Any = None
    # A sink that writes part files names the directory of its pending
    # commits (what a restore that drops its state reports); None otherwise.
    commit_directory: Any = None
    # What checkpoints, derived ids and job fingerprints call its kind
    # (``type_name``); None: its class's name.
    type_name: Any = None
    # Its node in the job graph and the uid its state is stored under: given
    # by ``place`` when its task is deployed; None for an operator run by hand
    # (an OperatorHarness), whose state is stored under its name.
    node_id: Any = None
    uid: Any = None

    def __init__(self, name: str):
        self.name = name

    def place(self, node_id, uid, out_kind, timestamped: bool) -> None:
        """What its task gives it from the job graph before ``open`` (the one
        setup step after construction): its node, the uid of its state, its
        output stream's kind and whether that stream carries timestamps."""
        self.node_id = node_id
        self.uid = uid
        self.out_kind = out_kind
        self.timestamped = timestamped

    def open(self, subtask: int, parallelism: int) -> None:
        self.subtask = subtask
        self.parallelism = parallelism

    @abc.abstractmethod
    def process_batch(self, batch: list) -> list:
        """The records it emits for ``batch`` (a list of records)."""

    def process_input(self, batch: list, input_index: int) -> list:
        """A batch read from input ``input_index`` of a task with several
        inputs (union, connect); only the operator heading such a task gets
        these. One-input operators do not care where a batch came from."""
        return self.process_batch(batch)

    def process_ts(self, batch: list, ts) -> tuple:
        """``process_batch`` on a chain that carries timestamps: ``ts`` holds the
        batch's times (None where its input has none); returns ``(output,
        its times)``. This default gives the output none: an operator whose
        output stream is timestamped overrides it."""
        return self.process_batch(batch), None

    def process_input_ts(self, batch: list, ts, input_index: int) -> tuple:
        """``process_input`` with the batch's times (see ``process_ts``)."""
        if type(self).process_input is Operator.process_input:
            return self.process_ts(batch, ts)
        return self.process_input(batch, input_index), None

    def finish(self) -> list:
        """Records to emit at end of input."""
        return []

    def snapshot_state(self) -> Any:
        """Operator state for a checkpoint (None when stateless): a copy, since
        the task goes on processing while it is written out."""
        return None

    def restore_state(self, state: Any) -> None:
        """Called before ``open`` when the job restores from a checkpoint."""

    # ---- state that moves between parallelisms (pyflowbuf.checkpoint.keygroups) ----
    # A keyed operator (``keyed_state``) hands its snapshot over as maps and
    # timer lists whose entries belong to keys; checkpoints store each with
    # the key group of every entry, and a restore at any parallelism gives
    # the operator back the entries of its subtask's groups.
    keyed_state = False
    # A keyed operator that records the keys it changes in ``touched`` (a set
    # the task installs when checkpoints are incremental, None otherwise):
    # a checkpoint then writes only the key groups of those keys.
    tracks_changes = False
    touched = None

    def keyed_parts(self, state) -> tuple[dict, dict, Any]:
        """A keyed snapshot as (maps, timers, common): ``maps`` {name: (dict,
        key_of)}, ``timers`` {name: (TimerQueue snapshot, key_of)}, where
        ``key_of(k)`` is the record key of an entry's key (None: the key
        itself), and ``common`` what belongs to no key."""
        raise NotImplementedError

    def from_keyed_parts(self, maps: dict, timers: dict, commons: list) -> Any:
        """``keyed_parts`` undone: the entries of one subtask's key groups
        (``commons``: the keyless rest of every subtask they came from)."""
        raise NotImplementedError

    def rescale_state(self, states: list, index: int, parallelism: int) -> Any:
        """The state of subtask ``index`` of ``parallelism`` from the
        per-subtask (non-keyed) states of a checkpoint taken at another
        parallelism. Only stateless subtasks move by default: per-subtask
        state has no rule for being split or joined."""
        if all(s is None for s in states):
            return None
        raise errors.ConfigurationError(
            f"operator {self.name!r} keeps per-subtask state that cannot be redistributed from parallelism "
            f"{len(states)} to {parallelism}; restore it at parallelism {len(states)}")

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
        """Add what a process function returned (records, or None) to ``out``.

        The rule, one type check per call: a list, a generator or another
        iterable (iterator, set, deque...) holds the records; None is none; a
        str, bytes, tuple or Mapping is refused, since it could be one record
        as well as several and guessing would change records' shape."""
        t = type(res)
        if t is list or t is _GENERATOR:
            out.extend(res)
            return
        if res is None:
            return
        if isinstance(res, _NOT_RECORDS) or isinstance(res, Mapping) or _is_dataframe(res):
            raise self._not_records(res)
        try:
            out.extend(res)
        except TypeError:
            if hasattr(res, "__iter__"):
                raise  # the iteration itself failed, inside the user's iterable
            raise self._not_records(res) from None

    def _not_records(self, value) -> errors.RecordTypeError:
        t = type(value).__name__
        if isinstance(value, (str, bytes, bytearray, memoryview)):
            why = f"; a {t} would be split into its items"
        elif isinstance(value, tuple):
            why = (f"; a {t} is ambiguous (one record that is a tuple, or several records?), so it is "
                   "never taken apart. One record: return [record] (e.g. [(k, v)]) or yield it; "
                   "several: return a list or yield each")
        elif isinstance(value, Mapping) or _is_dataframe(value):
            why = (f"; iterating a {t} gives its keys/column labels, not records. One record: "
                   "return [record] or yield it")
        else:
            why = ""
        return errors.RecordTypeError(
            f"operator {self.name!r}: its function returned {short_repr(value)} ({t}) where an "
            f"iterable of records belongs{why}. Return a list of records (e.g. [value]), yield them, or "
            "use map() for one record per input")


def type_name(op) -> str:
    """What checkpoints, derived operator ids and job fingerprints call an
    operator's kind: its class's name, or the ``type_name`` it gives (an
    operator that took over another's work keeps that one's name, so ids and
    checkpoints stay valid)."""
    return op.type_name or type(op).__name__


def _is_dataframe(x) -> bool:
    # by name, not isinstance: pandas may be half-imported by another task's
    # thread (pyarrow imports it lazily), and a stream without it need not import it
    return any(c.__name__ == "DataFrame" and c.__module__.split(".")[0] == "pandas" for c in type(x).__mro__)
