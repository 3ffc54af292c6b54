"""What a restore trusts: the commits listed in ``_metadata`` (only renames the
job's own sinks can produce run), damaged checkpoints (never a silent fresh
start over committed output), and the sources' input (a saved position is
never applied to another file)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pipeline_helpers import read_parts, resume_job, running_counts
from pyflowbuf import checkpoint, errors
from pyflowbuf.checkpoint import CheckpointStorage
from pyflowbuf.connectors import outputs
from pyflowbuf.connectors.sources import TextFileSource


def text_job(chk, out, n=3000, mode="error"):
    env = fb.Environment(checkpoint_interval=0.02, checkpoint_dir=chk, checkpoints_retained=3)
    # 0.6 s at least, so that checkpoints complete on a loaded machine too
    env.from_sequence(0, n, rate_limit=5_000).map(str, kind="str").write_text(out, mode=mode)
    return env


def craft_metadata(chk, extra_commits):
    """Rewrite the newest checkpoint's ``_metadata`` with ``extra_commits``
    appended, with valid checksums: the storage itself writes it."""
    storage = CheckpointStorage(str(chk), retained=3)
    meta = storage.latest()
    os.remove(os.path.join(meta.path.removeprefix("file://"), "_metadata"))
    props = dict(meta.properties)
    props["commits"] = list(props.get("commits", [])) + extra_commits
    storage.complete(meta.checkpoint_id, list(meta.tasks.values()), trigger_time=meta.trigger_time,
                     properties=props)
    assert storage.latest().properties["commits"][-len(extra_commits):] == extra_commits
    return meta


# ---------------------------------------------------------------- 1. commits from _metadata

def crafted_actions(tmp, out):
    attacker, victim = str(tmp / "attacker"), str(tmp / "victim")
    pend = lambda seq: str(out / f".part-00000-{seq:06d}.txt.inprogress")   # noqa: E731
    final = lambda seq: str(out / f"part-00000-{seq:06d}.txt")              # noqa: E731
    return {
        "outside to outside": ["rename", attacker, victim],
        "pending part to outside": ["rename", pend(90), victim],
        "outside into the sink": ["rename", attacker, final(91)],
        "not a part file": ["rename", str(out / "notes"), final(92)],
        "another final name": ["rename", pend(93), final(94)],
        "a subtask the sink lacks": ["rename", str(out / ".part-00007-000095.txt.inprogress"),
                                     str(out / "part-00007-000095.txt")],
        "dot dot": ["rename", str(out / ".." / "out" / ".part-00000-000096.txt.inprogress"), final(96)],
        "a link": ["rename", pend(97), final(97)],
        "not a rename": ["delete", victim],
        "malformed": ["rename", victim],
    }


CASES = ["outside to outside", "pending part to outside", "outside into the sink", "not a part file",
         "another final name", "a subtask the sink lacks", "dot dot", "a link", "not a rename", "malformed"]


@pytest.mark.parametrize("case", CASES)
def test_a_crafted_metadata_cannot_move_a_file_the_sinks_did_not_write(tmp_path, case):
    chk, out = tmp_path / "chk", tmp_path / "out"
    text_job(chk, out).execute(60)
    committed = sorted(read_parts(out))
    (tmp_path / "attacker").write_text("evil")
    (tmp_path / "victim").write_text("precious")
    (out / "notes").write_text("a note")
    for seq in (90, 93, 96):
        (out / f".part-00000-{seq:06d}.txt.inprogress").write_text("pending\n")
    (out / ".part-00007-000095.txt.inprogress").write_text("pending\n")
    os.symlink(tmp_path / "victim", out / ".part-00000-000097.txt.inprogress")
    legit = ["rename", str(out / ".part-00000-000090.txt.inprogress"), str(out / "part-00000-000090.txt")]
    # a commit the sink can produce comes first: nothing may move before the check refuses the list
    craft_metadata(chk, [legit, crafted_actions(tmp_path, out)[case]])
    before = sorted(os.listdir(out)), sorted(os.listdir(tmp_path))
    caught = None
    try:
        text_job(chk, out).execute(60, restore_from="latest")
    except Exception as exc:     # noqa: BLE001 - checked below, after the files
        caught = exc
    assert (tmp_path / "victim").read_text() == "precious"
    assert (tmp_path / "attacker").read_text() == "evil"
    assert (sorted(os.listdir(out)), sorted(os.listdir(tmp_path))) == before     # not a file moved
    assert sorted(read_parts(out)) == committed
    assert isinstance(caught, checkpoint.UnsafeCommitError), caught
    assert isinstance(caught, checkpoint.CorruptCheckpointError)
    assert caught.action == crafted_actions(tmp_path, out)[case]


def test_the_sinks_own_commits_still_run_on_restore(tmp_path):
    from pyflowbuf.connectors.sinks import TextFileSink

    sink_dir = tmp_path / "out"
    out = outputs.FileOutput(sink_dir, ".txt")
    out.parallelism = 2
    os.makedirs(sink_dir)
    (sink_dir / ".part-00001-000004.txt.inprogress").write_text("x\n")
    action = ["rename", str(sink_dir / ".part-00001-000004.txt.inprogress"), str(sink_dir / "part-00001-000004.txt")]
    sink = TextFileSink("out", sink_dir, transactional=True, output=out)
    sink.commit([action])
    sink.commit([action])       # idempotent
    assert os.listdir(sink_dir) == ["part-00001-000004.txt"]


@pytest.mark.parametrize("case", CASES)
def test_a_crafted_committable_in_a_sinks_state_moves_no_file(tmp_path, case):
    """The committables a file sink's subtask recommits on restore come from
    its state in the checkpoint: checked against its own directory before
    any file moves, as those listed in ``_metadata`` are."""
    from pyflowbuf.connectors.api import ConnectorSinkOperator
    from pyflowbuf.connectors.sinks import TextFileSink

    out = tmp_path / "out"
    os.makedirs(out)
    (tmp_path / "attacker").write_text("evil")
    (tmp_path / "victim").write_text("precious")
    (out / "notes").write_text("a note")
    for seq in (90, 93, 96):
        (out / f".part-00000-{seq:06d}.txt.inprogress").write_text("pending\n")
    (out / ".part-00007-000095.txt.inprogress").write_text("pending\n")
    os.symlink(tmp_path / "victim", out / ".part-00000-000097.txt.inprogress")
    output = outputs.FileOutput(out, ".txt")
    output.parallelism = 1
    op = ConnectorSinkOperator("out", TextFileSink("out", out, transactional=True, output=output))
    legit = ["rename", str(out / ".part-00000-000090.txt.inprogress"), str(out / "part-00000-000090.txt")]
    op.restore_state({"pending": [[3, [legit, crafted_actions(tmp_path, out)[case]]]], "writers": [{"seq": 99}]})
    before = sorted(os.listdir(out)), sorted(os.listdir(tmp_path))
    with pytest.raises(checkpoint.UnsafeCommitError) as info:
        op.open(0, 1)
    assert (tmp_path / "victim").read_text() == "precious"
    assert (tmp_path / "attacker").read_text() == "evil"
    assert (sorted(os.listdir(out)), sorted(os.listdir(tmp_path))) == before     # not a file moved
    assert info.value.action == crafted_actions(tmp_path, out)[case]


# ---------------------------------------------------------------- 2. every checkpoint damaged

def test_when_every_checkpoint_is_damaged_the_restore_refuses_instead_of_duplicating(tmp_path):
    chk, out = str(tmp_path / "chk"), str(tmp_path / "out")
    run = resume_job(tmp_path, chk, out, n=6000, retained=3)
    first = run(3000, need=2)
    assert first.returncode == 17, first.stderr
    storage = CheckpointStorage(chk)
    complete = storage.list_complete()
    assert len(complete) >= 2
    committed = read_parts(out)
    assert committed            # the checkpoints committed output
    for meta in complete:       # one state file truncated in each
        victim = os.path.join(meta.path.removeprefix("file://"), next(iter(meta.tasks.values())).file)
        with open(victim, "r+b") as fh:
            fh.truncate(os.path.getsize(victim) // 2)
    second = run(0)
    assert second.returncode != 0
    assert "CorruptCheckpointError" in second.stderr and "restore_from=None" in second.stderr, second.stderr
    assert read_parts(out) == committed           # nothing written twice, nothing at all
    # a fresh start over committed output is refused unless asked for ...
    third = run(0, restore="none")
    assert third.returncode != 0 and "OutputExistsError" in third.stderr, third.stderr
    assert read_parts(out) == committed
    # ... and when it is, the output is that of one whole run
    fourth = run(0, restore="none", mode="overwrite")
    assert fourth.returncode == 0, fourth.stderr
    assert sorted(read_parts(out)) == running_counts(6000)


def test_latest_checkpoint_tells_none_from_damaged(tmp_path):
    from pyflowbuf.checkpointing.restore_point import latest_checkpoint

    storage = CheckpointStorage(str(tmp_path))
    assert latest_checkpoint(storage) is None                     # no checkpoint at all
    storage.write_task_state(1, "t", {"x": 1})                    # one in progress only
    assert latest_checkpoint(storage) is None
    h = storage.write_task_state(2, "t", {"x": 2})
    storage.complete(2, [h])
    assert latest_checkpoint(storage).checkpoint_id == 2
    path = os.path.join(storage.checkpoint_path(2), h.file)
    with open(path, "r+b") as fh:
        fh.seek(h.size - 20)
        fh.write(b"\0" * 4)
    with pytest.raises(checkpoint.CorruptCheckpointError, match="chk-2") as info:
        latest_checkpoint(storage)
    assert info.value.checkpoint_id == 2


def test_a_restored_sink_drops_the_parts_it_committed_after_its_checkpoint(tmp_path):
    """A newer checkpoint damaged: the restore falls back to an older one, and
    what the newer one committed is written again by the restored job."""
    from pyflowbuf.connectors.sinks import TextFileSink

    out = outputs.FileOutput(tmp_path, ".txt")
    out.parallelism = 2
    for sub, seq in [(0, 0), (0, 1), (0, 2), (0, 3), (1, 2)]:
        (tmp_path / f"part-{sub:05d}-{seq:06d}.txt").write_text(f"{sub} {seq}\n")
    (tmp_path / ".part-00000-000004.txt.inprogress").write_text("pending\n")
    sink = TextFileSink("out", tmp_path, transactional=True, output=out)
    sink.restore_state([{"seq": 2}])     # the restored checkpoint covered parts 0 and 1
    sink.open(0, 2)
    assert sorted(os.listdir(tmp_path)) == ["part-00000-000000.txt", "part-00000-000001.txt",
                                            "part-00001-000002.txt"]


# ---------------------------------------------------------------- 3. a source restored into other input

READ_TEXT = textwrap.dedent("""
    import os, sys
    import pyflowbuf as fb
    src, chk, out, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    seen = [0]
    def maybe_die(line):
        seen[0] += 1
        if kill_at and seen[0] == kill_at:
            os._exit(17)
        return line
    env = fb.Environment(checkpoint_interval=0.02, checkpoint_dir=chk, chaining=False)
    (env.read_text(src, rate_limit=40000)
        .map(maybe_die, kind="str")
        .write_text(out))
    env.execute(120, restore_from="latest")
""")


def _lines(prefix, n):
    return "".join(f"{prefix}{i:06d}\n" for i in range(n))


@pytest.mark.parametrize("change", ["another path", "rewritten", "truncated", "appended"])
def test_a_read_text_position_is_never_applied_to_another_file(tmp_path, change):
    script = tmp_path / "job.py"
    script.write_text(READ_TEXT)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(_lines("a", 20_000))
    b.write_text(_lines("b", 20_000))
    chk, out = str(tmp_path / "chk"), str(tmp_path / "out")

    def run(src, kill):
        return subprocess.run([sys.executable, str(script), str(src), chk, out, str(kill)],
                              capture_output=True, text=True, timeout=180)

    first = run(a, 12_000)
    assert first.returncode == 17, first.stderr
    assert CheckpointStorage(chk).latest() is not None
    src = a
    if change == "another path":
        src = b
    elif change == "rewritten":
        a.write_text(_lines("c", 20_000))           # same size, other lines
    elif change == "truncated":
        a.write_text(_lines("a", 100))
    else:
        with open(a, "a") as fh:
            fh.write(_lines("z", 500))
    second = run(src, 0)
    if change == "appended":
        # data added after the position is read on: every line exactly once
        assert second.returncode == 0, second.stderr
        assert sorted(read_parts(out)) == sorted(_lines("a", 20_000).split() + _lines("z", 500).split())
        return
    assert second.returncode != 0
    assert "IncompatibleCheckpointError" in second.stderr, second.stderr
    assert "read_text" in second.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="workers need fork")
def test_with_workers_the_driver_refuses_another_input_before_any_worker_starts(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(_lines("a", 6000))
    b.write_text(_lines("b", 6000))

    def job(src):
        env = fb.Environment(workers=2, checkpoint_interval=0.02, checkpoint_dir=tmp_path / "chk")
        env.read_text(src, rate_limit=20_000).map(str.upper, kind="str", parallelism=2).write_text(tmp_path / "out")
        return env

    job(a).execute(120)
    assert CheckpointStorage(str(tmp_path / "chk")).latest() is not None
    committed = sorted(read_parts(tmp_path / "out"))
    with pytest.raises(checkpoint.IncompatibleCheckpointError, match="b.txt"):
        job(b).execute(120, restore_from="latest")
    assert sorted(read_parts(tmp_path / "out")) == committed
    job(a).execute(120, restore_from="latest")      # its own input: restored
    assert sorted(read_parts(tmp_path / "out")) == committed


def test_read_text_identity_accepts_its_own_file_and_refuses_others(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text(_lines("a", 5000))
    src = TextFileSource(a)
    src.open(0, 1)
    src.next_batch(1234)
    ident, pos = src.identity(), src.position()
    src.close()
    TextFileSource(a).check_identity(ident, pos)
    with pytest.raises(checkpoint.IncompatibleCheckpointError, match="decoded"):
        TextFileSource(a, encoding="latin-1").check_identity(ident, pos)
    b = tmp_path / "b.txt"
    b.write_text(_lines("a", 5000))                       # the same lines, another file
    with pytest.raises(errors.ConfigurationError, match="another file"):   # a ConfigurationError too
        TextFileSource(b).check_identity(ident, pos)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 3000), read=st.integers(0, 3000), flip=st.integers(0, 10**9))
def test_read_text_identity_catches_any_changed_byte_near_the_position(tmp_path_factory, n, read, flip):
    """A byte changed in what was read, within the fingerprinted windows (the
    first and the last 64 KiB before the position), is always refused."""
    path = tmp_path_factory.mktemp("fp") / "f.txt"
    data = _lines("l", n).encode()
    path.write_bytes(data)
    src = TextFileSource(path)
    src.open(0, 1)
    src.next_batch(read)
    ident, pos = src.identity(), src.position()
    src.close()
    if pos == 0:
        TextFileSource(path).check_identity(ident, pos)
        return
    i = flip % pos
    changed = bytearray(data)
    changed[i] ^= 0x01
    path.write_bytes(bytes(changed))
    with pytest.raises(checkpoint.IncompatibleCheckpointError):
        TextFileSource(path).check_identity(ident, pos)


def test_file_sources_refuse_changed_files_and_settings(tmp_path):
    pytest.importorskip("pyarrow")
    from pyflowbuf import connectors

    f = tmp_path / "in.csv"
    f.write_text("a,b\n" + "".join(f"{i},{i * 2}\n" for i in range(1000)))
    factory, _ = connectors.csv_source(f)
    ident = factory().identity()
    factory().check_identity(ident, (0, 0, 0))
    factory2, _ = connectors.csv_source(f, block_size=4096)
    with pytest.raises(checkpoint.IncompatibleCheckpointError, match="block_size"):
        factory2().check_identity(ident, (0, 0, 0))
    with open(f, "a") as fh:
        fh.write("1000,2000\n")
    factory3, _ = connectors.csv_source(f)
    with pytest.raises(checkpoint.IncompatibleCheckpointError, match="changed since the checkpoint"):
        factory3().check_identity(ident, (0, 0, 0))


def test_old_checkpoints_without_identities_still_restore(tmp_path):
    from pyflowbuf.checkpointing.restore import check_sources

    class Meta:
        checkpoint_id = 3

    src = TextFileSource(tmp_path / "nothing-yet.txt")
    check_sources(Meta, {"v0-0": {"source": 10, "operators": []}}, {"v0-0": ("read_text", src)})


def test_a_chk_directory_of_another_job_is_read_from_there_not_as_this_jobs(tmp_path):
    """restore_from="<other dir>/chk-N" read only the name, so it restored
    this job's own chk-N: a silent restore from the wrong checkpoint. A
    checkpoint directory given by path is read where it is (issue 21: a
    checkpoint or savepoint copied elsewhere restores)."""
    from pyflowbuf.checkpointing.restore_point import restore_plan

    mine, other = CheckpointStorage(str(tmp_path / "mine")), CheckpointStorage(str(tmp_path / "other"))
    for storage, x in ((mine, 1), (other, 2)):
        storage.complete(5, [storage.write_task_state(5, "t", {"x": x})])
    assert restore_plan(mine, "chk-5").checkpoint_id == 5                     # a name: this job's own
    assert restore_plan(mine, str(tmp_path / "mine" / "chk-5")).path == mine.latest().path
    assert restore_plan(mine, str(tmp_path / "mine" / "." / "chk-5/")).path == mine.latest().path
    theirs = restore_plan(mine, str(tmp_path / "other" / "chk-5"))
    assert theirs.path == other.latest().path and theirs.path != mine.latest().path
    env = fb.Environment(checkpoint_interval=1.0, checkpoint_dir=str(tmp_path / "mine"))
    env.from_sequence(0, 10).collect()
    # that one is another job's (its task "t"): refused as such, never read as this job's chk-5
    with pytest.raises(errors.ConfigurationError, match="another job graph"):
        env.execute(30, restore_from=str(tmp_path / "other" / "chk-5"))
