"""Checkpoints: durable storage of task state and in-flight data (see
``pyflowbuf/checkpoint/README.md`` for what lives where, the layout and the file format)."""
from pyflowbuf.checkpoint.codec import decode_value, encode_value
from pyflowbuf.checkpoint.container import dumps, loads
from pyflowbuf.checkpoint.errors import (
    CheckpointDirectoryInUseError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStateError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    KeyKindError,
    PickleNotAllowedError,
    TaskStateNotFoundError,
    UnsafeCommitError,
    UnsupportedStateError,
)
from pyflowbuf.checkpoint.storage import (
    ALIGNMENTS,
    CheckpointInfo,
    CheckpointMetadata,
    CheckpointStorage,
    SavepointStorage,
    TaskSnapshot,
    TaskStateHandle,
    TaskStateWriter,
)

__all__ = [
    "ALIGNMENTS", "CheckpointDirectoryInUseError", "CheckpointError", "CheckpointInfo", "CheckpointMetadata", "CheckpointNotFoundError",
    "CheckpointStateError", "CheckpointStorage", "CorruptCheckpointError", "IncompatibleCheckpointError",
    "KeyKindError", "PickleNotAllowedError", "SavepointStorage",
    "TaskSnapshot", "TaskStateHandle", "TaskStateNotFoundError", "TaskStateWriter", "UnsafeCommitError",
    "UnsupportedStateError",
    "decode_value", "dumps", "encode_value", "loads",
]
