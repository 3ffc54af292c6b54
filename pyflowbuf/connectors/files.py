"""What the file sources share: arguments, listing files, turning Arrow
data into records, and the reading loop (``_FileSource``)."""
from __future__ import annotations

import os

from pyflowbuf import errors
from pyflowbuf.errors import FileFormatError
from pyflowbuf.connectors import filesystems as fsx
from pyflowbuf.connectors.sources import Source, incompatible

MODES = ("records", "tuples", "arrow", "pandas")
DEFAULT_BATCH_ROWS = 65536
DEFAULT_CSV_BLOCK = 1 << 20
_GLOB_CHARS = "*?["


def _pyarrow():
    try:  # pyarrow is an optional dependency (extra "arrow")
        import pyarrow as pa
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError("read_parquet and read_csv need pyarrow: pip install 'pyflowbuf[arrow]'") from exc
    return pa, pq, pacsv


# ---------------------------------------------------------------- arguments and files

def _check_common(what, as_, batch_size, columns):
    if as_ not in MODES:
        raise errors.ConfigurationError(f"{what}: as_ must be one of {MODES}, got {as_!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise errors.ConfigurationError(f"{what}: batch_size must be a positive int (rows), got {batch_size!r}")
    if columns is not None:
        if isinstance(columns, str) or not all(isinstance(c, str) for c in columns) or not columns:
            raise errors.ConfigurationError(
                f"{what}: columns must be a non-empty list of column names, got {columns!r}")
        columns = list(columns)
    if as_ == "pandas":
        try:
            import pandas  # noqa: F401  (optional dependency, extra "arrow")
        except ImportError as exc:
            raise ImportError(f"{what}: as_='pandas' needs pandas") from exc
    return columns


def _hidden(name: str) -> bool:
    # what a part-file sink has not committed (".part-...inprogress") and
    # metadata files ("_SUCCESS", "_common_metadata"): not data
    return name.startswith((".", "_"))


def list_files(path, what: str) -> list[str]:
    """The files ``path`` names, sorted: a file, a directory (every file below
    it, hidden names skipped), a glob pattern, or a list of these; each a
    local path or an fsspec URL (the files then named by canonical URLs)."""
    if isinstance(path, (list, tuple)):
        if not path:
            raise errors.ConfigurationError(f"{what}: the list of paths is empty")
        out = []
        for p in path:
            out.extend(list_files(p, what))
        return out
    if not isinstance(path, (str, os.PathLike)):
        raise errors.ConfigurationError(f"{what}: path must be a path, a glob or a list of them, got {path!r}")
    path = os.fspath(path)
    if fsx.isfile(path):
        return [fsx.canonical(path) if fsx.is_url(path) else path]
    if fsx.isdir(path):
        found = sorted(fsx.list_tree(path))
        if not found:
            raise fsx.not_found(what, "the directory holds no data files", path)
        return found
    if any(c in path for c in _GLOB_CHARS):
        found = sorted(fsx.glob_files(path))
        if not found:
            raise fsx.not_found(what, "no file matches the pattern", path)
        return found
    raise fsx.not_found(what, "no such file or directory", path)


def _plain_type(pa, t) -> bool:
    """Whether pyarrow turns values of type ``t`` into plain Python values the
    struct kind carries (numbers, str, bytes, bool, None, lists, dicts)."""
    types = pa.types
    if (types.is_integer(t) or types.is_floating(t) or types.is_boolean(t) or types.is_null(t)
            or types.is_string(t) or types.is_large_string(t) or types.is_binary(t)
            or types.is_large_binary(t) or types.is_fixed_size_binary(t)):
        return True
    if getattr(types, "is_string_view", None) and (types.is_string_view(t) or types.is_binary_view(t)):
        return True
    if types.is_list(t) or types.is_large_list(t) or types.is_fixed_size_list(t):
        return _plain_type(pa, t.value_type)
    if types.is_struct(t):
        return all(_plain_type(pa, t.field(i).type) for i in range(t.num_fields))
    if types.is_dictionary(t):
        return _plain_type(pa, t.value_type)
    return False


def _kind(pa, schema, as_) -> str:
    if as_ in ("arrow", "pandas"):
        return as_
    return "struct" if all(_plain_type(pa, f.type) for f in schema) else "pickle"


def _rows(as_, piece) -> list:
    """A RecordBatch slice as the records of mode ``as_``."""
    if as_ == "records":
        return piece.to_pylist()
    if as_ == "tuples":
        return list(zip(*[c.to_pylist() for c in piece.columns]))
    if as_ == "pandas":
        return [piece.to_pandas()]
    return [piece]


# ---------------------------------------------------------------- the shared reading loop

class _FileSource(Source):
    """Reads units (a Parquet row group, a CSV block) one after the other and
    hands out their rows; the position is (file, unit, rows emitted of it).

    Subclasses give ``_start()`` (the first unit of this subtask, or None),
    ``_batches(file, unit)`` (the unit's RecordBatches) and ``_after(file,
    unit)`` (the unit that follows, or None)."""

    rewindable = True

    def __init__(self, what, files, as_, batch_size):
        self.what = what
        self.files = files
        self.as_ = as_
        self.batch_size = batch_size
        self._pos = None          # (file, unit); None: nothing left
        self._row = 0
        self._it = None           # RecordBatches of the current unit
        self._buf = None
        self._off = 0
        self._skip = 0

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        self._pa, self._pq, self._pacsv = _pyarrow()
        self._pos, self._row = self._start(), 0

    # ---- position ----
    def position(self):
        if self._pos is None:
            return (len(self.files), 0, 0)
        return (self._pos[0], self._pos[1], self._row)

    def seek(self, position):
        try:
            f, unit, row = position
            if not all(type(v) is int and v >= 0 for v in (f, unit, row)):
                raise ValueError
        except (TypeError, ValueError):
            raise errors.ConfigurationError(
                f"{self.what}: {position!r} is not a position of this source "
                "(file index, unit, row: ints >= 0)") from None
        self._drop()
        if f >= len(self.files):
            self._pos, self._row = None, 0
            return
        self._check_position(f, unit)
        self._pos, self._row, self._skip = (f, unit), row, row

    def _check_position(self, f, unit):
        pass

    # The files (path, size, CRC-32 of their first and last 64 KiB) and the
    # settings that decide what a position means: a restore into other
    # files, changed files or other settings is refused. Files a source
    # reads are taken as finished: one that grew counts as changed.
    def identity(self):
        return self.plan.identity()

    def check_identity(self, recorded, position):
        mine = self.identity()
        if recorded == mine:
            return
        if not isinstance(recorded, dict) or recorded.get("kind") != mine["kind"]:
            raise incompatible(self, f"the checkpoint's source was not a {mine['kind']} ({recorded!r})")
        old, new = recorded.get("files") or [], mine["files"]
        for i in range(max(len(old), len(new))):
            a = old[i] if i < len(old) else None
            b = new[i] if i < len(new) else None
            if a != b:
                if a is None or b is None or a[0] != b[0]:
                    raise incompatible(self, f"file {i} of the listing was {a[0] if a else 'absent'} when the "
                                             f"checkpoint was taken and is {b[0] if b else 'absent'} now")
                raise incompatible(self, f"{b[0]} changed since the checkpoint (size {a[1]} -> {b[1]} bytes, "
                                         "or other contents)")
        for key in sorted(set(recorded) | set(mine)):
            if recorded.get(key) != mine.get(key):
                raise incompatible(self, f"{key} was {recorded.get(key)!r} when the checkpoint was taken, "
                                         f"it is {mine.get(key)!r} now")

    # ---- reading ----
    def next_batch(self, max_records):
        per_row = self.as_ in ("records", "tuples")
        want = max_records if per_row else 1
        out = []
        while len(out) < want:
            piece = self._take(want - len(out) if per_row else self.batch_size)
            if piece is None:
                break
            out.extend(_rows(self.as_, piece))
        return out or None

    def _take(self, limit):
        """Up to ``limit`` rows of the current unit as a RecordBatch slice,
        moving the position past them; None when the subtask's share is read."""
        while True:
            buf = self._buf
            if buf is not None and self._off < buf.num_rows:
                k = min(limit, buf.num_rows - self._off)
                piece = buf.slice(self._off, k)
                self._off += k
                self._row += k
                return piece
            if self._pos is None:
                return None
            nxt = self._next_of_unit()
            if nxt is not None:
                # after a seek: the rows the checkpoint covers were emitted already
                skip = min(self._skip, nxt.num_rows)
                self._skip -= skip
                self._buf, self._off = nxt, skip
                continue
            if self._skip:
                f, unit = self._pos
                raise FileFormatError(
                    f"{self.what}: {self.files[f]}: the checkpoint's position is row {self._row} of "
                    f"{self._unit_name(unit)}, which has only {self._row - self._skip} rows now: "
                    "the file changed since the checkpoint")
            self._buf = self._it = None
            self._pos, self._row = self._after(*self._pos), 0

    def _next_of_unit(self):
        try:
            if self._it is None:
                self._it = iter(self._batches(*self._pos))
            return next(self._it, None)
        except (OSError, ValueError) as exc:    # pyarrow's ArrowInvalid/ArrowIOError are these
            if isinstance(exc, (errors.FlowBufError, FileNotFoundError, PermissionError)):
                raise
            f, unit = self._pos
            raise FileFormatError(
                f"{self.what}: {self.files[f]}: {self._unit_name(unit)} cannot be read: {exc}") from None

    def _drop(self):
        self._buf = self._it = None
        self._off = self._skip = 0

    def close(self):
        self._drop()
