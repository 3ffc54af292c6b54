"""Mistakes in a job's declaration are refused where they are made, or at
execute() before anything runs, with a typed error naming what is wrong;
and a fault of key_by is blamed on key_by, not on the source before it."""
import functools
import random

import pytest

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf.time.process import KeyedProcessFunction
from pyflowbuf.windows import Count, Sum, Tumbling

from test_windows import norm, random_stream, reference, run_job


# ---- a job that would do nothing visible ----

def test_execute_refuses_an_empty_environment():
    env = fb.Environment()
    with pytest.raises(errors.ConfigurationError, match="nothing to run"):
        env.execute()
    # refused before anything started: the Environment is still unused
    env.from_collection([1, 2]).collect()
    env.execute(timeout=30)


@pytest.mark.parametrize("run", ["execute", "execute_async"])
def test_execute_refuses_a_job_without_a_sink(run):
    env = fb.Environment()
    env.from_collection([1, 2, 3]).map(lambda x: x + 1, name="plus_one")
    with pytest.raises(errors.ConfigurationError, match="no sink.*'plus_one'"):
        getattr(env, run)()
    assert env.last_execution is None


def test_a_sink_on_one_branch_is_enough():
    env = fb.Environment()
    s = env.from_collection([1, 2, 3])
    s.map(lambda x: x * 10)          # a branch without a sink, beside one with a sink
    out = s.collect()
    env.execute(timeout=30)
    assert out.result == [1, 2, 3]


# ---- aggregate functions ----

def _windowed(env, records=(("a", 1.0), ("b", 2.0))):
    return (env.from_collection(list(records)).assign_timestamps(lambda r: r[1])
               .key_by(lambda r: r[0]).window(Tumbling(5)))


def test_aggregate_refuses_a_class_instead_of_an_instance():
    with pytest.raises(TypeError, match=r"Count\(\) \(with parentheses\)"):
        _windowed(fb.Environment()).aggregate(Count)


def test_sum_of_tuple_records_is_refused_at_declaration():
    with pytest.raises(errors.ConfigurationError, match=r"Sum\(lambda r: r\[1\]\)"):
        _windowed(fb.Environment()).aggregate(Sum())
    # with a function picking the number it runs
    env = fb.Environment()
    out = _windowed(env, [("a", 1.0), ("a", 2.0)]).aggregate(Sum(lambda r: r[1])).collect()
    env.execute(timeout=30)
    assert out.result == [3.0]


def test_sum_of_records_of_an_unknown_kind_fails_at_the_first_record_naming_the_operator():
    env = fb.Environment()
    w = (env.from_collection([("a", 1.0)]).map(lambda r: r)      # map: kind unknown until it runs
            .assign_timestamps(lambda r: r[1]).key_by(lambda r: r[0]).window(Tumbling(5)))
    w.aggregate(Sum(), name="totals").collect()
    with pytest.raises(errors.JobFailedError, match=r"'totals'.*RecordTypeError.*Sum\(lambda r: r\[1\]\)"):
        env.execute(timeout=30)


def test_sum_of_numbers_needs_no_function():
    env = fb.Environment()
    out = (env.from_collection([1.0, 2.0, 7.0]).assign_timestamps(lambda r: r)
              .key_by(lambda r: 0).window(Tumbling(5)).aggregate(Sum()).collect())
    env.execute(timeout=30)
    assert sorted(out.result) == [3.0, 7.0]


# ---- late() ----

def test_windowed_stream_late_explains_where_late_belongs():
    with pytest.raises(errors.ConfigurationError, match="result of the window"):
        _windowed(fb.Environment()).late()


def test_late_on_the_collect_handle_explains_the_order():
    res = _windowed(fb.Environment()).aggregate(Count())
    with pytest.raises(errors.ConfigurationError, match="res.late"):
        res.collect().late()


@pytest.mark.parametrize("parallelism", [1, 2])
def test_late_after_collect_splits_the_results_and_matches_the_reference(parallelism):
    """late() after the results are read: the collect() declared before it
    still gets exactly the window results, and late() the late records."""
    rnd = random.Random(77 + parallelism)
    records = random_stream(rnd, 150, disorder=5, very_late=0.08)
    want, want_late = reference(records, kind="tumbling", size=1.0, ooo=0.25, lateness=0.5)
    got, got_late, _ = run_job(records, kind="tumbling", size=1.0, ooo=0.25, lateness=0.5,
                               parallelism=parallelism, late_first=False)
    assert norm(got) == norm(want)
    assert sorted(got_late) == sorted(want_late) and want_late


def test_stream_taken_from_the_results_before_late_reads_the_results():
    env = fb.Environment(max_batch=1)
    res = (env.from_collection([("a", 0.5), ("a", 1.5), ("a", 9.0), ("a", 0.7)])
              .assign_timestamps(lambda r: r[1], watermark_interval=0)
              .key_by(lambda r: r[0]).window(Tumbling(1.0))
              .aggregate(Count(), window_function=lambda k, w, n: (k, w.start, n)))
    mapped = res.map(lambda r: r[2])     # declared before late(), no sink yet
    late = res.late().collect()
    counts = mapped.collect()
    env.execute(timeout=30)
    assert sorted(counts.result) == [1, 1, 1]
    assert late.result == [("a", 0.7)]


# ---- process functions: arity ----

@pytest.mark.parametrize("fn", [lambda k, x: [x], lambda: None, lambda k, x, s, c, extra: None,
                                lambda k, x, s, *, must: None])
def test_keyed_process_with_the_wrong_arity_is_refused(fn):
    env = fb.Environment()
    with pytest.raises(errors.ConfigurationError, match=r"process 'p'.*fn\(key, record, state\)"):
        env.from_collection([1]).key_by(lambda x: x).process(fn, name="p")


class _Callable:
    def __call__(self, key, record, state):
        return [record]


class _PF(KeyedProcessFunction):
    def process_element(self, key, record, state, ctx):
        return [record]


@pytest.mark.parametrize("fn", [lambda k, x, s: [x], lambda k, x, s, ctx: [x], lambda *a: [a[1]],
                                functools.partial(lambda tag, k, x, s: [x], "t"), _Callable(), _PF()])
def test_keyed_process_accepts_every_fitting_callable(fn):
    env = fb.Environment()
    out = env.from_collection([1, 2]).key_by(lambda x: x).process(fn).collect()
    env.execute(timeout=30)
    assert sorted(out.result) == [1, 2]


def test_process_timer_callbacks_and_connected_functions_are_checked():
    env = fb.Environment()
    ks = env.from_collection([1]).key_by(lambda x: x)
    with pytest.raises(errors.ConfigurationError, match="on_timer"):
        ks.process(lambda k, x, s: None, on_timer=lambda k, t: None)
    with pytest.raises(errors.ConfigurationError, match="on_end"):
        ks.process(lambda k, x, s: None, on_end=lambda k: None)
    a, b = env.from_collection([1]), env.from_collection([2])
    with pytest.raises(errors.ConfigurationError, match=r"fn2\(record, state\)"):
        a.connect(b).process(lambda x, s: None, lambda x: None)
    with pytest.raises(errors.ConfigurationError, match=r"fn1\(key, record, state\)"):
        a.key_by(str).connect(b.key_by(str)).process(lambda x, s: None, lambda k, x, s: None)


def test_a_builtin_without_a_signature_is_left_to_its_call():
    env = fb.Environment()
    env.from_collection([1]).key_by(lambda x: x).process(max).collect()   # no signature to read
    with pytest.raises(errors.JobFailedError):
        env.execute(timeout=30)


# ---- key_by faults are key_by's ----

@pytest.mark.parametrize("workers", [None, 2])
def test_a_key_function_returning_a_list_is_blamed_on_key_by(workers):
    env = fb.Environment(parallelism=2, workers=workers)
    (env.from_collection([1, 2, 3], name="numbers").key_by(lambda x: [x])
        .reduce(lambda a, b: a + b, name="total").collect())
    with pytest.raises(errors.JobFailedError) as info:
        env.execute(timeout=60)
    msg = str(info.value)
    assert "operator \"key_by (into 'total')\"" in msg and "KeyTypeError" in msg, msg


def test_a_key_function_that_raises_is_blamed_on_key_by():
    env = fb.Environment(parallelism=2)
    env.from_collection([{"a": 1}], name="dicts").key_by(lambda r: r["missing"]).map(str, name="m").collect()
    with pytest.raises(errors.JobFailedError, match="operator \"key_by \\(into 'm'\\)\".*KeyError"):
        env.execute(timeout=30)
