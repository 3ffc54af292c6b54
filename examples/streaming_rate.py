#!/usr/bin/env python
"""Structured Streaming through a pyflowbuf pipeline, micro-batch by micro-batch.

Spark's ``rate-micro-batch`` source (or ``rate``: rows per second, or a
folder where JSON files arrive) feeds a streaming query. ``foreachBatch``
hands every micro-batch to a pyflowbuf pipeline running inside Spark's
Python workers through ``mapInArrow``:

    parse (1 thread)  ->  enrich (a simulated remote lookup: 4 threads)  ->  score

and appends the result to a sink (parquet files, an in-memory table, or the
console). After each micro-batch the pipeline's own metrics (per stage: busy
/ backpressured ms per second and level; rows; memory pool and worker RSS)
are printed next to Spark's ``query.lastProgress``. The query stops by itself
after ``--batches`` micro-batches.

    python examples/streaming_rate.py                      # 5 micro-batches, parquet in a temp dir
    python examples/streaming_rate.py --batches 3 --rows-per-batch 50000 --sink console
    python examples/streaming_rate.py --source files --input /tmp/incoming   # drop *.json files there

``main(...)`` returns one dict per micro-batch (the tests call it). With
``sink="memory"`` the results are kept on the driver as Arrow tables (the
reports then carry ``table``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pyflowbuf.spark import MetricsCollector, local_session, map_in_arrow

OUTPUT_SCHEMA = "timestamp timestamp, value long, bucket int, score double, enriched_by string"

if __name__ != "__main__":
    # imported (by the tests, say): Spark's workers cannot import this file,
    # so its functions travel by value, as they do when it runs as a script
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ---------------------------------------------------------------- the pipeline

def parse(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Keep what we need and derive a bucket (cheap, vectorised)."""
    value = batch.column("value")
    bucket = pc.cast(pc.bit_wise_and(value, pa.scalar(15, pa.int64())), pa.int32())
    return pa.RecordBatch.from_arrays([batch.column("timestamp"), value, bucket],
                                      names=["timestamp", "value", "bucket"])


class Enrich:
    """Stands in for a call to a remote service: ``latency_s`` of waiting per
    batch (the GIL is released while waiting), so 4 threads overlap it."""

    def __init__(self, latency_s: float = 0.005):
        self.latency_s = latency_s

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        time.sleep(self.latency_s)
        who = pa.array(["lookup-service"] * batch.num_rows)
        return batch.append_column("enriched_by", who)


def score(batch: pa.RecordBatch) -> pa.RecordBatch:
    v = batch.column("value").to_numpy(zero_copy_only=False).astype(np.float64)
    s = pa.array(np.sin(v) * 0.5 + 0.5)
    return pa.RecordBatch.from_arrays(
        [batch.column("timestamp"), batch.column("value"), batch.column("bucket"), s,
         batch.column("enriched_by")],
        names=["timestamp", "value", "bucket", "score", "enriched_by"])


def build(latency_s: float):
    enrich = Enrich(latency_s)

    def _build(stream):
        return (stream.map(parse, name="parse")
                      .map(enrich, parallelism=4, name="enrich")
                      .map(score, name="score"))
    return _build


# ---------------------------------------------------------------- the query

def _source(spark, args):
    if args.source == "rate-micro-batch":
        return (spark.readStream.format("rate-micro-batch")
                .option("rowsPerBatch", args.rows_per_batch).option("numPartitions", args.partitions).load())
    if args.source == "rate":
        return (spark.readStream.format("rate")
                .option("rowsPerSecond", args.rows_per_batch).option("numPartitions", args.partitions).load())
    # files: JSON lines with "timestamp" and "value" arriving in a folder
    os.makedirs(args.input, exist_ok=True)
    return (spark.readStream.schema("timestamp timestamp, value long")
            .option("maxFilesPerTrigger", 1).json(args.input))


def _stage_line(name, m):
    return (f"    {name:<12} {m['level']:<5} busy {m['busy_ms_per_s']:>6.1f}  "
            f"backpressured {m['backpressured_ms_per_s']:>6.1f}  idle {m['idle_ms_per_s']:>6.1f} ms/s  "
            f"batches {m['records_in']}")


def main(batches: int = 5, rows_per_batch: int = 20_000, source: str = "rate-micro-batch",
         sink: str = "parquet", out: str | None = None, input_dir: str | None = None,
         trigger: str = "1 second", latency_s: float = 0.005, partitions: int = 2,
         max_records_per_batch: int = 5_000, spark=None, quiet: bool = False, timeout_s: float = 300.0) -> list:
    """Run the query for ``batches`` micro-batches; returns one dict per micro-batch
    with ``batch_id``, ``rows``, the pipeline ``stages`` and ``memory`` figures and
    Spark's ``progress`` (``query.lastProgress``) for that batch."""
    args = argparse.Namespace(source=source, rows_per_batch=rows_per_batch, partitions=partitions,
                              input=input_dir or os.path.join(tempfile.gettempdir(), "pyflowbuf-incoming"))
    log = (lambda *a: None) if quiet else print
    own_session = spark is None
    if own_session:
        spark = local_session("pyflowbuf-streaming", max_records_per_batch=max_records_per_batch)
    out = out or tempfile.mkdtemp(prefix="pyflowbuf-stream-")
    checkpoint = os.path.join(out, "_checkpoint")
    collector = MetricsCollector(spark)
    per_batch: dict = {}
    memory: list = []
    pipeline = build(latency_s)

    enough = threading.Event()   # set once `batches` non-empty micro-batches are done

    def process(batch_df, batch_id):
        if enough.is_set():
            return   # the query is about to stop: do not start another Spark job
        collector.reset()
        t0 = time.perf_counter()
        result = map_in_arrow(batch_df, pipeline, OUTPUT_SCHEMA, metrics=collector)
        if sink == "parquet":
            result.write.mode("append").parquet(os.path.join(out, "data"))
        elif sink == "memory":
            memory.append(result.toArrow())   # kept on the driver (small demos only)
        else:
            result.show(5, truncate=False)
        parts = collector.partitions
        per_batch[batch_id] = {
            "batch_id": batch_id,
            "rows": sum(p["rows_out"] for p in parts),
            "seconds": round(time.perf_counter() - t0, 3),
            "stages": collector.stages(),
            "memory": collector.summary(),
        }
        if sum(1 for r in per_batch.values() if r["rows"]) >= batches:
            enough.set()

    query = (_source(spark, args).writeStream.foreachBatch(process)
             .trigger(processingTime=trigger).option("checkpointLocation", checkpoint).start())
    reports: list = []
    seen = set()
    deadline = time.monotonic() + timeout_s
    try:
        while len(reports) < batches:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(reports)} of {batches} micro-batches within {timeout_s} s")
            if query.exception() is not None:
                raise RuntimeError(f"streaming query failed: {query.exception()}")
            for prog in query.recentProgress:
                bid = prog["batchId"]
                if bid in seen or bid not in per_batch:
                    continue
                if per_batch[bid]["rows"] == 0 and prog.get("numInputRows", 0) == 0:
                    seen.add(bid)  # an empty trigger (rate source warming up): not counted
                    continue
                seen.add(bid)
                if sink == "memory" and memory:
                    per_batch[bid]["table"] = memory.pop(0)
                rep = {**per_batch[bid], "progress": {
                    k: prog.get(k) for k in ("batchId", "numInputRows", "inputRowsPerSecond",
                                             "processedRowsPerSecond", "durationMs", "timestamp")}}
                reports.append(rep)
                _print_batch(log, rep)
                if len(reports) >= batches:
                    break
            time.sleep(0.2)
    finally:
        query.stop()
        if own_session:
            spark.stop()
    log(f"\nstopped after {len(reports)} micro-batches; output in {out}")
    return reports


def _print_batch(log, rep):
    p = rep["progress"]
    mem = rep["memory"]
    log(f"\nmicro-batch {rep['batch_id']}: {rep['rows']} rows through the pipeline in {rep['seconds']} s "
        f"(Spark: numInputRows {p['numInputRows']}, processedRowsPerSecond "
        f"{(p['processedRowsPerSecond'] or 0):.0f}, durationMs {json.dumps(p['durationMs'])})")
    for name, m in rep["stages"].items():
        log(_stage_line(name, m))
    log(f"    memory: pool {mem.get('pool_mib_per_partition')} MiB per partition, peak "
        f"{mem.get('pool_peak_segments')} segments in use; worker RSS peak {mem.get('worker_rss_peak_mib')} MiB")


def _cli(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=5, help="stop after this many micro-batches")
    ap.add_argument("--rows-per-batch", type=int, default=20_000,
                    help="rows per micro-batch (rate-micro-batch) or per second (rate)")
    ap.add_argument("--source", choices=["rate-micro-batch", "rate", "files"], default="rate-micro-batch")
    ap.add_argument("--input", help="folder watched by --source files")
    ap.add_argument("--sink", choices=["parquet", "memory", "console"], default="parquet")
    ap.add_argument("--out", help="output folder (default: a new temp dir)")
    ap.add_argument("--trigger", default="1 second", help="processing-time trigger interval")
    ap.add_argument("--latency", type=float, default=0.005, help="simulated lookup latency per Arrow batch (s)")
    ap.add_argument("--json", action="store_true", help="print the reports as JSON at the end")
    a = ap.parse_args(argv)
    reports = main(batches=a.batches, rows_per_batch=a.rows_per_batch, source=a.source, sink=a.sink,
                   out=a.out, input_dir=a.input, trigger=a.trigger, latency_s=a.latency)
    if a.json:
        print(json.dumps(reports, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
