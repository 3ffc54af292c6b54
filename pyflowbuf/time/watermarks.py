"""Event time: timestamps, watermarks, and the valve that combines them.

Times are seconds of event time as floats (ints, and datetimes, are converted).
A watermark W says "no record with a timestamp below W is expected any more":
a window [start, end) is complete once W >= end, and an event-time timer at t
fires once W >= t.

Watermarks are events that travel with the records (``EVT_WATERMARK``), like
checkpoint barriers: a producer broadcasts them to every subpartition after
the records written before them, over local channels and TCP alike, with no
credit. A task with several input channels takes the minimum over them
(``WatermarkValve``, plain logic so it can be tested without threads); a
channel marked idle does not hold the others back. End of input is +inf, so
every window fires.

``TimestampsAssigner`` is the operator behind ``Stream.assign_timestamps``:
the bounded-out-of-orderness generator (watermark = highest timestamp seen -
out_of_orderness), emitting periodically (Flink's 200 ms auto-watermark
interval) through the task's mailbox, so a watermark always follows the
records it covers.
"""
from __future__ import annotations

import datetime as _dt
import math
from array import array as _array
import numbers
import struct
import time
import warnings
from typing import Hashable, Iterable

import numpy as np

from pyflowbuf import errors
from pyflowbuf._core.serde import ts_apply, ts_max
from pyflowbuf.operators.contracts import Operator
from pyflowbuf.serializers import short_repr

NO_WATERMARK = -math.inf
END_OF_TIME = math.inf

_PACK = struct.Struct("<d")
_UNPACK = struct.Struct("<q")
# A quiet NaN with a payload no arithmetic produces: "this channel is idle".
IDLE_AUX = _UNPACK.unpack(struct.pack("<Q", 0x7FF8_1D1E_0000_0001))[0]


def encode(watermark: float) -> int:
    """The int64 payload of a watermark event: the bits of the float64."""
    return _UNPACK.unpack(_PACK.pack(watermark))[0]


def decode(aux: int) -> float | None:
    """The watermark in an event's payload; None for the idle marker."""
    if aux == IDLE_AUX:
        return None
    return _PACK.unpack(_UNPACK.pack(aux))[0]


def to_seconds(t) -> float:
    """An event timestamp as float seconds: numbers as they are, datetimes
    (naive ones read as UTC, so the answer does not depend on the machine's
    zone) as seconds since the epoch, NumPy datetime64 and pandas Timestamps too."""
    if isinstance(t, float):
        return t
    if isinstance(t, numbers.Real) and not isinstance(t, bool):
        return float(t)
    if isinstance(t, _dt.datetime):
        if t != t:      # pd.NaT: no time, as NaN (refused by the assigner)
            return math.nan
        if t.tzinfo is None:
            t = t.replace(tzinfo=_dt.timezone.utc)
        return t.timestamp()
    if type(t).__name__ == "datetime64":
        if np.isnat(t):
            return math.nan
        return float(t.astype("datetime64[us]").astype(np.int64)) / 1e6
    raise errors.RecordTypeError(
        f"a timestamp function returned {t!r} ({type(t).__name__}); event time is seconds as a float "
        "or int, or a datetime")


# seconds in one of each unit= of assign_timestamps
UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}
# above this a timestamp in seconds is past the year 5000: almost surely
# milliseconds (1.7e12 today), microseconds or nanoseconds since 1970
SECONDS_LOOK_LIKE_MS = 1e11


def in_unit(fn, unit: str):
    """``fn`` giving seconds, for a timestamp function whose numbers are in
    ``unit``; datetimes carry their own unit and are converted as they are."""
    per_s = UNITS[unit]

    def seconds(record):
        t = fn(record)
        if isinstance(t, numbers.Real) and not isinstance(t, bool):
            return t / per_s
        return t
    return seconds


def check_seconds(name: str, value, *, optional=False, positive=False) -> float | None:
    """A duration argument (out_of_orderness, idle_timeout, window sizes) as
    float seconds, or a ConfigurationError naming it."""
    if value is None and optional:
        return None
    if isinstance(value, _dt.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise errors.ConfigurationError(f"{name} must be a finite number of seconds, got {value!r}")
    value = float(value)
    if value < 0 or (positive and value == 0):
        raise errors.ConfigurationError(f"{name} must be {'> 0' if positive else '>= 0'} seconds, got {value!r}")
    return value


Key = Hashable     # (input index, channel)


class WatermarkValve:
    """The watermark of a task with several input channels.

    Each channel's watermark only rises (a lower one is ignored). The task's
    watermark is the minimum over the active channels, and never decreases.
    A channel marked idle is left out until it sends a watermark again; a
    channel that comes back below the task's watermark is left out too until
    it catches up (it is not "aligned"), so its return does not stall the
    others. When every channel is idle the task is idle and holds its
    watermark. A finished channel counts as +inf.
    """

    def __init__(self, channels: Iterable[Key]):
        self.channel_wm: dict = {k: NO_WATERMARK for k in channels}
        if not self.channel_wm:
            raise ValueError("a WatermarkValve needs at least one channel")
        self.idle_channels: set = set()
        self.unaligned: set = set()
        self.current = NO_WATERMARK

    @property
    def idle(self) -> bool:
        """Every channel is idle: the task has no watermark to give."""
        return len(self.idle_channels) == len(self.channel_wm)

    def on_watermark(self, key: Key, watermark: float) -> float | None:
        """Channel ``key`` sent ``watermark``; the task's new watermark if it rose."""
        wm = self.channel_wm
        if watermark > wm[key]:
            wm[key] = watermark
        if key in self.idle_channels:
            self.idle_channels.discard(key)
            if wm[key] < self.current:
                self.unaligned.add(key)
        if key in self.unaligned and wm[key] >= self.current:
            self.unaligned.discard(key)
        return self._recompute()

    def on_idle(self, key: Key) -> float | None:
        """Channel ``key`` went idle; the task's new watermark if it rose."""
        self.idle_channels.add(key)
        self.unaligned.discard(key)
        return self._recompute()

    def on_channel_finished(self, key: Key) -> float | None:
        """Channel ``key`` ended: it holds nothing back any more."""
        self.idle_channels.discard(key)
        self.unaligned.discard(key)
        self.channel_wm[key] = END_OF_TIME
        return self._recompute()

    def _recompute(self) -> float | None:
        skip_idle, skip_unaligned = self.idle_channels, self.unaligned
        low = None
        for k, w in self.channel_wm.items():
            if k in skip_idle or k in skip_unaligned:
                continue
            if low is None or w < low:
                low = w
        if low is None or low <= self.current:
            return None
        self.current = low
        return low


class TimestampsAssigner(Operator):
    """``assign_timestamps``: passes records through, tracks the highest
    timestamp, and emits watermark = highest - out_of_orderness every
    ``interval`` seconds of processing time (0: after every batch), after the
    records that raised it. Watermarks from upstream stop here (this
    operator decides event time from now on), except the end of input.

    With ``idle_timeout``, a subtask that got no records for that long tells
    its consumers it is idle, so they do not wait for its watermark.

    ``ts_fn`` is a function of a record, or for Arrow/pandas batch streams a
    column name (timestamps per row, the highest found with pyarrow compute).
    """

    event_time = True
    passes_records = True       # its output is its input, unchanged (see Subtask)

    def __init__(self, name, ts_fn, out_of_orderness: float, idle_timeout: float | None, interval: float,
                 unit: str = "s", shared: dict | None = None):
        super().__init__(name)
        self.unit = unit
        self._unit_checked = False
        # what the operator's subtasks (in this process) share: which of them warned
        self._shared = {} if shared is None else shared
        self.ts_fn = ts_fn
        self.column = ts_fn if isinstance(ts_fn, str) else None
        self.out_of_orderness = out_of_orderness
        self.idle_timeout = idle_timeout
        self.interval = interval
        self.max_ts = NO_WATERMARK
        self.emitted = NO_WATERMARK

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        self._last_emit_ns = time.monotonic_ns()
        self._last_record_ns = self._last_emit_ns
        self._mail_pending = False
        self.is_idle = False
        self._closed = False
        self._timer = None
        if self.chain_output is not None and (self.interval > 0 or self.idle_timeout is not None):
            self._schedule_tick()
        if self.max_ts > NO_WATERMARK:
            # restored: the watermark goes out again before the first record,
            # as it went out before the records after the checkpoint
            self._post_emit(force=True)

    @property
    def watermark(self) -> float:
        return self.max_ts - self.out_of_orderness

    # ---- records ----
    def process_batch(self, batch):
        return self.process_ts(batch, None)[0]

    def process_ts(self, batch, ts_in):
        """The records as they are, and (on a stream whose timestamps travel)
        their times from ``ts_fn``, replacing any they came with."""
        if not batch:
            return batch, None
        stamps = None
        if self.column is not None:
            high = _batch_max(batch, self.column, self.name)
        elif self.timestamped:
            # the times the records travel with: one array, its max (NaN if a
            # time is NaN) in one C loop, no list of floats on the way
            try:
                stamps, high = ts_apply(self.ts_fn, batch)
            except TypeError:   # datetimes (and bools): converted (or refused) one by one
                stamps = _array("d", [to_seconds(t) for t in map(self.ts_fn, batch)])
                high = ts_max(stamps)
            if high != high:
                self._refuse_nan(batch, stamps)
        else:
            ts = list(map(self.ts_fn, batch))
            try:
                high = max(ts)
                total = sum(ts)     # NaN when a timestamp is: one C loop, not a test per record
            except TypeError:       # datetimes, or a mix
                ts = [to_seconds(t) for t in ts]
                high = max(ts)
                total = sum(ts)
            if total != total:
                self._refuse_nan(batch, ts)
            if type(high) is not float:
                high = to_seconds(high)
        if not self._unit_checked:
            self._check_unit(high)
        if high > self.max_ts:
            self.max_ts = high
        self._last_record_ns = now = time.monotonic_ns()
        if self.is_idle:
            self.is_idle = False
            self._post_emit(force=True)
        elif self.watermark > self.emitted and (
                self.interval == 0 or now - self._last_emit_ns >= self.interval * 1e9):
            self._post_emit()
        return batch, stamps

    def _refuse_nan(self, batch, ts):
        for x, t in zip(batch, ts):
            if to_seconds(t) != to_seconds(t):
                raise errors.InvalidTimestampError(
                    f"operator {self.name!r}: the timestamp of record {short_repr(x)} is {t!r}: a record "
                    "with no time belongs to no window and would be lost. Filter such records out "
                    "before assign_timestamps, or give them a time")

    def _check_unit(self, high):
        self._unit_checked = True
        if (self.unit == "s" and abs(high) > SECONDS_LOOK_LIKE_MS and high != END_OF_TIME
                and self._shared.setdefault("unit_warning", self) is self):     # one subtask warns
            warnings.warn(errors.UnitWarning(
                f"operator {self.name!r}: timestamps are read as seconds, and the first ones (up to "
                f"{high:.6g}) look like milliseconds or finer since 1970: every record would get a window "
                "of its own. Pass unit='ms' (or 'us', 'ns') to assign_timestamps"), stacklevel=2)

    def on_watermark(self, watermark):
        if watermark == END_OF_TIME:
            self.max_ts = END_OF_TIME
            self.emitted = END_OF_TIME
            return [], END_OF_TIME
        return [], None

    # ---- emission, in the task's thread, between batches ----
    def _post_emit(self, force=False):
        output = self.chain_output
        if output is None or self._mail_pending:
            return
        self._mail_pending = True
        output.post(lambda: self._emit(force))

    def _emit(self, force=False):
        self._mail_pending = False
        if self._closed:
            return
        wm = self.watermark
        self._last_emit_ns = time.monotonic_ns()
        if wm > self.emitted or force:
            self.emitted = max(wm, self.emitted)
            self.chain_output.emit_watermark(self.emitted, force=force)

    def _schedule_tick(self):
        period = self.interval if self.interval > 0 else 0.2
        if self.idle_timeout is not None:
            period = min(period, max(self.idle_timeout / 2, 0.01))
        self._timer = self.chain_output.schedule(time.time() + period, self._tick)

    def _tick(self):
        if self._closed:
            return
        now = time.monotonic_ns()
        if self.watermark > self.emitted:
            self._emit()
        if (self.idle_timeout is not None and not self.is_idle
                and now - self._last_record_ns >= self.idle_timeout * 1e9):
            self.is_idle = True
            self.chain_output.emit_idle()
        self._schedule_tick()

    def finish(self):
        self._closed = True
        return []

    # ---- checkpoints: the watermark goes on where it was ----
    def snapshot_state(self):
        return {"max_ts": self.max_ts}

    def restore_state(self, state):
        if state:
            self.max_ts = state["max_ts"]

    def rescale_state(self, states, index, parallelism):
        # the lowest: a subtask now sees keys another saw, never a later watermark
        known = [s["max_ts"] for s in states if s]
        return {"max_ts": min(known)} if known else None


def _batch_max(batch, column, operator=None) -> float:
    """The highest timestamp in ``column`` of a list of Arrow RecordBatches/
    Tables or pandas DataFrames."""
    high = NO_WATERMARK
    for b in batch:
        h = column_max_seconds(b, column, operator)
        if h > high:
            high = h
    return high


def column_max_seconds(b, column, operator=None) -> float:
    import pyarrow as pa  # optional dependency: Arrow / pandas batches only
    import pyarrow.compute as pc

    if not isinstance(b, (pa.RecordBatch, pa.Table)):
        b = pa.Table.from_pandas(b, preserve_index=False)
    if b.num_rows == 0:
        return NO_WATERMARK
    col = seconds_column(b.column(column))
    if operator is not None and (col.null_count or pc.any(pc.is_nan(col)).as_py()):
        raise errors.InvalidTimestampError(
            f"operator {operator!r}: column {column!r} holds {col.null_count} null and "
            f"{pc.sum(pc.cast(pc.is_nan(col), pa.int64())).as_py() or 0} NaN timestamps: rows with no "
            "time belong to no window. Filter them out before assign_timestamps")
    return float(pc.max(col).as_py())


def seconds_column(col):
    """A timestamp column as float64 seconds (Arrow timestamps converted)."""
    import pyarrow as pa  # optional dependency: Arrow columns only
    import pyarrow.compute as pc

    t = col.type
    if pa.types.is_timestamp(t):
        scale = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}[t.unit]
        return pc.divide(pc.cast(col.cast(pa.timestamp(t.unit)), pa.int64()), scale)
    if not pa.types.is_floating(t):
        return pc.cast(col, pa.float64())
    return col
