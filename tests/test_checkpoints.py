"""Checkpoints and recovery: barriers through the job, durable snapshots, and
exactly-once state and output after injected failures.

The fault-injection tests compare a job that fails (an exception raised once
at a random record, in a random operator) with the same job without failures:
the committed output and the final keyed state must be equal, nothing lost and
nothing duplicated.
"""
from __future__ import annotations

import collections
import multiprocessing
import os
import signal
import threading
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pipeline_helpers import (held_sequence, read_parts, resume_job, running_counts, wait_for,  # noqa: E402
                              wait_until_held)
from pyflowbuf import errors
from pyflowbuf.checkpoint import CheckpointStorage

N_KEYS = 7
KILLS = collections.Counter()       # fault-injection runs that really failed and recovered


class FailOnce:
    """An identity function that raises once, at its ``at``-th call (across all
    subtasks of the operator), and never again: the failure of one attempt."""

    def __init__(self, at: int):
        self.at = at
        self.calls = 0
        self.fired = False
        self.lock = threading.Lock()

    def __call__(self, x):
        with self.lock:
            self.calls += 1
            fire = not self.fired and self.calls == self.at
            if fire:
                self.fired = True
        if fire:
            raise RuntimeError(f"injected failure at call {self.at}")
        return x


def keyed_job(env, n, *, parallelism, partition, stages, fail=None, fail_stage=0, out_dir=None, rate=None,
              source=None):
    """source -> (stages of map, one may fail) -> key_by -> running count -> sinks."""
    s = source if source is not None else env.from_sequence(0, n, parallelism=1, rate_limit=rate)
    for i in range(stages):
        fn = fail if (fail is not None and i == fail_stage) else (lambda x: x)
        if partition == "rebalance":
            s = s.rebalance()
        s = s.map(fn, parallelism=parallelism, name=f"stage{i}", kind="int64")
    counts = (s.map(lambda x: (x % N_KEYS, x), kind="struct")
               .key_by(lambda kv: kv[0])
               .reduce(lambda a, b: (a[0], a[1] + b[1]), parallelism=parallelism, name="count"))
    handle = counts.collect(parallelism=1)
    if out_dir is not None:
        counts.map(lambda kv: f"{kv[0]},{kv[1]}", kind="str").write_text(str(out_dir), parallelism=1)
    return handle


def final_counts(records):
    """The last running count per key (the keyed state at the end)."""
    last = {}
    for k, total in records:
        last[k] = max(last.get(k, -1), total)
    return last


def expected(n):
    sums = collections.defaultdict(int)
    for x in range(n):
        sums[x % N_KEYS] += x
    return dict(sums)


# ---------------------------------------------------------------- basics

def test_checkpoints_complete_during_a_job(tmp_path):
    env = fb.Environment(checkpoint_interval=0.02, checkpoint_dir=tmp_path / "chk", chaining=False)
    release = str(tmp_path / "release")
    source = held_sequence(env, 6000, parallelism=1, rate_limit=20_000, hold_at=3000, release=release)
    h = keyed_job(env, 6000, parallelism=2, partition="rebalance", stages=1, source=source)
    job = env.execute_async()
    # the source holds half way until a checkpoint with state has completed: on a
    # loaded machine the job cannot end before its first checkpoint
    wait_until_held(release, 1, job=job)
    wait_for(lambda: any(c["status"] == "completed" and c["state_bytes"] > 0 for c in env.checkpoints()),
             "a completed checkpoint with state", job=job)
    open(release, "w").close()
    job.join(60)
    assert final_counts(h.result) == expected(6000)
    done = [c for c in env.checkpoints() if c["status"] == "completed"]
    assert done, env.checkpoints()
    c = done[-1]
    assert c["tasks"] == c["acknowledged"] and c["state_bytes"] > 0
    assert set(c["alignment_ms"]) and all(v >= 0 for v in c["alignment_ms"].values())
    ids = [c["id"] for c in env.checkpoints()]
    assert ids == sorted(ids)
    storage = CheckpointStorage(str(tmp_path / "chk"))
    kept = storage.list_complete()
    assert 1 <= len(kept) <= 2                     # checkpoints_retained=2


def test_recovery_gives_exactly_once_state_and_output(tmp_path):
    fail = FailOnce(2500)
    env = fb.Environment(checkpoint_interval=0.02, checkpoint_dir=tmp_path / "chk", restart_attempts=2,
                         chaining=False)
    h = keyed_job(env, 6000, parallelism=2, partition="rebalance", stages=2, fail=fail, fail_stage=1,
                  out_dir=tmp_path / "out", rate=20_000)
    env.execute(120)
    assert fail.fired
    assert final_counts(h.result) == expected(6000)
    # the collected running counts are those of a run without failures: no duplicate, none lost
    assert collections.Counter(k for k, _ in h.result) == collections.Counter(x % N_KEYS for x in range(6000))
    lines = read_parts(tmp_path / "out")
    assert sorted(lines) == sorted(f"{k},{v}" for k, v in h.result)
    assert not [f for f in os.listdir(tmp_path / "out") if f.startswith(".")]   # nothing uncommitted left
    assert env.last_execution.restarts == 1


def test_failure_without_restart_attempts_fails_the_job(tmp_path):
    env = fb.Environment(checkpoint_interval=0.02, checkpoint_dir=tmp_path / "chk")
    keyed_job(env, 3000, parallelism=1, partition="forward", stages=1, fail=FailOnce(100), rate=20_000)
    with pytest.raises(errors.JobFailedError, match="injected failure"):
        env.execute(60)


def test_restart_attempts_are_limited(tmp_path):
    def always(x):
        if x == 500:
            raise ValueError("always fails at 500")
        return x
    env = fb.Environment(checkpoint_interval=0.02, checkpoint_dir=tmp_path / "chk", restart_attempts=2)
    env.from_sequence(0, 2000, rate_limit=20_000).map(always).collect()
    with pytest.raises(errors.JobFailedError, match="always fails at 500"):
        env.execute(60)
    assert env.last_execution.restarts == 2


def test_every_segment_returns_after_restarts(tmp_path):
    fail = FailOnce(1000)
    env = fb.Environment(checkpoint_interval=0.02, checkpoint_dir=tmp_path / "chk", restart_attempts=1,
                         chaining=False)
    keyed_job(env, 3000, parallelism=2, partition="rebalance", stages=1, fail=fail, rate=20_000)
    env.execute(60)
    ex = env.last_execution
    assert ex.restarts == 1
    for pool in ex.network_pools:
        assert pool.available_segments == pool.total_segments


def test_non_rewindable_source_is_refused(tmp_path):
    env = fb.Environment(checkpoint_interval=0.1, checkpoint_dir=tmp_path / "chk")
    env.from_iterable(iter(range(10))).collect()
    with pytest.raises(errors.ConfigurationError, match="cannot rewind"):
        env.execute(10)
    # at-least-once: accepted
    env = fb.Environment(checkpoint_interval=0.1, checkpoint_dir=tmp_path / "chk2",
                         checkpointing_mode="at_least_once")
    out = env.from_iterable(iter(range(10))).collect()
    env.execute(10)
    assert out.result == list(range(10))


def test_checkpoint_settings_are_validated(tmp_path):
    for kw, name in [(dict(checkpoint_interval=0), "checkpoint_interval"),
                     (dict(checkpoint_interval=-1), "checkpoint_interval"),
                     (dict(checkpoint_interval="1s"), "checkpoint_interval"),
                     (dict(checkpoint_interval=1, checkpoint_timeout=0), "checkpoint_timeout"),
                     (dict(checkpoint_interval=1, checkpoints_retained=0), "checkpoints_retained"),
                     (dict(restart_attempts=-1), "restart_attempts"),
                     (dict(checkpoint_interval=1, checkpointing_mode="twice"), "checkpointing_mode")]:
        with pytest.raises(ValueError, match=name):
            fb.Environment(checkpoint_dir=tmp_path, **kw)


def test_checkpoints_on_an_fsspec_memory_filesystem():
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    if fs.exists("/pyflowbuf-test"):
        fs.rm("/pyflowbuf-test", recursive=True)
    fail = FailOnce(1500)
    env = fb.Environment(checkpoint_interval=0.02, checkpoint_dir="memory://pyflowbuf-test",
                         restart_attempts=1, chaining=False)
    h = keyed_job(env, 4000, parallelism=2, partition="rebalance", stages=1, fail=fail, rate=20_000)
    env.execute(60)
    assert fail.fired and final_counts(h.result) == expected(4000)
    assert CheckpointStorage("memory://pyflowbuf-test").latest() is not None


def test_a_torn_checkpoint_is_skipped_on_restore(tmp_path):
    chk = tmp_path / "chk"
    env = fb.Environment(checkpoint_interval=0.02, checkpoint_dir=chk, checkpoints_retained=3)
    keyed_job(env, 4000, parallelism=1, partition="forward", stages=1, rate=20_000)
    env.execute(60)
    storage = CheckpointStorage(str(chk), retained=3)
    complete = storage.list_complete()
    assert len(complete) >= 2
    newest = complete[-1]
    victim = os.path.join(newest.path.removeprefix("file://"), next(iter(newest.tasks.values())).file)
    with open(victim, "r+b") as fh:
        fh.seek(20)
        byte = fh.read(1)
        fh.seek(20)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert storage.latest().checkpoint_id == complete[-2].checkpoint_id


# ---------------------------------------------------------------- Hypothesis fault injection

def random_job(env, n, stages, parallelism, fail, fail_stage, out_dir, rate, before_count=None):
    """source -> stages (each reached by forward, rebalance, key_by, or a split
    into two filters joined again by union; one stage's map may fail) ->
    ``before_count(stream)`` if given -> keyed running count -> collect +
    write_text."""
    s = env.from_sequence(0, n, parallelism=1, rate_limit=rate)
    for i, how in enumerate(stages):
        fn = fail if i == fail_stage else (lambda x: x)
        if how == "rebalance":
            s = s.rebalance()
        elif how == "key_by":
            s = s.key_by(lambda x: x % 5)
        elif how == "union":
            evens = s.filter(lambda x: x % 2 == 0, name=f"evens{i}")
            odds = s.filter(lambda x: x % 2 == 1, name=f"odds{i}")
            s = evens.union(odds, parallelism=parallelism, name=f"union{i}")
        s = s.map(fn, parallelism=parallelism, name=f"stage{i}", kind="int64")
    if before_count is not None:
        s = before_count(s)
    counts = (s.map(lambda x: (x % N_KEYS, x), kind="struct")
               .key_by(lambda kv: kv[0])
               .reduce(lambda a, b: (a[0], a[1] + b[1]), parallelism=parallelism, name="count"))
    handle = counts.collect(parallelism=1)
    counts.map(lambda kv: f"{kv[0]},{kv[1]}", kind="str").write_text(str(out_dir), parallelism=1)
    return handle


def check_exactly_once(handle, out_dir, n):
    assert final_counts(handle.result) == expected(n)
    # one running count per input record: nothing lost, nothing duplicated
    assert collections.Counter(k for k, _ in handle.result) == collections.Counter(x % N_KEYS for x in range(n))
    assert sorted(read_parts(out_dir)) == sorted(f"{k},{v}" for k, v in handle.result)
    assert not [f for f in os.listdir(out_dir) if f.startswith(".")]


@given(parallelism=st.integers(1, 3),
       stages=st.lists(st.sampled_from(["forward", "rebalance", "key_by", "union"]), min_size=1, max_size=4),
       fail_stage=st.integers(0, 3), fail_at=st.integers(1, 3000), chaining=st.booleans())
def test_exactly_once_under_random_failures(tmp_path_factory, parallelism, stages, fail_stage, fail_at, chaining):
    tmp = tmp_path_factory.mktemp("eo")
    n = 3000
    fail = FailOnce(fail_at)
    env = fb.Environment(checkpoint_interval=0.01, checkpoint_dir=tmp / "chk", restart_attempts=3,
                         chaining=chaining)
    h = random_job(env, n, stages, parallelism, fail, min(fail_stage, len(stages) - 1), tmp / "out", 40_000)
    env.execute(120)
    assert fail.fired      # every stage sees every record once: the failure always comes
    KILLS["exception"] += 1
    check_exactly_once(h, tmp / "out", n)
    assert env.last_execution.restarts == 1


class KillWorkerOnce:
    """In a worker process: at its ``at``-th call, once over all attempts and
    workers (a marker file), the process kills itself."""

    def __init__(self, marker, at):
        self.marker, self.at, self.calls = str(marker), at, 0

    def __call__(self, x):
        self.calls += 1
        if self.calls == self.at:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return x
            os.kill(os.getpid(), signal.SIGKILL)
        return x


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="workers need fork")
@settings(max_examples=int(os.environ.get("PYFLOWBUF_WORKER_KILLS", "12")))
@given(stages=st.lists(st.sampled_from(["forward", "rebalance", "key_by", "union"]), min_size=1, max_size=3),
       fail_stage=st.integers(0, 2), kill_at=st.integers(1, 1400))
def test_exactly_once_when_a_worker_process_is_killed_at_a_random_record(tmp_path_factory, stages, fail_stage,
                                                                        kill_at):
    tmp = tmp_path_factory.mktemp("kill")
    n = 3000
    env = fb.Environment(workers=2, parallelism=2, checkpoint_interval=0.02, checkpoint_dir=tmp / "chk",
                         restart_attempts=3)
    kill = KillWorkerOnce(tmp / "killed", kill_at)
    h = random_job(env, n, stages, 2, kill, min(fail_stage, len(stages) - 1), tmp / "out", 20_000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", errors.WorkerSideEffectWarning)
        env.execute(180)
    # each of the stage's 2 subtasks sees about half the records: a kill point
    # beyond what a subtask sees never fires
    if os.path.exists(tmp / "killed"):
        KILLS["worker"] += 1
        check_kill_restarts(env)
    check_exactly_once(h, tmp / "out", n)


def check_kill_restarts(env, test="worker kill"):
    """One kill, one restart, for the reason of the kill. (A second restart
    used to be tolerated: a restarted worker's network sender could take an
    overtaking barrier for a data buffer and crash, issue 18; and attempts
    are fenced now, so nothing of the killed attempt can fail the next.)"""
    ex = env.last_execution
    failures = ex.restart_failures
    assert ex.restarts == 1, f"{test}: {ex.restarts} restarts: {failures}"
    assert "exited unexpectedly: killed by SIGKILL" in failures[0][2], failures


# ---------------------------------------------------------------- a new process resumes

def test_a_new_process_resumes_a_crashed_job_from_its_checkpoint_dir(tmp_path):
    chk, out = str(tmp_path / "chk"), str(tmp_path / "out")
    run = resume_job(tmp_path, chk, out, n=5000)
    first = run(3000)
    assert first.returncode == 17, first.stderr
    assert CheckpointStorage(chk).latest() is not None
    second = run(0)
    assert second.returncode == 0, second.stderr
    KILLS["process"] += 1
    # exactly the running counts of a run without failure
    assert sorted(read_parts(out)) == running_counts(5000)


def test_the_main_jobs_checkpoint_step(tmp_path):
    from pyflowbuf.demo import checkpoint_demo

    res = checkpoint_demo(tmp_path, records=30_000)
    assert res["restarts"] == 1 and res["exactly_once"] and res["output_lines"] == 30_000
    assert res["checkpoints_completed"] >= 1


def test_the_readme_checkpoint_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open("events.csv", "w") as fh:
        for i in range(3000):
            fh.write(f"user{i % 4},page{i}\n")

    def count(user, event, state):
        state["n"] = state.get("n", 0) + 1
        return [f"{user},{state['n']}"]

    env = fb.Environment(parallelism=2, checkpoint_interval=1.0, checkpoint_dir="checkpoints",
                         restart_attempts=3)
    (env.read_text("events.csv")
        .map(lambda line: tuple(line.split(",")[:2]))
        .key_by(lambda e: e[0])
        .process(count)
        .write_text("counts"))
    env.execute(60, restore_from="latest")
    lines = read_parts("counts")
    assert sorted(lines) == sorted(f"user{u},{n}" for u in range(4) for n in range(1, 751))


def test_a_finished_task_does_not_rewrite_a_checkpoint_it_snapshotted(tmp_path):
    """The task's own write for n may still be on its way when it finishes:
    the coordinator must not write its final state into n as well (two
    writers of one file: the metadata check then fails the checkpoint)."""
    from pyflowbuf.checkpointing.coordinator import CheckpointCoordinator, CheckpointSettings

    storage = CheckpointStorage(str(tmp_path))
    coord = CheckpointCoordinator(CheckpointSettings(interval=1, directory=str(tmp_path)), storage)

    class Execution:
        def trigger_sources(self, n): pass
        def notify_complete(self, n): pass
        def abort_checkpoint(self, n): pass

    coord.attach(Execution(), ["a", "b"])
    n = coord.trigger()
    writes = []
    write = storage.write_task_state
    storage.write_task_state = lambda *a, **k: writes.append(a[:2]) or write(*a, **k)
    coord.task_finished("a", {"finished": True}, [], snapshotted=n)
    assert writes == []
    coord.task_finished("b", {"finished": True}, [], snapshotted=n - 1)   # b never snapshotted n
    assert writes == [(n, "b")]
    coord.acknowledge("a", n, write(n, "a", {"x": 1}), 0.0, [])
    assert coord.checkpoints()[-1]["status"] == "completed"


def test_checkpoints_reach_the_json_log_prometheus_and_the_metrics(tmp_path):
    log = tmp_path / "metrics.jsonl"
    env = fb.Environment(checkpoint_interval=0.02, checkpoint_dir=tmp_path / "chk", chaining=False,
                         metrics_log=log, metrics_interval=0.05)
    keyed_job(env, 4000, parallelism=2, partition="rebalance", stages=1, rate=20_000)
    env.execute(60)
    import json
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    ckpts = [x["checkpoint"] for x in lines if "checkpoint" in x]
    assert ckpts and any(c["status"] == "completed" for c in ckpts)
    assert [c["id"] for c in ckpts] == [c["id"] for c in env.checkpoints()]
    m = env.metrics()
    assert max(t["last_checkpoint"] for t in m.values()) >= 1
    assert all("checkpoint_alignment_ms" in t and "buffers_out" in t for t in m.values())

    pytest.importorskip("prometheus_client")
    from pyflowbuf.monitoring import PrometheusExporter

    exp = PrometheusExporter(0, "j", serve=False)
    exp.checkpoint({"id": 3, "status": "completed", "duration_s": 0.5, "state_bytes": 100,
                    "alignment_ms": {"v1-0": 2.0, "v1-1": 7.5}})
    exp.checkpoint({"id": 4, "status": "expired", "duration_s": 9.0, "alignment_ms": {}})
    value = exp.registry.get_sample_value
    assert value("pyflowbuf_checkpoint_last_id", {"job": "j"}) == 3
    assert value("pyflowbuf_checkpoint_last_max_alignment_ms", {"job": "j"}) == 7.5
    assert value("pyflowbuf_checkpoints_total", {"job": "j", "status": "expired"}) == 1


class Point:
    def __init__(self, k, v):
        self.k, self.v = k, v


def test_state_that_cannot_be_checkpointed_fails_the_job_naming_the_type(tmp_path):
    env = fb.Environment(checkpoint_interval=0.02, checkpoint_dir=tmp_path / "chk", chaining=False)
    # (unbounded: on a loaded machine a short job could end before its first checkpoint)
    (env.from_sequence(0, None, rate_limit=20_000)
        .map(lambda x: Point(x % 3, x), kind="pickle")
        .key_by(lambda p: p.k)
        .reduce(lambda a, b: Point(a.k, a.v + b.v), kind="pickle")
        .sink(lambda p: None))
    with pytest.raises(errors.JobFailedError, match="Point"):
        env.execute(60)
    # with the opt-in it checkpoints
    env = fb.Environment(checkpoint_interval=0.02, checkpoint_dir=tmp_path / "chk2", chaining=False,
                         allow_pickle=True)
    out = (env.from_sequence(0, 4000, rate_limit=4000)         # about 1 s: checkpoints complete meanwhile
              .map(lambda x: Point(x % 3, x), kind="pickle")
              .key_by(lambda p: p.k)
              .reduce(lambda a, b: Point(a.k, a.v + b.v), kind="pickle")
              .map(lambda p: p.v, kind="int64")
              .collect())
    env.execute(60)
    assert max(out.result) == max(sum(x for x in range(4000) if x % 3 == k) for k in range(3))
    assert any(c["status"] == "completed" for c in env.checkpoints())
