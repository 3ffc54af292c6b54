"""Checkpoints and recovery for jobs with ``Environment(workers=N)``: the
coordinator in the driver, barriers crossing TCP between workers, and
exactly-once state and output after an exception in a worker's operator or a
worker process killed outright."""
from __future__ import annotations

import collections
import glob
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import pyflowbuf as fb
from pipeline_helpers import HeldSequenceSource, read_parts, wait_for, worker_processes_left  # noqa: E402
from pyflowbuf.connectors.sources import SequenceSource
from pyflowbuf._core.memory import NetworkBufferPool
from pyflowbuf._core.channel import BufferQueue, InputGate
from pyflowbuf._core.serde import RecordReader, RecordWriter
from pyflowbuf._core.channel import BARRIER
from pyflowbuf.checkpoint import CheckpointStorage
from pyflowbuf.net import ConnectionManager, NetworkServer, new_secret

pytestmark = pytest.mark.timeout(60)

N_KEYS = 7


class HeldFromOne(HeldSequenceSource):
    """HeldSequenceSource over 1..n (``from_sequence(1, n + 1)``)."""

    def __init__(self, n, hold_at, release):
        SequenceSource.__init__(self, 1, n + 1, 1)
        self.hold_at, self.release = hold_at, release


def counting_job(env, n, out_dir, fail=None, where="stage", rate=20_000, hold=None):
    """records 1..n -> map -> keyed running count -> map -> collect and
    write_text; ``fail`` replaces the identity of the map ``where`` ("stage":
    before the count, "after": after it). With parallelism 2 over 2 workers
    the rebalance and the keyed exchange cross TCP both ways. ``hold``:
    ``(record, release file)``, the source holds there until the file exists
    (HeldSequenceSource)."""
    same = lambda x: x      # noqa: E731
    fail = fail or same
    if hold is None:
        s = env.from_sequence(1, n + 1, parallelism=1, rate_limit=rate)
    else:
        s = env._source("sequence", lambda: HeldFromOne(n, *hold), "int64", rate, 1)
    s = s.rebalance().map(fail if where == "stage" else same, parallelism=2, name="stage", kind="int64")
    counts = (s.map(lambda x: (x % N_KEYS, x), kind="struct")
               .key_by(lambda kv: kv[0])
               .reduce(lambda a, b: (a[0], a[1] + b[1]), parallelism=2, name="count")
               .map(fail if where == "after" else same, parallelism=2, name="after", kind="struct"))
    handle = counts.collect(parallelism=2)
    counts.map(lambda kv: f"{kv[0]},{kv[1]}", kind="str").write_text(str(out_dir), parallelism=2)
    return handle


def check_lines(lines, n):
    """Running counts (key, sum so far) of records 1..n, as a run without failure
    writes them: one line per record (none lost, none twice) and the final sum
    per key. The order records of one key arrive in depends on the two map
    subtasks, so the intermediate sums may differ between runs."""
    pairs = [tuple(int(v) for v in line.split(",")) for line in lines]
    assert collections.Counter(k for k, _ in pairs) == collections.Counter(x % N_KEYS for x in range(1, n + 1))
    sums = collections.defaultdict(int)
    for x in range(1, n + 1):
        sums[x % N_KEYS] += x
    final = {}
    for k, total in pairs:
        final[k] = max(final.get(k, -1), total)
    assert final == dict(sums)
    # a key's running sums strictly increase (every record is > 0): a replayed
    # record would repeat a sum
    for k in sums:
        mine = [t for kk, t in pairs if kk == k]
        assert len(set(mine)) == len(mine)


def check_exactly_once(handle, out_dir, n):
    collected = [f"{k},{v}" for k, v in handle.result]
    check_lines(collected, n)
    assert sorted(read_parts(out_dir)) == sorted(collected)
    assert not [f for f in os.listdir(out_dir) if f.startswith(".")]    # nothing uncommitted left


class FailInWorker:
    """Raises once, from the ``at``-th record a worker's copy sees on, as soon
    as a checkpoint in ``chk`` is complete (so the recovery restores one); a
    marker file (the workers are separate processes) keeps it from firing
    again after the restart. ``kill``: the worker process dies at once."""

    def __init__(self, marker, at, chk=None, kill=False):
        self.marker, self.at, self.chk, self.kill = str(marker), at, chk, kill
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        if self.calls >= self.at and self.calls % 25 == 0:
            if self.chk is not None and not glob.glob(os.path.join(self.chk, "chk-*", "_metadata")):
                return x
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return x        # fired before (in the other worker, or an earlier attempt)
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure at record {self.calls} of pid {os.getpid()}")
        return x


def test_checkpoints_complete_with_workers(tmp_path):
    env = fb.Environment(workers=2, checkpoint_interval=0.05, checkpoint_dir=tmp_path / "chk", chaining=False)
    h = counting_job(env, 6000, tmp_path / "out")
    env.execute(timeout=40)
    check_exactly_once(h, tmp_path / "out", 6000)
    done = [c for c in env.checkpoints() if c["status"] == "completed"]
    assert done, env.checkpoints()
    c = done[-1]
    assert c["acknowledged"] == c["tasks"] and c["state_bytes"] > 0
    # every task of both workers took part: alignment times of tasks in either worker
    assert len(c["alignment_ms"]) == c["tasks"]
    assert CheckpointStorage(str(tmp_path / "chk")).latest() is not None
    assert env.last_execution.restarts == 0


@pytest.mark.parametrize("where", ["stage", "after"])
def test_an_exception_in_a_worker_is_recovered_exactly_once(tmp_path, where):
    fail = FailInWorker(tmp_path / "fired", at=500, chk=tmp_path / "chk")
    env = fb.Environment(workers=2, checkpoint_interval=0.05, checkpoint_dir=tmp_path / "chk",
                         restart_attempts=2, chaining=False)
    h = counting_job(env, 10_000, tmp_path / "out", fail=fail, where=where, rate=15_000,
                     hold=(6000, str(tmp_path / "release")))
    # the failure needs a completed checkpoint before it; the source holds
    # (checkpoints go on) until one has, however slow the machine (ASan)
    job = env.execute_async()
    wait_for(lambda: any(c["status"] == "completed" for c in env.checkpoints()) or job.done, "a checkpoint")
    (tmp_path / "release").touch()
    job.join(timeout=120)
    ex = env.last_execution
    assert os.path.exists(tmp_path / "fired"), (ex.restarts, env.checkpoints()[:3], h.result[:3])
    assert ex.restarts == 1 and "injected failure" in ex.restart_failures[0][2]
    assert ex.restored_from is not None           # from a checkpoint, not from the start
    check_exactly_once(h, tmp_path / "out", 10_000)


@pytest.mark.parametrize("where", ["stage", "after"])
def test_a_killed_worker_process_is_recovered_exactly_once(tmp_path, where):
    kill = FailInWorker(tmp_path / "killed", at=500, chk=tmp_path / "chk", kill=True)
    env = fb.Environment(workers=2, checkpoint_interval=0.05, checkpoint_dir=tmp_path / "chk",
                         restart_attempts=2, chaining=False)
    h = counting_job(env, 10_000, tmp_path / "out", fail=kill, where=where, rate=15_000,
                     hold=(6000, str(tmp_path / "release")))
    # the failure needs a completed checkpoint before it; the source holds
    # (checkpoints go on) until one has, however slow the machine (ASan)
    job = env.execute_async()
    wait_for(lambda: any(c["status"] == "completed" for c in env.checkpoints()) or job.done, "a checkpoint")
    (tmp_path / "release").touch()
    job.join(timeout=120)
    assert os.path.exists(tmp_path / "killed")
    ex = env.last_execution
    assert ex.restarts == 1
    assert any("exited unexpectedly" in f[2] for f in ex.restart_failures), ex.restart_failures
    assert ex.restored_from is not None
    check_exactly_once(h, tmp_path / "out", 10_000)


def test_without_restart_attempts_a_worker_failure_fails_the_job(tmp_path):
    env = fb.Environment(workers=2, checkpoint_interval=0.05, checkpoint_dir=tmp_path / "chk", chaining=False)
    counting_job(env, 4000, tmp_path / "out", fail=FailInWorker(tmp_path / "fired", at=300))
    with pytest.raises(fb.errors.JobFailedError, match="injected failure"):
        env.execute(timeout=40)


def test_restart_attempts_with_workers_are_limited(tmp_path):
    def always(x):
        if x == 300:
            raise ValueError("always fails at 300")
        return x
    env = fb.Environment(workers=2, checkpoint_interval=0.05, checkpoint_dir=tmp_path / "chk",
                         restart_attempts=2, chaining=False)
    counting_job(env, 4000, tmp_path / "out", fail=always)
    with pytest.raises(fb.errors.JobFailedError, match="always fails at 300"):
        env.execute(timeout=40)
    assert env.last_execution.restarts == 2
    assert worker_processes_left() == []


def segfault_at(k):
    def fn(x):
        if x == k:
            import ctypes
            ctypes.string_at(0)     # a real SIGSEGV in the worker
        return x
    return fn


def test_a_worker_killed_by_a_signal_is_reported_with_the_signal_and_its_stacks(tmp_path):
    """A crashed worker was reported as "exited unexpectedly (exit code None)":
    the pipe closes before the process is reaped. Now the driver waits for
    the status, names the signal and adds the worker's faulthandler output."""
    env = fb.Environment(workers=2, chaining=False)
    counting_job(env, 4000, tmp_path / "out", fail=segfault_at(1000))
    with pytest.raises(fb.errors.JobFailedError) as info:
        env.execute(timeout=40)
    msg = str(info.value)
    assert "killed by SIGSEGV (exit code -11)" in msg, msg
    assert "Segmentation fault" in msg and "in fn" in msg, msg      # faulthandler: the crashing frame
    assert worker_processes_left() == []


def test_a_worker_that_dies_before_the_job_starts_is_reported_with_its_signal(tmp_path, monkeypatch):
    """A worker gone before "go" failed the start (or a restart) with a bare
    EOFError or BrokenPipeError; now the error says which worker and how it died."""
    from pyflowbuf.cluster import driver as cluster

    monkeypatch.setattr(cluster, "_worker_main", lambda *args: os.kill(os.getpid(), signal.SIGKILL))
    env = fb.Environment(workers=2, chaining=False)
    counting_job(env, 100, tmp_path / "out")
    with pytest.raises(fb.errors.FlowBufError,
                       match=r"worker 0 exited unexpectedly: killed by SIGKILL \(exit code -9\), before the job"):
        env.execute(timeout=40)
    assert worker_processes_left() == []


def test_a_peer_lost_while_a_worker_starts_is_not_the_reason_of_the_failure(tmp_path, monkeypatch):
    """Worker 1 cannot reach worker 0 while it starts (worker 0 is dying):
    that ConnectionLostError follows worker 0's death and must not stand for
    the job's failure (or a restart's reason) in its place."""
    from pyflowbuf.cluster import driver as cluster

    start_share = cluster.JobExecution.start

    def start(self):
        if self.remote is None:
            return start_share(self)        # the driver's own execution (the same class) starts as ever
        if self.me == 0:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        raise fb.errors.ConnectionLostError("the peer closed the connection")

    monkeypatch.setattr(cluster.JobExecution, "start", start)
    env = fb.Environment(workers=2, chaining=False)
    counting_job(env, 100, tmp_path / "out")
    with pytest.raises(fb.errors.JobFailedError, match=r"worker 0 exited unexpectedly: killed by SIGKILL"):
        env.execute(timeout=40)


def test_messages_and_failures_of_an_earlier_attempt_are_ignored(tmp_path):
    """Fencing: after a restart (attempt 1) a late word of attempt 0 (its
    failure, its pipe closing) starts nothing; the same word of attempt 1 does."""
    from pyflowbuf.cluster.driver import ClusterExecution

    env = fb.Environment(workers=2, checkpoint_interval=0.05, checkpoint_dir=tmp_path / "chk",
                         restart_attempts=2, chaining=False)
    counting_job(env, 100, tmp_path / "out")
    ex = ClusterExecution(env.job_spec())
    ex.attempt = 1
    late = ("failed", "worker 1", "remote exchange", "ConnectionLostError: connection lost: Broken pipe", "", True)
    ex.launcher._handle(1, late, 0)
    ex.subtask_failed("worker 0", "worker process", "worker 0 exited unexpectedly", "", secondary=False, attempt=0)
    assert ex.failure is None and not ex.cancelled
    ex.launcher._handle(1, late, 1)
    assert ex.failure is not None and "Broken pipe" in ex.failure[2] and ex.cancelled


class _Execution:
    """What the coordinator tells an attempt, recorded."""

    def __init__(self):
        self.told = []

    def trigger_sources(self, n):
        self.told.append(("trigger", n))

    def notify_complete(self, n):
        self.told.append(("complete", n))

    def abort_checkpoint(self, n):
        self.told.append(("abort", n))


def _coordinator(tmp_path, storage_cls=CheckpointStorage):
    from pyflowbuf import checkpointing as ckpt

    env = fb.Environment(checkpoint_interval=60, checkpoint_dir=tmp_path / "chk")
    config = ckpt.CheckpointSettings.from_env(env)
    return ckpt.CheckpointCoordinator(config, storage_cls(str(tmp_path / "chk")))


def test_a_trigger_decided_before_a_restart_does_not_reach_the_restarted_attempt(tmp_path):
    """The coordinator thread picks checkpoint n for attempt 0, writes the
    final states of finished tasks, then tells the execution; a restart
    (detach, abort_all, new workers) in between got that trigger sent to the
    new workers: one told "trigger" before "go" quit, and the restart failed
    with BrokenPipeError (seen once in 600 kill runs)."""
    writing, go_on = threading.Event(), threading.Event()

    class SlowStorage(CheckpointStorage):
        def write_task_state(self, *args, **kwargs):
            writing.set()
            go_on.wait(10)
            return super().write_task_state(*args, **kwargs)

    c = _coordinator(tmp_path, SlowStorage)
    ex = _Execution()                 # the same object across attempts, as ClusterExecution is
    c.attach(ex, ["a", "b"], finished={"b": ({"finished": True}, [])})
    t = threading.Thread(target=c.trigger)
    t.start()
    assert writing.wait(10)           # n is chosen; the final state of "b" is being written
    c.attach(None, ["a", "b"])        # the restart detaches the stopped attempt ...
    c.abort_all("restarting")
    c.attach(ex, ["a", "b"])          # ... and attaches the new one
    go_on.set()
    t.join(10)
    assert ex.told == [] and not c.pending


def test_a_completion_under_way_when_a_restart_detaches_is_finished_first(tmp_path):
    """A restart reads the latest checkpoint right after detaching: a
    completion already under way must be on disk by then (or not happen), or
    the restart restores an older one while the newer one's sink commits run."""
    completing, go_on = threading.Event(), threading.Event()
    order = []

    class SlowStorage(CheckpointStorage):
        def complete(self, *args, **kwargs):
            completing.set()
            go_on.wait(10)
            meta = super().complete(*args, **kwargs)
            order.append("completed")
            return meta

    c = _coordinator(tmp_path, SlowStorage)
    ex = _Execution()
    c.attach(ex, ["a"])
    n = c.trigger()
    handle = c.storage.write_task_state(n, "a", {"x": 1})
    acker = threading.Thread(target=c.acknowledge, args=("a", n, handle, 0.0, []))
    acker.start()
    assert completing.wait(10)
    started = threading.Event()

    def detach():
        started.set()
        c.attach(None, ["a"])
        order.append("detached")

    restart = threading.Thread(target=detach)
    restart.start()
    assert started.wait(10)
    restart.join(0.5)                 # with the fence it waits for the completion
    go_on.set()
    acker.join(10)
    restart.join(10)
    assert order == ["completed", "detached"], order
    assert c.storage.latest().checkpoint_id == n and ex.told == [("trigger", n), ("complete", n)]


def test_a_connection_of_another_attempt_is_refused():
    """Workers of attempt n authenticate with the job's secret bound to n:
    a client of another attempt cannot request (or receive) anything."""
    from pyflowbuf.cluster.driver import attempt_secret

    secret = new_secret()
    nbp = NetworkBufferPool(64, 4096)
    with NetworkServer(attempt_secret(secret, 1), max_buffer_size=4096) as srv:
        q = BufferQueue(nbp)
        srv.export("p", 0, q, kind="bytes")
        for attempt, ok in ((0, False), (1, True)):
            mgr = ConnectionManager(attempt_secret(secret, attempt))
            try:
                excl, fl = mgr.create_input_pools(nbp, 1, 2, 2)
                rq = BufferQueue(nbp)
                if ok:
                    ch = mgr.create_channel(srv.address, "p", 0, rq, excl[0], fl, kind="bytes")
                    ch.cancel()
                else:
                    with pytest.raises(fb.errors.AuthenticationError):
                        mgr.create_channel(srv.address, "p", 0, rq, excl[0], fl, kind="bytes")
            finally:
                mgr.close()
    assert attempt_secret(secret, 0) != attempt_secret(secret, 1) != secret


def test_a_barrier_leaving_a_network_sender_after_the_job_stopped_is_declined_not_raised():
    """A subtask's checkpoint waits for the network sender's word on what the
    barrier overtook; the job stops (a failure, a restart) and shuts its
    snapshot writer down; then the sender thread passes the barrier. That
    raised RuntimeError (cannot schedule new futures after shutdown) in the
    network thread; now the checkpoint is declined and nothing is written."""
    from types import SimpleNamespace

    from pyflowbuf import checkpointing as ckpt

    declined = []
    coordinator = SimpleNamespace(decline=lambda key, n, reason: declined.append((key, n, reason)),
                                  config=SimpleNamespace(switchable=False))
    out = SimpleNamespace(remote=(True,), kind_name=None, overtaken_listener=None)
    task = SimpleNamespace(vertex=SimpleNamespace(id=3, name="v"), index=0, outputs=[out], operators=[], source=None)
    writer = ckpt.new_writer()
    tc = ckpt.SubtaskCheckpoints(task, [])
    tc.attach(coordinator, writer)
    tc.snapshot_unaligned(5, {}, "unaligned")      # waits for out/0/0's word
    writer.shutdown(wait=True)
    errs = []
    t = threading.Thread(target=lambda: _catching(errs, out.overtaken_listener, 5, 0, []))
    t.start()                                       # the sender thread, late
    t.join(10)
    assert errs == []
    assert [(k, n) for k, n, _ in declined] == [("v3-0", 5)] and "stopped" in declined[0][2]


def _catching(errs, fn, *args):
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - the test reports it
        errs.append(exc)


def test_cancel_of_a_checkpointed_job_with_workers_restarts_nothing(tmp_path):
    env = fb.Environment(workers=2, checkpoint_interval=0.05, checkpoint_dir=tmp_path / "chk",
                         restart_attempts=3, chaining=False)
    counting_job(env, 10_000_000, tmp_path / "out", rate=20_000)
    job = env.execute_async()
    deadline = time.monotonic() + 60    # a loaded (or sanitized) machine takes its time
    while not [c for c in env.checkpoints() if c["status"] == "completed"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [c for c in env.checkpoints() if c["status"] == "completed"], "no checkpoint completed in 60 s"
    job.cancel()
    job.join(timeout=30)
    assert job.restarts == 0
    assert worker_processes_left() == []


def test_a_source_that_cannot_rewind_is_refused_before_any_worker_starts(tmp_path):
    env = fb.Environment(workers=2, checkpoint_interval=0.05, checkpoint_dir=tmp_path / "chk")
    env.from_iterable(iter(range(10))).map(lambda x: x, parallelism=2).collect()
    with pytest.raises(fb.errors.ConfigurationError, match="cannot rewind"):
        env.execute(timeout=20)
    assert worker_processes_left() == []


RESUME = textwrap.dedent("""
    import glob, os, sys, time
    import pyflowbuf as fb
    from pyflowbuf.connectors.sources import SequenceSource
    chk, out, marker = sys.argv[1], sys.argv[2], sys.argv[3]
    checkpointed = lambda: glob.glob(os.path.join(chk, "chk-*", "_metadata"))
    class HeldUntilCheckpoint(SequenceSource):
        # from_sequence(1, 6001)'s source; in the first run it holds at 3000
        # (checkpoints go on) until one completed, however slow the machine
        def next_batch(self, max_records):
            if marker != "-" and self._ranges is None and not checkpointed():
                if self.next_value >= 3000:
                    time.sleep(0.01)
                    return []
                max_records = min(max_records, 3000 - self.next_value)
            return super().next_batch(max_records)
    driver = os.getpid()        # (a worker's parent is the job's zygote)
    calls = [0]
    def maybe_die(x):
        calls[0] += 1
        # once a checkpoint is complete (its metadata written), and only once
        if marker != "-" and calls[0] >= 1000 and calls[0] % 50 == 0 and checkpointed():
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return x
            os.kill(driver, 9)     # the driver dies; its zygote and workers die with it
            os._exit(17)
        return x
    env = fb.Environment(workers=2, checkpoint_interval=0.05, checkpoint_dir=chk, chaining=False)
    s = (env._source("sequence", lambda: HeldUntilCheckpoint(1, 6001), "int64", 20000, 1).rebalance()
            .map(maybe_die, parallelism=2, kind="int64")
            .map(lambda x: (x % 7, x), kind="struct")
            .key_by(lambda kv: kv[0])
            .reduce(lambda a, b: (a[0], a[1] + b[1]), parallelism=2))
    s.map(lambda kv: f"{kv[0]},{kv[1]}", kind="str").write_text(out, parallelism=2)
    h = s.collect(parallelism=2)
    env.execute(timeout=40, restore_from="latest")
    print("restored from", env.last_execution.restored_from)
    print("collected", len(h.result))
""")


def test_a_new_process_resumes_a_job_with_workers_from_its_checkpoint_dir(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(RESUME)
    chk, out, marker = str(tmp_path / "chk"), str(tmp_path / "out"), str(tmp_path / "died")
    run = lambda m: subprocess.run([sys.executable, str(script), chk, out, m],  # noqa: E731
                                   capture_output=True, text=True, timeout=50)
    first = run(marker)
    assert first.returncode == -signal.SIGKILL, (first.stdout, first.stderr)
    latest = CheckpointStorage(chk).latest()
    assert latest is not None
    second = run("-")
    assert second.returncode == 0, second.stderr
    assert f"restored from {latest.checkpoint_id}" in second.stdout
    # collect() holds what this run added after the checkpoint (as for a job in one process)
    assert 0 < int(second.stdout.split("collected ")[1]) < 6000
    check_lines(read_parts(out), 6000)


# ---------------------------------------------------------------- barriers over TCP

def test_barriers_cross_tcp_in_order_and_a_blocked_channel_holds_back_only_itself():
    """Two producers feed one InputGate over TCP. Barriers arrive in order with
    the records around them (events cost no credit). Blocking channel 0, as
    alignment does, stops its data at the credit it had: nothing of it is
    read, no new credit is announced, and channel 1 still delivers everything."""
    secret = new_secret()
    nbp = NetworkBufferPool(256, 4096)
    server = NetworkServer(secret, max_buffer_size=4096)
    server.start()
    manager = ConnectionManager(secret)
    try:
        writers = []
        for p in range(2):
            q = BufferQueue(nbp)
            server.export("p", p, q, kind="int64")
            writers.append(RecordWriter(nbp.create_pool(8, 8), [q], kind="int64", request_timeout=30))
        excl, floating = manager.create_input_pools(nbp, 2, 2, 2)
        queues = [BufferQueue(nbp) for _ in range(2)]
        gate = InputGate(queues)
        chans = []
        for p in range(2):
            ch = manager.create_channel(server.address, "p", p, queues[p], excl[p], floating, kind="int64")
            ch.attach_gate(gate)
            chans.append(ch)
        reader = RecordReader(gate, kind="int64")

        # channel 0: records 0..99, barrier 1, then far more than its credit covers
        writers[0].write_batch(list(range(100)))
        writers[0].broadcast_event(BARRIER, 1)
        big = list(range(100, 100 + 20_000))
        done0 = threading.Event()

        def produce0():
            writers[0].write_batch(big)
            writers[0].end_input()
            done0.set()
        t0 = threading.Thread(target=produce0, daemon=True)

        got = {0: [], 1: []}
        deadline = time.monotonic() + 20
        # read up to channel 0's barrier, then block channel 0 (alignment)
        while True:
            assert time.monotonic() < deadline
            batch = reader.read_batch(1000, timeout=0.2)
            got[0] += batch
            ev = reader.take_event()
            if ev is not None:
                assert ev[:3] == (0, BARRIER, 1)
                break
        assert got[0] == list(range(100))          # every record before the barrier, none after
        gate.block(0)
        t0.start()
        # channel 1 delivers everything while channel 0 is blocked
        def produce1():
            writers[1].write_batch(list(range(5000)))
            writers[1].broadcast_event(BARRIER, 1)
            writers[1].write_batch(list(range(5000, 6000)))
            writers[1].end_input()
        threading.Thread(target=produce1, daemon=True).start()
        events = []
        while len(got[1]) < 6000:
            assert time.monotonic() < deadline, len(got[1])
            got[1] += reader.read_batch(1000, timeout=0.2)
            ev = reader.take_event()
            if ev is not None:
                events.append((ev[:3], len(got[1])))
        assert got[1] == list(range(6000))
        assert events == [((1, BARRIER, 1), 5000)]
        # channel 0 is held back at the credit it had: nothing more arrives, its producer waits
        held = chans[0].credit.buffers_received
        time.sleep(0.3)
        assert chans[0].credit.buffers_received == held < 10     # of about 40 buffers it has to send
        assert not done0.is_set()
        gate.resume(0)
        while not reader.finished:
            assert time.monotonic() < deadline
            got[0] += reader.read_batch(1000, timeout=0.2)
            reader.take_event()
        assert got[0] == list(range(100)) + big
        assert done0.wait(5)
    finally:
        manager.close()
        server.close()


def test_a_restore_in_which_a_branch_had_finished_reads_its_ends(tmp_path):
    """A checkpoint taken after one branch of the job had ended holds that
    branch's subtasks as finished. Restored with workers, they read their
    producers' end of partition (over TCP where the exchange crosses workers)
    instead of ending without reading it: the producer's worker waited for
    its output to be consumed until the drain timeout (the execute timeout
    here), or failed with "the consumer closed the connection"."""
    from pyflowbuf import checkpointing as ckpt

    chk = tmp_path / "chk"

    def job(workers=2):
        env = fb.Environment(parallelism=2, workers=workers, checkpoint_interval=0.05, checkpoint_dir=str(chk),
                             checkpoints_retained=1000)
        fast = env.from_sequence(0, 50, parallelism=2).rebalance().map(lambda x: x, name="fast")
        slow = env.from_sequence(1000, 4000, rate_limit=5000, parallelism=2).map(lambda x: x, name="slow")
        return env, fast.union(slow).collect()

    env, out = job()
    env.execute(60)
    assert sorted(out.result) == list(range(50)) + list(range(1000, 4000))
    # the newest checkpoint in which one branch had finished and the other not
    # (not simply the latest: a slow machine may take one after both ended)
    storage = CheckpointStorage(str(chk), retained=1000)
    partial = None
    for meta in reversed(storage.list_complete()):
        finished = [s.get("finished", False) for s in ckpt.read_states(storage, meta).values()]
        if any(finished) and not all(finished):
            partial = meta.checkpoint_id
            break
    assert partial is not None, "no checkpoint had one branch finished and the other running: the case is not built"
    for _ in range(3):          # a race made it fail now and then: a few restores
        env, out = job()
        env.execute(30, restore_from=partial)
        assert set(out.result) <= set(range(1000, 4000))
    # the deterministic part, in one process: every subtask read each input
    # to its end, the restored-finished ones too
    env, out = job(workers=None)
    ex = env.execute_async(restore_from=partial)
    ex.join(30)
    unread = [t.name for t in ex.tasks if t.input is not None and not t.input.finished]
    assert not unread, f"restored as finished, these never read their inputs' ends: {unread}"
