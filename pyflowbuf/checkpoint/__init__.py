"""Checkpoints: durable storage of task state and in-flight data (see
``pyflowbuf/checkpoint/README.md`` for the layout and the file format)."""
from pyflowbuf.checkpoint.storage import (
    ALIGNMENTS,
    CheckpointError,
    CheckpointInfo,
    CheckpointMetadata,
    CheckpointNotFoundError,
    CheckpointStateError,
    CheckpointStorage,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    PickleNotAllowedError,
    TaskSnapshot,
    TaskStateHandle,
    TaskStateNotFoundError,
    TaskStateWriter,
    UnsafeCommitError,
    UnsupportedStateError,
    decode_value,
    dumps,
    encode_value,
    loads,
)

__all__ = [
    "ALIGNMENTS", "CheckpointError", "CheckpointInfo", "CheckpointMetadata", "CheckpointNotFoundError",
    "CheckpointStateError", "CheckpointStorage", "CorruptCheckpointError", "IncompatibleCheckpointError",
    "PickleNotAllowedError",
    "TaskSnapshot", "TaskStateHandle", "TaskStateNotFoundError", "TaskStateWriter", "UnsafeCommitError",
    "UnsupportedStateError",
    "decode_value", "dumps", "encode_value", "loads",
]
