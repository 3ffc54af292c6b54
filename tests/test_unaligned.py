"""Unaligned checkpoints and the alignment timeout: barriers that overtake
in-flight data, which the checkpoint then holds and a recovery replays.

The fault-injection tests are those of the aligned checkpoints
(test_checkpoints.py) in unaligned mode and with a small alignment timeout:
an exception at a random record of a random job, and the committed output and
final keyed state equal a run without failures. A slow last stage keeps
buffers queued, so barriers really overtake data and recoveries really replay
it (counted in INFLIGHT_RESTORES, checked at the end of the module).
"""
from __future__ import annotations

import collections
import multiprocessing
import os
import time
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf.checkpoint import CheckpointStorage
from pipeline_helpers import cancel_and_join
from test_checkpoints import FailOnce, KillWorkerOnce, check_exactly_once, check_kill_restarts, random_job

RESTORES = collections.Counter()
N = 6000


def slow_every(k, seconds):
    def fn(x):
        if x % k == 0:
            time.sleep(seconds)
        return x
    return fn


def modes():
    return st.sampled_from([dict(checkpoint_alignment="unaligned"),
                            dict(checkpoint_alignment="unaligned", alignment_timeout=0.005)])


def slow_job(env, n, stages, parallelism, fail, fail_stage, out_dir):
    """random_job of test_checkpoints with a slow stage before the keyed
    count: its input queues stay full, so barriers overtake data."""
    return random_job(env, n, stages, parallelism, fail, fail_stage, out_dir, None,
                      before_count=lambda s: s.rebalance().map(slow_every(25, 0.0005), parallelism=parallelism,
                                                               name="slow", kind="int64"))


def restored_inflight_bytes(env, directory):
    """In-flight bytes of the checkpoint the last attempt restored (0 if none)."""
    job = env.last_execution
    if job.restored_from is None:
        return 0
    for c in env.checkpoints():
        if c["id"] == job.restored_from:
            return c.get("inflight_bytes") or 0
    return 0


@given(parallelism=st.integers(1, 3),
       stages=st.lists(st.sampled_from(["forward", "rebalance", "key_by", "union"]), min_size=1, max_size=4),
       fail_stage=st.integers(0, 3), fail_at=st.integers(1000, N), chaining=st.booleans(), mode=modes())
def test_exactly_once_under_random_failures_unaligned(tmp_path_factory, parallelism, stages, fail_stage, fail_at,
                                                      chaining, mode):
    tmp = tmp_path_factory.mktemp("ua")
    n = N
    fail = FailOnce(fail_at)
    env = fb.Environment(checkpoint_interval=0.005, checkpoint_dir=tmp / "chk", restart_attempts=3,
                         chaining=chaining, segment_size=256, **mode)
    h = slow_job(env, n, stages, parallelism, fail, min(fail_stage, len(stages) - 1), tmp / "out")
    env.execute(120)
    assert fail.fired
    check_exactly_once(h, tmp / "out", n)
    assert env.last_execution.restarts == 1
    RESTORES["runs"] += 1
    if restored_inflight_bytes(env, tmp / "chk"):
        RESTORES["with_inflight"] += 1


def test_zz_recoveries_replayed_inflight_data():
    """The fault injection above is not vacuous: some recoveries restored a
    checkpoint that held in-flight data (runs after it, in file order)."""
    if RESTORES["runs"] < 20:
        pytest.skip("the fault-injection test did not run (or ran too few examples) in this session")
    assert RESTORES["with_inflight"] >= 1, dict(RESTORES)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="workers need fork")
@settings(max_examples=int(os.environ.get("PYFLOWBUF_WORKER_KILLS", "8")))
@given(stages=st.lists(st.sampled_from(["forward", "rebalance", "key_by", "union"]), min_size=1, max_size=3),
       fail_stage=st.integers(0, 2), kill_at=st.integers(200, 2500), mode=modes())
def test_exactly_once_when_a_worker_is_killed_unaligned(tmp_path_factory, stages, fail_stage, kill_at, mode):
    """Barriers cross TCP as priority events; in-flight output of the network
    senders and in-flight input of the receivers go into the checkpoint."""
    tmp = tmp_path_factory.mktemp("uakill")
    env = fb.Environment(workers=2, parallelism=2, checkpoint_interval=0.01, checkpoint_dir=tmp / "chk",
                         restart_attempts=3, segment_size=256, **mode)
    kill = KillWorkerOnce(tmp / "killed", kill_at)
    h = slow_job(env, N, stages, 2, kill, min(fail_stage, len(stages) - 1), tmp / "out")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", errors.WorkerSideEffectWarning)
        env.execute(180)
    if os.path.exists(tmp / "killed"):
        check_kill_restarts(env, "unaligned worker kill")
    check_exactly_once(h, tmp / "out", N)


def test_settings_are_validated(tmp_path):
    for kw, word in [(dict(checkpoint_alignment="sideways"), "checkpoint_alignment"),
                     (dict(checkpoint_alignment="aligned", alignment_timeout=1.0), "alignment_timeout"),
                     (dict(checkpoint_alignment="unaligned", alignment_timeout=-1), "alignment_timeout"),
                     (dict(checkpoint_alignment="unaligned", alignment_timeout="soon"), "alignment_timeout"),
                     (dict(checkpoint_alignment="unaligned", checkpointing_mode="at_least_once"), "exactly_once")]:
        with pytest.raises(errors.ConfigurationError, match=word):
            fb.Environment(checkpoint_interval=1, checkpoint_dir=tmp_path, **kw)


def backpressured_job(env, sink_rate=5_000):
    """A source 20x faster than its sink, until cancelled."""
    def slow_sink(batch):
        time.sleep(len(batch) / sink_rate)
    (env.from_sequence(0, None, rate_limit=sink_rate * 20)
        .map(lambda x: (x % 10, 1), kind="struct")
        .key_by(lambda kv: kv[0])
        .reduce(lambda a, b: (a[0], a[1] + b[1]))
        .sink(slow_sink, batched=True))


def run_for(env, seconds, completed=2, limit=60):
    """Run an endless job for ``seconds``, and on until ``completed``
    checkpoints have completed (a loaded machine is slow), then cancel it."""
    job = env.execute_async()
    start = time.monotonic()
    while not job.done:
        now = time.monotonic()
        done = sum(c["status"] == "completed" for c in env.checkpoints())
        if (now - start >= seconds and done >= completed) or now - start > limit:
            break
        time.sleep(0.05)
    cancel_and_join(job, failure_ok=True)
    return env.checkpoints()


@pytest.mark.parametrize("timeout", [None, 0.05])
def test_under_backpressure_checkpoints_overtake_and_hold_inflight_data(tmp_path, timeout):
    env = fb.Environment(chaining=False, checkpoint_interval=0.3, checkpoint_dir=tmp_path / "chk",
                         checkpoint_alignment="unaligned", alignment_timeout=timeout, segment_size=4096)
    backpressured_job(env)
    done = [c for c in run_for(env, 3.0) if c["status"] == "completed"]
    assert done, env.checkpoints()
    want = "unaligned" if timeout is None else "switched"
    assert {c["alignment"] for c in done} == {want}
    # the queues are full: every checkpoint holds what its barriers overtook
    assert all(c["inflight_bytes"] > 0 for c in done)
    assert all(sum(c["task_inflight_bytes"].values()) == c["inflight_bytes"] for c in done)
    storage = CheckpointStorage(str(tmp_path / "chk"))
    meta = storage.latest()
    assert meta.properties["alignment"] == want
    assert any(h.alignment == "unaligned" for h in meta.tasks.values())
    # bounded by the network memory (in-flight data is buffers of the pools)
    assert max(c["inflight_bytes"] for c in done) <= env.last_execution.network_pools[-1].total_bytes


def test_unaligned_checkpoints_reach_the_json_log_and_prometheus(tmp_path):
    import json
    log = tmp_path / "metrics.jsonl"
    env = fb.Environment(chaining=False, checkpoint_interval=0.3, checkpoint_dir=tmp_path / "chk",
                         checkpoint_alignment="unaligned", segment_size=4096, metrics_log=log, metrics_interval=0.2)
    backpressured_job(env)
    run_for(env, 2.0)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    entries = [x["checkpoint"] for x in lines if "checkpoint" in x and x["checkpoint"]["status"] == "completed"]
    assert entries and entries[-1]["alignment"] == "unaligned" and entries[-1]["inflight_bytes"] > 0
    assert entries[-1]["task_inflight_bytes"]

    pytest.importorskip("prometheus_client")
    from pyflowbuf.monitoring import PrometheusExporter

    exp = PrometheusExporter(0, "j", serve=False)
    exp.checkpoint(entries[-1])
    value = exp.registry.get_sample_value
    assert value("pyflowbuf_checkpoint_last_inflight_bytes", {"job": "j"}) == entries[-1]["inflight_bytes"]
    assert value("pyflowbuf_checkpoint_last_unaligned", {"job": "j"}) == 1
    exp.checkpoint(dict(entries[-1], alignment="switched", id=entries[-1]["id"] + 1))
    assert value("pyflowbuf_checkpoint_last_unaligned", {"job": "j"}) == 2


def test_restoring_inflight_data_into_another_parallelism_is_refused(tmp_path):
    env = fb.Environment(chaining=False, checkpoint_interval=0.3, checkpoint_dir=tmp_path / "chk",
                         checkpoint_alignment="unaligned", segment_size=4096)
    backpressured_job(env)
    assert [c for c in run_for(env, 1.5) if c["status"] == "completed"]
    env2 = fb.Environment(parallelism=2, chaining=False, checkpoint_interval=0.3, checkpoint_dir=tmp_path / "chk",
                          checkpoint_alignment="unaligned", segment_size=4096)
    backpressured_job(env2)
    with pytest.raises(errors.ConfigurationError, match="parallelism"):
        env2.execute(30, restore_from="latest")


def test_the_main_jobs_windows_step(tmp_path):
    """The main job's event-time step: windows over Parquet with unaligned
    checkpoints and a failure in the middle of open windows, exactly once."""
    from pyflowbuf.demo import windows_demo

    r = windows_demo(tmp_path, 5_000)
    assert r["exactly_once"] and r["restarts"] == 1 and r["windows"] > 0
    assert r["checkpoint_modes"] in ([], ["unaligned"])
