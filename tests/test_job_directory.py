"""Checkpoints belong to a job (issue 27, cases 2 and 3): a directory per job
by default, a lock held by the running job's driver, the job's identity
checked on a restore, and ``restore_from`` / ``--restore`` spelled either
way (docs/checkpoints.md, "Whose checkpoints: the job's directory")."""
import collections
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import fsspec
import pytest
from hypothesis import given, strategies as st

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf.checkpoint import CheckpointDirectoryInUseError, CheckpointNotFoundError, CheckpointStorage, IncompatibleCheckpointError
from pyflowbuf.checkpoint.lock import LOCK_FILE, DirectoryLock, process_start_time
from pyflowbuf.config import job_directory_name

from cli_helpers import ENV, cli
from pipeline_helpers import cancel_and_join, wait_for

KEYS = 5


def counting(env, n, rate, value=lambda x: 1, *, extra_state=False):
    """Per key (x % KEYS), the running sum of ``value(x)``: the last value of
    each key is the whole job's, exactly when the restored state was this
    job's own. ``value`` is the job's "logic": same shape, another job."""
    s = (env.from_sequence(0, n, rate_limit=rate).uid("numbers")
            .map(lambda x: (x % KEYS, value(x)))
            .key_by(lambda kv: kv[0])
            .reduce(lambda a, b: (a[0], a[1] + b[1])).uid("sums"))
    if extra_state:
        s = s.key_by(lambda kv: kv[0]).reduce(lambda a, b: b).uid("latest")
    return s.collect().uid("out")


def finals(records) -> dict:
    out = {}
    for k, v in records:
        out[k] = v
    return out


def expected(n, value=lambda x: 1) -> dict:
    want = collections.defaultdict(int)
    for x in range(n):
        want[x % KEYS] += value(x)
    return dict(want)


def cancel(job):
    cancel_and_join(job, failure_ok=True)


def run_until_a_checkpoint(env, **kw):
    """Start the job and cancel it once a checkpoint of it completed."""
    job = env.execute_async(**kw)
    wait_for(lambda: any(c["status"] == "completed" for c in env.checkpoints()), "a completed checkpoint")
    cancel_and_join(job, failure_ok=True)
    return job


def sums(x):
    return x


N = 200_000      # at RATE per second: the first runs are cancelled long before their end
RATE = 4000


# ---------------------------------------------------------------- case 2: the default directory

def test_two_jobs_with_the_default_directory_each_restore_their_own(tmp_path, monkeypatch):
    """Two jobs in one working directory, checkpoint_interval and no
    checkpoint_dir: each gets checkpoints/<name>, and each restores its own
    state (before: both wrote ./checkpoints, and one restored the other's)."""
    monkeypatch.chdir(tmp_path)
    envs = {}
    for name, value in (("clicks", None), ("payments", sums)):
        env = fb.Environment(checkpoint_interval=0.05, name=name)
        counting(env, N, RATE, value or (lambda x: 1))
        run_until_a_checkpoint(env)
        envs[name] = env
    for name, value in (("clicks", lambda x: 1), ("payments", sums)):
        env = fb.Environment(checkpoint_interval=0.05, name=name)
        out = counting(env, N, None, value)
        env.execute(120, restore_from="latest")
        assert env.last_execution.restored_from is not None, name
        assert finals(out.result) == expected(N, value), name
    for name, env in envs.items():
        assert env.checkpoint_dir == f"checkpoints/{name}"
        assert CheckpointStorage(env.checkpoint_dir).latest().properties["job"] == name


def test_checkpoint_dir_reports_where_the_checkpoints_are(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = fb.Environment(checkpoint_interval=0.05)
    assert env.checkpoint_dir == "checkpoints/job"          # before: None
    env.name = "payments"
    assert env.checkpoint_dir == env.checkpoint_config.directory == "checkpoints/payments"
    assert env.configuration()["checkpoint"].directory == "checkpoints/payments"
    env.checkpoint_interval = 0.02          # a setting changed: the directory still follows the name
    counting(env, N, RATE)
    job = env.execute_async("renamed")
    try:
        assert env.checkpoint_dir == "checkpoints/renamed"
        wait_for(lambda: any(c["status"] == "completed" for c in env.checkpoints()), "a completed checkpoint")
        assert os.path.exists(os.path.join("checkpoints", "renamed", LOCK_FILE))
        sp = job.savepoint()
        assert sp.startswith("checkpoints/renamed/savepoints/savepoint-")
    finally:
        cancel(job)
    assert CheckpointStorage("checkpoints/renamed").latest().properties["job"] == "renamed"
    assert not os.path.exists(os.path.join("checkpoints", "renamed", LOCK_FILE))       # released
    # an explicit directory is used as it is
    assert fb.Environment(checkpoint_interval=1.0, checkpoint_dir="ck").checkpoint_dir == "ck"
    assert fb.Environment().checkpoint_dir is None          # no checkpoints, nowhere
    # `checkpoints list` on the parent names the jobs it holds
    code, out, err = cli("checkpoints", "list", "checkpoints", "--json")
    assert code == 0, err
    assert [(j["name"], j["job"]) for j in json.loads(out)["jobs"]] == [("renamed", "renamed")]


@given(st.lists(st.text(min_size=1, max_size=80), min_size=2, max_size=6, unique=True))
def test_distinct_job_names_get_distinct_safe_directories(names):
    dirs = [job_directory_name(n) for n in names]
    assert len(set(dirs)) == len(dirs)
    for name, d in zip(names, dirs):
        assert d and "/" not in d and "\\" not in d and not d.startswith(".") and len(d) < 100
        assert d.isascii() and d.isprintable()
        assert d == job_directory_name(name)            # stable across runs: "latest" finds it


def test_any_job_name_gets_a_safe_directory_of_its_own():
    names = ["payments", "a/b", "../up", "a b", "chk-3", ".", "..", "é", "A" * 300, "savepoints", "a_b"]
    dirs = [job_directory_name(n) for n in names]
    assert dirs[0] == "payments" and dirs[-1] == "a_b"
    assert len(set(dirs)) == len(dirs)
    for d in dirs:
        assert d and "/" not in d and d not in (".", "..") and not d.startswith(".") and len(d) < 100
        assert not (d.startswith("chk-") and d[4:].isdigit()) and d != "savepoints"


# ---------------------------------------------------------------- case 3: another job's checkpoint

def test_restore_latest_refuses_another_jobs_checkpoint_naming_both(tmp_path):
    ck = str(tmp_path / "shared")
    clicks = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="clicks")
    counting(clicks, N, RATE)
    run_until_a_checkpoint(clicks)
    latest = CheckpointStorage(ck).latest().checkpoint_id
    # the same shape, other logic, another name: before, it resumed from clicks' counts
    payments = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="payments")
    counting(payments, N, None, sums)
    with pytest.raises(IncompatibleCheckpointError) as e:
        payments.execute(60, restore_from="latest")
    msg = str(e.value)
    assert f"chk-{latest}" in msg and "'clicks'" in msg and "'payments'" in msg and "checkpoint_dir" in msg
    with pytest.raises(IncompatibleCheckpointError, match="'clicks'"):
        payments.execute(60, restore_from=latest)
    # a fresh start there would number over clicks' checkpoints and prune them
    with pytest.raises(CheckpointDirectoryInUseError, match="holds checkpoints of job 'clicks'"):
        payments.execute(60)
    # clicks' checkpoints are untouched, and clicks resumes from them
    again = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="clicks")
    out = counting(again, N, None)
    again.execute(120, restore_from="latest")
    assert again.last_execution.restored_from == latest
    assert finals(out.result) == expected(N)


def test_two_jobs_named_job_are_told_apart_by_their_stateful_operators(tmp_path):
    ck = str(tmp_path / "ck")
    first = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck)        # the default name "job"
    counting(first, N, RATE)
    run_until_a_checkpoint(first)
    meta = CheckpointStorage(ck).latest()
    assert meta.properties["fingerprint"]["operators"]
    # the same name, other stateful operators: not the job that wrote it
    other = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck)
    (other.from_sequence(0, 100).uid("numbers").key_by(lambda x: x % 3).process(lambda k, x, st: [x]).uid("p")
          .collect())
    with pytest.raises(IncompatibleCheckpointError, match="default name 'job'"):
        other.execute(60, restore_from="latest")
    # ... while by its path, a new version of the job restores it, as always
    upgraded = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=str(tmp_path / "ck2"), parallelism=2)
    out = counting(upgraded, N, None, extra_state=True)
    upgraded.execute(120, restore_from=meta.path)
    assert upgraded.last_execution.restored_from == meta.checkpoint_id
    assert finals((kv for kv in out.result)) == expected(N)


def test_a_new_version_of_a_named_job_restores_latest_and_a_savepoint(tmp_path):
    """The identity check is against another job: the same job changed
    (a stateful operator added with its uid, another parallelism) restores
    its own "latest", and a savepoint by path, as before."""
    ck = str(tmp_path / "ck")
    v1 = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="counts")
    counting(v1, N, RATE)
    job = v1.execute_async()
    wait_for(lambda: any(c["status"] == "completed" for c in v1.checkpoints()), "a completed checkpoint")
    sp = job.stop(savepoint=str(tmp_path / "sp"))
    v2 = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="counts", parallelism=3)
    out = counting(v2, N, None, extra_state=True)
    v2.execute(120, restore_from="latest")
    assert v2.last_execution.restored_from is not None
    assert finals(out.result) == expected(N)
    v3 = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=str(tmp_path / "ck3"), name="counts-v3",
                        parallelism=2)
    out = counting(v3, N, None, extra_state=True)
    v3.execute(120, restore_from=sp)
    assert finals(out.result) == expected(N)


# ---------------------------------------------------------------- the lock

def _endless(env):
    (env.from_sequence(0, None, rate_limit=2000).uid("numbers")
        .key_by(lambda x: x % KEYS).reduce(lambda a, b: a + b).uid("sums")
        .sink(lambda x: None))


@pytest.mark.parametrize("workers", [None, 2])
def test_a_second_job_on_a_running_jobs_directory_is_refused_and_the_first_runs_on(tmp_path, workers):
    ck = str(tmp_path / "ck")
    first = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="first", workers=workers)
    _endless(first)
    job = first.execute_async()
    try:
        wait_for(lambda: any(c["status"] == "completed" for c in first.checkpoints()), "a checkpoint")
        with open(os.path.join(ck, LOCK_FILE)) as f:
            held = json.load(f)
        # the driver holds it, not a worker
        assert held["job"] == "first" and held["pid"] == os.getpid()
        second = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="second", workers=workers)
        _endless(second)
        with pytest.raises(CheckpointDirectoryInUseError) as e:
            second.execute_async()
        msg = str(e.value)
        assert "'first'" in msg and f"pid {os.getpid()}" in msg and "'second'" in msg and "checkpoint_dir" in msg
        assert e.value.holder["job"] == "first"
        # the first is unharmed: it goes on checkpointing, its lock stays
        done = sum(c["status"] == "completed" for c in first.checkpoints())
        wait_for(lambda: sum(c["status"] == "completed" for c in first.checkpoints()) > done + 1,
                 "two more checkpoints of the first job")
        assert not job.done
        with open(os.path.join(ck, LOCK_FILE)) as f:
            assert json.load(f)["token"] == held["token"]
    finally:
        sp = job.stop(savepoint=str(tmp_path / "sp"))
    assert not os.path.exists(os.path.join(ck, LOCK_FILE))
    # stopped: the directory is free for the next run of the job
    again = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="first", workers=workers)
    _endless(again)
    job = again.execute_async(restore_from=sp)
    cancel(job)


def test_the_lock_is_released_however_the_job_ends(tmp_path):
    ck = str(tmp_path / "ck")
    lock = os.path.join(ck, LOCK_FILE)

    def boom(x):
        if x == 50:
            raise ValueError("boom")
        return x

    env = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="j")
    env.from_sequence(0, 100).map(boom).collect()
    with pytest.raises(errors.JobFailedError):          # failed
        env.execute(60)
    assert not os.path.exists(lock)
    env = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="j")
    env.from_sequence(0, 100).collect()
    with pytest.raises(CheckpointNotFoundError):          # a start refused
        env.execute(60, restore_from=12345)
    assert not os.path.exists(lock)
    env = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="j")
    env.from_sequence(0, 100).collect()
    env.execute(60)                                       # finished
    assert not os.path.exists(lock)


KILLED_JOB = textwrap.dedent("""\
    import sys
    import pyflowbuf as fb
    env = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=sys.argv[1], name="victim")
    (env.from_sequence(0, None, rate_limit=2000).uid("numbers")
        .key_by(lambda x: x % 5).reduce(lambda a, b: a + b).uid("sums").sink(lambda x: None))
    env.execute()
""")


def test_a_stale_lock_of_a_killed_job_is_taken_over(tmp_path, caplog):
    ck = str(tmp_path / "ck")
    script = tmp_path / "victim.py"
    script.write_text(KILLED_JOB)
    proc = subprocess.Popen([sys.executable, str(script), ck], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        wait_for(lambda: os.path.exists(os.path.join(ck, LOCK_FILE)) and CheckpointStorage(ck).latest() is not None,
                 "the job's lock and a checkpoint")
        with open(os.path.join(ck, LOCK_FILE)) as f:
            assert json.load(f)["pid"] == proc.pid
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    assert os.path.exists(os.path.join(ck, LOCK_FILE))      # left behind
    env = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="victim")
    _endless(env)
    with caplog.at_level(logging.WARNING, logger="pyflowbuf.checkpoint"):
        job = env.execute_async(restore_from="latest")
    try:
        assert job.restored_from is not None
        assert any("takes over the lock of job 'victim'" in r.getMessage() and str(proc.pid) in r.getMessage()
                   for r in caplog.records)
        with open(os.path.join(ck, LOCK_FILE)) as f:
            assert json.load(f)["pid"] == os.getpid()
    finally:
        cancel(job)


def test_locks_on_an_fsspec_url_recognise_dead_and_reused_pids(tmp_path, caplog):
    url = "memory://jobdir-test/ck"
    a = DirectoryLock.acquire(url, job="a")
    with pytest.raises(CheckpointDirectoryInUseError, match="job 'a'"):
        DirectoryLock.acquire(url, job="b")
    a.release()

    def plant(**info):
        fs, root = fsspec.core.url_to_fs(url)
        lock = DirectoryLock(fs, root, "planted")       # its file, as a holder writes it; not taken
        fs.pipe(lock.path, json.dumps({**lock.info, **info}).encode())

    parent = os.getppid()
    plant(pid=parent, process_started=process_start_time(parent))        # alive, the same process
    with pytest.raises(CheckpointDirectoryInUseError, match="job 'planted'"):
        DirectoryLock.acquire(url, job="b")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for info in ({"pid": dead.pid},                                                # gone
                 {"pid": parent, "process_started": -1},                          # pid reused
                 {"pid": os.getpid(), "token": "not held here"}):                 # this process, not held
        plant(**info)
        with caplog.at_level(logging.WARNING, logger="pyflowbuf.checkpoint"):
            b = DirectoryLock.acquire(url, job="b")
        assert b.took_over["pid"] == info["pid"]
        assert "takes over the lock of job 'planted'" in caplog.text
        b.release()
    plant(host="elsewhere")                  # another host: cannot be checked, so held
    with pytest.raises(CheckpointDirectoryInUseError, match="host elsewhere"):
        DirectoryLock.acquire(url, job="b")


def test_two_jobs_started_at_once_on_one_directory_one_gets_it(tmp_path):
    ck = str(tmp_path / "ck")
    results, barrier = {}, threading.Barrier(4)

    def start(i):
        env = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name=f"j{i}")
        _endless(env)
        barrier.wait()
        try:
            results[i] = env.execute_async()
        except CheckpointDirectoryInUseError as e:
            results[i] = e

    threads = [threading.Thread(target=start, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    running = [j for j in results.values() if not isinstance(j, Exception)]
    assert len(running) == 1 and len(results) == 4
    cancel(running[0])


# ---------------------------------------------------------------- a fresh start, a restart

def test_a_restart_never_restores_a_checkpoint_of_an_earlier_run(tmp_path):
    """A run that starts fresh in a directory holding an earlier run's
    checkpoints, and fails before its own first checkpoint, starts over:
    it does not take up the earlier run's state."""
    ck = str(tmp_path / "ck")
    first = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="counts")
    counting(first, N, RATE)
    run_until_a_checkpoint(first)
    old = CheckpointStorage(ck).latest().checkpoint_id
    fired = []

    def fail_first(kv):
        if not fired:
            fired.append(True)
            raise RuntimeError("injected before any checkpoint of this run")
        return kv

    n = N          # the same input: the earlier run's position and counts would be taken up silently
    env = fb.Environment(checkpoint_interval=30.0, checkpoint_dir=ck, name="counts", restart_attempts=1)
    out = (env.from_sequence(0, n).uid("numbers").map(lambda x: (x % KEYS, 1)).map(fail_first)
              .key_by(lambda kv: kv[0]).reduce(lambda a, b: (a[0], a[1] + b[1])).uid("sums").collect())
    env.execute(120)
    assert env.last_execution.restarts == 1
    assert env.last_execution.restored_from is None, f"restored chk-{old} of the earlier run"
    assert finals(out.result) == expected(n)


def test_a_fresh_rerun_over_an_earlier_runs_checkpoints_says_so_and_how_to_resume(tmp_path):
    """A rerun without restore_from starts fresh (as in Flink), which is what
    a rerun that meant to resume would not notice: it reads its input again,
    and its retention removes the checkpoints it could have resumed from. The
    warning names the newest and restore_from='latest'; the first run and a
    resumed run say nothing."""
    import warnings
    ck = str(tmp_path / "ck")

    def run(**kw):
        env = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="counts")
        counting(env, N, RATE)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            run_until_a_checkpoint(env, **kw)
        return [w for w in got if issubclass(w.category, errors.FreshStartWarning)]

    assert run() == []
    newest = CheckpointStorage(ck).latest().checkpoint_id
    [w] = run()
    assert f"earlier run of job 'counts' (newest chk-{newest})" in str(w.message)
    assert "restore_from='latest'" in str(w.message)
    assert w.filename == __file__          # the user's line, not pyflowbuf's
    assert run(restore_from="latest") == []


# ---------------------------------------------------------------- restore_from="15", --restore PATH

def test_restore_from_takes_an_id_as_a_string_and_a_path(tmp_path):
    ck = str(tmp_path / "ck")
    for spell in (str, int, lambda cid: os.path.join(ck, f"chk-{cid}")):
        env = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="counts")
        counting(env, N, RATE)
        run_until_a_checkpoint(env)
        meta = CheckpointStorage(ck).latest()
        given = spell(meta.checkpoint_id)
        again = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="counts")
        out = counting(again, N, None)
        again.execute(120, restore_from=given)      # before: "15" was read as a path
        assert again.last_execution.restored_from == meta.checkpoint_id, given
        assert finals(out.result) == expected(N)


CLI_JOB = textwrap.dedent(f"""\
    import pyflowbuf as fb
    env = fb.Environment(checkpoint_interval=0.05, checkpoint_dir="ck", name="counts")
    (env.from_sequence(0, {N}).uid("numbers").map(lambda x: (x % {KEYS}, 1)).key_by(lambda kv: kv[0])
        .reduce(lambda a, b: (a[0], a[1] + b[1])).uid("sums").write_text("out"))
""")


def cli_job(env, rate):
    """CLI_JOB's graph, in this process."""
    (env.from_sequence(0, N, rate_limit=rate).uid("numbers").map(lambda x: (x % KEYS, 1)).key_by(lambda kv: kv[0])
        .reduce(lambda a, b: (a[0], a[1] + b[1])).uid("sums").write_text("out"))


@pytest.mark.parametrize("spelling", ["id", "path", "savepoint"])
def test_cli_restore_takes_an_id_or_a_path(tmp_path, monkeypatch, spelling):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        env = fb.Environment(checkpoint_interval=0.05, checkpoint_dir="ck", name="counts")
        cli_job(env, RATE)
        if spelling == "savepoint":
            job = env.execute_async()
            wait_for(lambda: any(c["status"] == "completed" for c in env.checkpoints()), "a checkpoint")
            given = job.stop(savepoint=str(tmp_path / "sp"))
        else:
            run_until_a_checkpoint(env)
            meta = CheckpointStorage("ck").latest()
            given = str(meta.checkpoint_id) if spelling == "id" else os.path.join("ck", f"chk-{meta.checkpoint_id}")
        (tmp_path / "jobdir_cli_job.py").write_text(CLI_JOB)
        code, out, err = cli("run", "jobdir_cli_job.py", "--restore", given, "--json")
        assert code == 0, err
        outcome = json.loads(out.strip().splitlines()[-1])
        assert outcome["status"] == "finished" and outcome["restored_from"] is not None
        if spelling != "savepoint":
            assert outcome["restored_from"] == meta.checkpoint_id
    finally:
        for name in [m for m in sys.modules if m.startswith("jobdir_cli_job")]:
            del sys.modules[name]


def test_checkpoints_of_the_old_default_layout_are_not_skipped_silently(tmp_path, monkeypatch):
    """Before each job had a directory, the default put chk-<id> in
    ./checkpoints itself. "latest" from the new default directory does not
    start from scratch past them: it says where they are and how to go on."""
    monkeypatch.chdir(tmp_path)
    old = fb.Environment(checkpoint_interval=0.05, checkpoint_dir="checkpoints")      # the old default, as given
    counting(old, N, RATE)
    run_until_a_checkpoint(old)
    latest = CheckpointStorage("checkpoints").latest().checkpoint_id
    new = fb.Environment(checkpoint_interval=0.05)
    counting(new, N, None)
    with pytest.raises(errors.ConfigurationError, match=f"checkpoints/chk-{latest}.*checkpoint_dir='checkpoints'"):
        new.execute(60, restore_from="latest")
    code, out, err = cli("checkpoints", "list", "checkpoints", "--json")     # still a checkpoint directory
    assert code == 0 and latest in [c["id"] for c in json.loads(out)["checkpoints"]]
    again = fb.Environment(checkpoint_interval=0.05, checkpoint_dir="checkpoints")
    out = counting(again, N, None)
    again.execute(120, restore_from="latest")
    assert again.last_execution.restored_from == latest and finals(out.result) == expected(N)


def test_the_control_file_and_the_cli_summary_are_in_the_jobs_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = fb.Environment(checkpoint_interval=0.05, name="payments", control_port=0)
    _endless(env)
    job = env.execute_async()
    try:
        assert job.control.path == os.path.join(str(tmp_path), "checkpoints", "payments", "_control.json")
        assert os.path.exists(job.control.path)
    finally:
        cancel(job)
    (tmp_path / "jobdir_summary_job.py").write_text(textwrap.dedent("""\
        import pyflowbuf as fb
        env = fb.Environment(checkpoint_interval=0.05, name="summary")
        env.from_sequence(0, 100).uid("numbers").key_by(lambda x: x % 3).reduce(lambda a, b: a + b).uid("s").collect()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        code, out, err = cli("run", "jobdir_summary_job.py", "--json")
    finally:
        for name in [m for m in sys.modules if m.startswith("jobdir_summary_job")]:
            del sys.modules[name]
    assert code == 0, err
    assert "in checkpoints/summary" in err, err            # the summary says where the checkpoints went


@pytest.mark.parametrize("workers", [None, 2])
def test_cancel_then_start_the_job_again_at_once_waits_for_the_old_one_to_end(tmp_path, workers):
    """cancel() does not wait for the job's end, and a notebook starts the job
    again right after it: the new run waits for the cancelled job's lock
    (same process, ending) instead of failing; nothing of the old run is left."""
    ck = str(tmp_path / "ck")
    for attempt in range(3):
        env = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="again", workers=workers)
        _endless(env)
        job = env.execute_async(restore_from="latest")
        wait_for(lambda: any(c["status"] == "completed" for c in env.checkpoints()), "a checkpoint")
        job.cancel()            # no join: the next run starts while this one ends
    cancel(job)
    assert not os.path.exists(os.path.join(ck, LOCK_FILE))


def test_a_running_job_of_this_process_keeps_its_lock_without_a_wait(tmp_path):
    """Only a job that was cancelled or stopped is waited for: a running
    one's directory is refused at once."""
    ck = str(tmp_path / "ck")
    first = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="first")
    _endless(first)
    job = first.execute_async()
    try:
        second = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=ck, name="first")
        _endless(second)
        t0 = time.monotonic()
        with pytest.raises(CheckpointDirectoryInUseError):
            second.execute_async()
        assert time.monotonic() - t0 < 30      # (a wait for an ending job would be up to 60 s)
    finally:
        cancel(job)


def test_a_lock_is_unregistered_only_once_its_file_is_free(tmp_path, monkeypatch):
    """A waiter that finds the ending holder gone takes the lock at once: the
    holder must not look released while its file is still locked (the race
    that made a notebook's "cancel, then start again" fail now and then)."""
    from pyflowbuf.checkpoint import lock as lock_mod
    fs = fsspec.filesystem("file")
    held = DirectoryLock(fs, str(tmp_path), "job")
    held._acquire()
    held.ending = True
    info = dict(held.info)
    seen = []
    real = DirectoryLock._release_file

    def probe(self):
        # the moment a waiter could look: the file is still locked here
        seen.append(lock_mod.wait_for_ending_holder(info, 0))
        real(self)

    monkeypatch.setattr(DirectoryLock, "_release_file", probe)
    held.release()
    assert seen == [False]
    after = DirectoryLock(fs, str(tmp_path), "job")
    after._acquire()
    after.release()
