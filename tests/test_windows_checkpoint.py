"""Window, timer and join state in checkpoints: a job that fails in the
middle of open windows and restores from its last checkpoint gives the output
of the same job without a failure (exactly once: nothing lost, nothing twice)."""
from __future__ import annotations

import random
import threading

import pytest

import pyflowbuf as fb
from pyflowbuf.windows import Count, Session, Sliding, Tumbling


class FailOnce:
    """Identity that raises once, at its ``at``-th call or the first call
    after it once a checkpoint of ``env`` has completed (so that the failure
    lands in the middle of a restored run, whatever the machine's speed),
    and never again."""

    def __init__(self, at):
        self.at = at
        self.calls = 0
        self.fired = False
        self.env = None
        self.lock = threading.Lock()

    def __call__(self, x):
        with self.lock:
            self.calls += 1
            fire = not self.fired and self.calls >= self.at and self._checkpointed()
            self.fired = self.fired or fire
        if fire:
            raise RuntimeError(f"injected failure at call {self.calls}")
        return x

    def _checkpointed(self):
        return self.env is None or any(c["status"] == "completed" for c in self.env.checkpoints())


def stream(seed, n, *, very_late=0.0):
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        t = i * 0.01 - rnd.randint(0, 5) * 0.01
        if rnd.random() < very_late:
            t -= rnd.uniform(1, 3)
        out.append((f"k{rnd.randrange(6)}", round(t, 2)))
    return out


# Sources are rate limited so that a job runs for about half a second: long
# enough for checkpoints to complete before the injected failure on a busy machine.

def windowed(env, records, assigner, *, fail=None, where="before", exact=False, lateness=0.0):
    s = env.from_iterable(records, rate_limit=5_000)
    if fail is not None and where == "before":
        s = s.map(fail, parallelism=1)      # chained to the source: the record order stays fixed
    w = (s.assign_timestamps(lambda r: r[1], out_of_orderness=0.05, watermark_interval=0 if exact else 0.2,
                             parallelism=1)
          .key_by(lambda r: r[0])
          .window(assigner)
          .allowed_lateness(lateness)
          .aggregate(Count(), window_function=lambda k, w, n: (k, w.start, w.end, n)))
    late = w.late()
    if fail is not None and where == "after":
        w = w.map(fail)
    return w.collect(parallelism=1), late.collect(parallelism=1)


def run(tmp_path, records, assigner, *, fail=None, where="before", exact=False, lateness=0.0, name="x"):
    kw = dict(checkpoint_interval=0.02, checkpoint_dir=tmp_path / name, restart_attempts=2) if fail else {}
    env = fb.Environment(parallelism=2, max_batch=1 if exact else 64, **kw)
    if fail is not None:
        fail.env = env
    out, late = windowed(env, records, assigner, fail=fail, where=where, exact=exact, lateness=lateness)
    env.execute(timeout=120)
    return sorted(out.result), sorted(late.result), env


@pytest.mark.parametrize("assigner,where", [(Tumbling(0.5), "before"), (Sliding(1.0, 0.25), "after"),
                                            (Session(0.03), "before")])
def test_restore_in_the_middle_of_open_windows(tmp_path, assigner, where):
    records = stream(1, 3000)
    want, want_late, _ = run(tmp_path, records, assigner)
    # before the windows: at a record; after them: at a window result (~6 per 0.25 s)
    fail = FailOnce(1000 if where == "before" else 100)
    got, got_late, env = run(tmp_path, records, assigner, fail=fail, where=where)
    assert fail.fired and env.last_execution.restarts == 1
    assert env.last_execution.restored_from is not None, "no checkpoint before the failure"
    assert got == want
    assert got_late == want_late == []


def test_restore_with_late_records_is_exact(tmp_path):
    """With the watermark after every record, the late records and the
    re-firings within the allowed lateness are those of the run without failure:
    the assigner's watermark and the windows' come back from the checkpoint."""
    records = stream(2, 2500, very_late=0.03)
    want, want_late, _ = run(tmp_path, records, Tumbling(0.2), exact=True, lateness=0.5)
    fail = FailOnce(1000)
    got, got_late, env = run(tmp_path, records, Tumbling(0.2), fail=fail, exact=True, lateness=0.5)
    assert fail.fired and env.last_execution.restored_from is not None
    assert got == want
    assert got_late == want_late and want_late


def test_timers_and_interval_join_state_survive_a_restore(tmp_path):
    def job(env, fail):
        a = env.from_iterable([(i % 5, i * 0.01) for i in range(2000)], rate_limit=4_000)
        b = env.from_iterable([(i % 5, i * 0.01 + 0.005) for i in range(2000)], rate_limit=4_000)
        if fail is not None:
            a = a.map(fail)
        a = a.assign_timestamps(lambda r: r[1], out_of_orderness=0.0)
        b = b.assign_timestamps(lambda r: r[1], out_of_orderness=0.0)
        joined = (a.key_by(lambda r: r[0]).interval_join(b.key_by(lambda r: r[0])).between(-0.02, 0.02)
                    .process(lambda l, r: [(l[0], l[1], r[1])]))

        def element(k, x, st, ctx):
            st["n"] = st.get("n", 0) + 1
            ctx.register_event_time_timer(round(x[1], 1) + 0.1)

        timers = (a.key_by(lambda r: r[0])
                    .process(element, on_timer=lambda k, t, st, ctx: [(k, t, st["n"])]))
        return joined.collect(parallelism=1), timers.collect(parallelism=1)

    env = fb.Environment(parallelism=2)
    j0, t0 = job(env, None)
    env.execute(timeout=120)
    fail = FailOnce(800)
    env = fb.Environment(parallelism=2, checkpoint_interval=0.02, checkpoint_dir=tmp_path / "c",
                         restart_attempts=2)
    fail.env = env
    j1, t1 = job(env, fail)
    env.execute(timeout=120)
    assert fail.fired and env.last_execution.restored_from is not None
    assert sorted(j1.result) == sorted(j0.result)
    # timers: the same (key, time) pairs fire; the counts they read may differ by
    # when the watermark came, so compare the timers only
    assert sorted((k, t) for k, t, _ in t1.result) == sorted((k, t) for k, t, _ in t0.result)


def test_arrow_window_state_in_a_checkpoint(tmp_path):
    pa = pytest.importorskip("pyarrow")
    records = stream(3, 4000)
    batches = [pa.record_batch({"key": [k for k, _ in records[i:i + 20]], "ts": [t for _, t in records[i:i + 20]]})
               for i in range(0, len(records), 20)]

    def job(env, fail):
        s = env.from_iterable(batches, kind="arrow", rate_limit=400)
        if fail is not None:
            s = s.map(fail, kind="arrow")
        return (s.assign_timestamps("ts", out_of_orderness=0.05)
                 .key_by("key").window(Tumbling(0.5)).aggregate({"n": ("key", "count")}).collect())

    env = fb.Environment()
    want = job(env, None)
    env.execute(timeout=120)
    fail = FailOnce(60)
    env = fb.Environment(checkpoint_interval=0.02, checkpoint_dir=tmp_path / "a", restart_attempts=2)
    fail.env = env
    got = job(env, fail)
    env.execute(timeout=120)
    assert fail.fired and env.last_execution.restored_from is not None

    def rows(res):
        return sorted(tuple(r.values()) for r in pa.Table.from_batches(res).to_pylist())
    assert rows(got.result) == rows(want.result)
