"""PyFlink's spellings that mean the same here work, and those whose meaning
differs say ours (docs/coming-from-pyflink.md): the window's result takes
name/set_parallelism/uid, the windowed stream trigger()/apply()/
side_output_late_data(), KeyedStream sum/min/max/min_by/max_by and
count_window, side outputs without declaring the tag, execute_and_collect,
ctx.timer_service()/get_current_key(), and KeyedProcessFunction with
PyFlink's method signatures."""
from __future__ import annotations

import collections
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf import errors

Pair = collections.namedtuple("Pair", "word n")


def _timed(env, records, p=1):
    return env.from_collection(records).assign_timestamps(lambda r: r[1], parallelism=p)


# ---------------------------------------------------------------- after a window

@pytest.mark.parametrize("p", [1, 2])
def test_name_set_parallelism_uid_after_a_window(p):
    env = fb.Environment(parallelism=1)
    res = (_timed(env, [("a", float(t)) for t in range(20)]).key_by(lambda r: r[0])
           .window(fb.Tumbling(10)).aggregate(fb.Count())
           .name("per-ten").set_parallelism(p).uid("per-ten-uid"))
    out = res.collect()
    vertices, _ = env.plan()
    assert any("per-ten" in v.name and v.parallelism == p for v in vertices)
    assert res.node.uid == "per-ten-uid"
    env.execute(timeout=60)
    assert sorted(out.result) == [10, 10]


def test_set_parallelism_changes_the_default_partitioner_of_the_input():
    env = fb.Environment(parallelism=2)
    doubled = env.from_sequence(0, 100).map(lambda x: 2 * x).set_parallelism(3)
    assert doubled.node.inputs[0].partitioner == "rebalance"
    out = doubled.collect()
    env.execute(timeout=60)
    assert sorted(out.result) == [2 * x for x in range(100)]


def test_set_parallelism_misuse_is_a_typed_error():
    env = fb.Environment(parallelism=2)
    src = env.from_sequence(0, 10)
    with pytest.raises(errors.ConfigurationError, match="parallelism= to it"):
        src.set_parallelism(4)
    m = src.map(lambda x: x)
    m.collect()
    with pytest.raises(errors.ConfigurationError, match="after its stream was used"):
        m.set_parallelism(3)
    timed = src.assign_timestamps(lambda x: float(x))
    alls = timed.window_all(fb.Tumbling(5)).aggregate(fb.Count())
    with pytest.raises(errors.ConfigurationError, match="one subtask"):
        alls.set_parallelism(2)
    with pytest.raises(errors.ConfigurationError, match="parallelism"):
        timed.map(lambda x: x).set_parallelism(0)


def test_name_renames_the_operator_in_errors():
    env = fb.Environment()
    env.from_sequence(0, 3).map(lambda x: 1 // (x - 1)).name("divide").collect()
    with pytest.raises(errors.JobFailedError, match="'divide'"):
        env.execute(timeout=60)


# ---------------------------------------------------------------- triggers and count windows

def test_trigger_on_the_windowed_stream():
    env = fb.Environment()
    out = (_timed(env, [("a", float(t)) for t in range(7)]).key_by(lambda r: r[0])
           .window(fb.Tumbling(10)).trigger(fb.CountTrigger(3)).aggregate(fb.Count())).collect()
    env.execute(timeout=60)
    assert out.result == [3, 6]


def test_trigger_misuse_is_a_typed_error():
    env = fb.Environment()
    w = _timed(env, [("a", 1.0)]).key_by(lambda r: r[0]).window(fb.Tumbling(10))
    with pytest.raises(TypeError, match=r"CountTrigger\(3\)"):
        w.trigger(fb.CountTrigger)
    with pytest.raises(TypeError, match="takes EventTimeTrigger"):
        w.trigger(3)
    with pytest.raises(errors.ConfigurationError, match="count windows"):
        env.from_sequence(0, 3).key_by(lambda x: x).count_window(2).trigger(fb.CountTrigger(1))


def test_count_window_tumbling_and_sliding():
    env = fb.Environment()
    keyed = env.from_sequence(0, 6).key_by(lambda x: 0)
    tumbling = keyed.count_window(3).reduce(lambda a, b: a + b).collect()
    sliding = keyed.count_window(2, 1).apply(lambda k, w, recs: [sum(recs)]).collect()
    env.execute(timeout=60)
    assert tumbling.result == [0 + 1 + 2, 3 + 4 + 5]
    assert sliding.result == [0, 1, 3, 5, 7, 9]


# ---------------------------------------------------------------- rolling aggregations

RECORDS = [("a", 3, "x"), ("b", 5, "y"), ("a", 1, "z"), ("a", 4, "w"), ("b", 5, "v")]


@pytest.mark.parametrize("how, expected", [
    ("sum", [("a", 3, "x"), ("b", 5, "y"), ("a", 4, "x"), ("a", 8, "x"), ("b", 10, "y")]),
    ("min", [("a", 3, "x"), ("b", 5, "y"), ("a", 1, "x"), ("a", 1, "x"), ("b", 5, "y")]),
    ("max", [("a", 3, "x"), ("b", 5, "y"), ("a", 3, "x"), ("a", 4, "x"), ("b", 5, "y")]),
    ("min_by", [("a", 3, "x"), ("b", 5, "y"), ("a", 1, "z"), ("a", 1, "z"), ("b", 5, "y")]),
    ("max_by", [("a", 3, "x"), ("b", 5, "y"), ("a", 3, "x"), ("a", 4, "w"), ("b", 5, "y")]),
])
def test_keyed_rolling_aggregations_by_position(how, expected):
    env = fb.Environment()
    out = getattr(env.from_collection(RECORDS).key_by(lambda r: r[0]), how)(1).collect()
    env.execute(timeout=60)
    assert out.result == expected


def test_rolling_aggregations_by_name_on_dicts_and_named_tuples_and_of_numbers():
    env = fb.Environment()
    dicts = env.from_collection([{"k": "a", "v": 2}, {"k": "a", "v": 5}]).key_by(lambda r: r["k"]).sum("v").collect()
    named = env.from_collection([Pair("a", 2), Pair("a", 7)]).key_by(lambda r: r.word).max("n").collect()
    numbers = env.from_collection([1, 2, 3]).key_by(lambda x: x % 2).sum().collect()
    env.execute(timeout=60)
    assert dicts.result == [{"k": "a", "v": 2}, {"k": "a", "v": 7}]
    assert named.result == [Pair("a", 2), Pair("a", 7)]
    assert sorted(numbers.result) == [1, 2, 4]


def test_rolling_aggregation_misuse():
    env = fb.Environment()
    with pytest.raises(TypeError, match="field position"):
        env.from_sequence(0, 3).key_by(lambda x: x).sum(1.5)
    env.from_collection([("a", 1), ("a", 2)]).key_by(lambda r: r[0]).sum(5).collect()
    with pytest.raises(errors.JobFailedError, match="no field 5"):
        env.execute(timeout=60)


# ---------------------------------------------------------------- side outputs

def test_side_output_without_declaring_the_tag():
    odd = fb.OutputTag("odd", kind="int64")

    def split(x, ctx):
        if x % 2:
            ctx.output(odd, x)
        else:
            yield x

    env = fb.Environment(parallelism=2)
    evens = env.from_sequence(0, 20).process(split)
    main = evens.collect()
    odds = evens.get_side_output(odd).collect()
    env.execute(timeout=60)
    assert sorted(main.result) == list(range(0, 20, 2))
    assert sorted(odds.result) == list(range(1, 20, 2))


def test_keyed_process_function_side_output_without_declaring():
    big = fb.OutputTag("big")

    class Split(fb.KeyedProcessFunction):
        def process_element(self, value, ctx):
            if value >= 5:
                ctx.output(big, (ctx.get_current_key(), value))
            yield value

    env = fb.Environment()
    main = env.from_sequence(0, 8).key_by(lambda x: x % 2).process(Split())
    out = main.collect()
    bigs = main.get_side_output(big).collect()
    env.execute(timeout=60)
    assert sorted(out.result) == list(range(8))
    assert sorted(bigs.result) == [(0, 6), (1, 5), (1, 7)]


def test_side_output_late_data_with_get_side_output():
    tag = fb.OutputTag("late-data")
    env = fb.Environment(max_batch=1)
    records = [("a", 1.0), ("a", 25.0), ("a", 2.0)]        # 2.0 comes after the watermark passed 10
    res = (env.from_iterable(records).assign_timestamps(lambda r: r[1], watermark_interval=0, parallelism=1)
              .key_by(lambda r: r[0]).window(fb.Tumbling(10)).side_output_late_data(tag)
              .aggregate(fb.Count()))
    counts = res.collect()
    late = res.get_side_output(tag)
    assert late is res.late()
    late_out = late.collect()
    env.execute(timeout=60)
    assert sorted(counts.result) == [1, 1]
    assert late_out.result == [("a", 2.0)]


def test_undeclared_side_output_on_a_function_without_ctx_still_says_ours():
    env = fb.Environment()
    s = env.from_sequence(0, 3).key_by(lambda x: x).process(lambda k, x, st: [x])
    with pytest.raises(errors.ConfigurationError, match="side_outputs="):
        s.get_side_output(fb.OutputTag("t"))


# ---------------------------------------------------------------- execute_and_collect

def test_execute_and_collect_with_and_without_limit():
    env = fb.Environment()
    assert env.from_sequence(0, 1000).map(lambda x: x * x).execute_and_collect(limit=3) == [0, 1, 4]
    env = fb.Environment()
    with env.from_sequence(0, 5).execute_and_collect("numbers") as records:
        assert list(records) == [0, 1, 2, 3, 4]
    assert env.name == "numbers"
    with pytest.raises(errors.ConfigurationError, match="limit"):
        fb.Environment().from_sequence(0, 5).execute_and_collect(limit=0)


# ---------------------------------------------------------------- process functions

class PyFlinkStyle(fb.KeyedProcessFunction):
    """Written as for PyFlink: open(runtime_context), process_element(value,
    ctx), on_timer(timestamp, ctx), ctx.timer_service(), ctx.get_current_key()."""

    def open(self, runtime_context):
        self.where = (runtime_context.get_index_of_this_subtask(),
                      runtime_context.get_number_of_parallel_subtasks(),
                      runtime_context.get_task_name())

    def process_element(self, value, ctx):
        ts = ctx.timer_service()
        assert ts.current_watermark() <= value[1]
        assert ts.current_processing_time() > 0
        ts.register_event_time_timer(value[1] + 10)
        yield (ctx.get_current_key(), value[1], self.where)

    def on_timer(self, timestamp, ctx):
        yield (ctx.get_current_key(), "timer", timestamp)

    def close(self):
        pass


@pytest.mark.parametrize("p", [1, 2])
def test_pyflink_style_keyed_process_function(p):
    env = fb.Environment(parallelism=p)
    out = (_timed(env, [("a", 1.0), ("b", 2.0)], p).key_by(lambda r: r[0])
           .process(PyFlinkStyle(), name="pf")).collect()
    env.execute(timeout=60)
    rows = sorted(out.result, key=repr)
    timers = [r for r in rows if r[1] == "timer"]
    assert sorted(timers) == [("a", "timer", 11.0), ("b", "timer", 12.0)]
    elements = [r for r in rows if r[1] != "timer"]
    assert {r[0] for r in elements} == {"a", "b"}
    assert all(r[2][1] == p and r[2][2] == "pf" and 0 <= r[2][0] < p for r in elements)


def test_runtime_context_get_state_says_ours():
    from pyflowbuf.time.process import RuntimeContext
    with pytest.raises(errors.ConfigurationError, match="state dict|state, a dict"):
        RuntimeContext("p", 0, 1).get_state("count")


# ---------------------------------------------------------------- side outputs keep their records' times

@pytest.mark.parametrize("p", [1, 2])
def test_a_window_after_a_side_output_sees_the_original_event_times(p):
    tag = fb.OutputTag("odd")

    def split(r, ctx):
        if r[1] % 2:
            ctx.output(tag, r)
        else:
            yield r

    env = fb.Environment(parallelism=p)
    records = [("k", i) for i in range(40)]
    timed = env.from_collection(records).assign_timestamps(lambda r: float(r[1]), parallelism=1)
    main = timed.map(lambda r: r, name="after").process(split)     # the times travel with the records
    per_ten = (main.get_side_output(tag).key_by(lambda r: r[0]).window(fb.Tumbling(10))
               .process(lambda k, w, recs: [(w.start, sorted(r[1] for r in recs))])).collect()
    main.collect()
    env.execute(timeout=60)
    assert sorted(per_ten.result) == [(float(s), list(range(s + 1, s + 10, 2))) for s in range(0, 40, 10)]


def test_a_window_after_late_records_sees_their_own_times():
    env = fb.Environment(max_batch=1)
    records = [("a", 1.0), ("a", 25.0), ("a", 2.0), ("a", 3.0), ("a", 14.0), ("a", 40.0), ("a", 11.0)]
    res = (env.from_iterable(records).assign_timestamps(lambda r: r[1], watermark_interval=0, parallelism=1)
              .map(lambda r: r, name="after")        # the times travel with the records from here
              .key_by(lambda r: r[0]).window(fb.Tumbling(10)).aggregate(fb.Count()))
    res.collect()
    late = res.late()
    stamps = late.process(lambda r, ctx: [(r[1], ctx.timestamp)]).collect()
    # downstream the watermark has passed them too: a window takes them within its allowed lateness
    again = (late.key_by(lambda r: r[0]).window(fb.Tumbling(10)).allowed_lateness(100)
             .process(lambda k, w, recs: [(w.start, sorted(r[1] for r in recs))])).collect()
    env.execute(timeout=60)
    assert sorted(stamps.result) == [(2.0, 2.0), (3.0, 3.0), (11.0, 11.0), (14.0, 14.0)]
    last: dict = {}
    for start, recs in again.result:            # each late firing holds the window's records so far
        if len(recs) > len(last.get(start, ())):
            last[start] = recs
    assert last == {0.0: [2.0, 3.0], 10.0: [11.0, 14.0]}


def test_process_side_output_records_keep_the_time_ctx_gave_them():
    tag = fb.OutputTag("echo")

    def fn(key, r, state, ctx):
        ctx.output(tag, r)                  # the record's own time
        ctx.register_event_time_timer(ctx.timestamp + 100)

    def on_timer(key, t, state, ctx):
        ctx.output(tag, (key, "timer"))     # the timer's time
        return []

    env = fb.Environment()
    timed = env.from_collection([("a", 1.0), ("a", 12.0)]).assign_timestamps(lambda r: r[1])
    main = timed.key_by(lambda r: r[0]).process(fn, on_timer=on_timer)
    main.collect()
    starts = (main.get_side_output(tag).window_all(fb.Tumbling(10))
              .process(lambda w, recs: [(w.start, len(recs))])).collect()
    env.execute(timeout=60)
    assert sorted(starts.result) == [(0.0, 1), (10.0, 1), (100.0, 1), (110.0, 1)]


def test_pyflink_style_process_function_on_an_unkeyed_stream():
    class Stamp:                                   # PyFlink's ProcessFunction shape
        def open(self, runtime_context):
            self.p = runtime_context.get_number_of_parallel_subtasks()

        def process_element(self, value, ctx):
            yield (value, ctx.timestamp, self.p, ctx.timer_service().current_watermark() <= value)

        def close(self):
            pass

    env = fb.Environment(parallelism=2)
    out = (env.from_collection([1.0, 2.0, 3.0]).assign_timestamps(lambda x: x, parallelism=1)
              .process(Stamp())).collect()
    env.execute(timeout=60)
    assert sorted(out.result) == [(x, x, 2, True) for x in (1.0, 2.0, 3.0)]


def test_timers_and_the_key_on_an_unkeyed_stream_say_ours():
    def fn(x, ctx):
        ctx.timer_service().register_event_time_timer(10.0)
        return [x]

    env = fb.Environment()
    env.from_collection([1.0]).process(fn, name="p").collect()
    with pytest.raises(errors.JobFailedError, match="key_by"):
        env.execute(timeout=60)


def test_an_unkeyed_process_function_with_a_bad_signature_is_refused_at_declaration():
    class Bad:
        def process_element(self, value):
            return [value]

    with pytest.raises(errors.ConfigurationError, match=r"Bad\.process_element"):
        fb.Environment().from_sequence(0, 3).process(Bad())


def test_window_settings_in_the_wrong_place_say_where_they_go():
    env = fb.Environment()
    keyed = _timed(env, [("a", 1.0)]).key_by(lambda r: r[0])
    w = keyed.window(fb.Tumbling(10))
    for call in (lambda: w.name("x"), lambda: w.uid("x"), lambda: w.set_parallelism(2)):
        with pytest.raises(errors.ConfigurationError, match="on their result"):
            call()
    res = w.aggregate(fb.Count())
    for call in (lambda: res.trigger(fb.CountTrigger(2)), lambda: res.allowed_lateness(5),
                 lambda: res.side_output_late_data(fb.OutputTag("l"))):
        with pytest.raises(errors.ConfigurationError, match="before its function"):
            call()
    with pytest.raises(errors.ConfigurationError, match="no operator itself"):
        keyed.name("x")
    with pytest.raises(errors.ConfigurationError, match="no operator itself"):
        env.from_sequence(0, 3).rebalance().set_parallelism(2)


def test_allowed_lateness_in_pyflink_milliseconds_warns():
    env = fb.Environment()
    w = _timed(env, [("a", 1.0)]).key_by(lambda r: r[0]).window(fb.Tumbling(10))
    with pytest.warns(errors.UnitWarning, match=r"allowed_lateness\(5\)"):
        w.allowed_lateness(5000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w.allowed_lateness(300)


def _reference(how, records):
    """PyFlink's rolling aggregation of field 1, per key, in arrival order."""
    acc: dict = {}
    out = []
    for r in records:
        a = acc.get(r[0])
        if a is None:
            a = r
        elif how == "sum":
            a = (a[0], a[1] + r[1], a[2])
        elif how == "min":
            a = (a[0], min(a[1], r[1]), a[2])
        elif how == "max":
            a = (a[0], max(a[1], r[1]), a[2])
        elif how == "min_by":
            a = r if r[1] < a[1] else a
        else:
            a = r if r[1] > a[1] else a
        acc[r[0]] = a
        out.append(a)
    return out


@settings(max_examples=25, deadline=None)
@given(how=st.sampled_from(["sum", "min", "max", "min_by", "max_by"]), p=st.sampled_from([1, 2]),
       values=st.lists(st.tuples(st.sampled_from("abc"), st.integers(-5, 5)), min_size=1, max_size=30))
def test_rolling_aggregations_match_a_reference(how, p, values):
    records = [(k, v, i) for i, (k, v) in enumerate(values)]
    env = fb.Environment(parallelism=p)
    out = getattr(env.from_collection(records).key_by(lambda r: r[0]), how)(1).collect()
    env.execute(timeout=60)
    expected = _reference(how, records)
    # each key's outputs come in its records' order (one source subtask feeds them)
    for key in "abc":
        assert [r for r in out.result if r[0] == key] == [r for r in expected if r[0] == key]
