"""Checkpointing of a running job, above the storage of ``pyflowbuf.checkpoint``:
the coordinator, a subtask's side of barriers and snapshots, restore, state
assignment and in-flight data rescaling, the job directory and its lock."""
