"""Savepoints (issue 21): triggered by the user, aligned, self-contained,
relocatable, never pruned, with a format version; stop-with-savepoint."""
from __future__ import annotations

import collections
import json
import os
import re
import shutil
import time

import pytest

import pyflowbuf as fb
from pyflowbuf.checkpoint import CheckpointStateError, CheckpointStorage, SavepointStorage
from pyflowbuf.errors import ConfigurationError
from pipeline_helpers import cancel_and_join, held_sequence, wait_until_held

DATA = os.path.join(os.path.dirname(__file__), "data")


def _numbers(env, n, p, rate, hold):
    """``hold=(hold_at, release)``: the source holds at ``hold_at`` until the
    file ``release`` exists (pipeline_helpers.HeldSequenceSource), so the
    test stops or savepoints a job that is still running."""
    if hold is None:
        return env.from_sequence(0, n, parallelism=p, rate_limit=rate)
    return held_sequence(env, n, parallelism=p, rate_limit=rate, hold_at=hold[0], release=hold[1])


def parquet_job(env, n, out, rate, p=2, hold=None):
    (_numbers(env, n, p, rate, hold).uid("numbers")
        .map(lambda x: {"key": x % 11, "x": x})
        .key_by(lambda r: r["key"])
        .reduce(lambda a, b: {"key": a["key"], "x": b["x"], "n": a.get("n", 1) + 1}).uid("counts")
        .map(lambda r: {"key": r["key"], "x": r["x"], "n": r.get("n", 1)})
        .write_parquet(out))


def read_parquet_dir(path):
    import pyarrow.parquet as pq

    rows = []
    for name in sorted(os.listdir(path)):
        if name.startswith("part-") and name.endswith(".parquet"):
            rows.extend(pq.read_table(os.path.join(path, name)).to_pylist())
    return rows


def test_stop_with_savepoint_then_resume_loses_and_duplicates_nothing(tmp_path):
    n = 8000
    out, ck, sp = str(tmp_path / "out"), str(tmp_path / "ck"), str(tmp_path / "sp")
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=ck)
    release = str(tmp_path / "release")
    parquet_job(env, n, out, rate=4000, hold=(n // 2, release))
    job = env.execute_async()
    wait_until_held(release, 2, job)
    assert job.stop(savepoint=sp) == sp
    assert job.done and job.stopped_with_savepoint is not None
    first = read_parquet_dir(out)
    assert 0 < len(first) < n          # what the savepoint covers is committed, no more
    env2 = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=ck)
    parquet_job(env2, n, out, rate=None)
    env2.execute(60, restore_from=sp)
    rows = read_parquet_dir(out)
    assert sorted(r["x"] for r in rows) == list(range(n))
    per_key = collections.defaultdict(list)
    for r in rows:
        per_key[r["key"]].append(r["n"])
    want = collections.Counter(x % 11 for x in range(n))
    assert {k: sorted(v) for k, v in per_key.items()} == {k: list(range(1, c + 1)) for k, c in want.items()}


def counting(env, n, p, rate, hold=None):
    return (_numbers(env, n, p, rate, hold).uid("numbers")
               .map(lambda x: (x % 7, 1)).key_by(lambda kv: kv[0])
               .reduce(lambda a, b: (a[0], a[1] + b[1])).uid("counts").collect())


def test_a_savepoint_copied_elsewhere_restores(tmp_path):
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"))
    release = str(tmp_path / "release")
    out1 = counting(env, 3000, 2, 3000, hold=(1500, release))
    job = env.execute_async()
    wait_until_held(release, 2, job)
    sp = job.stop(savepoint=str(tmp_path / "sp"))
    moved = str(tmp_path / "elsewhere" / "my-savepoint")
    shutil.copytree(sp, moved)
    shutil.rmtree(sp)
    env2 = fb.Environment(parallelism=3, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "other-ck"))
    out2 = counting(env2, 3000, 3, None)
    env2.execute(60, restore_from=moved)
    final = {}
    for k, c in out1.result + out2.result:
        final[k] = max(final.get(k, 0), c)
    assert final == dict(collections.Counter(x % 7 for x in range(3000)))
    assert len(out1.result) + len(out2.result) == 3000


def test_a_savepoint_of_an_earlier_release_restores():
    """tests/data/savepoint-format-2 was written by the release that
    introduced savepoints (tests/data/make_savepoint_format2.py): it must
    restore in every later one."""
    import tempfile

    src = os.path.join(DATA, "savepoint-format-2")
    with open(os.path.join(src, "expected.json")) as f:
        expected = json.load(f)
    meta = SavepointStorage(src).latest()
    assert meta.properties["state_format"] == 2 and meta.properties["savepoint"] is True
    with tempfile.TemporaryDirectory() as tmp:
        env = fb.Environment(parallelism=3, checkpoint_interval=0.1, checkpoint_dir=os.path.join(tmp, "ck"))
        out = counting(env, expected["n"], 3, None)
        env.execute(60, restore_from=src)
    totals = collections.Counter(x % expected["keys"] for x in range(expected["n"]))
    per_key = collections.defaultdict(list)
    for k, c in out.result:
        per_key[k].append(c)
    at = {int(k): v for k, v in expected["counts_at_savepoint"].items()}
    assert {k: sorted(v) for k, v in per_key.items()} == {k: list(range(at[k] + 1, totals[k] + 1)) for k in totals}


def test_savepoints_show_in_the_history_and_survive_retention(tmp_path):
    ck = str(tmp_path / "ck")
    env = fb.Environment(parallelism=2, checkpoint_interval=0.05, checkpoint_dir=ck, checkpoints_retained=1,
                         checkpoint_alignment="unaligned", alignment_timeout=0)
    release = str(tmp_path / "release")
    counting(env, 4000, 2, 8000, hold=(2000, release))
    job = env.execute_async()
    wait_until_held(release, 2, job)
    sp = job.savepoint()                    # default: under checkpoint_dir/savepoints
    assert sp.startswith(os.path.join(ck, "savepoints") + os.sep)
    # checkpoints go on while the source holds; then it reads on to the end
    deadline = time.monotonic() + 120
    while sum(1 for c in env.checkpoints() if not c["savepoint"] and c["status"] == "completed") < 2:
        assert time.monotonic() < deadline, "fewer than 2 checkpoints completed"
        time.sleep(0.05)
    open(release, "w").close()
    job.join(60)
    history = env.checkpoints()
    sps = [c for c in history if c["savepoint"]]
    assert len(sps) == 1 and sps[0]["status"] == "completed" and sps[0]["path"].endswith(os.path.basename(sp))
    assert sum(1 for c in history if not c["savepoint"] and c["status"] == "completed") >= 2
    # retention (1) pruned the older checkpoints, never the savepoint
    assert len(CheckpointStorage(ck).list_complete()) == 1
    meta = SavepointStorage(sp).latest()
    # always aligned, even when the job's checkpoints are unaligned
    assert meta.properties["alignment"] == "aligned" and meta.inflight_bytes == 0
    assert all(h.alignment == "aligned" for h in meta.tasks.values())
    assert set(meta.properties["operators"]) >= {"numbers", "counts"}


def test_savepoint_errors(tmp_path):
    # the jobs hold half way (their release never comes): running when asked, however slow the machine
    never = str(tmp_path / "never-released")
    env = fb.Environment(parallelism=1)
    counting(env, 100000, 1, 20000, hold=(500, never))
    job = env.execute_async()
    try:
        with pytest.raises(ConfigurationError, match="needs checkpointing"):
            job.savepoint(str(tmp_path / "sp"))
    finally:
        cancel_and_join(job, failure_ok=True)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    env = fb.Environment(parallelism=1, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"))
    counting(env, 100000, 1, 20000, hold=(500, never))
    job = env.execute_async()
    try:
        with pytest.raises(CheckpointStateError, match="not empty"):
            job.savepoint(str(full))
    finally:
        cancel_and_join(job, failure_ok=True)
    with pytest.raises(Exception, match="no complete checkpoint or savepoint"):
        env3 = fb.Environment(checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck3"))
        counting(env3, 10, 1, None)
        env3.execute(30, restore_from=str(tmp_path / "nothing-here"))


def test_in_flight_data_does_not_move_but_a_savepoint_does(tmp_path):
    """An unaligned checkpoint's in-flight data on edges that are not keyed
    (here the forward edge into the slow sink) restores only into the same
    tasks: at another parallelism the restore is refused, pointing to a
    savepoint; a savepoint of the same job (aligned) restores there. (On
    keyed edges it moves by key group: test_unaligned_rescale.py.)"""
    from test_unaligned import backpressured_job

    ck = str(tmp_path / "chk")
    env = fb.Environment(chaining=False, checkpoint_interval=0.3, checkpoint_dir=ck,
                         checkpoint_alignment="unaligned", segment_size=4096)
    backpressured_job(env)
    job = env.execute_async()
    deadline = time.monotonic() + 60
    while not any(c["status"] == "completed" and c["inflight_bytes"] for c in env.checkpoints()):
        assert time.monotonic() < deadline, env.checkpoints()
        time.sleep(0.05)
    sp = job.stop(savepoint=str(tmp_path / "sp"))
    assert SavepointStorage(sp).latest().inflight_bytes == 0
    # under backpressure every unaligned checkpoint holds what its barriers overtook
    held = [m for m in CheckpointStorage(ck).list_complete() if m.inflight_bytes]
    assert held
    # ... and the slow sink's input (a forward edge) is full
    sink = next(n.operator_uid for n in env.nodes if n.name == "sink")   # (a derived id)
    held = [m for m in held if any(s.get("inflight") and s["edges"]["in"] and s["edges"]["in"][0]["to"] == sink
                                   for s in m.properties["layout"].values())]
    assert held

    def rescaled():
        e = fb.Environment(parallelism=2, chaining=False, checkpoint_interval=0.3, checkpoint_dir=ck,
                           checkpoint_alignment="unaligned", segment_size=4096)
        backpressured_job(e)
        return e
    with pytest.raises(ConfigurationError, match=r"in-flight data on \d+ edge\(s\) that are not keyed.*forward edge "
                                                 r"into operator '" + re.escape(sink) + r"'.*cannot be redistributed.*savepoint"):
        rescaled().execute(30, restore_from=held[-1].checkpoint_id)
    env2 = rescaled()
    job2 = env2.execute_async(restore_from=sp)
    time.sleep(0.5)
    job2.cancel()
    assert env2.last_execution.restored_from == SavepointStorage(sp).checkpoint_id
