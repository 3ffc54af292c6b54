"""More windows (issue 22): triggers, count windows, window_all and
processing-time windows, each against a plain-Python reference.

The references replay the stream one record at a time with the watermark of
an assigner (highest timestamp so far minus out_of_orderness, before each
record), as tests/test_windows.py does; the jobs run with ``max_batch=1`` and
``watermark_interval=0`` so that each window operator sees that same
sequence of records and watermarks for its keys. Processing-time windows are
driven by an ``OperatorHarness`` that sets the processing time.
"""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pipeline_helpers import FailOnceAfterCheckpoint, Times, random_stream
from pyflowbuf import errors
from pyflowbuf.testing import OperatorHarness
from pyflowbuf.windows import AggregateFunction
from pyflowbuf.windows.operator import PROCESS, WindowSpec, window_operator_class


# ---- the references ----

def ref_windows(kind, size, slide, t):
    """The windows of time t, from their definitions."""
    if kind == "tumbling":
        start = math.floor(t / size) * size
        return [(start, start + size)]
    out = []
    k = math.floor(t / slide)
    while k * slide > t - size:
        out.append((k * slide, k * slide + size))
        k -= 1
    return out


def next_multiple(t, interval):
    f = (math.floor(t / interval) + 1) * interval
    return f if f > t else f + interval


def ref_triggered(records, *, kind, size, slide=None, ooo=0.0, lateness=0.0, trigger="event"):
    """Firings of event-time windows under ``trigger`` as (key, start, end,
    sorted times, firing), and the late records.

    trigger: "event" | ("continuous", interval) | ("count", n), each
    optionally wrapped as ("purging", inner)."""
    purge = isinstance(trigger, tuple) and trigger[0] == "purging"
    inner = trigger[1] if purge else trigger
    at_end = inner == "event" or inner[0] == "continuous"
    interval = inner[1] if isinstance(inner, tuple) and inner[0] == "continuous" else None
    every = inner[1] if isinstance(inner, tuple) and inner[0] == "count" else None
    results, late = [], []
    wins = {}           # (k, s, e) -> {"items": list | None (purged), "count", "early", "end_due"}
    high = wm = -math.inf

    def fire(wk, firing):
        items = wins[wk]["items"]
        if items:
            results.append((wk[0], wk[1], wk[2], sorted(items), firing))
            if purge:
                wins[wk]["items"] = None

    def advance(new):
        nonlocal wm
        if new <= wm:
            return
        wm = new
        for wk in list(wins):
            w = wins[wk]
            while w["early"] is not None and w["early"] <= wm:
                f = w["early"]
                fire(wk, "early")
                nxt = next_multiple(f, interval)
                w["early"] = nxt if nxt < wk[2] else None
            if w["end_due"] and wk[2] <= wm:
                w["end_due"] = False
                fire(wk, "on_time")
            if wk[2] + lateness <= wm:
                del wins[wk]

    for k, t in records:
        advance(high - ooo)
        high = max(high, t)
        placed = False
        for s, e in ref_windows(kind, size, slide, t):
            if e + lateness <= wm:
                continue
            placed = True
            wk = (k, s, e)
            w = wins.get(wk)
            if w is None:
                early = None
                if interval is not None and e > wm:
                    f = next_multiple(t, interval)
                    early = f if f < e else None
                w = wins[wk] = {"items": [], "count": 0, "early": early, "end_due": at_end and e > wm}
            if w["items"] is None:
                w["items"] = []
            w["items"].append(t)
            if every is not None:
                w["count"] += 1
                if w["count"] >= every:
                    w["count"] = 0
                    fire(wk, "late" if e <= wm else "early")
            elif at_end and e <= wm:
                fire(wk, "late")
        if not placed:
            late.append((k, t))
    advance(math.inf)
    return results, late


def ref_triggered_sessions(records, *, gap, ooo=0.0, lateness=0.0, trigger="event"):
    """``ref_triggered`` for Session(gap) windows: sessions merge, summing
    their counts and keeping the earliest pending early firing."""
    purge = isinstance(trigger, tuple) and trigger[0] == "purging"
    inner = trigger[1] if purge else trigger
    at_end = inner == "event" or inner[0] == "continuous"
    interval = inner[1] if isinstance(inner, tuple) and inner[0] == "continuous" else None
    every = inner[1] if isinstance(inner, tuple) and inner[0] == "count" else None
    results, late = [], []
    sessions: dict = {}     # k -> [{"lo", "hi", "items" (None: purged), "count", "early", "end_due"}]
    high = wm = -math.inf

    def fire(k, s, firing):
        if s["items"]:
            results.append((k, s["lo"], s["hi"], sorted(s["items"]), firing))
            if purge:
                s["items"] = None

    def advance(new):
        nonlocal wm
        if new <= wm:
            return
        wm = new
        for k, ss in sessions.items():
            for s in list(ss):
                while s["early"] is not None and s["early"] <= wm:
                    f = s["early"]
                    fire(k, s, "early")
                    nxt = next_multiple(f, interval)
                    s["early"] = nxt if nxt < s["hi"] else None
                if s["end_due"] and s["hi"] <= wm:
                    s["end_due"] = False
                    fire(k, s, "on_time")
                if s["hi"] + lateness <= wm:
                    ss.remove(s)

    for k, t in records:
        advance(high - ooo)
        high = max(high, t)
        ss = sessions.setdefault(k, [])
        hits = [s for s in ss if s["lo"] <= t + gap and t <= s["hi"]]
        lo = min([t] + [s["lo"] for s in hits])
        hi = max([t + gap] + [s["hi"] for s in hits])
        if hi + lateness <= wm:
            late.append((k, t))
            continue
        for s in hits:
            ss.remove(s)
        earlies = [s["early"] for s in hits if s["early"] is not None]
        early = min(earlies) if earlies else None
        if hi > wm:
            if interval is not None and early is None:
                f = next_multiple(t, interval)
                early = f if f < hi else None
        else:
            early = None
        new = {"lo": lo, "hi": hi, "items": [x for s in hits if s["items"] for x in s["items"]] + [t],
               "count": sum(s["count"] for s in hits), "early": early, "end_due": at_end and hi > wm}
        ss.append(new)
        if every is not None:
            new["count"] += 1
            if new["count"] >= every:
                new["count"] = 0
                fire(k, new, "late" if hi <= wm else "early")
        elif at_end and hi <= wm:
            fire(k, new, "late")
    advance(math.inf)
    return results, late


def ref_count_windows(records, size, slide=None, partial=False):
    """(key, start, end, values, firing) of CountWindow(size, slide) in record order."""
    seen: dict = {}
    out = []
    for k, v in records:
        vals = seen.setdefault(k, [])
        vals.append(v)
        n = len(vals)
        if slide is None and n % size == 0:
            out.append((k, n - size, n, vals[n - size:], "on_time"))
        elif slide is not None and n % slide == 0:
            lo = max(0, n - size)
            out.append((k, lo, n, vals[lo:], "on_time"))
    if partial:
        for k, vals in seen.items():
            n = len(vals)
            if slide is None and n % size:
                out.append((k, n - n % size, n, vals[n - n % size:], "partial"))
            elif slide is not None and n % slide:
                lo = max(0, n - size)
                out.append((k, lo, n, vals[lo:], "partial"))
    return out


def make_trigger(spec):
    if spec == "event":
        return fb.EventTimeTrigger()
    if spec[0] == "purging":
        return fb.PurgingTrigger(make_trigger(spec[1]))
    if spec[0] == "continuous":
        return fb.ContinuousEventTimeTrigger(spec[1])
    return fb.CountTrigger(spec[1])


def reference_for(records, *, kind, size, slide=None, ooo=0.0, lateness=0.0, trigger="event"):
    if kind == "session":
        return ref_triggered_sessions(records, gap=size, ooo=ooo, lateness=lateness, trigger=trigger)
    return ref_triggered(records, kind=kind, size=size, slide=slide, ooo=ooo, lateness=lateness, trigger=trigger)


def run_triggered(records, *, kind, size, slide, ooo, lateness, trigger, parallelism=1, workers=None,
                  how="process", all_=False):
    env = fb.Environment(parallelism=parallelism, workers=workers, max_batch=1)
    timed = env.from_iterable(records).assign_timestamps(lambda r: r[1], out_of_orderness=ooo,
                                                         watermark_interval=0, parallelism=1)
    assigner = {"tumbling": lambda: fb.Tumbling(size), "sliding": lambda: fb.Sliding(size, slide),
                "session": lambda: fb.Session(size)}[kind]()
    if all_:
        w = timed.window_all(assigner, trigger=make_trigger(trigger)).allowed_lateness(lateness)
        res = w.process(lambda win, recs, ctx: [("all", win.start, win.end, sorted(r[1] for r in recs),
                                                 ctx.firing)])
    else:
        w = timed.key_by(lambda r: r[0]).window(assigner, trigger=make_trigger(trigger)).allowed_lateness(lateness)
        if how == "process":
            res = w.process(lambda k, win, recs, ctx: [(k, win.start, win.end, sorted(r[1] for r in recs),
                                                        ctx.firing)])
        else:
            res = w.aggregate(Times(), window_function=lambda k, win, ts, ctx: (k, win.start, win.end, ts,
                                                                                ctx.firing))
    late = res.late()
    out, late_out = res.collect(), late.collect()
    env.execute(timeout=120)
    return out.result, late_out.result, env


def norm(rows):
    return sorted((k, float(s), float(e), list(ts), f) for k, s, e, ts, f in rows)


TRIGGERS = ["event", ("continuous", 0.5), ("continuous", 0.75), ("count", 3), ("purging", ("continuous", 0.5)),
            ("purging", ("count", 2)), ("purging", "event")]


# ---- triggers, against the reference ----

@pytest.mark.parametrize("trigger", TRIGGERS, ids=repr)
@pytest.mark.parametrize("kind,size,slide", [("tumbling", 2.0, None), ("sliding", 2.0, 0.75),
                                             ("session", 0.6, None)])
def test_triggers_match_reference_with_lateness(trigger, kind, size, slide):
    rnd = random.Random(repr((trigger, kind)))
    records = random_stream(rnd, 120, disorder=6, very_late=0.08)
    want, want_late = reference_for(records, kind=kind, size=size, slide=slide, ooo=0.5, lateness=0.75,
                                    trigger=trigger)
    got, got_late, _ = run_triggered(records, kind=kind, size=size, slide=slide, ooo=0.5, lateness=0.75,
                                     trigger=trigger, parallelism=2)
    assert norm(got) == norm(want)
    assert sorted(got_late) == sorted(want_late) and want_late
    kinds = {r[4] for r in want}
    if "continuous" in repr(trigger) or "count" in repr(trigger):
        assert "early" in kinds
    if trigger in ("event", ("purging", "event")):
        assert "on_time" in kinds


@settings(max_examples=10)
@given(st.integers(0, 2**32 - 1), st.sampled_from(TRIGGERS), st.sampled_from(["tumbling", "sliding", "session"]),
       st.integers(1, 3), st.sampled_from([0.0, 0.5, 1.5]), st.sampled_from(["process", "aggregate"]))
def test_random_triggered_windows_match_reference(seed, trigger, kind, parallelism, lateness, how):
    rnd = random.Random(seed)
    size, slide = {"tumbling": (1.0, None), "sliding": (1.5, 0.5), "session": (0.5, None)}[kind]
    records = random_stream(rnd, rnd.randint(0, 150), keys=rnd.randint(1, 4), disorder=rnd.randint(0, 6),
                            very_late=rnd.choice([0.0, 0.1]))
    ooo = rnd.choice([0.0, 0.25, 0.5])
    want, want_late = reference_for(records, kind=kind, size=size, slide=slide, ooo=ooo, lateness=lateness,
                                    trigger=trigger)
    got, got_late, _ = run_triggered(records, kind=kind, size=size, slide=slide, ooo=ooo, lateness=lateness,
                                     trigger=trigger, parallelism=parallelism, how=how)
    assert norm(got) == norm(want)
    assert sorted(got_late) == sorted(want_late)


def test_default_trigger_reports_on_time_and_late_firings():
    records = [("a", 0.5), ("a", 1.5), ("a", 3.0), ("a", 0.8), ("a", 9.0), ("a", 0.1)]
    want, want_late = ref_triggered(records, kind="tumbling", size=2.0, lateness=2.0)
    got, got_late, _ = run_triggered(records, kind="tumbling", size=2.0, slide=None, ooo=0.0, lateness=2.0,
                                     trigger="event")
    assert norm(got) == norm(want) == [("a", 0.0, 2.0, [0.5, 0.8, 1.5], "late"),
                                       ("a", 0.0, 2.0, [0.5, 1.5], "on_time"),
                                       ("a", 2.0, 4.0, [3.0], "on_time"), ("a", 8.0, 10.0, [9.0], "on_time")]
    assert got_late == want_late == [("a", 0.1)]


def test_workers_triggers_and_count_windows_cross_processes():
    """workers=2: the windows' subtasks in two processes, records as struct over TCP."""
    rnd = random.Random(7)
    records = random_stream(rnd, 120, disorder=4, very_late=0.06)
    trigger = ("purging", ("continuous", 0.5))
    want, want_late = ref_triggered(records, kind="tumbling", size=2.0, ooo=0.25, lateness=0.5, trigger=trigger)
    got, got_late, _ = run_triggered(records, kind="tumbling", size=2.0, slide=None, ooo=0.25, lateness=0.5,
                                     trigger=trigger, parallelism=2, workers=2)
    assert norm(got) == norm(want)
    assert sorted(map(tuple, got_late)) == sorted(want_late)
    values = [(k, float(i)) for i, (k, _) in enumerate(records)]
    env = fb.Environment(parallelism=2, workers=2)
    out = (env.from_iterable(values).key_by(lambda r: r[0]).window(fb.CountWindow(4, slide=3, emit_partial=True))
              .process(lambda k, w, recs, ctx: [(k, w.start, w.end, [r[1] for r in recs], ctx.firing)])
              .collect())
    env.execute(timeout=120)
    assert sorted(map(tuple, out.result)) == sorted(ref_count_windows(values, 4, 3, partial=True))


# ---- count windows ----

@settings(max_examples=10)
@given(st.integers(0, 2**32 - 1), st.integers(1, 5), st.one_of(st.none(), st.integers(1, 6)), st.booleans(),
       st.integers(1, 3), st.sampled_from(["process", "aggregate", "reduce"]))
def test_count_windows_match_reference(seed, size, slide, partial, parallelism, how):
    rnd = random.Random(seed)
    records = [(f"k{rnd.randrange(4)}", float(i)) for i in range(rnd.randint(0, 120))]
    want = ref_count_windows(records, size, slide, partial)
    env = fb.Environment(parallelism=parallelism, max_batch=rnd.choice([1, 7, 512]))
    w = env.from_iterable(records).key_by(lambda r: r[0]).window(fb.CountWindow(size, slide, emit_partial=partial))
    if how == "process":
        res = w.process(lambda k, win, recs, ctx: [(k, win.start, win.end, [r[1] for r in recs], ctx.firing)])
    elif how == "aggregate":
        res = w.aggregate(Times(), window_function=lambda k, win, ts, ctx: (k, win.start, win.end, ts, ctx.firing))
    else:
        res = w.reduce(lambda a, b: (a[0], a[1] + b[1]),
                       window_function=lambda k, win, r, ctx: (k, win.start, win.end, r[1], ctx.firing))
        want = [(k, s, e, sum(vs), f) for k, s, e, vs, f in want]
    out = res.collect()
    env.execute(timeout=60)
    assert sorted(out.result) == sorted(want)


def test_count_window_needs_no_timestamps_and_refuses_triggers_and_lateness():
    env = fb.Environment()
    s = env.from_iterable([("a", 1)])
    s.key_by(lambda r: r[0]).window(fb.CountWindow(2))        # no assign_timestamps: fine
    with pytest.raises(errors.ConfigurationError, match="count windows"):
        s.key_by(lambda r: r[0]).window(fb.CountWindow(2), trigger=fb.CountTrigger(1))
    with pytest.raises(errors.ConfigurationError, match="allowed_lateness"):
        s.key_by(lambda r: r[0]).window(fb.CountWindow(2)).allowed_lateness(1)
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(errors.ConfigurationError, match="CountWindow size"):
            fb.CountWindow(bad)
    with pytest.raises(errors.ConfigurationError, match="CountWindow slide"):
        fb.CountWindow(3, 0)


# ---- window_all ----

def test_window_all_with_early_firings_matches_reference():
    rnd = random.Random(11)
    records = random_stream(rnd, 150, disorder=5, very_late=0.05)
    trigger = ("continuous", 0.5)
    one_key = [("all", t) for _, t in records]
    want, want_late = ref_triggered(one_key, kind="sliding", size=2.0, slide=1.0, ooo=0.25, lateness=0.5,
                                    trigger=trigger)
    got, got_late, _ = run_triggered(records, kind="sliding", size=2.0, slide=1.0, ooo=0.25, lateness=0.5,
                                     trigger=trigger, parallelism=3, all_=True)
    assert norm(got) == norm(want)
    assert sorted(t for _, t in got_late) == sorted(t for _, t in want_late)


@settings(max_examples=6)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3))
def test_window_all_from_parallel_upstream_bounded_disorder(seed, parallelism):
    """Records reach the one subtask from several upstream subtasks in any
    interleaving; within out_of_orderness no record is late, so the windows
    are the reference's whatever the order."""
    rnd = random.Random(seed)
    records = random_stream(rnd, rnd.randint(0, 300), disorder=3)
    want, late = ref_triggered([("all", t) for _, t in records], kind="tumbling", size=1.0, ooo=1.0)
    assert not late
    env = fb.Environment(parallelism=parallelism)
    res = (env.from_iterable(records).rebalance()
              .assign_timestamps(lambda r: r[1], out_of_orderness=1.0)      # parallelism subtasks, then into one
              .window_all(fb.Tumbling(1.0))
              .aggregate(Times(), window_function=lambda w, ts: ("all", w.start, w.end, ts, "on_time")))
    assert res.node.parallelism == 1
    out = res.collect()
    env.execute(timeout=60)
    assert norm(out.result) == norm(want)


def test_window_all_refuses_parallelism_and_takes_count_windows():
    env = fb.Environment(parallelism=3)
    s = env.from_iterable(list(range(10))).assign_timestamps(lambda x: float(x))
    with pytest.raises(errors.ConfigurationError, match="one subtask"):
        s.window_all(fb.Tumbling(2)).aggregate(fb.Count(), parallelism=2)
    out = env.from_iterable(list(range(10))).window_all(fb.CountWindow(4)).reduce(
        lambda a, b: a + b, window_function=lambda w, total: (w.start, w.end, total)).collect()
    env.execute(timeout=60)
    assert out.result == [(0, 4, 6), (4, 8, 22)]
    assert "one subtask" in fb.Stream.window_all.__doc__


def test_trigger_errors():
    env = fb.Environment()
    timed = env.from_iterable([("a", 1.0)]).assign_timestamps(lambda r: r[1]).key_by(lambda r: r[0])
    with pytest.raises(TypeError, match="trigger="):
        timed.window(fb.Tumbling(1), trigger="count")
    with pytest.raises(errors.ConfigurationError, match="merge"):
        timed.window(fb.SessionProcessingTime(1), trigger=fb.CountTrigger(2))
    with pytest.raises(errors.ConfigurationError, match="processing time"):
        timed.window(fb.TumblingProcessingTime(1), trigger=fb.ContinuousEventTimeTrigger(1))
    with pytest.raises(errors.ConfigurationError, match="event time"):
        timed.window(fb.Tumbling(1), trigger=fb.ProcessingTimeTrigger())
    with pytest.raises(errors.ConfigurationError, match="interval"):
        fb.ContinuousEventTimeTrigger(0)
    with pytest.raises(errors.ConfigurationError, match="CountTrigger"):
        fb.CountTrigger(0)
    with pytest.raises(TypeError, match="PurgingTrigger"):
        fb.PurgingTrigger(fb.PurgingTrigger(fb.CountTrigger(1)))
    with pytest.raises(errors.ConfigurationError, match="vectorized"):
        timed.window(fb.Tumbling(1), trigger=fb.CountTrigger(2)).aggregate({"n": ("a", "count")})
    # the default trigger, spelled out, is the default path
    assert timed.window(fb.Session(1), trigger=fb.EventTimeTrigger())._trigger is None


# ---- processing time, driven by the harness ----

def ref_processing(steps, *, kind, size, slide=None, every=None, purge=False):
    """Firings of processing-time windows: ``steps`` are ("at", time) (the
    wall clock moves to ``time``, windows ending by then fire) and ("rec",
    key, value) (a record arriving now). Returns (key, start, end, values,
    firing) per firing, in order; at the end every open window fires."""
    now = None
    wins: dict = {}      # non-merging: (k, s, e) -> [values, count]; sessions: k -> [[s, e, values]]
    out = []

    def due(limit):
        if kind == "session":
            ready = sorted((s[1], k, s[0]) for k, ss in wins.items() for s in ss if s[1] <= limit)
            for e, k, s in ready:
                sess = next(x for x in wins[k] if x[0] == s and x[1] == e)
                wins[k].remove(sess)
                out.append((k, s, e, sess[2], "on_time"))
            return
        for wk in sorted((w for w in wins if w[2] <= limit), key=lambda w: w[2]):
            vals, _ = wins.pop(wk)
            if every is None and vals:
                out.append((wk[0], wk[1], wk[2], vals, "on_time"))

    for step in steps:
        if step[0] == "at":
            now = step[1]
            due(now)
            continue
        _, k, v = step
        if kind == "session":
            ss = wins.setdefault(k, [])
            lo, hi = now, now + size
            hits = [s for s in ss if s[0] <= hi and lo <= s[1]]
            vals = [x for s in sorted(hits) for x in s[2]] + [v]
            for s in hits:
                ss.remove(s)
            ss.append([min([lo] + [s[0] for s in hits]), max([hi] + [s[1] for s in hits]), vals])
            continue
        for s, e in ref_windows(kind, size, slide, now):
            w = wins.setdefault((k, s, e), [[], 0])
            w[0].append(v)
            if every is not None:
                w[1] += 1
                if w[1] >= every:
                    w[1] = 0
                    out.append((k, s, e, list(w[0]), "early"))
                    if purge:
                        w[0] = []
    due(math.inf)
    return out


def processing_stream(kind, size, slide, trigger):
    env = fb.Environment()
    assigner = {"tumbling": lambda: fb.TumblingProcessingTime(size),
                "sliding": lambda: fb.SlidingProcessingTime(size, slide),
                "session": lambda: fb.SessionProcessingTime(size)}[kind]()
    w = env.from_iterable([("a", 0)]).key_by(lambda r: r[0]).window(assigner, trigger=trigger)
    return w.process(lambda k, win, recs, ctx: [(k, win.start, win.end, [r[1] for r in recs], ctx.firing)])


@st.composite
def processing_steps(draw):
    steps = [("at", 100.0)]
    t = 100.0
    for i in range(draw(st.integers(0, 60))):
        if draw(st.booleans()):
            t += draw(st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.5]))
            steps.append(("at", t))
        else:
            steps.append(("rec", draw(st.sampled_from(["a", "b", "c"])), i))
    return steps


def drive(harness_factory, steps, restore_at=None):
    """Feed ``steps`` to harnesses (one record a batch); at step ``restore_at``
    the state goes through a snapshot into a new harness, as after a failure."""
    h = harness_factory(None)
    out = []
    for i, step in enumerate(steps):
        if i == restore_at:
            state, now = h.snapshot(), h.processing_time
            h = harness_factory(state)
            h.advance_processing_time(now)
        if step[0] == "at":
            out += h.advance_processing_time(step[1])
        else:
            out += h.process([(step[1], step[2])])
    return out + h.finish()


@settings(max_examples=25)
@given(processing_steps(), st.sampled_from([("tumbling", 1.0, None), ("sliding", 2.0, 0.5), ("session", 0.75, None)]),
       st.sampled_from([None, ("count", 2), ("purging", ("count", 2))]), st.data())
def test_processing_time_windows_match_reference(steps, shape, trigger, data):
    kind, size, slide = shape
    if kind == "session" and trigger is not None:
        return          # triggers are refused on merging windows (test_trigger_errors)
    every = trigger and (trigger[1][1] if trigger[0] == "purging" else trigger[1])
    want = ref_processing(steps, kind=kind, size=size, slide=slide, every=every,
                          purge=bool(trigger) and trigger[0] == "purging")
    stream = processing_stream(kind, size, slide, make_trigger(trigger) if trigger else None)
    restore_at = data.draw(st.one_of(st.none(), st.integers(1, max(1, len(steps) - 1))))
    got = drive(lambda state: OperatorHarness(stream, restore=state), steps, restore_at)
    assert sorted(got) == sorted(want)


def test_processing_time_harness_step_by_step():
    stream = processing_stream("tumbling", 10.0, None, None)
    h = OperatorHarness(stream)
    with pytest.raises(errors.ConfigurationError, match="advance_processing_time"):
        h.process([("a", 1)])
    h.advance_processing_time(1_000.0)
    assert h.process([("a", 1), ("b", 2)]) == []
    assert h.timers["processing"] == [(1010.0, [("a", 1000.0, 1010.0), ("b", 1000.0, 1010.0)])]
    h.advance_processing_time(1_005.0)
    h.process([("a", 3)])
    assert h.advance_processing_time(1_009.9) == []
    assert sorted(h.advance_processing_time(1_010.0)) == [("a", 1000.0, 1010.0, [1, 3], "on_time"),
                                                          ("b", 1000.0, 1010.0, [2], "on_time")]
    h.process([("a", 4)])
    assert h.finish() == [("a", 1010.0, 1020.0, [4], "on_time")]     # open windows fire at the end


def test_processing_time_windows_in_a_job_count_every_record_once():
    """End to end on the wall clock: the windows depend on timing, but
    every record lands in exactly one tumbling window and every window fires."""
    n = 600
    env = fb.Environment(parallelism=2)
    out = (env.from_iterable([(i % 3, i) for i in range(n)], rate_limit=3_000)
              .key_by(lambda r: r[0])
              .window(fb.TumblingProcessingTime(0.05))
              .aggregate(fb.Count(), window_function=lambda k, w, c, ctx: (k, w.start, w.end, c, ctx.firing))
              .collect())
    env.execute(timeout=60)
    rows = out.result
    assert sum(r[3] for r in rows) == n
    assert {r[4] for r in rows} == {"on_time"}
    for k in range(3):
        starts = [r[1] for r in rows if r[0] == k]
        assert starts and len(starts) == len(set(starts))       # one firing per window
    assert all(abs(e - s - 0.05) < 1e-6 for _, s, e, _, _ in rows)


def test_processing_time_needs_no_timestamps_and_refuses_lateness():
    env = fb.Environment()
    keyed = env.from_iterable([("a", 1)]).key_by(lambda r: r[0])
    keyed.window(fb.SlidingProcessingTime(2, 1))
    with pytest.raises(errors.ConfigurationError, match="allowed_lateness"):
        keyed.window(fb.TumblingProcessingTime(1)).allowed_lateness(1)
    with pytest.raises(errors.ConfigurationError, match="merge"):
        keyed.window(fb.SessionProcessingTime(1)).aggregate(_NoMerge())


class _NoMerge(AggregateFunction):
    def create_accumulator(self):
        return 0

    def add(self, v, acc):
        return acc + 1


# ---- restores in the middle of open windows ----



def restore_stream(seed, n):
    rnd = random.Random(seed)
    return [(f"k{rnd.randrange(5)}", round(i * 0.01 - rnd.randint(0, 5) * 0.01, 2)) for i in range(n)]


def restore_job(env, records, what, fail=None):
    s = env.from_iterable(records, rate_limit=5_000)
    if fail is not None:
        s = s.map(fail, parallelism=1)          # chained to the source: the record order stays fixed
    if what == "count_window":
        w = s.key_by(lambda r: r[0]).window(fb.CountWindow(7, slide=3, emit_partial=True))
    else:
        trigger = {"continuous": fb.PurgingTrigger(fb.ContinuousEventTimeTrigger(0.1)),
                   "count": fb.CountTrigger(4)}[what]
        timed = s.assign_timestamps(lambda r: r[1], out_of_orderness=0.03, watermark_interval=0, parallelism=1)
        w = timed.key_by(lambda r: r[0]).window(fb.Sliding(0.5, 0.25), trigger=trigger).allowed_lateness(0.05)
    res = w.process(lambda k, win, recs, ctx: [(k, win.start, win.end, sorted(r[1] for r in recs), ctx.firing)])
    return res.collect(parallelism=1)


@pytest.mark.parametrize("what", ["continuous", "count", "count_window"])
def test_restore_in_the_middle_of_open_windows(tmp_path, what):
    records = restore_stream(3, 2500)
    env = fb.Environment(parallelism=2, max_batch=1)
    want = restore_job(env, records, what)
    env.execute(timeout=120)
    fail = FailOnceAfterCheckpoint(1000)
    env = fb.Environment(parallelism=2, max_batch=1, checkpoint_interval=0.02, checkpoint_dir=tmp_path / what,
                         restart_attempts=2)
    fail.env = env
    got = restore_job(env, records, what, fail)
    env.execute(timeout=120)
    assert fail.fired and env.last_execution.restored_from is not None
    assert sorted(got.result) == sorted(want.result)
    if what == "continuous":
        assert {r[4] for r in want.result} >= {"early", "on_time"}


@settings(max_examples=25)
@given(st.integers(0, 2**32 - 1), st.sampled_from(TRIGGERS), st.sampled_from(["tumbling", "sliding", "session"]),
       st.sampled_from([0.0, 0.5]), st.data())
def test_triggered_windows_restored_at_any_record_match_reference(seed, trigger, kind, lateness, data):
    """The operator alone: records one at a time with the assigner's watermark
    before each, its state through a snapshot into a new operator at a random
    record (open windows, purged windows, counts and early timers in it)."""
    rnd = random.Random(seed)
    size, slide = {"tumbling": (1.0, None), "sliding": (1.5, 0.5), "session": (0.5, None)}[kind]
    records = random_stream(rnd, rnd.randint(1, 80), keys=2, disorder=rnd.randint(0, 5), very_late=0.1)
    want, want_late = reference_for(records, kind=kind, size=size, slide=slide, ooo=0.25, lateness=lateness,
                                    trigger=trigger)
    assigner = {"tumbling": lambda: fb.Tumbling(size), "sliding": lambda: fb.Sliding(size, slide),
                "session": lambda: fb.Session(size)}[kind]()
    spec = WindowSpec(assigner, lambda r: r[0], lambda r: r[1], lateness, make_trigger(trigger))

    def make():
        return window_operator_class(spec)(
            "w", spec, PROCESS, lambda k, win, recs, ctx: [(k, win.start, win.end, sorted(r[1] for r in recs),
                                                            ctx.firing)], with_ctx=True)
    late_tag = fb.OutputTag("late")         # the late records' side output, as late() reads it
    restore_at = data.draw(st.integers(0, len(records)))
    h = OperatorHarness(make(), side_outputs=[late_tag])
    got, late, high = [], [], -math.inf
    for i, r in enumerate(records):
        if i == restore_at:
            late += h.side_output(late_tag)
            h = OperatorHarness(make(), restore=h.snapshot(), side_outputs=[late_tag])
        if high > -math.inf:
            got += h.process_watermark(high - 0.25)
        high = max(high, r[1])
        got += h.process([r])
    got += h.finish()
    late += h.side_output(late_tag)
    assert norm(got) == norm(want)
    assert sorted(late) == sorted(want_late)


def test_processing_time_windows_restored_count_every_record_once(tmp_path):
    """Processing-time windows and their timers in checkpoints: across a
    failure and a restore every record is counted in exactly one window."""
    n = 1500
    fail = FailOnceAfterCheckpoint(700)
    env = fb.Environment(parallelism=2, checkpoint_interval=0.02, checkpoint_dir=tmp_path / "pt",
                         restart_attempts=2)
    fail.env = env
    out = (env.from_iterable([(i % 4, i) for i in range(n)], rate_limit=3_000)
              .map(fail, parallelism=1)
              .key_by(lambda r: r[0])
              .window(fb.TumblingProcessingTime(0.05))
              .process(lambda k, w, recs: [(k, w.start, sorted(r[1] for r in recs))])
              .collect(parallelism=1))
    env.execute(timeout=120)
    assert fail.fired and env.last_execution.restored_from is not None
    values = sorted(v for _, _, vs in out.result for v in vs)
    assert values == list(range(n))
    assert all(v % 4 == k for k, _, vs in out.result for v in vs)


class FailInWorker:
    """Raises once, at a record from ``at`` on, once a checkpoint in ``chk`` is
    complete; a marker file (the workers are separate processes) keeps it from
    firing again after the restart."""

    def __init__(self, marker, at, chk):
        self.marker, self.at, self.chk = str(marker), at, str(chk)
        self.calls = 0

    def __call__(self, x):
        import glob
        import os
        self.calls += 1
        if self.calls >= self.at and self.calls % 25 == 0 and glob.glob(os.path.join(self.chk, "chk-*", "_metadata")):
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return x
            raise RuntimeError(f"injected failure at record {self.calls}")
        return x


def test_workers_restore_in_the_middle_of_open_windows(tmp_path):
    """workers=2 and a failure: trigger state, emptied windows and early
    timers come back from the checkpoint in both processes."""
    records = restore_stream(5, 2500)
    env = fb.Environment(parallelism=2, max_batch=1, workers=2)
    want = restore_job(env, records, "continuous")
    env.execute(timeout=120)
    fail = FailInWorker(tmp_path / "fired", 1000, tmp_path / "chk")
    env = fb.Environment(parallelism=2, max_batch=1, workers=2, checkpoint_interval=0.05,
                         checkpoint_dir=tmp_path / "chk", restart_attempts=2)
    got = restore_job(env, records, "continuous", fail)
    env.execute(timeout=120)
    assert (tmp_path / "fired").exists() and env.last_execution.restored_from is not None
    assert sorted(map(tuple, got.result)) == sorted(map(tuple, want.result))


def test_records_a_count_never_fired_are_counted_when_dropped():
    """CountTrigger and CountWindow drop what never completed a count (as
    Flink does); ``unfired_records_dropped`` counts those records."""
    env = fb.Environment()
    timed = env.from_iterable([("a", 1.0)]).assign_timestamps(lambda r: r[1]).key_by(lambda r: r[0])
    fn = lambda k, w, recs: [(k, w.start, len(recs))]      # noqa: E731
    h = OperatorHarness(timed.window(fb.Tumbling(10), trigger=fb.CountTrigger(3)).process(fn))
    h.process([("a", t) for t in (1.0, 2.0, 3.0, 4.0, 5.0)] + [("b", 12.0)])
    assert h.take() == [("a", 0.0, 3)]
    assert h.finish() == [] and h.metrics["unfired_records_dropped"] == 3          # a: 2, b: 1

    sessions = OperatorHarness(timed.window(fb.Session(1), trigger=fb.CountTrigger(2)).process(fn))
    sessions.process([("a", 1.0), ("a", 1.5), ("a", 2.0), ("a", 9.0)])
    assert sessions.take() == [("a", 1.0, 2)]
    state = sessions.snapshot()
    again = OperatorHarness(timed.window(fb.Session(1), trigger=fb.CountTrigger(2)).process(fn), restore=state)
    assert again.finish() == []
    assert again.metrics["unfired_records_dropped"] == 2                             # 2.0 and 9.0

    counts = OperatorHarness(timed.window(fb.CountWindow(3)).process(fn))
    counts.process([("a", 0.0)] * 7 + [("b", 0.0)] * 2)
    counts.finish()
    assert counts.metrics["unfired_records_dropped"] == 3
    sliding = OperatorHarness(timed.window(fb.CountWindow(4, slide=3)).process(fn))
    sliding.process([("a", 0.0)] * 8)
    sliding.finish()
    assert sliding.metrics["unfired_records_dropped"] == 2

    proc = OperatorHarness(env.from_iterable([("a", 1)]).key_by(lambda r: r[0])
                           .window(fb.TumblingProcessingTime(10), trigger=fb.CountTrigger(2)).process(fn))
    proc.advance_processing_time(100.0)
    assert proc.process([("a", 1), ("a", 2), ("a", 3)]) == [("a", 100.0, 2)]
    assert proc.advance_processing_time(110.0) == []
    assert proc.metrics["unfired_records_dropped"] == 1
