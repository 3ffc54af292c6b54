"""Sinks: the last operator of a chain; they return nothing downstream.

``CollectSink`` and ``FunctionSink`` hand batches to the driver or to a user
function; the part-file sinks (text, Parquet) are connector sinks (``fb.Sink``) that
write files a checkpoint commits (see ``connectors/outputs.py`` for the
output modes and the commit).
"""
from __future__ import annotations

import numpy as np

from pyflowbuf import errors
from pyflowbuf.connectors import api as connector_api
from pyflowbuf.connectors import outputs
from pyflowbuf.connectors.outputs import FileOutput
from pyflowbuf.operators.contracts import Operator, _is_dataframe
from pyflowbuf.serializers import short_repr


class CollectSink(Operator):
    kind = "sink"

    def __init__(self, name, target: list):
        super().__init__(name)
        self.target = target

    _keep = 0

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        # After a restore, the records the checkpoint covers stay and the rest
        # (emitted by the failed attempt after it) go: they will come again.
        self.out = self.target.setdefault(subtask, [])
        del self.out[self._keep:]

    def snapshot_state(self):
        return {"records": len(self.out)}

    def restore_state(self, state):
        self._keep = state["records"] if state else 0

    def rescale_state(self, states, index, parallelism):
        # the kept count is about this process's list of an earlier attempt;
        # a job restored at another parallelism starts new lists
        return None

    def process_batch(self, batch):
        if batch and type(batch[0]) in _PLAIN:
            self.out.extend(batch)
        else:
            # Records read zero-copy (memoryviews of large bytes records, NumPy
            # views of rows) hold their segment: keeping them would pin the
            # producer's pool until it runs dry, so the result keeps copies.
            self.out.extend(map(_detach, batch))
        return []


_PLAIN = (int, float, str)


def _detach(x):
    t = type(x)
    if t is memoryview:
        return x.tobytes()
    if t is np.ndarray and x.base is not None:
        return x.copy()
    if t.__module__.startswith("pyarrow") and hasattr(x, "schema"):
        return _copy_arrow(x)
    return x


def _copy_arrow(x):
    """A RecordBatch/Table whose buffers are the Arrow library's own (one copy)."""
    import pyarrow as pa  # optional dependency, present: x is Arrow data

    out = pa.BufferOutputStream()
    with pa.ipc.new_stream(out, x.schema) as w:
        w.write(x)
    reader = pa.ipc.open_stream(out.getvalue())
    return reader.read_next_batch() if isinstance(x, pa.RecordBatch) else reader.read_all()


class FunctionSink(Operator):
    kind = "sink"

    def __init__(self, name, fn, batched: bool):
        super().__init__(name)
        self.fn = fn
        self.batched = batched

    def process_batch(self, batch):
        if self.batched:
            self.fn(batch)
        else:
            fn = self.fn
            for x in batch:
                fn(x)
        return []


class _PartFileSink(connector_api.Sink):
    """A file sink: ``path`` is a directory of part files
    ``part-<subtask>-<seq><suffix>`` (``pyflowbuf.connectors.outputs``), each
    written under a hidden name and renamed into place when committed. It is
    a connector sink (``fb.Sink``, run by ``ConnectorSinkOperator``): a part
    closes at each checkpoint's barrier, its rename (``["rename", pending
    path, final path]``) is the committable, and committing it renames the
    part, in the subtask when a checkpoint covering it completes (or on
    restore), by the driver for the last part at the end of input: Flink's
    two-phase commit, so readers never see records a recovery will write
    again. Without checkpoints a subtask writes one part, committed when its
    input ends. Subclasses write the file (``_open_file``, ``_write``,
    ``_close_file``: whether it left a part to commit, ``_has_file``)."""

    suffix = ""

    def __init__(self, name, path, transactional=False, output=None):
        self.name = name
        self.output = output if output is not None else FileOutput(path, self.suffix, what=name)
        self.path = self.output.path     # a local path or a canonical fsspec URL
        self.dir = self.output.dir       # where the files are listed, written and renamed
        self.transactional = transactional
        self.seq = None
        self.subtask = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # checkpoints and derived ids name it as when it was an operator of its own
        cls._type_name = cls.__name__

    def open(self, subtask, parallelism):
        self.subtask, self.parallelism = subtask, parallelism
        self.output.check_process()
        self.dir.makedirs()
        restored = self.seq is not None
        if not restored:
            self.seq = self.output.seq_start
        # What an earlier attempt left will be written again: its parts after
        # the checkpoint restored now (pending, or committed by a later
        # checkpoint). Pending parts before it are the checkpoint's own
        # committables, which commit once this returns; a fresh start has none.
        for name in self.dir.names():
            p = self.output.parse(name)
            if p is not None and p[0] == subtask and (p[1] >= self.seq if restored else p[2]):
                self.dir.remove(name)
        self._remove_orphans()
        if not self.transactional:
            self._open_file(self._name(True))

    def _part(self, hidden: bool) -> str:
        return self.output.part_path(self.subtask, self.seq, hidden)

    def _name(self, hidden: bool) -> str:
        return self.output.part_name(self.subtask, self.seq, hidden)

    def write(self, batch):
        if not self._has_file():
            self._open_file(self._name(True))
        self._write(batch)

    @property
    def _commit_directory(self):
        """Where its commits rename files: recorded with its state, so that a
        restore dropping that state can name it."""
        return self.path if self.transactional else None

    def prepare_commit(self, checkpoint_id):
        """The part written since the last barrier closes; its rename is the committable."""
        if not self._has_file() or not self._close_file():
            return []
        action = ["rename", self._part(True), self._part(False)]
        self.seq += 1
        return [action]

    def _check_committables(self, committables) -> None:
        outputs.check_renames(committables, self.output)

    def commit(self, committables):
        outputs.commit_renames(committables, self.output)

    def abort(self):
        # the part being written stays hidden; the next attempt removes it
        if self._has_file():
            try:
                self._close_file()
            except Exception:       # noqa: BLE001 - the subtask failed already
                pass

    def snapshot_state(self):
        if not self.transactional:
            return None
        if self._orphans:
            # kept from rescale to rescale: a later one that brings such a
            # subtask back numbers its parts after the ones it committed
            return {"seq": self.seq, "orphans": dict(self._orphans)}
        return {"seq": self.seq}

    def restore_state(self, states):
        state = states[0] if self.transactional and states else None
        if state:
            self.seq = state["seq"]
            self._orphans = state.get("orphans") or {}

    _orphans: dict = {}

    def _rescale_writer_states(self, states, index, parallelism):
        """Subtask ``index`` goes on with the part numbers of the subtask of
        that index; a new one numbers its parts after every number used, its
        own earlier ones too (a subtask that a lower parallelism left out and
        a higher one brings back: ``orphans``). Subtask 0 also cleans up
        after the subtasks that are gone (``orphans``): their parts written
        after the checkpoint will be written again (those before it are
        committables, committed by the subtask that takes them:
        ``ConnectorSinkOperator.rescale_state``)."""
        known = [s for s in states if s]
        if not known:
            return []
        before = {}
        for s in known:
            for j, seq in (s.get("orphans") or {}).items():
                before[j] = max(seq, before.get(j, 0))
        if index < len(states) and states[index]:
            state = dict(states[index])
        else:
            state = dict(known[0], seq=max([s["seq"] for s in known] + [before.get(str(index), 0)]))
        state.pop("orphans", None)
        if index == 0:
            gone = {str(j): s["seq"] for j, s in enumerate(states) if j >= parallelism and s}
            kept = {j: seq for j, seq in before.items() if int(j) >= parallelism and j not in gone}
            if gone or kept:
                state["orphans"] = {**kept, **gone}
        return [state]

    def _remove_orphans(self):
        """Parts of subtasks the restored checkpoint had and this job has
        not, numbered from the checkpoint's on."""
        if not self._orphans:
            return
        for name in self.dir.names():
            p = self.output.parse(name)
            if p is not None and str(p[0]) in self._orphans and p[1] >= self._orphans[str(p[0])]:
                self.dir.remove(name)


class TextFileSink(_PartFileSink):
    """``write_text``: one line per record (``str(record)``), in
    ``part-<subtask>-<seq>.txt`` files."""

    suffix = ".txt"

    def __init__(self, name, path, encoding="utf-8", transactional=False, output=None):
        super().__init__(name, path, transactional, output)
        self.encoding = encoding
        self.fh = None

    def _has_file(self):
        return self.fh is not None

    def _open_file(self, name):
        self.fh = self.dir.open_write(name, text=True, encoding=self.encoding)

    def _write(self, batch):
        self.fh.write("".join(f"{x}\n" for x in batch))

    def _close_file(self):
        self.fh.close()
        self.fh = None
        return True


_ROW_GROUP_ROWS = 128 * 1024


def import_pyarrow():
    """pyarrow and pyarrow.parquet, or an error that says how to get them:
    pyarrow is optional (the ``arrow`` extra), so it is imported only here."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError("write_parquet needs pyarrow: pip install 'pyflowbuf[arrow]'") from exc
    return pa, pq


def parquet_settings(schema, compression):
    """``schema`` as a pyarrow.Schema (or None), once it and ``compression``
    are known to be usable: refused when the stream is declared, not in a
    task of a running job."""
    pa, _ = import_pyarrow()
    if schema is not None and not isinstance(schema, pa.Schema):
        try:
            schema = pa.schema(schema)
        except (TypeError, ValueError, pa.ArrowException) as exc:
            raise errors.ConfigurationError(
                f"schema must be a pyarrow.Schema or what pyarrow.schema() takes (a list of fields or "
                f"(name, type) pairs), got {short_repr(schema)}: {exc}") from None
    codecs = compression.values() if isinstance(compression, dict) else [compression]
    for codec in codecs:
        if codec is None or (isinstance(codec, str) and codec.lower() == "none"):
            continue
        try:
            ok = isinstance(codec, str) and pa.Codec.is_available(codec)
        except ValueError:
            ok = False
        if not ok:
            raise errors.ConfigurationError(
                f"compression must be None or a codec this pyarrow has (snappy, gzip, brotli, lz4, zstd), "
                f"or a dict of them per column; got {codec!r}")
    return schema


class ParquetFileSink(_PartFileSink):
    """``write_parquet``: records become the rows of Parquet files,
    ``part-<subtask>-<seq>.parquet`` in the directory ``path``. Rows are
    buffered up to ``row_group_size`` so that readers get row groups of a
    useful size rather than one per batch.

    The schema is ``schema`` or the first batch's; it goes into checkpoints,
    so a restored subtask writes the schema its committed files have."""

    suffix = ".parquet"

    def __init__(self, name, path, schema=None, row_group_size=None, compression="snappy",
                 transactional=False, output=None):
        super().__init__(name, path, transactional, output)
        self.schema = schema
        self.row_group_size = row_group_size or _ROW_GROUP_ROWS
        self.compression = compression
        self.writer = None
        self.file = None
        self.pending: list = []
        self.pending_rows = 0

    def open(self, subtask, parallelism):
        self.pa, self.pq = import_pyarrow()
        super().open(subtask, parallelism)

    def _has_file(self):
        return self.file is not None

    def _open_file(self, name):
        # a local part is written by Arrow itself (no Python file object in between)
        self.file = self.output.part_path(self.subtask, self.seq, True) if self.dir.local else \
            self.dir.open_write(name, text=False)
        if self.schema is not None:
            # a job whose input is empty still leaves a file that gives the schema
            self.writer = self.pq.ParquetWriter(self.file, self.schema, compression=self.compression)

    def _write(self, batch):
        table = self._table(batch)
        if self.writer is None:
            # even for no rows: a part file this subtask commits must exist
            self.writer = self.pq.ParquetWriter(self.file, self.schema, compression=self.compression)
        if table.num_rows:
            self.pending.append(table)
            self.pending_rows += table.num_rows
            if self.pending_rows >= self.row_group_size:
                self._flush()

    def _flush(self, everything=False):
        """Write the pending rows as full row groups (and the rest too when
        ``everything``: the file is about to close)."""
        if not self.pending:
            return
        table = self.pa.concat_tables(self.pending)
        size = self.row_group_size
        n = table.num_rows if everything else table.num_rows - table.num_rows % size
        if n:
            self.writer.write_table(table.slice(0, n), row_group_size=size)
        rest = table.slice(n)
        self.pending = [rest] if rest.num_rows else []
        self.pending_rows = rest.num_rows

    def _close_file(self):
        self._flush(everything=True)
        written = self.writer is not None
        if written:
            self.writer.close()
            self.writer = None
        if not isinstance(self.file, str):
            self.file.close()       # the writer leaves a file object it was given open
            if not written:
                self.dir.remove(self._name(True))
        self.file = None
        # no rows and no schema: no Parquet file can be written (there is no
        # schema to give), so the subtask leaves no part
        return written

    def snapshot_state(self):
        state = super().snapshot_state()
        if state is not None and self.schema is not None:
            state["schema"] = self.schema.serialize().to_pybytes()
        return state

    def restore_state(self, states):
        super().restore_state(states)
        state = states[0] if states else None
        # a declared schema wins: the user may have changed it on purpose
        if self.transactional and state and state.get("schema") is not None and self.schema is None:
            pa, _ = import_pyarrow()
            self.schema = pa.ipc.read_schema(pa.py_buffer(state["schema"]))

    # ---- records -> a table of the schema ----
    def _table(self, batch):
        pa = self.pa
        first = batch[0]
        if isinstance(first, (pa.RecordBatch, pa.Table)):
            # Records read off an exchange are views over its segments: the
            # pending rows get their own copy, or they would pin the pool.
            tables = [self._conform(_copy_arrow(pa.table(x))) for x in batch]
            return tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        if _is_dataframe(first):
            return pa.concat_tables([self._conform(self._from_pandas(df)) for df in batch])
        if isinstance(first, np.ndarray):
            return self._conform(self._from_rows(batch))
        if isinstance(first, dict):
            return self._conform(self._from_dicts(batch))
        if isinstance(first, tuple):
            return self._conform(self._from_tuples(batch))
        return self._conform(self._from_columns({self._scalar_name(): batch}))

    def _from_pandas(self, df):
        try:
            return self.pa.Table.from_pandas(df, preserve_index=False)
        except (self.pa.ArrowException, TypeError, ValueError) as exc:
            raise self._misfit(None, f"the DataFrame does not convert to Arrow ({_brief(exc)})") from None

    def _from_rows(self, batch):
        """The chunks of a NumPy rows stream: a structured dtype's fields are
        the columns, a plain 1-D chunk is one column."""
        try:
            rows = np.concatenate(batch)     # also a copy that does not pin a segment
        except ValueError as exc:
            raise self._misfit(None, f"its NumPy chunks do not join into one array ({_brief(exc)})") from None
        if rows.dtype.names:
            return self._from_columns({n: rows[n] for n in rows.dtype.names})
        if rows.ndim != 1:
            raise self._misfit(None, f"NumPy chunks of shape {rows.shape[1:]} per row have no columns: "
                                     "use a structured dtype")
        return self._from_columns({self._scalar_name(): rows})

    def _from_dicts(self, batch):
        names = dict.fromkeys(self.schema.names) if self.schema is not None else {}
        for d in batch:
            if not isinstance(d, dict):
                raise self._misfit(None, f"a record is {short_repr(d)} where the batch holds dicts")
            names.update(dict.fromkeys(d))
        return self._from_columns({k: [d.get(k) for d in batch] for k in names})

    def _from_tuples(self, batch):
        if self.schema is not None:
            names = self.schema.names
        else:
            names = getattr(batch[0], "_fields", None) or [f"f{i}" for i in range(len(batch[0]))]
        n = len(names)
        for t in batch:
            if not isinstance(t, tuple) or len(t) != n:
                raise self._misfit(None, f"a record is {short_repr(t)} where tuples of {n} fields "
                                         f"({', '.join(map(str, names))}) belong")
        return self._from_columns(dict(zip(names, zip(*batch))))

    def _scalar_name(self):
        if self.schema is None:
            return "value"
        if len(self.schema) != 1:
            raise self._misfit(None, f"records are single values but the schema has {len(self.schema)} "
                                     "columns: write dicts or tuples")
        return self.schema.names[0]

    def _from_columns(self, columns):
        pa, schema = self.pa, self.schema
        arrays = []
        for name, values in columns.items():
            i = -1 if schema is None else schema.get_field_index(name)
            want = schema.field(i).type if i >= 0 else None
            try:
                arrays.append(pa.array(values, type=want))
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
                expect = f"{want} values" if want is not None else "of one Arrow type"
                raise self._misfit(name, f"holds values that are not {expect} ({_brief(exc)})") from None
        return pa.Table.from_arrays(arrays, names=list(columns))

    def _conform(self, table):
        """``table`` with exactly the schema's columns, in its order and of its
        types (safe casts only); the first table decides the schema."""
        pa, schema = self.pa, self.schema
        if schema is None:
            self.schema = table.schema
            return table
        names = table.column_names
        for name in names:
            if schema.get_field_index(name) < 0:
                raise self._misfit(name, f"is not in the schema ({', '.join(schema.names)})")
        columns = []
        for field in schema:
            if field.name not in names:
                raise self._misfit(field.name, "is missing")
            col = table.column(field.name)
            if col.type != field.type:
                try:
                    col = col.cast(field.type)
                except (pa.ArrowException, TypeError, ValueError) as exc:
                    raise self._misfit(field.name, f"is {col.type} where the schema has {field.type} "
                                                   f"({_brief(exc)})") from None
            if not field.nullable and col.null_count:
                raise self._misfit(field.name, "holds nulls but the schema says not null")
            columns.append(col)
        return pa.Table.from_arrays(columns, schema=schema)

    def _misfit(self, column, what) -> errors.RecordTypeError:
        where = f"column {column!r} " if column is not None else ""
        if self.schema is None:
            hint = "Pass schema= to write_parquet to declare the columns"
        else:
            hint = (f"The files' schema {_schema_text(self.schema)} is the one declared with schema= or "
                    "the first batch's: pass schema= to write_parquet to choose it")
            i = self.schema.get_field_index(column) if column is not None else -1
            if i >= 0 and self.schema.field(i).type == self.pa.null():
                hint += f" (the first batch had only None in {column!r}, so its type became null)"
        err = errors.RecordTypeError(f"sink {self.name!r}: {where}{what}. {hint}")
        err.column = column
        return err


def _brief(exc) -> str:
    """Arrow's message, which quotes the value: a DataFrame's repr would bury the rest."""
    text = str(exc)
    return text if len(text) <= 300 else text[:300] + "..."


def _schema_text(schema) -> str:
    return "(" + ", ".join(f"{f.name}: {f.type}" for f in schema) + ")"
