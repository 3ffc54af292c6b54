"""The two declared gateways between a job's checkpoint coordinator and its
subtasks, wherever the subtasks run (threads of this process, forked worker
processes, Spark barrier tasks).

``SubtaskGateway``: what the coordinator calls on the execution it is
attached to (``CheckpointCoordinator.attach``): inject barriers, tell the
subtasks a checkpoint completed or was aborted, turn a checkpoint unaligned,
end the job after a stop-with-savepoint. The one execution
(``JobExecution``) hands each call to its launcher, which posts it to the
subtasks' mailboxes (threads) or sends it to every worker.

``CoordinatorGateway``: what a subtask's side of checkpoints
(``TaskCheckpointing``) calls on its coordinator: the settings, where a
checkpoint's files go, and its acknowledgement, decline or final state.
``CheckpointCoordinator`` is one in the process that coordinates;
``pyflowbuf.cluster.worker.WorkerCoordinator`` is one in a worker process,
relaying each call to the driver's coordinator.

Example::

    from pyflowbuf.checkpointing.gateway import CoordinatorGateway, SubtaskGateway

    assert isinstance(job, SubtaskGateway)               # a JobExecution, wherever its subtasks run
    assert isinstance(job.coordinator, CoordinatorGateway)
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class SubtaskGateway(Protocol):
    """The coordinator's way to the subtasks of one attempt."""

    def trigger_sources(self, checkpoint_id: int, options: dict | None = None) -> None:
        """Checkpoint ``checkpoint_id`` starts: every source subtask sends its barrier
        (``options``: a savepoint's ``path``, ``stop``, ``drain``, ``aligned``)."""

    def notify_complete(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` completed: the subtasks commit what it covers."""

    def abort_checkpoint(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` was given up: the subtasks drop what they hold of it."""

    def switch_to_unaligned(self, checkpoint_id: int) -> None:
        """The alignment timeout passed: checkpoint ``checkpoint_id`` goes on unaligned."""

    def stop_after_savepoint(self, checkpoint_id: int) -> None:
        """Stop-with-savepoint ``checkpoint_id`` completed and committed: the job ends."""


@runtime_checkable
class CoordinatorGateway(Protocol):
    """A subtask's way to the coordinator of its job."""

    config: Any         # the job's CheckpointSettings
    storage: Any        # the job's CheckpointStorage

    def storage_for(self, checkpoint_id: int) -> Any:
        """Where checkpoint ``checkpoint_id``'s files go (a savepoint has its own directory)."""

    def acknowledge(self, task_key: str, checkpoint_id: int, handle: Any, alignment_ms: float, commits: list,
                    summary: dict | None = None) -> None:
        """The subtask's snapshot of ``checkpoint_id`` is durable at ``handle``."""

    def decline(self, task_key: str, checkpoint_id: int, reason: str) -> None:
        """The subtask cannot take part in ``checkpoint_id``."""

    def task_finished(self, task_key: str, state: Any, commits: list, snapshotted: int = 0,
                      summary: dict | None = None) -> None:
        """The subtask reached the end of its input; ``state`` is its final state."""
