"""File connectors a Python user expects: Parquet and CSV file sources read
through pyarrow, and ``print()``.

Both sources split their files over the source's subtasks and keep a position
that a checkpoint records and a recovery seeks to, so a restored job reads on
from the row after the last one the checkpoint covers:

* Parquet: the unit of work is a row group. Subtask i of p takes every p-th
  row group of the listing (files sorted by path, row groups in file order).
  The position is ``(file index, row group, rows of it already emitted)``.
* CSV: the data of each file (after its header line) is cut into p byte
  ranges, and a range owns the lines that start inside it. A range is read in
  blocks that end at a line end, each parsed by pyarrow.csv with the schema
  fixed when the stream was declared, so every block gets the same column
  types. The position is ``(file index, block start byte, rows of the block
  already emitted)``: blocks are cut the same way every time, so a restored
  subtask parses the same block and skips the rows it emitted before.

What ``as_=`` makes a record:

* ``"records"``: a dict per row, column name to value, as pyarrow's
  ``Table.to_pylist()`` and pandas' ``to_dict("records")`` give them;
* ``"tuples"``: a tuple per row, in column order (cheaper to make);
* ``"arrow"``: a ``pyarrow.RecordBatch`` of up to ``batch_size`` rows;
* ``"pandas"``: a ``pandas.DataFrame`` of up to ``batch_size`` rows.

Dicts and tuples of plain values (numbers, strings, bytes, bools, None, lists
and structs of them) travel as the ``struct`` kind, which crosses processes;
columns that become other Python objects (timestamps, dates, decimals) make
the stream ``pickle``, which needs ``allow_pickle`` with ``workers=``, or read
them with ``as_="arrow"``.
"""
from __future__ import annotations

import errno
import glob
import os
import sys
from typing import Any

import numpy as np

from pyflowbuf import errors
from pyflowbuf.errors import FileFormatError  # defined with the other errors; public here as before
from pyflowbuf.runtime.operators import Operator
from pyflowbuf.runtime.sources import Source, file_fingerprint, incompatible

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
    it, hidden names skipped), a glob pattern, or a list of these."""
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
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        found = []
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not _hidden(d))
            found.extend(os.path.join(root, f) for f in files if not _hidden(f))
        if not found:
            raise FileNotFoundError(errno.ENOENT, f"{what}: the directory holds no data files", path)
        return sorted(found)
    if any(c in path for c in _GLOB_CHARS):
        found = sorted(p for p in glob.glob(path, recursive=True)
                       if os.path.isfile(p) and not _hidden(os.path.basename(p)))
        if not found:
            raise FileNotFoundError(errno.ENOENT, f"{what}: no file matches the pattern", path)
        return found
    raise FileNotFoundError(errno.ENOENT, f"{what}: no such file or directory", path)


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


# ---------------------------------------------------------------- Parquet

class ParquetPlan:
    """What a Parquet source reads, checked when the stream is declared: the
    files, their row groups and one schema (of ``columns`` when given)."""

    def __init__(self, path, columns, what):
        pa, pq, _ = _pyarrow()
        self.what = what
        self.files = list_files(path, what)
        self.row_groups = []      # rows per row group, per file
        self.schema = None
        for f in self.files:
            pf = _parquet_file(pq, f, what)
            meta, schema = pf.metadata, pf.schema_arrow
            _close(pf)
            if columns is not None:
                missing = [c for c in columns if schema.get_field_index(c) < 0]
                if missing:
                    raise errors.ConfigurationError(
                        f"{what}: {f} has no column {missing[0]!r}; its columns: {schema.names}")
                schema = pa.schema([schema.field(c) for c in columns])
            if self.schema is None:
                self.schema, first = schema, f
            elif not schema.equals(self.schema):
                raise FileFormatError(
                    f"{what}: {f} has the schema {_schema_str(schema)}, {first} has "
                    f"{_schema_str(self.schema)}: the files of one source share a schema "
                    "(or pick common columns with columns=)")
            self.row_groups.append([meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
        self.columns = columns
        self._identity = None

    def identity(self) -> dict:
        if self._identity is None:
            self._identity = {"kind": "read_parquet", "files": [file_fingerprint(f) for f in self.files],
                              "columns": self.columns, "row_groups": self.row_groups}
        return self._identity


def _close(pf):
    close = getattr(pf, "close", None)
    if close is not None:
        close()


def _schema_str(schema) -> str:
    return "(" + ", ".join(f"{f.name}: {f.type}" for f in schema) + ")"


def _parquet_file(pq, path, what):
    try:
        return pq.ParquetFile(path)
    except (OSError, ValueError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise FileFormatError(f"{what}: {path} is not a readable Parquet file: {exc}") from None


class ParquetFileSource(_FileSource):
    """Rows of Parquet files; see the module's docstring for the split and
    the position."""

    def __init__(self, plan: ParquetPlan, as_, batch_size):
        super().__init__(plan.what, plan.files, as_, batch_size)
        self.plan = plan
        self._file = None       # (index, ParquetFile) of the file being read

    def open(self, subtask, parallelism):
        every = [(f, g) for f, groups in enumerate(self.plan.row_groups) for g in range(len(groups))]
        self._units = every[subtask::parallelism]
        self._index = {u: i for i, u in enumerate(self._units)}
        super().open(subtask, parallelism)

    def _start(self):
        return self._units[0] if self._units else None

    def _after(self, f, g):
        i = self._index[(f, g)] + 1
        return self._units[i] if i < len(self._units) else None

    def _unit_name(self, g):
        return f"row group {g}"

    def _check_position(self, f, g):
        if (f, g) not in self._index:
            raise errors.ConfigurationError(
                f"{self.what}: the checkpoint's position (file {f}, row group {g}) is not one this subtask "
                f"reads ({self.subtask} of {self.parallelism}): restore with the parallelism and the files "
                "of the run that took the checkpoint")

    def _batches(self, f, g):
        pf = self._open_file(f)
        return pf.iter_batches(batch_size=self.batch_size, row_groups=[g], columns=self.plan.columns,
                               use_threads=False)

    def _open_file(self, f):
        if self._file is None or self._file[0] != f:
            self._close_file()
            pf = _parquet_file(self._pq, self.files[f], self.what)
            schema = pf.schema_arrow
            if self.plan.columns is not None:
                if any(schema.get_field_index(c) < 0 for c in self.plan.columns):
                    schema = None
                else:
                    schema = self._pa.schema([schema.field(c) for c in self.plan.columns])
            if schema is None or not schema.equals(self.plan.schema):
                raise FileFormatError(f"{self.what}: {self.files[f]} changed its schema since the stream "
                                      "was declared")
            self._file = (f, pf)
        return self._file[1]

    def _close_file(self):
        if self._file is not None:
            _close(self._file[1])
            self._file = None

    def close(self):
        super().close()
        self._close_file()


def parquet_source(path, *, columns=None, batch_size=DEFAULT_BATCH_ROWS, as_="records",
                   what="read_parquet"):
    """``(factory, kind)`` for ``Environment.read_parquet``: the files are
    listed and their footers read now, so a missing or broken file is an
    error where the stream is declared."""
    columns = _check_common(what, as_, batch_size, columns)
    plan = ParquetPlan(path, columns, what)
    pa, _, _ = _pyarrow()
    return (lambda: ParquetFileSource(plan, as_, batch_size)), _kind(pa, plan.schema, as_)


# ---------------------------------------------------------------- CSV

# Only an unquoted empty field is None (pyarrow's default list also makes
# "NA", "null", "N/A", "#N/A", "NaN"... None, in string columns too)
_NULL_VALUES = [""]


def _quoted_line_break(data: bytes, quote, delimiter: bytes) -> int:
    """The offset in ``data`` (whole lines) of the first line end that lies
    inside a quoted value, or -1. Decided line by line, so the same lines are
    refused however the file is split: a line with an even number of quote
    characters closes what it opens (one vectorized pass finds the others,
    and only for blocks that hold a quote at all); a line with an odd number
    is read as the CSV parser does, since a quote inside an unquoted field
    (12" screen) is a plain character."""
    if quote is None or data.find(quote) < 0:
        return -1
    a = np.frombuffer(data, np.uint8)
    parity = np.cumsum(a == quote[0], dtype=np.uint8) & 1       # mod 256 keeps the parity
    ends = np.flatnonzero(a == 10)
    if not len(ends) or ends[-1] != len(data) - 1:
        ends = np.append(ends, len(data) - 1)                    # a last line without a newline
    at_end = parity[ends]
    odd_lines = np.flatnonzero(at_end ^ np.concatenate(([0], at_end[:-1])).astype(np.uint8))
    for j in odd_lines:
        first = 0 if j == 0 else int(ends[j - 1]) + 1
        if _ends_inside_quotes(data[first:int(ends[j]) + 1], quote, delimiter):
            return int(ends[j])
    return -1


def _ends_inside_quotes(line: bytes, quote: bytes, delimiter: bytes) -> bool:
    """Whether a quoted value opened on ``line`` (a quote at the start of a
    field) is still open at its end; "" inside a quoted value is a quote."""
    q, d = quote[0], delimiter[0]
    inside, field_start, i, n = False, True, 0, len(line)
    while i < n:
        c = line[i]
        i += 1
        if inside:
            if c == q:
                if i < n and line[i] == q:
                    i += 1
                else:
                    inside = False
        elif c == q and field_start:
            inside, field_start = True, False
        else:
            field_start = c == d
    return inside


def _first_bad_utf8_line(data: bytes, first_line: int) -> int:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return first_line + data.count(b"\n", 0, exc.start)
    return first_line


class CsvPlan:
    """What a CSV source reads, fixed when the stream is declared: the files,
    the column names (the first file's header line, ``column_names``, or
    f0, f1, ..) and the column types (``column_types``, the rest inferred
    from the first block of the first file)."""

    def __init__(self, path, *, columns, column_types, column_names, header, delimiter, quote_char,
                 block_size, what):
        pa, _, pacsv = _pyarrow()
        self.what = what
        self.files = list_files(path, what)
        self.header = header
        self.block_size = block_size
        try:
            self.parse_options = pacsv.ParseOptions(delimiter=delimiter, quote_char=quote_char)
        except (TypeError, ValueError) as exc:
            raise errors.ConfigurationError(f"{what}: delimiter/quote_char: {exc}") from None
        self.quote = quote_char.encode() if isinstance(quote_char, str) and quote_char else None
        self.delimiter = delimiter.encode()
        # an empty file has no rows and no header; the first other one gives them
        first = next((f for f in self.files if os.path.getsize(f) > 0), None)
        if first is None:
            raise FileFormatError(f"{what}: every file is empty: {self.files[0]}"
                                  f"{' ...' if len(self.files) > 1 else ''}")
        self.first = first
        with open(first, "rb") as fh:
            head = fh.read(block_size)
            if header and b"\n" not in head:      # a header line longer than a block
                head += fh.readline()
        header_len = 0
        names = None
        if header:
            header_len, names = _header(pacsv, head, first, self.parse_options, what)
        self.header_names = names        # what every file's header line must say
        if column_names is not None:
            column_names = list(column_names)
            if names is not None and len(names) != len(column_names):
                raise errors.ConfigurationError(
                    f"{what}: column_names has {len(column_names)} names and the header of {first} "
                    f"{len(names)} columns")
            names = column_names
        body = head[header_len:]
        cut = body.rfind(b"\n")
        sample = body[:cut + 1] if cut >= 0 and len(head) == block_size else body
        overrides = _column_types(pa, column_types, what)
        self.names = names
        self.schema = self._infer(pa, pacsv, sample, overrides, first)
        if columns is not None:
            missing = [c for c in columns if c not in self.schema.names]
            if missing:
                raise errors.ConfigurationError(
                    f"{what}: no column {missing[0]!r}; the columns: {self.schema.names}")
            self.out_schema = pa.schema([self.schema.field(c) for c in columns])
        else:
            self.out_schema = self.schema
        self.columns = columns
        self._identity = None

    def identity(self) -> dict:
        if self._identity is None:
            po = self.parse_options
            self._identity = {"kind": "read_csv", "files": [file_fingerprint(f) for f in self.files],
                              "columns": self.columns, "names": self.names, "header": self.header,
                              "block_size": self.block_size, "delimiter": po.delimiter,
                              "quote_char": po.quote_char}
        return self._identity

    def _infer(self, pa, pacsv, sample, overrides, path):
        read = pacsv.ReadOptions(column_names=self.names, autogenerate_column_names=self.names is None,
                                 use_threads=False, block_size=max(len(sample) + 1, 1 << 16))
        conv = pacsv.ConvertOptions(column_types=overrides, strings_can_be_null=True,
                                    quoted_strings_can_be_null=False, null_values=_NULL_VALUES)
        try:
            table = pacsv.read_csv(pa.BufferReader(sample), read_options=read,
                                   parse_options=self.parse_options, convert_options=conv)
        except pa.ArrowInvalid as exc:
            if self.names is not None and not sample.strip():
                return pa.schema([(n, overrides.get(n, pa.string())) for n in self.names])
            raise FileFormatError(f"{self.what}: {path}: the first rows do not parse: {exc}") from None
        if self.names is None:
            self.names = table.column_names
        binary = [f.name for f in table.schema if pa.types.is_binary(f.type) and f.name not in overrides]
        if binary:
            line = _first_bad_utf8_line(sample, 2 if self.header else 1)
            raise FileFormatError(
                f"{self.what}: {path}, line {line}: column {binary[0]!r} holds bytes that are not UTF-8 text: "
                "read_csv reads UTF-8 files (convert the file), or pass column_types={"
                f"{binary[0]!r}: 'binary'}} to get the raw bytes")
        unknown = [n for n in overrides if n not in self.names]
        if unknown:
            raise errors.ConfigurationError(
                f"{self.what}: column_types names {unknown[0]!r}, which is not a column; the columns: "
                f"{self.names}")
        # a column all empty in the sample is inferred as null, which no later
        # value would fit: it is read as strings unless column_types says
        return pa.schema([pa.field(f.name, pa.string()) if pa.types.is_null(f.type) and f.name not in overrides
                          else f for f in table.schema])


def _column_types(pa, column_types, what):
    if column_types is None:
        return {}
    if isinstance(column_types, pa.Schema):
        return {f.name: f.type for f in column_types}
    if isinstance(column_types, dict):
        out = {}
        for name, t in column_types.items():
            if not isinstance(t, pa.DataType):
                try:
                    t = pa.type_for_alias(t) if isinstance(t, str) else None
                except ValueError:
                    t = None
                if t is None:
                    raise errors.ConfigurationError(
                        f"{what}: column_types[{name!r}] must be a pyarrow type or its name "
                        f"('int64', 'string', ...), got {column_types[name]!r}")
            out[name] = t
        return out
    raise errors.ConfigurationError(
        f"{what}: column_types must be a pyarrow.Schema or a dict of column name to type, got {column_types!r}")


def _header(pacsv, head: bytes, path, parse_options, what):
    """(length in bytes of the header line, its column names)."""
    import pyarrow as pa  # optional dependency, present: the caller got pacsv from it

    end = head.find(b"\n")
    line = head if end < 0 else head[:end + 1]
    if not line.strip():
        raise FileFormatError(f"{what}: {path} has no header line (pass header=False for files without one)")
    try:
        # a file that is only a header line may lack its final newline: no rows
        names = pacsv.read_csv(pa.BufferReader(line if end >= 0 else line + b"\n"), parse_options=parse_options,
                               read_options=pacsv.ReadOptions(use_threads=False)).column_names
    except pa.ArrowInvalid as exc:
        raise FileFormatError(f"{what}: {path}: the header line does not parse: {exc}") from None
    except UnicodeDecodeError as exc:
        raise FileFormatError(f"{what}: {path}, line 1: the header line is not UTF-8 text ({exc.reason} at "
                              f"byte {exc.start}){_not_csv_hint(head)}") from None
    return len(line), names


def _not_csv_hint(head: bytes) -> str:
    if head.startswith(b"PAR1"):
        return "; the file is Parquet: read it with read_parquet"
    return "; read_csv reads UTF-8 (or ASCII) files: convert the file to UTF-8"


class CsvFileSource(_FileSource):
    """Rows of CSV files; see the module's docstring for the split and the
    position."""

    _CHUNK = 1 << 16

    def __init__(self, plan: CsvPlan, as_, batch_size):
        super().__init__(plan.what, plan.files, as_, batch_size)
        self.plan = plan
        self._ranges = {}       # file index -> (first line start, range end) of this subtask
        self._fh = None
        self._block = None      # (file, start, end) of the block read last

    def _unit_name(self, start):
        return f"the block of lines at byte {start}"

    def _file(self, f):
        if self._fh is None or self._fh[0] != f:
            self._close_file()
            self._fh = (f, open(self.files[f], "rb"))
        return self._fh[1]

    def _range(self, f):
        """This subtask's (start, end) in file ``f``: the lines that start in
        its share of the bytes; start is a line start, start >= end when none."""
        r = self._ranges.get(f)
        if r is not None:
            return r
        fh = self._file(f)
        size = os.fstat(fh.fileno()).st_size
        data = 0
        if size == 0:
            self._ranges[f] = r = (0, 0)
            return r
        if self.plan.header:
            fh.seek(0)
            head = fh.read(min(size, self.plan.block_size)) if size else b""
            if len(head) == self.plan.block_size and b"\n" not in head:
                head += self._read_to_line_end(fh, len(head))
            data, names = _header(self._pacsv, head, self.files[f], self.plan.parse_options, self.what)
            if names != self.plan.header_names:
                raise FileFormatError(
                    f"{self.what}: {self.files[f]} has the header {names}, {self.plan.first} has "
                    f"{self.plan.header_names}: the files of one source share their columns")
        p, i = self.parallelism, self.subtask
        a = data + (size - data) * i // p
        b = data + (size - data) * (i + 1) // p
        if a > data:
            a = self._line_end(fh, a - 1, size)       # the line across a belongs to the range before
        self._ranges[f] = r = (a, b)
        return r

    def _read_to_line_end(self, fh, pos):
        fh.seek(pos)
        parts = []
        while True:
            chunk = fh.read(self._CHUNK)
            if not chunk:
                break
            k = chunk.find(b"\n")
            if k >= 0:
                parts.append(chunk[:k + 1])
                break
            parts.append(chunk)
        return b"".join(parts)

    def _line_end(self, fh, pos, size):
        """The offset after the line end at or after ``pos`` (the file's size
        when the last line has none)."""
        return min(pos + len(self._read_to_line_end(fh, pos)), size)

    def _first_of(self, f):
        """The first unit of this subtask at or after file ``f``."""
        while f < len(self.files):
            a, b = self._range(f)
            if a < b:
                return (f, a)
            f += 1
        return None

    def _start(self):
        return self._first_of(0)

    def _block_end(self, f, start):
        if self._block is not None and self._block[:2] == (f, start):
            return self._block[2]
        a, b = self._range(f)
        fh = self._file(f)
        size = os.fstat(fh.fileno()).st_size
        if start + self.plan.block_size >= b:
            return self._line_end(fh, b - 1, size)
        fh.seek(start)
        chunk = fh.read(self.plan.block_size)
        k = chunk.rfind(b"\n")
        if k >= 0:
            return start + k + 1
        return self._line_end(fh, start + len(chunk), size)      # a line longer than a block

    def _after(self, f, start):
        end = self._block_end(f, start)
        return (f, end) if end < self._range(f)[1] else self._first_of(f + 1)

    def _check_position(self, f, start):
        a, b = self._range(f)
        if not a <= start < b:
            raise errors.ConfigurationError(
                f"{self.what}: the checkpoint's position (file {f}, byte {start}) is not in the lines this "
                f"subtask reads ({self.subtask} of {self.parallelism}): restore with the parallelism and the "
                "files of the run that took the checkpoint")

    def _batches(self, f, start):
        pa, pacsv, plan = self._pa, self._pacsv, self.plan
        end = self._block_end(f, start)
        self._block = (f, start, end)
        fh = self._file(f)
        fh.seek(start)
        data = fh.read(end - start)
        read = pacsv.ReadOptions(column_names=plan.names, use_threads=False,
                                 block_size=max(len(data) + 1, 1 << 16))
        conv = pacsv.ConvertOptions(column_types=plan.schema, include_columns=plan.columns,
                                    strings_can_be_null=True, quoted_strings_can_be_null=False,
                                    null_values=_NULL_VALUES)
        bad = _quoted_line_break(data, plan.quote, plan.delimiter)
        if bad >= 0:
            line = self._line_number(fh, start + bad)
            raise FileFormatError(
                f"{self.what}: {self.files[f]}, line {line} (byte {start + bad}): a line break inside a quoted "
                "value (a quote that opens a field and is not closed on its line). read_csv splits files at line "
                "ends (over its subtasks and in blocks), so it refuses such values rather than read them "
                "differently at each parallelism: remove the line breaks from the values, or read the file "
                "with pyarrow.csv / pandas")
        try:
            table = pacsv.read_csv(pa.BufferReader(data), read_options=read, parse_options=plan.parse_options,
                                   convert_options=conv)
        except pa.ArrowInvalid as exc:
            line = self._line_number(fh, start)
            raise FileFormatError(
                f"{self.what}: {self.files[f]}, in the lines from line {line} (byte {start}) on: {exc}. "
                "(read_csv splits files at line ends: values with line breaks inside quotes are not "
                "supported; a column of another type than the first rows showed needs column_types=)"
            ) from None
        return table.to_batches()

    def _line_number(self, fh, offset):
        fh.seek(0)
        lines, left = 1, offset
        while left > 0:
            chunk = fh.read(min(left, self._CHUNK))
            if not chunk:
                break
            lines += chunk.count(b"\n")
            left -= len(chunk)
        return lines

    def _close_file(self):
        if self._fh is not None:
            self._fh[1].close()
            self._fh = None

    def close(self):
        super().close()
        self._close_file()


def csv_source(path, *, columns=None, column_types=None, column_names=None, header=True, delimiter=",",
               quote_char='"', batch_size=DEFAULT_BATCH_ROWS, block_size=DEFAULT_CSV_BLOCK, as_="records",
               what="read_csv"):
    """``(factory, kind)`` for ``Environment.read_csv``: the files are listed,
    the header read and the column types fixed now."""
    columns = _check_common(what, as_, batch_size, columns)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1024:
        raise errors.ConfigurationError(f"{what}: block_size must be an int >= 1024 (bytes), got {block_size!r}")
    if not isinstance(header, bool):
        raise errors.ConfigurationError(f"{what}: header must be True or False, got {header!r}")
    if column_names is not None and (isinstance(column_names, str)
                                     or not all(isinstance(c, str) for c in column_names)):
        raise errors.ConfigurationError(f"{what}: column_names must be a list of str, got {column_names!r}")
    plan = CsvPlan(path, columns=columns, column_types=column_types, column_names=column_names, header=header,
                   delimiter=delimiter, quote_char=quote_char, block_size=block_size, what=what)
    pa, _, _ = _pyarrow()
    return (lambda: CsvFileSource(plan, as_, batch_size)), _kind(pa, plan.out_schema, as_)


# ---------------------------------------------------------------- print

class PrintSink(Operator):
    """``Stream.print()``: each record on stdout as ``str(record)``, after a
    prefix as PyFlink's print() writes it: ``"<subtask>> "`` (counted from 1)
    when the sink has several subtasks, ``"<prefix>> "`` or
    ``"<prefix>:<subtask>> "`` with a prefix, none otherwise. A batch is one
    write. Not transactional: after a restore, records since the checkpoint
    print again (at least once, as Flink's print sink)."""

    kind = "sink"

    def __init__(self, name, prefix: str | None = None, stream: Any = None):
        super().__init__(name)
        self.prefix = prefix
        self.stream = stream

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        label = self.prefix or ""
        if parallelism > 1:
            label = f"{label}:{subtask + 1}" if label else str(subtask + 1)
        self._head = f"{label}> " if label else ""

    def process_batch(self, batch):
        if batch:
            out = self.stream if self.stream is not None else sys.stdout
            head = self._head
            out.write("".join([f"{head}{r}\n" for r in batch]))
            out.flush()
        return []
