"""Reproduces the experiment of "How Apache Flink handles backpressure".

A producer task and a consumer task exchange records locally through an
output pool of exactly 2 buffers of 4096 bytes
(``Environment(segment_size=4096, output_buffers=(2, 2), chaining=False)``).
Slow-downs are simulated with sleeps inside the operators (the article uses
Thread.sleep): the producer is a generator source and the consumer a batched
sink, each with a :class:`~pyflowbuf.experiments.throttle.Pacer` reading a
shared :class:`~pyflowbuf.experiments.throttle.Speed` that this module's
controller changes on schedule.

1. calibration: both run unthrottled; each task's maximum rate (records/s
   written by the producer, read by the consumer) is measured - the
   article's "maximum attained throughput" - so percentages mean something;
2. phases of equal length: the producer runs at 60 % of its maximum
   throughout, the consumer at 100 %, 30 %, 100 %, 30 %, 100 %.

Every ``interval`` seconds both throughputs are sampled (with busy / idle /
backpressured ms/s of each task and the pool occupancy). The result is a CSV,
a PNG like the article's figure (throughput as % of maximum over time) and a
per-phase summary. Expected: the producer follows the consumer down to 30 %
and back up to 60 %, its backpressured time goes HIGH while the consumer is
slowed, the output pool never holds more than its 2 buffers, and every record
produced is consumed.

Two switches add what the later issues are about:

* ``--debloat``: buffer debloating on, with Flink's default buffers (32 KiB
  segments) and a target of ``--debloat-target`` seconds (0.0005: at millions
  of records/s, Flink's 1 s is far more than any buffer holds); the plot gains
  the consumer gate's debloated buffer size and its in-flight bytes.
* ``--checkpoints``: the schedule runs twice, with a checkpoint every interval,
  aligned and then unaligned, with Flink's default buffers (32 KiB segments);
  the plot gains both runs' checkpoint durations: aligned ones grow while the
  consumer is slowed (the barrier waits behind every queued buffer),
  unaligned ones do not.

    python -m pyflowbuf.experiments.backpressure [--quick] [--out DIR] [--debloat] [--checkpoints]
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import threading
import time

from pyflowbuf._core.memory import DEFAULT_SEGMENT_SIZE
from pyflowbuf.api import Environment
from pyflowbuf.experiments.throttle import Pacer, Speed
from pyflowbuf.runtime.metrics import _rates

SEGMENT_SIZE = 4096
BUFFERS = 2

#: (name, producer % of max, consumer % of max) - the article's schedule.
PHASES = (
    ("producer 60%", 60, 100),
    ("consumer 30%", 60, 30),
    ("released", 60, 100),
    ("consumer 30% again", 60, 30),
    ("released again", 60, 100),
)

# Default timings: the full run takes ~30 s, the quick one ~10 s.
FULL = dict(interval=0.5, calibration_seconds=2.5, phase_seconds=5.0)
QUICK = dict(interval=0.25, calibration_seconds=1.0, phase_seconds=1.5)

_CHUNK = 256  # records the producer yields between two pacing checks

CSV_FIELDS = (
    "t_s", "phase", "producer_setting_pct", "consumer_setting_pct",
    "producer_records_per_s", "consumer_records_per_s", "producer_pct", "consumer_pct",
    "producer_busy_ms_per_s", "producer_idle_ms_per_s", "producer_backpressured_ms_per_s",
    "producer_level", "consumer_busy_ms_per_s", "consumer_idle_ms_per_s",
    "consumer_backpressured_ms_per_s", "consumer_level", "out_pool_in_use",
    "out_pool_in_use_max", "network_pool_in_use_max", "debloat_buffer_size", "inflight_bytes",
)


class _MemoryWatch(threading.Thread):
    """Polls the producer's output pool and the NetworkBufferPool every few
    ms and keeps the largest occupancy seen (per interval and overall)."""

    def __init__(self, pool, network_pool, period=0.005):
        super().__init__(name="backpressure experiment: memory watch", daemon=True)
        self.pool, self.net, self.period = pool, network_pool, period
        self._stop_event = threading.Event()
        self._lock = threading.Lock()
        self.pool_max = self.net_max = 0
        self._pool_int = self._net_int = 0
        self.polls = 0

    def run(self):
        while not self._stop_event.wait(self.period):
            self.poll()

    def poll(self):
        p, n = self.pool.in_use, self.net.in_use_segments
        with self._lock:
            self.polls += 1
            self._pool_int = max(self._pool_int, p)
            self._net_int = max(self._net_int, n)
            self.pool_max = max(self.pool_max, p)
            self.net_max = max(self.net_max, n)

    def take_interval(self):
        """(max pool in_use, max network in_use) since the last call."""
        self.poll()
        with self._lock:
            out = self._pool_int, self._net_int
            self._pool_int = self._net_int = 0
        return out

    def stop(self):
        self._stop_event.set()


def _find_task(job, vertex_name):
    for t in job.tasks:
        if t.vertex.name == vertex_name:
            return t
    raise RuntimeError(f"no task for vertex {vertex_name!r}")


def run_experiment(out_dir, quick: bool = False, phase_seconds: float | None = None, *,
                   interval: float | None = None, calibration_seconds: float | None = None,
                   phases=PHASES, plot: bool = True, verbose: bool = False, debloat: bool = False,
                   checkpoints: bool = False, debloat_target: float = 0.0005, ui: bool = False,
                   _checkpoint_mode: str | None = None) -> dict:
    """Run the experiment; write ``backpressure.csv`` and ``backpressure.png``
    into ``out_dir``. Returns ``{"csv", "png", "phases": [per-phase summary],
    "max_rate", "records_produced", "records_consumed", memory figures,
    "samples"}``; per-phase figures are means over the phase's samples after
    the first (the transition interval). ``debloat``: buffer debloating on,
    its buffer size and in-flight bytes sampled. ``checkpoints``: run twice
    (aligned, unaligned checkpoints every interval, default buffers); the
    result gains ``"checkpoints": {mode: [(t_s, duration_s), ...]}``.
    ``ui``: serve the job's web view while it runs (a free port on
    127.0.0.1) and print its URL: watch the producer turn black when the
    consumer slows down."""
    if checkpoints:
        runs = {}
        for mode in ("aligned", "unaligned"):
            if verbose:
                print(f"--- {mode} checkpoints ---", file=sys.stderr)
            runs[mode] = run_experiment(os.path.join(out_dir, mode), quick, phase_seconds, interval=interval,
                                        calibration_seconds=calibration_seconds, phases=phases, plot=False,
                                        verbose=verbose, debloat=debloat, debloat_target=debloat_target,
                                        ui=ui, _checkpoint_mode=mode)
        result = runs["unaligned"]
        result["checkpoints"] = {m: r["checkpoint_durations"] for m, r in runs.items()}
        result["aligned_run"] = {k: v for k, v in runs["aligned"].items() if k != "samples"}
        if plot:
            iv = result["interval"]
            result["png"] = _plot(result["samples"], [(n, float(p), float(c)) for n, p, c in phases],
                                  max(1, round(result["phase_seconds"] / iv)), iv, result,
                                  os.path.join(out_dir, "backpressure.png"))
        return result
    return _run_once(out_dir, quick, phase_seconds, interval, calibration_seconds, phases, plot, verbose,
                     debloat, debloat_target, _checkpoint_mode, ui)


def _run_once(out_dir, quick, phase_seconds, interval, calibration_seconds, phases, plot, verbose, debloat,
              debloat_target, checkpoint_mode, ui=False):
    timing = dict(QUICK if quick else FULL)
    if phase_seconds is not None:
        timing["phase_seconds"] = float(phase_seconds)
    if interval is not None:
        timing["interval"] = float(interval)
    if calibration_seconds is not None:
        timing["calibration_seconds"] = float(calibration_seconds)
    iv = timing["interval"]
    if not iv > 0 or not timing["phase_seconds"] >= iv or not timing["calibration_seconds"] >= iv:
        raise ValueError(f"need interval > 0 and phases/calibration of at least one interval, got {timing}")
    per_phase = max(1, round(timing["phase_seconds"] / iv))
    calib_ticks = max(2, round(timing["calibration_seconds"] / iv))
    phases = [(str(n), float(p), float(c)) for n, p, c in phases]
    if not phases:
        raise ValueError("need at least one phase")
    if len({n for n, _, _ in phases}) != len(phases) or "calibration" in {n for n, _, _ in phases}:
        raise ValueError("phase names must be distinct and not 'calibration'")
    for name, p, c in phases:
        if not (0 < p <= 100 and 0 < c <= 100):
            raise ValueError(f"phase {name!r}: speeds must be in (0, 100] %, got {p}, {c}")
    os.makedirs(out_dir, exist_ok=True)

    # ---- the job: generator source -> batched sink, 2 x 4 KiB buffers ----
    p_speed, c_speed = Speed(1.0), Speed(1.0)
    p_pacer, c_pacer = Pacer(p_speed), Pacer(c_speed)
    stop = threading.Event()
    produced = [0]
    consumed = {"n": 0, "last": 0, "gaps": 0}

    def producer():
        n = 0
        while not stop.is_set():
            for _ in range(_CHUNK):
                n += 1
                produced[0] = n
                yield n
            p_pacer(_CHUNK)

    def consumer(batch):
        k = len(batch)
        if not k:
            return
        # records are 1, 2, 3, ...: any loss, duplicate or reorder breaks this
        if batch[0] != consumed["last"] + 1 or batch[-1] != consumed["last"] + k:
            consumed["gaps"] += 1
        consumed["last"] = batch[-1]
        consumed["n"] += k
        c_pacer(k)

    if checkpoint_mode is None and not debloat:
        buffers = dict(segment_size=SEGMENT_SIZE, output_buffers=(BUFFERS, BUFFERS))
    elif checkpoint_mode is None:
        # Flink's default buffers, and a target small enough for these rates
        # (millions of records/s fill 1 s of in-flight data far beyond them)
        buffers = dict(segment_size=DEFAULT_SEGMENT_SIZE, debloat_target=debloat_target)
    else:
        import tempfile
        # Flink's defaults: what an aligned barrier waits behind is what they hold
        buffers = dict(segment_size=DEFAULT_SEGMENT_SIZE, checkpoint_interval=iv, checkpoint_alignment=checkpoint_mode,
                       checkpoint_dir=tempfile.mkdtemp(prefix="pyflowbuf-experiment-"))
        if debloat:
            buffers["debloat_target"] = debloat_target
    if ui:
        buffers["ui_port"] = 0
    env = Environment(chaining=False, metrics_interval=iv, name="backpressure-experiment", debloat=debloat,
                      **buffers)
    env.from_generator(producer, kind="int64", name="producer").sink(consumer, batched=True, name="consumer")

    job = env.execute_async()
    if job.ui is not None:
        print(f"  web view, live while the experiment runs: {job.ui_url}", flush=True)
    rows: list = []
    watch = None
    try:
        prod_task, cons_task = _find_task(job, "producer"), _find_task(job, "consumer")
        pool = prod_task.outputs[0].pool
        watch = _MemoryWatch(pool, job.network_pool)
        watch.start()

        schedule = [("calibration", 100.0, 100.0)] * calib_ticks
        for ph in phases:
            schedule += [ph] * per_phase
        t0 = time.monotonic()
        t_phase1 = t0 + calib_ticks * iv
        t_wall0 = time.time() + calib_ticks * iv       # checkpoints carry wall-clock trigger times
        prev = {"p": prod_task.counters(), "c": cons_task.counters()}
        prev_ns = time.monotonic_ns()
        watch.take_interval()
        current = None
        for k, (name, p_pct, c_pct) in enumerate(schedule):
            if (name, p_pct, c_pct) != current:
                if name != "calibration" and current is not None and current[0] == "calibration":
                    _calibrate(rows, p_pacer, c_pacer, verbose)
                p_speed.set(p_pct / 100.0)
                c_speed.set(c_pct / 100.0)
                current = (name, p_pct, c_pct)
                if verbose:
                    print(f"[{time.monotonic() - t_phase1:6.1f} s] {name}: producer {p_pct:.0f}%, "
                          f"consumer {c_pct:.0f}%", file=sys.stderr)
            tick = t0 + (k + 1) * iv
            while True:
                left = tick - time.monotonic()
                if left <= 0:
                    break
                time.sleep(left)
            if job.done:
                job.join(0)  # raises the task's failure
                raise RuntimeError("the experiment job ended early")
            now_ns = time.monotonic_ns()
            cur = {"p": prod_task.counters(), "c": cons_task.counters()}
            pm = _rates(prev["p"], cur["p"], now_ns - prev_ns)
            cm = _rates(prev["c"], cur["c"], now_ns - prev_ns)
            prev, prev_ns = cur, now_ns
            pool_max, net_max = watch.take_interval()
            rows.append({
                "t_s": round(time.monotonic() - t_phase1, 3), "phase": name,
                "producer_setting_pct": p_pct, "consumer_setting_pct": c_pct,
                "producer_records_per_s": round(pm["records_out_per_s"], 1),
                "consumer_records_per_s": round(cm["records_in_per_s"], 1),
                "producer_busy_ms_per_s": pm["busy_ms_per_s"],
                "producer_idle_ms_per_s": pm["idle_ms_per_s"],
                "producer_backpressured_ms_per_s": pm["backpressured_ms_per_s"],
                "producer_level": pm["level"],
                "consumer_busy_ms_per_s": cm["busy_ms_per_s"],
                "consumer_idle_ms_per_s": cm["idle_ms_per_s"],
                "consumer_backpressured_ms_per_s": cm["backpressured_ms_per_s"],
                "consumer_level": cm["level"],
                "out_pool_in_use": pool.in_use,
                "out_pool_in_use_max": pool_max, "network_pool_in_use_max": net_max,
                **_debloat_sample(cons_task),
            })
        # end the job: the producer returns, the consumer drains at full speed
        c_speed.set(1.0)
        stop.set()
        job.join(timeout=30)
    except BaseException:
        stop.set()
        job.cancel()
        raise
    finally:
        if watch is not None:
            watch.stop()
            watch.join(1)
        if job.ui is not None:
            job.ui.close()

    max_p, max_c = p_pacer.max_rate, c_pacer.max_rate
    for r in rows:
        r["producer_pct"] = round(100.0 * r["producer_records_per_s"] / max_p, 2)
        r["consumer_pct"] = round(100.0 * r["consumer_records_per_s"] / max_c, 2)

    csv_path = os.path.join(out_dir, "backpressure.csv")
    with open(csv_path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({f: r[f] for f in CSV_FIELDS})

    summary = _summarise(rows, phases)
    result = {
        "csv": csv_path,
        "png": None,
        "phases": summary,
        "max_rate": {"producer": max_p, "consumer": max_c},
        "calibration": {
            "producer_busy_ms_per_s": _mean(r["producer_busy_ms_per_s"] for r in rows[1:calib_ticks]),
            "consumer_busy_ms_per_s": _mean(r["consumer_busy_ms_per_s"] for r in rows[1:calib_ticks]),
        },
        "records_produced": produced[0],
        "records_written": prod_task.counters()["records_out"],
        "records_consumed": consumed["n"],
        "last_record": consumed["last"],
        "order_breaks": consumed["gaps"],
        "out_pool_max_size": pool.max_size,
        "max_out_pool_in_use": watch.pool_max,
        "network_pool_segments": job.network_pool.total_segments,
        "max_network_pool_in_use": watch.net_max,
        "memory_polls": watch.polls,
        "segment_size": env.network_config.segment_size,
        "debloat": debloat,
        "checkpoint_mode": checkpoint_mode,
        "checkpoint_durations": [(round(c["trigger_time"] - t_wall0, 3), c["duration_s"])
                                 for c in env.checkpoints() if c["status"] == "completed"],
        "interval": iv,
        "phase_seconds": per_phase * iv,
        "calibration_seconds": calib_ticks * iv,
        "samples": rows,
    }
    if plot:
        result["png"] = _plot(rows, phases, per_phase, iv, result, os.path.join(out_dir, "backpressure.png"))
    return result


def _debloat_sample(task) -> dict:
    """The consumer gate's debloated buffer size and in-flight bytes (None
    when debloating is off)."""
    gates = getattr(task, "debloat_gates", None) or []
    if not gates:
        return {"debloat_buffer_size": None, "inflight_bytes": None}
    return {"debloat_buffer_size": gates[0].get("buffer_size"), "inflight_bytes": gates[0].get("inflight_bytes")}


def _calibrate(rows, p_pacer, c_pacer, verbose):
    """Each task's maximum rate: the median of the calibration samples after
    the first (warm-up); the median shrugs off a sample disturbed by other
    load on the machine."""
    cal = [r for r in rows if r["phase"] == "calibration"][1:]
    max_p = statistics.median(r["producer_records_per_s"] for r in cal)
    max_c = statistics.median(r["consumer_records_per_s"] for r in cal)
    if not (max_p > 0 and max_c > 0):
        raise RuntimeError(f"calibration measured no throughput (producer {max_p}, consumer {max_c})")
    p_pacer.max_rate, c_pacer.max_rate = max_p, max_c
    if verbose:
        print(f"calibration: producer max {max_p:,.0f} records/s, consumer max {max_c:,.0f} records/s",
              file=sys.stderr)


def _mean(values):
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _summarise(rows, phases):
    out = []
    for name, p_set, c_set in phases:
        mine = [r for r in rows if r["phase"] == name]
        steady = mine[1:] or mine           # the first interval is the transition
        follow = [abs(r["producer_records_per_s"] - r["consumer_records_per_s"])
                  / max(r["consumer_records_per_s"], 1.0) for r in steady]
        out.append({
            "phase": name,
            "producer_setting_pct": p_set,
            "consumer_setting_pct": c_set,
            "producer_pct": round(_mean(r["producer_pct"] for r in steady), 1),
            "consumer_pct": round(_mean(r["consumer_pct"] for r in steady), 1),
            "producer_backpressured_ms_per_s": round(_mean(r["producer_backpressured_ms_per_s"] for r in steady), 1),
            "producer_busy_ms_per_s": round(_mean(r["producer_busy_ms_per_s"] for r in steady), 1),
            "consumer_busy_ms_per_s": round(_mean(r["consumer_busy_ms_per_s"] for r in steady), 1),
            "consumer_idle_ms_per_s": round(_mean(r["consumer_idle_ms_per_s"] for r in steady), 1),
            "max_follow_error": round(max(follow), 4) if follow else float("nan"),
            "samples": len(steady),
        })
    return out


def _plot(rows, phases, per_phase, iv, result, path):
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    extra = []
    if any(r.get("debloat_buffer_size") is not None for r in rows):
        extra.append("debloat")
    if result.get("checkpoints"):
        extra.append("checkpoints")
    fig, axes = plt.subplots(2 + len(extra), 1, figsize=(10, 6.4 + 2.2 * len(extra)), dpi=110, sharex=True,
                             gridspec_kw={"height_ratios": (3, 1.3) + (1.5,) * len(extra)})
    ax, ax2 = axes[0], axes[1]
    t = [r["t_s"] - iv / 2 for r in rows]      # a sample covers the interval before it
    # the producer drawn wide underneath: where the two agree both stay visible
    ax.plot(t, [r["producer_pct"] for r in rows], "-", lw=5, alpha=0.55, color="#e6b800", label="producer")
    ax.plot(t, [r["consumer_pct"] for r in rows], "-s", lw=1.4, ms=3, color="#2e9e44", label="consumer")
    ax2.plot(t, [r["producer_backpressured_ms_per_s"] for r in rows], "-", color="#e6b800",
             label="producer backpressured")
    ax2.plot(t, [r["consumer_busy_ms_per_s"] for r in rows], "--", color="#2e9e44", label="consumer busy")
    span = per_phase * iv
    cal = result["calibration_seconds"]
    for a in axes:
        a.axvspan(-cal, 0, color="0.85", lw=0)
    top = max([115.0] + [1.08 * max(r["producer_pct"], r["consumer_pct"]) for r in rows])
    ax.text(-cal / 2, top - 2, "calibration", ha="center", va="top", fontsize=8)
    for i, (name, p_set, c_set) in enumerate(phases):
        x0 = i * span
        if i % 2:
            for a in axes:
                a.axvspan(x0, x0 + span, color="0.94", lw=0)
        ax.text(x0 + span / 2, top - 2, f"P {p_set:.0f}% / C {c_set:.0f}%", ha="center", va="top", fontsize=8)
    ax.axhline(100, color="0.6", lw=0.7, ls=":")
    ax.set_ylim(0, top)
    ax.set_xlim(-cal, len(phases) * span)
    ax.set_ylabel("throughput, % of maximum")
    mp = result["max_rate"]
    what = (f"{BUFFERS} buffers of {SEGMENT_SIZE} B" if not (result.get("checkpoints") or result.get("debloat"))
            else "default buffers of 32 KiB")
    ax.set_title(f"Backpressure: {what}, local exchange; "
                 f"max {mp['producer'] / 1e6:.2f}M (producer) / {mp['consumer'] / 1e6:.2f}M (consumer) "
                 f"records/s", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    for y, lab in ((100, "OK / LOW"), (500, "LOW / HIGH")):
        ax2.axhline(y, color="0.5", lw=0.7, ls=":")
        ax2.text(len(phases) * span, y, f" {lab}", va="center", fontsize=7, color="0.4")
    ax2.set_ylim(0, 1050)
    ax2.set_ylabel("ms per second")
    ax2.legend(loc="lower right", fontsize=7, ncol=2)
    ax2.grid(alpha=0.3)
    k = 2
    if "debloat" in extra:
        a = axes[k]
        k += 1
        pts = [(x, r) for x, r in zip(t, rows) if r.get("debloat_buffer_size") is not None]
        a.plot([x for x, _ in pts], [r["debloat_buffer_size"] / 1024 for _, r in pts], "-", color="#7a3db8",
               label="debloated buffer size (KiB)")
        a.set_ylabel("KiB")
        b = a.twinx()
        b.plot([x for x, _ in pts], [(r["inflight_bytes"] or 0) / 1024 for _, r in pts], "--", color="#d9534f",
               label="in-flight (KiB)")
        b.set_ylabel("in flight, KiB")
        a.legend(loc="upper left", fontsize=7)
        b.legend(loc="upper right", fontsize=7)
        a.grid(alpha=0.3)
    if "checkpoints" in extra:
        a = axes[k]
        colors = {"aligned": "#1f77b4", "unaligned": "#ff7f0e"}
        for mode, points in result["checkpoints"].items():
            if points:
                a.plot([p[0] for p in points], [p[1] for p in points], "o-", ms=3, color=colors.get(mode),
                       label=f"{mode} checkpoint duration")
        a.set_yscale("log")
        a.set_ylabel("seconds")
        a.legend(loc="upper left", fontsize=7)
        a.grid(alpha=0.3)
    axes[-1].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def format_summary(result: dict) -> str:
    lines = [f"max rate: producer {result['max_rate']['producer']:,.0f} records/s, "
             f"consumer {result['max_rate']['consumer']:,.0f} records/s",
             f"{'phase':<20} {'set P/C %':>10} {'producer %':>11} {'consumer %':>11} "
             f"{'P backpr ms/s':>14} {'C busy ms/s':>12} {'follow err':>11}"]
    for ph in result["phases"]:
        lines.append(
            f"{ph['phase']:<20} {ph['producer_setting_pct']:>4.0f}/{ph['consumer_setting_pct']:<5.0f} "
            f"{ph['producer_pct']:>11.1f} {ph['consumer_pct']:>11.1f} "
            f"{ph['producer_backpressured_ms_per_s']:>14.0f} {ph['consumer_busy_ms_per_s']:>12.0f} "
            f"{100 * ph['max_follow_error']:>10.2f}%")
    lines.append(f"records produced {result['records_produced']:,}, consumed {result['records_consumed']:,}, "
                 f"order breaks {result['order_breaks']}")
    lines.append(f"output pool in use: max {result['max_out_pool_in_use']} of {result['out_pool_max_size']}; "
                 f"NetworkBufferPool in use: max {result['max_network_pool_in_use']} of "
                 f"{result['network_pool_segments']} segments ({result['memory_polls']} polls)")
    for mode, points in (result.get("checkpoints") or {}).items():
        d = [p[1] for p in points]
        if d:
            lines.append(f"{mode} checkpoints: {len(d)} completed, median {statistics.median(d):.3f} s, "
                         f"max {max(d):.3f} s")
    lines.append(f"csv: {result['csv']}")
    if result.get("png"):
        lines.append(f"png: {result['png']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pyflowbuf.experiments.backpressure",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a ~10 s run instead of ~30 s")
    ap.add_argument("--out", default="backpressure-out", help="directory for the CSV and PNG")
    ap.add_argument("--phase-seconds", type=float, default=None, help="length of each phase")
    ap.add_argument("--interval", type=float, default=None, help="seconds between throughput samples")
    ap.add_argument("--calibration-seconds", type=float, default=None)
    ap.add_argument("--debloat", action="store_true",
                    help="buffer debloating on; plot its buffer size and in-flight bytes")
    ap.add_argument("--debloat-target", type=float, default=0.0005,
                    help="with --debloat: seconds of in-flight data to aim at (default 0.0005: these rates "
                         "fill Flink's 1 s far beyond the buffers)")
    ap.add_argument("--checkpoints", action="store_true",
                    help="run aligned and unaligned checkpoints (default buffers) and plot their durations")
    args = ap.parse_args(argv)
    try:
        result = run_experiment(args.out, quick=args.quick, phase_seconds=args.phase_seconds,
                                interval=args.interval, calibration_seconds=args.calibration_seconds,
                                verbose=True, debloat=args.debloat, checkpoints=args.checkpoints,
                                debloat_target=args.debloat_target)
    except ValueError as exc:
        ap.error(str(exc))
    print(format_summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
