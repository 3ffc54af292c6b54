"""Monitored file sources: ``read_text`` / ``read_csv`` / ``read_parquet``
with ``monitor=seconds`` watch a directory (or a glob) and read each new file
once, as it appears (Flink's ``FileSource.monitorContinuously``, Spark's
file stream source).

* **Scanning.** Every ``monitor`` seconds each subtask lists the directory
  (every file below it, hidden ``.``/``_`` names skipped, as the bounded
  sources do) or the glob. Waiting between scans sleeps on an event that the
  task's mails and a cancel set: no core spins, and checkpoints and
  watermark ticks are not held up.
* **Stable files only.** A file is read once two scans in a row saw the same
  size and modification time, so one still being written is read when it is
  complete; an empty file is not read (yet). New stable files are read
  oldest first (modification time, then path). A writer that pauses for
  longer than ``monitor`` would be read half-written: write files under a
  hidden name and rename them into place (what ``write_text`` and
  ``write_parquet`` do).
* **Once.** Each file is read once, whole. One that changes after it was
  read is not read again (a ``UserWarning`` says so, once per file), as
  Flink's and Spark's file stream sources do.
* **Split over subtasks.** File f goes to subtask ``crc32(abspath(f)) % p``,
  the same in every process; each file is read by one subtask, from its
  first line to its last.
* **Checkpoints.** The position is a plain dict: the files read (each as
  [path, size, CRC-32 of its first and last 64 KiB]) and the file being read
  with its position inside it (``rescale_positions`` deals the positions of
  all subtasks out to another parallelism). A restore reads no file twice and every file
  found after the checkpoint once: the files read stay read, the file being
  read goes on after the last record the checkpoint covers, and a file
  being read that changed since is ``IncompatibleCheckpointError``.
* **Ending.** A monitored source does not end by itself: the job runs until
  it is cancelled (``execute_async()`` then ``cancel()``, or the timeout of
  ``execute``). With ``monitor_timeout=seconds`` it ends once the listing
  (every subtask's files) has shown nothing new for that long and its files
  are read; a file that appears after that is not read.
"""
from __future__ import annotations

import math
import numbers
import os
import threading
import time
import warnings
import zlib

from pyflowbuf import errors
from pyflowbuf.connectors.csv import CsvFileSource, CsvPlan, csv_source as bounded_csv_source
from pyflowbuf.connectors.files import _GLOB_CHARS, _check_common, _kind, _pyarrow
from pyflowbuf.connectors.parquet import ParquetFileSource, ParquetPlan, _schema_str
from pyflowbuf.connectors import filesystems as fsx
from pyflowbuf.connectors.sources import Source, TextFileSource, file_fingerprint, incompatible

# How long one pull may wait before the task gets an empty batch.
POLL_S = 0.2


def check_monitor(what, monitor, monitor_timeout):
    """``monitor`` / ``monitor_timeout`` as float seconds (or None)."""
    def seconds(name, v):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
            raise errors.ConfigurationError(f"{what}: {name} must be a number of seconds > 0, got {v!r}")
        return float(v)
    monitor = seconds("monitor", monitor)
    if monitor_timeout is not None:
        monitor_timeout = seconds("monitor_timeout", monitor_timeout)
    return monitor, monitor_timeout


def check_watched(path, what) -> str:
    """The directory or glob a monitored source watches, as a str."""
    if not isinstance(path, (str, os.PathLike)):
        raise errors.ConfigurationError(
            f"{what}: with monitor=, path must be a directory or a glob pattern, got {path!r}")
    path = os.fspath(path)
    if any(c in path for c in _GLOB_CHARS):
        return path
    if fsx.isdir(path):
        return path
    if fsx.isfile(path):
        raise errors.ConfigurationError(
            f"{what}: monitor= watches a directory or a glob for new files, and {path} is a file: "
            "read it without monitor=, or watch its directory")
    raise FileNotFoundError(f"{what}: no such directory: {path}")


def scan(path) -> dict:
    """{absolute path or canonical URL: (size, modification stamp)} of the
    files ``path`` (a directory or a glob, local or an fsspec URL) names
    now, hidden names skipped. Files that vanish while being listed are
    left out."""
    found = fsx.glob_files(path) if any(c in path for c in _GLOB_CHARS) else fsx.list_tree(path)
    return {(p if fsx.is_url(p) else os.path.abspath(p)): st for p, st in found.items()}


def owner(path: str, parallelism: int) -> int:
    """The subtask that reads ``path`` (an absolute path): the same in every process."""
    return zlib.crc32(path.encode("utf-8", "surrogateescape")) % parallelism


class MonitoredFileSource(Source):
    """Watches ``path`` and reads each new file with ``reader(path, size)``,
    a bounded Source over that one file (opened as subtask 0 of 1; ``size``:
    the bytes it had when found complete); see the module's docstring."""

    rewindable = True

    def __init__(self, what, path, reader, monitor, monitor_timeout, kind, settings):
        self.what = what
        self.path = path
        self.reader = reader
        self.monitor = monitor
        self.monitor_timeout = monitor_timeout
        self.default_kind = kind
        self.settings = settings            # what decides the records of a file (the identity)
        self.done = {}                      # path -> fingerprint [path, size, head, tail] of files read
        # files of this subtask to read: (fingerprint, None) for a stable file
        # found by a scan, (fingerprint, position in it) for one a checkpoint
        # was in the middle of
        self._queue = []
        self._previous = {}                 # path -> (size, mtime_ns) at the scan before
        self._current = None                # (fingerprint, Source) of the file being read
        self._warned = set()
        self._wake = threading.Event()
        self._next_scan = 0.0
        self._last_news = None
        self._listing = None

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        self._last_news = time.monotonic()

    def wakeup(self) -> None:
        """Make a waiting ``next_batch`` return now (a mail or a cancel came)."""
        self._wake.set()

    # ---- reading ----
    def next_batch(self, max_records):
        while True:
            cur = self._current
            if cur is not None:
                batch = cur[1].next_batch(max_records)
                if batch:
                    return batch
                self._finish_current()
                continue
            if self._queue:
                self._start(self._queue.pop(0))
                continue
            now = time.monotonic()
            if now >= self._next_scan:
                self._scan(now)
                if self._queue:
                    continue
            if (self.monitor_timeout is not None and now - self._last_news >= self.monitor_timeout
                    and not any(size > 0 for size, _ in self._previous.values())):
                # (a file of this subtask that awaits its second look holds the end back)
                return None
            wait = self._next_scan - now
            if self.monitor_timeout is not None:
                wait = min(wait, self._last_news + self.monitor_timeout - now)
            self._wake.wait(max(0.0, min(wait, POLL_S)))
            self._wake.clear()
            return []

    def _scan(self, now):
        self._next_scan = now + self.monitor
        listing = scan(self.path)
        if listing != self._listing:
            self._listing = listing
            self._last_news = now
        previous, self._previous = self._previous, {}
        queued = {fp[0] for fp, _ in self._queue}
        reading = self._current[0][0] if self._current is not None else None
        new = []
        p, me = self.parallelism, self.subtask
        for path, stat in listing.items():
            if p > 1 and owner(path, p) != me:
                continue
            done = self.done.get(path)
            if done is not None:
                if done[1] != stat[0] and path not in self._warned:
                    self._warned.add(path)
                    warnings.warn(
                        f"{self.what}: {path} changed after it was read ({done[1]} -> {stat[0]} bytes); a "
                        "monitored source reads each file once, so the change is not read. Write files under "
                        "a hidden name (.name) and rename them into place when complete", UserWarning,
                        stacklevel=2)
                continue
            if path in queued or path == reading:
                continue
            self._previous[path] = stat
            if stat[0] > 0 and previous.get(path) == stat:
                new.append((stat[1], path))
        for _, path in sorted(new):
            try:
                fp = file_fingerprint(path)
            except OSError:
                continue    # gone since the listing: a later scan sees what is there
            self._previous.pop(path, None)
            self._queue.append((fp, None))
        if new:
            self._last_news = now

    def _start(self, entry):
        fp, inner = entry
        if inner is not None:
            self._check_unchanged(fp, errors.FileFormatError)
        src = self.reader(fp[0], fp[1])
        src.open(0, 1)
        if inner is not None:
            src.seek(tuple(inner) if isinstance(inner, list) else inner)
        self._current = (fp, src)

    def _finish_current(self):
        fp, src = self._current
        src.close()
        self._current = None
        self.done[fp[0]] = fp
        self._last_news = time.monotonic()

    # ---- checkpoints ----
    # The position is plain data (lists, str, ints), so that a checkpoint
    # stores it as it is and ``rescale_positions`` can deal it out again:
    # {"read": [fingerprint, ...], "reading": [[fingerprint, position in the file], ...]}
    def position(self):
        reading = []
        if self._current is not None:
            fp, src = self._current
            reading.append([list(fp), _plain(src.position())])
        reading += [[list(fp), _plain(inner)] for fp, inner in self._queue if inner is not None]
        return {"read": [list(fp) for fp in self.done.values()], "reading": reading}

    def seek(self, position):
        read, reading = self._parse(position)
        self.done = {fp[0]: fp for fp in read}
        self._previous = {}
        if self._current is not None:
            self._current[1].close()
            self._current = None
        self._queue = list(reading)     # read on first, before any new file

    def _parse(self, position):
        try:
            read, reading = position["read"], position["reading"] or []
            read = [list(fp) for fp in read]
            reading = [(list(fp), inner) for fp, inner in reading]
            if not all(len(fp) == 4 and isinstance(fp[0], str) for fp in read + [e[0] for e in reading]):
                raise ValueError
        except (TypeError, ValueError, KeyError):
            raise errors.ConfigurationError(
                f"{self.what}: {position!r} is not a position of a monitored source") from None
        return read, reading

    @staticmethod
    def rescale_positions(positions: list, parallelism: int) -> list:
        """The positions of ``parallelism`` subtasks from those of all the
        subtasks of a checkpoint taken at another parallelism: each file read,
        and each file in the middle of being read, goes to the subtask that
        owns it at the new parallelism (``owner``). Nothing is lost or read
        twice: the files read stay read, wherever they are listed."""
        out = [{"read": [], "reading": []} for _ in range(parallelism)]
        for pos in positions:
            if pos is None:
                continue
            for fp in pos["read"]:
                out[owner(fp[0], parallelism)]["read"].append(list(fp))
            for fp, inner in pos["reading"] or []:
                out[owner(fp[0], parallelism)]["reading"].append([list(fp), inner])
        return out

    def _check_unchanged(self, fp, error):
        path = fp[0]
        try:
            now = file_fingerprint(path)
        except OSError as exc:
            raise error(f"{self.what}: the checkpoint was reading {path}, which cannot be read now ({exc})") from None
        if now != list(fp):
            raise error(f"{self.what}: the checkpoint was reading {path} ({fp[1]} bytes), which changed since "
                        f"({now[1]} bytes now, or other contents): its position would be applied to other data")

    def identity(self):
        return {**self.settings, "monitor": fsx.canonical(self.path)}

    def check_identity(self, recorded, position):
        super().check_identity(recorded, position)
        try:
            _, reading = self._parse(position)
        except errors.ConfigurationError as exc:
            raise incompatible(self, str(exc)) from None
        for fp, _ in reading:
            self._check_unchanged(fp, lambda msg: incompatible(self, msg))

    def close(self):
        if self._current is not None:
            self._current[1].close()
            self._current = None


def _plain(inner):
    return list(inner) if isinstance(inner, tuple) else inner


# ---------------------------------------------------------------- the declarations

def text_source(path, *, encoding, monitor, monitor_timeout, what):
    """``(factory, kind)`` for ``read_text(path, monitor=...)``."""
    path = check_watched(path, what)
    monitor, monitor_timeout = check_monitor(what, monitor, monitor_timeout)
    settings = {"kind": "read_text", "encoding": encoding}
    return (lambda: MonitoredFileSource(what, path, lambda p, size: TextFileSource(p, encoding, size), monitor,
                                        monitor_timeout, "str", settings)), "str"


def _first_file(path):
    """The oldest non-empty file there now, or None."""
    found = [(st[1], p) for p, st in scan(path).items() if st[0] > 0]
    return min(found)[1] if found else None


def parquet_source(path, *, columns, schema, batch_size, as_, monitor, monitor_timeout, what):
    """``(factory, kind)`` for ``read_parquet(path, monitor=...)``: the schema
    is ``schema=`` or the oldest file's there now; every file read later must
    have it (``FileFormatError`` naming the file otherwise)."""
    columns = _check_common(what, as_, batch_size, columns)
    path = check_watched(path, what)
    monitor, monitor_timeout = check_monitor(what, monitor, monitor_timeout)
    pa, _, _ = _pyarrow()
    if schema is not None and not isinstance(schema, pa.Schema):
        raise errors.ConfigurationError(f"{what}: schema must be a pyarrow.Schema, got {schema!r}")
    if schema is None:
        first = _first_file(path)
        if first is None:
            raise errors.ConfigurationError(
                f"{what}: {path} holds no file yet, so the schema of the files to come is unknown: pass "
                "schema=pyarrow.schema([...]) (of the columns read), or put a first file there")
        schema = ParquetPlan([first], columns, what).schema
    elif columns is not None:
        missing = [c for c in columns if schema.get_field_index(c) < 0]
        if missing:
            raise errors.ConfigurationError(f"{what}: schema= has no column {missing[0]!r}")
        schema = pa.schema([schema.field(c) for c in columns])

    def reader(p, size):
        plan = ParquetPlan([p], columns, what)
        if not plan.schema.equals(schema):
            raise errors.FileFormatError(
                f"{what}: {p} has the schema {_schema_str(plan.schema)}, the stream was declared with "
                f"{_schema_str(schema)}: the files of one source share a schema")
        return ParquetFileSource(plan, as_, batch_size)

    settings = {"kind": "read_parquet", "columns": columns, "schema": _schema_str(schema), "as": as_}
    return (lambda: MonitoredFileSource(what, path, reader, monitor, monitor_timeout,
                                        _kind(pa, schema, as_), settings)), _kind(pa, schema, as_)


def csv_source(path, *, columns, column_types, column_names, header, delimiter, quote_char, batch_size,
               block_size, as_, monitor, monitor_timeout, what):
    """``(factory, kind)`` for ``read_csv(path, monitor=...)``: the column
    names and types are fixed now, from the oldest file there (as a bounded
    read_csv fixes them) or, for a directory with no file yet, from
    ``column_types`` given as a full ``pyarrow.Schema``; every file read
    later is parsed with them."""
    path = check_watched(path, what)
    monitor, monitor_timeout = check_monitor(what, monitor, monitor_timeout)
    pa, _, _ = _pyarrow()
    columns = _check_common(what, as_, batch_size, columns)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1024:
        raise errors.ConfigurationError(f"{what}: block_size must be an int >= 1024 (bytes), got {block_size!r}")
    if not isinstance(header, bool):
        raise errors.ConfigurationError(f"{what}: header must be True or False, got {header!r}")
    first = _first_file(path)
    args = dict(columns=columns, header=header, delimiter=delimiter, quote_char=quote_char,
                block_size=block_size, what=what)
    if first is not None:
        # the argument checks of a bounded read_csv, on the oldest file
        bounded_csv_source([first], column_types=column_types, column_names=column_names,
                           batch_size=batch_size, as_=as_, **args)
        plan = CsvPlan([first], column_types=column_types, column_names=column_names, **args)
        names, schema, header_names = plan.names, plan.schema, plan.header_names
    elif isinstance(column_types, pa.Schema):
        names, schema, header_names = list(column_types.names), column_types, None
        if columns is not None and any(c not in names for c in columns):
            raise errors.ConfigurationError(
                f"{what}: no column {next(c for c in columns if c not in names)!r}; the columns: {names}")
        if column_names is not None and list(column_names) != names:
            raise errors.ConfigurationError(
                f"{what}: column_names {list(column_names)} and the names of column_types {names} differ")
    else:
        raise errors.ConfigurationError(
            f"{what}: {path} holds no file yet, so the columns of the files to come are unknown: pass "
            "column_types=pyarrow.schema([...]) with every column in file order, or put a first file there")
    out_schema = schema if columns is None else pa.schema([schema.field(c) for c in columns])

    def reader(p, size):
        given = column_names if column_names is not None else None if header else names
        try:
            plan = CsvPlan([p], column_types=schema, column_names=given, **args)
        except errors.ConfigurationError as exc:     # its header names other columns
            raise errors.FileFormatError(
                f"{what}: {p} does not have the columns the stream was declared with ({header_names or names}): "
                f"{exc}") from None
        if plan.names != names or (header_names is not None and plan.header_names != header_names):
            raise errors.FileFormatError(
                f"{what}: {p} has the columns {plan.header_names or plan.names}, the stream was declared with "
                f"{header_names or names}: the files of one source share their columns")
        return CsvFileSource(plan, as_, batch_size)

    settings = {"kind": "read_csv", "columns": columns, "names": names, "header": header,
                "delimiter": delimiter, "quote_char": quote_char, "block_size": block_size, "as": as_,
                "types": [str(t) for t in schema.types]}
    kind = _kind(pa, out_schema, as_)
    return (lambda: MonitoredFileSource(what, path, reader, monitor, monitor_timeout, kind, settings)), kind
