"""Buffer debloating benchmark: in-flight data and memory under backpressure,
and what debloating costs without it. Every figure compares a job with
``debloat=True`` against the same job without, measured in the same run.

debloat_inflight_ratio_backpressure
    bytes queued in the input gates (median of samples over the steady
    part) with / without debloating: a rate-limited source of 200-byte
    records, a sink 20x slower, chaining off, output pools of (2, 32)
    segments of 32 KiB. Goal <= 0.2.
debloat_throughput_ratio
    records/s of source -> map -> sink (chaining off, no backpressure), with /
    without, interleaved repetitions. Goal >= 0.95. Each run lasts about a
    second or more (quick: 3 M records): with debloating, channels start at
    ``min_buffer_size`` until the first measurement (~0.1 s in), and a run of
    0.2 s measured mostly that start. ``debloat_throughput_ratio_short``: the
    same with 600 k records (about 0.2 s a run, the former size), start-up
    included, no goal.
debloat_time_to_consume_s
    the sink gate's estimated time to consume its in-flight buffers (size *
    buffers in use / throughput) in the backpressured job, median. Goal:
    within 2x of debloat_target (1 s).
debloat_pool_segments_ratio
    segments held by the output pools in that job, with / without. Goal <= 0.5.
debloat_rss_mib_saved
    resident memory (of the process, /proc) of a job whose output pool holds
    up to 256 MiB (output_buffers=(2, 8192)) under the same backpressure,
    without minus with debloating; each in a fresh process.
aligned_checkpoint_s_backpressure_debloat
    median aligned checkpoint duration (a checkpoint a second) of the
    checkpoint bench's backpressured job (keyed count, default buffers, 32 KiB
    segments, a sink 20x slower) with debloating; ``..._plain`` next to it is
    the same job without, ``aligned_checkpoint_debloat_speedup`` their ratio.

Run: ``python benchmarks/run.py debloat [--quick] [--json]``.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_checkpoint  # noqa: E402
import common  # noqa: E402
from common import Goal  # noqa: E402

import pyflowbuf as fb  # noqa: E402

RECORD = 200


def params(quick: bool) -> dict:
    if quick:
        return dict(bp_seconds=14.0, warm_s=6.0, rate=10_000, pools=(2, 32), n=3_000_000, n_short=600_000, repeats=3,
                    rss_seconds=8.0, rss_rate=20_000, ck_seconds=24.0, ck_warm_s=4.0)
    return dict(bp_seconds=40.0, warm_s=10.0, rate=10_000, pools=(2, 32), n=10_000_000, n_short=600_000, repeats=7,
                rss_seconds=15.0, rss_rate=20_000, ck_seconds=60.0, ck_warm_s=4.0)


def backpressure(debloat: bool, p: dict, tmp) -> dict:
    """Source at ``rate`` records/s, sink 20x slower; samples once the
    queues settled: in-flight bytes, pool segments, time to consume."""
    env = fb.Environment(chaining=False, max_batch=16, output_buffers=p["pools"], debloat=debloat)
    sink_rate = p["rate"] / 20

    def slow_sink(batch):
        time.sleep(len(batch) / sink_rate)

    (env.from_sequence(0, None, rate_limit=p["rate"])
        .map(lambda x: b"r" * RECORD, kind="bytes", name="pad")
        .sink(slow_sink, batched=True, name="sink"))
    job = env.execute_async()
    inflight, segments, ttc = [], [], []
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < p["bp_seconds"]:
            time.sleep(0.1)
            if time.monotonic() - t0 < p["warm_s"]:
                continue
            q_bytes = 0
            for t in job.tasks:
                if t.input is not None:
                    q_bytes += sum(t.input.gate.queued_bytes_per_channel())
            inflight.append(q_bytes)
            segments.append(sum(o.pool.in_use for t in job.tasks for o in t.outputs))
            for t in job.tasks:
                for g in getattr(t, "debloat_gates", None) or []:
                    if t.vertex.name.startswith("sink") and g["time_to_consume_s"]:
                        ttc.append(g["time_to_consume_s"])
    finally:
        job.cancel()
        try:
            job.join(60)
        except fb.errors.JobFailedError:
            pass
    return {"inflight": statistics.median(inflight), "segments": statistics.median(segments),
            "ttc": statistics.median(ttc) if ttc else float("nan")}


def steady_durations(entries, warm_s) -> list:
    """Durations of the checkpoints triggered ``warm_s`` after the first one
    (or, when none was, of all of them)."""
    if not entries:
        return []
    t0 = min(c["trigger_time"] for c in entries)
    later = [c["duration_s"] for c in entries if c["trigger_time"] >= t0 + warm_s]
    return later or [c["duration_s"] for c in entries]


def throughput_case(n: int, debloat: bool):
    def run():
        env = fb.Environment(chaining=False, debloat=debloat)
        seen = [0]
        (env.from_sequence(0, n).map(lambda x: x + 1, kind="int64", name="map")
            .sink(lambda b: seen.__setitem__(0, seen[0] + len(b)), batched=True, name="sink"))
        t0 = time.perf_counter()
        env.execute(600)
        dt = time.perf_counter() - t0
        assert seen[0] == n
        return n / dt
    return run


_RSS_CHILD = r"""
import sys, time
import pyflowbuf as fb
debloat, seconds, rate = sys.argv[1] == "1", float(sys.argv[2]), int(sys.argv[3])
env = fb.Environment(chaining=False, max_batch=16, output_buffers=(2, 8192), debloat=debloat)
payload = b"m" * 4000
sink_rate = rate / 20
def slow_sink(batch):
    time.sleep(len(batch) / sink_rate)
env.from_sequence(0, None, rate_limit=rate).map(lambda x: payload, kind="bytes", name="pad") \
   .sink(slow_sink, batched=True, name="sink")
job = env.execute_async()
time.sleep(seconds)
pages = int(open("/proc/self/statm").read().split()[1])
arena = job.network_pool.total_bytes
job.cancel()
try:
    job.join(60)
except Exception:
    pass
print(pages * 4096, arena)
"""


def rss(debloat: bool, p: dict) -> tuple:
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, "1" if debloat else "0", str(p["rss_seconds"]),
                          str(p["rss_rate"])], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    rss_b, arena = out.stdout.split()[-2:]
    return int(rss_b), int(arena)


def main(quick: bool = False) -> dict:
    p = params(quick)
    rep = common.Report("debloat", quick, params={**p, "record_bytes": RECORD, "segment_size": 32 * 1024,
                                                   "debloat_target_s": 1.0, "debloat_period_s": 0.2})
    with tempfile.TemporaryDirectory(prefix="pyflowbuf-bench-") as tmp:
        rep.section("a sink 20x slower than the source: in-flight data and pools")
        with common.progress("backpressure", 2) as adv:
            plain = backpressure(False, p, tmp)
            adv()
            deb = backpressure(True, p, tmp)
            adv()
        rep.add("inflight_bytes_plain", plain["inflight"], "B")
        rep.add("inflight_bytes_debloat", deb["inflight"], "B")
        rep.add("debloat_inflight_ratio_backpressure", deb["inflight"] / max(plain["inflight"], 1), "x",
                goal=Goal("<=", 0.2, "x"))
        rep.add("debloat_time_to_consume_s", deb["ttc"], "s", goal=Goal("<=", 2.0, "s"),
                note="goal: within 2x of the 1 s target")
        rep.add("debloat_pool_segments_ratio", deb["segments"] / max(plain["segments"], 1), "x",
                goal=Goal("<=", 0.5, "x"), note=f"{deb['segments']:.0f} vs {plain['segments']:.0f} segments")
        # The checkpoint bench's backpressured job (keyed count, default
        # buffers, a sink 20x slower), aligned checkpoints with and without
        # debloating: seed 004's "more predictable checkpoint time".
        rep.section("aligned checkpoints under backpressure (the checkpoint bench's job), debloat vs plain")
        with common.progress("checkpoints", 2) as adv:
            ck_plain = bench_checkpoint.backpressure_durations(p["ck_seconds"], 200_000, tmp)
            adv()
            ck_deb = bench_checkpoint.backpressure_durations(p["ck_seconds"], 200_000, tmp, debloat=True)
            adv()
        # the first checkpoint waits behind what the source queued before the
        # debloater measured anything: count those triggered after a warm-up
        steady = {k: steady_durations(v["entries"], p["ck_warm_s"]) for k, v in
                  (("plain", ck_plain), ("debloat", ck_deb))}
        med = {k: statistics.median(v) if v else float("nan") for k, v in steady.items()}
        rep.add("aligned_checkpoint_s_backpressure_debloat", med["debloat"], "s",
                note=f"median of {len(steady['debloat'])} triggered after {p['ck_warm_s']} s, "
                     f"of {len(ck_deb['durations'])} completed in {p['ck_seconds']} s")
        rep.add("aligned_checkpoint_s_backpressure_plain", med["plain"], "s",
                note=f"median of {len(steady['plain'])} triggered after {p['ck_warm_s']} s, same job "
                     "without debloating")
        rep.add("aligned_checkpoint_debloat_speedup", med["plain"] / med["debloat"], "x")

        rep.section("no backpressure: what debloating costs")
        with common.progress("throughput", p["repeats"]) as adv:
            s = common.interleaved({"debloat": throughput_case(p["n"], True),
                                    "plain": throughput_case(p["n"], False)}, p["repeats"], advance=adv)
        rep.add("debloat_records_per_s", s.median("debloat"), "records/s")
        rep.add("plain_records_per_s", s.median("plain"), "records/s")
        rep.add("debloat_throughput_ratio", s.ratio("debloat", "plain"), "x", goal=Goal(">=", 0.95, "x"),
                note=f"{p['n']:,} records a run")
        with common.progress("throughput (short runs)", p["repeats"]) as adv:
            s = common.interleaved({"debloat": throughput_case(p["n_short"], True),
                                    "plain": throughput_case(p["n_short"], False)}, p["repeats"], advance=adv)
        rep.add("debloat_throughput_ratio_short", s.ratio("debloat", "plain"), "x",
                note=f"{p['n_short']:,} records a run: the first ~0.1 s on min_buffer_size buffers weighs in")

        rep.section("resident memory of a job whose output pool may hold 256 MiB")
        with common.progress("rss", 2) as adv:
            rss_plain, arena = rss(False, p)
            adv()
            rss_deb, _ = rss(True, p)
            adv()
        rep.add("rss_mib_plain", rss_plain / 2**20, "MiB", note=f"arena {arena / 2**20:.0f} MiB")
        rep.add("rss_mib_debloat", rss_deb / 2**20, "MiB")
        rep.add("debloat_rss_mib_saved", (rss_plain - rss_deb) / 2**20, "MiB")
    return rep.as_dict()


if __name__ == "__main__":
    result = main(quick="--quick" in sys.argv[1:])
    sys.stdout.write(json.dumps(common.jsonable(result), allow_nan=False, separators=(",", ":")) + "\n")
