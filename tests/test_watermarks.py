"""Watermarks: the encoding that travels in events, the valve that combines
input channels (never decreasing, the minimum over channels, idle channels
left out), the timestamps assigner, and watermarks through running jobs
(local channels, and TCP with workers)."""
from __future__ import annotations

import datetime as dt
import math
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf.operators.contracts import Output
from pyflowbuf.time import watermarks as wmk
from pyflowbuf.time.watermarks import END_OF_TIME, NO_WATERMARK, TimestampsAssigner, WatermarkValve

times = st.floats(allow_nan=False, allow_infinity=True, width=64)


# ---- the event payload ----

@given(times)
def test_encode_decode_round_trip(t):
    aux = wmk.encode(t)
    assert -(1 << 63) <= aux < (1 << 63)
    assert wmk.decode(aux) == t
    assert aux != wmk.IDLE_AUX


def test_idle_marker_decodes_to_none():
    assert wmk.decode(wmk.IDLE_AUX) is None
    assert math.isnan(wmk.decode(wmk.encode(float("nan"))))     # an ordinary NaN is not the marker


def test_to_seconds():
    assert wmk.to_seconds(3) == 3.0 and type(wmk.to_seconds(3)) is float
    assert wmk.to_seconds(dt.datetime(1970, 1, 1, 0, 1)) == 60.0          # naive: UTC
    tz = dt.timezone(dt.timedelta(hours=2))
    assert wmk.to_seconds(dt.datetime(1970, 1, 1, 2, 0, 5, tzinfo=tz)) == 5.0
    with pytest.raises(errors.RecordTypeError, match="timestamp"):
        wmk.to_seconds("yesterday")


# ---- the valve, against a plain model ----

class ValveModel:
    """The rules of WatermarkValve, written out plainly: per channel the
    highest watermark; a channel is left out while idle, and after coming
    back below the task's watermark until it catches up; the task's
    watermark is the minimum over the others, and never goes down."""

    def __init__(self, n):
        self.wm = [NO_WATERMARK] * n
        self.idle = [False] * n
        self.behind = [False] * n
        self.current = NO_WATERMARK

    def watermark(self, c, w):
        self.wm[c] = max(self.wm[c], w)
        if self.idle[c]:
            self.idle[c] = False
            self.behind[c] = self.wm[c] < self.current
        if self.behind[c] and self.wm[c] >= self.current:
            self.behind[c] = False
        self._update()

    def go_idle(self, c):
        self.idle[c] = True
        self.behind[c] = False
        self._update()

    def finish(self, c):
        self.idle[c] = self.behind[c] = False
        self.wm[c] = END_OF_TIME
        self._update()

    def _update(self):
        active = [w for w, i, b in zip(self.wm, self.idle, self.behind) if not i and not b]
        if active:
            self.current = max(self.current, min(active))


ops = st.lists(st.tuples(st.sampled_from(["wm", "wm", "wm", "idle", "end"]), st.integers(0, 3),
                         st.floats(-100, 100, allow_nan=False)), max_size=60)


@given(st.integers(1, 4), ops)
def test_valve_matches_model(n, steps):
    valve = WatermarkValve([(0, c) for c in range(n)])
    model = ValveModel(n)
    seen = [valve.current]
    for op, c, w in steps:
        c %= n
        key = (0, c)
        before = valve.current
        if op == "wm":
            got = valve.on_watermark(key, w)
            model.watermark(c, w)
        elif op == "idle":
            got = valve.on_idle(key)
            model.go_idle(c)
        else:
            got = valve.on_channel_finished(key)
            model.finish(c)
        assert valve.current == model.current
        # a rise is reported exactly when it happens
        assert got == (valve.current if valve.current > before else None)
        seen.append(valve.current)
        assert valve.idle == all(model.idle)
    assert seen == sorted(seen), "the task's watermark went down"


@given(st.integers(1, 4), st.lists(st.tuples(st.integers(0, 3), st.floats(-1e6, 1e6)), max_size=80))
def test_valve_is_min_over_channels_without_idleness(n, steps):
    """With no channel idle, the task's watermark is the minimum over the
    channels' highest watermarks, and never decreases."""
    valve = WatermarkValve([(1, c) for c in range(n)])
    high = [NO_WATERMARK] * n
    last = NO_WATERMARK
    for c, w in steps:
        c %= n
        valve.on_watermark((1, c), w)
        high[c] = max(high[c], w)
        assert valve.current == min(high)
        assert valve.current >= last
        last = valve.current


@given(st.integers(2, 4), st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=30))
def test_idle_channel_does_not_hold_back(n, values):
    """One channel never sends; once it is marked idle the others decide."""
    valve = WatermarkValve([(0, c) for c in range(n)])
    for i, w in enumerate(values):
        valve.on_watermark((0, 1 + i % (n - 1)), w)
    assert valve.current == NO_WATERMARK          # channel 0 holds everything back
    valve.on_idle((0, 0))
    others = [max([NO_WATERMARK] + [w for i, w in enumerate(values) if 1 + i % (n - 1) == c])
              for c in range(1, n)]
    assert valve.current == min(others)
    # it comes back far behind: it does not pull the watermark down
    before = valve.current
    valve.on_watermark((0, 0), -1e9)
    assert valve.current == before


def test_all_idle_holds_and_reports_idle():
    valve = WatermarkValve([(0, 0), (0, 1)])
    valve.on_watermark((0, 0), 5.0)
    valve.on_watermark((0, 1), 7.0)
    assert valve.current == 5.0
    valve.on_idle((0, 0))
    assert valve.current == 7.0 and not valve.idle
    valve.on_idle((0, 1))
    assert valve.idle and valve.current == 7.0
    assert valve.on_watermark((0, 1), 9.0) == 9.0 and not valve.idle


def test_finished_channel_counts_as_end_of_time():
    valve = WatermarkValve([(0, 0), (1, 0)])
    valve.on_watermark((0, 0), 3.0)
    assert valve.current == NO_WATERMARK
    assert valve.on_channel_finished((1, 0)) == 3.0
    assert valve.on_channel_finished((0, 0)) == END_OF_TIME


def test_valve_needs_channels():
    with pytest.raises(ValueError):
        WatermarkValve([])


# ---- the assigner, driven by hand ----

class FakeOutput(Output):
    """An assigner's Output: mails run when the test says, no wall clock."""

    def __init__(self):
        self.mail = []
        self.sent = []

    def post(self, mail):
        self.mail.append(mail)

    def schedule(self, deadline, mail):
        return None

    def run_mail(self):
        while self.mail:
            self.mail.pop(0)()

    def emit_watermark(self, wm, force=False):
        self.sent.append(wm)

    def emit_idle(self):
        self.sent.append("idle")


def test_assigner_emits_after_the_batch_through_the_mailbox():
    op = TimestampsAssigner("ts", lambda r: r, 1.0, None, 0.0)
    op.chain_output = task = FakeOutput()
    op.open(0, 1)
    assert op.process_batch([5, 3, 4]) == [5, 3, 4]
    assert task.sent == []                          # not inside the batch: after it
    task.run_mail()
    assert task.sent == [4.0]
    op.process_batch([2])                           # no rise: nothing
    task.run_mail()
    op.process_batch([10])
    task.run_mail()
    assert task.sent == [4.0, 9.0]
    assert op.on_watermark(3.0) == ([], None)       # upstream watermarks stop here
    assert op.on_watermark(END_OF_TIME) == ([], END_OF_TIME)
    op.finish()


def test_assigner_datetimes_and_checkpoint():
    op = TimestampsAssigner("ts", lambda r: r, 0.0, None, 0.0)
    op.chain_output = FakeOutput()
    op.open(0, 1)
    op.process_batch([dt.datetime(1970, 1, 1, 0, 0, 10)])
    assert op.max_ts == 10.0
    snap = op.snapshot_state()
    op2 = TimestampsAssigner("ts", lambda r: r, 0.0, None, 0.0)
    op2.restore_state(snap)
    assert op2.max_ts == 10.0


def test_assign_timestamps_arguments_checked():
    env = fb.Environment()
    s = env.from_iterable([1, 2])
    with pytest.raises(errors.ConfigurationError, match="out_of_orderness"):
        s.assign_timestamps(lambda r: r, out_of_orderness=-1)
    with pytest.raises(errors.ConfigurationError, match="idle_timeout"):
        s.assign_timestamps(lambda r: r, idle_timeout=0)
    with pytest.raises(TypeError):
        s.assign_timestamps(42)
    with pytest.raises(errors.ConfigurationError, match="assign_timestamps"):
        s.key_by(lambda r: r).window(fb.Tumbling(1))


# ---- through running jobs ----

def _watch(records, *, parallelism=2, ooo=2.0, workers=None, ts_parallelism=2):
    """Per process subtask: the (record time, ctx.watermark) pairs it saw."""
    # small batches: watermarks go out between them, so records see them rise
    env = fb.Environment(parallelism=parallelism, workers=workers, max_batch=4)

    def fn(k, x, state, ctx):
        return [(ctx.timestamp, ctx.watermark)]

    out = (env.from_iterable(records)
              .assign_timestamps(lambda r: r[1], out_of_orderness=ooo, watermark_interval=0,
                                 parallelism=ts_parallelism)
              .key_by(lambda r: r[0])
              .process(fn, parallelism=1)
              .collect(parallelism=1))
    env.execute(timeout=60)
    return out.result


@pytest.mark.parametrize("workers", [None, 2])
def test_watermark_never_passes_a_record_within_bounds(workers):
    """Records at most ``ooo`` out of order are never behind the watermark
    where they arrive, and the watermark seen there never decreases, over
    two assigners feeding one task through local channels or TCP."""
    import random
    rnd = random.Random(7)
    records = [(f"k{rnd.randrange(3)}", float(i) - rnd.choice([0, 0, 0.5, 1.0, 2.0])) for i in range(400)]
    seen = _watch(records, workers=workers)
    assert len(seen) == len(records)
    wms = [w for _, w in seen]
    assert wms == sorted(wms)
    assert all(t >= w for t, w in seen)
    assert wms[-1] > 300                  # it did advance while the job ran


def test_watermark_is_min_over_inputs():
    """A fast and a slow stream connected: timers fire by the slower one's time."""
    env = fb.Environment(parallelism=1, buffer_timeout=0.01)
    fast_done = threading.Event()

    def slow_records():
        # ends only after the last fast record was processed: an input that
        # ended counts as +inf and would no longer hold the watermark back
        for t in range(100):
            yield ("slow", float(t) / 10)
        fast_done.wait(30)

    fast = env.from_iterable([("fast", float(t)) for t in range(100)]).assign_timestamps(
        lambda r: r[1], watermark_interval=0)
    slow = env.from_generator(slow_records).assign_timestamps(lambda r: r[1], watermark_interval=0)
    seen = []

    def f(k, x, st, ctx):
        seen.append(ctx.watermark)
        if x == ("fast", 99.0):
            fast_done.set()

    fast.key_by(lambda r: 0).connect(slow.key_by(lambda r: 0)).process(f, f).sink(lambda x: None)
    env.execute(timeout=60)
    assert fast_done.is_set()
    # the slow stream never gets past 9.9, so neither does the task's watermark before the end
    assert max(seen) <= 9.9
    assert seen == sorted(seen)


def test_idle_input_does_not_hold_windows_back():
    """A stream whose source goes quiet is marked idle after idle_timeout,
    so the windows of the other stream fire while it is still quiet."""
    env = fb.Environment(parallelism=1, buffer_timeout=0.01)
    gate = threading.Event()

    def busy():
        for i in range(30):
            yield ("a", float(i))
            time.sleep(0.03)

    def quiet():
        yield ("a", 0.0)
        gate.wait(10)        # quiet until the test saw a window fire

    fired_at = []

    def on_timer(k, t, st, ctx):
        fired_at.append((t, time.monotonic()))
        gate.set()

    def f(k, x, st, ctx):
        ctx.register_event_time_timer(5.0)

    a = env.from_generator(busy).rebalance().assign_timestamps(lambda r: r[1], idle_timeout=0.2)
    b = env.from_generator(quiet).rebalance().assign_timestamps(lambda r: r[1], idle_timeout=0.2)
    a.union(b).key_by(lambda r: r[0]).process(f, on_timer=on_timer).sink(lambda x: None)
    t0 = time.monotonic()
    env.execute(timeout=60)
    assert fired_at and fired_at[0][0] == 5.0
    assert fired_at[0][1] - t0 < 5, "the quiet stream held the watermark back until the end"


def test_without_idle_timeout_a_quiet_input_holds_back():
    env = fb.Environment(parallelism=1, buffer_timeout=0.01)
    released = []

    def busy():
        for i in range(10):
            yield ("a", float(i))

    def quiet():
        yield ("a", 0.0)
        time.sleep(0.8)
        released.append(time.monotonic())

    fired = []
    a = env.from_generator(busy).rebalance().assign_timestamps(lambda r: r[1])
    b = env.from_generator(quiet).rebalance().assign_timestamps(lambda r: r[1])
    a.union(b).key_by(lambda r: r[0]).process(
        lambda k, x, st, ctx: ctx.register_event_time_timer(5.0),
        on_timer=lambda k, t, st, ctx: fired.append(time.monotonic())).sink(lambda x: None)
    env.execute(timeout=60)
    assert fired and released and fired[0] >= released[0]


def test_watermark_events_cross_tcp_with_inferred_kinds():
    """workers=2: the watermark events go over the TCP exchange before the
    first data buffer (the kind event comes later) and after it."""
    records = [("k%d" % (i % 5), float(i)) for i in range(300)]
    env = fb.Environment(parallelism=2, workers=2)
    out = (env.from_iterable(records)
              .assign_timestamps(lambda r: r[1], watermark_interval=0)
              .key_by(lambda r: r[0])
              .window(fb.Tumbling(10.0))
              .aggregate(fb.windows.Count(), window_function=lambda k, w, n: (k, w.start, n))
              .collect())
    env.execute(timeout=60)
    expect = {}
    for k, t in records:
        expect[(k, math.floor(t / 10) * 10.0)] = expect.get((k, math.floor(t / 10) * 10.0), 0) + 1
    assert sorted(out.result) == sorted((k, s, n) for (k, s), n in expect.items())


# ---- issue 18, item 3: timestamp units, NaN timestamps, settings in seconds

def _tumbling_counts(records, chaining=True, **ts_kw):
    from pyflowbuf.windows import Count, Tumbling
    env = fb.Environment(chaining=chaining)
    out = (env.from_collection(records)
              .assign_timestamps(lambda r: r[1], name="stamps", **ts_kw)
              .key_by(lambda r: r[0])
              .window(Tumbling(1.0))
              .aggregate(Count(), window_function=lambda k, w, n: (k, w.start, n))
              .collect())
    env.execute(timeout=30)
    return sorted(out.result)


MS_RECORDS = [("a", 1_700_000_000_000 + 100 * i) for i in range(20)]     # 2 s of records, in ms


@pytest.mark.parametrize("chaining", [True, False])
def test_milliseconds_with_unit_ms_fill_one_second_windows(chaining):
    got = _tumbling_counts(MS_RECORDS, chaining, unit="ms")
    assert got == [("a", 1_700_000_000.0, 10), ("a", 1_700_000_001.0, 10)]


@pytest.mark.parametrize("parallelism", [1, 3])
def test_milliseconds_read_as_seconds_warn_once_naming_the_operator(parallelism):
    from pyflowbuf.windows import Count, Tumbling
    env = fb.Environment(parallelism=parallelism)
    (env.from_collection(MS_RECORDS * 3).rebalance()
        .assign_timestamps(lambda r: r[1], name="stamps")
        .key_by(lambda r: r[0]).window(Tumbling(1.0)).aggregate(Count()).collect())
    with pytest.warns(errors.UnitWarning, match="'stamps'.*unit='ms'") as rec:
        env.execute(timeout=30)
    assert len([w for w in rec if issubclass(w.category, errors.UnitWarning)]) == 1


def test_seconds_do_not_warn(recwarn):
    _tumbling_counts([("a", 1_700_000_000.0 + 0.1 * i) for i in range(20)])
    assert not [w for w in recwarn if issubclass(w.category, errors.UnitWarning)]


@pytest.mark.parametrize("unit, scale", [("us", 1e6), ("ns", 1e9)])
def test_finer_units(unit, scale):
    recs = [("a", int((1_700_000_000 + 0.1 * i) * scale)) for i in range(20)]
    assert _tumbling_counts(recs, unit=unit) == [("a", 1_700_000_000.0, 10), ("a", 1_700_000_001.0, 10)]


def test_a_bad_unit_is_refused_at_declaration():
    env = fb.Environment()
    with pytest.raises(errors.ConfigurationError, match="unit"):
        env.from_collection([1]).assign_timestamps(lambda r: r, unit="minutes")
    with pytest.raises(errors.ConfigurationError, match="column"):
        env.from_collection([1]).assign_timestamps("ts", unit="ms")


@pytest.mark.parametrize("chaining", [True, False])
@pytest.mark.parametrize("bad", [math.nan, None], ids=["nan", "NaT"])
def test_a_nan_timestamp_is_refused_not_dropped(chaining, bad):
    import numpy as np
    if bad is None:
        bad = np.datetime64("NaT")
        recs = [("a", np.datetime64("2024-01-01T00:00:01")), ("a", bad), ("a", np.datetime64("2024-01-01T00:00:02"))]
    else:
        recs = [("a", 1.0), ("a", bad), ("a", 2.0)]
    with pytest.raises(errors.JobFailedError) as info:
        _tumbling_counts(recs, chaining)
    cause = info.value.__cause__
    assert isinstance(cause, errors.InvalidTimestampError) and isinstance(cause, ValueError)
    assert "'stamps'" in str(cause)


def test_a_nan_timestamp_column_is_refused():
    pa = pytest.importorskip("pyarrow")
    env = fb.Environment()
    batch = pa.RecordBatch.from_pydict({"k": ["a", "b"], "ts": [1.0, math.nan]})
    env.from_collection([batch], kind="arrow").assign_timestamps("ts", name="stamps").collect()
    with pytest.raises(errors.JobFailedError) as info:
        env.execute(timeout=30)
    assert isinstance(info.value.__cause__, errors.InvalidTimestampError)
    assert "'stamps'" in str(info.value.__cause__) and "NaN" in str(info.value.__cause__)


@pytest.mark.parametrize("setting, value", [("checkpoint_interval", 1000), ("buffer_timeout", 100),
                                            ("checkpoint_timeout", 600_000), ("debloat_target", 1000),
                                            ("metrics_interval", 5000)])
def test_settings_that_look_like_milliseconds_warn(setting, value):
    with pytest.warns(errors.UnitWarning, match=setting):
        fb.Environment(**{setting: value}, **({"debloat": True} if setting.startswith("debloat") else {}))


def test_settings_in_plausible_seconds_do_not_warn(recwarn):
    fb.Environment(checkpoint_interval=30, buffer_timeout=0.1, checkpoint_timeout=600, debloat=True, debloat_target=1.0)
    env = fb.Environment()
    env.from_collection([1]).assign_timestamps(lambda r: r, watermark_interval=0.2)
    assert not [w for w in recwarn if issubclass(w.category, errors.UnitWarning)]
    with pytest.warns(errors.UnitWarning, match="watermark_interval"):
        env.from_collection([1]).assign_timestamps(lambda r: r, watermark_interval=200)


@pytest.mark.parametrize("chaining", [True, False])
def test_a_pandas_nat_timestamp_is_refused(chaining):
    pd = pytest.importorskip("pandas")
    recs = [("a", pd.Timestamp("2024-01-01")), ("a", pd.NaT)]
    with pytest.raises(errors.JobFailedError) as info:
        _tumbling_counts(recs, chaining)
    assert isinstance(info.value.__cause__, errors.InvalidTimestampError)


def test_to_seconds_of_no_time_is_nan_and_of_other_objects_a_record_type_error():
    import numpy as np
    assert math.isnan(wmk.to_seconds(np.datetime64("NaT")))
    with pytest.raises(errors.RecordTypeError):
        wmk.to_seconds(np.array([1.0, 2.0]))
