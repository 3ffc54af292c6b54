"""What a job tells its caller and what it leaves behind: the Prometheus
port it bound, the output of print() under workers=, and the worker
processes and threads of an execute_iter generator closed early."""
import contextlib
import io
import logging
import os
import threading
import time
import urllib.request

import pytest

import pyflowbuf as fb
from pipeline_helpers import cancel_and_join, wait_for

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="workers= forks")


# ---- prometheus_port=0 ----

@pytest.mark.parametrize("workers", [None, pytest.param(2, marks=needs_fork)])
def test_prometheus_port_zero_exposes_and_logs_the_port_it_bound(workers, caplog):
    env = fb.Environment(prometheus_port=0, workers=workers, name="free-port", metrics_interval=0.05)
    env.from_sequence(0, None, rate_limit=2000).map(lambda x: x, kind="int64").collect()
    with caplog.at_level(logging.INFO, logger="pyflowbuf"):
        job = env.execute_async()
    try:
        port = job.prometheus_port
        assert isinstance(port, int) and port > 0
        url = f"http://127.0.0.1:{port}/metrics"
        assert any(url in r.getMessage() and "free-port" in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
        deadline = time.monotonic() + 20
        body = ""
        while 'job="free-port"' not in body and time.monotonic() < deadline:
            with urllib.request.urlopen(url, timeout=5) as resp:
                body = resp.read().decode()
            time.sleep(0.05)
        assert 'job="free-port"' in body
    finally:
        cancel_and_join(job)


def test_prometheus_port_is_none_without_an_exporter():
    env = fb.Environment()
    env.from_collection([1]).collect()
    assert env.execute(timeout=30).prometheus_port is None


# ---- execute_iter closed early ----

def _pyflowbuf_threads():
    return [t.name for t in threading.enumerate() if t.name.lower().startswith("pyflowbuf")]


@pytest.mark.parametrize("workers", [None, pytest.param(2, marks=needs_fork)])
@pytest.mark.parametrize("how", ["break", "close"])
def test_closing_execute_iter_early_leaves_no_process_or_thread(workers, how):
    psutil = pytest.importorskip("psutil")
    me = psutil.Process()
    children_before = {c.pid for c in me.children(recursive=True)}
    threads_before = set(_pyflowbuf_threads())
    env = fb.Environment(workers=workers, parallelism=2)
    sink = env.from_sequence(0, None).map(lambda x: x * 2, kind="int64").to_iterator()
    gen = env.execute_iter(sink)
    got = []
    for x in gen:
        got.append(x)
        if len(got) == 500:
            # (the workers are the zygote's children: this process's grandchildren)
            spawned = [c for c in me.children(recursive=True) if c.pid not in children_before]
            workers_pids = [c.pid for c in spawned if c.name().startswith("pfb-worker")]
            direct_pids = [c.pid for c in me.children() if c.pid not in children_before]
            break
    if how == "close":
        gen.close()
    else:
        del gen     # the generator dropped after a break: closed by the interpreter
    assert len(got) == 500
    # the workers are reaped (no zombie) and every pyflowbuf thread has ended
    new_children = lambda: [c for c in me.children(recursive=True) if c.pid not in children_before]  # noqa: E731
    wait_for(lambda: not new_children(), lambda: f"the workers to end: {[(c.pid, c.status()) for c in new_children()]}")
    wait_for(lambda: set(_pyflowbuf_threads()) <= threads_before, lambda: f"the threads to end: {_pyflowbuf_threads()}")
    assert env.last_execution.done
    assert len(workers_pids) == (workers or 0)
    for pid in direct_pids:             # the zygote, our child: reaped already, not even a zombie is left
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    for pid in workers_pids:            # the zygote's children: gone, not zombies of an orphan
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


# ---- print() under workers= ----

@needs_fork
def test_worker_prints_reach_a_redirected_stdout_complete_and_in_order():
    """As in a notebook: the caller's sys.stdout is an object, not the fd the
    workers inherited. print() sinks and print() calls in operators reach it,
    every line before execute() returns, in order per subtask."""
    n = 3000

    def shout(x):
        if x % 1000 == 0:
            print(f"seen {x}")
        return x

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        env = fb.Environment(workers=2, parallelism=2, max_batch=64)
        env.from_sequence(0, n, parallelism=2).map(shout, kind="int64").print("n")
        env.execute(timeout=60)
    lines = buf.getvalue().splitlines()
    for sub in (1, 2):
        mine = [int(ln.split("> ")[1]) for ln in lines if ln.startswith(f"n:{sub}> ")]
        assert mine == sorted(mine), "a subtask's lines came out of order"
    got = sorted(int(ln.split("> ")[1]) for ln in lines if ln.startswith("n:"))
    assert got == list(range(n))
    assert sorted(ln for ln in lines if ln.startswith("seen")) == ["seen 0", "seen 1000", "seen 2000"]
    assert all(ln.startswith(("n:", "seen ")) for ln in lines), [ln for ln in lines
                                                                if not ln.startswith(("n:", "seen "))][:5]


@needs_fork
def test_a_slow_stdout_holds_the_workers_back_and_loses_nothing():
    """The relay is bounded: a stdout that takes its time slows the printing
    workers down (pipe backpressure) and every line still arrives."""

    class Slow(io.StringIO):
        def write(self, s):
            time.sleep(len(s) * 1e-6)     # ~1 s for the whole output
            return super().write(s)

    buf = Slow()
    with contextlib.redirect_stdout(buf):
        env = fb.Environment(workers=2, parallelism=2)
        env.from_sequence(0, 20_000, parallelism=2).map(lambda x: "x" * 50 + str(x), kind="str").print()
        env.execute(timeout=120)
    lines = buf.getvalue().splitlines()
    assert sorted(int(ln.split("> ")[1][50:]) for ln in lines) == list(range(20_000))


@needs_fork
def test_worker_output_keeps_long_lines_and_characters_cut_by_a_chunk_whole():
    line = "é€" * 50_000         # 250 KB of UTF-8, longer than the relay's chunk, no newline inside
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        env = fb.Environment(workers=2, parallelism=2)
        env.from_collection([line, "short"], kind="str").rebalance().print()
        env.execute(timeout=60)
    got = sorted(ln.split("> ", 1)[1] for ln in buf.getvalue().splitlines())
    assert got == sorted([line, "short"])
