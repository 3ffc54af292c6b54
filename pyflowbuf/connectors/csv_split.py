"""How ``read_csv`` cuts its files into work, and how a restore at another
parallelism deals out the work a checkpoint had left (``rescale_positions``).

* **Pieces.** A piece of work is a byte range ``[start, end)`` of a file and
  means the lines that *start* in it (a line: the bytes up to and including a
  ``\\n``; the file's last one may lack it). The header line is in none. Every
  line starts in exactly one piece of a cut, so a byte range may be cut at
  any byte: the line across the cut belongs to the piece before it.
* **Shares.** Subtask *i* of *p* reads, in every file, the piece
  ``[data + (size-data)*i//p, data + (size-data)*(i+1)//p)`` (``data``: the
  header line's length, 0 without one).
* **Blocks.** A piece is parsed in blocks that start at a line start and end
  after a line end (``block_end``): the last line end within ``block_size``
  bytes, or, when the piece ends within them, after the line across the
  piece's end, or after a line longer than a block. Where a block ends depends
  on its start, ``block_size`` and the piece's end only, so it is found again
  from a position.
* **Rescaling.** What old subtask *j* has left is its current block from the
  row it had reached (a *partly read block*: read whole again, those rows
  skipped, so it stays one piece), the rest of its share of that file and its
  shares of the later files. The pieces of all old subtasks, in file order,
  are cut at byte offsets into ``parallelism`` runs of about the same number
  of bytes (a partly read block goes whole to the run that holds its middle);
  new subtask *i* reads run *i*, in file order. The plan depends only on the
  positions and the files, so every new subtask computes the same one and
  takes its own run. The explicit position ``{"units": [[file, start, end,
  row], ...]}`` lists what is left: ``row > 0`` marks a partly read block
  (``[start, end)`` is that block, ``row`` its rows already emitted), ``row
  == 0`` a piece not begun. It rescales again the same way.
"""
from __future__ import annotations

import bisect

from pyflowbuf import errors
from pyflowbuf.errors import FileFormatError
from pyflowbuf.connectors import filesystems as fsx
from pyflowbuf.connectors.files import _pyarrow
from pyflowbuf.connectors.sources import incompatible

CHUNK = 1 << 16


# ---------------------------------------------------------------- lines and blocks

def read_to_line_end(fh, pos) -> bytes:
    """The bytes from ``pos`` up to and including the next ``\\n`` (to the
    end of the file when none follows)."""
    fh.seek(pos)
    parts = []
    while True:
        chunk = fh.read(CHUNK)
        if not chunk:
            break
        k = chunk.find(b"\n")
        if k >= 0:
            parts.append(chunk[:k + 1])
            break
        parts.append(chunk)
    return b"".join(parts)


def line_end(fh, pos, size) -> int:
    """The offset after the line end at or after ``pos`` (the file's size
    when the last line has none)."""
    return min(pos + len(read_to_line_end(fh, pos)), size)


def first_line_start(fh, pos, size) -> int:
    """The first line start at or after ``pos``: the line across ``pos``
    belongs to what comes before it."""
    return 0 if pos == 0 else line_end(fh, pos - 1, size)


def share(data, size, i, p):
    """The raw byte range of subtask ``i`` of ``p`` in a file."""
    return data + (size - data) * i // p, data + (size - data) * (i + 1) // p


def block_end(fh, start, end, size, block_size) -> int:
    """Where the block that starts at line start ``start`` of a piece ending
    at ``end`` ends (see the module's docstring)."""
    if start + block_size >= end:
        return line_end(fh, end - 1, size)
    fh.seek(start)
    chunk = fh.read(block_size)
    k = chunk.rfind(b"\n")
    if k >= 0:
        return start + k + 1
    return line_end(fh, start + len(chunk), size)      # a line longer than a block


def header(pacsv, head: bytes, path, parse_options, what):
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


def data_start(fh, size, plan, path, pacsv) -> int:
    """Where a file's rows start: after its header line, which must name the
    columns of the plan's first file (0 without a header)."""
    if size == 0 or not plan.header:
        return 0
    fh.seek(0)
    head = fh.read(min(size, plan.block_size))
    if len(head) == plan.block_size and b"\n" not in head:
        head += read_to_line_end(fh, len(head))
    data, names = header(pacsv, head, path, plan.parse_options, plan.what)
    if names != plan.header_names:
        raise FileFormatError(
            f"{plan.what}: {path} has the header {names}, {plan.first} has {plan.header_names}: the files of "
            "one source share their columns")
    return data


class Files:
    """The files of a plan, opened one at a time, with their sizes and data
    starts (read once): what a rescaling plan or a check of a position reads."""

    def __init__(self, plan):
        self.plan = plan
        self._pacsv = _pyarrow()[2]
        self._geometry = {}     # file index -> (size, data start)
        self._open = None       # (file index, file object)

    def fh(self, f):
        if self._open is None or self._open[0] != f:
            self.close()
            self._open = (f, fsx.open_input(self.plan.files[f]))
        return self._open[1]

    def geometry(self, f):
        g = self._geometry.get(f)
        if g is None:
            size = fsx.size(self.plan.files[f])
            g = self._geometry[f] = (size, data_start(self.fh(f), size, self.plan, self.plan.files[f],
                                                     self._pacsv))
        return g

    def is_line_start(self, f, pos) -> bool:
        if pos == 0:
            return True
        fh = self.fh(f)
        fh.seek(pos - 1)
        return fh.read(1) == b"\n"

    def close(self):
        if self._open is not None:
            self._open[1].close()
            self._open = None


# ---------------------------------------------------------------- positions

def _misfit(plan, what_pos, why):
    # (an IncompatibleCheckpointError, a ConfigurationError: the checkpoint was taken of other input)
    return incompatible(plan, f"the checkpoint's position {what_pos} does not fit the files read now ({why}): "
                              "restore with the files and settings of the run that took the checkpoint")


def _ints(values) -> bool:
    return all(type(v) is int and v >= 0 for v in values)


def parse_units(files: Files, position) -> list:
    """The units of an explicit position as tuples ``(file, start, end,
    row)``, each checked against the files: ConfigurationError when one does
    not fit them."""
    plan = files.plan
    try:
        units = [tuple(u) for u in position["units"]]
        if not all(len(u) == 4 and _ints(u) for u in units):
            raise ValueError
    except (TypeError, ValueError, KeyError):
        raise errors.ConfigurationError(
            f"{plan.what}: {position!r} is not a position of this source ({{'units': [[file index, start "
            "byte, end byte, row], ...]}} of ints >= 0)") from None
    for u in units:
        _check_unit(files, u)
    return units


def _check_unit(files: Files, unit):
    plan = files.plan
    f, start, end, row = unit
    if f >= len(plan.files):
        raise _misfit(plan, list(unit), f"file {f} of {len(plan.files)}")
    size, data = files.geometry(f)
    if not data <= start < end <= size:
        raise _misfit(plan, list(unit), f"bytes {start}..{end} of {plan.files[f]}, whose rows are bytes "
                                        f"{data}..{size}")
    if row and not (files.is_line_start(f, start) and (end == size or files.is_line_start(f, end))):
        raise _misfit(plan, list(unit), f"a block of {plan.files[f]} begun before the checkpoint must run from "
                                        "a line start to a line end")


def _left_of(files: Files, pos, j, old_p) -> list:
    """What subtask ``j`` of ``old_p`` had left at position ``pos``, as units
    in file order."""
    plan = files.plan
    if isinstance(pos, dict):
        return parse_units(files, pos)
    try:
        f, start, row = pos
        if not _ints((f, start, row)):
            raise ValueError
    except (TypeError, ValueError):
        raise errors.ConfigurationError(
            f"{plan.what}: {pos!r} (subtask {j} of {old_p}) is not a position of this source (file index, "
            "block start byte, row: ints >= 0)") from None
    nfiles = len(plan.files)
    if f >= nfiles:
        if f > nfiles:
            raise _misfit(plan, list(pos), f"file {f} of {nfiles}")
        return []           # that subtask had read its share
    size, data = files.geometry(f)
    a, b = share(data, size, j, old_p)
    if not (max(a, data) <= start < b and files.is_line_start(f, start)):
        raise _misfit(plan, list(pos), f"byte {start} of {plan.files[f]} is not a line start in bytes {a}..{b}, "
                                       f"the share of subtask {j} of {old_p}")
    left = []
    if row:
        end = block_end(files.fh(f), start, b, size, plan.block_size)
        left.append((f, start, end, row))
        start = end
    if start < b:
        left.append((f, start, b, 0))
    for g in range(f + 1, nfiles):
        size, data = files.geometry(g)
        a, b = share(data, size, j, old_p)
        if a < b:
            left.append((g, a, b, 0))
    return left


def rescale_positions(plan, positions, parallelism) -> list:
    """The explicit positions of ``parallelism`` new subtasks from those of
    every subtask of a checkpoint taken at another parallelism (see the
    module's docstring)."""
    files = Files(plan)
    try:
        units = []
        for j, pos in enumerate(positions):
            units.extend(_left_of(files, pos, j, len(positions)))
        units.sort()
        _check_disjoint(files, units)
    finally:
        files.close()
    return [{"units": [list(u) for u in run]} for run in deal(units, parallelism)]


def _check_disjoint(files: Files, units):
    """No line is in two units (sorted). Units may share bytes without
    sharing a line: a block begun before the checkpoint ends after the line
    across its share's end, where the next share, not begun, starts."""
    reach = None        # the unit that reaches furthest into the file so far
    for v in units:
        f, start = v[0], v[1]
        if reach is not None and reach[0] == f and reach[2] > start:
            first = start if v[3] else first_line_start(files.fh(f), start, files.geometry(f)[0])
            if first < min(reach[2], v[2]):
                raise _misfit(files.plan, [list(reach), list(v)],
                              f"the line at byte {first} of {files.plan.files[f]} is in both")
        if reach is None or reach[0] != f or v[2] > reach[2]:
            reach = v


def deal(units, parallelism) -> list:
    """``units`` (sorted, disjoint) as ``parallelism`` runs in file order of
    about the same number of bytes each: pieces not begun are cut at the
    runs' bounds, a partly read block goes whole to the run holding its
    middle; neighbouring pieces of one run are joined."""
    total = sum(end - start for _, start, end, _ in units)
    bounds = [total * i // parallelism for i in range(parallelism + 1)]
    runs = [[] for _ in range(parallelism)]
    at = 0          # bytes of the units before this one
    for f, start, end, row in units:
        width = end - start
        if row:
            i = min(bisect.bisect_right(bounds, at + width // 2) - 1, parallelism - 1)
            runs[i].append((f, start, end, row))
        else:
            i = min(bisect.bisect_right(bounds, at) - 1, parallelism - 1)
            lo = at
            while lo < at + width:
                hi = at + width if i == parallelism - 1 else min(at + width, bounds[i + 1])
                if hi > lo:
                    _append(runs[i], (f, start + lo - at, start + hi - at, 0))
                lo = hi
                i += 1
        at += width
    return runs


def _append(run, unit):
    if run:
        f, start, end, row = run[-1]
        if not row and f == unit[0] and end == unit[1]:
            run[-1] = (f, start, unit[2], 0)
            return
    run.append(unit)
