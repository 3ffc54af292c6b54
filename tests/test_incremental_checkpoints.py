"""Incremental checkpoints (issue 21, "checkpoint cost on long runs"): a
checkpoint writes only the key groups that changed since the last complete
one and refers to earlier checkpoints' files for the others.

The Hypothesis test drives the real subtask side (``SubtaskCheckpoints`` with
a ``KeyedReduce``), the real coordinator and storage through random updates,
checkpoints (completed, aborted, completed with the notification lost),
savepoints and retention, keeping a full copy of the state at every
checkpoint as the reference: each checkpoint that retention keeps restores
to exactly that copy, at its own parallelism and at another one.
"""
from __future__ import annotations

import ast
import collections
import os
import shutil
import tempfile
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf.checkpoint import CheckpointStorage, CorruptCheckpointError, SavepointStorage
from pyflowbuf.checkpoint import dumps, loads, shared
from pyflowbuf.checkpoint.columns import decode_map, decode_rows, encode_map
from pyflowbuf.checkpoint import keygroups as kg
from pyflowbuf.checkpointing.coordinator import CheckpointSettings, CheckpointCoordinator
from pyflowbuf.checkpointing.restore import task_key
from pyflowbuf.checkpointing.restore_point import latest_checkpoint, restore_plan
from pyflowbuf.checkpointing.subtask import SubtaskCheckpoints
from pyflowbuf.operators.keyed import KeyedReduce
from pyflowbuf.checkpointing.restore import RestorePlan
from pipeline_helpers import cancel_and_join


def _count(a, b):
    return (a[0], a[1] + b[1])


class _Writer:
    """The snapshot writer, run by hand: writes wait until ``run()``."""

    def __init__(self):
        self.queue = []

    def submit(self, fn, *args):
        self.queue.append((fn, args))
        return True

    def run(self):
        q, self.queue = self.queue, []
        for fn, args in q:
            fn(*args)


class _Execution:
    def __init__(self):
        self.completed = []

    def trigger_sources(self, n, options=None):
        pass

    def notify_complete(self, n):
        self.completed.append(n)

    def abort_checkpoint(self, n):
        pass

    def stop_after_savepoint(self, n):
        pass


class _Job:
    """p subtasks of one keyed reduce (uid "count"), records routed by key group."""

    def __init__(self, root, p, maxp, retained, incremental=True):
        self.p, self.maxp = p, maxp
        config = CheckpointSettings(interval=1.0, directory=root, retained=retained, max_parallelism=maxp,
                                  incremental=incremental)
        self.storage = CheckpointStorage(root, retained=retained, fsync=False)
        self.coordinator = CheckpointCoordinator(config, self.storage)
        self.execution = _Execution()
        self.writer = _Writer()
        vertex = SimpleNamespace(id=1, name="count", parallelism=p,
                                 head=SimpleNamespace(operator_uid=None, source=None), nodes=[])
        self.tasks = []
        for i in range(p):
            op = KeyedReduce("count", lambda r: r[0], _count)
            op.uid = "count"
            task = SimpleNamespace(vertex=vertex, index=i, operators=[op], outputs=[], source=None, input=None)
            task.checkpoints = SubtaskCheckpoints(task, [])
            task.checkpoints.attach(self.coordinator, self.writer)
            self.tasks.append(task)
        self.coordinator.attach(self.execution, [task_key(vertex, i) for i in range(p)])

    def process(self, keys):
        per = collections.defaultdict(list)
        for k in keys:
            per[kg.operator_index(self.maxp, self.p, kg.key_group(k, self.maxp))].append((k, 1))
        for i, batch in per.items():
            self.tasks[i].operators[0].process_batch(batch)

    def state(self) -> dict:
        out = {}
        for t in self.tasks:
            out.update(t.operators[0].state)
        return out

    def checkpoint(self, outcome="complete", savepoint=None):
        n = self.coordinator.trigger(savepoint=savepoint)
        assert n is not None
        for t in self.tasks:
            t.checkpoints.snapshot_and_write(n)
        if outcome == "abort":
            self.coordinator.abort(n, "test")
        self.writer.run()
        if n in self.execution.completed and outcome != "lost":
            for t in self.tasks:            # the mail each subtask gets
                t.checkpoints.confirm(n)
        return n


def restored(storage, meta, maxp, p2) -> list:
    """The state each of ``p2`` new subtasks gets from ``meta``."""
    plan = RestorePlan(storage, meta, maxp)
    vertex = SimpleNamespace(parallelism=p2)
    out = []
    for i in range(p2):
        op = KeyedReduce("count", lambda r: r[0], _count)
        out.append(plan._operator_state(op, "count", vertex, i) or {})
    return out


def check_restores(storage, meta, maxp, p2, want):
    parts = restored(storage, meta, maxp, p2)
    merged = {}
    for i, part in enumerate(parts):
        start, end = kg.key_group_range(maxp, p2, i)
        assert all(start <= kg.key_group(k, maxp) < end for k in part)
        merged.update(part)
    assert merged == want, f"checkpoint {meta.checkpoint_id} restored at parallelism {p2}"


actions = st.lists(st.one_of(
    # a few keys per batch: most key groups stay unchanged between checkpoints
    st.tuples(st.just("batch"), st.lists(st.integers(0, 200), min_size=1, max_size=4)),
    # and now and then most of them change (the subtask stops recording changes for a while)
    st.tuples(st.just("batch"), st.lists(st.integers(0, 200), min_size=60, max_size=120)),
    st.tuples(st.just("checkpoint"), st.sampled_from(["complete", "complete", "complete", "abort", "lost"])),
    st.tuples(st.just("savepoint"), st.just(None)),
), min_size=1, max_size=30)


@settings(max_examples=80, deadline=None)
@given(actions=actions, p1=st.integers(1, 3), p2=st.integers(1, 4), maxp=st.sampled_from([4, 16, 128]),
       retained=st.integers(1, 3))
def test_every_retained_incremental_checkpoint_restores_the_state_it_was_taken_of(actions, p1, p2, maxp,
                                                                                  retained):
    with tempfile.TemporaryDirectory() as root:
        job = _Job(os.path.join(root, "chk"), p1, maxp, retained)
        reference, savepoints = {}, {}
        for what, arg in actions:
            if what == "batch":
                job.process(arg)
                continue
            want = job.state()
            sp = os.path.join(root, f"sp-{len(savepoints)}") if what == "savepoint" else None
            n = job.checkpoint(arg or "complete", sp)
            if n in job.execution.completed:
                (savepoints if sp else reference)[n] = (sp, want)
        kept = job.storage.list_complete()
        # retention keeps the newest `retained` complete checkpoints, and each restores whole
        assert [m.checkpoint_id for m in kept] == sorted(reference)[-retained:]
        for meta in kept:
            check_restores(job.storage, meta, maxp, p1, reference[meta.checkpoint_id][1])
            check_restores(job.storage, meta, maxp, p2, reference[meta.checkpoint_id][1])
            assert set(shared.referenced_ids(meta)) < set(reference)
        # a directory is kept only as a retained checkpoint or for the files they refer to
        needed = shared.needed_files(kept)
        assert set(job.storage.checkpoint_ids()) <= {m.checkpoint_id for m in kept} | set(needed)
        for n, (sp, want) in savepoints.items():
            sps = SavepointStorage(sp)
            meta = sps.load_metadata(sps.checkpoint_id)
            assert not shared.references(meta)      # always whole
            check_restores(sps, meta, maxp, p2, want)


def test_an_unchanged_group_is_not_written_again_and_a_changed_one_is(tmp_path):
    maxp = 128
    job = _Job(str(tmp_path / "chk"), 1, maxp, retained=2)
    keys = list(range(20))
    job.process(keys)
    first = job.storage.load_metadata(job.checkpoint())
    assert not shared.references(first)               # the first checkpoint is whole
    hot = [k for k in keys if kg.key_group(k, maxp) == kg.key_group(0, maxp)]
    job.process(hot)
    second = job.storage.load_metadata(job.checkpoint())
    refs = shared.references(second)
    assert [r["checkpoint"] for r in refs] == [first.checkpoint_id]
    info = second.properties["operators"]["count"]["subtasks"]
    assert second.state_bytes < first.state_bytes
    assert second.properties["layout"]["v1-0"]["refs"] == [first.checkpoint_id]
    check_restores(job.storage, second, maxp, 1, job.state())
    check_restores(job.storage, second, maxp, 3, job.state())
    assert info


def test_incremental_checkpoints_off_writes_every_group(tmp_path):
    job = _Job(str(tmp_path / "chk"), 1, 8, retained=2, incremental=False)
    job.process(range(50))
    job.checkpoint()
    job.process([1])
    meta = job.storage.load_metadata(job.checkpoint())
    assert not shared.references(meta)
    assert job.tasks[0].operators[0].touched is None          # nothing recorded per record


def test_a_group_is_rewritten_once_its_copy_is_old(tmp_path):
    job = _Job(str(tmp_path / "chk"), 1, 128, retained=1)
    job.process(range(20))
    first = job.checkpoint()
    for _ in range(kg.INCREMENTAL_MAX_AGE + 2):
        job.process([0])
        last = job.checkpoint()
    refs = shared.references(job.storage.load_metadata(last))
    assert all(r["checkpoint"] > first for r in refs)
    assert first not in job.storage.checkpoint_ids()              # nothing refers to it any more
    assert refs
    check_restores(job.storage, job.storage.load_metadata(last), 128, 2, job.state())


def test_while_most_groups_change_changes_are_not_recorded_and_checkpoints_are_whole(tmp_path):
    maxp = 8
    job = _Job(str(tmp_path / "chk"), 1, maxp, retained=2)
    op = job.tasks[0].operators[0]
    assert op.touched == set()
    job.process(range(100))                 # every group
    job.checkpoint()
    assert op.touched is None               # no set insert per record from here on
    for i in range(kg.TRACK_PROBE_EVERY):
        job.process(range(i, i + 3))
        meta = job.storage.load_metadata(job.checkpoint())
        assert not shared.references(meta)          # whole: the changes were not recorded
        check_restores(job.storage, meta, maxp, 2, job.state())
    assert op.touched == set()              # a probe: recording again
    job.process([5])
    meta = job.storage.load_metadata(job.checkpoint())
    assert shared.references(meta) and op.touched == set()
    check_restores(job.storage, meta, maxp, 3, job.state())


def _torn_chain(tmp_path):
    job = _Job(str(tmp_path / "chk"), 1, 128, retained=3)
    job.process(range(20))
    base = job.checkpoint()
    job.process([0])
    job.checkpoint()
    job.process([0])
    newest = job.checkpoint()
    meta = job.storage.load_metadata(newest)
    assert [r["checkpoint"] for r in shared.references(meta)] == [base]
    path = os.path.join(job.storage.checkpoint_path(base), shared.references(meta)[0]["file"])
    return job, base, newest, path


def test_a_torn_file_in_the_chain_makes_every_checkpoint_referring_to_it_corrupt(tmp_path):
    job, base, newest, path = _torn_chain(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 3)
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint {base}"):
        job.storage.load_metadata(newest, verify=False)
    assert {i.checkpoint_id: i.status for i in job.storage.scan()} == \
        {base: "CORRUPT", base + 1: "CORRUPT", newest: "CORRUPT"}
    with pytest.raises(CorruptCheckpointError, match="no intact checkpoint"):
        latest_checkpoint(job.storage)          # refused, not restored from scratch silently


def test_a_flipped_byte_in_a_referenced_file_is_found_by_verify(tmp_path):
    job, base, newest, path = _torn_chain(tmp_path)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    job.storage.load_metadata(newest, verify=False)       # sizes still match
    with pytest.raises(CorruptCheckpointError):
        job.storage.load_metadata(newest, verify=True)


def test_an_incremental_checkpoint_copied_elsewhere_is_refused_with_a_pointer_to_savepoints(tmp_path):
    job, base, newest, path = _torn_chain(tmp_path)
    copy = tmp_path / "moved" / f"chk-{newest}"
    shutil.copytree(job.storage.checkpoint_path(newest), copy)
    with pytest.raises(CorruptCheckpointError, match="savepoint"):
        restore_plan(job.storage, str(copy))


def test_retention_retires_a_referenced_checkpoint_and_removes_it_once_unreferenced(tmp_path):
    job = _Job(str(tmp_path / "chk"), 1, 128, retained=1)
    job.process(range(20))
    base = job.checkpoint()
    job.process([0])
    job.checkpoint()
    ids = job.storage.checkpoint_ids()
    assert base in ids
    info = {i.checkpoint_id: i for i in job.storage.scan()}
    assert info[base].status == "INCOMPLETE" and "retired" in str(info[base].error)
    assert sorted(os.listdir(job.storage.checkpoint_path(base))) == \
        sorted([shared.RETIRED_FILE] + [r["file"] for r in shared.references(job.storage.latest())])


def _keyed_job(env, n, out):
    (env.from_sequence(0, n, rate_limit=5_000).uid("numbers")
        .map(lambda x: (x % 997 if x < 2000 else x % 5, 1), kind="struct", name="pair")
        .key_by(lambda kv: kv[0])
        .reduce(_count, name="count").uid("count")
        .write_text(out))


def _committed(out) -> collections.Counter:
    got: collections.Counter = collections.Counter()
    for name in os.listdir(out):
        if name.startswith("part-"):          # committed parts only (pending ones are hidden)
            with open(os.path.join(out, name)) as fh:
                got.update(ast.literal_eval(line) for line in fh if line.strip())
    return got


def test_a_job_resumed_from_an_incremental_checkpoint_at_another_parallelism(tmp_path):
    """End to end: a keyed count at parallelism 2 with incremental
    checkpoints is cancelled; resumed from its latest checkpoint (which
    refers to earlier ones) at parallelism 3 it counts every record once."""
    n = 15_000
    ck, out = str(tmp_path / "chk"), str(tmp_path / "out")
    env = fb.Environment(parallelism=2, chaining=False, checkpoint_interval=0.05, checkpoint_dir=ck,
                         checkpoints_retained=1)
    _keyed_job(env, n, out)
    job = env.execute_async()
    storage = CheckpointStorage(ck)
    deadline = 200
    while deadline:
        meta = storage.latest(verify=False)
        if meta is not None and shared.references(meta):
            break
        deadline -= 1
        time.sleep(0.05)
    cancel_and_join(job, failure_ok=True)
    meta = storage.latest()
    assert meta is not None and shared.references(meta), "no incremental checkpoint was taken"
    env2 = fb.Environment(parallelism=3, chaining=False, checkpoint_interval=0.05, checkpoint_dir=ck)
    _keyed_job(env2, n, out)
    env2.execute(120, restore_from="latest")
    counts = collections.Counter(x % 997 if x < 2000 else x % 5 for x in range(n))
    want = collections.Counter((k, c) for k, total in counts.items() for c in range(1, total + 1))
    assert _committed(out) == want


scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=3))
values = st.one_of(scalars, st.tuples(scalars, scalars), st.tuples(st.integers(), st.floats(allow_nan=False)),
                   st.tuples(), st.lists(scalars, max_size=2), st.dictionaries(st.text(max_size=2), scalars))


@settings(max_examples=200, deadline=None)
@given(d=st.one_of(st.dictionaries(st.one_of(st.integers(), st.text(max_size=3), st.booleans()), values),
                   st.dictionaries(st.integers(), st.tuples(st.integers(), st.integers())),
                   st.dictionaries(st.integers(), st.floats(allow_nan=False))))
def test_a_map_stored_by_columns_comes_back_exactly(d):
    """Exact types (a bool stays a bool, an int beyond 64 bits an int, a
    tuple a tuple), the same order, through the codec."""
    back = decode_map(loads(dumps(encode_map(d))))
    assert list(back.items()) == list(d.items())
    assert [(type(k), type(v)) for k, v in back.items()] == [(type(k), type(v)) for k, v in d.items()]
    assert all(repr(a) == repr(b) for a, b in zip(back.values(), d.values()))


@settings(max_examples=100, deadline=None)
@given(d=st.dictionaries(st.integers(), st.one_of(st.tuples(st.integers(), st.text(max_size=2)), st.floats(),
                                                  st.text(max_size=2))), data=st.data())
def test_rows_of_a_map_stored_by_columns_are_those_entries(d, data):
    rows = sorted(data.draw(st.sets(st.integers(0, max(len(d) - 1, 0)), max_size=len(d))))
    m = loads(dumps(encode_map(d)))
    items = list(d.items())
    assert repr(list(decode_rows(m, rows).items())) == repr([items[j] for j in rows])
