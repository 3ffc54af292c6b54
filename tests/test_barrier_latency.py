"""Waits that are not data (issue 32): each pinned by counted events, not by
timings. An overtaking barrier is taken before the rest of a batch or a
buffer; a source blocked on its output answers a trigger; the coordinator
completes a checkpoint in the call that brings its last acknowledgement."""
from __future__ import annotations

import threading
import time
import warnings

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf.checkpoint.storage import CheckpointStorage
from pyflowbuf.checkpointing.coordinator import CheckpointCoordinator, CheckpointSettings
from pyflowbuf.runtime.task.input import BatchSizer


def _wait_for(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


def _stop(job):
    job.cancel()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", errors.WorkerSideEffectWarning)
        try:
            job.join(60)
        except errors.JobFailedError:
            pass


def _task(job, name):
    return next(t for t in job.tasks if t.vertex.name == name)


# ---- batch sizes ----
def test_batch_sizer_one_record_at_a_time_when_a_record_is_slow():
    s = BatchSizer(1024, target_ns=2_000_000)
    s.size = 1024
    s.observe(1024, 1024 * 3_000_000)        # 3 ms a record
    assert s.size == 1
    s.observe(1, 3_000_000)
    assert s.size == 1                        # and stays there


def test_batch_sizer_keeps_fast_chains_at_max_batch():
    s = BatchSizer(1024, target_ns=2_000_000)
    assert s.size == 1024
    for _ in range(5):
        s.observe(1024, 1024 * 1_000)         # 1 µs a record
    assert s.size == 1024


def test_batch_sizer_keeps_a_first_slow_call_batched():
    """The first batch of a function at 50 ms a call whatever its size (the
    debloat test's sink) shrinks the size once; the second shows the cost is
    per call, and the size goes back: 8 records a call, not 1."""
    s = BatchSizer(8, target_ns=2_000_000)
    s.observe(8, 50_000_000)
    assert s.size == 1
    s.observe(1, 50_000_000)
    assert s.size == 8 and s.floor == 8


def test_batch_sizer_does_not_drift_down_on_a_call_just_over_the_target():
    """A function at 2.06 ms a call whatever its batch (a sink sleeping 2 ms
    a call) with a 2 ms target: each shrink is a small step, and no single
    step shows the cost is per call; against the first slow size it does.
    Before: it drifted down to one record a call."""
    s = BatchSizer(1024, target_ns=2_000_000)
    for _ in range(200):
        s.observe(s.size, 2_060_000)
    assert s.size == 1024 and s.floor == 1024


def test_batch_sizer_grows_back_when_records_get_faster():
    s = BatchSizer(1024, target_ns=2_000_000)
    s.size = 1024
    s.observe(1024, 1024 * 100_000)           # 0.1 ms a record: 20 records fill the target
    assert s.size == 20
    for _ in range(10):
        s.observe(s.size, s.size * 100)     # 0.1 µs a record
    assert s.size == 1024


def test_batch_sizer_does_not_split_a_cost_per_call():
    """A function that costs the same per call whatever the batch (a round
    trip per batch) is not cut into batches of one: that only slows it."""
    s = BatchSizer(1024, target_ns=2_000_000)
    s.size = 1024
    s.observe(1024, 10_000_000)               # 10 ms a call
    smaller = s.size
    assert smaller < 1024
    s.observe(smaller, 10_000_000)            # still 10 ms: per call, not per record
    assert s.size == 1024 and s.floor == 1024
    s.observe(1024, 10_000_000)
    assert s.size == 1024


# ---- an overtaking barrier at a slow operator ----
def test_unaligned_barrier_overtakes_a_batch_in_progress(tmp_path):
    """A map at 3 ms a record under backpressure: the barrier of a checkpoint
    triggered from inside it reaches its input channel's priority lane while
    records of the batch (and of the buffer) it read are still to process.
    Counted: the records it starts after the barrier arrived and before it
    took the barrier. Before: the rest of its batch and buffer (hundreds)."""
    START = 50
    env = fb.Environment(chaining=False, checkpoint_interval=120, checkpoint_dir=tmp_path / "chk",
                         checkpoint_alignment="unaligned", parallelism=1)
    ref = {}
    seen = {"n": 0, "id": None, "after": 0, "arrived": False}
    done = threading.Event()

    def slow(x):
        time.sleep(0.003)
        seen["n"] += 1
        job = ref.get("job")
        if job is None or done.is_set():
            return x
        me = _task(job, "slow")
        if seen["id"] is None:
            if seen["n"] >= START and me.input_processor.sizer.size == 1:
                seen["id"] = job.coordinator.trigger()
            return x
        if me.checkpoints.last_checkpoint >= seen["id"]:
            done.set()
        elif seen["arrived"] or any(ch.priority_backlog for ch in me.input_processor.sides[0].gate.channels):
            # the barrier is in the priority lane (it overtook everything
            # queued), and this record is processed after it came
            seen["arrived"] = True
            seen["after"] += 1
        return x

    (env.from_sequence(0, None, rate_limit=2000)
        .map(slow, kind="int64", name="slow")
        .sink(lambda b: None, batched=True, name="sink"))
    job = env.execute_async()
    ref["job"] = job
    try:
        _wait_for(lambda: done.is_set() or job.failure is not None, timeout=120)
        assert job.failure is None, job.failure
    finally:
        _stop(job)
    assert seen["after"] <= 1, seen
    entry = next(c for c in env.checkpoints() if c["id"] == seen["id"])
    assert entry["status"] == "completed"


def test_blocked_source_answers_a_trigger(tmp_path):
    """A source whose output has no free buffer (its sink holds everything)
    injects the barrier of a trigger at once: its wait wakes on the mail.
    Counted: no record reached the sink between the trigger and the source's
    snapshot (no progress of data was needed)."""
    env = fb.Environment(chaining=False, checkpoint_interval=120, checkpoint_dir=tmp_path / "chk",
                         checkpoint_alignment="unaligned", parallelism=1, num_segments=64)
    release = threading.Event()
    consumed = [0]

    def held(batch):
        consumed[0] += len(batch)
        release.wait(120)

    env.from_sequence(0, None).sink(held, batched=True, name="sink")
    job = env.execute_async()
    try:
        src = _task(job, "sequence")
        # blocked: waiting for an output buffer while the sink holds its batch
        _wait_for(lambda: consumed[0] > 0 and src.mailbox.output_blocked(), timeout=60)
        before = consumed[0]
        n = job.coordinator.trigger()
        _wait_for(lambda: src.checkpoints.last_checkpoint >= n, timeout=30)
        assert consumed[0] == before
        assert src.mailbox.output_blocked()
    finally:
        release.set()
        _stop(job)


# ---- the coordinator ----
class _Execution:
    def __init__(self):
        self.triggered, self.completed = [], []

    def trigger_sources(self, n, options=None):
        self.triggered.append(n)

    def notify_complete(self, n):
        self.completed.append((n, threading.get_ident()))


def test_coordinator_completes_in_the_call_of_the_last_acknowledgement(tmp_path):
    """No loop polls for complete checkpoints: the last acknowledgement
    completes it (metadata, commits, the tasks told) before it returns, and
    the coordinator's periodic thread never ran (it was not started)."""
    storage = CheckpointStorage(tmp_path / "chk")
    coord = CheckpointCoordinator(CheckpointSettings(interval=3600, directory=str(tmp_path / "chk")), storage)
    ex = _Execution()
    keys = ["v0-0", "v1-0", "v2-0"]
    coord.attach(ex, keys)
    n = coord.trigger()
    assert ex.triggered == [n]
    for i, key in enumerate(keys):
        handle = storage.write_task_state(n, key, {"vertex": key, "operators": []})
        assert coord.checkpoints() == []            # nothing completes before the last one
        coord.acknowledge(key, n, handle, 0.0, [])
    assert [c["status"] for c in coord.checkpoints()] == ["completed"]
    assert ex.completed == [(n, threading.get_ident())]
    assert coord._thread is None
    assert storage.load_metadata(n).checkpoint_id == n
