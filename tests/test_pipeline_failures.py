"""Failure and cancellation: an exception anywhere fails the whole job within a
bounded time, every task stops, every segment returns to the pool, no thread
is left behind, and the error names the operator and carries the original
traceback. Cancelling from the caller ends the same way."""
from __future__ import annotations

import itertools
import os
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf.errors import JobFailedError

pytestmark = pytest.mark.timeout(120)

BOUND_S = 10.0      # a failed or cancelled job must be down well within this


class Injected(Exception):
    """The failure the tests inject."""


def assert_stopped_and_clean(env, before=()):
    job = env.last_execution
    assert job.done
    for t in job.tasks:
        assert not t.is_alive(), t.name
        assert t.state in ("FINISHED", "FAILED", "CANCELED"), (t.name, t.state)
    pool = job.network_pool
    assert pool.available_segments == pool.total_segments, (pool.available_segments, pool.total_segments)
    alive = [t.name for t in threading.enumerate()
             if t.name.startswith("pyflowbuf") and t.ident not in before]
    assert alive == []


def thread_ids():
    return {t.ident for t in threading.enumerate()}


def fail_at(n, what="injected failure"):
    """A function failing on its n-th call (counted over all subtasks)."""
    counter = itertools.count()

    def fn(x):
        if next(counter) == n:
            raise Injected(f"{what} at call {n}")
        return x
    return fn


def expect_failure(env, op_name, *, timeout=30, text="injected failure"):
    t0 = time.monotonic()
    with pytest.raises(JobFailedError) as info:
        env.execute(timeout)
    elapsed = time.monotonic() - t0
    assert elapsed < BOUND_S, elapsed
    msg = str(info.value)
    assert f"operator {op_name!r}" in msg, msg
    assert text in msg
    assert "Original traceback" in msg and "Traceback (most recent call last)" in msg
    assert isinstance(info.value.__cause__, Injected)
    return msg


# --------------------------------------------------------------------------- one failing operator

def build(env, where, n_fail, big=False):
    """source -> map -> filter -> flat_map -> key_by/reduce -> process -> sink,
    each named; the operator ``where`` fails on its ``n_fail``-th record."""
    f = {name: (lambda x: x) for name in ("map", "filter", "flat_map", "reduce", "process", "sink", "source")}
    f[where] = fail_at(n_fail)
    payload = b"p" * 6000 if big else b""

    def source():
        for i in range(5000):
            f["source"](i)
            yield (i, payload)

    def flat(x):
        f["flat_map"](x)
        return [x, x]

    def red(a, b):
        f["reduce"](b)
        return b

    def proc(k, x, state):
        f["process"](x)
        return [x]

    (env.from_generator(source, name="the_source", kind="pickle")
        .map(lambda x: f["map"](x), name="the_map")
        .filter(lambda x: f["filter"](x) is not None, name="the_filter")
        .flat_map(flat, name="the_flat_map")
        .key_by(lambda x: x[0] % 7)
        .reduce(red, name="the_reduce")
        .key_by(lambda x: x[0] % 3)
        .process(proc, name="the_process")
        .rebalance()
        .sink(lambda x: f["sink"](x), name="the_sink"))


OPS = ["source", "map", "filter", "flat_map", "reduce", "process", "sink"]


@pytest.mark.parametrize("where", OPS)
@pytest.mark.parametrize("chaining", [True, False], ids=["chained", "unchained"])
@pytest.mark.parametrize("p", [1, 2], ids=["p1", "p2"])
def test_failure_in_any_operator_fails_the_job(where, chaining, p):
    before = thread_ids()
    env = fb.Environment(parallelism=p, chaining=chaining, segment_size=4096)
    build(env, where, 700)
    name = "the_source" if where == "source" else f"the_{where}"
    msg = expect_failure(env, name)
    assert "injected failure at call 700" in msg
    assert "in fn" in msg             # the failing function's frame is in the text
    assert_stopped_and_clean(env, before)


@pytest.mark.parametrize("where", ["map", "process", "sink"])
def test_failure_with_zero_copy_records_in_flight_returns_every_segment(where):
    """Records >= 4 KiB are memoryviews over segments; the batch in flight at
    the failure must not pin them."""
    before = thread_ids()
    env = fb.Environment(parallelism=2, chaining=False, segment_size=8192)
    build(env, where, 300, big=True)
    expect_failure(env, f"the_{where}")
    assert_stopped_and_clean(env, before)


def test_failure_while_producers_are_backpressured():
    """The source and the middle stages are parked on dry pools behind a slow
    sink when the sink fails: all of them wake and stop at once."""
    before = thread_ids()
    env = fb.Environment(parallelism=1, chaining=False, segment_size=1024, output_buffers=(1, 2))
    calls = itertools.count()

    def slow_sink(x):
        time.sleep(0.0005)
        if next(calls) == 400:
            raise Injected("injected failure in the slow sink")

    env.from_sequence(0, None).map(lambda x: x).map(lambda x: x).sink(slow_sink, name="slow_sink")
    expect_failure(env, "slow_sink")
    assert_stopped_and_clean(env, before)
    job = env.last_execution
    src = [t for t in job.tasks if t.task_name.startswith("sequence")][0]
    assert src.outputs[0].backpressure_ns > 0     # it really was parked


def test_failure_in_a_rate_limited_job_is_fast():
    before = thread_ids()
    env = fb.Environment(chaining=False)
    env.from_sequence(0, None, rate_limit=50).map(fail_at(3), name="m").sink(lambda x: None)
    expect_failure(env, "m")
    assert_stopped_and_clean(env, before)


def test_failure_in_open_or_finish_of_an_operator():
    """A failing key function (called while emitting) and an exception at end
    of input are reported too."""
    before = thread_ids()
    env = fb.Environment(parallelism=2, chaining=False)

    def key(x):
        if x == 77:
            raise Injected("injected failure in key_by")
        return x

    env.from_sequence(0, 1000).map(lambda x: x, name="keyed_map").key_by(key).map(lambda x: x).collect()
    # the key function runs in keyed_map's task, but the failure is key_by's
    expect_failure(env, "key_by (into 'map')", text="injected failure in key_by")
    assert_stopped_and_clean(env, before)


class Unprintable:
    def __str__(self):
        raise LookupError("no text for this record")


def test_failure_in_write_text(tmp_path):
    before = thread_ids()
    env = fb.Environment(chaining=False)
    env.from_collection([Unprintable()] * 10, kind="pickle").write_text(tmp_path / "out", name="writer")
    with pytest.raises(JobFailedError, match="'writer'") as info:
        env.execute(30)
    assert isinstance(info.value.__cause__, LookupError)
    # the failed part stays hidden: nothing reads as output
    assert [n for n in os.listdir(tmp_path / "out") if not n.startswith(".")] == []
    assert_stopped_and_clean(env, before)


def test_base_exception_in_operator_fails_the_job():
    before = thread_ids()
    env = fb.Environment(chaining=False)

    def exit_now(x):
        raise SystemExit("operator called exit")

    env.from_sequence(0, 100).map(exit_now, name="exiting").collect()
    with pytest.raises(JobFailedError, match="'exiting'"):
        env.execute(30)
    assert_stopped_and_clean(env, before)


# --------------------------------------------------------------------------- cancellation


def _unbounded(env, slow=False):
    def sink(x):
        if slow:
            time.sleep(0.0002)
    (env.from_sequence(0, None).map(lambda x: x + 1).rebalance()
        .map(lambda x: x, parallelism=2).key_by(lambda x: x % 4).reduce(lambda a, b: b).sink(sink))


@pytest.mark.parametrize("chaining", [True, False], ids=["chained", "unchained"])
@pytest.mark.parametrize("slow", [True, False], ids=["backpressured", "flowing"])
def test_cancel_from_the_caller(chaining, slow):
    before = thread_ids()
    env = fb.Environment(parallelism=2, chaining=chaining, segment_size=2048)
    _unbounded(env, slow)
    job = env.execute_async()
    time.sleep(0.3)
    assert not job.done
    t0 = time.monotonic()
    job.cancel()
    job.join(BOUND_S)                 # a cancelled job ends without an error
    assert time.monotonic() - t0 < BOUND_S
    assert_stopped_and_clean(env, before)
    assert all(t.state == "CANCELED" for t in job.tasks)


def test_join_timeout_cancels_the_job():
    before = thread_ids()
    env = fb.Environment(parallelism=2, chaining=False)
    _unbounded(env, slow=True)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish"):
        env.execute(0.5)
    assert time.monotonic() - t0 < 0.5 + BOUND_S
    assert_stopped_and_clean(env, before)


@pytest.mark.parametrize("chaining", [True, False], ids=["chained", "unchained"])
@pytest.mark.parametrize("big", [False, True], ids=["ints", "big-bytes"])
def test_closing_execute_iter_early_cancels(chaining, big):
    before = thread_ids()
    env = fb.Environment(parallelism=2, chaining=chaining, segment_size=8192)
    s = env.from_sequence(0, None)
    if big:
        s = s.map(lambda x: b"v" * 5000)
    h = s.map(lambda x: x).to_iterator()
    gen = env.execute_iter(h)
    # big records come as memoryviews over segments: keeping thousands of them
    # would pin every segment (by design), so look at each and drop it
    n = sum(1 for _ in itertools.islice(gen, 3000))
    assert n == 3000
    gen.close()
    assert_stopped_and_clean(env, before)


def test_execute_iter_reports_a_failure():
    before = thread_ids()
    env = fb.Environment(parallelism=2, chaining=False)
    h = env.from_sequence(0, 100_000).map(fail_at(5000), name="iter_map").to_iterator()
    got = []
    with pytest.raises(JobFailedError, match="'iter_map'"):
        for x in env.execute_iter(h):
            got.append(x)
    # the other subtask runs on until the cancel reaches it: some, not all, arrive
    assert len(got) < 100_000 and all(x % 1 == 0 for x in got)
    assert_stopped_and_clean(env, before)


def test_execute_iter_abandoned_generator_is_cleaned_by_close():
    """Breaking out of the loop and letting the generator go also cancels."""
    before = thread_ids()
    env = fb.Environment(chaining=False)
    h = env.from_sequence(0, None).to_iterator()
    gen = env.execute_iter(h)
    for i, _ in enumerate(gen):
        if i == 100:
            break
    gen.close()
    assert_stopped_and_clean(env, before)


# --------------------------------------------------------------------------- random graphs

OP_KINDS = ["map", "filter", "flat_map", "reduce"]


def _make_op(kind, fail):
    """Operators on (id, value) records whose record counts do not depend on
    partitioning or order, so the number of calls each one gets is known."""
    if kind == "map":
        return lambda r: (fail(r)[0], r[1] * 2 + 1)
    if kind == "filter":
        return lambda r: fail(r)[0] % 3 != 1
    if kind == "flat_map":
        return lambda r: (fail(r), [(r[0] * 2, r[1]), (r[0] * 2 + 1, -r[1])])[1]
    return lambda a, b: (fail(b)[0], a[1] + b[1])      # reduce: keeps b's id


def _calls_per_op(n, ops):
    """Reference: how many records reach each operator (pure Python)."""
    ids = list(range(n))
    calls = []
    for kind, *_ in ops:
        calls.append(len(ids))
        if kind == "filter":
            ids = [i for i in ids if i % 3 != 1]
        elif kind == "flat_map":
            ids = [j for i in ids for j in (i * 2, i * 2 + 1)]
        elif kind == "reduce":
            # the reduce function runs for every record but the first of a key
            calls[-1] = len(ids) - len({i % 4 for i in ids})
    return calls, len(ids)


graph_ops = st.lists(st.tuples(st.sampled_from(OP_KINDS), st.integers(1, 3), st.booleans()),
                     min_size=1, max_size=5)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=graph_ops, source_p=st.integers(1, 3), chaining=st.booleans(),
       fail_op=st.integers(0, 10), fail_frac=st.floats(0, 1.2), data=st.data())
def test_random_graphs_fail_cleanly(ops, source_p, chaining, fail_op, fail_frac, data):
    n = 600
    fail_op %= len(ops)
    calls, n_out = _calls_per_op(n, ops)
    fail_at_call = int(fail_frac * calls[fail_op])     # beyond the calls: no failure
    before = thread_ids()
    env = fb.Environment(parallelism=source_p, chaining=chaining, segment_size=1024,
                         max_batch=data.draw(st.sampled_from([1, 7, 64, 1024]), label="max_batch"))
    s = env.from_sequence(0, n).map(lambda i: (i, i), name="to_pairs", kind="pickle")
    names = []
    for i, (kind, p, rebalance) in enumerate(ops):
        counter = itertools.count()

        def fail(r, counter=counter, i=i):
            if next(counter) == fail_at_call and i == fail_op:
                raise Injected(f"injected failure in op{i}")
            return r

        name = f"op{i}_{kind}"
        names.append(name)
        fn = _make_op(kind, fail)
        if rebalance or p != s.node.parallelism:
            s = s.rebalance()
        if kind == "reduce":
            s = s.key_by(lambda r: r[0] % 4).reduce(fn, parallelism=p, name=name)
        else:
            s = getattr(s, kind)(fn, parallelism=p, name=name)
    h = s.collect()
    t0 = time.monotonic()
    if fail_at_call < calls[fail_op]:
        with pytest.raises(JobFailedError) as info:
            env.execute(30)
        msg = str(info.value)
        assert f"operator {names[fail_op]!r}" in msg, msg
        assert f"injected failure in op{fail_op}" in msg
        assert isinstance(info.value.__cause__, Injected)
    else:
        env.execute(30)
        assert len(h.result) == n_out
    assert time.monotonic() - t0 < BOUND_S
    assert_stopped_and_clean(env, before)
