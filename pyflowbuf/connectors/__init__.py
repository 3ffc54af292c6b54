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

Unbounded sources: ``monitor`` (``read_text``/``read_csv``/``read_parquet``
with ``monitor=``: a watched directory, each new file read once) and
``socket_text`` (lines from a TCP server); their modules' docstrings say how
they split, wait, end and checkpoint.

What lives where: ``files`` (listing, arguments, the shared reading loop),
``parquet``, ``csv``, ``console`` (``print()``), ``monitor``, ``socket_text``.
"""
from pyflowbuf.connectors.console import PrintSink
from pyflowbuf.connectors.csv import CsvFileSource, CsvPlan, csv_source
from pyflowbuf.connectors.files import DEFAULT_BATCH_ROWS, DEFAULT_CSV_BLOCK, MODES, list_files
from pyflowbuf.connectors.parquet import ParquetFileSource, ParquetPlan, parquet_source
from pyflowbuf.connectors import monitor, socket_text
from pyflowbuf.errors import FileFormatError  # defined with the other errors; public here as before

__all__ = ["MODES", "DEFAULT_BATCH_ROWS", "DEFAULT_CSV_BLOCK", "list_files", "parquet_source", "csv_source",
           "ParquetFileSource", "ParquetPlan", "CsvFileSource", "CsvPlan", "PrintSink", "FileFormatError"]
