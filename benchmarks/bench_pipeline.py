"""Pipeline benchmark: whole jobs (source -> map -> sink, chaining off, so three
tasks in three threads exchanging through segments), against peers measured
in the same run. Every ratio is the median of per-repetition ratios, ours and
the peer interleaved in each repetition (``common.interleaved``).

per_record_vs_queue_pipeline
    16-byte ``bytes`` records, map(identity), a per-record no-op sink: records/s
    / the same three-thread pipeline built on ``queue.Queue(maxsize=1024)``.
python_map_records_per_s
    ints from ``from_sequence`` through ``map(lambda x: x + 1)`` into a batched
    counting sink (the per-record-sink variant is reported too).
timestamped_python_map_vs_plain
    the same Python map job with timestamps assigned at the source
    (``assign_timestamps(float)`` right after it, which runs in the source's
    task, so every record travels with its time through both exchanges) /
    the job without them, interleaved in one run (issue 22: >= 0.85). The
    extractor is a C function so that the figure is the cost of carrying
    timestamps; ``timestamped_python_map_lambda_vs_plain`` (no goal) has a
    Python lambda instead, which adds one Python call per record, as much
    as the map itself.
batch_records_per_s_16b
    16-byte NumPy rows: ``from_arrays`` -> ``map_batches(identity)`` -> batched
    sink; 256 KiB segments (32 KiB reported too).
slowest_stage_efficiency
    the middle stage sleeps 1 ms every 500 records (2 us of GIL-free work per
    record, a known rate); end-to-end records/s of the job / the same stage
    function run alone over the same records in one thread.
overload_rss_over_pool_mib, overload_lost_records
    the source is rate-limited to 10x what the sink consumes, for
    ``overload_seconds``: peak RSS growth (psutil) minus the configured pool,
    and records the source emitted minus records the sink received.

Run: ``python benchmarks/run.py pipeline [--quick] [--json]`` or
``python benchmarks/bench_pipeline.py [--quick]`` (prints the JSON).
"""
from __future__ import annotations

import gc
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import Goal, perf_counter, rate  # noqa: E402

import pyflowbuf as fb  # noqa: E402

GOALS = {
    "per_record_vs_queue_pipeline": Goal(">=", 5.0, "x"),
    "python_map_records_per_s": Goal(">=", 2.3e6, "records/s"),
    "batch_records_per_s_16b": Goal(">=", 100e6, "records/s"),
    "slowest_stage_efficiency": Goal(">=", 0.9, "x"),
    "timestamped_python_map_vs_plain": Goal(">=", 0.85, "x"),
    "overload_rss_over_pool_mib": Goal("<=", 20.0, "MiB"),
    "overload_lost_records": Goal("<=", 0, "records"),
}

# figures quoted by the issue for PyFlink on this machine kind (not measured here)
PYFLINK_PROCESS_MODE = 60e3
PYFLINK_THREAD_MODE = 228e3

RECORD_16 = b"0123456789abcdef"
ROW_16 = np.dtype([("key", "<i8"), ("value", "<f8")])
BATCH_SEGMENT = 256 * 1024
SLOW_EVERY, SLOW_SLEEP = 500, 0.001          # 2 us of GIL-free work per record
OVERLOAD_SINK_RATE, OVERLOAD_RECORD = 20_000, 100


def params(quick: bool) -> dict:
    if quick:
        return dict(repeats=5, n_records=300_000, n_queue=60_000, n_map=1_500_000,
                    batch_arrays=32, batch_rows=1 << 20, n_slow=150_000, overload_seconds=8.0)
    return dict(repeats=9, n_records=1_000_000, n_queue=200_000, n_map=5_000_000,
                batch_arrays=96, batch_rows=1 << 20, n_slow=400_000, overload_seconds=20.0)


# --------------------------------------------------------------------------- ours


def _execute(env) -> float:
    """Seconds the whole job takes (threads started to all joined)."""
    t0 = perf_counter()
    env.execute()
    return perf_counter() - t0


def per_record_ours(n: int):
    records = [RECORD_16] * n

    def case():
        env = fb.Environment(chaining=False)
        seen = [0]

        def sink(x):
            seen[0] += 1        # the same per-record work as the peer's sink thread

        env.from_collection(records, kind="bytes").map(lambda x: x).sink(sink)
        dt = _execute(env)
        assert seen[0] == n
        return rate(n, dt)
    return case


def queue_pipeline(n: int, maxsize: int = 1024):
    """The peer: the same three stages as threads joined by queue.Queue."""
    records = [RECORD_16] * n
    end = object()

    def case():
        q1, q2 = queue.Queue(maxsize), queue.Queue(maxsize)
        fn = lambda x: x  # noqa: E731 - the same map function as ours
        seen = [0]

        def source():
            put = q1.put
            for r in records:
                put(r)
            put(end)

        def mapper():
            get, put = q1.get, q2.put
            while True:
                x = get()
                if x is end:
                    put(end)
                    return
                put(fn(x))

        def sink():
            get = q2.get
            while True:
                x = get()
                if x is end:
                    return
                seen[0] += 1

        threads = [threading.Thread(target=f) for f in (source, mapper, sink)]
        t0 = perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dt = perf_counter() - t0
        assert seen[0] == n
        return rate(n, dt)
    return case


def python_map(n: int, batched_sink: bool = True):
    def case():
        env = fb.Environment(chaining=False)
        seen = [0]
        s = env.from_sequence(0, n).map(lambda x: x + 1)
        if batched_sink:
            def count(batch):
                seen[0] += len(batch)
            s.sink(count, batched=True)
        else:
            def one(x):
                seen[0] += 1
            s.sink(one)
        dt = _execute(env)
        assert seen[0] == n
        return rate(n, dt)
    return case


def timestamped_python_map(n: int, extractor=float):
    """``python_map`` with event timestamps assigned right after the source
    (in its task): it writes each record with its time, the map's task
    passes the times along, the sink's task reads them."""
    def case():
        env = fb.Environment(chaining=False)
        seen = [0]

        def count(batch):
            seen[0] += len(batch)
        (env.from_sequence(0, n).assign_timestamps(extractor)
            .map(lambda x: x + 1).sink(count, batched=True))
        dt = _execute(env)
        assert seen[0] == n
        return rate(n, dt)
    return case


def batch_rows(arrays: int, rows: int, segment_size: int):
    chunk = np.zeros(rows, ROW_16)
    chunk["key"] = np.arange(rows)
    total = arrays * rows

    def case():
        env = fb.Environment(chaining=False, segment_size=segment_size)
        seen = [0]

        def count(batch):
            for a in batch:
                seen[0] += len(a)

        env.from_arrays([chunk] * arrays).map_batches(lambda a: a).sink(count, batched=True)
        dt = _execute(env)
        assert seen[0] == total
        return {"rate": rate(total, dt), "bytes_per_s": rate(total * ROW_16.itemsize, dt)}
    return case


def _slow_work():
    """A stage with a known rate: 1 ms asleep (GIL released) every 500 records."""
    count = 0
    sleep = time.sleep

    def work(x):
        nonlocal count
        count += 1
        if count == SLOW_EVERY:
            count = 0
            sleep(SLOW_SLEEP)
        return x
    return work


def slow_stage_alone(n: int):
    data = list(range(n))

    def case():
        work = _slow_work()
        t0 = perf_counter()
        out = [work(x) for x in data]       # what the Map operator runs, without the pipeline
        dt = perf_counter() - t0
        assert len(out) == n
        return rate(n, dt)
    return case


def slow_stage_pipeline(n: int, last: dict):
    def case():
        env = fb.Environment(chaining=False)
        seen = [0]
        marks = {}
        lo, hi = n // 10, n - n // 10

        def count(batch):
            c = seen[0] = seen[0] + len(batch)
            if c >= lo and "lo" not in marks:
                marks["lo"] = (perf_counter(), c)
            if c >= hi and "hi" not in marks:
                marks["hi"] = (perf_counter(), c)

        env.from_sequence(0, n).map(_slow_work(), name="slow").sink(count, batched=True)
        dt = _execute(env)
        assert seen[0] == n
        (t0, c0), (t1, c1) = marks["lo"], marks["hi"]
        last["summary"] = env.last_execution.summary()
        return {"rate": rate(n, dt), "steady": rate(c1 - c0, t1 - t0)}
    return case


def overload(seconds: float) -> dict:
    """The source is throttled to 10x the sink's rate: backpressure must hold it,
    RSS must not grow beyond the pool, nothing may be lost."""
    import psutil

    proc = psutil.Process()
    payload = b"x" * OVERLOAD_RECORD
    counts = {"source": 0, "sink": 0}
    deadline = [0.0]

    def source():
        n = 0
        while time.monotonic() < deadline[0]:
            n += 1
            counts["source"] = n
            yield payload

    def sink(batch):
        counts["sink"] += len(batch)
        time.sleep(len(batch) / OVERLOAD_SINK_RATE)

    env = fb.Environment(chaining=False)
    (env.from_generator(source, kind="bytes", rate_limit=10 * OVERLOAD_SINK_RATE)
        .map(lambda b: b)
        .sink(sink, batched=True))
    gc.collect()
    rss0 = proc.memory_info().rss
    deadline[0] = time.monotonic() + seconds
    t0 = perf_counter()
    job = env.execute_async()
    peak = rss0
    in_use_peak = 0
    while not job.done:
        peak = max(peak, proc.memory_info().rss)
        in_use_peak = max(in_use_peak, job.network_pool.in_use_segments)
        time.sleep(0.02)
    job.join()
    dt = perf_counter() - t0
    pool = job.network_pool
    pool_mib = pool.total_bytes / 2**20
    summary = job.summary()
    src = next(m for name, m in summary.items() if name.startswith("generator"))
    return {
        "rss_growth_mib": (peak - rss0) / 2**20,
        "pool_mib": pool_mib,
        "pool_segments": pool.total_segments,
        "pool_in_use_peak": in_use_peak,
        "source_records": counts["source"],
        "sink_records": counts["sink"],
        "wall_s": dt,
        "source_backpressured_ms_per_s": src["backpressured_ms_per_s"],
    }


def overload_in_subprocess(seconds: float) -> dict:
    """Run ``overload`` in a fresh interpreter, so that memory freed by the
    other measurements (and kept by the allocator) cannot hide RSS growth."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import bench_pipeline as b; "
            "print(json.dumps(b.overload(float(sys.argv[2]))))")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parent), str(seconds)],
                         capture_output=True, text=True, timeout=seconds + 120, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"overload run failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- main


def main(quick: bool = False) -> dict:
    p = params(quick)
    reps = p["repeats"]
    rep = common.Report("pipeline", quick, params={
        **p, "record_bytes": len(RECORD_16), "row_dtype": str(ROW_16), "batch_segment_size": BATCH_SEGMENT,
        "slow_stage": f"sleep {SLOW_SLEEP * 1e3:g} ms every {SLOW_EVERY} records",
        "overload_sink_records_per_s": OVERLOAD_SINK_RATE, "overload_source_rate_limit": 10 * OVERLOAD_SINK_RATE,
        "overload_record_bytes": OVERLOAD_RECORD, "chaining": False, "queue_maxsize": 1024})

    # ---------------------------------------------------------------- per record vs queue.Queue
    rep.section("per record: source -> map(identity) -> sink, 16-byte bytes records, 3 threads")
    with common.progress("per record", reps) as adv:
        s = common.interleaved({
            "ours": per_record_ours(p["n_records"]),
            "queue": queue_pipeline(p["n_queue"]),
        }, reps, advance=adv)
    rep.add("per_record_records_per_s", s.median("ours"), "records/s", spread=s.spread("ours"))
    rep.add("queue_pipeline_records_per_s", s.median("queue"), "records/s", spread=s.spread("queue"),
            note="peer: 3 threads joined by queue.Queue(maxsize=1024)")
    rep.add("per_record_vs_queue_pipeline", s.ratio("ours", "queue"), "x", goal=GOALS["per_record_vs_queue_pipeline"])

    # ---------------------------------------------------------------- Python map over ints
    rep.section("Python map: from_sequence -> map(lambda x: x + 1) -> sink")
    with common.progress("python map", reps) as adv:
        s = common.interleaved({
            "batched_sink": python_map(p["n_map"], True),
            "record_sink": python_map(p["n_map"] // 2, False),
        }, reps, advance=adv)
    m = rep.add("python_map_records_per_s", s.median("batched_sink"), "records/s",
                goal=GOALS["python_map_records_per_s"], spread=s.spread("batched_sink"),
                note="batched counting sink")
    rep.add("python_map_records_per_s_record_sink", s.median("record_sink"), "records/s",
            spread=s.spread("record_sink"), note="a Python sink function called per record")
    rep.add("python_map_vs_pyflink_thread_mode", m / PYFLINK_THREAD_MODE, "x",
            note="against the issue's 228 k/s (not measured here)")
    rep.add("python_map_vs_pyflink_process_mode", m / PYFLINK_PROCESS_MODE, "x",
            note="against the issue's 60 k/s (not measured here)")

    # ---------------------------------------------------------------- timestamps that travel
    rep.section("timestamps: the Python map job with timestamps assigned after the source / without")
    with common.progress("timestamped map", reps) as adv:
        s = common.interleaved({
            "plain": python_map(p["n_map"], True),
            "timestamped": timestamped_python_map(p["n_map"]),
            "lambda": timestamped_python_map(p["n_map"], lambda x: x * 1e-3),
        }, reps, advance=adv)
    rep.add("timestamped_python_map_records_per_s", s.median("timestamped"), "records/s",
            spread=s.spread("timestamped"), note="assign_timestamps(float) after the source")
    rep.add("timestamped_python_map_vs_plain", s.ratio("timestamped", "plain"), "x",
            goal=GOALS["timestamped_python_map_vs_plain"], note="the same job without timestamps, interleaved")
    rep.add("timestamped_python_map_lambda_vs_plain", s.ratio("lambda", "plain"), "x",
            note="assign_timestamps(lambda x: x * 1e-3): one more Python call per record")

    # ---------------------------------------------------------------- batch API, 16-byte rows
    rep.section("batch API: from_arrays -> map_batches(identity) -> sink, 16-byte NumPy rows")
    with common.progress("batch rows", reps) as adv:
        s = common.interleaved({
            "seg256k": batch_rows(p["batch_arrays"], p["batch_rows"], BATCH_SEGMENT),
            "seg32k": batch_rows(p["batch_arrays"], p["batch_rows"], 32 * 1024),
        }, reps, advance=adv)
    rep.add("batch_records_per_s_16b", s.median("seg256k"), "records/s", goal=GOALS["batch_records_per_s_16b"],
            spread=s.spread("seg256k"), note="256 KiB segments")
    rep.add("batch_bytes_per_s_16b", s.median("seg256k", "bytes_per_s"), "B/s")
    rep.add("batch_records_per_s_16b_seg32k", s.median("seg32k"), "records/s", spread=s.spread("seg32k"),
            note="default 32 KiB segments")

    # ---------------------------------------------------------------- slowest stage
    rep.section(f"slowest stage: the middle map sleeps {SLOW_SLEEP * 1e3:g} ms every {SLOW_EVERY} records")
    last: dict = {}
    with common.progress("slowest stage", reps) as adv:
        s = common.interleaved({
            "alone": slow_stage_alone(p["n_slow"]),
            "pipeline": slow_stage_pipeline(p["n_slow"], last),
        }, reps, advance=adv)
    rep.add("slow_stage_alone_records_per_s", s.median("alone"), "records/s", spread=s.spread("alone"),
            note="the stage function over a list, one thread")
    rep.add("slow_stage_pipeline_records_per_s", s.median("pipeline"), "records/s", spread=s.spread("pipeline"),
            note="whole job, wall clock")
    rep.add("slow_stage_pipeline_steady_records_per_s", s.median("pipeline", "steady"), "records/s",
            note="at the sink, 10 %..90 % of the records")
    rep.add("slowest_stage_efficiency", s.ratio("pipeline", "alone"), "x", goal=GOALS["slowest_stage_efficiency"],
            note="end-to-end (wall clock) / stage alone")
    steady = statistics.median(r["steady"] / a["rate"] for r, a in zip(s.runs["pipeline"], s.runs["alone"]))
    rep.add("slowest_stage_efficiency_steady", steady, "x", note="steady state / stage alone")
    # where the time goes in the last pipeline run (ms per second, whole run)
    rep.figures["slow_stage_tasks_busy_idle_backpressured_ms_per_s"] = {
        name: f"{mt['busy_ms_per_s']:.0f} / {mt['idle_ms_per_s']:.0f} / {mt['backpressured_ms_per_s']:.0f}"
        for name, mt in last.get("summary", {}).items()}

    # ---------------------------------------------------------------- overload
    secs = p["overload_seconds"]
    rep.section(f"overload: source rate-limited to 10x the sink for {secs:g} s"
                + (" (quick mode: shortened from 20 s)" if quick else ""))
    o = overload_in_subprocess(secs)
    rep.add("overload_seconds", secs, "s", note="quick mode shortens the 20 s run" if quick else "")
    rep.add("overload_rss_growth_mib", o["rss_growth_mib"], "MiB",
            note="peak RSS - RSS before the job, in a fresh interpreter")
    rep.add("overload_pool_mib", o["pool_mib"], "MiB", note=f"{o['pool_segments']} segments configured")
    rep.add("overload_pool_in_use_peak_segments", o["pool_in_use_peak"], "segments")
    rep.add("overload_rss_over_pool_mib", o["rss_growth_mib"] - o["pool_mib"], "MiB",
            goal=GOALS["overload_rss_over_pool_mib"])
    rep.add("overload_source_records", o["source_records"], "records")
    rep.add("overload_sink_records", o["sink_records"], "records")
    rep.add("overload_lost_records", o["source_records"] - o["sink_records"], "records",
            goal=GOALS["overload_lost_records"])
    rep.add("overload_sink_records_per_s", o["sink_records"] / o["wall_s"], "records/s",
            note=f"sink limit {OVERLOAD_SINK_RATE}/s, source limit {10 * OVERLOAD_SINK_RATE}/s")
    rep.add("overload_source_backpressured_ms_per_s", o["source_backpressured_ms_per_s"], "ms/s")
    return rep.as_dict()


if __name__ == "__main__":
    result = main(quick="--quick" in sys.argv[1:])
    sys.stdout.write(json.dumps(common.jsonable(result), allow_nan=False, separators=(",", ":")) + "\n")
