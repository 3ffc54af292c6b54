"""Sources: where records enter a job. Each keeps a position a checkpoint can
record and a recovery can rewind to (``position`` / ``seek``)."""
from __future__ import annotations

import bisect
import heapq
import itertools
import numbers
import os
import sys
import threading
import time
import zlib
from typing import Any, Callable, Iterable

from pyflowbuf import errors
from pyflowbuf.checkpoint.errors import IncompatibleCheckpointError
from pyflowbuf.connectors import filesystems as fsx


class Source:
    """The base of every source the runtime runs (``SourceOperator`` in
    ``pyflowbuf/connectors/contracts.py`` is the contract): its optional
    parts are declared here with the value that means "not used"."""

    name = "source"
    default_kind = "pickle"
    # what it reads, for error messages ("read_csv 'orders'"); None: its class name
    what: str | None = None
    # ``wakeup()``: make a waiting ``next_batch`` return now (a mail or a
    # cancel came); None: ``next_batch`` never waits long
    wakeup: Callable[[], None] | None = None
    # a source that cannot rewind may say why, and what to use instead
    # (the error an exactly-once job gets); None: the general message
    not_rewindable_because: str | None = None
    # ``rescale_positions(positions, parallelism) -> positions``: the
    # positions of ``parallelism`` subtasks from those a checkpoint recorded
    # at another parallelism; None: its positions cannot be redistributed
    rescale_positions: Callable[[list, int], list] | None = None
    # ``rows_of(batch) -> rows``: for a source whose record holds many rows
    # (Arrow batches), so its pull is sized in rows; None: a record is a row
    rows_of: Callable[[list], int] | None = None

    def open(self, subtask: int, parallelism: int) -> None:
        self.subtask = subtask
        self.parallelism = parallelism

    def next_batch(self, max_records: int) -> list | None:
        """Up to ``max_records`` records; None when exhausted."""
        raise NotImplementedError

    # Checkpoints record ``position()`` and recovery calls ``seek()`` after
    # ``open()``; a source that cannot rewind says so, and a job that needs
    # exactly-once recovery refuses it before it starts.
    rewindable = False

    def position(self) -> Any:
        return None

    def seek(self, position: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot rewind")

    # What the source reads, recorded with every checkpoint (plain data, or
    # None: nothing to tell); a restore first asks the new source whether a
    # recorded identity and position are its own (``check_identity`` raises
    # IncompatibleCheckpointError naming what differs), so a position is
    # never applied to other input.
    def identity(self) -> Any:
        return None

    def check_identity(self, recorded: Any, position: Any) -> None:
        mine = self.identity()
        if mine is not None and recorded != mine:
            raise incompatible(self, f"the checkpoint's source was {recorded!r}, this one is {mine!r}")

    def close(self) -> None:
        pass


class IterableSource(Source):
    """Pulls lazily from an iterable: an item is taken only when the task is
    ready to write it, so backpressure reaches whatever feeds the iterator."""

    def __init__(self, iterable: Iterable | Callable[[], Iterable]):
        self._factory = iterable if callable(iterable) and not hasattr(iterable, "__iter__") else None
        self._iterable = None if self._factory else iterable
        self._it = None
        self.offset = 0

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        if parallelism != 1:
            raise ValueError("an iterable/generator source has parallelism 1")
        self._it = iter(self._factory() if self._factory else self._iterable)

    @property
    def rewindable(self):
        return self._factory is not None or isinstance(self._iterable, (list, tuple, range))

    def next_batch(self, max_records):
        batch = list(itertools.islice(self._it, max_records))
        self.offset += len(batch)
        return batch or None

    def position(self):
        return self.offset

    def seek(self, position):
        if self._factory is None and not isinstance(self._iterable, (list, tuple, range)):
            raise ValueError("only a re-iterable source (a collection or generator factory) can rewind")
        self._it = iter(self._factory() if self._factory else self._iterable)
        for _ in itertools.islice(self._it, position):
            pass
        self.offset = position

    def close(self):
        close = getattr(self._it, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                pass


class SequenceSource(Source):
    """Integers ``start, start+step, ... < stop``; parallel subtasks take strides."""

    default_kind = "int64"
    rewindable = True

    def __init__(self, start: int, stop: int | None, step: int = 1):
        if step == 0:
            raise ValueError("step must not be 0")
        self.start, self.stop, self.step = start, stop, step
        self.next_value = None

    _ranges = None      # after a rescaled restore: [[next, stride], ...] read in turn

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        self.next_value = self.start + subtask * self.step
        self.stride = self.step * parallelism

    def _take(self, v, stride, max_records):
        end = v + stride * max_records
        if self.stop is not None:
            end = min(end, self.stop) if stride > 0 else max(end, self.stop)
        return list(range(v, end, stride))

    def next_batch(self, max_records):
        if self._ranges is not None:
            return self._next_from_ranges(max_records)
        v, stride = self.next_value, self.stride
        batch = self._take(v, stride, max_records)
        if not batch:
            return None
        self.next_value = batch[-1] + stride
        return batch

    def _next_from_ranges(self, max_records):
        """The next ``max_records`` values of all ranges merged in order: the
        subtask emits its values in the sequence's order, as before the
        rescale (event time taken from them stays ordered)."""
        ranges = self._ranges
        cands = [self._take(v, st, max_records) for v, st in ranges]
        keep = [(r, c) for r, c in zip(ranges, cands) if c]
        if not keep:
            ranges.clear()
            return None
        if len(keep) == 1:
            batch = keep[0][1]
        else:
            batch = list(itertools.islice(heapq.merge(*(c for _, c in keep), reverse=self.step < 0), max_records))
        last = batch[-1]
        for r, c in keep:
            # values past ``last`` (in the sequence's direction) stay for later
            taken = bisect.bisect_right(c, last) if self.step > 0 else bisect.bisect_right([-x for x in c], -last)
            if taken:
                r[0] = c[taken - 1] + r[1]
        self._ranges = [r for r in ranges if not self._exhausted(*r)]
        return batch

    def position(self):
        if self._ranges is not None:
            return {"ranges": [list(r) for r in self._ranges]}
        return self.next_value

    def seek(self, position):
        if isinstance(position, dict):
            self._ranges = [[int(v), int(st)] for v, st in position["ranges"]]
        else:
            self._ranges = None
            self.next_value = position

    def _exhausted(self, v, stride) -> bool:
        if self.stop is None:
            return False
        return v >= self.stop if stride > 0 else v <= self.stop

    def rescale_positions(self, positions, parallelism):
        """The positions of ``parallelism`` subtasks from those of every
        subtask of a checkpoint at another parallelism: the values not yet
        emitted, as arithmetic ranges, split so there are at least
        ``parallelism`` of them and dealt out in turn."""
        ranges = []
        for pos in positions:
            if isinstance(pos, dict):
                ranges.extend([int(v), int(st)] for v, st in pos["ranges"])
            elif pos is not None:
                ranges.append([int(pos), self.step * len(positions)])
        ranges = [r for r in ranges if not self._exhausted(*r)]
        k = -(-parallelism // len(ranges)) if ranges else 1
        split = [[v + j * st, st * k] for v, st in ranges for j in range(k)]
        return [{"ranges": split[i::parallelism]} for i in range(parallelism)]

    def identity(self):
        return {"kind": "sequence", "start": self.start, "stop": self.stop, "step": self.step}


class ArraySource(Source):
    """NumPy arrays of fixed-width rows (a rows stream)."""

    def __init__(self, arrays: Iterable | Callable[[], Iterable]):
        self.inner = IterableSource(arrays)

    @property
    def rewindable(self):
        return self.inner.rewindable

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        self.inner.open(subtask, parallelism)

    def next_batch(self, max_records):
        return self.inner.next_batch(1)

    def position(self):
        return self.inner.position()

    def seek(self, position):
        self.inner.seek(position)


_UTF8_BOM = b"\xef\xbb\xbf"


def _is_utf8(encoding: str) -> bool:
    return encoding.lower().replace("_", "-") in ("utf-8", "utf8", "utf-8-sig")


def _is_parquet(path) -> bool:
    with fsx.open_input(path) as fh:
        return fh.read(4) == b"PAR1"


def _readline(fh, limit):
    """A line of at most ``limit`` bytes (fsspec's buffered files take no limit)."""
    try:
        return fh.readline(limit)
    except TypeError:
        at = fh.tell()
        raw = fh.readline()
        if len(raw) > limit:
            raw = raw[:limit]
            fh.seek(at + limit)
        return raw


class TextFileSource(Source):
    """Lines of a text file (without the newline), a local path or an fsspec
    URL. The byte offset of the next line is the position, so a checkpoint
    can rewind exactly."""

    default_kind = "str"
    rewindable = True

    def __init__(self, path, encoding: str = "utf-8", end: int | None = None):
        self.path = os.fspath(path)
        self.encoding = encoding
        self.offset = 0
        # read up to this byte (a monitored file as it was when found
        # complete); None: to the end of the file
        self.end = end
        self._fh = None

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        if parallelism != 1:
            raise ValueError("read_text has parallelism 1")
        self._fh = fsx.open_input(self.path)
        self._fh.seek(self.offset)

    def next_batch(self, max_records):
        lines = []
        fh = self._fh
        encoding = self.encoding
        start = self.offset
        end = self.end
        for _ in range(max_records):
            if end is None:
                raw = fh.readline()
            elif end > self.offset:
                raw = _readline(fh, end - self.offset)
            else:
                break
            if not raw:
                break
            if self.offset == 0 and raw.startswith(_UTF8_BOM) and _is_utf8(encoding):
                raw = raw[3:]           # a byte-order mark is not text (read_csv drops it too)
                self.offset = 3
            try:
                lines.append(raw.rstrip(b"\r\n").decode(encoding))
            except UnicodeDecodeError as exc:
                raise self._not_text(exc, start, len(lines)) from None
            self.offset += len(raw)
        return lines or None

    def _not_text(self, exc, batch_start, in_batch):
        with fsx.open_input(self.path) as fh:
            line = fh.read(batch_start).count(b"\n") + 1 + in_batch
        return errors.FileFormatError(
            f"read_text: {self.path}, line {line}: not {self.encoding} text ({exc.reason} at byte {exc.start} "
            f"of the line){' (the file is Parquet: read it with read_parquet)' if _is_parquet(self.path) else ''}"
            f". Pass encoding= to read_text (e.g. encoding='latin-1')")

    def position(self):
        return self.offset

    def seek(self, position):
        self.offset = position
        if self._fh is not None:
            self._fh.seek(position)

    # A fingerprint of what was read, cheap enough for every checkpoint: the
    # first and the last FINGERPRINT_BYTES before the position. Data appended
    # after the position is fine (a log that grew while the job was down);
    # another file, or one rewritten before the position, is refused.
    def identity(self):
        fh = self._fh if self._fh is not None and not self._fh.closed else None
        return {"kind": "read_text", "path": fsx.canonical(self.path), "encoding": self.encoding,
                "offset": self.offset, **_prefix_fingerprint(fh, self.path, self.offset)}

    def check_identity(self, recorded, position):
        if not isinstance(recorded, dict) or recorded.get("kind") != "read_text":
            raise incompatible(self, f"the checkpoint's source was not a read_text ({recorded!r})")
        path = fsx.canonical(self.path)
        if recorded.get("path") != path:
            raise incompatible(self, f"the checkpoint read {recorded.get('path')}, this source reads {path}: "
                                     "its position would be applied to another file")
        if recorded.get("encoding") != self.encoding:
            raise incompatible(self, f"the checkpoint decoded {path} as {recorded.get('encoding')!r}, "
                                     f"this source as {self.encoding!r}")
        offset = recorded.get("offset")
        size = fsx.size(path)
        if not isinstance(offset, int) or size < offset:
            raise incompatible(self, f"{path} has {size} bytes, and the checkpoint had read {offset}: "
                                     "the file was replaced or truncated")
        now = _prefix_fingerprint(None, path, offset)
        for part in ("head", "tail"):
            if recorded.get(part) != now[part]:
                raise incompatible(self, f"{path}: the bytes the checkpoint had read (up to byte {offset}) "
                                         "differ now: the file was replaced or rewritten")

    def close(self):
        if self._fh is not None:
            self._fh.close()


FINGERPRINT_BYTES = 64 * 1024


def _prefix_fingerprint(fh, path, end) -> dict:
    """CRC-32 of the first and of the last FINGERPRINT_BYTES of ``path[:end]``
    (read through ``fh`` when it is open; a reading position it has is kept)."""
    n = min(end, FINGERPRINT_BYTES)
    if fh is not None and fsx.is_url(path):
        at = fh.tell()
        head, tail = fsx.read_at(path, 0, n, fh), fsx.read_at(path, end - n, n, fh)
        fh.seek(at)
    elif fh is not None:
        head, tail = fsx.read_at(path, 0, n, fh), fsx.read_at(path, end - n, n, fh)
    else:
        with fsx.open_input(path) as f:
            head, tail = fsx.read_at(path, 0, n, f), fsx.read_at(path, end - n, n, f)
    return {"head": zlib.crc32(head), "tail": zlib.crc32(tail)}


def file_fingerprint(path) -> list:
    """[absolute path or canonical URL, size, CRC-32 of the first and of the last FINGERPRINT_BYTES]."""
    size = fsx.size(path)
    fp = _prefix_fingerprint(None, path, size)
    return [fsx.canonical(path), size, fp["head"], fp["tail"]]


def incompatible(source, why):
    name = source.what or type(source).__name__
    return IncompatibleCheckpointError(f"cannot restore {name}: {why}", source=name)


class RateLimiter:
    """Token bucket for a static source rate limit (records/s and/or bytes/s),
    for sinks that cannot push back.

    The limit is the source's total: a source with parallelism p gives each
    subtask 1/p of it (``for_subtask``). Bytes are the records' payload as the
    source emits them (``payload_nbytes``: the length of bytes, the UTF-8
    length of str, 8 per number, ``nbytes`` of arrays and Arrow data), so the
    limit means the same whether or not the operators after it are chained.
    Waiting sleeps (the GIL is released, no core spins). The bucket holds at
    most one second of tokens so a stalled source cannot burst afterwards."""

    # a pull holds at most this much of the rate, so a throttled source emits
    # a steady trickle instead of a burst per second
    PULL_WINDOW_S = 0.02

    def __init__(self, records_per_s: float | None = None, bytes_per_s: float | None = None):
        if records_per_s is None and bytes_per_s is None:
            raise ValueError("RateLimiter needs records_per_s and/or bytes_per_s")
        self.records_per_s = _positive_rate("records_per_s", records_per_s)
        self.bytes_per_s = _positive_rate("bytes_per_s", bytes_per_s)
        self.rates = [self.records_per_s, self.bytes_per_s]
        self.tokens = [0.0 if r is None else min(r, 1.0) for r in self.rates]
        # counted from the first acquire: the time a job takes to start is no
        # credit for a burst
        self.last = None
        self._cancel = threading.Event()
        self._records = 0
        self._bytes = 0

    @property
    def counts_bytes(self) -> bool:
        return self.bytes_per_s is not None

    def for_subtask(self, parallelism: int) -> "RateLimiter":
        """A fresh bucket with this limit's share for one of ``parallelism`` subtasks."""
        share = [None if r is None else r / parallelism for r in self.rates]
        return RateLimiter(records_per_s=share[0], bytes_per_s=share[1])

    def pull_cap(self) -> int:
        """Records one pull may take: about PULL_WINDOW_S of the rate."""
        cap = float("inf")
        if self.records_per_s is not None:
            cap = self.records_per_s * self.PULL_WINDOW_S
        if self.bytes_per_s is not None and self._records:
            cap = min(cap, self.bytes_per_s * self.PULL_WINDOW_S * self._records / max(self._bytes, 1))
        return max(1, int(cap)) if cap != float("inf") else 1 << 30

    def acquire(self, records: int, nbytes: int = 0) -> None:
        """Wait until ``records`` records of ``nbytes`` bytes may go."""
        self._records += records
        self._bytes += nbytes
        need = (records, nbytes)
        if self.last is None:
            self.last = time.monotonic()
        while True:
            now = time.monotonic()
            dt, self.last = now - self.last, now
            wait = 0.0
            for i, rate in enumerate(self.rates):
                if rate is None:
                    continue
                self.tokens[i] = min(self.tokens[i] + dt * rate, max(rate, need[i]))
                if self.tokens[i] < need[i]:
                    wait = max(wait, (need[i] - self.tokens[i]) / rate)
            if wait <= 0:
                for i, rate in enumerate(self.rates):
                    if rate is not None:
                        self.tokens[i] -= need[i]
                return
            if self._cancel.wait(min(wait, 0.1)):
                return

    def cancel(self):
        self._cancel.set()

    def __repr__(self):
        return f"RateLimiter(records_per_s={self.records_per_s}, bytes_per_s={self.bytes_per_s})"


def _positive_rate(name, v):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v < float("inf"):
        raise ValueError(f"{name} must be a positive finite number per second, got {v!r}")
    return float(v)


def rate_limiter(rate_limit) -> RateLimiter | None:
    """The RateLimiter a source's ``rate_limit=`` asks for: None, records per
    second as a number, or a RateLimiter. Anything else is a ValueError naming
    ``rate_limit``, raised when the source is declared."""
    if rate_limit is None or isinstance(rate_limit, RateLimiter):
        return rate_limit
    try:
        return RateLimiter(records_per_s=rate_limit)
    except ValueError:
        raise ValueError(
            f"rate_limit must be records per second (a positive number) or a "
            f"RateLimiter(records_per_s=..., bytes_per_s=...), got {rate_limit!r}") from None


def payload_nbytes(batch: list) -> int:
    """The payload bytes of a batch of records, for a bytes/s rate limit."""
    return sum(map(_nbytes, batch))


def _nbytes(rec) -> int:
    t = type(rec)
    if t is bytes or t is bytearray:
        return len(rec)
    if t is str:
        return len(rec) if rec.isascii() else len(rec.encode("utf-8", "surrogatepass"))
    if t is int or t is float or t is bool or rec is None:
        return 8
    if t is memoryview:
        return rec.nbytes
    if t is tuple or t is list:
        return sum(map(_nbytes, rec))
    if t is dict:
        return sum(_nbytes(k) + _nbytes(v) for k, v in rec.items())
    nb = getattr(rec, "nbytes", None)            # NumPy arrays, Arrow batches and tables
    if isinstance(nb, int):
        return nb
    usage = getattr(rec, "memory_usage", None)   # pandas DataFrames
    if callable(usage):
        try:
            return int(usage(deep=True).sum())
        except Exception:
            pass
    return sys.getsizeof(rec)
