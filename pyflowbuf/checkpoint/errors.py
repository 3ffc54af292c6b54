"""The checkpoint errors. All subclass ``CheckpointError`` (a ``FlowBufError``)
and the builtin a caller would catch for the same trouble."""
from __future__ import annotations

from pyflowbuf.errors import ConfigurationError, FlowBufError


class CheckpointError(FlowBufError):
    """Base class of the checkpoint storage errors."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint (or a state file) is torn or corrupt: bad checksum, truncated,
    missing task file, malformed value. ``checkpoint_id``, ``path`` and ``reason``
    say which and why."""

    def __init__(self, reason, *, checkpoint_id=None, path=None):
        where = []
        if checkpoint_id is not None:
            where.append(f"checkpoint {checkpoint_id}")
        if path is not None:
            where.append(str(path))
        super().__init__(f"{' '.join(where)}: {reason}" if where else reason)
        self.reason = reason
        self.checkpoint_id = checkpoint_id
        self.path = path


class UnsafeCommitError(CorruptCheckpointError):
    """A sink commit a restore would carry out is not one this job's sinks can
    produce (a rename out of or into another directory, of a file that is not
    a pending part file): refused before any file moves. ``action`` is it."""

    def __init__(self, reason, *, action=None, checkpoint_id=None, path=None):
        super().__init__(reason, checkpoint_id=checkpoint_id, path=path)
        self.action = action


class IncompatibleCheckpointError(CheckpointError, ConfigurationError):
    """The checkpoint was taken of other input: a source's recorded identity
    (its kind, paths, settings, the fingerprint of what it had read) does not
    match the source being restored. ``source`` names it."""

    def __init__(self, message, *, source=None):
        super().__init__(message)
        self.source = source


class KeyKindError(IncompatibleCheckpointError):
    """A restored keyed operator computed a key of a kind its checkpointed
    state does not hold (the key function changed: ``x % 10`` became
    ``str(x % 10)``): the old state would never be found again. ``operator``,
    ``recorded`` (the kinds in the state) and ``found`` say which. The job
    fails without restarts: a restart would restore the same state."""

    restartable = False

    def __init__(self, message, *, operator=None, recorded=(), found=None):
        super().__init__(message)
        self.operator = operator
        self.recorded = tuple(recorded)
        self.found = found
        self.failed_operator = operator


class CheckpointDirectoryInUseError(CheckpointError, ConfigurationError):
    """The checkpoint directory belongs to another job: one that is running
    and holds its lock (``holder``: the lock's job, pid, host, start), or one
    whose checkpoints it holds, which this job would number over and remove
    by retention. ``path`` is the directory."""

    def __init__(self, message, *, path=None, holder=None):
        super().__init__(message)
        self.path = path
        self.holder = holder


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No such checkpoint, or it is not complete (no ``_metadata``)."""


class TaskStateNotFoundError(CheckpointError, KeyError):
    """The complete checkpoint holds no state for this task key."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class CheckpointStateError(CheckpointError, RuntimeError):
    """The operation does not fit the checkpoint's state: writing to an aborted or
    subsumed checkpoint, aborting or completing a complete one."""


class UnsupportedStateError(CheckpointError, TypeError):
    """At snapshot time: the state holds a value that is not plain data and
    ``allow_pickle`` is off (or it cannot be pickled). ``type_name`` and
    ``where`` (a path such as ``state['counts'][3]``) name it."""

    def __init__(self, message, *, type_name=None, where=None):
        super().__init__(message)
        self.type_name = type_name
        self.where = where


class PickleNotAllowedError(CheckpointError, PermissionError):
    """At restore time: the stored state holds a pickled object and this reader
    did not opt in with ``allow_pickle=True``. ``type_name`` names the type the
    writer recorded (informative only: nothing was unpickled)."""

    def __init__(self, message, *, type_name=None):
        super().__init__(message)
        self.type_name = type_name


class _Corrupt(Exception):
    """Malformed bytes found by the codec or the container parser. Internal: the
    reader that knows which checkpoint and file it read turns it into a
    CorruptCheckpointError naming them."""
