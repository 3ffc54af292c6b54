#!/usr/bin/env python
"""pyflowbuf inside PySpark: what does routing mapInArrow batches through a
pyflowbuf pipeline cost, compared with plain mapInArrow, in the same run?

    python benchmarks/run.py spark [--quick] [--json]
    python benchmarks/bench_spark.py [--quick]          # prints the dict as JSON

For Arrow batch sizes of 1,000 / 10,000 / 100,000 rows
(``spark.sql.execution.arrow.maxRecordsPerBatch``) the same cached DataFrame
(id long, k int, x double, s string) goes through

* ``mapInArrow(identity)``: Spark's Python worker hands each batch back as is (the peer);
* ``map_in_arrow`` with a 3-operator identity pyflowbuf pipeline
  (``map -> map -> map``, default settings): each batch is serialized into
  32 KiB segments by the source thread and read back in the worker's main
  thread, with backpressure between them;
* ``mapInPandas(identity)`` at 10,000 rows per batch, for reference.

Every run is fully evaluated (``write.format("noop")``). Cases run
interleaved, rotating their order, several repetitions; the overhead is
``1 - median over repetitions of (pyflowbuf rows/s / mapInArrow rows/s)``,
paired within a repetition so both see the same background load (goals:
<= 0.15 at 10,000 rows per batch, <= 0.10 at 1,000).

Where the time per batch goes (untimed runs at 1,000 rows per batch): the
CPU seconds of Spark's Python worker per Arrow batch, all its threads, with
plain ``mapInArrow`` and with the pipeline (``worker_cpu_us_per_batch_*``);
their difference is what the pipeline costs per batch whatever the load,
while the rows/s ratio also shows the overlap the pipeline's thread gives
(reading Spark's input while the worker writes the output).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import common  # noqa: E402

BATCH_SIZES = {"1k": 1_000, "10k": 10_000, "100k": 100_000}
GOAL_10K = common.Goal("<=", 0.15)
GOAL_1K = common.Goal("<=", 0.10)


def _functions():
    """The UDFs, made inside a function so that cloudpickle ships them by
    value (Spark's workers cannot import this benchmarks/ module)."""

    def identity_arrow(it):
        for b in it:
            yield b

    def identity_pandas(it):
        for df in it:
            yield df

    def ident(b):
        return b

    def build(stream):
        return stream.map(ident, name="op1").map(ident, name="op2").map(ident, name="op3")

    return identity_arrow, identity_pandas, build


def _cpu_per_batch(udf, acc):
    """``udf`` wrapped to add (CPU seconds of the whole worker process, batches)
    of each partition to the accumulator ``acc``. Made here for the same
    reason as ``_functions``."""

    def measured(it):
        import time as _time

        c0 = _time.process_time()
        n = 0
        for b in udf(it):
            n += 1
            yield b
        acc.add([(_time.process_time() - c0, n)])

    return measured


def main(quick: bool = False) -> dict:
    warnings.filterwarnings("ignore", message=".*pandas >= 3.0.0.*", category=FutureWarning)
    from pyspark.sql import functions as F

    from pyflowbuf.spark import local_session, map_in_arrow

    rows = 600_000 if quick else 2_000_000
    repeats = 3 if quick else 7
    rep = common.Report("spark", quick, params={
        "rows": rows, "repeats": repeats, "partitions": 2, "master": "local[2]",
        "pipeline": "map -> map -> map (identity), parallelism 1, default Environment settings",
        "batch_sizes": BATCH_SIZES})
    t_start = time.perf_counter()
    spark = local_session("pyflowbuf-bench", cores=2, max_records_per_batch=10_000)
    rep.params["session_start_s"] = round(time.perf_counter() - t_start, 1)
    try:
        df = (spark.range(0, rows, numPartitions=2)
              .select(F.col("id"), (F.col("id") % 1000).cast("int").alias("k"),
                      (F.col("id") * 0.5).alias("x"),
                      F.concat(F.lit("name-"), (F.col("id") % 997).cast("string")).alias("s"))
              .cache())
        df.count()
        schema = df.schema
        identity_arrow, identity_pandas, build = _functions()

        def timed_run(out_df):
            t0 = time.perf_counter()
            out_df.write.format("noop").mode("overwrite").save()
            return rows / (time.perf_counter() - t0)

        def case(kind, batch):
            def run():
                spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", str(batch))
                if kind == "arrow":
                    return timed_run(df.mapInArrow(identity_arrow, schema))
                if kind == "pandas":
                    return timed_run(df.mapInPandas(identity_pandas, schema))
                return timed_run(map_in_arrow(df, build, schema))
            return run

        results = {}
        for label, batch in BATCH_SIZES.items():
            rep.section(f"{batch:,} rows per Arrow batch")
            cases = {"mapinarrow": case("arrow", batch), "pyflowbuf": case("pyflowbuf", batch)}
            if label == "10k":
                cases["mapinpandas"] = case("pandas", batch)
            samples = common.interleaved(cases, repeats=repeats, warmup=1)
            results[label] = samples
            m_arrow = samples.median("mapinarrow")
            m_fb = samples.median("pyflowbuf")
            rep.add(f"rows_per_s_mapinarrow_{label}", m_arrow, "/s", spread=samples.spread("mapinarrow"))
            rep.add(f"rows_per_s_pyflowbuf_{label}", m_fb, "/s", spread=samples.spread("pyflowbuf"))
            if "mapinpandas" in cases:
                rep.add(f"rows_per_s_mapinpandas_{label}", samples.median("mapinpandas"), "/s",
                        spread=samples.spread("mapinpandas"))
            overhead = 1.0 - samples.ratio("pyflowbuf", "mapinarrow")
            rep.add(f"overhead_vs_mapinarrow_{label}", overhead, "",
                    goal={"10k": GOAL_10K, "1k": GOAL_1K}.get(label),
                    note="1 - median paired ratio of rows/s (negative: pyflowbuf was faster)")
        _worker_cpu(rep, spark, df, schema, identity_arrow, build, repeats)
        # honesty check (untimed): the pyflowbuf case really moved every row
        from pyflowbuf.spark import MetricsCollector

        spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "10000")
        collector = MetricsCollector(spark)
        map_in_arrow(df, build, schema, metrics=collector).write.format("noop").mode("overwrite").save()
        moved = collector.summary()
        rep.add("verified_rows_through_pipeline", moved.get("rows_out", 0), "",
                note=f"of {rows}; pool {moved.get('pool_mib_per_partition')} MiB per partition, "
                     f"worker RSS peak {moved.get('worker_rss_peak_mib')} MiB")
        df.unpersist()
    finally:
        spark.stop()
    rep.params["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    return rep.as_dict()


def _worker_cpu(rep, spark, df, schema, identity_arrow, build, repeats):
    """Untimed: CPU of Spark's Python workers per 1,000-row batch, plain
    mapInArrow and through the pipeline (median over repetitions of the
    per-run figure, runs alternating)."""
    from pyspark.accumulators import AccumulatorParam

    from pyflowbuf.spark import arrow_udf

    class _Concat(AccumulatorParam):
        def zero(self, value):
            return []

        def addInPlace(self, a, b):
            a.extend(b)
            return a

    acc = spark.sparkContext.accumulator([], _Concat())
    fns = {"mapinarrow": _cpu_per_batch(identity_arrow, acc),
           "pyflowbuf": _cpu_per_batch(arrow_udf(build, schema), acc)}
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "1000")
    per_batch: dict = {k: [] for k in fns}
    for r in range(repeats + 1):
        for name in (list(fns) if r % 2 else list(fns)[::-1]):
            acc.value = []
            df.mapInArrow(fns[name], schema).write.format("noop").mode("overwrite").save()
            if r:   # the first round warms the workers up
                parts = acc.value
                per_batch[name].append(sum(c for c, _ in parts) / max(1, sum(n for _, n in parts)))
    rep.section("Python worker CPU per 1,000-row batch (untimed runs)")
    plain = statistics.median(per_batch["mapinarrow"]) * 1e6
    ours = statistics.median(per_batch["pyflowbuf"]) * 1e6
    rep.add("worker_cpu_us_per_batch_mapinarrow_1k", plain, "us")
    rep.add("worker_cpu_us_per_batch_pyflowbuf_1k", ours, "us")
    rep.add("worker_cpu_us_per_batch_pipeline_1k", ours - plain, "us",
            note="what the pipeline adds to a batch's CPU in the worker (both threads)")


if __name__ == "__main__":
    quick = "--quick" in sys.argv[1:]
    print(json.dumps(common.jsonable(main(quick=quick))))
