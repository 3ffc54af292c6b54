"""Web view benchmark: what serving the page costs a running job.

ui_overhead_ratio
    records/s of source -> map -> rebalance -> map -> sink (parallelism 2)
    with the web view served and polled as an open page on its subtask view
    polls it (one GET /api/live?view=subtasks a second over one kept-alive
    HTTP/1.1 connection, after loading the page's files once; by a process
    of its own, started before the job as a browser is open before) / the
    same job without a view, interleaved repetitions, median of the paired
    ratios. Goal >= 0.98.
ui_cpu_overhead_ratio
    the same runs, records per CPU-second of the job's process (user + system:
    the tasks, the sampler and the page's server; the poller is another
    process) with / without the view. Less at the mercy of a shared machine
    than wall-clock throughput: what serving the page costs in CPU.
ui_poll_ms
    median time one poll (its one request) took, answered by the job's
    process while it ran: mostly waits for the GIL behind the job's threads.
ui_poll_bytes
    bytes of one poll's answer (the benchmark job: 6 subtasks).
ui_server_cpu_ms_per_s
    CPU time of the thread that answered the page's connection (parsing,
    building, encoding, sending), per second the job ran: the GIL time the
    page took from the job, less the handoffs. Less at the mercy of a shared
    machine than the throughput ratio.
ui_poll_cpu_ms_800
    CPU time (of this thread) to build one poll's answer (/api/live of the
    subtask view: job and every subtask) for 50 operator chains at
    parallelism 16 (800 subtasks, their metrics made up with the precision
    the sampler gives them: rates at full float precision, ms per second to
    0.1, pool usage to 0.001), median of repetitions: at one poll a second,
    this over 1000 ms is the share of one core a page costs the job's
    process at the size the issue names, whatever the machine's load. Built
    once per metrics sample, however many pages poll.
ui_poll_bytes_800
    bytes of that answer.
ui_poll_top_cpu_ms_800, ui_poll_top_bytes_800
    the same for the Top N view (ranked by the server: 3 x 10 rows).

Run: ``python benchmarks/run.py ui [--quick] [--json]``.
"""
from __future__ import annotations

import os
import random
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

# The poller: a process of its own, as a browser is, started once before the
# runs. For each URL it reads on stdin it does what the page does: load the
# page's files once, then one GET /api/live a second over one kept-alive
# connection, until the next line; then it prints "ms,bytes" of each poll.
_POLLER = r"""
import http.client, select, sys, time, urllib.parse
line = sys.stdin.readline().strip()
while line and line != "quit":
    u = urllib.parse.urlsplit(line)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    def get(path):
        conn.request("GET", path, headers={"Accept": "*/*"})
        return conn.getresponse().read()
    for path in ("/", "/static/app.css", "/static/app.js"):
        get(path)
    polls = []
    while True:
        t = time.perf_counter()
        n = len(get("/api/live?view=subtasks"))
        polls.append(f"{(time.perf_counter() - t) * 1000:.2f},{n}")
        if select.select([sys.stdin], [], [], max(0.0, 1.0 - (time.perf_counter() - t)))[0]:
            sys.stdin.readline()
            break
    conn.close()
    print(" ".join(polls), flush=True)
    line = sys.stdin.readline().strip()
"""


def params(quick: bool) -> dict:
    return dict(n=12_000_000, repeats=5) if quick else dict(n=30_000_000, repeats=9)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _handler_cpu(server, into: list):
    """Count the CPU time of each thread that answers a connection of ``server``."""
    handler = server._httpd.RequestHandlerClass
    finish = handler.finish

    def counted(self):
        try:
            finish(self)
        finally:
            into.append(time.thread_time())   # the thread was started for this connection
    handler.finish = counted


def run_job(n: int, poller, polls: list, server_cpu: list) -> dict:
    served = poller is not None
    env = fb.Environment(parallelism=2, name="ui-bench", **({"ui_port": 0} if served else {}))
    (env.from_sequence(0, n).map(lambda x: x + 1, name="inc")
        .rebalance().map(lambda x: x, name="ident").sink(lambda b: None, batched=True, name="sink"))
    cpu0 = _cpu_s()
    t0 = time.perf_counter()
    job = env.execute_async()
    handlers: list = []
    try:
        if served:
            _handler_cpu(job.ui, handlers)
            poller.stdin.write(job.ui_url + "\n")
            poller.stdin.flush()
        job.join(600)
        took = time.perf_counter() - t0
        cpu = _cpu_s() - cpu0
    finally:
        if served:
            poller.stdin.write("next\n")
            poller.stdin.flush()
            polls.extend(tuple(float(x) for x in p.split(",")) for p in poller.stdout.readline().split())
            job.ui.close()
    if served:
        deadline = time.monotonic() + 10        # the handler sees its connection close
        while not handlers and time.monotonic() < deadline:
            time.sleep(0.01)
        server_cpu.append(sum(handlers) * 1000 / took)
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
        rnd = random.Random(30)             # the same figures every run
        for v in self.spec.plan()[0]:
            for i in range(v.parallelism):
                bp = round(rnd.uniform(0, 1000), 1)
                idle = round(rnd.uniform(0, 1000 - bp), 1)
                # the sampler's precision (runtime/metrics.py): rates as measured, times and pools rounded
                self._m[f"{v.name} ({i + 1}/{v.parallelism})"] = {
                    "state": "RUNNING", "level": rnd.choice(["OK", "LOW", "HIGH"]),
                    "busy_ms_per_s": round(1000 - bp - idle, 1), "idle_ms_per_s": idle,
                    "backpressured_ms_per_s": bp, "records_in": rnd.randrange(10 ** 9),
                    "records_out": rnd.randrange(10 ** 9), "records_in_per_s": rnd.uniform(0, 2e5),
                    "records_out_per_s": rnd.uniform(0, 2e5), "bytes_in": rnd.randrange(10 ** 11),
                    "bytes_out": rnd.randrange(10 ** 11), "bytes_in_per_s": rnd.uniform(0, 2e7),
                    "bytes_out_per_s": rnd.uniform(0, 2e7), "buffers_out": rnd.randrange(10 ** 6),
                    "remote_buffers_in": 0, "credit_available": None, "sender_backlog": None,
                    "last_checkpoint": 0, "checkpoint_alignment_ms": 0.0,
                    "in_pool_usage": round(rnd.random(), 3), "out_pool_usage": round(rnd.random(), 3),
                    "vertex": v.name, "subtask": i,
                    "debloat": [{"gate": 0, "buffer_size": 4096, "inflight_bytes": 8192}],
                    "debloat_buffer_size": 4096, "debloat_inflight_bytes": 8192,
                    "debloat_time_to_consume_s": round(rnd.random(), 4), "debloat_segments_held": 11}

    def metrics(self):
        return dict(self._m)

    def checkpoints(self):
        return []


def poll_cpu_ms_800(repeats: int, view: str) -> tuple:
    from pyflowbuf import ui
    job = _WideJob()            # the view holds its job weakly
    server = ui.UiServer(job)
    try:
        took = []
        for _ in range(repeats):
            server._cache.clear()
            server._by_sample.clear()       # a new sample each poll: the whole build
            t = time.thread_time()
            body = server.answer("/api/live", {"view": [view]})[2]
            took.append((time.thread_time() - t) * 1000)
        return statistics.median(took), len(body)
    finally:
        server.close()


def main(quick: bool = False) -> dict:
    p = params(quick)
    rep = common.Report("ui", quick, params={**p, "parallelism": 2, "metrics_interval_s": 1.0, "poll_s": 1.0})
    rep.section("a job with its web view served and polled once a second / the same job without")
    polls: list = []
    server_cpu: list = []
    poller = subprocess.Popen([sys.executable, "-c", _POLLER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        with common.progress("runs", 2 * (p["repeats"] + 1)) as adv:
            def case(served):
                def run():
                    r = run_job(p["n"], poller if served else None, polls, server_cpu)
                    adv()
                    return r
                return run
            s = common.interleaved({"served": case(True), "plain": case(False)}, repeats=p["repeats"])
    finally:
        poller.stdin.write("quit\n")
        poller.stdin.close()
        poller.wait(30)
    rep.add("records_per_s_plain", s.median("plain"), "rec/s", spread=s.spread("plain"))
    rep.add("records_per_s_ui", s.median("served"), "rec/s", spread=s.spread("served"))
    rep.add("ui_overhead_ratio", s.ratio("served", "plain"), "x", goal=Goal(">=", 0.98, "x"),
            note=f"median of {p['repeats']} paired ratios: {[round(x, 3) for x in s.ratios('served', 'plain')]}")
    rep.add("ui_cpu_overhead_ratio", s.ratio("served", "plain", "cpu_rate"), "x",
            note=f"paired ratios: {[round(x, 3) for x in s.ratios('served', 'plain', 'cpu_rate')]}")
    rep.add("ui_poll_ms", statistics.median(x[0] for x in polls) if polls else float("nan"), "ms",
            note=f"{len(polls)} polls, one GET /api/live?view=subtasks each, kept alive")
    rep.add("ui_poll_bytes", statistics.median(x[1] for x in polls) if polls else float("nan"), "B")
    rep.add("ui_server_cpu_ms_per_s", statistics.median(server_cpu) if server_cpu else float("nan"), "ms",
            note=f"{statistics.median(server_cpu) / 10:.2f} % of the job's GIL time" if server_cpu else "")
    rep.section("what one poll costs at 800 subtasks (50 chains x parallelism 16)")
    cpu, size = poll_cpu_ms_800(20 if quick else 60, "subtasks")
    rep.add("ui_poll_cpu_ms_800", cpu, "ms", note=f"the subtask view; {cpu / 10:.2f} % of one core at one "
                                                  "poll a second")
    rep.add("ui_poll_bytes_800", size, "B", note="the subtask view")
    cpu, size = poll_cpu_ms_800(20 if quick else 60, "top")
    rep.add("ui_poll_top_cpu_ms_800", cpu, "ms", note="the Top N view, ranked by the server")
    rep.add("ui_poll_top_bytes_800", size, "B", note="the Top N view")
    cpu, _ = poll_cpu_ms_800(20 if quick else 60, "graph")
    rep.add("ui_poll_graph_cpu_ms_800", cpu, "ms", note="the graph view")
    return rep.as_dict()


if __name__ == "__main__":
    main("--quick" in sys.argv)
