"""Durable checkpoint storage: the directory layout, the task state handles and
metadata, ``TaskStateWriter`` and ``CheckpointStorage``. The file format lives in
``pyflowbuf.checkpoint.container``, the value codec in ``pyflowbuf.checkpoint.codec``,
the errors in ``pyflowbuf.checkpoint.errors``.

Layout
======
One directory per checkpoint under ``checkpoint_dir`` (a local path or any fsspec
URL: ``s3://bucket/job``, ``hdfs://...``, ``memory://...``)::

    checkpoint_dir/
      chk-41/                      complete: holds _metadata
        _metadata
        map_0-1f0c9a3be27d4c55.state
        ...
      chk-42/                      in progress: task files, no _metadata yet

A task writes its file under a temporary name in the checkpoint's directory and
renames it when the file is whole. The coordinator writes ``_metadata`` (also
temporary name, then rename) only after every task has acknowledged; a
checkpoint is complete exactly when a valid ``_metadata`` exists and every task
file it lists is there with the recorded size and valid checksums. On object
stores, where a rename is a copy, that rule alone is what makes a checkpoint
complete: readers never trust a directory without metadata.
"""
from __future__ import annotations

import logging
import os
import re
import reprlib
import threading
import time
import uuid
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Any, Iterable, Mapping

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from pyflowbuf._version import __version__
from pyflowbuf.checkpoint.codec import EncodedValue, _byte_view, encode_value
from pyflowbuf.checkpoint.container import (FILE_METADATA, FILE_TASK_STATE, FORMAT_VERSION, SEC_INFLIGHT, SEC_INFO,
                                            SEC_METADATA, SEC_STATE, _ContainerWriter, _decode_section, _MemSource,
                                            _parse, _split_inflight, _StreamSource)
from pyflowbuf.checkpoint.errors import (CheckpointError, CheckpointNotFoundError, CheckpointStateError,
                                         CorruptCheckpointError, PickleNotAllowedError, TaskStateNotFoundError,
                                         _Corrupt)
from pyflowbuf.checkpoint import shared

# The public names of the codec, the container and the errors lived here before
# the split and stay importable from here.
from pyflowbuf.checkpoint.codec import (EXT_ARROW_BATCH, EXT_ARROW_TABLE, EXT_BIGINT, EXT_COMPLEX,  # noqa: F401,E402
                                        EXT_FROZENSET, EXT_NDARRAY, EXT_NPSCALAR, EXT_PICKLE, EXT_SET, EXT_TUPLE,
                                        INLINE_MAX, MAX_EXT_DEPTH, PLAIN_TYPES, decode_value)
from pyflowbuf.checkpoint.container import (FILE_VALUE, FLAG_PICKLE, MAGIC, SEC_END, SEC_VALUE,  # noqa: F401,E402
                                            dumps, loads)
from pyflowbuf.checkpoint.errors import (IncompatibleCheckpointError, UnsafeCommitError,  # noqa: F401,E402
                                         UnsupportedStateError)

log = logging.getLogger("pyflowbuf.checkpoint")

# ---------------------------------------------------------------------------- records

ALIGNMENTS = ("aligned", "unaligned")
COMPLETED = "COMPLETED"
INCOMPLETE = "INCOMPLETE"
CORRUPT = "CORRUPT"

_SAFE_CHARS = re.compile(r"[^A-Za-z0-9_.-]")
_TASK_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*-[0-9a-f]{16}\.state$")
_CHK_DIR = re.compile(r"^chk-(0|[1-9][0-9]*)$")
METADATA_FILE = "_metadata"


def task_file_name(task_key: str) -> str:
    """The file a task's state goes to: a readable prefix of the key plus a hash of
    the whole key, so distinct keys never collide and any key is a safe name on
    every file system."""
    prefix = _SAFE_CHARS.sub("_", task_key)[:80].lstrip(".-") or "task"
    digest = blake2b(task_key.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return f"{prefix}-{digest}.state"


def _check_id(checkpoint_id) -> int:
    if type(checkpoint_id) is not int and not isinstance(checkpoint_id, np.integer):
        raise TypeError(f"checkpoint_id must be an int, got {type(checkpoint_id).__name__}")
    cid = int(checkpoint_id)
    if cid < 0:
        raise ValueError(f"checkpoint_id must be >= 0, got {cid}")
    return cid


def _check_key(task_key) -> str:
    if type(task_key) is not str or not task_key:
        raise TypeError(f"task_key must be a non-empty str, got {task_key!r}")
    return task_key


def _check_alignment(alignment) -> str:
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")
    return alignment


@dataclass(frozen=True)
class TaskStateHandle:
    """What a task acknowledges to the coordinator: where its state went and how
    big it is. ``to_dict()`` is plain data, to cross processes."""

    checkpoint_id: int
    task_key: str
    file: str             # name inside the checkpoint directory
    size: int             # bytes of the file
    state_bytes: int      # bytes of the encoded operator state
    inflight_bytes: int   # bytes of persisted in-flight buffers (unaligned checkpoints)
    alignment: str = "aligned"
    inflight_buffers: int = 0

    def to_dict(self) -> dict:
        return {"checkpoint_id": self.checkpoint_id, "task_key": self.task_key, "file": self.file,
                "size": self.size, "state_bytes": self.state_bytes, "inflight_bytes": self.inflight_bytes,
                "alignment": self.alignment, "inflight_buffers": self.inflight_buffers}

    @classmethod
    def from_dict(cls, d: Mapping) -> "TaskStateHandle":
        h = cls(**{k: d[k] for k in ("checkpoint_id", "task_key", "file", "size", "state_bytes",
                                     "inflight_bytes", "alignment", "inflight_buffers")})
        ints = (h.checkpoint_id, h.size, h.state_bytes, h.inflight_bytes, h.inflight_buffers)
        if (not all(type(v) is int and v >= 0 for v in ints) or type(h.task_key) is not str
                or h.alignment not in ALIGNMENTS or type(h.file) is not str or not _TASK_FILE.match(h.file)):
            raise ValueError(f"invalid task state handle {reprlib.repr(dict(d))}")
        return h


@dataclass(frozen=True)
class CheckpointMetadata:
    """A complete checkpoint, as recorded in its ``_metadata``. Times are epoch
    seconds, ``duration`` seconds from trigger to completion."""

    checkpoint_id: int
    trigger_time: float
    completion_time: float
    duration: float
    status: str
    tasks: Mapping[str, TaskStateHandle]
    properties: dict = field(default_factory=dict)
    path: str = ""

    @property
    def state_bytes(self) -> int:
        return sum(t.state_bytes for t in self.tasks.values())

    @property
    def inflight_bytes(self) -> int:
        return sum(t.inflight_bytes for t in self.tasks.values())

    @property
    def size(self) -> int:
        return sum(t.size for t in self.tasks.values())

    def to_dict(self) -> dict:
        return {"format": FORMAT_VERSION, "checkpoint_id": self.checkpoint_id,
                "trigger_time": self.trigger_time, "completion_time": self.completion_time,
                "duration": self.duration, "status": self.status,
                "tasks": [t.to_dict() for t in self.tasks.values()], "properties": self.properties}

    @classmethod
    def from_dict(cls, d: Mapping, path: str = "") -> "CheckpointMetadata":
        if type(d) is not dict or d.get("format") != FORMAT_VERSION:
            raise ValueError("metadata is not a format-1 dict")
        tasks = {}
        for t in d["tasks"]:
            h = TaskStateHandle.from_dict(t)
            if h.task_key in tasks:
                raise ValueError(f"task {h.task_key!r} listed twice")
            tasks[h.task_key] = h
        m = cls(d["checkpoint_id"], d["trigger_time"], d["completion_time"], d["duration"], d["status"],
                tasks, d["properties"], path)
        times = (m.trigger_time, m.completion_time, m.duration)
        if (type(m.checkpoint_id) is not int or type(m.properties) is not dict or m.status != COMPLETED
                or not all(type(t) in (int, float) for t in times)):
            raise ValueError("metadata fields have the wrong types")
        if any(h.checkpoint_id != m.checkpoint_id for h in tasks.values()):
            raise ValueError("a task handle belongs to another checkpoint")
        return m


@dataclass
class TaskSnapshot:
    """One task's state read back from a checkpoint. ``inflight`` maps each
    channel to its buffers in the order written (read-only views of the file's
    bytes; NumPy arrays in ``state`` are writable views of the same bytes)."""

    checkpoint_id: int
    task_key: str
    alignment: str
    state: Any
    inflight: dict
    state_bytes: int
    inflight_bytes: int


@dataclass
class CheckpointInfo:
    """A checkpoint directory as ``scan()`` found it: COMPLETED (``metadata`` set),
    INCOMPLETE (no metadata: in progress or abandoned) or CORRUPT (``error``)."""

    checkpoint_id: int
    path: str
    status: str
    metadata: CheckpointMetadata | None = None
    error: CheckpointError | None = None


# ---------------------------------------------------------------------------- writing a task's state


class TaskStateWriter:
    """Writes one task's state file: in-flight sections as they come, the operator
    state once, then ``commit()`` renames the temporary file into place.

    Use as a context manager: leaving the block commits, an exception aborts
    (the temporary file is removed). Buffers handed to ``write_inflight`` and
    arrays in the state are written from their own memory, one write each; they
    must not change until the call returns."""

    def __init__(self, storage: "CheckpointStorage", checkpoint_id: int, task_key: str, alignment: str):
        self._storage = storage
        self.checkpoint_id = checkpoint_id
        self.task_key = task_key
        self.alignment = alignment
        self.handle: TaskStateHandle | None = None
        self.state_bytes = 0
        self.inflight_bytes = 0
        self._inflight_buffers = 0
        self._state_written = False
        self._done = False
        self._fs = storage.fs
        directory = storage.checkpoint_path(checkpoint_id)
        self.file = task_file_name(task_key)
        self._final = f"{directory}/{self.file}"
        self._tmp = f"{directory}/.{self.file}.{uuid.uuid4().hex}.tmp"
        self._fs.makedirs(directory, exist_ok=True)
        self._f = self._fs.open(self._tmp, "wb")
        try:
            self._w = _ContainerWriter(self._f, FILE_TASK_STATE)
            info = {"checkpoint_id": checkpoint_id, "task_key": task_key, "alignment": alignment,
                    "created": time.time(), "writer": f"pyflowbuf {__version__}"}
            self._w.value_section(SEC_INFO, "info", encode_value(info))
        except BaseException:
            self.abort()
            raise

    def _check_open(self):
        if self._done:
            raise CheckpointStateError(f"the state file of task {self.task_key!r} is already closed")

    def write_inflight(self, channel: str, buffers: Iterable) -> int:
        """Persist in-flight buffers of one input channel (any objects with the
        buffer protocol: pyflowbuf Buffers, memoryviews, bytes, arrays). Calls
        for the same channel append. Returns the bytes of data written."""
        self._check_open()
        if type(channel) is not str:
            raise TypeError(f"channel must be a str, got {type(channel).__name__}")
        views = [_byte_view(b) for b in buffers]
        try:
            n = self._w.inflight_section(channel, views)
        except BaseException:
            self.abort()
            raise
        self.inflight_bytes += n
        self._inflight_buffers += len(views)
        return n

    def write_state(self, state) -> int:
        """Encode and write the operator state (once). Returns its encoded size.
        UnsupportedStateError (the file stays open) if it is not plain data and
        the storage does not allow pickle."""
        self._check_open()
        if self._state_written:
            raise CheckpointStateError(f"the state of task {self.task_key!r} was already written")
        return self._write_encoded_state(encode_value(state, allow_pickle=self._storage.allow_pickle))

    def _write_encoded_state(self, enc: EncodedValue) -> int:
        try:
            self.state_bytes = self._w.value_section(SEC_STATE, "state", enc)
        except BaseException:
            self.abort()
            raise
        self._state_written = True
        return self.state_bytes

    def commit(self) -> TaskStateHandle:
        """Finish the file, make it durable and rename it into place."""
        self._check_open()
        if not self._state_written:
            raise CheckpointStateError(f"task {self.task_key!r}: write_state() before commit()")
        try:
            self._storage._raise_if_dead(self.checkpoint_id)
            self._w.end()
            size = self._w.pos
            self._storage._sync_file(self._f)
            self._f.close()
            self._fs.mv(self._tmp, self._final)
            self._storage._sync_dir(self._final.rsplit("/", 1)[0])
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError) and self._storage._is_dead(self.checkpoint_id):
                raise CheckpointStateError(
                    f"checkpoint {self.checkpoint_id} was aborted while task {self.task_key!r} wrote") from e
            raise
        self._done = True
        self.handle = TaskStateHandle(self.checkpoint_id, self.task_key, self.file, size, self.state_bytes,
                                      self.inflight_bytes, self.alignment, self._inflight_buffers)
        return self.handle

    def abort(self) -> None:
        """Drop the temporary file; the checkpoint gets nothing from this task."""
        if self._done:
            return
        self._done = True
        try:
            self._f.close()
        except Exception:
            pass
        try:
            self._fs.rm(self._tmp)
        except (FileNotFoundError, OSError):
            pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()


# ---------------------------------------------------------------------------- the storage


class _References:
    """CheckpointStorage's part for what an incremental checkpoint refers to
    (``checkpoint/shared.py``): checked on completion and load, read on restore."""

    def _check_reference_sizes(self, cid: int, refs) -> None:
        """Before an incremental checkpoint completes: every earlier file it
        refers to is there, with the size it had when it was written."""
        for r in refs:
            path = f"{self.checkpoint_path(r['checkpoint'])}/{r['file']}"
            try:
                size = self.fs.size(path)
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"checkpoint {cid} refers to {path}, which does not exist") from None
            if size != r["size"]:
                raise CorruptCheckpointError(f"checkpoint {cid} refers to {path} of {r['size']} bytes, it has "
                                             f"{size}", checkpoint_id=cid, path=path)

    def _check_references(self, meta: CheckpointMetadata, verify: bool) -> None:
        """An incremental checkpoint is complete only with the files of earlier
        checkpoints it refers to (``pyflowbuf.checkpoint.shared``)."""
        cid = meta.checkpoint_id
        try:
            refs = shared.references(meta)
        except ValueError as e:
            raise CorruptCheckpointError(f"{METADATA_FILE}: {e}", checkpoint_id=cid, path=meta.path) from e
        if refs and not self._holds_chain:
            raise CorruptCheckpointError(
                f"checkpoint {cid} is incremental: it refers to state files of checkpoint(s) "
                f"{sorted({r['checkpoint'] for r in refs})} in the checkpoint_dir it was taken in, which are not "
                f"here. Restore it from that checkpoint_dir, or take a savepoint (always self-contained) to move "
                f"state", checkpoint_id=cid, path=meta.path)
        for r in refs:
            h = self._reference_handle(r)
            path = f"{self.checkpoint_path(h.checkpoint_id)}/{h.file}"
            try:
                size = self.fs.size(path)
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"checkpoint {cid} refers to the state file of task {h.task_key!r} in checkpoint "
                    f"{h.checkpoint_id} ({h.file}), which is missing", checkpoint_id=cid, path=path) from None
            if size != h.size:
                raise CorruptCheckpointError(
                    f"checkpoint {cid} refers to the state file of task {h.task_key!r} in checkpoint "
                    f"{h.checkpoint_id}, which has {size} bytes, metadata says {h.size} (torn)",
                    checkpoint_id=cid, path=path)
            if verify:
                try:
                    self._verify_task_file(meta, h, path)
                except Exception as e:
                    raise CorruptCheckpointError(f"checkpoint {cid} refers to checkpoint {h.checkpoint_id}, task "
                                                 f"{h.task_key!r}: {e}", checkpoint_id=cid, path=path) from e

    @staticmethod
    def _reference_handle(r: dict) -> TaskStateHandle:
        return TaskStateHandle(r["checkpoint"], r["task"], r["file"], r["size"], 0, 0, r["alignment"], 0)

    def read_shared_state(self, meta: CheckpointMetadata, checkpoint_id: int, task_key: str):
        """The stored state of ``task_key`` in earlier checkpoint
        ``checkpoint_id``, which incremental checkpoint ``meta`` refers to
        (every checksum is checked). CorruptCheckpointError when ``meta``
        lists no such reference or the file is damaged."""
        try:
            refs = shared.references(meta)
        except ValueError as e:
            raise CorruptCheckpointError(f"{METADATA_FILE}: {e}", checkpoint_id=meta.checkpoint_id,
                                         path=meta.path) from e
        r = next((r for r in refs if r["checkpoint"] == checkpoint_id and r["task"] == task_key), None)
        if r is None or not self._holds_chain:
            raise CorruptCheckpointError(
                f"checkpoint {meta.checkpoint_id}: task {task_key!r} refers to checkpoint {checkpoint_id}, which "
                f"its {METADATA_FILE} does not list among its references", checkpoint_id=meta.checkpoint_id,
                path=meta.path)
        return self._read_file(self._reference_handle(r)).state


class CheckpointStorage(_References):
    """Checkpoints of one job under ``checkpoint_dir`` (path or fsspec URL).

    retained
        How many complete checkpoints ``complete()`` keeps (the newest).
    allow_pickle
        Opt-in, as on the wire: without it, state that is not plain data is
        refused at snapshot time and stored pickles are refused at restore time.
    fsync
        On a local file system, fsync files and directories before a rename is
        reported done (other file systems are as durable as their put is).
    storage_options
        Passed to fsspec (credentials, endpoints...).
    """

    # whether earlier checkpoints lie beside this one (incremental references resolve)
    _holds_chain = True

    def __init__(self, checkpoint_dir, retained: int = 2, allow_pickle: bool = False, *,
                 fsync: bool = True, storage_options: Mapping | None = None):
        if type(retained) is not int or retained < 1:
            raise ValueError(f"retained must be an int >= 1, got {retained!r}")
        self.fs, root = fsspec.core.url_to_fs(os.fspath(checkpoint_dir), **dict(storage_options or {}))
        self.root = root.rstrip("/") or "/"
        self.retained = retained
        self.allow_pickle = bool(allow_pickle)
        self._local = isinstance(self.fs, LocalFileSystem)
        self._fsync = fsync and self._local
        self._lock = threading.Lock()
        self._aborted: set[int] = set()
        self._completed_max = -1

    def __repr__(self):
        return f"CheckpointStorage({self.url!r}, retained={self.retained}, allow_pickle={self.allow_pickle})"

    @property
    def url(self) -> str:
        return self.fs.unstrip_protocol(self.root)

    def checkpoint_path(self, checkpoint_id: int) -> str:
        return f"{self.root.rstrip('/')}/chk-{_check_id(checkpoint_id)}"

    # -- durability helpers

    def _sync_file(self, f):
        if self._fsync:
            f.flush()
            os.fsync(f.fileno())

    def _sync_dir(self, path):
        if self._fsync:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _is_dead(self, cid: int) -> bool:
        with self._lock:
            return cid in self._aborted or cid < self._completed_max

    def _raise_if_dead(self, cid: int):
        with self._lock:
            if cid in self._aborted:
                raise CheckpointStateError(f"checkpoint {cid} was aborted")
            if cid < self._completed_max:
                raise CheckpointStateError(
                    f"checkpoint {cid} is subsumed: checkpoint {self._completed_max} already completed")

    # -- writing

    def task_writer(self, checkpoint_id: int, task_key: str, *, alignment: str = "aligned") -> TaskStateWriter:
        """A writer for one task's state file (for in-flight data that arrives
        piecewise during an unaligned checkpoint)."""
        cid = _check_id(checkpoint_id)
        _check_key(task_key)
        _check_alignment(alignment)
        self._raise_if_dead(cid)
        return TaskStateWriter(self, cid, task_key, alignment)

    def write_task_state(self, checkpoint_id: int, task_key: str, state, inflight: Mapping | None = None, *,
                         alignment: str = "aligned") -> TaskStateHandle:
        """Write one task's state (and in-flight buffers: channel -> buffers)
        to a temporary file, then rename it. The handle's ``size`` is the bytes
        written; give the handle to ``complete()``."""
        state_enc = encode_value(state, allow_pickle=self.allow_pickle)  # refuse before creating anything
        with self.task_writer(checkpoint_id, task_key, alignment=alignment) as w:
            for channel, buffers in (inflight or {}).items():
                w.write_inflight(channel, buffers)
            w._write_encoded_state(state_enc)
        return w.handle

    def complete(self, checkpoint_id: int, tasks, *, trigger_time: float | None = None,
                 duration: float | None = None, properties: Mapping | None = None) -> CheckpointMetadata:
        """Every task acknowledged: check their files, write ``_metadata`` last,
        then keep only the newest ``retained`` complete checkpoints.

        ``tasks``: the TaskStateHandles (or their dicts), as a list or a mapping.
        ``trigger_time``: epoch seconds (default now); ``duration`` defaults to
        now minus trigger_time. ``properties``: plain data stored as is."""
        cid = _check_id(checkpoint_id)
        self._raise_if_dead(cid)
        items = tasks.values() if isinstance(tasks, Mapping) else tasks
        handles = {}
        for h in items:
            h = TaskStateHandle.from_dict(h.to_dict() if isinstance(h, TaskStateHandle) else h)
            if h.checkpoint_id != cid:
                raise ValueError(f"task {h.task_key!r} acknowledged checkpoint {h.checkpoint_id}, not {cid}")
            if h.task_key in handles:
                raise ValueError(f"task {h.task_key!r} acknowledged twice")
            handles[h.task_key] = h
        directory = self.checkpoint_path(cid)
        meta_path = f"{directory}/{METADATA_FILE}"
        if self.fs.exists(meta_path):
            raise CheckpointStateError(f"checkpoint {cid} is already complete")
        for h in handles.values():
            try:
                size = self.fs.size(f"{directory}/{h.file}")
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"checkpoint {cid}: the state file of task {h.task_key!r} "
                                              f"({h.file}) does not exist") from None
            if size != h.size:
                raise CorruptCheckpointError(f"the state file of task {h.task_key!r} has {size} bytes, "
                                             f"the task wrote {h.size}", checkpoint_id=cid, path=h.file)
        self._check_reference_sizes(cid, (properties or {}).get("references") or ())
        now = time.time()
        trigger = now if trigger_time is None else float(trigger_time)
        meta = CheckpointMetadata(cid, trigger, now, now - trigger if duration is None else float(duration),
                                  COMPLETED, handles, dict(properties or {}), self.fs.unstrip_protocol(directory))
        enc = encode_value(meta.to_dict())  # properties must be plain data: no pickle in metadata
        self.fs.makedirs(directory, exist_ok=True)
        tmp = f"{directory}/.{METADATA_FILE}.{uuid.uuid4().hex}.tmp"
        try:
            with self.fs.open(tmp, "wb") as f:
                w = _ContainerWriter(f, FILE_METADATA)
                w.value_section(SEC_METADATA, "metadata", enc)
                w.end()
                self._sync_file(f)
            self.fs.mv(tmp, meta_path)
        except BaseException:
            try:
                self.fs.rm(tmp)
            except (FileNotFoundError, OSError):
                pass
            raise
        self._sync_dir(directory)
        self._sync_dir(self.root)
        with self._lock:
            self._completed_max = max(self._completed_max, cid)
            self._aborted = {a for a in self._aborted if a > self._completed_max}
        self._prune()
        return meta

    def abort(self, checkpoint_id: int) -> None:
        """Discard a pending checkpoint and its files; later writes to it raise
        CheckpointStateError. A complete checkpoint cannot be aborted."""
        cid = _check_id(checkpoint_id)
        directory = self.checkpoint_path(cid)
        if self.fs.exists(f"{directory}/{METADATA_FILE}"):
            raise CheckpointStateError(f"checkpoint {cid} is complete; abort() only discards pending ones")
        with self._lock:
            self._aborted.add(cid)
        try:
            self.fs.rm(directory, recursive=True)
        except FileNotFoundError:
            pass

    def _remove(self, cid: int, why: str):
        directory = self.checkpoint_path(cid)
        log.info("removing checkpoint %d (%s) from %s", cid, why, self.url)
        try:
            # metadata first: a crash mid-removal leaves an incomplete checkpoint,
            # never one that looks complete but lacks files
            try:
                self.fs.rm(f"{directory}/{METADATA_FILE}")
            except FileNotFoundError:
                pass
            self.fs.rm(directory, recursive=True)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove checkpoint %d at %s: %s", cid, directory, e)

    def _prune(self):
        """Keep the newest ``retained`` complete checkpoints; remove every other
        directory below the newest complete one (superseded, abandoned, corrupt).
        Directories above it are checkpoints still in progress."""
        kept, drop = [], []
        for cid in sorted(self._ids(), reverse=True):
            if len(kept) >= self.retained:
                drop.append((cid, f"beyond the {self.retained} retained"))
                continue
            info = self._probe(cid, verify=False)
            if info.status == COMPLETED:
                kept.append(info.metadata)
            elif kept:
                drop.append((cid, "abandoned" if info.status == INCOMPLETE else f"corrupt: {info.error.reason}"))
        # files of dropped checkpoints that kept (incremental) ones refer to stay
        needed = shared.needed_files(kept)
        for cid, why in drop:
            if cid in needed:
                shared.retire(self, cid, needed[cid], why, log)
            else:
                self._remove(cid, why)

    # -- reading

    def _ids(self) -> list[int]:
        try:
            self.fs.invalidate_cache(self.root)
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        ids = []
        for name in names:
            m = _CHK_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
            if m:
                ids.append(int(m.group(1)))
        return sorted(set(ids))

    def checkpoint_ids(self) -> list[int]:
        """The ids of every ``chk-<id>`` directory, complete or not, ascending."""
        return self._ids()

    def _read_metadata(self, cid: int) -> CheckpointMetadata:
        directory = self.checkpoint_path(cid)
        path = f"{directory}/{METADATA_FILE}"
        try:
            with self.fs.open(path, "rb") as f:
                data = bytearray(f.read())
        except FileNotFoundError:
            if shared.is_retired(self, cid):
                raise CheckpointNotFoundError(
                    f"checkpoint {cid} was retired: its directory keeps only state files that later incremental "
                    "checkpoints refer to") from None
            if self.fs.exists(directory):
                raise CheckpointNotFoundError(f"checkpoint {cid} is not complete (no {METADATA_FILE})") from None
            raise CheckpointNotFoundError(f"no checkpoint {cid} under {self.url}") from None
        try:
            sections = list(_parse(_MemSource(memoryview(data)), FILE_METADATA))
            if [s.kind for s in sections] != [SEC_METADATA] or sections[0].flags:
                raise _Corrupt("expected exactly one metadata section")
            meta = CheckpointMetadata.from_dict(_decode_section(sections[0], False),
                                                self.fs.unstrip_protocol(directory))
            if meta.checkpoint_id != cid:
                raise _Corrupt(f"metadata describes checkpoint {meta.checkpoint_id}")
        except CheckpointError as e:
            raise CorruptCheckpointError(f"{METADATA_FILE}: {e}", checkpoint_id=cid, path=path) from e
        except Exception as e:
            raise CorruptCheckpointError(f"{METADATA_FILE}: {e}", checkpoint_id=cid, path=path) from e
        return meta

    def _verify_task_file(self, meta: CheckpointMetadata, h: TaskStateHandle, path: str):
        with self.fs.open(path, "rb") as f:
            src = _StreamSource(f, h.size)
            kinds = []
            for sec in _parse(src, FILE_TASK_STATE, keep=lambda kind: kind == SEC_INFO):
                kinds.append(sec.kind)
                if sec.kind == SEC_INFO:
                    _check_info(_decode_section(sec, False), h.checkpoint_id, h)
            _check_layout(kinds)
            if src.pos != h.size:
                raise _Corrupt(f"file has {src.pos} bytes, metadata says {h.size}")

    def load_metadata(self, checkpoint_id: int, *, verify: bool = True) -> CheckpointMetadata:
        """The metadata of a complete checkpoint, after checking that every task
        file exists with its recorded size and (``verify``) that every checksum
        in it holds. Raises CheckpointNotFoundError or CorruptCheckpointError."""
        cid = _check_id(checkpoint_id)
        meta = self._read_metadata(cid)
        directory = self.checkpoint_path(cid)
        for h in meta.tasks.values():
            path = f"{directory}/{h.file}"
            try:
                size = self.fs.size(path)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"the state file of task {h.task_key!r} ({h.file}) is missing",
                                             checkpoint_id=cid, path=path) from None
            if size != h.size:
                raise CorruptCheckpointError(
                    f"the state file of task {h.task_key!r} has {size} bytes, metadata says {h.size} (torn)",
                    checkpoint_id=cid, path=path)
            if verify:
                try:
                    self._verify_task_file(meta, h, path)
                except CheckpointError as e:
                    raise CorruptCheckpointError(f"task {h.task_key!r}: {e}", checkpoint_id=cid, path=path) from e
                except Exception as e:
                    raise CorruptCheckpointError(f"task {h.task_key!r}: {e}", checkpoint_id=cid, path=path) from e
        self._check_references(meta, verify)
        return meta

    def _probe(self, cid: int, verify: bool) -> CheckpointInfo:
        path = self.fs.unstrip_protocol(self.checkpoint_path(cid))
        try:
            return CheckpointInfo(cid, path, COMPLETED, metadata=self.load_metadata(cid, verify=verify))
        except CorruptCheckpointError as e:
            return CheckpointInfo(cid, path, CORRUPT, error=e)
        except CheckpointNotFoundError as e:
            return CheckpointInfo(cid, path, INCOMPLETE, error=e)

    def _report(self, info: CheckpointInfo):
        if info.status == CORRUPT:
            log.warning("skipping corrupt checkpoint %d: %s", info.checkpoint_id, info.error)
        elif info.status == INCOMPLETE:
            log.info("skipping checkpoint %d: %s", info.checkpoint_id, info.error)

    def scan(self, *, verify: bool = True) -> list[CheckpointInfo]:
        """Every checkpoint directory, oldest first, with what it is."""
        return [self._probe(cid, verify) for cid in self._ids()]

    def list_complete(self, *, verify: bool = True) -> list[CheckpointMetadata]:
        """The complete, intact checkpoints, oldest first; corrupt ones are
        logged (warning) and left out."""
        out = []
        for info in self.scan(verify=verify):
            self._report(info)
            if info.metadata is not None:
                out.append(info.metadata)
        return out

    def latest(self, *, verify: bool = True, min_id: int = 0) -> CheckpointMetadata | None:
        """The newest complete, intact checkpoint, or None. Newer torn or corrupt
        ones are logged (warning) and skipped in favour of older ones. With
        ``verify`` every task file's checksums are checked (it reads them all);
        without, only the metadata and the files' sizes. ``min_id``: only
        checkpoints from that id on (those of one run of the job)."""
        for cid in sorted((c for c in self._ids() if c >= min_id), reverse=True):
            info = self._probe(cid, verify)
            if info.metadata is not None:
                return info.metadata
            self._report(info)
        return None

    def owners(self) -> dict:
        """Which job wrote each checkpoint that has a readable ``_metadata``:
        checkpoint id -> the job's name (``properties["job"]``; None for
        metadata written before names were recorded). Task files are not
        read or checked."""
        out = {}
        for cid in self._ids():
            try:
                meta = self._read_metadata(cid)
            except CheckpointError:
                continue
            job = meta.properties.get("job")
            out[cid] = job if isinstance(job, str) else None
        return out

    def read_task_state(self, checkpoint_id: int, task_key: str, *,
                        metadata: CheckpointMetadata | None = None) -> TaskSnapshot:
        """Read one task's state and in-flight buffers from a complete checkpoint
        (every checksum is checked). Raises CheckpointNotFoundError,
        TaskStateNotFoundError, CorruptCheckpointError, PickleNotAllowedError."""
        cid = _check_id(checkpoint_id)
        _check_key(task_key)
        if metadata is None or metadata.checkpoint_id != cid:
            metadata = self._read_metadata(cid)
        h = metadata.tasks.get(task_key)
        if h is None:
            raise TaskStateNotFoundError(f"checkpoint {cid} holds no state for task {task_key!r}")
        return self._read_file(h)

    def _read_file(self, h: TaskStateHandle) -> TaskSnapshot:
        cid, task_key = h.checkpoint_id, h.task_key
        path = f"{self.checkpoint_path(cid)}/{h.file}"
        try:
            size = self.fs.size(path)
            if size != h.size:  # before allocating what the metadata claims
                raise CorruptCheckpointError(f"the state file of task {task_key!r} has {size} bytes, "
                                             f"metadata says {h.size} (torn)", checkpoint_id=cid, path=path)
            with self.fs.open(path, "rb") as f:
                data = bytearray(h.size)
                got = _StreamSource(f, h.size)._read_into(memoryview(data))
                extra = f.read(1)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"the state file of task {task_key!r} is missing",
                                         checkpoint_id=cid, path=path) from None
        try:
            if got != h.size or extra:
                raise _Corrupt(f"the file does not have the {h.size} bytes the metadata records (torn)")
            state, inflight, kinds = None, {}, []
            for sec in _parse(_MemSource(memoryview(data)), FILE_TASK_STATE):
                kinds.append(sec.kind)
                if sec.kind == SEC_INFO:
                    _check_info(_decode_section(sec, False), cid, h)
                elif sec.kind == SEC_INFLIGHT:
                    inflight.setdefault(sec.name, []).extend(_split_inflight(sec.payload))
                elif sec.kind == SEC_STATE:
                    state = _decode_section(sec, self.allow_pickle)
            _check_layout(kinds)
        except PickleNotAllowedError:
            raise
        except CheckpointError as e:
            raise CorruptCheckpointError(f"task {task_key!r}: {e}", checkpoint_id=cid, path=path) from e
        except Exception as e:
            raise CorruptCheckpointError(f"task {task_key!r}: {e}", checkpoint_id=cid, path=path) from e
        return TaskSnapshot(cid, task_key, h.alignment, state, inflight, h.state_bytes, h.inflight_bytes)


def _check_info(info, cid: int, h: TaskStateHandle):
    if type(info) is not dict:
        raise _Corrupt("INFO section is not a dict")
    found = (info.get("checkpoint_id"), info.get("task_key"), info.get("alignment"))
    if found != (cid, h.task_key, h.alignment):
        raise _Corrupt(f"file belongs to checkpoint {found[0]}, task {found[1]!r} ({found[2]}), "
                       f"not checkpoint {cid}, task {h.task_key!r} ({h.alignment})")


def _check_layout(kinds: list):
    if not kinds or kinds[0] != SEC_INFO or kinds.count(SEC_INFO) != 1 or kinds.count(SEC_STATE) != 1 \
            or not set(kinds) <= {SEC_INFO, SEC_STATE, SEC_INFLIGHT}:
        raise _Corrupt(f"task file sections {kinds} are not INFO, then in-flight sections and one STATE")


class SavepointStorage(CheckpointStorage):
    """One checkpoint in a directory of its own: a savepoint (``job.savepoint``),
    or a ``chk-<id>`` directory restored from wherever it was copied to.
    ``_metadata`` and the task files lie side by side and refer to each other
    by name only, so the directory can be moved or copied as a whole.
    Nothing here is ever pruned by retention. A copied incremental checkpoint
    refers to files it does not hold: its restore is refused.

    ``checkpoint_id``: the id of the checkpoint to write; None to open an
    existing one (its id is read from its ``_metadata``)."""

    def __init__(self, path, allow_pickle: bool = False, *, checkpoint_id: int | None = None,
                 fsync: bool = True, storage_options: Mapping | None = None):
        super().__init__(path, retained=1, allow_pickle=allow_pickle, fsync=fsync,
                         storage_options=storage_options)
        self._cid = None if checkpoint_id is None else _check_id(checkpoint_id)

    _holds_chain = False

    def __repr__(self):
        return f"SavepointStorage({self.url!r})"

    def checkpoint_path(self, checkpoint_id: int) -> str:
        return self.root

    @property
    def checkpoint_id(self) -> int:
        """The id of the checkpoint this directory holds (read from ``_metadata``)."""
        if self._cid is None:
            path = f"{self.root}/{METADATA_FILE}"
            try:
                with self.fs.open(path, "rb") as f:
                    data = bytearray(f.read())
            except FileNotFoundError:
                raise CheckpointNotFoundError(
                    f"{self.url} holds no complete checkpoint or savepoint (no {METADATA_FILE})") from None
            try:
                sections = list(_parse(_MemSource(memoryview(data)), FILE_METADATA))
                d = _decode_section(sections[0], False)
                cid = d["checkpoint_id"]
                _check_id(cid)
            except Exception as e:
                raise CorruptCheckpointError(f"{METADATA_FILE}: {e}", checkpoint_id=None, path=path) from e
            self._cid = cid
        return self._cid

    def _ids(self) -> list[int]:
        try:
            return [self.checkpoint_id]
        except CheckpointNotFoundError:
            return []

    def _prune(self):
        pass        # a savepoint belongs to the user

    def prepare_new(self) -> None:
        """Before a savepoint is written: the directory must be new or empty
        (a savepoint never mixes its files with others)."""
        try:
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            names = []
        if names:
            raise CheckpointStateError(f"the savepoint directory {self.url} exists and is not empty")
        self.fs.makedirs(self.root, exist_ok=True)

    def abort(self, checkpoint_id: int) -> None:
        cid = _check_id(checkpoint_id)
        if self.fs.exists(f"{self.root}/{METADATA_FILE}"):
            raise CheckpointStateError(f"savepoint {cid} is complete; abort() only discards pending ones")
        with self._lock:
            self._aborted.add(cid)
        try:
            self.fs.rm(self.root, recursive=True)
        except FileNotFoundError:
            pass
