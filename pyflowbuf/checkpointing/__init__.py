"""Checkpointing of a running job, above the storage of ``pyflowbuf.checkpoint``:
the coordinator, a subtask's side of barriers and snapshots, restore, state
assignment, in-flight data (captured, replayed, rescaled), the job directory
and its lock (see this package's README.md for what lives where).

What the runtime, the cluster and the tools use is named here too, so that
a job execution imports the layer once (``from pyflowbuf import checkpointing
as ckpt``)."""
from pyflowbuf.checkpointing.coordinator import (CheckpointCoordinator, CheckpointSettings, check_rewindable,
                                                 run_commits)
from pyflowbuf.checkpointing.restore import (RestorePlan, check_graph, check_sources, graph_task_keys,
                                             read_states, task_key)
from pyflowbuf.checkpointing.restore_point import (latest_checkpoint, restart_point, restore_id,
                                                   restore_location, restore_plan, storage_of)
from pyflowbuf.checkpointing.snapshot import SnapshotWriter, new_writer
from pyflowbuf.checkpointing.subtask import SubtaskCheckpoints

__all__ = [
    "CheckpointCoordinator", "CheckpointSettings", "RestorePlan", "SnapshotWriter", "SubtaskCheckpoints",
    "check_graph", "check_rewindable", "check_sources", "graph_task_keys", "latest_checkpoint", "new_writer",
    "read_states", "restart_point", "restore_id", "restore_location", "restore_plan", "run_commits",
    "storage_of", "task_key",
]
