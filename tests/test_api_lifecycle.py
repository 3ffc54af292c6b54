"""The job API's contract around running a job: settings and declarations
checked before anything starts (output pools that could deadlock, source
parallelism, record kinds, max_record_size, timeouts, a busy Prometheus
port), an Environment that executes its graph once, metrics that are final
when execute() returns, and a warning when sink(fn) ran in a worker."""
from __future__ import annotations

import multiprocessing
import socket
import threading
import time
import warnings

import numpy as np
import pytest

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf.serializers import Serializer
from pipeline_helpers import cancel_and_join, held_sequence, wait_until_held, worker_processes_left

pytestmark = pytest.mark.timeout(120)

needs_fork = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")


def _pyflowbuf_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("pyflowbuf")}


def _no_new_threads(before: set, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not (_pyflowbuf_threads() - before):
            return True
        time.sleep(0.02)
    return not (_pyflowbuf_threads() - before)


def _no_children(timeout: float = 10.0) -> bool:
    return worker_processes_left(timeout) == []


# --------------------------------------------------------------------------- output pools


def _one_to_three_to_one(env, n=50_000):
    """The issue's job: a parallelism-1 source, an operator at the default
    parallelism 3 (a 1 -> 3 rebalance: one output pool of 3 subpartitions),
    and a rebalance() to a parallelism-1 sink (3 -> 1)."""
    return (env.from_collection(list(range(n)), name="numbers")
               .map(lambda x: x + 1, name="inc")
               .rebalance()
               .collect(parallelism=1, name="out"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("output_buffers", [(1, 1), (1, 2), (2, 2)])
def test_output_pool_max_below_its_subpartitions_is_refused_not_a_hang(output_buffers):
    before = _pyflowbuf_threads()
    env = fb.Environment(parallelism=3, segment_size=4096, output_buffers=output_buffers)
    _one_to_three_to_one(env)
    with pytest.raises(errors.ConfigurationError) as info:
        env.execute(timeout=10)         # before the fix: a deadlock until this timeout
    msg = str(info.value)
    assert "output_buffers" in msg and "'numbers'" in msg and "'inc'" in msg
    assert "3 subpartitions" in msg and "at least 3" in msg
    assert isinstance(info.value, ValueError)
    assert env.last_execution is None            # refused before anything started
    assert _no_new_threads(before)


@pytest.mark.timeout(60)
def test_three_to_one_rebalance_progresses_with_one_buffer_per_pool():
    """3 -> 1: each of the 3 producers has one subpartition, so (1, 1) is
    enough: a pool of max = subpartitions always progresses (the writer ships
    a full buffer before it asks for the next one)."""
    env = fb.Environment(parallelism=3, segment_size=4096, output_buffers=(1, 1))
    out = env.from_sequence(0, 30_000).rebalance().collect(parallelism=1)
    env.execute(timeout=30)
    assert sorted(out.result) == list(range(30_000))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("output_buffers", [(1, 3), (3, 3)])
def test_one_to_three_rebalance_with_max_equal_to_subpartitions_completes(output_buffers):
    env = fb.Environment(parallelism=3, segment_size=4096, output_buffers=output_buffers)
    out = _one_to_three_to_one(env, 30_000)
    env.execute(timeout=30)
    assert sorted(out.result) == list(range(1, 30_001))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_segments", [4, 5])
def test_output_pool_min_below_its_subpartitions_is_refused_when_pools_compete(num_segments):
    """With num_segments too small for every pool to reach its max, a pool
    only counts on its guaranteed min: a 1 -> 3 pool with min 1 deadlocks
    (observed with 4 and 5 segments), so min must cover the subpartitions."""
    env = fb.Environment(parallelism=3, segment_size=4096, output_buffers=(1, 3), num_segments=num_segments,
                         chaining=False)
    (env.from_sequence(0, 100_000, parallelism=1, name="src")
        .rebalance().map(lambda x: x, name="m").rebalance().collect(parallelism=1))
    with pytest.raises(errors.ConfigurationError) as info:
        env.execute(timeout=10)
    msg = str(info.value)
    assert "output_buffers" in msg and "min" in msg and "num_segments" in msg and "'src'" in msg


@pytest.mark.timeout(60)
def test_output_pool_min_below_subpartitions_is_fine_when_every_pool_reaches_its_max():
    env = fb.Environment(parallelism=3, segment_size=4096, output_buffers=(1, 3), chaining=False)
    out = (env.from_sequence(0, 30_000, parallelism=1)
              .rebalance().map(lambda x: x).rebalance().collect(parallelism=1))
    env.execute(timeout=30)
    assert sorted(out.result) == list(range(30_000))


@needs_fork
@pytest.mark.timeout(60)
def test_output_pool_check_runs_in_the_driver_before_workers_start():
    env = fb.Environment(workers=2, parallelism=2, segment_size=4096, output_buffers=(1, 1))
    env.from_sequence(0, 50_000, parallelism=1, name="src").rebalance().map(lambda x: x).collect(parallelism=1)
    with pytest.raises(errors.ConfigurationError, match="output_buffers"):
        env.execute(timeout=10)
    assert env.last_execution is None
    assert _no_children()


# --------------------------------------------------------------------------- source parallelism


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_source_parallelism_is_checked_when_declared(bad):
    env = fb.Environment(parallelism=2)
    with pytest.raises(errors.ConfigurationError, match="parallelism"):
        env.from_sequence(0, 10, parallelism=bad)
    assert env.nodes == []


@pytest.mark.parametrize("method", ["map", "flat_map", "filter", "collect", "sink", "write_text"])
@pytest.mark.parametrize("bad", [0, -1])
def test_operator_and_sink_parallelism_zero_is_refused(method, bad, tmp_path):
    env = fb.Environment(parallelism=2)
    s = env.from_sequence(0, 10)
    args = {"map": (lambda x: x,), "flat_map": (lambda x: [x],), "filter": (bool,),
            "collect": (), "sink": (print,), "write_text": (tmp_path / "o.txt",)}[method]
    with pytest.raises(ValueError, match="parallelism"):
        getattr(s, method)(*args, parallelism=bad)


def test_source_parallelism_none_means_the_default():
    env = fb.Environment(parallelism=2)
    s = env.from_sequence(0, 10)
    assert s.node.parallelism == 2


# --------------------------------------------------------------------------- kinds and settings


def _declarations(env):
    """Every API method taking kind=, as (name, call(kind))."""
    base = env.from_collection([1, 2, 3])
    keyed = base.key_by(lambda x: x % 2)
    return [
        ("from_iterable", lambda k: env.from_iterable([1, 2], kind=k)),
        ("from_collection", lambda k: env.from_collection([1, 2], kind=k)),
        ("from_generator", lambda k: env.from_generator(lambda: iter([1]), kind=k)),
        ("map", lambda k: base.map(lambda x: x, kind=k)),
        ("flat_map", lambda k: base.flat_map(lambda x: [x], kind=k)),
        ("map_batches", lambda k: base.map_batches(lambda b: b, kind=k)),
        ("reduce", lambda k: keyed.reduce(lambda a, b: a, kind=k)),
        ("process", lambda k: keyed.process(lambda key, x, st: [x], kind=k)),
    ]


@pytest.mark.parametrize("which", range(8))
@pytest.mark.parametrize("bad", ["no-such-kind", "Int64", ["int64"], np.int32, Serializer, 3])
def test_every_kind_argument_is_checked_when_declared(which, bad):
    env = fb.Environment()
    name, declare = _declarations(env)[which]
    n = len(env.nodes)
    with pytest.raises(errors.ConfigurationError, match="kind") as info:
        declare(bad)
    assert isinstance(info.value, ValueError)
    assert len(env.nodes) == n, name             # nothing was added to the graph
    if bad == "no-such-kind":
        assert "no-such-kind" in str(info.value) and "int64" in str(info.value)   # lists the known ones
    if bad is np.int32:
        assert "np.dtype" in str(info.value)


@pytest.mark.parametrize("good", [None, "int64", "float64", "str", "bytes", "pickle",
                                  np.dtype("int32"), Serializer()])
def test_valid_kinds_are_accepted(good):
    env = fb.Environment()
    for _, declare in _declarations(env):
        declare(good)


def test_misspelt_kind_in_an_all_chained_job_no_longer_goes_unnoticed():
    env = fb.Environment()          # everything chained into one task: nothing is serialized
    src = env.from_collection([1, 2, 3])
    with pytest.raises(errors.ConfigurationError, match="int46"):
        src.map(lambda x: x, kind="int46")


def test_max_record_size_smaller_than_a_fixed_width_kind_is_refused_when_declared():
    env = fb.Environment(max_record_size=4)
    with pytest.raises(errors.ConfigurationError, match="max_record_size"):
        env.from_sequence(0, 10)                # int64 records are 8 bytes
    src = env.from_collection([b"ab"])
    with pytest.raises(errors.ConfigurationError, match="max_record_size"):
        src.map(float, kind="float64")
    src.map(lambda b: b, kind="bytes")          # variable-size kinds may still fit


@pytest.mark.parametrize("dtype, param", [
    (np.dtype((np.void, 512)), "segment_size"),       # a row wider than a segment
    (np.dtype([("a", "i8"), ("o", object)]), "dtype"),  # pointers cannot travel as bytes
    (np.dtype([]), "dtype"),                          # zero-width rows
])
def test_rows_dtype_unusable_with_the_settings_is_refused_when_declared(dtype, param):
    env = fb.Environment(segment_size=256)
    with pytest.raises(errors.ConfigurationError, match=param):
        env.from_arrays([], dtype=dtype)
    src = env.from_arrays([np.zeros(3, "i8")])
    with pytest.raises(errors.ConfigurationError, match=param):
        src.map_batches(lambda a: a, kind=dtype)


def test_from_arrays_unknown_dtype_names_the_parameter():
    env = fb.Environment()
    with pytest.raises(errors.ConfigurationError, match="dtype"):
        env.from_arrays([], dtype="no-such-dtype")


@pytest.mark.parametrize("args, param", [
    ((0, 10, 0), "step"),
    ((0.5, 10), "start"),
    ((0, "10"), "stop"),
    ((0, 2**64), "stop"),           # kind int64: values must fit
    ((-2**64, 0), "start"),
])
def test_from_sequence_arguments_are_checked_when_declared(args, param):
    env = fb.Environment()
    with pytest.raises(errors.ConfigurationError, match=param):
        env.from_sequence(*args)


def test_settings_changed_after_construction_are_checked_before_anything_starts():
    before = _pyflowbuf_threads()
    env = fb.Environment()
    env.from_sequence(0, 10).collect()
    # a setting of a config object is checked as it is set (the object is replaced by a checked copy) ...
    with pytest.raises(errors.ConfigurationError, match="max_record_size"):
        env.max_record_size = 2**40
    assert env.max_record_size == 64 * 1024 * 1024
    # ... the plain ones, and settings that must agree, when the job is claimed
    env.max_batch = 0
    with pytest.raises(errors.ConfigurationError, match="max_batch"):
        env.execute()
    env.max_batch = 1024
    env.segment_size = 1024
    env.min_buffer_size = 512
    env.segment_size = 256
    with pytest.raises(errors.ConfigurationError, match="min_buffer_size"):
        env.execute()
    assert env.last_execution is None and _no_new_threads(before)


# --------------------------------------------------------------------------- final metrics


def _assert_final(metrics, summary, n, source="sequence", sink="collect"):
    assert metrics, "no metrics"
    assert {m["state"] for m in metrics.values()} == {"FINISHED"}, metrics
    src = [m for name, m in metrics.items() if name.startswith(source)]
    snk = [m for name, m in metrics.items() if name.startswith(sink)]
    assert src and snk, sorted(metrics)
    assert sum(m["records_out"] for m in src) == n
    assert sum(m["records_in"] for m in snk) == n
    for name, m in metrics.items():
        assert m["records_in"] == summary[name]["records_in"], name
        assert m["records_out"] == summary[name]["records_out"], name


def test_metrics_after_execute_are_final_when_the_job_ends_just_after_a_sample():
    """The job ends ~40 ms after the periodic sample at 0.4 s: before the fix
    the sampler skipped its final sample (the last one was under a quarter of
    an interval old), and env.metrics() showed RUNNING and partial counts."""
    n = 20_000
    for _ in range(4):
        first = []

        def sink(batch):
            if not first:
                first.append(time.monotonic())
            wait = first[0] + 0.43 - time.monotonic()
            if wait > 0:
                time.sleep(wait)

        env = fb.Environment(chaining=False, metrics_interval=0.4)
        env.from_sequence(0, n).map(lambda x: x).sink(sink, batched=True)
        env.execute(timeout=30)
        _assert_final(env.metrics(), env.last_execution.summary(), n, sink="sink")


@pytest.mark.parametrize("interval", [0.02, 0.05])
def test_metrics_after_execute_are_final_in_process(interval):
    n = 60_000
    for _ in range(6):
        env = fb.Environment(parallelism=2, chaining=False, metrics_interval=interval)
        env.from_sequence(0, n).map(lambda x: x).rebalance().collect(parallelism=1)
        env.execute(timeout=30)
        _assert_final(env.metrics(), env.last_execution.summary(), n)


def test_metrics_are_final_once_an_async_job_is_done_without_join():
    env = fb.Environment(chaining=False, metrics_interval=0.02)
    env.from_sequence(0, 30_000).map(lambda x: x).collect()
    job = env.execute_async()
    deadline = time.monotonic() + 30
    while not job.done and time.monotonic() < deadline:
        time.sleep(0.005)
    assert job.done
    _assert_final(env.metrics(), job.summary(), 30_000)
    job.join(10)


def test_metrics_after_execute_iter_are_final():
    env = fb.Environment(chaining=False, metrics_interval=0.02)
    it = env.from_sequence(0, 30_000).map(lambda x: x).to_iterator()
    assert sum(1 for _ in env.execute_iter(it)) == 30_000
    m = env.metrics()
    assert {v["state"] for v in m.values()} == {"FINISHED"}
    assert m["sequence (1/1)"]["records_out"] == 30_000


@needs_fork
def test_metrics_after_execute_are_final_with_workers():
    n = 40_000
    for _ in range(3):
        env = fb.Environment(workers=2, parallelism=2, metrics_interval=0.05, chaining=False)
        env.from_sequence(0, n).map(lambda x: x, kind="int64").rebalance().collect(parallelism=2)
        env.execute(timeout=60)
        m = env.metrics()
        assert len(m) == 6, sorted(m)            # every subtask of every vertex, from both workers
        _assert_final(m, env.last_execution.summary(), n)
    assert _no_children()


# --------------------------------------------------------------------------- execute() arguments


def test_execute_takes_a_job_name_as_pyflink_does():
    before = _pyflowbuf_threads()
    env = fb.Environment()
    out = env.from_sequence(0, 100).map(lambda x: x * 2).collect()
    env.execute("my job")
    assert out.result == [2 * x for x in range(100)]
    assert env.name == "my job"
    assert _no_new_threads(before)


def test_job_name_shows_in_failures():
    env = fb.Environment()
    env.from_sequence(0, 10).map(lambda x: 1 // 0, name="boom").collect()
    with pytest.raises(errors.JobFailedError, match="'named run'"):
        env.execute("named run", 30)


@pytest.mark.parametrize("call", [
    lambda env: env.execute(30),
    lambda env: env.execute(timeout=30),
    lambda env: env.execute(None),
    lambda env: env.execute("n", 30),
    lambda env: env.execute(job_name="n", timeout=30.5),
    lambda env: env.execute_async("n").join(30),
])
def test_execute_signatures(call):
    env = fb.Environment()
    out = env.from_sequence(0, 10).collect()
    call(env)
    assert out.result == list(range(10))


@pytest.mark.parametrize("args, kwargs", [
    ((-1,), {}),
    ((0,), {}),
    ((float("nan"),), {}),
    ((True,), {}),
    (("job", "30"), {}),
    ((), {"timeout": "30"}),
    ((30,), {"timeout": 30}),
    ((), {"job_name": b"name"}),
    ((), {"job_name": ""}),
])
def test_bad_execute_arguments_are_refused_before_anything_starts(args, kwargs):
    before = _pyflowbuf_threads()
    calls = []
    env = fb.Environment()
    env.from_sequence(0, 1000).sink(calls.append)
    with pytest.raises(errors.ConfigurationError) as info:
        env.execute(*args, **kwargs)
    assert "timeout" in str(info.value) or "job_name" in str(info.value)
    assert env.last_execution is None and calls == []
    assert _no_new_threads(before)
    env.execute(timeout=30)                      # nothing ran, so the environment is still unused
    assert len(calls) == 1000


# --------------------------------------------------------------------------- execute once


def test_second_execute_is_a_clear_error_and_runs_nothing():
    calls = []
    env = fb.Environment()
    env.from_sequence(0, 100).sink(calls.append)
    env.execute()
    first = env.last_execution
    with pytest.raises(errors.AlreadyExecutedError) as info:
        env.execute()
    assert isinstance(info.value, RuntimeError)
    assert "new Environment" in str(info.value)
    assert len(calls) == 100 and env.last_execution is first


def _run(env, how, handle=None):
    if how == "execute":
        env.execute(timeout=30)
    elif how == "execute_async":
        env.execute_async().join(30)
    else:
        return list(env.execute_iter(handle))


@pytest.mark.parametrize("first, second", [
    ("execute", "execute"), ("execute", "execute_async"),
    ("execute_async", "execute"), ("execute_async", "execute_async"),
    ("execute_iter", "execute_iter"),
])
def test_every_way_of_running_runs_the_graph_once(first, second):
    env = fb.Environment()
    s = env.from_sequence(0, 50)
    handle = s.to_iterator() if first == "execute_iter" else None
    out = None if handle else s.collect()
    got = _run(env, first, handle)
    with pytest.raises(errors.AlreadyExecutedError, match="new Environment"):
        _run(env, second, handle)
    assert (got if handle else out.result) == list(range(50))


def test_execute_async_refuses_an_iterator_sink_as_execute_does():
    env = fb.Environment()
    env.from_sequence(0, 50).to_iterator()
    with pytest.raises(ValueError, match="execute_iter"):
        env.execute_async()
    assert env.last_execution is None


def test_two_execute_async_calls_do_not_run_at_once():
    calls = []
    env = fb.Environment()
    env.from_sequence(0, 2000, rate_limit=20_000).sink(calls.append)
    job = env.execute_async()
    with pytest.raises(errors.AlreadyExecutedError):
        env.execute_async()
    job.join(30)
    assert sorted(calls) == list(range(2000))     # once, not twice


def test_execute_after_a_failed_run_is_refused_too():
    env = fb.Environment()
    env.from_sequence(0, 10).map(lambda x: 1 // 0).collect()
    with pytest.raises(errors.JobFailedError):
        env.execute(30)
    with pytest.raises(errors.AlreadyExecutedError):
        env.execute(30)


def test_concurrent_execute_calls_run_the_graph_once():
    calls = []
    env = fb.Environment()
    env.from_sequence(0, 500).sink(calls.append)
    outcomes = []
    barrier = threading.Barrier(4)

    def go():
        barrier.wait()
        try:
            env.execute(timeout=30)
            outcomes.append("ran")
        except errors.AlreadyExecutedError:
            outcomes.append("refused")

    threads = [threading.Thread(target=go) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes) == ["ran", "refused", "refused", "refused"]
    assert len(calls) == 500


# --------------------------------------------------------------------------- sink(fn) in workers


@needs_fork
def test_sink_function_in_workers_warns_that_its_side_effects_stay_there():
    seen = []
    env = fb.Environment(workers=2, parallelism=2)
    env.from_sequence(0, 1000, parallelism=1).map(lambda x: x, kind="int64").sink(seen.append, name="keep")
    with pytest.warns(errors.WorkerSideEffectWarning) as record:
        env.execute(timeout=60)
    assert seen == []                            # it ran in the workers' copies of the list
    assert len(record) == 1
    msg = str(record[0].message)
    assert "'keep'" in msg and "worker" in msg and "collect()" in msg
    assert record[0].filename == __file__        # attributed to the caller's line
    assert _no_children()


@needs_fork
def test_no_warning_for_workers_jobs_without_sink_functions():
    env = fb.Environment(workers=2, parallelism=2)
    out = env.from_sequence(0, 100, parallelism=1).map(lambda x: x, kind="int64").collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error", errors.WorkerSideEffectWarning)
        env.execute(timeout=60)
    assert sorted(out.result) == list(range(100))


def test_no_warning_for_sink_functions_in_process():
    seen = []
    env = fb.Environment(parallelism=2)
    env.from_sequence(0, 100).sink(seen.append)
    with warnings.catch_warnings():
        warnings.simplefilter("error", errors.WorkerSideEffectWarning)
        env.execute(timeout=30)
    assert sorted(seen) == list(range(100))


def test_workers_docstring_tells_about_sink_functions():
    doc = fb.Environment.__doc__
    workers = doc[doc.index("workers :"):]
    assert "sink(fn)" in workers[:1200] and "collect()" in workers[:1200]


# --------------------------------------------------------------------------- prometheus_port


@pytest.fixture
def busy_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


@pytest.mark.parametrize("workers", [None, pytest.param(2, marks=needs_fork)])
def test_busy_prometheus_port_is_a_clear_error_before_tasks_start(busy_port, workers):
    before = _pyflowbuf_threads()
    calls = []
    env = fb.Environment(prometheus_port=busy_port, workers=workers, parallelism=2)
    env.from_sequence(0, 100).sink(calls.append)
    with pytest.raises(errors.PortUnavailableError) as info:
        env.execute(timeout=30)
    assert isinstance(info.value, OSError) and info.value.errno is not None
    msg = str(info.value)
    assert "prometheus_port" in msg and str(busy_port) in msg
    assert calls == []
    assert _no_new_threads(before)
    assert _no_children()


@pytest.mark.parametrize("bad", [-1, 70000, "9249", 1.5, True])
def test_bad_prometheus_port_is_refused_by_the_environment(bad):
    with pytest.raises(errors.ConfigurationError, match="prometheus_port"):
        fb.Environment(prometheus_port=bad)


@needs_fork
def test_prometheus_with_workers_is_served_by_the_caller():
    import urllib.request
    from pyflowbuf import monitoring

    env = fb.Environment(workers=2, parallelism=2, prometheus_port=0, metrics_interval=0.05, name="wprom")
    env.from_sequence(0, None, parallelism=1, rate_limit=5000).map(lambda x: x, kind="int64").sink(
        lambda x: None, batched=True, parallelism=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", errors.WorkerSideEffectWarning)
        job = env.execute_async()
        try:
            exp = [x for x in job.sampler.listeners if isinstance(x, monitoring.PrometheusExporter)][0]
            # tasks of both workers, in one endpoint of the calling process
            want = [f'pyflowbuf_task_records_in{{job="wprom",task="{task}"'
                    for task in ("sequence (1/1)", "map -> sink (1/2)", "map -> sink (2/2)")]
            body = ""
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not all(w in body for w in want):
                with urllib.request.urlopen(exp.url, timeout=5) as resp:
                    body = resp.read().decode()
                time.sleep(0.05)
            for w in want:
                assert w in body, w
        finally:
            cancel_and_join(job)
    assert _no_children()


@needs_fork
@pytest.mark.parametrize("segment_size", [4096, 65536])
def test_workers_jobs_run_with_any_segment_size(segment_size):
    """The workers' servers announce the job's segment size: before, they
    announced 32 KiB whatever it was, and consumers refused smaller segments
    (producers refused larger ones)."""
    env = fb.Environment(workers=2, parallelism=2, segment_size=segment_size)
    out = env.from_sequence(0, 20_000, parallelism=1).rebalance().map(lambda x: x).collect(parallelism=1)
    env.execute(timeout=60)
    assert sorted(out.result) == list(range(20_000))
    assert _no_children()



def test_join_zero_asks_without_waiting(tmp_path):
    """``join(0)`` is ``Thread.join(0)``: on an ended job it returns, or raises
    the job's failure (it used to refuse 0 as a bad timeout, hiding the failure);
    on a running job it is a TimeoutError, which cancels it like every join timeout."""
    env = fb.Environment(parallelism=1)
    env.from_collection(list(range(10))).map(lambda x: x + 1).collect()
    job = env.execute_async()
    job.join()
    assert job.join(0) is job

    env = fb.Environment(parallelism=1)
    env.from_collection(list(range(10))).map(lambda x: 1 // (x - 5)).collect()
    job = env.execute_async()
    with pytest.raises(errors.JobFailedError):
        job.join()
    with pytest.raises(errors.JobFailedError, match="ZeroDivisionError"):
        job.join(0)

    env = fb.Environment(parallelism=1)
    release = str(tmp_path / "release")      # never created: the source holds
    held_sequence(env, 100, parallelism=1, rate_limit=None, hold_at=5, release=release).collect()
    job = env.execute_async()
    for bad in (-1, float("nan"), True, "0"):
        with pytest.raises(errors.ConfigurationError, match=">= 0"):
            job.join(bad)
    wait_until_held(release, 1, job=job)
    with pytest.raises(TimeoutError):
        job.join(0)
    assert job.done
