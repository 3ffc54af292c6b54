"""Rescaling by key groups (issue 21): a keyed job stopped with a savepoint at
parallelism p1 and resumed at p2 commits exactly what one uninterrupted run
would, per key, once.

The job: a sequence source -> event time -> key_by -> (a rolling count, a
keyed process function with event-time timers, a tumbling window), each into
a ``write_text`` sink; only committed part files count. The expected output
comes from a pure-Python model of the same computation.
"""
from __future__ import annotations

import ast
import collections
import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf.checkpoint import SavepointStorage
from pyflowbuf.errors import ConfigurationError
from pyflowbuf.checkpoint import keygroups as kg
from pipeline_helpers import held_sequence, wait_until_held
from reference_model import ref_stable_hash
from test_serde import Pipe, read_channel

KEYS = 13
WINDOW = 5.0
COUNT = 7


def per_second_counts(keyed):
    """Each key's records per event-time second, counted in keyed state and
    emitted as ``("t", key, second, count)`` by an event-time timer."""
    def per_second(key, rec, state, ctx):
        b = int(rec[1])
        state[b] = state.get(b, 0) + 1
        ctx.register_event_time_timer(b + 1)

    def fire(key, t, state, ctx):
        b = int(t) - 1
        return [("t", key, b, state.pop(b, 0))]

    return keyed.process(per_second, on_timer=fire).uid("seconds")


def keyed_job(env, p, n, out, rate, kinds=("reduce", "timers", "window"), hold=None):
    """``hold=(hold_at, release)``: the source holds at ``hold_at`` until the
    file ``release`` exists (pipeline_helpers.HeldSequenceSource), so the test
    stops or savepoints a job that is still running."""
    if hold is None:
        src = env.from_sequence(0, n, parallelism=p, rate_limit=rate).uid("numbers")
    else:
        src = held_sequence(env, n, parallelism=p, rate_limit=rate, hold_at=hold[0], release=hold[1]).uid("numbers")
    keyed = (src.map(lambda x: (x % KEYS, x / 100.0, 1))
             .assign_timestamps(lambda r: r[1]).uid("event-time")
             .key_by(lambda r: r[0]))
    if "reduce" in kinds:
        (keyed.reduce(lambda a, b: (a[0], b[1], a[2] + b[2])).uid("counts")
              .map(lambda r: ("r", r[0], r[2])).write_text(os.path.join(out, "reduce")))
    if "timers" in kinds:
        per_second_counts(keyed).write_text(os.path.join(out, "timers"))
    if "count_trigger" in kinds:
        (keyed.window(fb.Tumbling(WINDOW), trigger=fb.CountTrigger(COUNT))
              .reduce(lambda a, b: (a[0], a[1], a[2] + b[2]),
                      window_function=lambda key, w, r: ("c", key, w.start, r[2])).uid("counted")
              .write_text(os.path.join(out, "counted")))
    if "window" in kinds:
        (keyed.window(fb.Tumbling(WINDOW))
              .reduce(lambda a, b: (a[0], a[1], a[2] + b[2]),
                      window_function=lambda key, w, r: ("w", key, w.start, r[2])).uid("windows")
              .write_text(os.path.join(out, "window")))


def expected(n, kinds=("reduce", "timers", "window")) -> collections.Counter:
    """What one uninterrupted run commits, as a multiset of records."""
    out: collections.Counter = collections.Counter()
    per_key = collections.Counter(x % KEYS for x in range(n))
    if "reduce" in kinds:
        for k, c in per_key.items():
            out.update(("r", k, i) for i in range(1, c + 1))
    if "timers" in kinds:
        out.update(("t", k, b, c) for (k, b), c in collections.Counter(
            (x % KEYS, int(x / 100.0)) for x in range(n)).items())
    if "count_trigger" in kinds:
        # a CountTrigger fires every COUNT records of a window, with all it holds
        for (k, s), c in collections.Counter((x % KEYS, (x / 100.0) // WINDOW * WINDOW) for x in range(n)).items():
            out.update(("c", k, s, COUNT * m) for m in range(1, c // COUNT + 1))
    if "window" in kinds:
        out.update(("w", k, s, c) for (k, s), c in collections.Counter(
            (x % KEYS, (x / 100.0) // WINDOW * WINDOW) for x in range(n)).items())
    return out


def committed(out) -> collections.Counter:
    got: collections.Counter = collections.Counter()
    for sub in ("reduce", "timers", "window", "counted"):
        d = os.path.join(out, sub)
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            if name.startswith("part-"):          # committed parts only (pending ones are hidden)
                with open(os.path.join(d, name)) as fh:
                    got.update(ast.literal_eval(line) for line in fh if line.strip())
    return got


def run_stop_resume(tmp, p1, p2, n, stop_after, rate, kinds=("reduce", "timers", "window")):
    """``stop_after``: the fraction of the input read when the job is stopped."""
    out, ck, sp = os.path.join(tmp, "out"), os.path.join(tmp, "ck"), os.path.join(tmp, "sp")
    release = os.path.join(tmp, "release")
    env = fb.Environment(parallelism=p1, checkpoint_interval=0.1, checkpoint_dir=ck)
    keyed_job(env, p1, n, out, rate, kinds, hold=(int(n * stop_after), release))
    job = env.execute_async()
    wait_until_held(release, p1, job)
    path = job.stop(savepoint=sp)
    assert job.stopped_with_savepoint is not None
    env2 = fb.Environment(parallelism=p2, checkpoint_interval=0.1, checkpoint_dir=ck)
    keyed_job(env2, p2, n, out, rate, kinds)
    env2.execute(120, restore_from=path)
    return committed(out)


@settings(max_examples=6)
@given(p1=st.integers(1, 4), p2=st.integers(1, 4), stop_after=st.floats(0.3, 0.9))
def test_a_keyed_job_resumed_at_another_parallelism_commits_each_result_once(tmp_path_factory, p1, p2,
                                                                              stop_after):
    tmp = str(tmp_path_factory.mktemp("rescale"))
    n = 3000
    got = run_stop_resume(tmp, p1, p2, n, stop_after, rate=2500)
    want = expected(n)
    assert got == want, (p1, p2, sorted((want - got).items())[:5], sorted((got - want).items())[:5])


def test_a_savepoint_taken_while_running_restores_at_more_subtasks(tmp_path):
    """job.savepoint() leaves the job running; its state restores at 4."""
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    release = str(tmp_path / "release")
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=ck)
    keyed_job(env, 2, 2000, out, rate=4000, kinds=("reduce",), hold=(1000, release))
    job = env.execute_async()
    wait_until_held(release, 2, job)
    sp = job.savepoint(str(tmp_path / "sp"))
    open(release, "w").close()      # the job reads on to the end
    job.join(60)
    meta = SavepointStorage(sp).latest()
    assert meta.properties["savepoint"] is True
    counts = meta.properties["operators"]["counts"]
    assert counts["keyed"] and counts["parallelism"] == 2
    assert sorted(s["key_groups"] for s in counts["subtasks"].values()) == [[0, 64], [64, 128]]
    assert any(c.get("savepoint") and c["status"] == "completed" for c in env.checkpoints())
    # Restoring the savepoint into the same output: the parts committed after
    # it are written again, so what is committed in the end is one run's worth
    env2 = fb.Environment(parallelism=4, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck2"))
    keyed_job(env2, 4, 2000, out, rate=None, kinds=("reduce",))
    env2.execute(60, restore_from=sp)
    assert committed(out) == expected(2000, kinds=("reduce",))


def test_a_restore_at_fewer_subtasks_removes_what_the_gone_subtasks_wrote_after_it(tmp_path):
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    release = str(tmp_path / "release")
    env = fb.Environment(parallelism=4, checkpoint_interval=0.05, checkpoint_dir=ck)
    keyed_job(env, 4, 3000, out, rate=6000, kinds=("reduce",), hold=(1500, release))
    job = env.execute_async()
    wait_until_held(release, 4, job)
    sp = job.savepoint(str(tmp_path / "sp"))
    open(release, "w").close()      # the job reads on to the end
    job.join(60)
    assert committed(out) == expected(3000, kinds=("reduce",))
    env2 = fb.Environment(parallelism=1, checkpoint_interval=0.1, checkpoint_dir=ck)
    keyed_job(env2, 1, 3000, out, rate=None, kinds=("reduce",))
    env2.execute(60, restore_from=sp)
    assert committed(out) == expected(3000, kinds=("reduce",))


def test_changing_max_parallelism_is_refused(tmp_path):
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=ck)
    release = str(tmp_path / "release")
    keyed_job(env, 2, 2000, out, rate=4000, kinds=("reduce",), hold=(1000, release))
    job = env.execute_async()
    wait_until_held(release, 2, job)
    sp = job.stop(savepoint=str(tmp_path / "sp"))
    env2 = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=ck, max_parallelism=256)
    keyed_job(env2, 2, 2000, out, rate=None, kinds=("reduce",))
    with pytest.raises(ConfigurationError, match="max_parallelism=128"):
        env2.execute(60, restore_from=sp)


def test_max_parallelism_is_checked():
    with pytest.raises(ConfigurationError, match="max_parallelism"):
        fb.Environment(max_parallelism=0)
    with pytest.raises(ConfigurationError, match="max_parallelism"):
        fb.Environment(max_parallelism=40000)
    env = fb.Environment(parallelism=4, max_parallelism=2)
    env.from_sequence(0, 10).key_by(lambda x: x).reduce(lambda a, b: a).collect()
    with pytest.raises(ConfigurationError, match="above max_parallelism=2"):
        env.execute(10)


def test_key_by_sends_each_key_to_the_owner_of_its_key_group():
    """Where records land equals the pure-Python model of key groups."""

    env = fb.Environment(parallelism=3, max_parallelism=10)
    keys = [f"k{i}" for i in range(300)]
    out = (env.from_collection(keys).key_by(lambda k: k)
              .process(lambda k, x, state, ctx: [(k, ctx._op.subtask)]).collect())
    env.execute(30)
    for k, sub in out.result:
        group = ref_stable_hash(k) % 10
        assert sub == group * 3 // 10
        start, end = kg.key_group_range(10, 3, sub)
        assert start <= group < end


@given(maxp=st.integers(1, 600), p=st.integers(1, 600))
def test_key_group_ranges_match_the_reference(maxp, p):
    """Contiguous, covering, disjoint ranges; the owner of each group is the
    subtask whose range holds it (Flink's KeyGroupRangeAssignment)."""
    if p > maxp:
        return
    ranges = [kg.key_group_range(maxp, p, i) for i in range(p)]
    assert ranges[0][0] == 0 and ranges[-1][1] == maxp
    for (s0, e0), (s1, _) in zip(ranges, ranges[1:]):
        assert e0 == s1 and s0 < e0
    for g in range(0, maxp, max(1, maxp // 50)):
        i = kg.operator_index(maxp, p, g)
        assert ranges[i][0] <= g < ranges[i][1]
        # the reference: ceil(i * maxp / p) starts subtask i's range
        assert ranges[i][0] == -(-i * maxp // p)


@given(st.lists(st.one_of(st.integers(-2**70, 2**70), st.text(max_size=8), st.binary(max_size=8),
                          st.tuples(st.integers(), st.text(max_size=3))), max_size=50),
       st.integers(1, 32768))
def test_key_groups_in_bulk_match_the_pure_python_hash(keys, maxp):
    assert kg.key_groups(keys, maxp) == [ref_stable_hash(k) % maxp for k in keys]
    assert [kg.key_group(k, maxp) for k in keys] == [ref_stable_hash(k) % maxp for k in keys]


def test_workers_stop_with_savepoint_and_resume_at_another_parallelism(tmp_path):
    """With workers=2 each worker process restores its own subtasks' key groups."""
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    release = str(tmp_path / "release")
    env = fb.Environment(parallelism=2, workers=2, checkpoint_interval=0.1, checkpoint_dir=ck)
    keyed_job(env, 2, 4000, out, rate=3000, hold=(2000, release))
    job = env.execute_async()
    wait_until_held(release, 2, job)
    sp = job.stop(savepoint=str(tmp_path / "sp"))
    assert sum(committed(out).values()) < sum(expected(4000).values())
    env2 = fb.Environment(parallelism=3, workers=2, checkpoint_interval=0.1, checkpoint_dir=ck)
    keyed_job(env2, 3, 4000, out, rate=None)
    env2.execute(120, restore_from=sp)
    assert committed(out) == expected(4000)


@settings(max_examples=30)
@given(keys=st.lists(st.one_of(st.integers(-50, 50), st.text(max_size=3)), max_size=30, unique=True),
       maxp=st.integers(1, 64), p=st.integers(1, 8))
def test_keyed_state_split_by_group_and_merged_per_range_is_the_state_of_the_range(keys, maxp, p):
    """The stored keyed state of a window operator and a keyed process
    operator (every entry with its key group): restored whole it is the
    snapshot; restored for a subtask's range it holds exactly that range's
    keys, their windows and their timers."""
    from pyflowbuf.time.process import KeyedProcessOperator
    from pyflowbuf.windows.operator import WindowOperator, WindowSpec

    if p > maxp:
        return
    win = WindowOperator("w", WindowSpec(fb.Tumbling(5.0), lambda r: r[0], lambda r: r[1]), "reduce",
                         lambda a, b: a)
    proc = KeyedProcessOperator("p", lambda r: r[0], None, lambda k, x, st, ctx: None, on_timer=lambda *a: None)
    for i, k in enumerate(keys):
        win.windows[(k, 0.0, 5.0)] = i
        win.timers.event.register((k, 0.0, 5.0), 5.0)
        win.cleanup.register((k, 0.0, 5.0), 5.0)
        proc.state[k] = {"n": i}
        proc.timers.event.register(k, float(i % 3))
        proc.timers.processing.register(k, 100.0 + i)
    win.timers.advance(1.0)
    from pyflowbuf.checkpoint import dumps, loads
    from pyflowbuf.checkpointing.restore import keyed_restore, keyed_value

    for op in (win, proc):
        snap = op.snapshot_state()
        value, present = keyed_value(op, snap, maxp, 0, maxp, op.name, 0)
        value = loads(dumps(value))          # as a restore reads it back
        assert present == len({kg.key_group(k, maxp) for k in keys})
        whole = keyed_restore(op, [(value, None)])
        assert repr(whole) == repr(snap)     # at the same parallelism: the snapshot as it was
        seen = []
        for i in range(p):
            start, end = kg.key_group_range(maxp, p, i)
            mine = [k for k in keys if start <= kg.key_group(k, maxp) < end]
            merged = keyed_restore(op, [(value, i == 0)], start, end)
            if op is win:
                assert sorted(map(repr, merged["windows"])) == sorted(repr((k, 0.0, 5.0)) for k in mine)
                assert sorted(repr(k) for _, ks in merged["timers"]["event"] for k in ks) == \
                    sorted(repr((k, 0.0, 5.0)) for k in mine)
                assert merged["timers"]["watermark"] == 1.0
            else:
                assert {repr(k): v for k, v in merged["state"].items()} == \
                    {repr(k): proc.state[k] for k in mine}
                assert sorted(repr(k) for _, ks in merged["timers"]["processing"] for k in ks) == \
                    sorted(repr(k) for k in mine)
            seen.extend(mine)
        assert sorted(map(repr, seen)) == sorted(map(repr, keys))


def test_a_monitored_directory_resumes_at_another_parallelism(tmp_path):
    """read_text(monitor=...): the files read and those being read move to
    their owners at the new parallelism; every line is read once."""
    src = tmp_path / "in"
    src.mkdir()

    def files(ids):
        for i in ids:
            (src / f"f{i}.txt").write_text("".join(f"{i}-{j}\n" for j in range(400)))

    def build(p, rate, end_after):
        env = fb.Environment(parallelism=p, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"))
        out = (env.read_text(str(src), monitor=0.05, monitor_timeout=end_after, parallelism=p, rate_limit=rate)
                  .uid("lines").key_by(lambda line: line.split("-")[0])
                  .reduce(lambda a, b: b).uid("last").collect())
        return env, out

    files(range(4))
    env, o1 = build(2, 2000, None)      # watching without an end: running until stopped
    job = env.execute_async()
    deadline = time.monotonic() + 120
    while not any(m.get("records_in", 0) > 0 for task, m in env.metrics().items() if "reduce" in task):
        assert time.monotonic() < deadline and not job.done, "no line reached the reduce"
        time.sleep(0.05)
    sp = job.stop(savepoint=str(tmp_path / "sp"))
    files(range(4, 8))                  # the rest comes while the job is stopped
    env, o2 = build(3, None, 0.5)
    env.execute(60, restore_from=sp)
    lines = o1.result + o2.result
    assert o1.result and o2.result
    assert sorted(lines) == sorted(f"{i}-{j}" for i in range(8) for j in range(400))


@given(st.lists(st.one_of(st.integers(-2**70, 2**70), st.text(max_size=6)), max_size=60),
       st.integers(1, 6), st.sampled_from([6, 7, 10, 64, 128, 1000, 4096, 32768]))
def test_the_record_writer_routes_by_key_group(keys, channels, maxp):
    """write_batch_keyed(..., max_parallelism) against the pure-Python model,
    for powers of two (a mask and a shift) and other sizes (divisions)."""
    if channels > maxp:
        return
    p = Pipe(channels=channels, kind="pickle", segments=64)
    records = [(i, k) for i, k in enumerate(keys)]
    p.writer.write_batch_keyed(records, keys, max_parallelism=maxp)
    p.writer.end_input()
    for ch in range(channels):
        expect = [rec for rec, k in zip(records, keys) if (ref_stable_hash(k) % maxp) * channels // maxp == ch]
        assert read_channel(p, ch) == expect


@pytest.mark.parametrize("p1, p2", [(2, 3), (3, 1)])
def test_count_trigger_windows_resume_at_another_parallelism(tmp_path, p1, p2):
    """Windows with a trigger keep their counts per window across a rescale."""
    got = run_stop_resume(str(tmp_path), p1, p2, 3000, 0.5, rate=2500, kinds=("count_trigger",))
    assert got == expected(3000, kinds=("count_trigger",))
