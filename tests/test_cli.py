"""The ``pyflowbuf`` command line (pyflowbuf/cli): ``run`` on job modules
written here, ``checkpoints list|show|verify`` on real checkpoints of a small
job, whole, torn and corrupt, compared with what ``CheckpointStorage`` says of
the same directory. Most commands run in this process (``main(argv)``); some
through ``python -m pyflowbuf`` in a subprocess, Ctrl-C included."""
from __future__ import annotations

import glob
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from cli_helpers import ENV, KEYS, ROOT, cli, committed_lines, expected_lines
from pipeline_helpers import wait_for
from pyflowbuf.checkpoint import CheckpointStorage, shared
from pyflowbuf.checkpoint.codec import encode_value
from pyflowbuf.checkpoint.container import FILE_METADATA, SEC_METADATA, _ContainerWriter
from pyflowbuf.cli import build_parser, main, render
from pyflowbuf.cli.checkpoints import raw_metadata
from pyflowbuf.runtime import overrides




def last_json(text):
    return json.loads(text.strip().splitlines()[-1])




def job_source(ckdir, out, *, n, parallelism=2, rate=None, extra="", sink_parallelism=None, mode="aligned",
               slow=False, interval=0.05, incremental=True):
    return textwrap.dedent(f"""\
        import time
        import pyflowbuf as fb

        def count(key, n, state):
            state["n"] = state.get("n", 0) + 1
            return [f"{{key}},{{state['n']}}"]

        def slow(line):
            time.sleep(0.0002)
            return line

        env = fb.Environment(parallelism={parallelism}, checkpoint_interval={interval}, checkpoint_dir={str(ckdir)!r},
                             checkpoints_retained=3, checkpoint_alignment={mode!r}, buffer_timeout=0.001,
                             segment_size=256, incremental_checkpoints={incremental!r})
        s = (env.from_sequence(0, {n}, rate_limit={rate!r})
                .key_by(lambda n: n % {KEYS})
                .process(count))
        if {slow!r}:
            s = s.map(slow)
        s.write_text({str(out)!r}, parallelism={sink_parallelism!r})
        {extra}
        if __name__ == "__main__":
            env.execute()
        """)


def watching_job_source(ckdir, out, *, parallelism=2, rate=2000, interval=0.05):
    """The keyed count of ``job_source`` over the numbers in the text files of
    ``in/``, a watched directory: the job runs until it is told to stop (the
    source never ends), so a signal always finds it running, however loaded
    the machine; with ``END_AFTER`` (seconds) in its environment it ends
    once no new file has appeared for that long (a resumed run that
    completes the output)."""
    return textwrap.dedent(f"""\
        import os
        import pyflowbuf as fb

        def count(key, n, state):
            state["n"] = state.get("n", 0) + 1
            return [f"{{key}},{{state['n']}}"]

        end_after = os.environ.get("END_AFTER")
        env = fb.Environment(parallelism={parallelism}, checkpoint_interval={interval}, checkpoint_dir={str(ckdir)!r},
                             checkpoints_retained=3, buffer_timeout=0.001, segment_size=256)
        (env.read_text("in", monitor=0.05, monitor_timeout=float(end_after) if end_after else None,
                       rate_limit={rate!r})
            .map(int)
            .key_by(lambda n: n % {KEYS})
            .process(count)
            .write_text({str(out)!r}))
        if __name__ == "__main__":
            env.execute()
        """)


def feed(directory, numbers, files=4):
    """Numbers into ``files`` new text files of a watched directory, each
    whole when it appears (written beside it, then renamed in)."""
    os.makedirs(directory, exist_ok=True)
    numbers = list(numbers)
    for i in range(files):
        part = numbers[i::files]
        tmp = os.path.join(os.path.dirname(directory), f".feed-{part[0]}.tmp")
        with open(tmp, "w") as f:
            f.write("".join(f"{x}\n" for x in part))
        os.replace(tmp, os.path.join(directory, f"numbers-{part[0]:08d}.txt"))


def wait_for_checkpoint(proc, ckdir, timeout=120):
    """Until a checkpoint of the running job is complete (its _metadata, in
    ``ckdir`` or a subdirectory of it), while the process runs."""
    wait_for(lambda: glob.glob(os.path.join(str(ckdir), "**", "chk-*", "_metadata"), recursive=True),
             "a completed checkpoint", timeout=timeout, proc=proc)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A checkpoint_dir with three complete checkpoints of a keyed count, taken
    unaligned under backpressure (a slow map), so some hold in-flight data.
    Whole checkpoints (no incremental ones), so that the directory holds
    exactly the three retained; test_incremental_checkpoints_are_listed_shown_and_verified
    has the others."""
    d = tmp_path_factory.mktemp("cli")
    job = d / "job_unaligned.py"
    job.write_text(job_source(d / "ck", d / "out", n=6000, mode="unaligned", slow=True, incremental=False))
    path = list(sys.path)
    try:
        code, out, err = cli("run", job, "--json")
    finally:
        sys.path[:] = path
        sys.modules.pop("job_unaligned", None)
    assert code == 0, err
    outcome = last_json(out)
    assert outcome["status"] == "finished"
    assert committed_lines(d / "out") == expected_lines(6000)
    ids = CheckpointStorage(d / "ck").checkpoint_ids()
    assert len(ids) == 3, ids              # checkpoints_retained=3
    return d / "ck"


@pytest.fixture
def ckdir(checkpoints, tmp_path):
    """A copy of the checkpoints, to damage."""
    return shutil.copytree(checkpoints, tmp_path / "ck")


def task_files(chk):
    return sorted(glob.glob(os.path.join(chk, "*.state")))


_STATUS = {"COMPLETED": "complete", "INCOMPLETE": "incomplete"}


def assert_statuses_match_storage(ckdir, listed, verify):
    """The CLI's status of each checkpoint is the storage's (torn and corrupt
    both being CORRUPT there), and its figures are the metadata's."""
    infos = {i.checkpoint_id: i for i in CheckpointStorage(ckdir).scan(verify=verify)}
    assert sorted(infos) == [c["id"] for c in listed]
    for c in listed:
        info = infos[c["id"]]
        assert _STATUS.get(info.status, ("torn", "corrupt")) in (c["status"], ("torn", "corrupt")), (c, info)
        if info.status == "CORRUPT":
            assert c["status"] in ("torn", "corrupt") and c["reason"] == info.error.reason
        if info.metadata is not None:
            m = info.metadata
            assert (c["state_bytes"], c["inflight_bytes"], c["tasks"]) == (m.state_bytes, m.inflight_bytes,
                                                                           len(m.tasks))
            assert c["completion_time"] == m.completion_time and c["kind"] == "checkpoint"


# ---------------------------------------------------------------- checkpoints list / show / verify


def test_list_shows_every_checkpoint_as_the_storage_sees_it(checkpoints):
    code, out, err = cli("checkpoints", "list", checkpoints, "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert [c["status"] for c in data["checkpoints"]] == ["complete"] * 3
    assert {c["alignment"] for c in data["checkpoints"]} <= {"unaligned", "switched"}
    assert_statuses_match_storage(checkpoints, data["checkpoints"], verify=False)
    for c in data["checkpoints"]:          # bytes on disk: the task files and _metadata
        files = glob.glob(os.path.join(c["path"].removeprefix("file://"), "*"))
        assert c["size"] == sum(os.path.getsize(f) for f in files)
    code, table, _ = cli("checkpoints", "list", checkpoints)
    assert code == 0
    for c in data["checkpoints"]:
        assert re.search(rf"^\s*{c['id']}\s+checkpoint\s+complete\s", table, re.M), table


def test_show_gives_each_tasks_figures_from_the_metadata(checkpoints):
    storage = CheckpointStorage(checkpoints)
    for meta in storage.list_complete():
        code, out, err = cli("checkpoints", "show", os.path.join(checkpoints, f"chk-{meta.checkpoint_id}"),
                             "--json")
        assert code == 0, err
        data = json.loads(out)
        assert data["id"] == meta.checkpoint_id and data["status"] == "complete"
        assert data["mode"] == "exactly_once" and data["job"] == "job"
        by_task = {t["task_key"]: t for t in data["tasks"]}
        assert set(by_task) == set(meta.tasks) == {"v0-0", "v0-1", "v1-0", "v1-1"}
        for key, h in meta.tasks.items():
            t = by_task[key]
            assert (t["state_bytes"], t["inflight_bytes"], t["inflight_buffers"], t["size"], t["file"],
                    t["alignment"], t["on_disk"]) == (h.state_bytes, h.inflight_bytes, h.inflight_buffers,
                                                      h.size, h.file, h.alignment, "ok")
            assert t["alignment_ms"] == meta.properties["alignment_ms"][key]
        assert data["inflight_bytes"] == meta.inflight_bytes
    # the checkpoint_dir and an id, the checkpoint_dir alone (the newest) and a _metadata file name the same
    newest = storage.checkpoint_ids()[-1]
    outs = [cli("checkpoints", "show", *argv, "--json")[1] for argv in
            ([checkpoints, newest], [checkpoints], [os.path.join(checkpoints, f"chk-{newest}", "_metadata")])]
    assert len({json.dumps(json.loads(o)["tasks"]) for o in outs}) == 1
    code, table, _ = cli("checkpoints", "show", checkpoints)
    assert code == 0 and re.search(rf"^checkpoint:\s+{newest} \(checkpoint, complete\)", table, re.M), table
    assert all(re.search(rf"^\s*{k}\s+(aligned|unaligned)\s", table, re.M) for k in ("v0-0", "v1-1")), table


def test_some_checkpoint_holds_inflight_data_and_show_counts_it(checkpoints):
    # the slow map backpressures the keyed count: an unaligned barrier overtakes queued buffers
    metas = CheckpointStorage(checkpoints).list_complete()
    if not any(m.inflight_bytes for m in metas):
        pytest.skip("no checkpoint of this run overtook data (timing)")
    m = next(m for m in metas if m.inflight_bytes)
    data = json.loads(cli("checkpoints", "show", checkpoints, m.checkpoint_id, "--json")[1])
    assert sum(t["inflight_bytes"] for t in data["tasks"]) == m.inflight_bytes > 0
    assert any(t["inflight_buffers"] > 0 and t["alignment"] == "unaligned" for t in data["tasks"])


def test_verify_passes_on_whole_checkpoints(checkpoints):
    code, out, err = cli("checkpoints", "verify", checkpoints, "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data["ok"] and [c["status"] for c in data["checkpoints"]] == ["complete"] * 3
    code, out, _ = cli("checkpoints", "verify", os.path.join(checkpoints, "chk-" + str(data["checkpoints"][0]["id"])))
    assert code == 0 and "checksums ok" in out


def test_incremental_checkpoints_are_listed_shown_and_verified(tmp_path, clean_imports):
    """A keyed count whose late records touch few keys: its checkpoints refer
    to earlier ones; a checkpoint kept only for the files they refer to is
    listed as incomplete (retired), ``show`` names the references and
    ``verify`` checks the referenced files too."""
    job = tmp_path / "job_incr.py"
    # n: few records after the hold, so the job ends within a few checkpoints of it; with many
    # (4000: nine more at 0.05 s) the groups written before record 400 reached INCREMENTAL_MAX_AGE
    # and the last checkpoint re-wrote them all, referring to nothing (about one run in five)
    src = job_source(tmp_path / "ck", tmp_path / "out", n=1000, rate=8000, parallelism=1)
    hold = textwrap.dedent(f"""\
        import glob, os, re, time
        since = []

        def hold(n):
            # from record 400 on only key 0 changes: go slowly until two checkpoints
            # completed since, so the newest refers to an earlier one's files however
            # loaded the machine (a bounded job would otherwise race the checkpoint timer)
            if n >= 400:
                done = [int(m.group(1)) for p in glob.glob(os.path.join({str(tmp_path / "ck")!r}, "**", "_metadata"),
                                                           recursive=True)
                        for m in [re.search(r"chk-(\\d+)", p)] if m]
                newest = max(done, default=0)
                if not since:
                    since.append(newest)
                if newest < since[0] + 2:
                    time.sleep(0.002)
            return n
        """)
    job.write_text(hold + src.replace("key_by(lambda n: n % " + str(KEYS) + ")",
                                      "map(hold).key_by(lambda n: n % 40 if n < 400 else 0)"))
    code, out, err = cli("run", job, "--json")
    assert code == 0, err
    storage = CheckpointStorage(tmp_path / "ck")
    newest = storage.latest()
    refs = shared.references(newest)
    assert refs, "the newest checkpoint refers to no earlier one"
    code, out, err = cli("checkpoints", "list", tmp_path / "ck", "--json")
    listed = {c["id"]: c for c in json.loads(out)["checkpoints"]}
    for cid in set(shared.referenced_ids(newest)) - {m.checkpoint_id for m in storage.list_complete()}:
        assert listed[cid]["status"] == "incomplete" and "retired" in listed[cid]["reason"]
    code, out, err = cli("checkpoints", "show", tmp_path / "ck", "--json")
    assert code == 0, err
    assert json.loads(out)["properties"]["references"] == refs
    code, table, err = cli("checkpoints", "show", tmp_path / "ck", "--state")
    assert code == 0 and re.search(r"incremental: \d+ groups written here, refers to \d+ in chk-\d+", table), table
    code, out, err = cli("checkpoints", "verify", tmp_path / "ck", "--json")
    assert code == 0 and json.loads(out)["ok"], out
    path = f"{storage.checkpoint_path(refs[0]['checkpoint'])}/{refs[0]['file']}"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    code, out, err = cli("checkpoints", "verify", tmp_path / "ck", newest.checkpoint_id, "--json")
    assert code == 1
    entry = json.loads(out)["checkpoints"][0]
    assert entry["status"] in ("torn", "corrupt") and f"checkpoint {refs[0]['checkpoint']}" in entry["reason"]


def test_a_deleted_or_truncated_task_file_is_torn(ckdir):
    ids = CheckpointStorage(ckdir).checkpoint_ids()
    newest, middle, oldest = ckdir / f"chk-{ids[2]}", ckdir / f"chk-{ids[1]}", ids[0]
    deleted = task_files(newest)[0]
    os.remove(deleted)
    cut = task_files(middle)[-1]
    with open(cut, "r+b") as f:
        f.truncate(os.path.getsize(cut) - 7)
    code, out, err = cli("checkpoints", "list", ckdir, "--json")
    assert code == 0
    listed = json.loads(out)["checkpoints"]
    assert [c["status"] for c in listed] == ["complete", "torn", "torn"]
    assert os.path.basename(deleted) in listed[2]["reason"] and "missing" in listed[2]["reason"]
    assert "torn" in listed[1]["reason"]
    assert_statuses_match_storage(ckdir, listed, verify=False)
    assert "torn" in cli("checkpoints", "list", ckdir)[1]

    # show: what the metadata records, the missing file marked, exit code 1 with the reason
    code, out, err = cli("checkpoints", "show", newest, "--json")
    assert code == 1 and "is torn" in err and len(err.strip().splitlines()) == 1
    rows = {t["file"]: t["on_disk"] for t in json.loads(out)["tasks"]}
    assert rows[os.path.basename(deleted)] == "missing"
    assert list(rows.values()).count("ok") == len(rows) - 1
    code, out, err = cli("checkpoints", "show", middle)
    assert code == 1 and "(torn)" in out

    # verify: the directory fails, naming each damaged checkpoint; the intact one passes
    code, out, err = cli("checkpoints", "verify", ckdir)
    assert code == 1
    assert f"checkpoint {ids[2]} is torn" in err and f"checkpoint {ids[1]} is torn" in err
    assert "Traceback" not in err
    assert cli("checkpoints", "verify", ckdir, oldest)[0] == 0


def test_a_flipped_byte_is_found_by_the_checksums(ckdir):
    ids = CheckpointStorage(ckdir).checkpoint_ids()
    victim = task_files(ckdir / f"chk-{ids[-1]}")[1]
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x20]))
    # the sizes are right: only a reading of the checksums finds it
    listed = json.loads(cli("checkpoints", "list", ckdir, "--json")[1])["checkpoints"]
    assert listed[-1]["status"] == "complete"
    listed = json.loads(cli("checkpoints", "list", ckdir, "--verify", "--json")[1])["checkpoints"]
    assert [c["status"] for c in listed] == ["complete", "complete", "corrupt"]
    assert_statuses_match_storage(ckdir, listed, verify=True)
    code, out, err = cli("checkpoints", "verify", ckdir / f"chk-{ids[-1]}")
    assert code == 1
    assert f"checkpoint {ids[-1]} is corrupt" in err and "checksum" in err
    assert len(err.strip().splitlines()) == 1


def test_a_damaged_metadata_file_is_corrupt_and_show_refuses_it_in_one_line(ckdir):
    ids = CheckpointStorage(ckdir).checkpoint_ids()
    meta = ckdir / f"chk-{ids[-1]}" / "_metadata"
    data = bytearray(meta.read_bytes())
    data[40] ^= 0xFF
    meta.write_bytes(bytes(data))
    listed = json.loads(cli("checkpoints", "list", ckdir, "--json")[1])["checkpoints"]
    assert listed[-1]["status"] == "corrupt" and listed[-1]["kind"] is None
    assert_statuses_match_storage(ckdir, listed, verify=False)
    code, out, err = cli("checkpoints", "show", ckdir, ids[-1])
    assert code == 1 and out == ""
    assert err.startswith("pyflowbuf checkpoints show: error: checkpoint") and err.count("\n") == 1
    assert "_metadata: section checksum mismatch" in err
    code, _, err = cli("checkpoints", "show", ckdir, ids[-1], "--debug")
    assert code == 1 and "Traceback" in err and "CorruptCheckpointError" in err


def test_an_incomplete_checkpoint_is_listed_and_not_shown(ckdir):
    ids = CheckpointStorage(ckdir).checkpoint_ids()
    pending = ckdir / f"chk-{ids[-1] + 1}"
    shutil.copytree(ckdir / f"chk-{ids[-1]}", pending)
    os.remove(pending / "_metadata")
    listed = json.loads(cli("checkpoints", "list", ckdir, "--json")[1])["checkpoints"]
    assert listed[-1]["status"] == "incomplete" and listed[-1]["id"] == ids[-1] + 1
    assert_statuses_match_storage(ckdir, listed, verify=False)
    code, _, err = cli("checkpoints", "show", pending)
    assert code == 1 and "not complete" in err
    # the directory's newest with metadata is shown; verify of the directory does not fail for it
    assert json.loads(cli("checkpoints", "show", ckdir, "--json")[1])["id"] == ids[-1]
    assert cli("checkpoints", "verify", ckdir)[0] == 0
    assert cli("checkpoints", "verify", pending)[0] == 1


@pytest.mark.parametrize("make, argv, message", [
    (None, ["list", "{d}/nope"], "no such file or directory"),
    ("dir", ["list", "{d}/plain"], "is not a checkpoint directory"),
    ("file", ["show", "{d}/plain.txt"], "is a file, not a checkpoint directory"),
    ("ck", ["list", "{d}/ck/chk-{id}"], "`list` takes the checkpoint_dir"),
    ("ck", ["show", "{d}/ck", "999"], "holds no checkpoint 999"),
    ("ck", ["show", "{d}/ck/chk-{id}", "999"], "is checkpoint"),
    ("ck", ["verify", "{d}/ck", "x"], None),          # usage: exit code 2
])
def test_errors_are_one_line_with_a_nonzero_exit_code(checkpoints, tmp_path, make, argv, message):
    cid = CheckpointStorage(checkpoints).checkpoint_ids()[-1]
    if make == "dir":
        (tmp_path / "plain").mkdir()
        (tmp_path / "plain" / "data.csv").write_text("a,b\n")
    elif make == "file":
        (tmp_path / "plain.txt").write_text("x")
    elif make == "ck":
        shutil.copytree(checkpoints, tmp_path / "ck")
    args = ["checkpoints"] + [a.format(d=tmp_path, id=cid) for a in argv]
    if message is None:
        with pytest.raises(SystemExit) as e:
            cli(*args)
        assert e.value.code == 2
        return
    code, out, err = cli(*args)
    assert code == 1 and out == ""
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    code, _, err = cli(*args, "--debug")
    assert code == 1 and "Traceback" in err


def test_fields_of_a_later_metadata_are_shown_as_they_are(checkpoints, tmp_path):
    """A later release writes operator ids, key groups and savepoints into the
    metadata; `show` and `list` show what is there instead of dropping it."""
    ck = shutil.copytree(checkpoints, tmp_path / "ck")
    storage = CheckpointStorage(ck)
    cid = storage.checkpoint_ids()[-1]
    raw = storage.load_metadata(cid).to_dict()
    groups = {"v0": "source-uid", "v1": "count-uid"}
    for t in raw["tasks"]:
        vertex, sub = t["task_key"].split("-")
        t["operator_id"] = groups[vertex]
        t["key_groups"] = [int(sub) * 64, int(sub) * 64 + 63]
    raw["properties"]["kind"] = "savepoint"
    raw["max_parallelism"] = 128
    raw["operators"] = [{"uid": "count-uid", "state_bytes": 10}, {"uid": "source-uid", "state_bytes": 2}]
    meta = ck / f"chk-{cid}" / "_metadata"
    with open(meta, "wb") as f:
        w = _ContainerWriter(f, FILE_METADATA)
        w.value_section(SEC_METADATA, "metadata", encode_value(raw))
        w.end()
    assert storage.load_metadata(cid).checkpoint_id == cid        # still a valid checkpoint for the storage
    listed = json.loads(cli("checkpoints", "list", ck, "--json")[1])["checkpoints"]
    assert listed[-1]["kind"] == "savepoint" and listed[-1]["status"] == "complete"
    data = json.loads(cli("checkpoints", "show", ck, "--json")[1])
    assert data["extra"] == {"max_parallelism": 128, "operators": raw["operators"]}
    assert {t["task_key"]: t["extra"]["key_groups"] for t in data["tasks"]} == {
        "v0-0": [0, 63], "v0-1": [64, 127], "v1-0": [0, 63], "v1-1": [64, 127]}
    code, table, _ = cli("checkpoints", "show", ck)
    assert code == 0
    assert "(savepoint, complete)" in table and "max_parallelism: 128" in table
    # per operator: the operator id first, its subtasks together, key groups as ranges
    rows = [line.split() for line in table.splitlines() if re.match(r"\s*v\d-\d\s", line)]
    assert [r[:3] for r in rows] == [["v1-0", "count-uid", "0..63"], ["v1-1", "count-uid", "64..127"],
                                     ["v0-0", "source-uid", "0..63"], ["v0-1", "source-uid", "64..127"]]
    assert re.search(r"^\s*operators\s*$", table, re.M) and "count-uid" in table.split("operators")[-1]


def test_plain_tables_without_rich(monkeypatch):
    monkeypatch.setattr(render, "_Console", None)
    out = io.StringIO()
    render.table("t", [("id", "right"), ("name", "left")], [["1", "a[b]"], ["22", "c"]], out)
    assert out.getvalue().splitlines() == ["t", "id  name", "--  ----", " 1  a[b]", "22  c"]


# ---------------------------------------------------------------- run


def test_run_twice_the_second_restores_and_the_output_is_exactly_once(tmp_path, monkeypatch, clean_imports):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.py").write_text(job_source("ck", "out", n=3000, rate=3000))
    code, out, err = cli("run", "job.py", "--restore", "latest", "--json")
    assert code == 0, err
    first = last_json(out)
    assert first["status"] == "finished" and first["restored_from"] is None
    done = [c for c in first["checkpoints"] if c["status"] == "completed"]
    assert done and all(c["kind"] == "checkpoint" for c in first["checkpoints"])
    latest = CheckpointStorage("ck").latest()
    assert latest.checkpoint_id == done[-1]["id"] and latest.properties["kind"] == "checkpoint"
    assert f"restored from" not in err and "finished" in err
    assert committed_lines("out") == expected_lines(3000)

    code, out, err = cli("run", "job.py", "--restore", "latest", "--json")
    assert code == 0, err
    second = last_json(out)
    assert second["restored_from"] == latest.checkpoint_id
    assert f"restored from checkpoint {latest.checkpoint_id}" in err
    assert committed_lines("out") == expected_lines(3000)          # nothing written twice
    # a chk-<id> directory of its own checkpoint_dir, and an id, restore too
    for form in ("ck/chk-{}", "{}"):
        newest = CheckpointStorage("ck").latest().checkpoint_id
        code, out, err = cli("run", "job.py", "--restore", form.format(newest), "--json")
        assert code == 0, err
        assert last_json(out)["restored_from"] == newest


def _ctrl_c_as_in_a_terminal():
    """A suite started in the background (``nohup``, ``&``) has SIGINT
    ignored, and a child inherits that: Python then installs no Ctrl-C
    handler and the signal would do nothing. The job runs as from a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig, code, extra", [(signal.SIGINT, 130, []), (signal.SIGTERM, 143, ["--workers", "2"])],
                         ids=["ctrl-c", "sigterm-workers"])
def test_ctrl_c_cancels_with_130_and_restore_latest_resumes_exactly_once(tmp_path, sig, code, extra):
    """Through a real `python -m pyflowbuf run`: SIGINT (or SIGTERM) once a
    checkpoint is complete, then a second run resumes from the latest. The
    job watches a directory, so it is still running when the signal comes;
    the rest of the input arrives after the stop."""
    n = 8000
    (tmp_path / "job.py").write_text(watching_job_source("ck", "out"))
    feed(tmp_path / "in", range(n // 2))
    proc = subprocess.Popen([sys.executable, "-m", "pyflowbuf", "run", "job.py", "--restore", "latest", *extra],
                            cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ctrl_c_as_in_a_terminal)
    try:
        wait_for_checkpoint(proc, tmp_path / "ck")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    assert "cancelled by" in err and "--restore latest" in err and "Traceback" not in err
    interrupted = CheckpointStorage(tmp_path / "ck").latest().checkpoint_id
    assert len(committed_lines(tmp_path / "out")) <= n // 2       # it stopped before the rest came

    feed(tmp_path / "in", range(n // 2, n))
    res = subprocess.run([sys.executable, "-m", "pyflowbuf", "run", "job.py", "--restore", "latest", "--json"],
                         cwd=tmp_path, env=dict(ENV, END_AFTER="1.0"), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert last_json(res.stdout)["restored_from"] == interrupted
    assert committed_lines(tmp_path / "out") == expected_lines(n)


def interrupted_run(tmp_path, *args):
    """``python -m pyflowbuf run job.py ARGS`` in ``tmp_path``, Ctrl-C once a
    checkpoint is complete: (the process, its stdout, its stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "pyflowbuf", "run", "job.py", *args],
                            cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ctrl_c_as_in_a_terminal)
    try:
        wait_for_checkpoint(proc, tmp_path / "ck")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, out, err


def test_savepoint_on_stop_stops_with_a_savepoint_and_resumes_from_it_exactly_once(tmp_path):
    """Through a real `python -m pyflowbuf run --savepoint-on-stop`: Ctrl-C
    takes a final savepoint instead of cancelling; resuming from it (at
    another parallelism) completes the output exactly once. The job watches
    a directory, so it is still running when Ctrl-C comes."""
    n = 8000
    (tmp_path / "job.py").write_text(watching_job_source("ck", "out"))
    feed(tmp_path / "in", range(n // 2))
    proc, out, err = interrupted_run(tmp_path, "--savepoint-on-stop", "sp")
    assert proc.returncode == 0, err
    assert "stopped with a savepoint in" in err and "Traceback" not in err
    assert os.path.exists(tmp_path / "sp" / "_metadata")
    assert len(committed_lines(tmp_path / "out")) <= n // 2       # it stopped before the rest came
    feed(tmp_path / "in", range(n // 2, n))
    res = subprocess.run([sys.executable, "-m", "pyflowbuf", "run", "job.py", "--restore", "sp",
                          "--parallelism", "3", "--json"],
                         cwd=tmp_path, env=dict(ENV, END_AFTER="1.0"), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert last_json(res.stdout)["restored_from"] is not None
    assert committed_lines(tmp_path / "out") == expected_lines(n)


def test_savepoint_on_stop_with_drain_ends_event_time_in_the_final_savepoint(tmp_path):
    """``run --savepoint-on-stop PATH --drain``: Ctrl-C reaches
    job.stop(savepoint=PATH, drain=True); the job ends with its savepoint and
    everything read so far committed once."""
    n = 4000
    (tmp_path / "job.py").write_text(watching_job_source("ck", "out"))
    feed(tmp_path / "in", range(n))
    proc, out, err = interrupted_run(tmp_path, "--savepoint-on-stop", "sp", "--drain")
    assert proc.returncode == 0, err
    assert "draining event time first" in err and "Traceback" not in err
    assert os.path.exists(tmp_path / "sp" / "_metadata")
    lines = committed_lines(tmp_path / "out")
    assert len(lines) == len(set(lines)) and set(lines) <= set(expected_lines(n))


def test_drain_without_a_savepoint_on_stop_is_a_usage_error(tmp_path, monkeypatch, clean_imports):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.py").write_text(job_source("ck", "out", n=100))
    code, out, err = cli("run", "job.py", "--drain")
    assert code != 0 and "--drain" in err and "--savepoint-on-stop" in err
    assert not os.path.exists(tmp_path / "out")          # refused before the job started


def test_parallelism_is_the_default_of_operators_without_their_own(tmp_path, monkeypatch, clean_imports):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.py").write_text(job_source("ck", "out", n=600, parallelism=1, sink_parallelism=1, rate=1000,
                                                interval=0.02))
    code, out, err = cli("run", "job.py", "--parallelism", "3", "--json")
    assert code == 0, err
    assert last_json(out)["parallelism"] == 3
    assert committed_lines("out") == expected_lines(600)
    tasks = json.loads(cli("checkpoints", "show", "ck", "--json")[1])["tasks"]
    # source and keyed count at 3 (the override), the sink at its own 1
    assert sorted(t["task_key"] for t in tasks) == ["v0-0", "v0-1", "v0-2", "v1-0", "v1-1", "v1-2", "v2-0"]


def test_workers_runs_the_job_in_worker_processes(tmp_path, monkeypatch, clean_imports):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.py").write_text(job_source("ck", "out", n=1000))
    code, out, err = cli("run", "job.py", "--workers", "2", "--json")
    assert code == 0, err
    outcome = last_json(out)
    assert outcome["workers"] == 2 and outcome["status"] == "finished"
    assert committed_lines("out") == expected_lines(1000)


def test_a_function_that_builds_the_environment(tmp_path, monkeypatch, clean_imports):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job_fn.py").write_text(textwrap.dedent("""\
        import pyflowbuf as fb
        RESULT = []

        def build():
            env = fb.Environment()
            RESULT.append(env.from_sequence(0, 5).map(lambda x: x * x).collect())
            return env

        def not_an_env():
            return 42

        VALUE = 3
        """))
    code, out, err = cli("run", "job_fn.py:build", "--parallelism", "2", "--json")
    assert code == 0, err
    assert last_json(out)["parallelism"] == 2
    assert sorted(sys.modules["job_fn"].RESULT[-1].result) == [0, 1, 4, 9, 16]
    for spec, message in (("job_fn.py:not_an_env", "returned int, not a pyflowbuf Environment"),
                          ("job_fn.py:VALUE", "is a int, not an Environment"),
                          ("job_fn.py:nope", "has no attribute 'nope'"),
                          ("job_fn.py", "has no Environment at module level")):
        code, out, err = cli("run", spec)
        assert code == 1 and message in err and err.count("\n") == 1, (spec, err)


@pytest.mark.parametrize("source, message", [
    ("import pyflowbuf as fb\na = fb.Environment()\nb = fb.Environment()\nc = a\n",
     "has 2 Environments at module level (a=c, b): name the one to run, e.g. job_bad.py:a"),
    ("import pyflowbuf as fb\nenv = fb.Environment()\nenv.from_sequence(0, 3).collect()\nenv.execute()\n",
     "already ran while the module was loaded"),
    ("import pyflowbuf as fb\nenv = fb.Environment(checkpoint_interval=None)\nenv.from_sequence(0, 3).collect()\n",
     None),
])
def test_job_modules_that_cannot_run_are_refused(tmp_path, monkeypatch, clean_imports, source, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job_bad.py").write_text(source)
    if message is None:       # a job without checkpointing: --restore is refused
        code, out, err = cli("run", "job_bad.py", "--restore", "latest")
        message = "--restore needs checkpointing"
    else:
        code, out, err = cli("run", "job_bad.py")
    assert code == 1 and message in err and err.count("\n") == 1, err


def test_errors_in_the_job_code_show_its_own_traceback(tmp_path, monkeypatch, clean_imports):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job_raises.py").write_text("import pyflowbuf as fb\n\nx = 1 / 0\n")
    code, out, err = cli("run", "job_raises.py")
    assert code == 1
    assert "job_raises.py raised while it was loaded" in err and "ZeroDivisionError" in err
    assert 'job_raises.py", line 3' in err and "importlib" not in err and "pyflowbuf/cli" not in err
    (tmp_path / "job_config.py").write_text("import pyflowbuf as fb\n\nenv = fb.Environment(buffer_timeout=-1)\n")
    code, out, err = cli("run", "job_config.py")
    assert code == 1 and "ConfigurationError: buffer_timeout" in err and "(job_config.py, line 3)" in err
    (tmp_path / "job_fails.py").write_text(textwrap.dedent("""\
        import pyflowbuf as fb
        def boom(x):
            raise ValueError("bad record")
        env = fb.Environment()
        env.from_sequence(0, 3).map(boom).collect()
        """))
    code, out, err = cli("run", "job_fails.py", "--json")
    assert code == 1 and "bad record" in err
    assert last_json(out)["status"] == "failed"
    code, out, err = cli("run", "no_such_job.py")
    assert code == 1 and "no such job file" in err


def test_restore_from_a_checkpoint_copied_elsewhere_reads_it_there(tmp_path, monkeypatch, clean_imports):
    """A chk-<id> directory outside the job's checkpoint_dir (copied, moved)
    is restored from where it is, never replaced by the job's own checkpoint
    of that number."""
    monkeypatch.chdir(tmp_path)
    # whole checkpoints: an incremental one refers to files of earlier checkpoints and is refused
    # elsewhere (test_incremental_checkpoints.py::test_an_incremental_checkpoint_copied_elsewhere_...)
    (tmp_path / "job.py").write_text(job_source("ck", "out", n=3000, rate=3000, incremental=False))
    code, _, err = cli("run", "job.py")
    assert code == 0, err
    cid = CheckpointStorage("ck").latest().checkpoint_id
    shutil.copytree(tmp_path / "ck" / f"chk-{cid}", tmp_path / "elsewhere" / f"chk-{cid}")
    shutil.rmtree(tmp_path / "ck")
    code, out, err = cli("run", "job.py", "--restore", tmp_path / "elsewhere" / f"chk-{cid}", "--json")
    assert code == 0, err
    assert last_json(out)["restored_from"] == cid
    assert committed_lines("out") == expected_lines(3000)          # nothing written twice
    code, _, err = cli("run", "job.py", "--restore", tmp_path / "nowhere" / "chk-1")
    assert code == 1 and "no such checkpoint or savepoint directory" in err
    os.makedirs(tmp_path / "empty")
    code, _, err = cli("run", "job.py", "--restore", tmp_path / "empty")
    assert code == 1 and "has no _metadata" in err


def test_overrides_reach_environments_built_inside_only():
    with overrides.overriding(parallelism=3, workers=None):
        env = fb.Environment(parallelism=2)
        s = env.from_sequence(0, 10)
        own = s.map(abs, parallelism=1)
        assert overrides.current() == {"parallelism": 3}
    assert env.parallelism == 3 and s.node.parallelism == 3 and own.node.parallelism == 1
    assert fb.Environment(parallelism=2).parallelism == 2 and overrides.current() == {}
    with pytest.raises(TypeError, match="segment_size"):
        with overrides.overriding(segment_size=1024):
            pass
    with pytest.raises(RuntimeError):
        with overrides.overriding(parallelism=4):
            raise RuntimeError
    assert overrides.current() == {}


# ---------------------------------------------------------------- the entry points and the docs


def test_console_script_and_python_dash_m_are_the_same_main(tmp_path, checkpoints):
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:    # (tomllib is 3.11+)
        scripts = f.read().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    target = re.search(r'^pyflowbuf\s*=\s*"([^"]+)"', scripts, re.M).group(1)
    module, _, attr = target.partition(":")
    assert getattr(__import__(module, fromlist=[attr]), attr) is main
    res = subprocess.run([sys.executable, "-m", "pyflowbuf", "checkpoints", "list", str(checkpoints), "--json"],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert len(json.loads(res.stdout)["checkpoints"]) == 3
    res = subprocess.run([sys.executable, "-m", "pyflowbuf", "checkpoints", "verify", str(tmp_path)],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and res.stderr.count("\n") == 1 and "not a checkpoint directory" in res.stderr
    assert build_parser().parse_args(["demo", "--quick"]).quick        # ci/main.sh's command still parses


def _command_line_section():
    with open(os.path.join(ROOT, "docs", "checkpoints.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("\n## Command line\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    job = next(code for lang, code in blocks if lang == "python" and code.startswith("# job.py\n"))
    commands = [line.split("#", 1)[0].split() for lang, code in blocks if lang == "bash"
                for line in code.splitlines() if line.strip()]
    return job, commands


@pytest.mark.timeout(400)
def test_the_docs_command_line_examples_run_as_written(tmp_path):
    job, commands = _command_line_section()
    assert commands and all(c[0] == "pyflowbuf" for c in commands)
    (tmp_path / "job.py").write_text(job)
    outputs = []
    for argv in commands:
        res = subprocess.run([sys.executable, "-m", "pyflowbuf", *argv[1:]], cwd=tmp_path, env=ENV,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, (argv, res.stderr)
        outputs.append(res.stdout)
    assert "restored from checkpoint" in subprocess.run(
        [sys.executable, "-m", "pyflowbuf", "run", "job.py", "--restore", "latest"], cwd=tmp_path, env=ENV,
        capture_output=True, text=True, timeout=120).stderr
    assert committed_lines(tmp_path / "counts") == expected_lines(20_000)
    # (a checkpoint retired by retention stays for the files later incremental ones refer to)
    assert all(c["status"] == "complete" or "retired" in c["reason"]
               for c in json.loads(outputs[-1])["checkpoints"])


def test_a_module_of_a_package_by_its_dotted_name(tmp_path, monkeypatch, clean_imports):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    (tmp_path / "jobs_pkg").mkdir()
    (tmp_path / "jobs_pkg" / "__init__.py").write_text("")
    (tmp_path / "jobs_pkg" / "squares.py").write_text(textwrap.dedent("""\
        import pyflowbuf as fb

        def build():
            env = fb.Environment()
            env.from_sequence(0, 4).map(lambda x: x * x).write_text("squares")
            return env
        """))
    code, out, err = cli("run", "jobs_pkg.squares:build", "--json")
    assert code == 0, err
    assert sorted(committed_lines(tmp_path / "squares")) == ["0", "1", "4", "9"]
    code, out, err = cli("run", "jobs_pkg.nothing")
    assert code == 1 and "jobs_pkg.nothing: no such job file or module" in err
    sys.modules.pop("jobs_pkg.squares", None)
    sys.modules.pop("jobs_pkg", None)


def test_checkpoints_at_an_fsspec_url():
    """A checkpoint_dir on any fsspec file system (here memory://), as the storage takes."""
    storage = CheckpointStorage("memory://pyflowbuf-cli-test/job")
    for cid in (1, 2):
        h = storage.write_task_state(cid, "v0-0", {"n": cid})
        storage.complete(cid, [h])
    code, out, err = cli("checkpoints", "list", "memory://pyflowbuf-cli-test/job", "--json")
    assert code == 0, err
    assert [(c["id"], c["status"]) for c in json.loads(out)["checkpoints"]] == [(1, "complete"), (2, "complete")]
    code, out, err = cli("checkpoints", "verify", "memory://pyflowbuf-cli-test/job/chk-2")
    assert code == 0, err
    code, out, err = cli("checkpoints", "show", "memory://pyflowbuf-cli-test/nothing")
    assert code == 1 and "no such file or directory" in err
    storage.fs.rm("/pyflowbuf-cli-test", recursive=True)


def test_show_state_names_each_tasks_operators_and_sizes_their_state(checkpoints, tmp_path):
    newest = CheckpointStorage(checkpoints).checkpoint_ids()[-1]
    code, out, err = cli("checkpoints", "show", checkpoints, newest, "--state", "--json")
    assert code == 0, err
    states = {t["task_key"]: t["state"] for t in json.loads(out)["tasks"]}
    assert {states[k]["vertex"] for k in ("v0-0", "v0-1")} == {"'sequence'"}
    assert all("process" in states[k]["vertex"] for k in ("v1-0", "v1-1"))
    # the keyed count's state per operator id, its key groups split over the two subtasks
    groups = []
    for k in ("v1-0", "v1-1"):
        m = re.search(r"KeyedProcess-[0-9a-f]+ \(KeyedProcess\): (\d+) bytes, key groups (\d+)\.\.(\d+)",
                      states[k]["operators"])
        assert m and int(m.group(1)) > 0, states[k]["operators"]
        groups.append((int(m.group(2)), int(m.group(3))))
    assert sorted(groups) == [(0, 63), (64, 127)]
    code, table, _ = cli("checkpoints", "show", checkpoints, newest, "--state")
    assert code == 0 and re.search(r"^\s*v0-0\s+'sequence'", table, re.M), table
    ck = shutil.copytree(checkpoints, tmp_path / "ck")
    os.remove(task_files(ck / f"chk-{newest}")[0])
    code, out, err = cli("checkpoints", "show", ck, newest, "--state")
    assert code == 1 and "is torn" in err and "its state is not read" in err and err.count("\n") == 1


# ---------------------------------------------------------------- damage, at random


def _damage_ops():
    op = st.sampled_from(["delete", "truncate", "extend", "flip_task", "flip_metadata", "drop_metadata"])
    return st.lists(st.tuples(op, st.integers(0, 2), st.integers(0, 10**6)), max_size=4)


def _apply(ck, ids, ops):
    for what, which, where in ops:
        chk = ck / f"chk-{ids[which]}"
        files = task_files(chk)
        if what in ("delete", "truncate", "extend", "flip_task"):
            if not files:
                continue
            path = files[where % len(files)]
        else:
            path = chk / "_metadata"
        if not os.path.exists(path):
            continue
        data = bytearray(open(path, "rb").read())
        if what in ("delete", "drop_metadata"):
            os.remove(path)
            continue
        if not data and what != "extend":
            continue        # cut to nothing by an earlier step: nothing left to cut or flip
        if what == "truncate":
            data = data[:where % len(data)]
        elif what == "extend":
            data += b"\0"
        else:
            data[where % len(data)] ^= 1 << (where % 8)
        with open(path, "wb") as f:
            f.write(data)


def _model(ck, cid):
    """What the CLI must say of one checkpoint, from the files alone and the
    storage's verdict: incomplete without _metadata; torn when a file the
    metadata lists is missing or of another size; else the storage decides."""
    chk = ck / f"chk-{cid}"
    if not os.path.exists(chk / "_metadata"):
        return "incomplete"
    info = next(i for i in CheckpointStorage(ck).scan(verify=True) if i.checkpoint_id == cid)
    if info.status == "COMPLETED":
        return "complete"
    try:
        raw = raw_metadata(CheckpointStorage(ck), cid)
    except Exception:
        return "corrupt"
    for t in raw["tasks"]:
        path = chk / t["file"]
        if not os.path.exists(path) or os.path.getsize(path) != t["size"]:
            return "torn"
    return "corrupt"


def test_random_damage_is_classified_as_the_files_and_the_storage_say(checkpoints):
    ids = CheckpointStorage(checkpoints).checkpoint_ids()

    @settings(max_examples=40)
    @given(_damage_ops())
    def check(ops):
        with tempfile.TemporaryDirectory() as d:
            ck = shutil.copytree(checkpoints, os.path.join(d, "ck"))
            ck = type(checkpoints)(ck)
            _apply(ck, ids, ops)
            code, out, err = cli("checkpoints", "list", ck, "--verify", "--json")
            assert code == 0, err
            got = {c["id"]: c["status"] for c in json.loads(out)["checkpoints"]}
            want = {cid: _model(ck, cid) for cid in ids}
            assert got == want, ops
            code, out, err = cli("checkpoints", "verify", ck, "--json")
            assert code == (1 if {"torn", "corrupt"} & set(want.values()) else 0), (ops, err)
            for cid in ids:
                code, out, err = cli("checkpoints", "verify", ck, cid)
                assert code == (0 if want[cid] == "complete" else 1), (ops, cid, err)
                if code:
                    assert err.count("\n") == 1 and "Traceback" not in err

    check()


def test_show_and_verify_take_a_savepoint_directory_with_a_table_per_operator(tmp_path):
    """A savepoint is a directory of its own (no chk-<id> around it): show and
    verify take it; show lists per operator id its state, key groups per
    subtask and its tasks' in-flight bytes; list points to show."""
    env = fb.Environment(parallelism=2, checkpoint_interval=0.2, checkpoint_dir=str(tmp_path / "ck"))
    (env.from_sequence(0, None, parallelism=2, rate_limit=2000).uid("numbers")
        .key_by(lambda x: x % 5).reduce(lambda a, b: a + b).uid("sums")
        .sink(lambda r: None).uid("drop"))
    job = env.execute_async()
    # until records have reached the reduce (its state is not empty), however slow the machine
    deadline = time.monotonic() + 120
    while not any(m.get("records_in", 0) > 0 for task, m in env.metrics().items() if "reduce" in task):
        assert time.monotonic() < deadline and not job.done, "no record reached the reduce"
        time.sleep(0.05)
    sp = job.stop(savepoint=str(tmp_path / "sp"))
    data = json.loads(cli("checkpoints", "show", sp, "--json")[1])
    assert data["kind"] == "savepoint" and data["status"] == "complete"
    ops = {o["uid"]: o for o in data["operators"]}
    assert set(ops) == {"numbers", "sums", "drop"}
    assert ops["sums"]["keyed"] and ops["sums"]["key_groups"] == [[0, 64], [64, 128]]
    assert ops["sums"]["state_bytes"] > 0 and ops["sums"]["inflight_bytes"] == 0
    assert ops["numbers"]["type"] == "source" and len(ops["sums"]["tasks"]) == 2
    code, table, _ = cli("checkpoints", "show", os.path.join(sp, "_metadata"))
    assert code == 0 and "(savepoint, complete)" in table
    rows = {line.split()[0]: line.split() for line in table.split("operators")[-1].splitlines()[3:] if line.strip()}
    assert rows["sums"][1:4] == ["uid", "reduce", "KeyedReduce"] and "0..63" in rows["sums"] and "64..127" in rows["sums"]
    code, out, _ = cli("checkpoints", "verify", sp, "--json")
    assert code == 0 and json.loads(out)["ok"]
    code, _, err = cli("checkpoints", "list", sp)
    assert code != 0 and "`show` and `verify` take one checkpoint" in err


def test_a_copied_checkpoint_missing_its_task_files_is_shown_torn(checkpoints, tmp_path):
    """A directory holding a `_metadata` is one checkpoint on its own (a
    savepoint, a copied chk-<id>); without its task files it is torn."""
    cid = CheckpointStorage(checkpoints).checkpoint_ids()[-1]
    (tmp_path / "loose").mkdir()
    shutil.copy(checkpoints / f"chk-{cid}" / "_metadata", tmp_path / "loose")
    code, out, err = cli("checkpoints", "show", tmp_path / "loose")
    assert code == 1 and f"checkpoint:      {cid} (checkpoint, torn)" in out and "missing" in out
    assert f"checkpoint {cid} is torn" in err
    code, out, _ = cli("checkpoints", "verify", tmp_path / "loose", "--json")
    assert code == 1 and not json.loads(out)["ok"]
