"""What the runtime asks of the ends of a job: a source it reads
(``SourceOperator``) and a sink operator that commits with checkpoints
(``SinkOperator``). Both are ``typing.Protocol``s the runtime's classes
satisfy: every source derives from ``connectors.sources.Source``, which
declares the optional parts with the value that means "not used"; every
sink is an ``Operator`` (``pyflowbuf/operators/contracts.py``), whose
defaults commit nothing. The runtime reads these parts as attributes,
never probing for them (``tests/test_operator_contracts.py``).

These are the internal contracts of the runtime as it runs today; the
public connector API a user implements is a separate one.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable


@runtime_checkable
class SourceOperator(Protocol):
    """A source: the head of its task's chain, read in batches between mails.

    Checkpoints record ``position()`` (and ``identity()``, what it reads);
    a restore calls ``check_identity`` then ``seek`` after ``open``. A source
    that is not ``rewindable`` is refused by an exactly-once job."""

    name: str
    default_kind: Any
    rewindable: bool
    # the optional parts (None: not used); see connectors.sources.Source
    what: str | None
    wakeup: Callable[[], None] | None
    not_rewindable_because: str | None
    rescale_positions: Callable[[list, int], list] | None
    rows_of: Callable[[list], int] | None

    def open(self, subtask: int, parallelism: int) -> None: ...

    def next_batch(self, max_records: int) -> list | None:
        """Up to ``max_records`` records; None when exhausted."""

    def position(self) -> Any: ...

    def seek(self, position: Any) -> None: ...

    def identity(self) -> Any: ...

    def check_identity(self, recorded: Any, position: Any) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class SinkOperator(Protocol):
    """The sink side of the operator contract: at each checkpoint barrier
    ``prepare_commit(checkpoint_id)`` closes the transaction it covers, and
    the sink commits it itself when it hears of the checkpoint's completion
    in ``notify_checkpoint_complete`` (``ConnectorSinkOperator``, which every
    committing sink runs on). At the end of input (-1) it returns the
    idempotent actions the driver carries out once the job has ended.
    ``commit_directory``: where a part-file sink's commits rename files
    (None: it has none)."""

    commit_directory: str | None

    def prepare_commit(self, checkpoint_id: int) -> list: ...

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None: ...
