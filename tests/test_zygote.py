"""workers=N: every worker, of every attempt, is forked by the job's zygote, a
process with one thread forked before the execution starts any; nothing of
it outlives the job (pyflowbuf/cluster/zygote.py)."""
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

import pyflowbuf as fb
from pyflowbuf import errors
from pipeline_helpers import FailOnceInJob as FailOnce, wait_for, worker_processes_left

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]


def _alive(pid, zombies=True) -> bool:
    """Running, or (``zombies``) a zombie its parent did not reap: left behind
    either way. (An orphan's zombie is its new parent's to reap.)"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return zombies or state != "Z"


def _wait_gone(pids, timeout=30.0, zombies=True) -> list:
    deadline = time.monotonic() + timeout
    while any(_alive(p, zombies) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p, zombies)]


class RecordProcess:
    """Writes "pid ppid" to ``directory`` once per process that runs it."""

    def __init__(self, directory):
        self.directory = str(directory)
        self.seen = False

    def __call__(self, x):
        if not self.seen:
            self.seen = True
            with open(os.path.join(self.directory, str(os.getpid())), "w") as f:
                f.write(f"{os.getpid()} {os.getppid()}")
        return x


def test_every_worker_of_a_restarted_job_is_forked_by_the_single_threaded_zygote(tmp_path):
    """The job is started from a thread that ends at once (a zygote tied to
    that thread's life would take the job with it), fails once, and
    restarts: the second set of workers comes from the same zygote, which
    had one thread at every fork; afterwards no zygote or worker is left."""
    seen = tmp_path / "seen"
    seen.mkdir()
    env = fb.Environment(workers=2, parallelism=2, chaining=False, checkpoint_interval=0.05,
                         checkpoint_dir=tmp_path / "chk", restart_attempts=2)
    h = (env.from_sequence(0, 4000, parallelism=1, rate_limit=20_000).rebalance()
         .map(RecordProcess(seen), name="record", parallelism=2)
         .map(FailOnce(tmp_path / "failed", 500), name="fail", parallelism=2)
         .collect(parallelism=1))
    started = []
    starter = threading.Thread(target=lambda: started.append(env.execute_async()))
    starter.start()
    starter.join()
    job = started[0]
    zygote = job.launcher.zygote
    assert zygote.pid != os.getpid()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", errors.WorkerSideEffectWarning)
        job.join(timeout=120)
    assert job.restarts == 1, job.restart_failures
    assert sorted(h.result) == list(range(4000))
    pids = {}
    for name in os.listdir(seen):
        pid, ppid = map(int, (seen / name).read_text().split())
        pids[pid] = ppid
    # both workers of both attempts ran the map (rebalance reaches each subtask)
    assert len(pids) == 4, pids
    assert set(pids.values()) == {zygote.pid}, (pids, zygote.pid)
    assert zygote.threads_at_fork == [1, 1, 1, 1]
    assert _wait_gone([zygote.pid, *pids]) == []


def _unbounded(env):
    env.from_sequence(0, None, parallelism=1, rate_limit=5_000).map(lambda x: x, parallelism=2).sink(lambda x: None)


@pytest.mark.parametrize("end", ["finished", "failed", "cancelled"])
def test_no_zygote_or_worker_outlives_the_job(tmp_path, end):
    env = fb.Environment(workers=2, parallelism=2)
    if end == "cancelled":
        _unbounded(env)
    else:
        fail = FailOnce(tmp_path / "failed", 100) if end == "failed" else (lambda x: x)
        env.from_sequence(0, 2000, parallelism=1).map(fail, parallelism=2).collect(parallelism=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", errors.WorkerSideEffectWarning)
        job = env.execute_async()
        processes = [job.launcher.zygote.pid, *job.launcher.pids]
        assert all(map(_alive, processes))
        if end == "cancelled":
            job.cancel()
            job.join(timeout=60)
        elif end == "failed":
            with pytest.raises(errors.JobFailedError, match="injected failure"):
                job.join(timeout=60)
        else:
            job.join(timeout=60)
    assert _wait_gone(processes) == []
    assert worker_processes_left() == []


def test_a_start_that_fails_leaves_no_zygote(tmp_path):
    """The zygote is forked first in start(): a start refused after it (here:
    a Prometheus port in use) ends it."""
    import socket
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        env = fb.Environment(workers=2, parallelism=2, prometheus_port=busy.getsockname()[1])
        _unbounded(env)
        before = set(_children())
        with pytest.raises(errors.PortUnavailableError):
            env.execute_async()
    finally:
        busy.close()
    assert _wait_gone(set(_children()) - before) == []


def _children():
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


DRIVER = textwrap.dedent("""
    import os, signal, sys, threading
    import pyflowbuf as fb
    jobs = []
    def start():
        env = fb.Environment(workers=2, parallelism=2)
        env.from_sequence(0, None, parallelism=1, rate_limit=5_000).map(lambda x: x, parallelism=2).sink(lambda x: None)
        jobs.append(env.execute_async())
    for _ in range(int(sys.argv[2])):
        if sys.argv[1] == "thread":     # a thread that ends: only EOF on its socket tells a zygote
            t = threading.Thread(target=start)
            t.start()
            t.join()
        else:
            start()
    bystander = os.fork()       # the caller's own child, alive after the driver: it holds no zygote's socket
    if bystander == 0:
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 1)     # (the test reads the driver's output to its end)
        os.dup2(devnull, 2)
        signal.pause()
        os._exit(0)
    print(bystander, *[p for job in jobs for p in (job.launcher.zygote.pid, *job.launcher.pids)], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("started, jobs", [("main", 1), ("thread", 2)])
def test_the_zygote_and_workers_die_with_the_driver(started, jobs):
    """Two jobs: the second's zygote, forked from the driver, must not hold
    the first's socket open."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", DRIVER, started, str(jobs)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    bystander, *pids = [int(p) for p in proc.stdout.split()]
    try:
        assert len(pids) == 3 * jobs, proc.stdout
        assert _wait_gone(pids, zombies=False) == []
    finally:
        os.kill(bystander, signal.SIGKILL)
