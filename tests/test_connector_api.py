"""The public connector API (``fb.Source``, ``fb.Sink``): splits dealt out by
``owner``, a position per split in every checkpoint, redistribution on a
restore at another parallelism, the identity check; a sink's two-phase
commit, exactly once through failures and at the end of input."""
from __future__ import annotations

import collections
import glob
import os

import pytest

import pyflowbuf as fb
from pyflowbuf.checkpoint.errors import IncompatibleCheckpointError
from pipeline_helpers import FailOnceInJob as FailOnce, wait_for


class Numbers(fb.Source):
    """0..n-1 in ``parts`` splits; split s holds s, s + parts, ..."""

    def __init__(self, n, parts, bounded=True, tag="numbers"):
        self.n, self.parts, self.bounded, self.tag = n, parts, bounded, tag

    def splits(self):
        return list(range(self.parts))

    def read(self, split, position, max_records):
        start = split if position is None else position
        out = list(range(start, self.n, self.parts)[:min(max_records, 50)])
        nxt = out[-1] + self.parts if out else start
        return out, nxt, self.bounded and nxt >= self.n

    def identity(self):
        return {"tag": self.tag, "parts": self.parts}


class Files(fb.Sink):
    """Part files renamed into place when a checkpoint completes."""

    def __init__(self, folder):
        self.folder = folder

    def open(self, subtask, parallelism):
        self.subtask, self.lines = subtask, []

    def write(self, batch):
        self.lines.extend(map(str, batch))

    def prepare_commit(self, checkpoint_id):
        tmp = os.path.join(self.folder, f".{self.subtask}-{checkpoint_id}-{os.getpid()}-{id(self)}")
        with open(tmp, "w") as f:
            f.writelines(line + "\n" for line in self.lines)
        self.lines = []
        return [tmp]

    def commit(self, committables):
        for tmp in committables:
            if os.path.exists(tmp):
                os.replace(tmp, tmp.replace("/.", "/part-"))


def committed(folder):
    return collections.Counter(int(line) for p in glob.glob(os.path.join(folder, "part-*")) for line in open(p))


@pytest.mark.parametrize("at", [1, 700, 2900])
def test_source_and_sink_exactly_once_through_a_failure(tmp_path, at):
    out = tmp_path / "out"
    out.mkdir()
    env = fb.Environment(parallelism=2, checkpoint_interval=0.02, checkpoint_dir=str(tmp_path / "chk"),
                         restart_attempts=2)
    (env.from_source(Numbers(6000, 5), name="numbers").map(FailOnce(tmp_path / "failed", at))
        .map(lambda x: (__import__("time").sleep(0.0002), x)[1]).sink_to(Files(str(out))))
    env.execute()
    assert os.path.exists(tmp_path / "failed")
    assert committed(out) == collections.Counter(range(6000))


def test_without_checkpoints_the_sink_commits_at_the_end(tmp_path):
    env = fb.Environment(parallelism=3)
    env.from_source(Numbers(1000, 7)).sink_to(Files(str(tmp_path)))
    env.execute()
    assert committed(tmp_path) == collections.Counter(range(1000))


def test_splits_are_redistributed_on_a_restore_at_another_parallelism(tmp_path):
    out = tmp_path / "out"
    out.mkdir()

    def job(p, bounded):
        env = fb.Environment(parallelism=p, checkpoint_interval=0.05, checkpoint_dir=str(tmp_path / "chk"))
        (env.from_source(Numbers(20000, 6, bounded=bounded), name="numbers").uid("numbers")
            .map(lambda x: (__import__("time").sleep(0.0001), x)[1]).uid("slow")
            .sink_to(Files(str(out)), name="files").uid("files"))
        return env

    job2 = job(2, False).execute_async()
    wait_for(lambda: sum(c.get("status") == "completed" for c in job2.checkpoints()) >= 2, "checkpoints", job=job2)
    sp = job2.stop(savepoint=str(tmp_path / "sp"), timeout=60)
    assert 0 < sum(committed(out).values()) < 20000
    job(3, True).execute(restore_from=sp)
    assert committed(out) == collections.Counter(range(20000))


def test_a_restore_with_another_source_is_refused(tmp_path):
    env = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=str(tmp_path / "chk"))
    env.from_source(Numbers(10 ** 9, 2, bounded=False, tag="a")).uid("s").collect()
    job = env.execute_async()
    wait_for(lambda: any(c.get("status") == "completed" for c in job.checkpoints()), "a checkpoint", job=job)
    sp = job.stop(savepoint=str(tmp_path / "sp"), timeout=60)
    env = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=str(tmp_path / "chk"))
    env.from_source(Numbers(10, 2, tag="b")).uid("s").collect()
    with pytest.raises(IncompatibleCheckpointError, match="tag"):
        env.execute(restore_from=sp)


def test_from_source_takes_a_source():
    env = fb.Environment()
    with pytest.raises(TypeError, match="fb.Source"):
        env.from_source([1, 2, 3])
    with pytest.raises(TypeError, match="fb.Sink"):
        env.from_collection([1]).sink_to(print)


def test_a_file_sink_and_a_user_sink_commit_through_the_same_operator(tmp_path, monkeypatch):
    """write_text and a user's fb.Sink (no Kafka) in one job: both run on
    ConnectorSinkOperator, both commit in their subtasks when checkpoints
    complete and through the driver's final commit at the end, exactly once
    through a failure; no checkpoint lists a rename of its own any more."""
    from pyflowbuf.checkpoint import CheckpointStorage
    from pyflowbuf.connectors import api as capi

    committed_by = collections.Counter()
    notify = capi.ConnectorSinkOperator.notify_checkpoint_complete
    final = capi.run_final_commit

    def notified(self, checkpoint_id):
        if any(0 <= n <= checkpoint_id and cs for n, cs in self.pending):
            committed_by[("subtask", type(self.sink).__name__)] += 1
        return notify(self, checkpoint_id)

    def final_commit(action, sink=None):
        committed_by[("driver", type(capi.committer(action)).__name__)] += 1
        return final(action, sink)

    monkeypatch.setattr(capi.ConnectorSinkOperator, "notify_checkpoint_complete", notified)
    monkeypatch.setattr(capi, "run_final_commit", final_commit)
    text, files = tmp_path / "text", tmp_path / "files"
    files.mkdir()
    env = fb.Environment(parallelism=2, checkpoint_interval=0.02, checkpoint_dir=str(tmp_path / "chk"),
                         restart_attempts=2)
    nums = (env.from_source(Numbers(6000, 5), name="numbers").map(FailOnce(tmp_path / "failed", 2000))
            .map(lambda x: (__import__("time").sleep(0.0002), x)[1]))
    a = nums.map(str, kind="str").write_text(str(text), name="text").uid("text")
    b = nums.sink_to(Files(str(files)), name="files").uid("files")
    ops = [a._node.make_operator(), b._node.make_operator()]
    assert {type(op) for op in ops} == {capi.ConnectorSinkOperator}
    env.execute()
    assert os.path.exists(tmp_path / "failed")
    assert committed(files) == collections.Counter(range(6000))
    assert committed(text) == collections.Counter(range(6000))
    assert not [n for n in os.listdir(text) if n.startswith(".")]
    for sink in ("TextFileSink", "Files"):
        assert committed_by[("subtask", sink)] >= 1, committed_by
        assert committed_by[("driver", sink)] >= 1, committed_by
    for meta in CheckpointStorage(str(tmp_path / "chk")).list_complete():
        assert all(c[0] == "connector" for c in meta.properties["commits"]), meta.properties["commits"]
