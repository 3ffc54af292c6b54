"""The source declarations of ``Environment`` (``from_iterable``,
``from_sequence``, ``read_parquet``, ...): each adds a source node to the
graph and returns its stream."""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable

import numpy as np

from pyflowbuf import connectors
from pyflowbuf._core.serde import number_kind
from pyflowbuf._validation import _check_kind, _parallelism, _positive_int, _sequence_args
from pyflowbuf.api.stream import Stream
from pyflowbuf.connectors import socket_text as st
from pyflowbuf.errors import ConfigurationError
from pyflowbuf.connectors import filesystems as fsx
from pyflowbuf.connectors import sources as srcs
from pyflowbuf.serializers import infer_kind


class SourceDeclarations:
    """The ``Environment``'s methods that declare sources."""

    def _source(self, name, source, kind, rate_limit, parallelism=1, paths=None) -> "Stream":
        srcs.rate_limiter(rate_limit)   # a bad rate_limit= fails here, not in the running task
        node = self._add(name=name, parallelism=parallelism, source=source, kind=kind,
                         rate_limit=rate_limit)
        if paths is not None:
            # where a file source reads: checked by a SparkCluster before it submits
            node.input_paths = [os.fspath(p) for p in paths] if isinstance(paths, (list, tuple)) \
                else [os.fspath(paths)]
        return Stream(self, node)

    def from_iterable(self, iterable: Iterable, *, kind: Any = None, name: str = "iterable",
                      rate_limit=None) -> "Stream":
        """Records from an iterable (or a zero-argument function returning one),
        pulled lazily: an item is taken only when the task can write it.

        ``kind`` declares the record kind (None: inferred from the first record;
        a list of plain numbers gets a fixed-width number kind when its values
        fit one); ``rate_limit`` caps the source at that
        many records per second, or takes a ``RateLimiter``. The source has
        parallelism 1. Returns a ``Stream``. A bad ``kind`` is a
        ``ConfigurationError``, a bad ``rate_limit`` a ``ValueError``, both
        raised here. ``from_collection`` is the same method.

        Example::

            words = env.from_iterable(["a", "b", "c"])
            lines = env.from_iterable(lambda: open("words.txt"), kind="str", rate_limit=1000)
        """
        kind = _check_kind(kind, f"from_iterable {name!r}")
        if kind is None and isinstance(iterable, (list, tuple, range)) and len(iterable):
            kind = infer_kind(iterable[0])
            if kind == "number":
                # all the records are known: plain ints (or floats) take the
                # fixed-width kind, as from_sequence does
                if isinstance(iterable, range):
                    fits = -(1 << 63) <= min(iterable[0], iterable[-1]) and max(iterable[0], iterable[-1]) < (1 << 63)
                    kind = "int64" if fits else "number"
                else:
                    kind = number_kind(iterable if isinstance(iterable, list) else list(iterable))
        return self._source(name, lambda: srcs.IterableSource(iterable), kind, rate_limit)

    from_collection = from_iterable

    def from_generator(self, fn: Callable[[], Iterable], *, kind: Any = None, name: str = "generator",
                       rate_limit=None) -> "Stream":
        """Records from ``fn()``, a function of no arguments returning an iterable
        (a generator function), called when the job starts.

        ``kind``, ``name`` and ``rate_limit`` as for ``from_iterable``; the
        source has parallelism 1. Returns a ``Stream``. A ``fn`` that is not
        callable is a ``TypeError``, a bad ``kind`` a ``ConfigurationError``.

        Example::

            def readings():
                for i in range(1000):
                    yield ("sensor-1", float(i))

            stream = env.from_generator(readings, name="sensor")
        """
        if not callable(fn):
            raise TypeError("from_generator takes a function that returns an iterable")
        kind = _check_kind(kind, f"from_generator {name!r}")
        return self._source(name, lambda: srcs.IterableSource(fn), kind, rate_limit)

    def from_sequence(self, start: int, stop: int | None = None, step: int = 1, *,
                      parallelism: int | None = None, name: str = "sequence", rate_limit=None) -> "Stream":
        """Integers in ``range(start, stop, step)`` (``stop=None``: unbounded).

        The stream's kind is ``int64``; with ``parallelism`` p each subtask
        takes every p-th value. Returns a ``Stream``. Arguments that are not
        ints, a ``step`` of 0 or values outside int64 are a
        ``ConfigurationError``.

        Example::

            evens = env.from_sequence(0, 100, 2, parallelism=2)    # 0, 2, .., 98
            ticks = env.from_sequence(0, rate_limit=10)             # unbounded, 10 per second
        """
        start, stop, step = _sequence_args(start, stop, step)
        if parallelism is not None:
            _positive_int("parallelism", parallelism)
        p = self.parallelism if parallelism is None else parallelism
        return self._source(name, lambda: srcs.SequenceSource(start, stop, step), "int64", rate_limit, p)

    def read_text(self, path, *, encoding: str = "utf-8", name: str = "read_text", rate_limit=None,
                  monitor: float | None = None, monitor_timeout: float | None = None,
                  parallelism: int | None = None) -> "Stream":
        """Lines of a text file (a local path or an fsspec URL such as
        ``s3://bucket/log.txt``); the source tracks byte offsets.

        Each record is one line as a ``str`` without its line break, decoded
        with ``encoding``; the byte offset makes a restore resume exactly. A
        missing file is ``FileNotFoundError``, raised here. Returns a ``Stream``.

        ``monitor=seconds``: ``path`` is a directory (or a glob) watched for
        new files, each read once when it is complete (its size unchanged
        between two scans), split over ``parallelism`` subtasks by file. The
        source then never ends by itself, unless ``monitor_timeout=seconds``:
        it ends once nothing new has appeared for that long. The files read
        are checkpointed, so a restore reads each exactly once. See
        docs/connectors.md, "Watching a directory".

        Example::

            lines = env.read_text("words.txt")
            words = lines.flat_map(str.split)
            incoming = env.read_text("inbox/", monitor=1.0)        # new files, every second
        """
        if monitor is not None:
            factory, kind = connectors.monitor.text_source(
                path, encoding=encoding, monitor=monitor, monitor_timeout=monitor_timeout,
                what=f"read_text {name!r}")
            return self._source(name, factory, kind, rate_limit, _parallelism(self.parallelism, parallelism), path)
        _not_monitored("read_text", monitor_timeout, parallelism)
        if not fsx.exists(path):
            raise FileNotFoundError(path)
        if fsx.isdir(path):
            # e.g. the directory of part files write_text made: reading its
            # parts in some order of our choosing would be a guess
            raise IsADirectoryError(
                f"read_text reads one file, and {path} is a directory (write_text writes a directory of "
                "part files): read each part, e.g. env.read_text(p) for p in "
                f"sorted(glob.glob('{fsx.join(os.fspath(path), 'part-*')}')), joined with union()")
        return self._source(name, lambda: srcs.TextFileSource(path, encoding), "str", rate_limit, paths=path)

    def read_parquet(self, path, *, columns: list | None = None, batch_size: int = 65536,
                     as_: str = "records", parallelism: int | None = None, name: str = "read_parquet",
                     rate_limit=None, monitor: float | None = None, monitor_timeout: float | None = None,
                     schema=None) -> "Stream":
        """Rows of Parquet files (pyarrow): ``path`` is a file, a directory
        (its files, hidden ``.``/``_`` names skipped), a glob or a list of them,
        each a local path or an fsspec URL (``s3://bucket/events/``).

        ``as_``: ``"records"`` (a dict per row), ``"tuples"`` (a tuple per row,
        in column order), ``"arrow"`` (RecordBatches of up to ``batch_size``
        rows) or ``"pandas"`` (DataFrames). The row groups are split over the
        ``parallelism`` subtasks; the position (file, row group, row) rewinds
        exactly for checkpoints. Files are listed and their footers read
        here: a missing file is FileNotFoundError, a broken one
        ``connectors.FileFormatError``.

        ``monitor=seconds`` watches the directory (or glob) for new files,
        as ``read_text`` does (each file read whole by one subtask); the
        schema is ``schema=`` (a ``pyarrow.Schema``, needed while the
        directory is empty) or the oldest file's, and a file read later
        with another is ``FileFormatError``. ``monitor_timeout`` as for
        ``read_text``.

        Returns a ``Stream``.

        Example::

            rows = env.read_parquet("lines.parquet", columns=["ts", "text"])       # dicts
            batches = env.read_parquet("events/", as_="arrow", parallelism=2)      # RecordBatches
            incoming = env.read_parquet("events/", monitor=5.0)                    # new files too
        """
        if monitor is not None:
            factory, kind = connectors.monitor.parquet_source(
                path, columns=columns, schema=schema, batch_size=batch_size, as_=as_, monitor=monitor,
                monitor_timeout=monitor_timeout, what=f"read_parquet {name!r}")
            return self._source(name, factory, kind, rate_limit, _parallelism(self.parallelism, parallelism), path)
        _not_monitored("read_parquet", monitor_timeout)
        if schema is not None:
            raise ConfigurationError("read_parquet: schema= is for monitor= (the files to come); a bounded "
                                     "read takes the files' own schema")
        factory, kind = connectors.parquet_source(path, columns=columns, batch_size=batch_size, as_=as_,
                                                  what=f"read_parquet {name!r}")
        return self._source(name, factory, kind, rate_limit, _parallelism(self.parallelism, parallelism), path)

    def read_csv(self, path, *, columns: list | None = None, column_types=None, column_names: list | None = None,
                 header: bool = True, delimiter: str = ",", quote_char: str = '"', batch_size: int = 65536,
                 block_size: int = 1 << 20, as_: str = "records", parallelism: int | None = None,
                 name: str = "read_csv", rate_limit=None, monitor: float | None = None,
                 monitor_timeout: float | None = None) -> "Stream":
        """Rows of CSV files (pyarrow.csv), ``path`` as for ``read_parquet``,
        records as its ``as_`` says.

        The column names are the header line's (``header=True``, every file
        has one), ``column_names``, or f0, f1, ..; the types are
        ``column_types`` (a pyarrow Schema or a dict of name to type) and, for
        the other columns, inferred from the first ``block_size`` bytes. An
        unquoted empty field is None, a quoted one ``""``. Each file's lines
        are split over the ``parallelism`` subtasks by byte ranges (a
        checkpoint or savepoint restores at any other parallelism: the bytes
        not yet read are dealt out again); a value
        holding a line break inside quotes is refused at every parallelism. A
        row that does not parse is ``connectors.FileFormatError`` naming the
        file and line.

        ``monitor=seconds`` watches the directory (or glob) for new files,
        as ``read_text`` does (each file read whole by one subtask). The
        columns are fixed from the oldest file there, or, while the directory
        is empty, from ``column_types`` given as a full ``pyarrow.Schema``.
        ``monitor_timeout`` as for ``read_text``.

        Returns a ``Stream``.

        Example::

            users = env.read_csv("users.csv", columns=["name", "age"])
            for_windows = env.read_csv("events.csv", as_="arrow")
            incoming = env.read_csv("events/", monitor=5.0)          # new files too
        """
        if monitor is not None:
            factory, kind = connectors.monitor.csv_source(
                path, columns=columns, column_types=column_types, column_names=column_names, header=header,
                delimiter=delimiter, quote_char=quote_char, batch_size=batch_size, block_size=block_size,
                as_=as_, monitor=monitor, monitor_timeout=monitor_timeout, what=f"read_csv {name!r}")
            return self._source(name, factory, kind, rate_limit, _parallelism(self.parallelism, parallelism), path)
        _not_monitored("read_csv", monitor_timeout)

        factory, kind = connectors.csv_source(
            path, columns=columns, column_types=column_types, column_names=column_names, header=header,
            delimiter=delimiter, quote_char=quote_char, batch_size=batch_size, block_size=block_size,
            as_=as_, what=f"read_csv {name!r}")
        return self._source(name, factory, kind, rate_limit, _parallelism(self.parallelism, parallelism), path)

    def socket_text(self, host: str, port: int, delimiter: str = "\n", *, encoding: str = "utf-8",
                    max_retries: int | None = 5, retry_delay: float = 0.5, max_retry_delay: float = 10.0,
                    allow_remote: bool = False, name: str = "socket_text", rate_limit=None) -> "Stream":
        """Lines of text from a TCP server (Flink's ``socketTextStream``):
        the source connects to ``host:port`` and each record is the text up
        to the next ``delimiter`` (a ``str``, without it).

        When the server closes the connection (or is not there), the source
        connects again after ``retry_delay`` seconds, doubling the wait after
        each failed try up to ``max_retry_delay``; after ``max_retries``
        failed tries in a row (None: no limit) the stream ends, as Flink's
        does, and the job finishes. A source that never connected fails the
        job instead (``ConnectionRefusedError``). Parallelism 1.

        Only loopback hosts unless ``allow_remote=True`` (the text is plain
        and unauthenticated). The source cannot rewind: with checkpoints on
        it needs ``checkpointing_mode="at_least_once"``. Both are a
        ``ConfigurationError``, raised here (and again at ``execute()``).
        Returns a ``Stream`` of str.

        Example::

            # in a shell: nc -lk 9999, then type lines
            counts = (env.socket_text("localhost", 9999)
                         .flat_map(str.split)
                         .key_by(lambda w: w)
                         .reduce(lambda a, b: a))
        """
        retry_delay, max_retry_delay = st.check_arguments(host, port, delimiter, encoding, max_retries,
                                                          retry_delay, max_retry_delay, allow_remote)
        st.check_checkpointing(self.checkpoint_config, name)
        return self._source(name, lambda: st.SocketTextSource(
            host, port, delimiter, encoding=encoding, max_retries=max_retries, retry_delay=retry_delay,
            max_retry_delay=max_retry_delay, name=name), "str", rate_limit)

    def from_arrays(self, arrays: Iterable, *, dtype=None, name: str = "arrays", rate_limit=None) -> "Stream":
        """A rows stream: NumPy arrays of fixed-width rows, moved with one memcpy
        per buffer and read back as views. Operators see array chunks.

        ``dtype`` is the rows' NumPy dtype; it may be left out only when
        ``arrays`` is a non-empty list (the first array's dtype). A missing or
        invalid dtype, or one of Python objects, is a ``ConfigurationError``.
        Returns a ``Stream`` of that dtype.

        Example::

            import numpy as np

            rows = np.zeros(10_000, dtype=[("key", "i8"), ("value", "f8")])
            stream = env.from_arrays([rows[:5000], rows[5000:]])
            positive = stream.map_batches(lambda chunk: chunk[chunk["value"] > 0])
        """
        if dtype is None:
            if isinstance(arrays, (list, tuple)) and arrays:
                dtype = np.asarray(arrays[0]).dtype
            else:
                raise ConfigurationError("from_arrays needs dtype= when the arrays are not a non-empty list")
        try:
            dtype = np.dtype(dtype)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"from_arrays {name!r}: dtype={dtype!r} is not a NumPy dtype: {exc}") from None
        return self._source(name, lambda: srcs.ArraySource(arrays), dtype, rate_limit)



def _not_monitored(what, monitor_timeout, parallelism=None):
    if monitor_timeout is not None:
        raise ConfigurationError(f"{what}: monitor_timeout= ends a monitored source; it needs monitor=")
    if parallelism is not None:
        raise ConfigurationError(f"{what}: a single text file is read by one subtask; parallelism= is for "
                                 "monitor= (files split over subtasks)")
