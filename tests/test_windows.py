"""Windows against a plain-Python reference.

The reference replays the stream one record at a time with the watermark an
assigner makes (highest timestamp so far minus out_of_orderness), firing a
window when the watermark reaches its end, keeping it for the allowed
lateness (firing again per record that arrives in that time), and calling
a record late when every window it belongs to is past that. The jobs run
with ``max_batch=1`` and ``watermark_interval=0`` where lateness matters, so
the watermark before each record is exactly the reference's; with bounded
disorder (no record late) any batching must give the same windows.
"""
from __future__ import annotations

import math
import random
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf.windows import AggregateFunction, Count, Session, Sliding, Tumbling
from pipeline_helpers import Times, random_stream


# ---- the reference ----

def ref_windows(kind, size, slide, t):
    """The windows of time t, written out from their definitions."""
    if kind == "tumbling":
        start = math.floor(t / size) * size
        return [(start, start + size)]
    if kind == "sliding":
        out = []
        k = math.floor(t / slide)
        while k * slide > t - size:
            out.append((k * slide, k * slide + size))
            k -= 1
        return out
    return [(t, t + size)]       # session: the record's own window before merging


def reference(records, *, kind, size, slide=None, ooo=0.0, lateness=0.0, ts_lag=None):
    """(results, late): results as (key, start, end, sorted times) per firing.

    ``ts_lag``: how many records behind the watermark is (1: the assigner's
    watermark covers every record before this one)."""
    results, late = [], []
    windows = {}        # non-merging: (k, s, e) -> [times]; merging: k -> list of [s, e, times]
    fired = set()       # non-merging windows already fired
    high = -math.inf
    wm = -math.inf

    def advance(new):
        nonlocal wm
        if new <= wm:
            return
        wm = new
        if kind == "session":
            for k, sess in windows.items():
                for s in sess:
                    if s[1] <= wm and not s[3]:
                        s[3] = True
                        results.append((k, s[0], s[1], sorted(s[2])))
                windows[k] = [s for s in sess if s[1] + lateness > wm]
            return
        for wk in sorted(windows, key=lambda w: w[2]):
            if wk[2] <= wm and wk not in fired:
                fired.add(wk)
                results.append((wk[0], wk[1], wk[2], sorted(windows[wk])))
        for wk in [w for w in windows if w[2] + lateness <= wm]:
            del windows[wk]

    for k, t in records:
        advance(high - ooo)
        high = max(high, t)
        if kind == "session":
            sess = windows.setdefault(k, [])
            lo, hi = t, t + size
            hits = [s for s in sess if s[0] <= hi and lo <= s[1]]
            lo = min([lo] + [s[0] for s in hits])
            hi = max([hi] + [s[1] for s in hits])
            if hi + lateness <= wm:
                late.append((k, t))
                continue
            items = [t] + [x for s in hits for x in s[2]]
            for s in hits:
                sess.remove(s)
            new = [lo, hi, items, hi <= wm]
            sess.append(new)
            if hi <= wm:
                results.append((k, lo, hi, sorted(items)))
            continue
        placed = False
        for s, e in ref_windows(kind, size, slide, t):
            if e + lateness <= wm:
                continue
            placed = True
            windows.setdefault((k, s, e), []).append(t)
            if e <= wm:
                fired.add((k, s, e))
                results.append((k, s, e, sorted(windows[(k, s, e)])))
        if not placed:
            late.append((k, t))
    advance(math.inf)
    return results, late


def assigner_for(kind, size, slide):
    return {"tumbling": lambda: Tumbling(size), "sliding": lambda: Sliding(size, slide),
            "session": lambda: Session(size)}[kind]()


def run_job(records, *, kind, size, slide=None, ooo=0.0, lateness=0.0, parallelism=1, workers=None,
            how="process", exact=True, with_late=True, late_first=True):
    env = fb.Environment(parallelism=parallelism, workers=workers, max_batch=1 if exact else 1024)
    w = (env.from_iterable(records)
            .assign_timestamps(lambda r: r[1], out_of_orderness=ooo, watermark_interval=0 if exact else 0.2,
                               parallelism=1 if exact else None)
            .key_by(lambda r: r[0])
            .window(assigner_for(kind, size, slide))
            .allowed_lateness(lateness))
    if how == "process":
        res = w.process(lambda k, win, recs: [(k, win.start, win.end, sorted(r[1] for r in recs))])
    elif how == "aggregate":
        res = w.aggregate(Times(), window_function=lambda k, win, ts: (k, win.start, win.end, ts))
    else:
        res = w.reduce(lambda a, b: (a[0], a[1], a[2] + b[2]),
                       window_function=lambda k, win, r: (k, win.start, win.end, sorted(r[2])))
    late = res.late() if with_late and late_first else None
    out = res.collect()
    if with_late and not late_first:
        late = res.late()       # after the results are used: they keep their reader
    late_out = late.collect() if late is not None else None
    env.execute(timeout=120)
    return out.result, (late_out.result if late_out is not None else None), env


def norm(rows):
    return sorted((k, float(s), float(e), list(ts)) for k, s, e, ts in rows)


# ---- differential tests ----

@pytest.mark.parametrize("kind,size,slide", [("tumbling", 1.0, None), ("sliding", 2.0, 0.5),
                                             ("sliding", 1.0, 1.5), ("session", 0.75, None)])
@pytest.mark.parametrize("parallelism", [1, 3])
def test_each_window_type_matches_reference_with_lateness(kind, size, slide, parallelism):
    rnd = random.Random(zlib.crc32(repr((kind, size, slide, parallelism)).encode()))
    for trial in range(2):
        records = random_stream(rnd, 160, disorder=6, very_late=0.08)
        ooo = rnd.choice([0.0, 0.5])
        lateness = rnd.choice([0.0, 0.75, 2.0])
        want, want_late = reference(records, kind=kind, size=size, slide=slide, ooo=ooo, lateness=lateness)
        got, got_late, env = run_job(records, kind=kind, size=size, slide=slide, ooo=ooo, lateness=lateness,
                                     parallelism=parallelism)
        assert norm(got) == norm(want), (trial, ooo, lateness)
        assert sorted(got_late) == sorted(want_late)
        assert want_late, "the stream should have late records"


@pytest.mark.parametrize("how", ["aggregate", "reduce"])
@pytest.mark.parametrize("kind", ["tumbling", "sliding", "session"])
def test_aggregate_and_reduce_match_reference(how, kind):
    rnd = random.Random(len(how) * 31 + len(kind))
    size, slide = {"tumbling": (1.0, None), "sliding": (1.5, 0.5), "session": (0.5, None)}[kind]
    records = random_stream(rnd, 150, disorder=5, very_late=0.05)
    if how == "reduce":
        records = [(k, t) for k, t in records]
    want, want_late = reference(records, kind=kind, size=size, slide=slide, ooo=0.25, lateness=0.5)
    if how == "reduce":
        # reduce folds (key, time, [times]) records; same windows, same times
        job_records = [(k, t, [t]) for k, t in records]
        got, _, env = run_job(job_records, kind=kind, size=size, slide=slide, ooo=0.25, lateness=0.5,
                              parallelism=2, how="reduce", with_late=False)
    else:
        got, _, env = run_job(records, kind=kind, size=size, slide=slide, ooo=0.25, lateness=0.5,
                              parallelism=2, how="aggregate", with_late=False)
    assert norm(got) == norm(want)
    dropped = sum(m.get("late_records_dropped", 0) for m in env.metrics().values())
    assert dropped == len(want_late) > 0


@settings(max_examples=8)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["tumbling", "sliding", "session"]), st.integers(1, 3))
def test_random_streams_bounded_disorder_any_batching(seed, kind, parallelism):
    """Disorder within out_of_orderness: no record is late whatever the
    batching and watermark timing, so the windows are the reference's."""
    rnd = random.Random(seed)
    size, slide = {"tumbling": (2.0, None), "sliding": (2.0, 0.75), "session": (0.5, None)}[kind]
    records = random_stream(rnd, rnd.randint(0, 400), keys=4, disorder=4)
    want, late = reference(records, kind=kind, size=size, slide=slide, ooo=1.0)
    assert not late
    got, got_late, _ = run_job(records, kind=kind, size=size, slide=slide, ooo=1.0, parallelism=parallelism,
                               exact=False)
    assert norm(got) == norm(want)
    assert got_late == []


@pytest.mark.parametrize("kind", ["tumbling", "session"])
def test_workers_struct_records_cross_processes(kind):
    """workers=2: (key, time) tuples travel as struct over TCP, windows and
    late records come back exactly as the reference says."""
    rnd = random.Random(5)
    size = 1.0 if kind == "tumbling" else 0.5
    records = random_stream(rnd, 120, disorder=4, very_late=0.06)
    want, want_late = reference(records, kind=kind, size=size, ooo=0.25, lateness=0.5)
    got, got_late, _ = run_job(records, kind=kind, size=size, ooo=0.25, lateness=0.5, parallelism=2,
                               workers=2)
    assert norm(got) == norm(want)
    assert sorted(map(tuple, got_late)) == sorted(want_late)


@pytest.mark.parametrize("parallelism", [1, 2])
def test_tumbling_count_fast_path_matches_reference(parallelism):
    rnd = random.Random(21)
    records = random_stream(rnd, 300, keys=4, disorder=6, very_late=0.05)
    want, want_late = reference(records, kind="tumbling", size=1.0, ooo=0.5, lateness=0.5)
    env = fb.Environment(parallelism=parallelism, max_batch=1)
    out = (env.from_iterable(records)
              .assign_timestamps(lambda r: r[1], out_of_orderness=0.5, watermark_interval=0, parallelism=1)
              .key_by(lambda r: r[0])
              .window(Tumbling(1.0))
              .allowed_lateness(0.5)
              .aggregate(Count(), window_function=lambda k, w, n: (k, w.start, w.end, n))
              .collect())
    env.execute(timeout=60)
    assert sorted(out.result) == sorted((k, s, e, len(ts)) for k, s, e, ts in want)
    assert sum(m.get("late_records_dropped", 0) for m in env.metrics().values()) == len(want_late) > 0


def test_windowed_word_count_every_window_fires_at_end():
    """The case from the issue: every key's last window comes out, because
    end of input takes the watermark to +inf."""
    words = [("a", 0.5), ("b", 1.2), ("a", 1.9), ("a", 2.1), ("c", 2.2), ("b", 5.0)]
    env = fb.Environment(parallelism=2)
    out = (env.from_iterable(words)
              .assign_timestamps(lambda r: r[1])
              .key_by(lambda r: r[0])
              .window(Tumbling(1.0))
              .aggregate(Count(), window_function=lambda k, w, n: (k, w.start, n))
              .collect())
    env.execute(timeout=60)
    assert sorted(out.result) == [("a", 0.0, 1), ("a", 1.0, 1), ("a", 2.0, 1), ("b", 1.0, 1),
                                  ("b", 5.0, 1), ("c", 2.0, 1)]


def test_datetime_timestamps_and_filter_keeps_them():
    import datetime as dt
    base = dt.datetime(2024, 1, 1)
    recs = [("a", base + dt.timedelta(seconds=s)) for s in (0, 10, 61, 62, 130)]
    env = fb.Environment()
    out = (env.from_iterable(recs, kind="pickle")
              .assign_timestamps(lambda r: r[1])
              .filter(lambda r: True)
              .key_by(lambda r: r[0])
              .window(Tumbling(60))
              .aggregate(Count())
              .collect())
    env.execute(timeout=60)
    assert sorted(out.result) == [1, 2, 2]


def test_configuration_errors():
    env = fb.Environment()
    s = env.from_iterable([("a", 1.0)]).assign_timestamps(lambda r: r[1]).key_by(lambda r: r[0])
    with pytest.raises(errors.ConfigurationError, match="size"):
        Tumbling(0)
    with pytest.raises(errors.ConfigurationError, match="slide"):
        Sliding(1, -1)
    with pytest.raises(errors.ConfigurationError, match="gap"):
        Session(float("nan"))
    with pytest.raises(TypeError, match="Tumbling"):
        s.window(1.0)
    with pytest.raises(errors.ConfigurationError, match="allowed_lateness"):
        s.window(Tumbling(1)).allowed_lateness(-1)
    with pytest.raises(errors.ConfigurationError, match="merge"):
        s.window(Session(1)).aggregate(_NoMerge())
    with pytest.raises(TypeError, match="AggregateFunction"):
        s.window(Tumbling(1)).aggregate(object())
    with pytest.raises(errors.ConfigurationError, match="result of the window"):
        s.window(Tumbling(1)).late()
    with pytest.raises(errors.ConfigurationError, match="not of the handle collect"):
        s.window(Tumbling(1)).aggregate(Count()).collect().late()
    with pytest.raises(errors.ConfigurationError, match="no timestamps"):
        env.from_iterable([("a", 1)]).key_by(lambda r: r[0]).window(Tumbling(1))


class _NoMerge(AggregateFunction):
    def create_accumulator(self):
        return 0

    def add(self, v, acc):
        return acc + 1


def test_bad_timestamp_fails_the_job_with_a_typed_error():
    env = fb.Environment()
    (env.from_iterable([("a", "noon")]).assign_timestamps(lambda r: r[1])
        .key_by(lambda r: r[0]).window(Tumbling(1)).aggregate(Count()).collect())
    with pytest.raises(errors.JobFailedError, match="timestamp"):
        env.execute(timeout=60)


# ---- the vectorized path ----

def _arrow_batches(records, per_batch):
    import pyarrow as pa
    out = []
    for i in range(0, len(records), per_batch):
        chunk = records[i:i + per_batch]
        out.append(pa.record_batch({"key": [k for k, _ in chunk], "ts": [t for _, t in chunk],
                                    "x": [float(j) for j in range(len(chunk))]}))
    return out


@pytest.mark.parametrize("kind,size,slide", [("tumbling", 1.0, None), ("sliding", 2.0, 0.5)])
@pytest.mark.parametrize("parallelism", [1, 3])
def test_arrow_windows_match_reference(kind, size, slide, parallelism):
    pa = pytest.importorskip("pyarrow")
    rnd = random.Random(11)
    records = random_stream(rnd, 600, keys=5, disorder=3)
    want, _ = reference(records, kind=kind, size=size, slide=slide, ooo=1.0)
    batches = _arrow_batches(records, 37)
    env = fb.Environment(parallelism=parallelism)
    out = (env.from_iterable(batches, kind="arrow")
              .assign_timestamps("ts", out_of_orderness=1.0, parallelism=1)
              .key_by("key")
              .window(assigner_for(kind, size, slide))
              .aggregate({"n": ("key", "count"), "lo": ("ts", "min"), "hi": ("ts", "max")},
                         parallelism=parallelism)
              .collect())
    env.execute(timeout=60)
    rows = pa.Table.from_batches(out.result).to_pylist() if out.result else []
    got = sorted((r["key"], r["window_start"], r["window_end"], r["n"], r["lo"], r["hi"]) for r in rows)
    assert got == sorted((k, s, e, len(ts), min(ts), max(ts)) for k, s, e, ts in want)


def test_arrow_windows_late_rows_counted_and_pandas():
    pa = pytest.importorskip("pyarrow")
    pd = pytest.importorskip("pandas")
    frames = [pd.DataFrame({"key": ["a", "b"], "ts": [float(i), float(i)], "x": [1.0, 2.0]}) for i in range(10)]
    frames.append(pd.DataFrame({"key": ["a"], "ts": [0.5], "x": [5.0]}))      # far behind: late
    env = fb.Environment(max_batch=1)
    out = (env.from_iterable(frames, kind="pandas")
              .assign_timestamps("ts", watermark_interval=0)
              .key_by("key")
              .window(Tumbling(5.0))
              .aggregate({"s": ("x", "sum"), "m": ("x", "mean")})
              .collect())
    env.execute(timeout=60)
    rows = sorted((r["key"], r["window_start"], r["s"], r["m"]) for r in pa.Table.from_batches(out.result).to_pylist())
    assert rows == [("a", 0.0, 5.0, 1.0), ("a", 5.0, 5.0, 1.0), ("b", 0.0, 10.0, 2.0), ("b", 5.0, 10.0, 2.0)]
    assert sum(m.get("late_records_dropped", 0) for m in env.metrics().values()) == 1


def test_arrow_spec_checked():
    pytest.importorskip("pyarrow")
    env = fb.Environment()
    s = env.from_iterable([], kind="arrow").assign_timestamps("ts").key_by("key").window(Tumbling(1))
    with pytest.raises(errors.ConfigurationError, match="median"):
        s.aggregate({"m": ("x", "median")})
    with pytest.raises(errors.ConfigurationError, match="parallelism 1"):
        s.allowed_lateness(1).aggregate({"n": ("key", "count")}, parallelism=2)
