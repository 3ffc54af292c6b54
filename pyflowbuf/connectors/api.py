"""The public connector contract: ``fb.Source`` and ``fb.Sink``.

A **source** is a set of *splits* (a file, a Kafka partition, a range of
keys), each read from a *position* that every checkpoint records. The
shapes follow Flink's Source API (FLIP-27) with one simplification: the
splits are enumerated by every reader subtask, not by a coordinator, and
each subtask takes its own share by a formula (``Source.owner``), as
Flink's Kafka enumerator assigns partitions. The formula depends only on the
split and the parallelism, so no round trip to the driver is needed and the
same code runs with threads, ``workers=N`` and ``SparkCluster``:

* a job starts: each subtask calls ``splits()`` and reads the splits it owns
  from their initial positions;
* a checkpoint records, per subtask, ``{split: position}`` of its splits;
* a restore at the same parallelism hands each subtask its own positions; at
  another parallelism every subtask gets all recorded positions and takes the
  splits it owns now (``rescale_positions``), so the splits are redistributed;
* ``discovery_interval`` seconds: the subtasks call ``splits()`` again while
  the job runs and start reading new splits they own.

A **sink** writes with a two-phase commit (Flink's Sink V2): ``write(batch)``
as records come; ``prepare_commit(checkpoint_id)`` at the checkpoint's
barrier returns *committables* (plain data) that are stored in the snapshot;
``commit(committables)`` runs once the checkpoint is complete, and again, on
the committables of the restored checkpoint, when a job restores (so it
must be idempotent); ``abort()`` drops what was written but not prepared,
when the job fails or is cancelled. At the end of input the sink prepares
and commits what is left.

docs/connectors.md ("Writing a connector") shows a small source and sink.
"""
from __future__ import annotations

import copy
import time
import zlib
from typing import Any

from pyflowbuf import errors
from pyflowbuf.checkpoint.errors import UnsafeCommitError
from pyflowbuf.connectors import sources as srcs
from pyflowbuf.operators.contracts import Operator

END_OF_INPUT = -1      # the checkpoint id ``prepare_commit`` gets at the end of input


def stable_split_hash(split) -> int:
    """A hash of a split id that is the same in every process (``hash()`` of
    a str is salted per process)."""
    return zlib.crc32(repr(split).encode("utf-8"))


class Source:
    """A connector source; subclass it and give it to ``Environment.from_source``.

    Implement ``splits()`` and either ``read(split, position, max_records)``
    (each split read on its own, as a file) or ``create_reader()`` (one
    reader for all of a subtask's splits, as a Kafka consumer). The object is
    pickled to worker processes: keep connections out of ``__init__``.

    Example::

        class Numbers(fb.Source):
            def __init__(self, n, parts):
                self.n, self.parts = n, parts

            def splits(self):
                return list(range(self.parts))

            def read(self, split, position, max_records):
                start = split if position is None else position
                out = list(range(start, self.n, self.parts))[:max_records]
                nxt = out[-1] + self.parts if out else start
                return out, nxt, nxt >= self.n          # records, new position, finished
    """

    #: whether the splits end (a file) or are read for as long as the job runs
    bounded = True
    #: seconds between two calls of ``splits()`` while the job runs (None: once)
    discovery_interval: float | None = None
    #: the record kind of the stream (None: inferred from the first record)
    kind: Any = None
    #: whether a restore can read again from a recorded position
    rewindable = True

    def splits(self) -> list:
        """The split ids: plain values (str, int, tuples of them), the same in
        every subtask and every process."""
        raise NotImplementedError

    def owner(self, split, parallelism: int) -> int:
        """The subtask that reads ``split`` (a function of the split and the
        parallelism only)."""
        return stable_split_hash(split) % parallelism

    def read(self, split, position, max_records: int) -> tuple:
        """``(records, position after them, finished)`` for one split;
        ``position`` is None the first time."""
        raise NotImplementedError

    def create_reader(self, subtask: int, parallelism: int) -> "SourceReader":
        """The reader of one subtask (default: ``read`` split by split)."""
        return _SplitByScanReader(self)

    def identity(self) -> Any:
        """What the source reads (plain data, or None), recorded in every
        checkpoint: a restore whose source has another identity is refused
        (``IncompatibleCheckpointError``) instead of applying positions to
        other input."""
        return None


class SourceReader:
    """What one subtask of a source runs (``Source.create_reader``)."""

    def add_splits(self, splits: dict) -> None:
        """Start reading these splits, ``{split: position}`` (None: from the start)."""
        raise NotImplementedError

    def poll(self, max_records: int) -> list | None:
        """Up to ``max_records`` records; ``[]`` when none came within a short
        wait (the task then tends to its mailbox); None when every split it
        reads has ended and no new split can come."""
        raise NotImplementedError

    def positions(self) -> dict:
        """``{split: position}`` of every split it was given, ended ones included."""
        raise NotImplementedError

    def wakeup(self) -> None:
        """Make a waiting ``poll`` return (any thread may call it)."""

    def close(self) -> None:
        pass


class _SplitByScanReader(SourceReader):
    """``Source.read`` over the splits in turn."""

    def __init__(self, source):
        self.source = source
        self.state: dict = {}          # split -> [position, finished]
        self._turn = 0

    def add_splits(self, splits):
        for s, pos in splits.items():
            self.state[s] = list(pos) if isinstance(pos, (list, tuple)) and len(pos) == 2 else [None, False]

    def poll(self, max_records):
        live = [s for s, (_, done) in self.state.items() if not done]
        if not live:
            return None
        s = live[self._turn % len(live)]
        self._turn += 1
        pos = self.state[s][0]
        records, pos, finished = self.source.read(s, pos, max_records)
        self.state[s] = [pos, bool(finished)]
        return list(records)

    def positions(self):
        return {s: list(v) for s, v in self.state.items()}


class SourceTask(srcs.Source):
    """The runtime's side of a ``fb.Source``: the splits this subtask owns,
    their positions in checkpoints, new splits found while running."""

    def __init__(self, source: Source, name: str):
        self.source = source
        self.what = f"source {name!r} ({type(source).__name__})"
        self.reader = None
        self.restored = None        # {split: position} from a checkpoint
        self.owned: set = set()
        self._next_discovery = None

    @property
    def rewindable(self):
        return self.source.rewindable

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        self.reader = self.source.create_reader(subtask, parallelism)
        # what this subtask reads is decided on the first pull, after ``seek``
        # has handed it the checkpoint's positions
        self._started = False

    def _discover(self):
        found = self.source.splits()
        p = self.parallelism
        new = {}
        for s in found:
            s = _split_key(s)
            if s in self.owned:
                continue
            owner = self.source.owner(s, p)
            if not (isinstance(owner, int) and 0 <= owner < p):
                raise errors.ConfigurationError(
                    f"{self.what}: owner({s!r}, {p}) returned {owner!r}, not a subtask index in 0..{p - 1}")
            if owner == self.subtask:
                new[s] = (self.restored or {}).get(s)
        if new:
            self.owned.update(new)
            self.reader.add_splits(new)
        if self.source.discovery_interval is not None:
            self._next_discovery = time.monotonic() + self.source.discovery_interval

    def next_batch(self, max_records):
        if not self._started:
            self._started = True
            self._discover()
        elif self._next_discovery is not None and time.monotonic() >= self._next_discovery:
            self._discover()
        batch = self.reader.poll(max_records)
        if batch is None and not self.source.bounded:
            # every split read has ended, and new ones may come
            time.sleep(0.05)
            return []
        return batch

    def position(self):
        positions = self.reader.positions() if self.reader is not None else {}
        if self.restored:
            # splits recorded for this subtask that it has not picked up (yet)
            for s, pos in self.restored.items():
                if s not in positions and self.source.owner(s, self.parallelism) == self.subtask:
                    positions[s] = pos
        return {"splits": [[_plain(s), pos] for s, pos in positions.items()]}

    def seek(self, position):
        self.restored = _positions(position)

    def rescale_positions(self, positions, parallelism):
        """Every subtask gets every recorded position and takes those of the
        splits it owns (``Source.owner``) when it starts."""
        merged = {}
        for pos in positions:
            merged.update(_positions(pos))
        whole = {"splits": [[_plain(s), p] for s, p in merged.items()]}
        return [whole] * parallelism

    def identity(self):
        ident = self.source.identity()
        return None if ident is None else {"kind": "source", "type": type(self.source).__name__, "identity": ident}

    def check_identity(self, recorded, position):
        mine = self.identity()
        if mine is not None and recorded is not None and recorded != mine:
            raise srcs.incompatible(self, f"the checkpoint's source was {recorded!r}, this one is {mine!r}")

    def wakeup(self):
        if self.reader is not None:
            self.reader.wakeup()

    def close(self):
        if self.reader is not None:
            self.reader.close()


def _split_key(s):
    # checkpoints store lists where tuples were: a split id is hashable again
    return tuple(_split_key(x) for x in s) if isinstance(s, list) else s


def _plain(s):
    return [_plain(x) for x in s] if isinstance(s, tuple) else s


def _positions(position) -> dict:
    if not position:
        return {}
    if not isinstance(position, dict) or "splits" not in position:
        raise errors.ConfigurationError(f"a connector source's checkpointed position is {position!r}, "
                                        "not one this source wrote")
    return {_split_key(s): p for s, p in position["splits"]}


class Sink:
    """A connector sink with a two-phase commit; subclass it and give it to
    ``stream.sink_to``. Each subtask gets its own copy (``copy.deepcopy``)
    before ``open``.

    Example (files renamed into place when a checkpoint completes)::

        class Files(fb.Sink):
            def __init__(self, folder):
                self.folder = folder

            def open(self, subtask, parallelism):
                self.subtask, self.lines = subtask, []

            def write(self, batch):
                self.lines.extend(map(str, batch))

            def prepare_commit(self, checkpoint_id):
                tmp = os.path.join(self.folder, f".{self.subtask}-{checkpoint_id}")
                with open(tmp, "w") as f:
                    f.writelines(line + "\\n" for line in self.lines)
                self.lines = []
                return [tmp]                        # stored in the checkpoint

            def commit(self, committables):
                for tmp in committables:            # again after a restore: idempotent
                    if os.path.exists(tmp):
                        os.replace(tmp, tmp.replace("/.", "/part-"))
    """

    def open(self, subtask: int, parallelism: int) -> None:
        """Called in the subtask before the first record (and after a restore)."""

    def write(self, batch: list) -> None:
        raise NotImplementedError

    def prepare_commit(self, checkpoint_id: int) -> list:
        """At checkpoint ``checkpoint_id``'s barrier (-1: the end of input):
        make what was written since the last call ready to commit; the
        committables returned (plain data) go into the checkpoint."""
        raise NotImplementedError

    def commit(self, committables: list) -> None:
        """Make ``committables`` visible. Runs once their checkpoint is
        complete, and again after a restore: doing it twice changes nothing."""
        raise NotImplementedError

    def abort(self) -> None:
        """The job failed or was cancelled: drop what was written and not prepared."""

    def snapshot_state(self) -> Any:
        """State of the writer besides its committables (None: none)."""
        return None

    def restore_state(self, states: list) -> None:
        """Called before ``open`` after a restore: what ``snapshot_state``
        returned in the subtask(s) whose place this one takes (one, or
        several when the job restores at a lower parallelism)."""

    def close(self) -> None:
        """The subtask ended (after its last commit, or a failure)."""

    # The part-file sinks' parts (``connectors/sinks.py``), declared here with
    # the value meaning "not used" (a user's sink leaves them): the name its
    # state has in checkpoints and derived ids, the directory it commits
    # into, a check of committables read back from a checkpoint before any
    # is committed, and its own rule for handing writer states to another
    # parallelism (``ConnectorSinkOperator.rescale_state``).
    _type_name: str | None = None
    _commit_directory: str | None = None
    _check_committables = None
    # called from another thread when the job is cancelled (the Kafka sink's
    # waits for the broker end then); None: nothing to wake
    _cancel = None
    _rescale_writer_states = None


# The connector sinks declared in this process, by commit key: the driver
# runs the commits of a job's final state (a sink subtask that reached the end
# of its input commits when the whole job has ended, or when a restore finds
# its final state), and only for sinks its own job declared.
_DECLARED: dict = {}


def declare(key: str, sink: "Sink") -> None:
    _DECLARED[key] = sink


def committer(action):
    if len(action) != 3 or not isinstance(action[1], str) or not isinstance(action[2], list):
        return None
    return _DECLARED.get(action[1])


def checked_final_commit(action) -> "Sink":
    """The declared sink that runs a final commit action
    (``["connector", commit key, committables]``), once the action is one a
    sink of this job can have written: it comes back from ``_metadata`` on a
    restore, so a sink unknown here, or committables the sink itself refuses
    (``_check_committables``), raise ``UnsafeCommitError`` before anything
    is committed."""
    sink = committer(action) if isinstance(action, (list, tuple)) else None
    if sink is None:
        raise UnsafeCommitError(
            f"refusing sink commit {str(action)[:200]}: no connector sink of this job has the commit key "
            f"{action[1] if isinstance(action, (list, tuple)) and len(action) > 1 else None!r}", action=action)
    if sink._check_committables is not None:
        sink._check_committables(action[2])
    return sink


def run_final_commit(action, sink: "Sink | None" = None) -> None:
    """Commit a finished sink subtask's last committables (in the driver, on
    a fresh copy of the declared sink: ``open`` is not called)."""
    sink = copy.deepcopy(sink if sink is not None else checked_final_commit(action))
    try:
        sink.commit(action[2])
    finally:
        sink.close()


class ConnectorSinkOperator(Operator):
    """The operator that runs a ``fb.Sink`` in its subtask: every sink that
    commits with checkpoints, user sinks, Kafka and the part-file sinks
    (``write_text``, ``write_parquet``), commits through it.

    Committables are committed here when a checkpoint completes, and after a
    restore. At the end of input the last ones (and any whose checkpoint was
    not confirmed yet) go into the final state as a commit action that the
    driver runs once the whole job has ended: committing them when this
    subtask ends would duplicate them if another task then failed and the job
    restored a checkpoint taken before this subtask's end. Without
    checkpoints (``checkpointed=False``), the subtask commits them itself at
    the end of its input, and a failure to commit fails it."""

    kind = "sink"

    def __init__(self, name, sink: Sink, commit_key: str | None = None, checkpointed: bool | None = None):
        super().__init__(name)
        self.sink = copy.deepcopy(sink)
        self.commit_key = commit_key
        self.checkpointed = checkpointed   # None: not known (commits at close when no checkpoint took them)
        self.pending: list = []         # [checkpoint id, committables] not known to be committed
        self.to_recommit: list = []     # committables of the restored checkpoint
        self.final = None               # the committables prepared at the end of input

    @property
    def type_name(self) -> str:
        """What checkpoints and derived ids call it (``contracts.type_name``):
        the part-file sinks keep the names their operators had before they
        ran on this one, so their ids and checkpoints stay valid."""
        return self.sink._type_name or type(self).__name__

    @property
    def commit_directory(self):
        return self.sink._commit_directory

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        self.sink.open(subtask, parallelism)
        if self.to_recommit:
            # the checkpoint restored now is complete: what it prepared commits
            # (again, if its first commit went through)
            self.sink.commit(self.to_recommit)
            self.to_recommit = []

    def process_batch(self, batch):
        self.sink.write(batch)
        return []

    def prepare_commit(self, checkpoint_id):
        if checkpoint_id != END_OF_INPUT:
            self.pending.append([checkpoint_id, list(self.sink.prepare_commit(checkpoint_id))])
            return []   # committed here, in the subtask, when the checkpoint completes
        if self.final is None:
            return []
        done, self.final = self.final, None
        self.pending = []
        if self.commit_key is None:
            self.sink.commit(done)     # (a sink not declared by a job: no driver to hand it to)
            return []
        return [["connector", self.commit_key, done]] if done else []

    def snapshot_state(self):
        return {"pending": [[n, list(c)] for n, c in self.pending], "writers": [self.sink.snapshot_state()]}

    def restore_state(self, state):
        if state:
            state = _sink_state(state)
            self.to_recommit = [c for _, cs in state.get("pending", ()) for c in cs]
            self.sink.restore_state([w for w in state.get("writers", ()) if w is not None])

    def rescale_state(self, states, index, parallelism):
        """Subtask ``index`` commits the committables of the old subtasks
        ``index``, ``index + parallelism``, ... and gets their writer states
        (or those the sink's own rule, ``_rescale_writer_states``, gives it)."""
        states = [_sink_state(s) if s else s for s in states]
        mine = [s for j, s in enumerate(states) if s and j % parallelism == index]
        rule = self.sink._rescale_writer_states
        if rule is not None:
            writers = rule([(s.get("writers") or [None])[0] if s else None for s in states], index, parallelism)
        else:
            writers = [w for s in mine for w in s.get("writers", ())]
        if not mine and not any(w is not None for w in writers):
            return None
        return {"pending": [p for s in mine for p in s.get("pending", ())], "writers": writers}

    def notify_checkpoint_complete(self, checkpoint_id):
        done = [c for n, cs in self.pending if 0 <= n <= checkpoint_id for c in cs]
        self.pending = [[n, cs] for n, cs in self.pending if not 0 <= n <= checkpoint_id]
        if done:
            self.sink.commit(done)

    def finish(self):
        last = list(self.sink.prepare_commit(END_OF_INPUT))
        self.final = [c for _, cs in self.pending for c in cs] + last
        if self.checkpointed is False:
            # no checkpoint takes the final state: commit here, where a failure fails the subtask
            done, self.final = self.final, None
            self.pending = []
            if done:
                self.sink.commit(done)
        return []

    def cancel_connector(self) -> None:
        """(Another thread) The job is cancelled: a sink that waits on an
        outside system (``_cancel``) stops waiting soon."""
        cancel = self.sink._cancel
        if cancel is not None:
            cancel()

    def close_connector(self, failed: bool) -> None:
        """The subtask ended (``failed``: by a failure or a cancel)."""
        try:
            if failed:
                self.sink.abort()
            elif self.final:
                # no checkpoint took the final state (checkpoints are off)
                done, self.final = self.final, None
                self.sink.commit(done)
        finally:
            self.sink.close()


def _sink_state(state) -> dict:
    """A ``ConnectorSinkOperator`` state; a part-file sink's state of a
    checkpoint written before it ran on this operator (``{"seq": ...}``,
    its committables in ``_metadata``'s commits) is its writer state."""
    if isinstance(state, dict) and ("writers" in state or "pending" in state):
        return state
    return {"pending": [], "writers": [state]}
