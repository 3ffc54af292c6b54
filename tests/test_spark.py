"""pyflowbuf pipelines inside a real (local) Spark: mapInArrow, mapInPandas,
scalar pandas_udf, errors reaching the driver, metrics coming back, the
Structured Streaming example and the demo. One session for the whole module
(local[2], UI off, 2 shuffle partitions, Arrow batches of 1,000 rows)."""
import os
import random
import shutil
import sys
import time

import pytest

pytest.importorskip("pyspark")
pa = pytest.importorskip("pyarrow")
pd = pytest.importorskip("pandas")
import pyarrow.compute as pc  # noqa: E402

pytestmark = [
    pytest.mark.spark,
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning"),
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("java") is None and not os.environ.get("JAVA_HOME"),
                       reason="PySpark needs a JDK (17+)"),
]

# Spark's workers cannot import this test module: ship its functions by value.
from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROWS_PER_BATCH = 1000
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def spark():
    from pyflowbuf.spark import local_session

    session = local_session("pyflowbuf-tests", cores=2, max_records_per_batch=ROWS_PER_BATCH,
                            shuffle_partitions=2)
    yield session
    session.stop()


@pytest.fixture(scope="module")
def ids(spark):
    """20,000 rows in 2 partitions -> 10 Arrow batches per partition."""
    return spark.range(0, 20_000, numPartitions=2)


def _jitter(batch):
    time.sleep(random.random() * 0.003)   # parallel subtasks finish out of order
    return batch.append_column("sq", pc.multiply(batch.column("id"), batch.column("id")))


def test_map_in_arrow_keeps_partition_order_through_parallel_stages(spark, ids):
    from pyflowbuf.spark import MetricsCollector, map_in_arrow

    metrics = MetricsCollector(spark)
    out = map_in_arrow(ids, lambda s: s.map(_jitter, parallelism=3, name="jitter").map(lambda b: b, name="ident"),
                       "id long, sq long", metrics=metrics)
    rows = out.collect()
    assert [r.id for r in rows] == list(range(20_000)), "row order within each partition is kept"
    assert all(r.sq == r.id * r.id for r in rows[::997])

    reports = metrics.partitions
    assert len(reports) == 2 and sum(r["rows_in"] for r in reports) == 20_000
    assert {r["partition"] for r in reports} == {0, 1}
    stages = metrics.stages()
    assert set(stages) >= {"spark-input", "jitter", "ident"}
    assert stages["jitter"]["subtasks"] == 6 and stages["jitter"]["records_in"] == 20
    for m in stages.values():
        assert m["level"] in ("OK", "LOW", "HIGH")


def test_unordered_mode_and_the_full_stream_api(spark, ids):
    from pyflowbuf.spark import map_in_arrow

    def build(s):   # preserve_order=False: the real pyflowbuf Stream
        return s.rebalance().map(_jitter, parallelism=2).filter(lambda b: b.num_rows > 0)

    out = map_in_arrow(ids, build, "id long, sq long", preserve_order=False)
    assert sorted(r.id for r in out.collect()) == list(range(20_000))


def test_output_is_cast_and_reordered_to_the_declared_schema(spark, ids):
    from pyflowbuf.spark import map_in_arrow

    def shape(b):   # wrong order, int32 where long is declared, pandas output
        return pd.DataFrame({"label": [f"n{v}" for v in b.column("id").to_pylist()],
                             "id": b.column("id").to_numpy().astype("int32")})

    out = map_in_arrow(ids.limit(3000), lambda s: s.map(shape), "id long, label string")
    assert out.schema.simpleString() == "struct<id:bigint,label:string>"
    rows = out.orderBy("id").limit(3).collect()
    assert [(r.id, r.label) for r in rows] == [(0, "n0"), (1, "n1"), (2, "n2")]


def test_map_in_pandas(spark, ids):
    from pyflowbuf.spark import map_in_pandas

    def enrich(df):
        return df.assign(half=df["id"] / 2.0)

    out = map_in_pandas(ids, lambda s: s.map(enrich, parallelism=2), "id long, half double")
    rows = out.collect()
    assert [r.id for r in rows] == list(range(20_000))
    assert rows[4001].half == 2000.5


def test_scalar_pipeline_udf(spark, ids):
    from pyflowbuf.spark import pipeline_udf

    plus_one = pipeline_udf(lambda s: s.map(lambda v: v + 1, parallelism=2), "long")
    dist = pipeline_udf(lambda s: s.map(lambda df: (df["_0"] ** 2 + df["_1"] ** 2) ** 0.5), "double", num_args=2)
    rows = ids.select("id", plus_one("id").alias("p"), dist("id", "id").alias("d")).collect()
    assert all(r.p == r.id + 1 for r in rows)
    assert abs(rows[3].d - 3 * 2 ** 0.5) < 1e-9


def test_pipeline_failure_fails_the_task_with_the_pipeline_error(spark, ids):
    from pyflowbuf.spark import map_in_arrow

    def enrich(b):
        if b.column("id")[0].as_py() >= 4000:
            raise ValueError("lookup failed for row 4242")
        return b

    t0 = time.monotonic()
    with pytest.raises(Exception) as ei:
        map_in_arrow(ids, lambda s: s.map(enrich, parallelism=2, name="enrich"), "id long").collect()
    assert time.monotonic() - t0 < 60, "a failing pipeline must fail the task, not hang it"
    text = str(ei.value)
    assert "JobFailedError" in text
    assert "operator 'enrich'" in text
    assert "ValueError: lookup failed for row 4242" in text


def test_schema_mismatch_names_the_columns(spark, ids):
    from pyflowbuf.spark import map_in_arrow

    def wrong(b):
        return pa.record_batch({"id": pa.array(["x"] * b.num_rows), "extra": b.column("id")})

    with pytest.raises(Exception) as ei:
        map_in_arrow(ids, lambda s: s.map(wrong), "id long, score double").collect()
    text = str(ei.value)
    assert "SchemaMismatchError" in text
    assert "missing columns ['score']" in text
    assert "unexpected columns ['extra']" in text
    assert "'id' expected int64, got string" in text


def test_a_limit_does_not_wait_for_the_whole_partition(spark):
    """After a limit Spark stops reading the partition's output; the pipeline
    must not keep the task busy until its input is exhausted (400 batches
    of 250 ms on 2 threads would need 50 s: far above what a loaded machine
    adds to the few batches the limit needs)."""
    from pyflowbuf.spark import map_in_arrow

    big = spark.range(0, 400_000, numPartitions=1)
    out = map_in_arrow(big, lambda s: s.map(lambda b: (time.sleep(0.25), b)[1], parallelism=2), "id long")
    t0 = time.monotonic()
    assert [r.id for r in out.limit(10).collect()] == list(range(10))
    assert time.monotonic() - t0 < 25


def test_streaming_example_runs_bounded(spark, tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import streaming_rate
    finally:
        sys.path.pop(0)
    reports = streaming_rate.main(batches=2, rows_per_batch=4000, sink="parquet", out=str(tmp_path),
                                  trigger="0.5 seconds", latency_s=0.001, spark=spark, quiet=True, timeout_s=120)
    assert len(reports) == 2
    for rep in reports:
        assert rep["rows"] == 4000 == rep["progress"]["numInputRows"]
        assert {"spark-input -> parse", "enrich", "score"} <= set(rep["stages"])
        assert rep["memory"]["pool_mib_per_partition"] > 0
    written = spark.read.parquet(str(tmp_path / "data"))
    assert written.count() == 8000
    assert written.columns == ["timestamp", "value", "bucket", "score", "enriched_by"]


def test_spark_demo_quick(spark):
    from pyflowbuf.spark.demo import run_spark_demo

    res = run_spark_demo(rows=200_000, quick=True, spark=spark, verbose=False)
    assert res["rows"] == res["rows_out"] == 200_000
    assert res["rows_per_s"] > 0
    (slow,) = [name for name in res["stages"] if name.startswith("slow-score")]
    assert res["stages"][slow]["level"] in ("OK", "LOW", "HIGH")
    assert res["checksum_ok"]
    assert res["worker_rss_peak_mib"] > 0 and res["pool_mib_per_partition"] > 0


def test_scalar_pipeline_udf_must_keep_lengths(spark, ids):
    from pyflowbuf.spark import pipeline_udf

    shorter = pipeline_udf(lambda s: s.map(lambda v: v.iloc[:-1]), "long")
    with pytest.raises(Exception, match="output batch 0 has 999 values but its input batch had 1000 rows"):
        ids.select(shorter("id")).collect()
