"""Helpers shared by the test modules: waiting for a condition and
cancelling a job (the loaded-machine rule: wait for what a test needs, never
race a timer); after a job, every segment is back in its pool and no thread
of the job is left; the committed output of a part-file sink; a job script
that a test runs as its own process, killed and resumed; for window tests, random
records and an aggregate that keeps their times."""

import collections
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import time

from pyflowbuf import errors
from pyflowbuf.connectors.sources import SequenceSource
from pyflowbuf.windows import AggregateFunction

# A bound for a wait that only a hang reaches: a loaded machine makes a job
# slow, never this slow.
WAIT_S = 120


def wait_for(predicate, what="the condition", *, timeout=WAIT_S, proc=None, job=None, step=0.02):
    """Until ``predicate()`` is true; returns its value. Fails (AssertionError
    naming ``what``) after ``timeout`` seconds, or at once when the process
    ``proc`` or the job ``job`` ended first: then the condition can no longer
    come. ``what`` may be a function, called at the failure for a message
    that shows the state then."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        said = what() if callable(what) else what
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended before {said}: {proc.communicate()}")
        if job is not None and job.done:
            raise AssertionError(f"the job ended before {said}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {said}")
        time.sleep(step)


def cancel_and_join(job, timeout=60, *, failure_ok=False):
    """Cancel ``job`` and wait until it has ended (its threads and workers
    gone). A JobFailedError from a job that failed before the cancel is
    raised, unless ``failure_ok``: where the test has checked what it
    needs already and only cleans up."""
    job.cancel()
    try:
        job.join(timeout)
    except errors.JobFailedError:
        if not failure_ok:
            raise


def random_stream(rnd, n, *, keys=3, disorder=2, very_late=0.0, step=0.25):
    """``n`` records ``(key, time)`` of ``keys`` keys (``rnd``: a
    random.Random), times on a grid of ``step`` (exact floats), each up to
    ``disorder`` steps early, and with probability ``very_late`` far behind."""
    out = []
    for i in range(n):
        t = i * step - rnd.randint(0, disorder) * step
        if rnd.random() < very_late:
            t -= rnd.randint(8, 40) * step
        out.append((f"k{rnd.randrange(keys)}", t))
    return out


class Times(AggregateFunction):
    """Collects the times of the window's records (a mergeable accumulator):
    records are ``(key, time)``, the result is the sorted times."""

    def create_accumulator(self):
        return []

    def add(self, value, acc):
        return acc + [value[1]]

    def get_result(self, acc):
        return sorted(acc)

    def merge(self, a, b):
        return a + b


def job_threads(job) -> list:
    """Threads of ``job`` still alive (tasks, metrics sampler, watcher)."""
    threads = list(job.tasks)
    if job.sampler is not None:
        threads.append(job.sampler)
    watcher = getattr(job, "_watcher", None)
    if watcher is not None:
        threads.append(watcher)
    return [t for t in threads if t.is_alive()]


def assert_clean(env) -> None:
    """After a job: every segment back in the pool, no thread of it alive."""
    job = env.last_execution
    pool = job.network_pool
    assert pool.available_segments == pool.total_segments, (pool.available_segments, pool.total_segments)
    assert job_threads(job) == []


def run(env, timeout=60):
    env.execute(timeout)
    assert_clean(env)


def read_parts(directory):
    """The lines of the committed part files of a write_text directory (hidden
    in-progress files are not output)."""
    lines = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("part-"):
            with open(os.path.join(directory, name)) as fh:
                lines += fh.read().splitlines()
    return lines


# A keyed running sum into write_text, as a script of its own: the process
# dies (exit code 17, no cleanup) at record ``kill_at`` (0: never).
# Arguments: chk out kill_at restore(latest|none) mode n retained
RESUME_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import pyflowbuf as fb
    chk, out, kill_at, restore, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    n, retained, need = int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8])
    def maybe_die(x):
        # dies at kill_at or the first record after it once `need` checkpoints of this
        # run completed; until then slowly, so that they can, however loaded the machine
        if kill_at and x >= kill_at:
            if sum(c["status"] == "completed" for c in env.checkpoints()) >= need:
                os._exit(17)        # the process dies, no cleanup
            time.sleep(0.005)
        return x
    env = fb.Environment(checkpoint_interval=0.02, checkpoint_dir=chk, chaining=False,
                         checkpoints_retained=retained)
    (env.from_sequence(0, n, rate_limit=20000)
        .map(maybe_die, kind="int64")
        .map(lambda x: (x % 5, x), kind="struct")
        .key_by(lambda kv: kv[0])
        .reduce(lambda a, b: (a[0], a[1] + b[1]))
        .map(lambda kv: f"{kv[0]},{kv[1]}", kind="str")
        .write_text(out, mode=mode))
    env.execute(120, restore_from=None if restore == "none" else "latest")
    print("restored_from", env.last_execution.restored_from)
""")


def resume_job(tmp_path, chk, out, *, n, retained=2):
    """``run(kill_at, restore="latest", mode="error", need=1)`` runs
    RESUME_SCRIPT in a new process and returns the CompletedProcess; a run
    with ``kill_at`` dies (exit 17) at that record or after it, once ``need``
    of its checkpoints completed."""
    script = tmp_path / "job.py"
    script.write_text(RESUME_SCRIPT)

    def run(kill_at, restore="latest", mode="error", need=1):
        return subprocess.run([sys.executable, str(script), str(chk), str(out), str(kill_at), restore, mode,
                               str(n), str(retained), str(need)], capture_output=True, text=True, timeout=180)
    return run


def running_counts(n):
    """What RESUME_SCRIPT writes in one run without failure, sorted."""
    want, sums = [], collections.defaultdict(int)
    for x in range(n):
        sums[x % 5] += x
        want.append(f"{x % 5},{sums[x % 5]}")
    return sorted(want)


class FailOnceInJob:
    """Identity that raises once in the whole job, over every attempt and
    process (the first to create the file ``marker``), at its ``at``-th call
    in a subtask."""

    def __init__(self, marker, at):
        self.marker, self.at, self.calls = str(marker), at, 0

    def __call__(self, x):
        self.calls += 1
        if self.calls == self.at:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return x
            raise RuntimeError("injected failure")
        return x


class FailOnceAfterCheckpoint:
    """Identity that raises once, at its ``at``-th call or the first after it
    once a checkpoint of ``env`` (set by the test) has completed, so a restore
    has state to restore; never again."""

    def __init__(self, at):
        self.at, self.calls, self.fired, self.env = at, 0, False, None
        self.lock = threading.Lock()

    def __call__(self, x):
        with self.lock:
            self.calls += 1
            fire = (not self.fired and self.calls >= self.at
                    and any(c["status"] == "completed" for c in self.env.checkpoints()))
            self.fired = self.fired or fire
        if fire:
            raise RuntimeError(f"injected failure at call {self.calls}")
        return x


# ---- a bounded job that is still running when the test stops it

class HeldSequenceSource(SequenceSource):
    """``from_sequence(0, n)``'s source (the same identity and positions, so
    a plain ``from_sequence`` restores from its savepoints) that holds at
    ``hold_at`` until the file ``release`` exists: there it emits nothing
    and idles as an unbounded source with nothing new does, so checkpoints
    and a stop-with-savepoint go on. Each subtask that reached ``hold_at``
    says so with the file ``release + ".held-<subtask>"``. A test stops the
    job there, however slow or loaded the machine, instead of racing a
    timer against the end of the input."""

    def __init__(self, n, hold_at, release):
        super().__init__(0, n, 1)
        self.hold_at, self.release = hold_at, release

    def next_batch(self, max_records):
        if self._ranges is None and not os.path.exists(self.release):
            if self.next_value >= self.hold_at:
                marker = f"{self.release}.held-{self.subtask}"
                if not os.path.exists(marker):
                    with open(marker, "w"):
                        pass
                time.sleep(0.01)
                return []
            # never past hold_at in one batch
            max_records = min(max_records, -(-(self.hold_at - self.next_value) // self.stride))
        return super().next_batch(max_records)


def held_sequence(env, n, *, parallelism, rate_limit, hold_at, release):
    """A stream like ``env.from_sequence(0, n, parallelism=..., rate_limit=...)``
    (name, kind, parallelism: the same graph) from a HeldSequenceSource."""
    return env._source("sequence", lambda: HeldSequenceSource(n, hold_at, release), "int64", rate_limit,
                       parallelism)


def wait_until_held(release, parallelism, job=None, timeout=120):
    """Until every subtask of a held sequence has reached its hold."""
    wait_for(lambda: all(os.path.exists(f"{release}.held-{i}") for i in range(parallelism)),
             "the source to reach its hold", timeout=timeout, job=job)


# ---- no job process left behind

def worker_processes_left(timeout: float = 10.0):
    """This process's descendants that are a job's zygote or workers (by the
    names they give themselves, ``pfb-*``; not, e.g., multiprocessing's forkserver),
    from /proc, once they have had time to go: ``[(pid, name, state)]``.
    Workers are the zygote's children, not multiprocessing's, so
    ``multiprocessing.active_children()`` alone would never see them."""
    deadline = time.monotonic() + timeout
    while True:
        stats = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        head, tail = f.read().rsplit(")", 1)
                    state, parent = tail.split()[:2]
                    stats[int(entry)] = (int(parent), head.split("(", 1)[1], state)
                except (OSError, IndexError, ValueError):
                    pass
        found, todo = [], [os.getpid()]
        while todo:
            p = todo.pop()
            for child, (parent, name, state) in stats.items():
                if parent == p:
                    todo.append(child)
                    if name.startswith("pfb-"):
                        found.append((child, name, state))
        if (not found and not multiprocessing.active_children()) or time.monotonic() > deadline:
            return found + [(p.pid, p.name, "multiprocessing") for p in multiprocessing.active_children()]
        time.sleep(0.05)


# ---- descriptors and threads a connection may leave behind

def open_sockets() -> int:
    """Sockets open in this process (TCP, and a TLS relay's pairs): a refused
    or closed connection must leave none behind."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass        # closed while listed
    return n


def tls_relay_threads() -> list:
    """The names of this process's TLS relay threads (``pyflowbuf-tls...``)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("pyflowbuf-tls")]
