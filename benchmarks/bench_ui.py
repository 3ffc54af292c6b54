"""Web view benchmark: what serving the page costs a running job.

ui_overhead_ratio
    records/s of source -> map -> rebalance -> map -> sink (parallelism 2)
    with the web view served and polled once a second (graph, subtasks and
    job, as an open page on the subtask view polls them, by a separate
    process as a browser would be) / the same job without a view,
    interleaved repetitions, median of the paired ratios. Goal >= 0.98.
ui_cpu_overhead_ratio
    the same runs, records per CPU-second of the job's process (user + system:
    the tasks, the sampler and the page's server; the poller is another
    process) with / without the view. Less at the mercy of a shared machine
    than wall-clock throughput: what serving the page costs in CPU.
ui_poll_ms
    median time one poll (the three requests) took, answered by the job's
    process while it ran.
ui_poll_cpu_ms_800
    CPU time (of this thread) to build one poll's answers (job, graph,
    subtasks) for 50 operator chains at parallelism 16 (800 subtasks, their
    metrics made up), median of repetitions: at one poll a second, this
    over 1000 ms is the share of one core a page costs the job's process at
    the size the issue names, whatever the machine's load.

Run: ``python benchmarks/run.py ui [--quick] [--json]``.
"""
from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import Goal  # noqa: E402

import pyflowbuf as fb  # noqa: E402

# The poller: a process of its own, as a browser is; prints the ms each poll took.
_POLLER = r"""
import sys, time, urllib.request
url = sys.argv[1]
while True:
    t = time.perf_counter()
    try:
        for path in ("api/job", "api/graph", "api/subtasks"):
            urllib.request.urlopen(url + path, timeout=10).read()
    except OSError:
        break
    print(round((time.perf_counter() - t) * 1000, 2), flush=True)
    time.sleep(max(0.0, 1.0 - (time.perf_counter() - t)))
"""


def params(quick: bool) -> dict:
    return dict(n=12_000_000, repeats=3) if quick else dict(n=30_000_000, repeats=7)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_job(n: int, served: bool, polls: list) -> dict:
    env = fb.Environment(parallelism=2, name="ui-bench", **({"ui_port": 0} if served else {}))
    (env.from_sequence(0, n).map(lambda x: x + 1, name="inc")
        .rebalance().map(lambda x: x, name="ident").sink(lambda b: None, batched=True, name="sink"))
    poller = None
    cpu0 = _cpu_s()
    t0 = time.perf_counter()
    job = env.execute_async()
    try:
        if served:
            poller = subprocess.Popen([sys.executable, "-c", _POLLER, job.ui_url], stdout=subprocess.PIPE,
                                      text=True)
        job.join(600)
        took = time.perf_counter() - t0
        cpu = _cpu_s() - cpu0
    finally:
        if poller is not None:
            poller.terminate()
            out, _ = poller.communicate(timeout=30)
            polls.extend(float(x) for x in out.split())
        if served:
            job.ui.close()
    return {"rate": n / took, "cpu_rate": n / cpu}


class _WideJob:
    """A job handle as the view reads one: 50 chains at parallelism 16, every
    subtask reporting (made-up figures; building the answer is what is timed)."""

    done = False
    ran = True
    coordinator = None

    def __init__(self):
        env = fb.Environment(parallelism=16, name="wide")
        s = env.from_sequence(0, 10)
        for i in range(49):
            s = s.map(lambda x: x, name=f"op{i}").rebalance()
        s.sink(lambda b: None, batched=True, name="sink")
        self.spec = env.job_spec()          # what the view reads of a job
        self._m = {}
        for v in self.spec.plan()[0]:
            for i in range(v.parallelism):
                self._m[f"{v.name} ({i + 1}/{v.parallelism})"] = {
                    "state": "RUNNING", "level": "HIGH", "busy_ms_per_s": 100.0, "idle_ms_per_s": 0.0,
                    "backpressured_ms_per_s": 900.0, "records_in": 10 ** 6, "records_out": 10 ** 6,
                    "records_in_per_s": 1e5, "records_out_per_s": 1e5, "bytes_in": 8e6, "bytes_out": 8e6,
                    "in_pool_usage": 0.5, "out_pool_usage": 0.9, "vertex": v.name, "subtask": i,
                    "debloat": [{"gate": 0, "buffer_size": 4096, "inflight_bytes": 8192}],
                    "debloat_buffer_size": 4096, "debloat_inflight_bytes": 8192}

    def metrics(self):
        return dict(self._m)

    def checkpoints(self):
        return []


def poll_cpu_ms_800(repeats: int) -> float:
    from pyflowbuf import ui
    job = _WideJob()            # the view holds its job weakly
    server = ui.UiServer(job)
    try:
        took = []
        for _ in range(repeats):
            server._cache.clear()
            t = time.thread_time()
            for path in ("/api/job", "/api/graph", "/api/subtasks"):
                server.answer(path, {})
            took.append((time.thread_time() - t) * 1000)
        return statistics.median(took)
    finally:
        server.close()


def main(quick: bool = False) -> dict:
    p = params(quick)
    rep = common.Report("ui", quick, params={**p, "parallelism": 2, "metrics_interval_s": 1.0, "poll_s": 1.0})
    rep.section("a job with its web view served and polled once a second / the same job without")
    polls: list = []
    with common.progress("runs", 2 * (p["repeats"] + 1)) as adv:
        def case(served):
            def run():
                r = run_job(p["n"], served, polls)
                adv()
                return r
            return run
        s = common.interleaved({"served": case(True), "plain": case(False)}, repeats=p["repeats"])
    rep.add("records_per_s_plain", s.median("plain"), "rec/s", spread=s.spread("plain"))
    rep.add("records_per_s_ui", s.median("served"), "rec/s", spread=s.spread("served"))
    rep.add("ui_overhead_ratio", s.ratio("served", "plain"), "x", goal=Goal(">=", 0.98, "x"),
            note=f"median of {p['repeats']} paired ratios: {[round(x, 3) for x in s.ratios('served', 'plain')]}")
    rep.add("ui_cpu_overhead_ratio", s.ratio("served", "plain", "cpu_rate"), "x",
            note=f"paired ratios: {[round(x, 3) for x in s.ratios('served', 'plain', 'cpu_rate')]}")
    rep.add("ui_poll_ms", statistics.median(polls) if polls else float("nan"), "ms",
            note=f"{len(polls)} polls of /api/job, /api/graph, /api/subtasks")
    rep.section("what one poll costs at 800 subtasks (50 chains x parallelism 16)")
    cpu = poll_cpu_ms_800(20 if quick else 60)
    rep.add("ui_poll_cpu_ms_800", cpu, "ms", note=f"{cpu / 10:.2f} % of one core at one poll a second")
    return rep.as_dict()


if __name__ == "__main__":
    main("--quick" in sys.argv)
