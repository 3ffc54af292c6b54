"""Timers: the timer queue (deduplicated, in order, snapshots), keyed
process with a context (event-time and processing-time timers, the end-of-
input hook, the class form), and timers on two connected keyed inputs."""
from __future__ import annotations

import math
import random
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf.time.process import KeyedProcessFunction, KeyedProcessOperator, takes_context
from pyflowbuf.time.timers import ProcessingTimeService, TimerQueue


# ---- the queue, against a model ----

@given(st.lists(st.tuples(st.sampled_from(["reg", "reg", "del", "pop"]), st.integers(0, 4),
                          st.integers(0, 20).map(float)), max_size=80))
def test_timer_queue_matches_model(steps):
    q = TimerQueue()
    model = []       # (t, registration order, key), no duplicates of (key, t)
    order = 0
    for op, key, t in steps:
        if op == "reg":
            fresh = not any(k == key and tt == t for tt, _, k in model)
            assert q.register(key, t) == fresh
            if fresh:
                model.append((t, order, key))
                order += 1
        elif op == "del":
            q.delete(key, t)
            model = [m for m in model if not (m[2] == key and m[0] == t)]
        else:
            got = q.pop_due(t)
            due = sorted(m for m in model if m[0] <= t)
            if due:
                assert got == (due[0][2], due[0][0])
                model.remove(due[0])
            else:
                assert got is None
        assert len(q) == len(model)
        assert q.peek_time() == (min(m[0] for m in model) if model else None)
    restored = TimerQueue.restored(q.snapshot())
    assert restored.snapshot() == q.snapshot()
    drained = []
    while (x := restored.pop_due(math.inf)) is not None:
        drained.append(x)
    assert drained == [(k, t) for t, _, k in sorted(model)]


def test_processing_time_service_runs_callbacks_in_deadline_order():
    svc = ProcessingTimeService()
    svc.start()
    got = []
    done = threading.Event()
    now = time.time()
    svc.schedule(now + 0.06, lambda: (got.append(2), done.set()))
    h = svc.schedule(now + 0.03, lambda: got.append("cancelled"))
    svc.schedule(now + 0.02, lambda: got.append(1))
    svc.cancel(h)
    assert done.wait(5)
    assert got == [1, 2]


def test_takes_context():
    assert takes_context(lambda k, x, st, ctx: 0, 3)
    assert not takes_context(lambda k, x, st: 0, 3)
    assert takes_context(lambda *a: 0, 3)
    assert not takes_context(len, 3)


# ---- keyed process with timers, in jobs ----

def hand_window(records, size, *, parallelism=2, ooo=0.0):
    """A tumbling count written with process + event-time timers."""
    env = fb.Environment(parallelism=parallelism)

    def element(k, x, st, ctx):
        start = math.floor(ctx.timestamp / size) * size
        st[start] = st.get(start, 0) + 1
        ctx.register_event_time_timer(start + size)

    def on_timer(k, t, st, ctx):
        assert ctx.time_domain == "event_time" and ctx.key == k and ctx.timestamp == t
        assert ctx.watermark >= t
        return [(k, t - size, st.pop(t - size))]

    out = (env.from_iterable(records)
              .assign_timestamps(lambda r: r[1], out_of_orderness=ooo)
              .key_by(lambda r: r[0])
              .process(element, on_timer=on_timer)
              .collect())
    env.execute(timeout=60)
    return out.result


def test_event_time_timers_give_every_window_of_every_key():
    """The issue's hand-written window: with timers and the +inf watermark
    at end of input, every window of every key comes out (18 of 18)."""
    rnd = random.Random(3)
    records = [(f"k{i % 3}", float(t) + rnd.random() * 0.5) for i in range(3) for t in range(6)
               for _ in range(rnd.randint(1, 4))]
    rnd.shuffle(records)
    got = hand_window(records, 1.0, ooo=10.0)
    want = {}
    for k, t in records:
        want[(k, math.floor(t))] = want.get((k, math.floor(t)), 0) + 1
    assert len(want) == 18
    assert sorted(got) == sorted((k, float(s), n) for (k, s), n in want.items())


def test_timers_deduplicated_and_in_order():
    fired = []

    def element(k, x, st, ctx):
        ctx.register_event_time_timer(x[2])
        ctx.register_event_time_timer(x[2])      # twice: fires once

    def on_timer(k, t, st, ctx):
        fired.append((k, t, ctx.watermark))

    records = [("a", 0.0, 5.0), ("a", 1.0, 3.0), ("b", 2.0, 4.0), ("a", 3.0, 3.0), ("a", 40.0, 41.0)]
    env = fb.Environment(parallelism=1, max_batch=1)
    (env.from_iterable(records)
        .assign_timestamps(lambda r: r[1], watermark_interval=0)
        .key_by(lambda r: r[0])
        .process(element, on_timer=on_timer)
        .sink(lambda x: None))
    env.execute(timeout=60)
    assert [(k, t) for k, t, _ in fired] == [("a", 3.0), ("b", 4.0), ("a", 5.0), ("a", 41.0)]
    # each when the watermark reached it (after the record at 3, then at 40), the last at the end
    assert [w for _, _, w in fired] == [3.0, 40.0, 40.0, math.inf]


def test_on_end_runs_once_per_key_after_the_timers():
    calls = []

    def element(k, x, st, ctx):
        st["n"] = st.get("n", 0) + 1
        ctx.register_event_time_timer(100.0)

    def on_timer(k, t, st, ctx):
        calls.append(("timer", k))
        st["timer"] = True

    def on_end(k, st, ctx):
        calls.append(("end", k))
        return [(k, st["n"], st.get("timer", False))]

    env = fb.Environment(parallelism=2)
    out = (env.from_iterable([("a", 1.0), ("b", 2.0), ("a", 3.0)])
              .assign_timestamps(lambda r: r[1])
              .key_by(lambda r: r[0])
              .process(element, on_timer=on_timer, on_end=on_end)
              .collect())
    env.execute(timeout=60)
    assert sorted(out.result) == [("a", 2, True), ("b", 1, True)]
    for k in "ab":
        assert calls.index(("timer", k)) < calls.index(("end", k))


def test_on_end_without_timestamps_for_plain_process():
    """on_end needs no event time: a plain keyed process gets the hook too."""
    env = fb.Environment(parallelism=2)
    out = (env.from_iterable(["x", "y", "x"])
              .key_by(lambda w: w)
              .process(lambda k, w, st: st.update(n=st.get("n", 0) + 1),
                       on_end=lambda k, st, ctx: [(k, st["n"])])
              .collect())
    env.execute(timeout=60)
    assert sorted(out.result) == [("x", 2), ("y", 1)]


class Sessionize(KeyedProcessFunction):
    """Flink's classic: emit a key's count after ``gap`` of processing time
    without records of it."""

    def __init__(self, gap):
        self.gap = gap

    def process_element(self, key, record, state, ctx):
        state["n"] = state.get("n", 0) + 1
        state["deadline"] = ctx.current_processing_time() + self.gap
        ctx.register_processing_time_timer(state["deadline"])

    def on_timer(self, key, t, state, ctx):
        assert ctx.time_domain == "processing_time"
        if t == state.get("deadline"):
            n = state.pop("n")
            return [(key, n)]


def test_processing_time_timers_fire_in_the_task():
    def slow():
        for i in range(6):
            yield "a" if i < 3 else "b"
            time.sleep(0.02)
        time.sleep(0.6)               # the job stays up while the timers fire

    env = fb.Environment(parallelism=1, buffer_timeout=0.01)
    out = env.from_generator(slow).key_by(lambda w: w).process(Sessionize(0.15)).collect()
    env.execute(timeout=60)
    assert sorted(out.result) == [("a", 3), ("b", 3)]


def test_timer_without_on_timer_is_a_configuration_error():
    env = fb.Environment()
    (env.from_iterable([("a", 1.0)]).assign_timestamps(lambda r: r[1]).key_by(lambda r: r[0])
        .process(lambda k, x, st, ctx: ctx.register_event_time_timer(2.0), on_end=lambda k, st, c: None)
        .sink(lambda x: None))
    with pytest.raises(errors.JobFailedError, match="on_timer"):
        env.execute(timeout=60)


def test_bad_timer_time_fails():
    env = fb.Environment()
    (env.from_iterable([("a", 1.0)]).assign_timestamps(lambda r: r[1]).key_by(lambda r: r[0])
        .process(lambda k, x, st, ctx: ctx.register_event_time_timer("soon"), on_timer=lambda *a: None)
        .sink(lambda x: None))
    with pytest.raises(errors.JobFailedError, match="timestamp"):
        env.execute(timeout=60)


def test_keyed_process_snapshot_restores_state_and_timers():
    op = KeyedProcessOperator("p", lambda r: r[0], lambda r: r[1],
                              lambda k, x, st, ctx: ctx.register_event_time_timer(x[1] + 1),
                              on_timer=lambda k, t, st, ctx: [(k, t)])
    op.open(0, 1)
    op.process_batch([("a", 1.0), ("b", 2.0), ("a", 1.0)])
    op.on_watermark(1.5)
    snap = op.snapshot_state()
    op2 = KeyedProcessOperator("p", lambda r: r[0], lambda r: r[1], lambda *a: None,
                               on_timer=lambda k, t, st, ctx: [(k, t)])
    op2.restore_state(snap)
    op2.open(0, 1)
    assert op2.timers.watermark == 1.5
    assert op2.on_watermark(10.0) == ([("a", 2.0), ("b", 3.0)], 10.0)


# ---- two keyed inputs ----

def test_connected_keyed_inputs_share_timers_and_take_the_min_watermark():
    """A hand-written join of orders and payments: an order waits for its
    payment until 5 s of event time, then times out."""
    env = fb.Environment(parallelism=2)
    orders = env.from_iterable([(i, float(i)) for i in range(20)]).assign_timestamps(lambda r: r[1])
    payments = env.from_iterable([(i, float(i) + 2) for i in range(0, 20, 2)]).assign_timestamps(
        lambda r: r[1])

    def order(k, x, st, ctx):
        st["order"] = x
        ctx.register_event_time_timer(x[1] + 5)

    def payment(k, x, st, ctx):
        st["paid"] = True

    def on_timer(k, t, st, ctx):
        # both inputs' watermarks passed t: a payment before t has arrived
        return [(k, "paid" if st.get("paid") else "timeout")]

    out = (orders.key_by(lambda r: r[0]).connect(payments.key_by(lambda r: r[0]))
              .process(order, payment, on_timer=on_timer).collect())
    env.execute(timeout=60)
    assert sorted(out.result) == [(i, "paid" if i % 2 == 0 else "timeout") for i in range(20)]


def test_connected_timers_need_keys():
    env = fb.Environment()
    a, b = env.from_iterable([1]), env.from_iterable([2])
    with pytest.raises(errors.ConfigurationError, match="key_by"):
        a.connect(b).process(lambda x, st: None, lambda x, st: None, on_timer=lambda *a: None)
