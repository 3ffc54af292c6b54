"""Every phase of a checkpoint, per subtask: in env.checkpoints(), the JSON
metrics log and Prometheus, for threads and for workers (issue 32)."""
from __future__ import annotations

import json
import multiprocessing
import time
import warnings

import pytest

import pyflowbuf as fb
from pyflowbuf import errors, monitoring
from pyflowbuf.checkpointing.snapshot import SnapshotWriter
from pipeline_helpers import wait_for

SUBTASK_KEYS = ("start_delay_ms", "alignment_ms", "inflight_wait_ms", "sync_ms", "write_queue_ms", "async_ms",
                "encode_ms", "write_ms", "ack_ms", "ack_received_ms", "ack_to_complete_ms", "bytes",
                "state_bytes", "inflight_bytes")
PHASE_KEYS = ("start_delay_ms", "alignment_ms", "sync_ms", "write_queue_ms", "async_ms", "last_ack_ms",
              "metadata_ms", "commits_ms", "completion_ms", "bytes", "inflight_bytes")
TOL_MS = 1.0        # rounding to µs, and wall-clock instants taken in two places


def _completed(env, n):
    done = [c for c in env.checkpoints() if c["status"] == "completed"]
    return done if len(done) >= n else None


def _run_until_checkpoints(tmp_path, alignment, workers=None, n=3, **kw):
    env = fb.Environment(chaining=False, checkpoint_interval=0.05, checkpoint_dir=tmp_path / "chk",
                         checkpoint_alignment=alignment, workers=workers, parallelism=1, **kw)

    def slow(batch):        # backpressure: the sink is slower than the source
        time.sleep(len(batch) / 50_000)

    (env.from_sequence(0, None, rate_limit=100_000)
        .map(lambda x: (x % 10, 1), kind="struct", name="pair")
        .key_by(lambda kv: kv[0]).reduce(lambda a, b: (a[0], a[1] + b[1]), name="count").uid("count")
        .sink(slow, batched=True, name="sink"))
    job = env.execute_async()
    try:
        done = wait_for(lambda: _completed(env, n), timeout=120)
    finally:
        job.cancel()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", errors.WorkerSideEffectWarning)
            try:
                job.join(60)
            except errors.JobFailedError:
                pass
    return env, done


def _check_entry(entry, *, unaligned):
    subs = entry["subtasks"]
    assert len(subs) == entry["tasks"] == 4
    for key, s in subs.items():
        for k in SUBTASK_KEYS:
            assert s[k] >= 0, (key, k, s)
        assert s["unaligned"] is unaligned
        assert s["fsync"] is True          # local storage syncs by default
        if unaligned:
            assert s["alignment_ms"] == 0
        else:
            assert s["inflight_wait_ms"] == 0 and s["inflight_bytes"] == 0
        # the phases follow each other: none reaches past the acknowledgement
        assert s["start_delay_ms"] + s["alignment_ms"] + s["sync_ms"] + s["write_queue_ms"] + s["async_ms"] \
            <= s["ack_ms"] + TOL_MS, (key, s)
        assert s["ack_ms"] <= s["ack_received_ms"] + TOL_MS
        assert abs(s["async_ms"] - s["encode_ms"] - s["write_ms"]) <= 0.01
        assert s["bytes"] >= s["state_bytes"] + s["inflight_bytes"]
    assert sum(s["source"] for s in subs.values()) == 1
    ph = entry["phases"]
    for k in PHASE_KEYS:
        assert ph[k] >= 0, (k, ph)
    src = next(s for s in subs.values() if s["source"])
    assert ph["trigger_to_source_ms"] == src["start_delay_ms"] <= ph["start_delay_ms"]
    assert ph["last_ack_ms"] == max(s["ack_received_ms"] for s in subs.values())
    assert ph["metadata_ms"] + ph["commits_ms"] <= ph["completion_ms"] + TOL_MS
    assert ph["unaligned_subtasks"] == (4 if unaligned else 0)
    assert ph["bytes"] == sum(s["bytes"] for s in subs.values())
    # the duration runs from the trigger to the metadata written
    assert ph["last_ack_ms"] <= entry["duration_s"] * 1000 + TOL_MS
    for s in subs.values():
        assert s["ack_received_ms"] + s["ack_to_complete_ms"] == pytest.approx(
            ph["last_ack_ms"] + ph["completion_ms"], abs=0.01)


@pytest.mark.parametrize("alignment", ["aligned", "unaligned"])
def test_phases_per_subtask_threads(tmp_path, alignment):
    log = tmp_path / "metrics.jsonl"
    env, done = _run_until_checkpoints(tmp_path, alignment, metrics_log=str(log), metrics_interval=0.1)
    for entry in done:
        _check_entry(entry, unaligned=alignment == "unaligned")
    if alignment == "unaligned":
        # the in-flight data the barriers overtook is counted where it was
        assert any(e["phases"]["inflight_bytes"] > 0 for e in done)
    else:
        assert any(s["alignment_ms"] > 0 for e in done for s in e["subtasks"].values())
    # the JSON log holds the same figures
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    logged = {x["checkpoint"]["id"]: x["checkpoint"] for x in lines if "checkpoint" in x}
    for entry in done:
        assert logged[entry["id"]]["subtasks"] == entry["subtasks"]
        assert logged[entry["id"]]["phases"] == entry["phases"]


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="workers need fork")
def test_phases_per_subtask_workers(tmp_path):
    """The workers' figures travel to the driver with their acknowledgements."""
    env, done = _run_until_checkpoints(tmp_path, "unaligned", workers=2)
    for entry in done:
        _check_entry(entry, unaligned=True)


def test_phases_in_prometheus():
    prom = pytest.importorskip("prometheus_client")
    exp = monitoring.PrometheusExporter(0, "job", registry=prom.CollectorRegistry(), serve=False)
    try:
        entry = {"id": 3, "status": "completed", "alignment": "unaligned", "alignment_ms": {},
                 "phases": {"start_delay_ms": 4.5, "sync_ms": 0.25, "completion_ms": 7.0, "bytes": 10},
                 "subtasks": {"v1-0": {"start_delay_ms": 4.5, "async_ms": 2.0, "source": False}}}
        exp.checkpoint(entry)
        get = exp.registry.get_sample_value
        assert get("pyflowbuf_checkpoint_last_phase_ms", {"job": "job", "phase": "start_delay"}) == 4.5
        assert get("pyflowbuf_checkpoint_last_phase_ms", {"job": "job", "phase": "completion"}) == 7.0
        assert get("pyflowbuf_checkpoint_subtask_phase_ms",
                   {"job": "job", "task": "v1-0", "phase": "async"}) == 2.0
    finally:
        exp.close()


def test_snapshot_writer_writes_in_parallel():
    """Subtasks' writes (each ending with an fsync) do not queue behind two
    threads: eight writes that each wait for all the others finish."""
    import threading
    writer = SnapshotWriter()
    barrier = threading.Barrier(8, timeout=10)
    passed = []
    try:
        for _ in range(8):
            assert writer.submit(lambda: passed.append(barrier.wait()))
    finally:
        writer.shutdown()
    assert len(passed) == 8
