"""A savepoint and an unaligned checkpoint written by a288b41 (the commit
that moved checkpointing into ``pyflowbuf/checkpointing/``, before its
subtask side became one class) restore in every later one: what each
subtask gets to start from (operator states, source positions, in-flight
items, record kinds) and the output of the restored run are the very ones
a288b41 restored (``tests/data/make_checkpoints_a288b41.py`` recorded them,
in ``expected.json`` beside each).

* ``savepoint-a288b41``: a keyed running count and a keyed process function
  with event-time timers, stopped with a savepoint at parallelism 2;
  restored at 2 and at 3.
* ``unaligned-a288b41``: the same job under backpressure (a slow chain after
  the count), cancelled after an unaligned checkpoint that holds in-flight
  data on its keyed edge (a ``chk-<id>`` directory copied elsewhere, written
  without incremental references so it stands alone); restored at 2 (the
  items go back into their channels) and at 3 (redistributed by key group).
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import time

import numpy as np
import pytest

import pyflowbuf as fb
from pyflowbuf.checkpoint import SavepointStorage
from pyflowbuf.runtime.task import subtask as subtask_mod
from pipeline_helpers import held_sequence, wait_until_held

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
N = 3000
KEYS = 13

pytestmark = pytest.mark.timeout(300)


def _slow(seconds):
    def fn(r):
        if seconds:
            time.sleep(seconds)
        return r
    return fn


def _per_second(key, rec, state, ctx):
    b = int(rec[1])
    state[b] = state.get(b, 0) + 1
    ctx.register_event_time_timer(b + 1)


def _fire(key, t, state, ctx):
    b = int(t) - 1
    return [("t", key, b, state.pop(b, 0))]


def keyed_job(env, p, n=N, delay=0.0, rate=None):
    """The job both were taken of; its two collect sinks."""
    src = env.from_sequence(0, n, parallelism=p, rate_limit=rate).uid("numbers")
    timed = (src.map(lambda x: (x % KEYS, x / 100.0, 1))
             .assign_timestamps(lambda r: r[1]).uid("event-time"))
    keyed = timed.key_by(lambda r: r[0])
    counts = (keyed.reduce(lambda a, b: (a[0], b[1], a[2] + b[2])).uid("counts").map(_slow(delay))
              .map(lambda r: ("r", r[0], r[2])).collect().uid("counts-out"))
    seconds = keyed.process(_per_second, on_timer=_fire).uid("seconds").collect().uid("seconds-out")
    return counts, seconds


def stop_with_savepoint(tmp, dest):
    """Run the job at parallelism 2 until its sources hold halfway, stop it
    with a savepoint and copy that to ``dest``; the output up to it, sorted."""
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=os.path.join(tmp, "ck"))
    release = os.path.join(tmp, "release")
    env.from_sequence = lambda a, n, parallelism, rate_limit=None: held_sequence(
        env, n, parallelism=parallelism, rate_limit=2000, hold_at=n // 2, release=release)
    counts, seconds = keyed_job(env, 2)
    job = env.execute_async()
    wait_until_held(release, 2, job)
    shutil.copytree(job.stop(savepoint=os.path.join(tmp, "sp")), dest)
    return sorted(map(list, counts.result + seconds.result))


def canonical(value):
    """``value`` as plain JSON (dicts sorted by key, arrays as lists, bytes as
    their SHA-256): the same for equal restores, in any process."""
    if isinstance(value, dict):
        return [[canonical(k), canonical(v)] for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))]
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "sha256:" + hashlib.sha256(bytes(value)).hexdigest()
    if isinstance(value, np.ndarray):
        return canonical(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _start(restore) -> dict:
    """What a subtask starts from, without the stored layout it was read from
    (``stored``: the file's own bytes, the same by construction)."""
    return {k: v for k, v in restore.items() if k != "stored"}


def restore_and_run(monkeypatch, tmp, src, p):
    """Restore ``src`` into the job at parallelism ``p`` and run it to its end:
    (what each subtask started from, by thread name; the output, sorted)."""
    starts = {}
    opened = subtask_mod.Subtask._open

    def _open(self):
        if self.restore is not None:
            starts[self.task_name] = canonical(_start(self.restore))
        return opened(self)

    monkeypatch.setattr(subtask_mod.Subtask, "_open", _open)
    env = fb.Environment(parallelism=p, checkpoint_interval=0.2, checkpoint_dir=os.path.join(tmp, "ck"))
    counts, seconds = keyed_job(env, p)
    env.execute(120, restore_from=src)
    monkeypatch.setattr(subtask_mod.Subtask, "_open", opened)
    return starts, sorted(map(list, counts.result + seconds.result))


def all_output(n=N) -> collections.Counter:
    """What one uninterrupted run outputs."""
    out = collections.Counter()
    for k, c in collections.Counter(x % KEYS for x in range(n)).items():
        out.update(("r", k, i) for i in range(1, c + 1))
    out.update(("t", k, b, c) for (k, b), c in collections.Counter((x % KEYS, int(x / 100.0))
                                                                   for x in range(n)).items())
    return out


def digest(output) -> dict:
    """A run's sorted output as few bytes as expected.json keeps it."""
    return {"records": len(output),
            "sha256": hashlib.sha256(json.dumps(output, separators=(",", ":")).encode()).hexdigest()}


@pytest.mark.parametrize("name", ["savepoint-a288b41", "unaligned-a288b41"])
@pytest.mark.parametrize("p", [2, 3])
def test_a_checkpoint_of_a288b41_restores_to_the_same_state_and_output(tmp_path, monkeypatch, name, p):
    src = os.path.join(DATA, name)
    with open(os.path.join(src, "expected.json")) as f:
        expected = json.load(f)
    starts, output = restore_and_run(monkeypatch, str(tmp_path), src, p)
    want = expected["restored"][str(p)]
    assert sorted(starts) == sorted(want["starts"])
    for task, start in want["starts"].items():
        assert starts[task] == start, task
    # exactly once: each key's counts go on from its restored count up to its total
    got = collections.Counter(tuple(r) for r in output)
    assert not got - all_output()
    for k, total in collections.Counter(x % KEYS for x in range(N)).items():
        counts = sorted(r[2] for r in got if r[0] == "r" and r[1] == k)
        assert counts == list(range(total - len(counts) + 1, total + 1)), k
    if name == "unaligned-a288b41":
        # it held in-flight items, and they came back
        assert any(k == "inflight" and v for start in starts.values() for k, v in start)
    assert digest(output) == want["output"]


def shape(value):
    """What a stored value is made of, without its data: dicts by key, lists
    item by item (their lengths are the graph's), the rest by type."""
    if isinstance(value, dict):
        return {str(k): shape(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [shape(v) for v in value]
    return type(value).__name__


def test_a_savepoint_written_now_has_the_layout_a288b41_wrote(tmp_path):
    """Writing did not change either: a savepoint of the same job taken now
    holds, in its metadata and in every task file, the very fields (and
    types) the one a288b41 wrote holds."""
    now = str(tmp_path / "now")
    stop_with_savepoint(str(tmp_path), now)
    old, new = SavepointStorage(os.path.join(DATA, "savepoint-a288b41")), SavepointStorage(now)
    m_old, m_new = old.latest(), new.latest()
    assert sorted(m_new.tasks) == sorted(m_old.tasks)
    # (commits and alignment figures are per task key, and layout's summaries per subtask: same keys)
    assert shape(m_new.properties) == shape(m_old.properties)
    for key in m_old.tasks:
        assert shape(new.read_task_state(m_new.checkpoint_id, key, metadata=m_new).state) == \
            shape(old.read_task_state(m_old.checkpoint_id, key, metadata=m_old).state), key
