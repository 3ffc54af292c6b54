#!/usr/bin/env python
"""PySpark: a DataFrame through a three-operator pipeline inside mapInArrow,
with 4 threads for the middle stage and per-stage metrics.

    python examples/pyspark_udf.py

Needs pyspark and a JDK 17+ (the ``spark`` extra). See docs/pyspark.md."""
import os
import tempfile

import pyarrow as pa
import pyarrow.compute as pc

from pyflowbuf.spark import MetricsCollector, local_session, map_in_arrow


def parse(batch):
    return batch.select(["id"])


def enrich(batch):                                         # e.g. a remote lookup: worth threads
    return pa.RecordBatch.from_arrays([batch["id"], pc.multiply(batch["id"], 2)], ["id", "x"])


def build(stream):                                         # a stream of pyarrow.RecordBatch
    return stream.map(parse, name="parse").map(enrich, parallelism=4, name="enrich")


def main(d, rows=50_000):
    spark = local_session()                                # local[2], bound to 127.0.0.1
    try:
        metrics = MetricsCollector(spark)
        out = map_in_arrow(spark.range(0, rows), build, "id long, x long", metrics=metrics)
        out.write.parquet(os.path.join(d, "out"))
        back = spark.read.parquet(os.path.join(d, "out"))
        assert back.count() == rows and back.where("x != 2 * id").count() == 0
        return metrics.stages()
    finally:
        spark.stop()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        for stage, m in main(d).items():
            print(stage, m.get("level"), m.get("busy_ms_per_s"))
