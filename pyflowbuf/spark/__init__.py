"""PySpark integration: pyflowbuf pipelines inside Spark's Python workers.

    from pyflowbuf.spark import map_in_arrow, MetricsCollector

    def build(stream):                       # stream of pyarrow.RecordBatch
        return (stream.map(parse)
                      .map(enrich, parallelism=4, name="enrich")   # I/O-bound: threads
                      .map(score, name="score"))

    metrics = MetricsCollector(spark)
    out = map_in_arrow(df, build, "id long, score double", metrics=metrics)
    out.write.parquet("scores")
    metrics.stages()    # per stage: busy / backpressured ms per s, level

Spark schedules the partitions; inside each, pyflowbuf moves the Arrow batches
between the operators through bounded segment pools with backpressure.

* ``map_in_arrow`` / ``arrow_udf``: ``DataFrame.mapInArrow``; records are RecordBatches.
* ``map_in_pandas`` / ``pandas_udf_fn``: ``DataFrame.mapInPandas``; records are DataFrames.
* ``pipeline_udf``: a scalar iterator ``pandas_udf`` (a column in, a column out).
* ``run_partition``: the engine, an iterator in and out, usable without Spark.
* ``MetricsCollector``: per-partition pipeline metrics back on the driver.
* ``local_session``: a small local SparkSession (examples, tests).
* ``SparkCluster``: one job across executors, ``Environment(cluster=SparkCluster(spark, workers=N))``
  (docs/spark-cluster.md).
* ``run_dataflow``: one job over a DataFrame's partitions on SparkCluster workers, with
  exchanges between them; returns a DataFrame.
"""
from pyflowbuf.spark._schema import SchemaMismatchError, conform_batch, resolve_schema
from pyflowbuf.spark.cluster import JobDescription, SparkCluster
from pyflowbuf.spark.dataflow import run_dataflow
from pyflowbuf.spark.adapters import (
    DEFAULT_ENV, arrow_udf, map_in_arrow, map_in_pandas, pandas_udf_fn, pipeline_udf, run_partition)
from pyflowbuf.spark.metrics import MetricsCollector, PartitionStats, aggregate_stages, summarize
from pyflowbuf.spark.session import local_session

__all__ = [
    "arrow_udf", "map_in_arrow", "pandas_udf_fn", "map_in_pandas", "pipeline_udf", "run_partition",
    "MetricsCollector", "PartitionStats", "aggregate_stages", "summarize", "SchemaMismatchError",
    "conform_batch", "resolve_schema", "local_session", "DEFAULT_ENV", "SparkCluster", "JobDescription",
    "run_dataflow",
]
