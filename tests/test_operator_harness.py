"""The window, join and keyed operators, one at a time, through
``pyflowbuf.testing.OperatorHarness``: records, watermarks and processing
time by hand, outputs computed by hand."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf.time.process import KeyedProcessOperator
from pyflowbuf.testing import OperatorHarness
from pyflowbuf.windows import IntervalJoinOperator, WindowOperator


def _timed(records=(("a", 0.0),)):
    env = fb.Environment()
    return env, env.from_collection(list(records)).assign_timestamps(lambda r: r[1])


def _tumbling_counts(size=10.0, lateness=0.0):
    _, s = _timed()
    w = s.key_by(lambda r: r[0]).window(fb.Tumbling(size))
    if lateness:
        w = w.allowed_lateness(lateness)
    return w.aggregate(fb.Count(), window_function=lambda k, win, n: (k, win.start, n))


# ---- tumbling windows ----

def test_tumbling_count_fires_on_the_watermark_and_drops_late_records():
    h = OperatorHarness(_tumbling_counts())
    assert isinstance(h.operator, WindowOperator)
    assert h.process([("a", 1.0), ("a", 4.0), ("b", 12.0)]) == []
    assert h.timers["event"] == [(10.0, [("a", 0.0, 10.0)]), (20.0, [("b", 10.0, 20.0)])]
    assert h.process_watermark(9.5) == []               # [0, 10) is not complete yet
    assert h.process_watermark(10.0) == [("a", 0.0, 2)]
    assert h.watermarks == [9.5, 10.0]
    # the result goes out before the watermark that completed it
    assert h.events[-2:] == [("record", ("a", 0.0, 2)), ("watermark", 10.0)]
    assert h.timers["event"] == [(20.0, [("b", 10.0, 20.0)])]
    assert h.process([("a", 5.0)]) == []                # its window [0, 10) is gone: late
    assert h.metrics["late_records_dropped"] == 1
    h.process([("b", 15.0), ("b", 19.999)])
    assert h.process_watermark(8.0) == []               # a lower watermark changes nothing
    assert h.watermarks == [9.5, 10.0]
    assert h.process_watermark(20.0) == [("b", 10.0, 3)]
    assert h.state["windows"] == {}                     # fired windows are purged
    assert h.finish() == []
    assert h.watermarks == [9.5, 10.0, 20.0, math.inf]
    assert h.output == [("a", 0.0, 2), ("b", 10.0, 3)]


def test_tumbling_allowed_lateness_fires_again_then_drops():
    h = OperatorHarness(_tumbling_counts(lateness=5.0))
    h.process([("a", 1.0), ("a", 2.0)])
    assert h.process_watermark(10.0) == [("a", 0.0, 2)]
    # within the lateness: the window fires again at once with the new count
    assert h.process([("a", 3.0)]) == [("a", 0.0, 3)]
    assert h.state["windows"] == {("a", 0.0, 10.0): 3}
    assert h.process_watermark(15.0) == []              # end + lateness: the state goes
    assert h.state["windows"] == {}
    assert h.process([("a", 4.0)]) == []
    assert h.metrics["late_records_dropped"] == 1
    assert h.take() == [("a", 0.0, 2), ("a", 0.0, 3)]
    assert h.output == []


# ---- session windows ----

def test_session_windows_merge_when_a_record_bridges_them():
    _, s = _timed()
    res = (s.key_by(lambda r: r[0]).window(fb.Session(3.0))
            .aggregate(fb.Count(), window_function=lambda k, w, n: (k, w.start, w.end, n)))
    h = OperatorHarness(res)
    h.process([("a", 1.0), ("a", 2.0)])                 # [1, 4) and [2, 5): one session [1, 5)
    h.process([("a", 7.0), ("b", 4.0)])                 # [7, 10) apart; b has its own
    assert h.state["sessions"] == {"a": [[1.0, 5.0, 2], [7.0, 10.0, 1]], "b": [[4.0, 7.0, 1]]}
    assert h.timers["event"] == [(5.0, [("a", 1.0, 5.0)]), (7.0, [("b", 4.0, 7.0)]),
                                 (10.0, [("a", 7.0, 10.0)])]
    h.process([("a", 4.5)])                             # [4.5, 7.5) touches both: one [1, 10)
    assert h.state["sessions"]["a"] == [[1.0, 10.0, 4]]
    assert h.timers["event"] == [(7.0, [("b", 4.0, 7.0)]), (10.0, [("a", 1.0, 10.0)])]
    assert h.process_watermark(7.0) == [("b", 4.0, 7.0, 1)]
    assert h.process_watermark(9.9) == []
    assert h.process_watermark(10.0) == [("a", 1.0, 10.0, 4)]
    assert h.state["sessions"] == {}
    assert h.process([("a", 6.0)]) == []                # [6, 9) is past the watermark: late
    assert h.metrics["late_records_dropped"] == 1


# ---- keyed process with timers ----

def _alarm(key, record, state, ctx):
    state["n"] = state.get("n", 0) + 1
    ctx.register_event_time_timer(ctx.timestamp + 5)


def test_keyed_process_event_time_timer_fires_with_the_state_of_its_key():
    _, s = _timed()
    out = s.key_by(lambda r: r[0]).process(
        _alarm, on_timer=lambda k, t, state, ctx: [(k, t, state["n"], ctx.time_domain)],
        on_end=lambda k, state, ctx: [(k, "end", state["n"])])
    h = OperatorHarness(out)
    assert isinstance(h.operator, KeyedProcessOperator)
    h.process([("a", 1.0), ("a", 2.0), ("b", 3.0)])
    assert h.timers["event"] == [(6.0, ["a"]), (7.0, ["a"]), (8.0, ["b"])]
    assert h.state["state"] == {"a": {"n": 2}, "b": {"n": 1}}
    assert h.process_watermark(6.5) == [("a", 6.0, 2, "event_time")]
    h.process([("a", 10.0)])
    assert h.process_watermark(8.0) == [("a", 7.0, 3, "event_time"), ("b", 8.0, 1, "event_time")]
    # end of input: the +inf watermark fires the last timer, then on_end per key
    assert h.finish() == [("a", 15.0, 3, "event_time"), ("a", "end", 3), ("b", "end", 1)]
    assert h.watermarks == [6.5, 8.0, math.inf]
    with pytest.raises(errors.ConfigurationError, match="finished"):
        h.process([("a", 20.0)])


def test_keyed_process_processing_time_timer_fires_when_the_harness_says():
    def fn(key, record, state, ctx):
        ctx.register_processing_time_timer(100.0)

    op = KeyedProcessOperator("p", lambda r: r[0], None, fn,
                              on_timer=lambda k, t, state, ctx: [(k, t, ctx.time_domain)])
    h = OperatorHarness(op)
    h.process([("a", None), ("b", None), ("a", None)])  # deduplicated per key and time
    assert h.timers["processing"] == [(100.0, ["a", "b"])]
    assert op._proc_handle is None                      # nothing waits on the wall clock
    assert h.advance_processing_time(99.0) == []
    assert h.advance_processing_time(100.0) == [("a", 100.0, "processing_time"), ("b", 100.0, "processing_time")]
    assert h.timers["processing"] == []
    with pytest.raises(errors.ConfigurationError, match="forward"):
        h.advance_processing_time(50.0)


# ---- interval join ----

def test_interval_join_pairs_records_within_the_bounds_and_drops_late_ones():
    env, left = _timed()
    right = env.from_collection([("a", 0.0)]).assign_timestamps(lambda r: r[1])
    joined = (left.key_by(lambda r: r[0]).interval_join(right.key_by(lambda r: r[0]))
              .between(-1.0, 2.0).process(lambda l, r: [(l[0], l[1], r[1])]))
    h = OperatorHarness(joined)
    assert isinstance(h.operator, IntervalJoinOperator)
    assert h.process([("a", 5.0)], input=0) == []
    assert h.process([("a", 4.0)], input=1) == [("a", 5.0, 4.0)]       # 4 in [5 - 1, 5 + 2]
    assert h.process([("a", 7.5), ("b", 5.0)], input=1) == []           # 7.5 > 7; b has no left
    assert h.process([("a", 6.0)], input=1) == [("a", 5.0, 6.0)]
    assert h.process([("a", 8.0)], input=0) == [("a", 8.0, 7.5)]       # [7, 10]
    h.process_watermark(7.0)
    # a left record at t is kept while a right record at up to t + 2 may come
    # (watermark <= t + 2), a right one at t while a left one at up to t + 1
    # may: right a@4 and b@5 are gone at 7, right a@6 just stays
    buffers = h.state["buffers"]
    assert buffers[0] == {"a": [(5.0, ("a", 5.0)), (8.0, ("a", 8.0))]}
    assert buffers[1] == {"a": [(7.5, ("a", 7.5)), (6.0, ("a", 6.0))]}
    assert h.process([("a", 6.5)], input=0) == []       # below the watermark: late
    assert h.metrics["late_records_dropped"] == 1
    h.process_watermark(7.5)
    assert h.state["buffers"] == [{"a": [(8.0, ("a", 8.0))]}, {"a": [(7.5, ("a", 7.5))]}]
    assert h.output == [("a", 5.0, 4.0), ("a", 5.0, 6.0), ("a", 8.0, 7.5)]


# ---- checkpoints: snapshot, restore, go on ----

_steps = st.lists(st.one_of(
    st.tuples(st.just("rec"), st.sampled_from("ab"), st.integers(0, 60).map(lambda t: t / 2)),
    st.tuples(st.just("wm"), st.just(""), st.integers(0, 60).map(lambda t: t / 2))), max_size=40)


def _run(h, steps):
    for what, key, t in steps:
        if what == "rec":
            h.process([(key, t)])
        else:
            h.process_watermark(t)


def _reference_tumbling_counts(steps, size=10.0):
    """Per key and window [start, start + size), the records that came while
    the watermark was below its end; each fires once the watermark reaches it."""
    wm, open_windows, out = -math.inf, {}, []
    for what, key, t in steps:
        if what == "rec":
            start = t - t % size
            if start + size > wm:
                open_windows[(key, start)] = open_windows.get((key, start), 0) + 1
        elif t > wm:
            wm = t
            due = sorted((w for w in open_windows if w[1] + size <= wm), key=lambda w: w[1])
            out.extend((k, s, open_windows.pop((k, s))) for k, s in due)
    return out, open_windows


@settings(max_examples=60, deadline=None)
@given(steps=_steps, cut=st.integers(0, 40))
def test_tumbling_counts_match_a_reference_across_a_snapshot_and_restore(steps, cut):
    stream = _tumbling_counts()
    whole = OperatorHarness(stream)
    _run(whole, steps)
    expected, still_open = _reference_tumbling_counts(steps)
    assert whole.output == expected
    before = OperatorHarness(stream)
    _run(before, steps[:cut])
    after = OperatorHarness(stream, restore=before.snapshot())
    _run(after, steps[cut:])
    assert before.output + after.output == whole.output
    assert after.timers == whole.timers
    # end of input fires what is still open, in window order
    rest = sorted(still_open.items(), key=lambda kv: kv[0][1])
    assert after.finish() == whole.finish() == [(k, s, n) for (k, s), n in rest]


def test_interval_join_state_survives_the_checkpoint_format():
    env, left = _timed()
    right = env.from_collection([("a", 0.0)]).assign_timestamps(lambda r: r[1])
    joined = (left.key_by(lambda r: r[0]).interval_join(right.key_by(lambda r: r[0]))
              .between(0.0, 1.0).process(lambda l, r: [(l[1], r[1])]))
    h = OperatorHarness(joined)
    h.process([("a", 1.0), ("b", 1.0)], input=0)
    h.process_watermark(0.5)
    state = h.snapshot()
    assert state == h.state
    h2 = OperatorHarness(joined, restore=state)
    assert h2.timers == h.timers
    assert h2.process([("a", 1.5), ("b", 3.0)], input=1) == [(1.0, 1.5)]


def test_keyed_process_state_and_timers_survive_a_restore():
    _, s = _timed()
    out = s.key_by(lambda r: r[0]).process(
        _alarm, on_timer=lambda k, t, state, ctx: [(k, t, state["n"])])
    h = OperatorHarness(out)
    h.process([("a", 1.0), ("b", 2.0), ("a", 3.0)])
    h.process_watermark(6.0)
    h2 = OperatorHarness(out, restore=h.snapshot())
    assert h2.timers["watermark"] == 6.0
    assert h2.process_watermark(10.0) == h.process_watermark(10.0) == [("b", 7.0, 1), ("a", 8.0, 2)]


# ---- the harness's own rules ----

def test_assigner_watermarks_follow_each_batch():
    env = fb.Environment()
    ts = env.from_collection([1.0]).assign_timestamps(lambda r: r, out_of_orderness=1.0, watermark_interval=0)
    h = OperatorHarness(ts)
    assert h.process([5.0, 3.0, 4.0]) == [5.0, 3.0, 4.0]
    h.process([2.0])
    h.process([10.0])
    assert h.watermarks == [4.0, 9.0]
    assert h.events == [("record", 5.0), ("record", 3.0), ("record", 4.0), ("watermark", 4.0),
                        ("record", 2.0), ("record", 10.0), ("watermark", 9.0)]


def test_bad_input_is_refused_with_a_typed_error():
    env = fb.Environment()
    src = env.from_collection([1.0])
    with pytest.raises(errors.ConfigurationError, match="no operator"):
        OperatorHarness(src)
    with pytest.raises(TypeError, match="Operator or a Stream"):
        OperatorHarness(lambda x: x)
    with pytest.raises(errors.ConfigurationError, match="watermark_interval=0"):
        OperatorHarness(src.assign_timestamps(lambda r: r))
    h = OperatorHarness(_tumbling_counts())
    for bad in (float("nan"), "10", True):
        with pytest.raises(errors.ConfigurationError, match="seconds"):
            h.process_watermark(bad)


@pytest.mark.parametrize("where", ["module", "class"])
def test_the_documented_examples_run(where):
    import inspect
    import textwrap

    import pyflowbuf.testing as testing

    doc = testing.__doc__ if where == "module" else inspect.getdoc(OperatorHarness)
    block = []
    for line in doc.split("Example::\n", 1)[1].splitlines():
        if line.strip() and not line.startswith("    "):
            break
        block.append(line)
    code = textwrap.dedent("\n".join(block))
    assert "process_watermark" in code
    exec(compile(code, f"<{where} example>", "exec"), {})
