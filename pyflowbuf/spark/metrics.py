"""Per-partition pipeline metrics, sent from Spark's Python workers to the driver.

Every partition that runs a pyflowbuf pipeline produces one report (a plain
dict, see ``PartitionStats.report``): rows in and out, wall time, the memory
pool's size and peak use, the worker's RSS, and the runtime's whole-run
figures per task (busy / idle / backpressured ms per second, records, bytes,
backpressure level). A ``MetricsCollector`` carries the reports back through
a Spark accumulator, so it works on a cluster as well as in local mode.

Accumulator updates from transformations are at-least-once: a retried or
speculative task reports twice (each report has its stage, partition and
attempt, so duplicates can be told apart).
"""
from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any

from pyflowbuf.monitoring import backpressure_level

_MIB = 2**20


def _rss_bytes() -> int:
    try:
        import psutil  # optional dependency (extra "monitor")

        return psutil.Process().memory_info().rss
    except Exception:  # psutil is optional
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except Exception:
            return 0


def _maxrss_bytes() -> int:
    try:
        import resource
        import sys

        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return r if sys.platform == "darwin" else r * 1024
    except Exception:  # pragma: no cover
        return 0


def _rows(rec) -> int:
    n = getattr(rec, "num_rows", None)
    if n is not None:
        return n
    try:
        return len(rec)
    except TypeError:
        return 1


class PartitionStats:
    """Counts rows in and out of one partition's pipeline and samples memory."""

    SAMPLE_EVERY_S = 0.05

    def __init__(self):
        self.t0 = time.perf_counter()
        self.rows_in = self.batches_in = 0
        self.rows_out = self.batches_out = 0
        self.input_rows = collections.deque()   # rows of each input batch, in order
        self.rss_start = _rss_bytes()
        self.rss_peak = self.rss_start
        self.pool_peak = 0
        self._next_sample = 0.0
        self._lock = threading.Lock()
        self.env = None

    def count_in(self, records):
        """Wrap the input iterator (it is pulled in the source thread)."""
        for rec in records:
            n = _rows(rec)
            self.rows_in += n
            self.batches_in += 1
            self.input_rows.append(n)
            self.sample_pool()
            yield rec

    def count_out(self, rec) -> None:
        self.rows_out += _rows(rec)
        self.batches_out += 1
        self.sample_pool()
        now = time.perf_counter()
        if now >= self._next_sample:
            self._next_sample = now + self.SAMPLE_EVERY_S
            self.rss_peak = max(self.rss_peak, _rss_bytes())

    def sample_pool(self) -> None:
        """Segments in use now (a cheap read of the pool's counter)."""
        job = getattr(self.env, "last_execution", None)
        pool = getattr(job, "network_pool", None)
        if pool is not None:
            n = pool.in_use_segments
            if n > self.pool_peak:
                self.pool_peak = n

    def sample(self) -> None:
        self.rss_peak = max(self.rss_peak, _rss_bytes())
        self.sample_pool()

    def report(self, env) -> dict[str, Any]:
        self.sample()
        seconds = time.perf_counter() - self.t0
        job = getattr(env, "last_execution", None)
        pool = getattr(job, "network_pool", None)
        try:
            summary = job.summary() if job is not None else {}
        except Exception:  # pragma: no cover - metrics must never fail a task
            summary = {}
        ctx = None
        try:
            from pyspark import TaskContext  # optional dependency (extra "spark")

            ctx = TaskContext.get()
        except Exception:  # pragma: no cover
            pass
        rep = {
            "stage": ctx.stageId() if ctx else None,
            "partition": ctx.partitionId() if ctx else None,
            "attempt": ctx.attemptNumber() if ctx else None,
            "pid": os.getpid(),
            "rows_in": self.rows_in,
            "rows_out": self.rows_out,
            "batches_in": self.batches_in,
            "batches_out": self.batches_out,
            "seconds": round(seconds, 4),
            "rows_per_s": round(self.rows_in / seconds) if seconds > 0 else None,
            "pool_segments": pool.total_segments if pool is not None else None,
            "segment_size": pool.segment_size if pool is not None else None,
            "pool_mib": round(pool.total_bytes / _MIB, 3) if pool is not None else None,
            "pool_peak_segments": self.pool_peak,
            "rss_start_mib": round(self.rss_start / _MIB, 1),
            "rss_peak_mib": round(self.rss_peak / _MIB, 1),
            "worker_maxrss_mib": round(_maxrss_bytes() / _MIB, 1),
            "tasks": {name: {k: v for k, v in m.items() if not k.endswith("_per_s") or k.endswith("ms_per_s")}
                      for name, m in summary.items()},
        }
        return rep


try:
    from pyspark.accumulators import AccumulatorParam as _AccumulatorParam
except ImportError:  # pragma: no cover - pyspark is optional
    _AccumulatorParam = object


class ListParam(_AccumulatorParam):
    """Accumulates lists of reports by concatenation."""

    def zero(self, value):
        return []

    def addInPlace(self, a, b):
        a.extend(b)
        return a


class MetricsCollector:
    """Collects the per-partition reports of pyflowbuf pipelines run in Spark.

        collector = MetricsCollector(spark)
        out = map_in_arrow(df, build, schema, metrics=collector)
        out.write.format("noop").mode("overwrite").save()
        collector.partitions      # one dict per partition (and task attempt)
        collector.stages()        # aggregated per pipeline stage

    Pass the same collector to several jobs to accumulate; ``reset()`` empties it.
    """

    def __init__(self, spark_or_context):
        sc = getattr(spark_or_context, "sparkContext", spark_or_context)
        self._acc = sc.accumulator([], ListParam())

    def add(self, report: dict) -> None:
        """Called in the worker when a partition's pipeline ends."""
        self._acc.add([report])

    @property
    def partitions(self) -> list:
        """The reports received so far (driver side)."""
        return list(self._acc.value)

    def reset(self) -> None:
        self._acc.value = []

    def stages(self) -> dict:
        return aggregate_stages(self.partitions)

    def summary(self) -> dict:
        return summarize(self.partitions)


def _vertex(task_name: str, m: dict) -> str:
    return m.get("vertex") or task_name.rsplit(" (", 1)[0]


def aggregate_stages(reports: list) -> dict:
    """Per pipeline stage (runtime vertex) over all partitions: records and
    bytes summed, the ms-per-second figures averaged weighted by each
    partition's wall time, and the backpressure level of that average."""
    acc: dict = {}
    for rep in reports:
        w = max(rep.get("seconds") or 0.0, 1e-9)
        for name, m in (rep.get("tasks") or {}).items():
            v = _vertex(name, m)
            a = acc.setdefault(v, {"subtasks": 0, "w": 0.0, "busy": 0.0, "idle": 0.0, "bp": 0.0,
                                   "records_in": 0, "records_out": 0, "bytes_in": 0, "bytes_out": 0,
                                   "out_pool_usage_max": 0.0})
            a["subtasks"] += 1
            a["w"] += w
            a["busy"] += w * m.get("busy_ms_per_s", 0.0)
            a["idle"] += w * m.get("idle_ms_per_s", 0.0)
            a["bp"] += w * m.get("backpressured_ms_per_s", 0.0)
            for k in ("records_in", "records_out", "bytes_in", "bytes_out"):
                a[k] += m.get(k, 0) or 0
            a["out_pool_usage_max"] = max(a["out_pool_usage_max"], m.get("out_pool_usage", 0.0) or 0.0)
    out = {}
    for v, a in acc.items():
        w = a["w"] or 1.0
        bp = a["bp"] / w
        out[v] = {
            "subtasks": a["subtasks"],
            "busy_ms_per_s": round(a["busy"] / w, 1),
            "idle_ms_per_s": round(a["idle"] / w, 1),
            "backpressured_ms_per_s": round(bp, 1),
            "level": backpressure_level(bp / 1000.0),
            "records_in": a["records_in"],
            "records_out": a["records_out"],
            "bytes_in": a["bytes_in"],
            "bytes_out": a["bytes_out"],
        }
    return out


def summarize(reports: list) -> dict:
    """Totals over partitions: rows, the largest pool, peaks of pool use and RSS."""
    if not reports:
        return {"partitions": 0}
    return {
        "partitions": len(reports),
        "rows_in": sum(r["rows_in"] for r in reports),
        "rows_out": sum(r["rows_out"] for r in reports),
        "batches_in": sum(r["batches_in"] for r in reports),
        "pool_mib_per_partition": max((r["pool_mib"] or 0) for r in reports),
        "pool_peak_segments": max(r["pool_peak_segments"] for r in reports),
        "worker_rss_peak_mib": max(r["rss_peak_mib"] for r in reports),
        "worker_rss_growth_mib": round(max(r["rss_peak_mib"] - r["rss_start_mib"] for r in reports), 1),
        "workers": len({r["pid"] for r in reports}),
        "partition_seconds_max": max(r["seconds"] for r in reports),
    }
