"""The Parquet file source: a row group is the unit of work."""
from __future__ import annotations



from pyflowbuf import errors
from pyflowbuf.errors import FileFormatError
from pyflowbuf.connectors import filesystems as fsx
from pyflowbuf.connectors.sources import file_fingerprint
from pyflowbuf.connectors.files import DEFAULT_BATCH_ROWS, _FileSource, _check_common, _kind, _pyarrow, list_files

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
        if fsx.is_url(path):
            fs, p = fsx.url_fs(path)
            return pq.ParquetFile(p, filesystem=fs)
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
        self._units = self._strided = every[subtask::parallelism]
        self._index = {u: i for i, u in enumerate(self._units)}
        super().open(subtask, parallelism)

    def _start(self):
        return self._units[0] if self._units else None

    def _after(self, f, g):
        i = self._index[(f, g)] + 1
        return self._units[i] if i < len(self._units) else None

    def _unit_name(self, g):
        return f"row group {g}"

    # ---- restored at another parallelism: an explicit list of row groups ----
    _skips: dict = {}           # (file, row group) -> rows emitted before the restore

    def rescale_positions(self, positions, parallelism):
        """The positions of ``parallelism`` subtasks from those of every
        subtask of a checkpoint at another parallelism: the row groups not
        yet read (the one each subtask was in, from the row it had reached),
        in file order, dealt out in turn."""
        every = [(f, g) for f, groups in enumerate(self.plan.row_groups) for g in range(len(groups))]
        left = []
        for j, pos in enumerate(positions):
            if isinstance(pos, dict):
                left.extend(tuple(u) for u in pos["units"])
                continue
            f, g, row = pos
            if f >= len(self.files):
                continue        # that subtask had read its share
            mine = every[j::len(positions)]
            try:
                at = mine.index((f, g))
            except ValueError:
                raise errors.ConfigurationError(
                    f"{self.what}: the checkpoint's position (file {f}, row group {g}) is not one subtask {j} of "
                    f"{len(positions)} reads: restore with the files of the run that took the checkpoint") from None
            left.append((f, g, row))
            left.extend((uf, ug, 0) for uf, ug in mine[at + 1:])
        left.sort()
        return [{"units": [list(u) for u in left[i::parallelism]]} for i in range(parallelism)]

    def seek(self, position):
        if not isinstance(position, dict):
            self._skips = {}
            return super().seek(position)
        units = [tuple(u) for u in position["units"]]
        self._drop()
        self._units = [(f, g) for f, g, _ in units]
        self._index = {u: i for i, u in enumerate(self._units)}
        self._skips = {(f, g): row for f, g, row in units[1:] if row}
        if not units:
            self._pos, self._row = None, 0
            return
        f, g, row = units[0]
        self._pos, self._row, self._skip = (f, g), row, row

    def position(self):
        if not self._skips and self._units == self._strided:
            return super().position()
        if self._pos is None:
            return {"units": []}
        at = self._index[self._pos]
        row = self._skips.get(self._pos, self._row)      # (a skip not yet taken: that many were emitted)
        return {"units": [[*self._pos, row]] +
                         [[f, g, self._skips.get((f, g), 0)] for f, g in self._units[at + 1:]]}

    def _next_of_unit(self):
        if self._it is None and self._skips and self._row == 0:
            # a row group another subtask had begun before the restore
            s = self._skips.pop(self._pos, 0)
            self._row = self._skip = s
        return super()._next_of_unit()

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
