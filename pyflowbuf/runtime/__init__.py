"""The task runtime: job graph planning, subtask threads with mailbox loops,
exchanges over the core, failure handling and metrics."""
