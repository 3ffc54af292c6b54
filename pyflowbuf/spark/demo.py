"""The PySpark part of the main demo: a few million rows through a
multi-stage pyflowbuf pipeline inside ``mapInArrow``, with a deliberately
slow stage.

    spark.range(rows) + columns --mapInArrow-->  [spark-input -> parse]
        -> enrich (2 threads) -> slow-score (1 thread, ~2 us per row of waiting)
        -> format  --> Spark aggregates the result (count, sums: every row checked)

The slow stage is the bottleneck: it is busy all the time, while the stages
before it spend their time backpressured (waiting for a free buffer) - the
pipeline slows Spark's reading of its own input instead of buffering it, so
the Python worker's memory stays at the pool's size. The figures come from
the workers through a Spark accumulator (``MetricsCollector``).

    python -m pyflowbuf.spark.demo [--rows N] [--quick]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

SLOW_US_PER_ROW = 4.0   # 3 M rows in 2 partitions: 6 s of waiting per partition


def _build(slow_us_per_row: float):
    import pyarrow as pa
    import pyarrow.compute as pc

    def parse(b: pa.RecordBatch) -> pa.RecordBatch:
        cents = pc.cast(pc.round(pc.multiply(b.column("amount"), 100)), pa.int64())
        return b.append_column("cents", cents)

    def enrich(b: pa.RecordBatch) -> pa.RecordBatch:
        # a lookup table join, vectorised: the category's region
        region = pc.cast(pc.bit_wise_and(b.column("category"), pa.scalar(3, pa.int64())), pa.int8())
        return b.append_column("region", region)

    def slow_score(b: pa.RecordBatch) -> pa.RecordBatch:
        # the deliberately slow stage: a remote model call, say (waits, GIL released)
        time.sleep(slow_us_per_row * b.num_rows / 1e6)
        cents = b.column("cents").to_numpy()
        score = np.log1p(cents.astype(np.float64)) * (1.0 + (b.column("region").to_numpy() == 1))
        return b.append_column("score", pa.array(score))

    def fmt(b: pa.RecordBatch) -> pa.RecordBatch:
        return pa.RecordBatch.from_arrays(
            [b.column("id"), b.column("user"), b.column("cents"), b.column("region"), b.column("score")],
            names=["id", "user", "cents", "region", "score"])

    def build(stream):
        return (stream.map(parse, name="parse")
                      .map(enrich, parallelism=2, name="enrich")
                      .map(slow_score, parallelism=1, name="slow-score")
                      .map(fmt, name="format"))
    return build


OUTPUT_SCHEMA = "id long, user string, cents long, region tinyint, score double"


def run_spark_demo(rows: int = 3_000_000, quick: bool = False, *, spark=None, partitions: int = 2,
                   rows_per_batch: int = 10_000, slow_us_per_row: float = SLOW_US_PER_ROW,
                   verbose: bool = True) -> dict:
    """Run the demo; returns (and prints, when ``verbose``) a summary:
    rows, wall time and throughput, per-stage backpressure, pool and worker
    memory. ``quick`` is accepted for the demo runner (it picks fewer
    ``rows``; the pipeline is the same). Creates a local SparkSession
    (local[2]) unless ``spark`` is given."""
    from pyspark.sql import functions as F

    from pyflowbuf.spark import MetricsCollector, local_session, map_in_arrow
    from pyflowbuf.spark.metrics import _rss_bytes

    log = print if verbose else (lambda *a, **k: None)
    own = spark is None
    t_session = time.perf_counter()
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    if own:
        spark = local_session("pyflowbuf-demo", cores=2, max_records_per_batch=rows_per_batch)
        previous = None
    else:
        previous = spark.conf.get(key, None)
        spark.conf.set(key, str(rows_per_batch))
    session_s = time.perf_counter() - t_session
    try:
        df = (spark.range(0, rows, numPartitions=partitions)
              .withColumn("category", F.col("id") % 100)
              .withColumn("amount", F.rand(seed=7) * 100)
              .withColumn("user", F.concat(F.lit("user_"), (F.col("id") % 1000).cast("string"))))
        # start the Python workers first (Spark reuses them), so the timed run
        # measures the pipeline and not interpreter start-up
        t_warm = time.perf_counter()
        warm = spark.range(0, 4 * partitions * rows_per_batch, numPartitions=partitions).select(
            "id", (F.col("id") % 100).alias("category"), F.lit(1.0).alias("amount"), F.lit("u").alias("user"))
        map_in_arrow(warm, _build(0.0), OUTPUT_SCHEMA).write.format("noop").mode("overwrite").save()
        warmup_s = time.perf_counter() - t_warm
        metrics = MetricsCollector(spark)
        out = map_in_arrow(df, _build(slow_us_per_row), OUTPUT_SCHEMA, metrics=metrics,
                           name="spark-demo")
        log(f"  {rows:,} rows in {partitions} partitions, Arrow batches of {rows_per_batch:,} rows; "
            f"slow stage: {slow_us_per_row} us per row")
        t0 = time.perf_counter()
        agg = out.agg(F.count("*").alias("n"), F.sum("id").alias("ids"), F.sum("cents").alias("cents"),
                      F.countDistinct("user").alias("users"), F.sum("score").alias("score")).collect()[0]
        seconds = time.perf_counter() - t0
        reports = metrics.partitions
        stages = metrics.stages()
        summary = metrics.summary()
    finally:
        if own:
            spark.stop()
        elif previous is not None:
            spark.conf.set(key, previous)
    expected_ids = rows * (rows - 1) // 2
    result = {
        "rows": rows,
        "rows_out": int(agg["n"]),
        "checksum_ok": int(agg["ids"]) == expected_ids and int(agg["users"]) == min(rows, 1000),
        "seconds": round(seconds, 2),
        "session_start_s": round(session_s, 2),
        "warmup_s": round(warmup_s, 2),
        "rows_per_s": round(rows / seconds),
        "partitions": partitions,
        "rows_per_batch": rows_per_batch,
        "slow_us_per_row": slow_us_per_row,
        "stages": {name: {k: m[k] for k in ("level", "busy_ms_per_s", "backpressured_ms_per_s", "idle_ms_per_s",
                                            "subtasks", "records_in")}
                   for name, m in stages.items()},
        "pool_mib_per_partition": summary.get("pool_mib_per_partition"),
        "pool_peak_segments": summary.get("pool_peak_segments"),
        "worker_rss_peak_mib": summary.get("worker_rss_peak_mib"),
        "worker_rss_growth_mib": summary.get("worker_rss_growth_mib"),
        "workers": summary.get("workers"),
        "driver_rss_mib": round(_rss_bytes() / 2**20, 1),
        "partition_reports": len(reports),
    }
    if verbose:
        _print(result)
    return result


def _print(res: dict) -> None:
    print("\n== PySpark: mapInArrow through a pyflowbuf pipeline ==")
    for k in ("rows", "rows_out", "checksum_ok", "seconds", "rows_per_s", "session_start_s", "warmup_s",
              "partitions", "rows_per_batch",
              "pool_mib_per_partition", "pool_peak_segments", "worker_rss_peak_mib", "worker_rss_growth_mib",
              "driver_rss_mib"):
        print(f"  {k:>24}: {res[k]}")
    print(f"  {'stage':<26} {'level':<5} {'busy':>7} {'bp':>7} {'idle':>7}  (ms per second, averaged over partitions)")
    for name, m in res["stages"].items():
        print(f"  {name:<26} {m['level']:<5} {m['busy_ms_per_s']:>7} {m['backpressured_ms_per_s']:>7} "
              f"{m['idle_ms_per_s']:>7}")
    slow = max(res["stages"].items(), key=lambda kv: kv[1]["busy_ms_per_s"], default=(None, None))[0]
    if slow:
        print(f"  bottleneck: {slow!r}; the stages before it wait for buffers (backpressure) instead of "
              "reading ahead, so each worker's memory stays at its pool")


def _cli(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=None, help="default 3,000,000 (500,000 with --quick)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = a.rows if a.rows is not None else (500_000 if a.quick else 3_000_000)
    res = run_spark_demo(rows=rows, quick=a.quick)
    if a.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
