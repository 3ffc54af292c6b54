"""Pipelines across worker processes (Environment(workers=N))."""
import multiprocessing
import os
import signal
import threading
import time

import numpy as np
import pytest

import pyflowbuf as fb
from pyflowbuf import errors
from pipeline_helpers import worker_processes_left

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")]




def test_collect_across_workers_is_exactly_once():
    env = fb.Environment(workers=2, parallelism=2)
    out = env.from_sequence(0, 50_000, parallelism=1).map(lambda x: x * 2, name="double").collect(parallelism=1)
    env.execute(timeout=60)
    assert sorted(out.result) == [2 * i for i in range(50_000)]
    assert worker_processes_left() == []


@pytest.mark.parametrize("credit_based", [True, False])
def test_keyed_reduce_across_workers_matches_reference(credit_based):
    words = [f"w{i % 37}" for i in range(20_000)]
    env = fb.Environment(workers=2, parallelism=2, credit_based=credit_based)
    latest = (env.from_collection(words)
                 .map(lambda w: w + ",1", name="pair")
                 .key_by(lambda s: s.split(",")[0])
                 .reduce(lambda a, b: a.split(",")[0] + "," + str(int(a.split(",")[1]) + 1), kind="str")
                 .collect())
    env.execute(timeout=60)
    final = {}
    for rec in latest.result:
        k, c = rec.split(",")
        final[k] = max(final.get(k, 0), int(c))
    expected = {}
    for w in words:
        expected[w] = expected.get(w, 0) + 1
    assert final == expected


def test_iterator_sink_in_driver_preserves_order_from_one_producer():
    env = fb.Environment(workers=2)
    it = env.from_sequence(0, 30_000).map(lambda x: x + 1).to_iterator()
    assert list(env.execute_iter(it)) == list(range(1, 30_001))
    assert worker_processes_left() == []


def test_rows_stream_across_workers():
    arrays = [np.arange(i * 1000, (i + 1) * 1000, dtype=np.int64) for i in range(20)]
    env = fb.Environment(workers=2, parallelism=2)
    out = env.from_arrays(arrays).map_batches(lambda a: a * 3).collect(parallelism=1)
    env.execute(timeout=60)
    got = np.sort(np.concatenate(out.result))
    assert np.array_equal(got, np.arange(20_000, dtype=np.int64) * 3)


def test_inferred_kinds_travel_in_band():
    env = fb.Environment(workers=2, parallelism=2)
    out = env.from_sequence(0, 1000, parallelism=1).map(lambda x: f"v{x}").map(lambda s: s.upper()).collect()
    env.execute(timeout=60)
    assert sorted(out.result) == sorted(f"V{x}" for x in range(1000))


def test_failure_in_worker_names_operator_and_traceback():
    def bad(x):
        if x == 777:
            raise KeyError("boom in a worker")
        return x

    env = fb.Environment(workers=2, parallelism=2)
    env.from_sequence(0, 100_000, parallelism=1).map(bad, name="exploding-map").collect()
    t0 = time.monotonic()
    with pytest.raises(errors.JobFailedError) as info:
        env.execute(timeout=60)
    assert time.monotonic() - t0 < 30
    text = str(info.value)
    assert "exploding-map" in text and "boom in a worker" in text and "Traceback" in text
    assert worker_processes_left() == []


def test_pickle_streams_do_not_cross_processes_without_opt_in():
    # a set is not a struct record: these dicts are pickled
    env = fb.Environment(workers=2, parallelism=2)
    env.from_collection([{"a": {i}} for i in range(10)]).map(lambda d: d).collect()
    with pytest.raises(errors.JobFailedError, match="allow_pickle=True"):
        env.execute(timeout=60)

    env = fb.Environment(workers=2, parallelism=2, allow_pickle=True)
    out = env.from_collection([{"a": {i}} for i in range(10)]).map(lambda d: min(d["a"])).collect()
    env.execute(timeout=60)
    assert sorted(out.result) == list(range(10))


def test_inferred_pickle_is_refused_at_the_consumer():
    env = fb.Environment(workers=2, parallelism=2)
    # the map's output kind is only known from its first record: a tuple holding a set -> pickle
    env.from_sequence(0, 100, parallelism=1).map(lambda x: (x, {x})).collect(parallelism=1)
    with pytest.raises(errors.JobFailedError, match="allow_pickle"):
        env.execute(timeout=60)
    assert worker_processes_left() == []


def test_killed_worker_fails_the_job_in_bounded_time():
    def slow(x):
        time.sleep(0.001)
        return x

    env = fb.Environment(workers=2, parallelism=2)
    env.from_sequence(0, 10_000_000, parallelism=1).map(slow, name="slow").sink(lambda x: None)
    job = env.execute_async()
    time.sleep(1.0)
    os.kill(job.launcher.pids[1], signal.SIGKILL)      # (forked by the job's zygote)
    t0 = time.monotonic()
    with pytest.raises(errors.JobFailedError):
        job.join(timeout=60)
    assert time.monotonic() - t0 < 30
    assert worker_processes_left() == []


def test_cancel_stops_every_worker():
    env = fb.Environment(workers=2, parallelism=2)
    env.from_sequence(0, None, parallelism=1).map(lambda x: x).sink(lambda x: None)
    job = env.execute_async()
    time.sleep(0.5)
    job.cancel()
    job.join(timeout=30)
    assert worker_processes_left() == []


def test_workers_must_be_positive():
    with pytest.raises(ValueError, match="workers"):
        fb.Environment(workers=0)
