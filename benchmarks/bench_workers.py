"""Worker processes: what ``Environment(workers=N)`` buys a CPU-bound Python
operator. The GIL lets threads run Python code one at a time; worker
processes joined by the TCP exchange do not share it.

workers2_vs_threads_cpu_map
    from_sequence -> map(cpu-bound Python function, parallelism 2) -> batched
    counting sink; records/s with workers=2 / the same job in threads.
workers2_vs_one_core_loop
    the same records/s / a plain single-thread Python loop calling the same
    function (the one-core limit, measured in the same repetition). On a
    2-core machine the ideal is 2; the exchange, the sink and the source
    share those cores.

Run: ``python benchmarks/run.py workers [--quick] [--json]``.
"""
from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Goal  # noqa: E402

import pyflowbuf as fb  # noqa: E402
from pyflowbuf.errors import WorkerSideEffectWarning  # noqa: E402

WORK = 60  # inner loop length: about 2-3 us of Python per record


def cpu_work(x: int) -> int:
    acc = x
    for i in range(WORK):
        acc = (acc * 31 + i) & 0xFFFF
    return acc


def job_rate(n: int, workers):
    def run():
        count = [0]

        def sink(batch):
            count[0] += len(batch)

        env = fb.Environment(workers=workers, parallelism=2, name="cpu-map")
        (env.from_sequence(0, n, parallelism=1)
            .map(cpu_work, name="cpu-map", kind="int64")
            .map(lambda x: x, parallelism=1, name="funnel", kind="int64")
            .sink(sink, batched=True, parallelism=1))
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            # with workers the sink counts in a worker's copy; the metrics say what it saw
            warnings.simplefilter("ignore", WorkerSideEffectWarning)
            env.execute(timeout=600)
        dt = time.perf_counter() - t0
        # the funnel and the sink are chained into one task: its records in are the sink's
        seen = sum(m["records_in"] for m in env.metrics().values() if m["vertex"].endswith("sink"))
        if seen != n:
            raise AssertionError(f"the sink saw {seen} of {n} records")
        return n / dt
    return run


def loop_rate(n: int):
    def run():
        t0 = time.perf_counter()
        for x in range(n):
            cpu_work(x)
        return n / (time.perf_counter() - t0)
    return run


def main(quick: bool = False) -> dict:
    reps = 3 if quick else 7
    n = 150_000 if quick else 500_000
    rep = common.Report("workers", quick, params={"records": n, "repeats": reps, "inner_loop": WORK,
                                                  "parallelism": 2})
    rep.section("CPU-bound Python map, parallelism 2: threads vs 2 worker processes")
    with common.progress("workers", reps) as adv:
        s = common.interleaved({
            "workers": job_rate(n, 2),
            "threads": job_rate(n, None),
            "loop": loop_rate(n // 2),
        }, reps, advance=adv)
    rep.add("workers2_records_per_s", s.median("workers"), "records/s", spread=s.spread("workers"))
    rep.add("threads_records_per_s", s.median("threads"), "records/s", spread=s.spread("threads"))
    rep.add("one_core_loop_records_per_s", s.median("loop"), "records/s", spread=s.spread("loop"),
            note="the function alone in a Python for loop")
    rep.add("workers2_vs_threads_cpu_map", s.ratio("workers", "threads"), "x",
            goal=Goal(">=", 1.3, "x"), note="ideal 2 on 2 cores")
    rep.add("workers2_vs_one_core_loop", s.ratio("workers", "loop"), "x", note="ideal 2 on 2 cores")
    rep.add("threads_vs_one_core_loop", s.ratio("threads", "loop"), "x", note="the GIL caps this near 1")
    return rep.as_dict()


if __name__ == "__main__":
    result = main(quick="--quick" in sys.argv[1:])
    sys.stdout.write(json.dumps(common.jsonable(result), allow_nan=False, separators=(",", ":")) + "\n")
