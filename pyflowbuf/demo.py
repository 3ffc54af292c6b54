"""The main job: an end-to-end demonstration on embedded defaults.

1. A local multi-stage pipeline with a deliberately slow stage: the live view
   shows backpressure reaching the source while memory stays inside the pool.
2. The same idea inside PySpark (local[*]): a DataFrame of a few million rows
   goes through a pyflowbuf pipeline in mapInArrow.
3. Checkpoints: a keyed count with a text sink fails once halfway, restarts
   from its latest checkpoint (in ./out/checkpoints) and ends with exactly
   the output of a run without failure.
4. Event time: a windowed word count over Parquet, unaligned checkpoints, a
   failure in the middle of open windows.
5. The same windowed count as one dataflow over two Spark barrier tasks.
6. The backpressure experiment of Flink's blog post, written as PNG + CSV,
   with the job's web view served while it runs.
7. Kafka as the durable source: a local broker, the lag growing in Kafka
   while the sink side is slow, memory flat, one failure, the output read
   back exactly once.
Everything lands in ./out (override with PYFLOWBUF_OUT).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from pyflowbuf.experiments.kafka_demo import kafka_demo


def _rss_mib() -> float:
    try:
        import psutil
        return psutil.Process().memory_info().rss / 2**20
    except ImportError:  # pragma: no cover
        return float("nan")


def local_pipeline_demo(records: int = 2_000_000, console=None) -> dict:
    """source -> parse -> slow enrichment (parallelism 2) -> keyed count -> sink."""
    import pyflowbuf as fb

    class SlowEnrich:
        """A stand-in for an I/O call: every 1000 records cost 1 ms of waiting."""

        def __init__(self):
            self.n = 0

        def __call__(self, x):
            self.n += 1
            if self.n % 1000 == 0:
                time.sleep(0.001)
            return (x % 97, 1)

    latest: dict = {}

    def remember(batch):
        for k, c in batch:
            latest[k] = c

    env = fb.Environment(parallelism=1, chaining=False, metrics_interval=0.5,
                         live_view=sys.stdout.isatty(), name="local-demo")
    (env.from_sequence(0, records, name="source")
        .map(lambda x: x * 3 + 1, name="parse")
        .map(SlowEnrich(), parallelism=2, name="slow-enrich", kind="pickle")
        .key_by(lambda kv: kv[0])
        .reduce(lambda a, b: (a[0], a[1] + b[1]), name="keyed-count")
        .sink(remember, batched=True, name="sink"))
    rss0 = _rss_mib()
    t0 = time.perf_counter()
    job = env.execute_async()
    peak = rss0
    pool_peak = 0
    while not job.done:
        time.sleep(0.2)
        peak = max(peak, _rss_mib())
        pool_peak = max(pool_peak, job.network_pool.in_use_segments)
    job.join()
    dt = time.perf_counter() - t0
    summary = job.summary()
    result = {
        "records": records,
        "seconds": round(dt, 2),
        "records_per_s": round(records / dt),
        "keys": len(latest),
        "counted": sum(latest.values()),
        "pool_segments": job.network_pool.total_segments,
        "pool_peak_segments": pool_peak,
        "pool_mib": round(job.network_pool.total_bytes / 2**20, 2),
        "rss_growth_mib": round(peak - rss0, 1),
        "stages": {name: {"level": m["level"], "busy_ms_per_s": m["busy_ms_per_s"],
                          "backpressured_ms_per_s": m["backpressured_ms_per_s"],
                          "idle_ms_per_s": m["idle_ms_per_s"], "records_in": m["records_in"]}
                   for name, m in summary.items()},
    }
    return result


def checkpoint_job(env, records: int, fail_once, sink_dir) -> None:
    """The keyed count of ``checkpoint_demo``, declared on ``env``. Every
    stateful operator has a uid: the id its state is stored under, whatever
    is changed around it later."""
    (env.from_sequence(0, records, parallelism=1, rate_limit=records / 3).uid("numbers")   # about 3 s
        .map(fail_once, name="fails-once", kind="int64")
        .map(lambda x: (x % 10, x), kind="struct", name="pair")
        .key_by(lambda kv: kv[0])
        .reduce(lambda a, b: (a[0], a[1] + b[1]), name="sum").uid("sums")
        .map(lambda kv: f"{kv[0]},{kv[1]}", kind="str", name="format")
        .write_text(sink_dir, parallelism=1).uid("sums-out"))


def checkpoint_demo(out: Path, records: int = 200_000) -> dict:
    """A keyed count that fails once, recovers from its checkpoint, and still
    writes each running count exactly once (two-phase-committed part files)."""
    import shutil

    import pyflowbuf as fb

    chk, sink_dir = out / "checkpoints", out / "checkpointed-counts"
    for d in (chk, sink_dir):
        shutil.rmtree(d, ignore_errors=True)
    failed = []

    def fail_once(x):
        if x == records // 2 and not failed:
            failed.append(time.monotonic())
            raise RuntimeError("injected failure (the demo kills this task once)")
        return x

    env = fb.Environment(parallelism=2, chaining=False, checkpoint_interval=0.2, checkpoint_dir=chk,
                         restart_attempts=1, name="checkpoint-demo")
    checkpoint_job(env, records, fail_once, sink_dir)
    t0 = time.perf_counter()
    env.execute(300)
    lines = []
    for f in sorted(sink_dir.glob("part-*")):
        lines += f.read_text().splitlines()
    sums: dict = {}
    want = []
    for x in range(records):
        sums[x % 10] = sums.get(x % 10, 0) + x
        want.append(f"{x % 10},{sums[x % 10]}")
    done = [c for c in env.checkpoints() if c["status"] == "completed"]
    result = {
        "records": records,
        "seconds": round(time.perf_counter() - t0, 2),
        "restarts": env.last_execution.restarts,
        "restored_from_checkpoint": env.last_execution.restored_from,
        "checkpoints_completed": len(done),
        "median_checkpoint_ms": round(1000 * sorted(c["duration_s"] for c in done)[len(done) // 2], 1) if done else None,
        "output_lines": len(lines),
        "exactly_once": sorted(lines) == sorted(want),
        "checkpoint_dir": str(chk),
    }
    for k, v in result.items():
        print(f"  {k:>26}: {v}")
    return result


def windows_job(env, src, lines: int, fail_once):
    """The windowed word count of ``windows_demo``, declared on ``env``
    (with a uid for each stateful operator); returns its collect() handle."""
    import pyflowbuf as fb
    from pyflowbuf.windows import Count

    return (env.read_parquet(src, rate_limit=lines / 2).uid("lines")          # about 2 s
               .map(fail_once, name="fails-once")
               .flat_map(lambda r: [(w, r["ts"]) for w in r["text"].split()], name="words")
               .assign_timestamps(lambda wt: wt[1], out_of_orderness=0.5).uid("event-time")   # disorder: 0.4 s at most
               .key_by(lambda wt: wt[0])
               .window(fb.Tumbling(1.0))
               .aggregate(Count(), window_function=lambda w, win, n: (w, win.start, n)).uid("word-counts")
               .collect().uid("results"))


def windows_demo(out: Path, lines: int = 20_000) -> dict:
    """A windowed word count over a Parquet file (event time, 1 s tumbling
    windows, out-of-order timestamps), with unaligned checkpoints, a failure in
    the middle of open windows, and a check against a plain-Python count."""
    import random
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    import pyflowbuf as fb

    words = ["stream", "buffer", "credit", "barrier", "window", "spark", "arrow", "flink"]
    rng = random.Random(7)
    ts = [i / 1000 + rng.uniform(-0.2, 0.2) for i in range(lines)]       # ~1 000 lines/s, out of order
    text = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 6))) for _ in range(lines)]
    src = out / "lines.parquet"
    pq.write_table(pa.table({"ts": ts, "text": text}), src, row_group_size=2_000)
    chk = out / "window-checkpoints"
    shutil.rmtree(chk, ignore_errors=True)
    failed = []

    def fail_once(row):
        if len(failed) == 0 and row["ts"] > lines / 2000:
            failed.append(1)
            raise RuntimeError("injected failure (the demo kills this task once)")
        return row

    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=chk, restart_attempts=1,
                         checkpoint_alignment="unaligned", name="windows-demo")
    counts = windows_job(env, src, lines, fail_once)
    t0 = time.perf_counter()
    env.execute(300)
    want: dict = {}
    for t, line in zip(ts, text):
        for w in line.split():
            key = (w, float(t // 1.0))
            want[key] = want.get(key, 0) + 1
    got = {(w, float(start)): n for w, start, n in counts.result}
    done = [c for c in env.checkpoints() if c["status"] == "completed"]
    result = {
        "lines": lines,
        "seconds": round(time.perf_counter() - t0, 2),
        "restarts": env.last_execution.restarts,
        "windows": len(got),
        "checkpoints_completed": len(done),
        "checkpoint_modes": sorted({c.get("alignment") for c in done}),
        "inflight_bytes_max": max((c.get("inflight_bytes") or 0 for c in done), default=0),
        "exactly_once": got == want and len(counts.result) == len(want),
    }
    for k, v in result.items():
        print(f"  {k:>26}: {v}")
    return result


def _print_stages(title, res):
    print(f"\n== {title} ==")
    for k, v in res.items():
        if k != "stages":
            print(f"  {k:>22}: {v}")
    print(f"  {'task':<40} {'level':<5} {'busy':>6} {'bp':>6} {'idle':>6}  (ms per second)")
    for name, m in res.get("stages", {}).items():
        print(f"  {name:<40} {m['level']:<5} {m['busy_ms_per_s']:>6} {m['backpressured_ms_per_s']:>6} "
              f"{m['idle_ms_per_s']:>6}")


def run_demo(quick: bool = False) -> int:
    out = Path(os.environ.get("PYFLOWBUF_OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    t_start = time.perf_counter()

    print("[1/7] local pipeline with a slow stage (threads, bounded pools)")
    report["local"] = local_pipeline_demo(500_000 if quick else 2_000_000)
    _print_stages("local pipeline", report["local"])

    print("\n[2/7] PySpark (local[*]): a DataFrame through a pyflowbuf pipeline in mapInArrow")
    try:
        from pyflowbuf.spark.demo import run_spark_demo
    except ImportError as exc:
        print(f"  skipped: {exc}")
    else:
        report["spark"] = run_spark_demo(rows=500_000 if quick else 3_000_000, quick=quick)

    print("\n[3/7] checkpoints: a keyed count fails once and recovers, exactly once")
    report["checkpoints"] = checkpoint_demo(out, 100_000 if quick else 200_000)

    print("\n[4/7] event time: a windowed word count over Parquet, unaligned checkpoints, one failure")
    report["windows"] = windows_demo(out, 10_000 if quick else 20_000)

    print("\n[5/7] Spark executors: the windowed word count as one dataflow over two Spark barrier tasks, "
          "one failure, exactly once")
    try:
        from pyflowbuf.spark.cluster_demo import run_cluster_demo
    except ImportError as exc:
        print(f"  skipped: {exc}")
    else:
        report["spark_cluster"] = run_cluster_demo(out, quick=quick)

    print("\n[6/7] the backpressure experiment (Flink blog, 2 buffers of 4 KiB)")
    try:
        from pyflowbuf.experiments.backpressure import run_experiment
    except ImportError as exc:
        print(f"  skipped: {exc}")
    else:
        report["experiment"] = run_experiment(out, quick=quick, ui=True)
        print(f"  plot: {report['experiment'].get('png')}  csv: {report['experiment'].get('csv')}")

    print("\n[7/7] Kafka, the durable source: a local broker (KRaft), lag grows in Kafka while the sink side is "
          "slow and memory stays flat; one failure; the output read back exactly once")
    report["kafka"] = kafka_demo(out, quick=quick)

    report["total_seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "demo_report.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"\ndone in {report['total_seconds']} s; report: {out / 'demo_report.json'}")
    wrong = [step for step, res in report.items() if isinstance(res, dict) and res.get("exactly_once") is False]
    if wrong:
        print(f"NOT exactly once: {', '.join(wrong)}", file=sys.stderr)
        return 1
    return 0
