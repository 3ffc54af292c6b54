"""Stop-with-savepoint (issue 27, case 1): once the stop barrier is injected
at a source, nothing more flows from its side (no records, watermarks, idle
markers, timers), so a keyed event-time window fires exactly once across the
stopped job and the job restored from its savepoint. ``drain=True`` ends
event time before the savepoint instead: every window fires inside it, and a
restore fires none again."""
from __future__ import annotations

import collections
import threading
import time

import pytest

import pyflowbuf as fb
from pyflowbuf._core.events import BARRIER
from pyflowbuf.exchange.sides import OutputSide
from pyflowbuf.windows import Count, Tumbling
from pipeline_helpers import cancel_and_join, wait_for

KEYS = 3
PER_WINDOW = 100        # timestamp x // 10, windows of 10 s: 100 numbers each


def window_job(env, branch=None, rate=2000, watermark_interval=0.05):
    """An unbounded keyed event-time tumbling-window count; ``branch``: a map
    on a second branch of the source (parallelism 1, not chained), to slow
    the savepoint down with backpressure. Returns the collect() handles of
    the windows and of the branch (every number read before the savepoint)."""
    timed = (env.from_sequence(0, None, parallelism=2, rate_limit=rate).uid("numbers")
                .assign_timestamps(lambda x: x // 10, watermark_interval=watermark_interval).uid("times"))
    out = (timed.key_by(lambda x: x % KEYS)
                .window(Tumbling(10))
                .aggregate(Count(), window_function=lambda k, w, n: (k, w.start, n)).uid("windows")
                .collect().uid("out"))
    read = timed.map(branch or _identity, parallelism=1).uid("branch").collect().uid("branch-out")
    return out, read


def _identity(x):
    return x


def expected_count(key, start):
    return sum(1 for x in range(start * 10, start * 10 + PER_WINDOW) if x % KEYS == key)


def windows_fired(out, n):
    return lambda: len(out.result) >= n


def check_exactly_once(results):
    """Every window's result once across the runs, with its full count, and
    no window missing below the highest one fired."""
    results = [(k, int(start), n) for k, start, n in results]
    seen = collections.Counter((k, start) for k, start, _ in results)
    twice = sorted(w for w, c in seen.items() if c > 1)
    assert not twice, f"windows fired twice (after the savepoint and again after the restore): {twice[:10]}"
    for k, start, n in results:
        assert n == expected_count(k, start), (k, start, n)
    top = max(start for _, start, _ in results)
    missing = [(k, s) for s in range(0, top, 10) for k in range(KEYS) if (k, s) not in seen]
    assert not missing, missing[:10]


def slow_branch(delay):
    def slow(x):
        time.sleep(delay)
        return x
    return slow


def env_for(tmp_path, workers=None, interval=0.2):
    """(A worker ships its collect() records to the driver with each
    checkpoint: without checkpoints they show only when the job ends.)"""
    kw = {"workers": workers} if workers else {}
    return fb.Environment(parallelism=2, checkpoint_interval=interval, checkpoint_dir=str(tmp_path / "ck"), **kw)


def checkpointed(env, n):
    """Progress a job with workers shows while it runs (its collect() records
    reach the driver with each checkpoint, and the caller when it ends)."""
    return lambda: sum(c["status"] == "completed" and not c["savepoint"] for c in env.checkpoints()) >= n


def stop_restore_stop(tmp_path, workers=None, branch=None):
    env = env_for(tmp_path, workers)
    out1, _ = window_job(env, branch)
    job = env.execute_async()
    try:
        wait_for(checkpointed(env, 4), "checkpoints in the first run")
        sp = job.stop(savepoint=str(tmp_path / "sp1"), timeout=60)
    finally:
        cancel_and_join(job, failure_ok=True)
    first = list(out1.result)
    assert first
    env2 = env_for(tmp_path, workers)
    out2, _ = window_job(env2)
    job2 = env2.execute_async(restore_from=sp)
    try:
        wait_for(checkpointed(env2, 4), "checkpoints after the restore")
        job2.stop(savepoint=str(tmp_path / "sp2"), timeout=60)
    finally:
        cancel_and_join(job2, failure_ok=True)
    assert max(s for _, s, _ in out2.result) > max(s for _, s, _ in first)
    check_exactly_once(first + out2.result)
    return first, out2.result


@pytest.mark.parametrize("backpressured", [False, True], ids=["plain", "backpressured"])
def test_windows_fire_once_across_stop_and_restore_threads(tmp_path, backpressured):
    stop_restore_stop(tmp_path, branch=slow_branch(0.002) if backpressured else None)


@pytest.mark.parametrize("backpressured", [False, True], ids=["plain", "backpressured"])
def test_windows_fire_once_across_stop_and_restore_workers(tmp_path, backpressured):
    stop_restore_stop(tmp_path, workers=2, branch=slow_branch(0.002) if backpressured else None)


@pytest.fixture
def after_barrier(monkeypatch, tmp_path):
    """What each output partition sends after it sent a checkpoint barrier:
    a list of (producer, what) and an Event set at the first such send; in
    worker processes (forked with this patch) a line each in the file
    ``tmp_path / "sent-after-barrier"``."""
    marker = str(tmp_path / "sent-after-barrier")
    barred: set = set()
    sent_after: list = []
    seen = threading.Event()
    emit, broadcast = OutputSide.emit, OutputSide.broadcast_event

    def record(side, what):
        if id(side) in barred:
            sent_after.append((side.producer, what))
            seen.set()
            with open(marker, "a") as f:
                f.write(f"{side.producer}: {what}\n")

    def emit_recorded(self, batch, ts=None):
        record(self, f"{len(batch)} record(s)")
        return emit(self, batch, ts)

    def broadcast_recorded(self, kind, aux=0, flags=0, priority=False):
        record(self, f"event kind {kind} aux {aux}")
        result = broadcast(self, kind, aux, flags, priority)
        if kind == BARRIER:
            barred.add(id(self))
        return result

    monkeypatch.setattr(OutputSide, "emit", emit_recorded)
    monkeypatch.setattr(OutputSide, "broadcast_event", broadcast_recorded)
    return sent_after, seen


def test_nothing_flows_after_the_stop_barrier(tmp_path, after_barrier):
    """Counted, not timed: a branch holds the savepoint back until something
    was sent after a stop barrier (at most 1.5 s). Before the fix, the
    source's periodic watermark went out within 0.5 s of it, and the windows
    it fired reached the collect sink after its snapshot."""
    sent_after, seen = after_barrier
    stopping = threading.Event()
    # watermarks at most every 0.5 s: at the barrier the source holds one
    # not yet sent (its tick sent it within 0.5 s, before the fix)
    held = []

    def hold(x):
        if stopping.is_set() and not held:
            held.append(x)
            seen.wait(1.5)
        return x

    env = env_for(tmp_path, interval=120)       # no checkpoint but the savepoint: its barrier is the stop's
    out1, _ = window_job(env, hold, watermark_interval=0.5)
    job = env.execute_async()
    try:
        wait_for(windows_fired(out1, 5 * KEYS), "windows in the first run")
        stopping.set()
        sp = job.stop(savepoint=str(tmp_path / "sp1"), timeout=60)
    finally:
        cancel_and_join(job, failure_ok=True)
    assert held, "the branch saw no record after the stop was asked for"
    assert sent_after == []
    first = list(out1.result)
    env2 = env_for(tmp_path)
    out2, _ = window_job(env2)
    job2 = env2.execute_async(restore_from=sp)
    try:
        top = max(s for _, s, _ in first)
        wait_for(lambda: any(s > top + 30 for _, s, _ in out2.result), "windows after the restore")
        job2.stop(savepoint=str(tmp_path / "sp2"), timeout=60)
    finally:
        cancel_and_join(job2, failure_ok=True)
    check_exactly_once(first + out2.result)


@pytest.mark.parametrize("workers", [None, 2], ids=["threads", "workers"])
def test_drain_fires_every_window_inside_the_savepoint(tmp_path, workers):
    env = env_for(tmp_path, workers)
    out1, read = window_job(env)
    job = env.execute_async()
    try:
        wait_for(checkpointed(env, 3), "checkpoints in the first run")
        sp = job.stop(savepoint=str(tmp_path / "sp1"), drain=True, timeout=60)
    finally:
        cancel_and_join(job, failure_ok=True)
    # every number read before the savepoint is in a window that fired, once
    want = collections.Counter((x % KEYS, x // 100 * 10) for x in read.result)
    got = collections.Counter()
    for k, start, n in out1.result:
        assert (k, int(start)) not in got, (k, start)
        got[(k, int(start))] = n
    assert got == want
    env2 = env_for(tmp_path, workers)
    out2, read2 = window_job(env2)
    job2 = env2.execute_async(restore_from=sp)
    try:
        wait_for(checkpointed(env2, 3), "checkpoints after the restore")
        job2.stop(savepoint=str(tmp_path / "sp2"), timeout=60)
    finally:
        cancel_and_join(job2, failure_ok=True)
    assert read2.result and not set(read2.result) & set(read.result)     # it read on
    assert out2.result == []        # ... and fired nothing again: event time had ended


def test_the_command_line_stops_with_drain(tmp_path):
    """``pyflowbuf stop --drain`` reaches job.stop(drain=True) through the
    control endpoint; a drain on a savepoint that does not stop is refused."""
    from cli_helpers import cli
    from pyflowbuf.cluster import control

    env = fb.Environment(parallelism=2, checkpoint_interval=0.2, checkpoint_dir=str(tmp_path / "ck"), control_port=0)
    out, read = window_job(env)
    job = env.execute_async()
    try:
        wait_for(checkpointed(env, 2), "checkpoints")
        info = control.read_control_file(str(tmp_path / "ck"))
        answer = control.request(control.control_address(info), control.control_secret(info),
                                 {"op": "savepoint", "drain": True})
        assert answer["ok"] is False and "drain" in answer["message"] and not job.done
        code, text, err = cli("stop", tmp_path / "ck", "--savepoint", tmp_path / "sp", "--drain")
        assert code == 0, err
        assert "stopped job" in text and job.done
    finally:
        cancel_and_join(job, failure_ok=True)
    want = collections.Counter((x % KEYS, x // 100 * 10) for x in read.result)
    assert collections.Counter({(k, int(s)): n for k, s, n in out.result}) == want
    assert len(out.result) == len(want)


def held_branch():
    """A branch map that, once ``stopping`` is set, holds its records (and so
    the savepoint's barrier behind them) until ``release`` is set."""
    stopping, release = threading.Event(), threading.Event()

    def hold(x):
        if stopping.is_set():
            release.wait(60)
        return x
    return hold, stopping, release


def test_a_stop_that_fails_lets_the_job_go_on(tmp_path):
    """The savepoint of a stop expires: the tasks that took its barrier thaw,
    the job reads and fires on, and a later stop and restore are exactly once."""
    from pyflowbuf.checkpoint import CheckpointStateError

    hold, stopping, release = held_branch()
    env = env_for(tmp_path)
    out1, _ = window_job(env, hold)
    job = env.execute_async()
    try:
        wait_for(checkpointed(env, 2), "checkpoints in the first run")
        stopping.set()
        with pytest.raises(CheckpointStateError, match="expired"):
            job.stop(savepoint=str(tmp_path / "failed"), timeout=0.3)
        stopping.clear()
        release.set()
        assert not job.done
        before = len(out1.result)
        wait_for(lambda: len(out1.result) > before + 3 * KEYS, "windows after the failed stop")
        sp = job.stop(savepoint=str(tmp_path / "sp1"), timeout=60)
    finally:
        release.set()
        cancel_and_join(job, failure_ok=True)
    first = list(out1.result)
    env2 = env_for(tmp_path)
    out2, _ = window_job(env2)
    job2 = env2.execute_async(restore_from=sp)
    try:
        wait_for(checkpointed(env2, 3), "checkpoints after the restore")
        job2.stop(savepoint=str(tmp_path / "sp2"), timeout=60)
    finally:
        cancel_and_join(job2, failure_ok=True)
    check_exactly_once(first + out2.result)


def test_a_drained_stop_that_fails_fails_the_job(tmp_path):
    """Event time has ended at the sources: going on would make every later
    record late, so the job fails with an error that says what to do."""
    from pyflowbuf.checkpoint import CheckpointStateError

    hold, stopping, release = held_branch()
    env = env_for(tmp_path)
    window_job(env, hold)
    job = env.execute_async()
    try:
        wait_for(checkpointed(env, 2), "checkpoints")
        stopping.set()
        with pytest.raises(CheckpointStateError, match="expired"):
            job.stop(savepoint=str(tmp_path / "failed"), drain=True, timeout=0.3)
        release.set()
        with pytest.raises(fb.errors.JobFailedError, match=r"drain=True\) was aborted.*last checkpoint"):
            job.join(60)
    finally:
        release.set()
        cancel_and_join(job, failure_ok=True)


def test_no_processing_time_timer_fires_after_the_stop_barrier(tmp_path, after_barrier):
    """A keyed process function with a processing-time timer every 20 ms,
    which emits: once its task sent the stop barrier, no timer fires there
    (before the fix they fired on, into the sink, after its snapshot)."""
    sent_after, seen = after_barrier
    stopping = threading.Event()

    def hold(x):
        if stopping.is_set():
            seen.wait(1.5)      # (each record: the barrier waits behind them)
            stopping.clear()
        return x

    def on_record(key, x, state, ctx):
        if not state.get("armed"):
            state["armed"] = True
            ctx.register_processing_time_timer(ctx.current_processing_time() + 0.02)
        return []

    def on_timer(key, t, state, ctx):
        ctx.register_processing_time_timer(t + 0.02)
        return [(key, t)]

    env = env_for(tmp_path, interval=120)       # no checkpoint but the savepoint: its barrier is the stop's
    numbers = env.from_sequence(0, None, parallelism=2, rate_limit=2000).uid("numbers")
    ticks = (numbers.key_by(lambda x: x % KEYS).process(on_record, on_timer=on_timer).uid("ticks")
                    .collect(parallelism=1).uid("out"))
    numbers.map(hold, parallelism=1).uid("branch").collect().uid("branch-out")
    job = env.execute_async()
    try:
        wait_for(lambda: len(ticks.result) >= 10, "timers firing")
        stopping.set()
        job.stop(savepoint=str(tmp_path / "sp"), timeout=60)
    finally:
        cancel_and_join(job, failure_ok=True)
    assert sent_after == []


def test_nothing_flows_after_the_stop_barrier_in_workers(tmp_path, after_barrier):
    """As above, with workers=2: the barrier and its flag cross the TCP
    exchange, and each worker's tasks stop at it."""
    import os

    marker = str(tmp_path / "sent-after-barrier")
    flag = str(tmp_path / "stopping")

    def hold(x):
        if os.path.exists(flag):
            os.remove(flag)
            deadline = time.monotonic() + 1.5
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.01)
        return x

    env = env_for(tmp_path, workers=2, interval=120)     # no checkpoint but the savepoint
    window_job(env, hold, watermark_interval=0.5)
    job = env.execute_async()
    try:
        time.sleep(1.0)         # (windows fire meanwhile; a slow start only makes fewer)
        open(flag, "w").close()
        job.stop(savepoint=str(tmp_path / "sp1"), timeout=60)
    finally:
        cancel_and_join(job, failure_ok=True)
    assert not os.path.exists(flag), "the branch saw no record after the stop was asked for"
    assert not os.path.exists(marker), open(marker).read()
