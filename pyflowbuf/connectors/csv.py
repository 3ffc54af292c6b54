"""The CSV file source: byte ranges of each file, parsed in blocks by pyarrow.csv.

* **Split.** Subtask *i* of *p* reads, in every file, the lines that start in
  its share of the bytes after the header line, ``[data + (size-data)*i//p,
  data + (size-data)*(i+1)//p)``; the line across a share's end is the
  share's last. Files are read in listing order.
* **Blocks.** A share is parsed in blocks of about ``block_size`` bytes cut
  after a line end (a line longer than a block is a block of its own), one
  ``pyarrow.csv`` read each. A value holding a line break inside quotes is
  refused (``FileFormatError``), the same at every parallelism.
* **Position.** ``(file index, block start byte, rows emitted of that
  block)``: a restore at the same parallelism reads the block again and
  skips those rows. ``(number of files, 0, 0)``: the share is read.
* **Rescaling.** A restore at another parallelism (``rescale_positions``)
  gathers what every old subtask had left (its partly read block, the rest of
  its shares) and cuts it by byte ranges into runs of about the same size,
  one per new subtask, in file order (``connectors/csv_split.py``). Such a
  subtask's position is explicit, ``{"units": [[file, start, end, row],
  ...]}``, and rescales again. A restore into changed files is refused
  (``identity``).
"""
from __future__ import annotations

import numpy as np

from pyflowbuf import errors
from pyflowbuf.errors import FileFormatError
from pyflowbuf.connectors import csv_split, filesystems as fsx
from pyflowbuf.connectors.sources import file_fingerprint
from pyflowbuf.connectors.files import DEFAULT_BATCH_ROWS, DEFAULT_CSV_BLOCK, _FileSource, _check_common, _kind, _pyarrow, list_files

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
        first = next((f for f in self.files if fsx.size(f) > 0), None)
        if first is None:
            raise FileFormatError(f"{what}: every file is empty: {self.files[0]}"
                                  f"{' ...' if len(self.files) > 1 else ''}")
        self.first = first
        with fsx.open_input(first) as fh:
            head = fh.read(block_size)
            if header and b"\n" not in head:      # a header line longer than a block
                head += fh.readline()
        header_len = 0
        names = None
        if header:
            header_len, names = csv_split.header(pacsv, head, first, self.parse_options, what)
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
        self.rescaled = None        # (positions and parallelism, the plan rescale_positions gave for them)

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


class CsvFileSource(_FileSource):
    """Rows of CSV files; see the module's docstring for the split and the
    position."""

    _units = None       # after a rescaled restore: [(file, start, end, row), ...]; None: this subtask's shares
    _unit = 0           # the index in _units of the unit being read
    _pending = 0        # rows of the next block emitted before the restore (a partly read block)

    def __init__(self, plan: CsvPlan, as_, batch_size):
        super().__init__(plan.what, plan.files, as_, batch_size)
        self.plan = plan
        self._ranges = {}       # file index -> (first line start, range end) of this subtask
        self._fh = None
        self._block = None      # (file, start, end) of the block read last

    def open(self, subtask, parallelism):
        self._units, self._unit, self._pending = None, 0, 0
        super().open(subtask, parallelism)

    def _unit_name(self, start):
        return f"the block of lines at byte {start}"

    def _file(self, f):
        if self._fh is None or self._fh[0] != f:
            self._close_file()
            self._fh = (f, fsx.open_input(self.files[f]), fsx.size(self.files[f]))
        return self._fh[1]

    def _range(self, f):
        """This subtask's (start, end) in file ``f``: the lines that start in
        its share of the bytes; start is a line start, start >= end when none."""
        r = self._ranges.get(f)
        if r is not None:
            return r
        fh = self._file(f)
        size = self._fh[2]
        data = csv_split.data_start(fh, size, self.plan, self.files[f], self._pacsv)
        a, b = csv_split.share(data, size, self.subtask, self.parallelism)
        if a > data:
            a = csv_split.line_end(fh, a - 1, size)       # the line across a belongs to the range before
        self._ranges[f] = r = (a, b)
        return r

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
        if self._units is None:
            end = self._range(f)[1]
        else:
            _, _, end, row = self._units[self._unit]
            if row:
                return end          # a partly read block is read whole, as before the restore
        if self._block is not None and self._block[:2] == (f, start):
            return self._block[2]
        fh = self._file(f)
        return csv_split.block_end(fh, start, end, self._fh[2], self.plan.block_size)

    def _after(self, f, start):
        end = self._block_end(f, start)
        if self._units is not None:
            _, _, unit_end, row = self._units[self._unit]
            return (f, end) if not row and end < unit_end else self._enter(self._unit + 1)
        return (f, end) if end < self._range(f)[1] else self._first_of(f + 1)

    def _check_position(self, f, start):
        a, b = self._range(f)
        if not a <= start < b:
            raise errors.ConfigurationError(
                f"{self.what}: the checkpoint's position (file {f}, byte {start}) is not in the lines this "
                f"subtask reads ({self.subtask} of {self.parallelism}): restore with the parallelism and the "
                "files of the run that took the checkpoint")

    # ---- restored at another parallelism: explicit units (connectors/csv_split.py) ----
    def rescale_positions(self, positions, parallelism):
        """The positions of ``parallelism`` subtasks from those of every
        subtask of a checkpoint at another parallelism: the bytes not yet
        read, cut into runs of about the same size (``csv_split``)."""
        # the new subtasks of one process share the plan: it is worked out once per restore
        key = (repr(positions), parallelism)
        done = self.plan.rescaled
        if done is None or done[0] != key:
            done = self.plan.rescaled = (key, csv_split.rescale_positions(self.plan, positions, parallelism))
        return [{"units": [list(u) for u in run["units"]]} for run in done[1]]

    def seek(self, position):
        if not isinstance(position, dict):
            self._units, self._pending = None, 0
            return super().seek(position)
        files = csv_split.Files(self.plan)
        try:
            units = csv_split.parse_units(files, position)
        finally:
            files.close()
        self._drop()
        self._units, self._row, self._block = units, 0, None
        self._pos = self._enter(0)

    def _enter(self, k):
        """The first block of the first unit from ``k`` on that holds a line
        start, or None; the unit becomes the current one."""
        units = self._units
        while k < len(units):
            f, start, end, row = units[k]
            if not row:
                fh = self._file(f)
                start = csv_split.first_line_start(fh, start, self._fh[2])
            if start < end:
                self._unit, self._pending = k, row
                return (f, start)
            k += 1
        self._unit, self._pending = len(units), 0
        return None

    def _next_of_unit(self):
        if self._pending and self._it is None:
            # a block another subtask had begun before the restore: its rows up to there were emitted
            self._row = self._skip = self._pending
            self._pending = 0
        return super()._next_of_unit()

    def position(self):
        if self._units is None:
            return super().position()
        if self._pos is None:
            return {"units": []}
        f, start = self._pos
        _, _, end, unit_row = self._units[self._unit]
        row = self._pending or self._row
        if unit_row:
            here = [[f, start, end, row]]
        elif row:
            block = self._block_end(f, start)
            here = [[f, start, block, row]] + ([[f, block, end, 0]] if block < end else [])
        else:
            here = [[f, start, end, 0]]
        return {"units": here + [list(u) for u in self._units[self._unit + 1:]]}

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
            chunk = fh.read(min(left, csv_split.CHUNK))
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
