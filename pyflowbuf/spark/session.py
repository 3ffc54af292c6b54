"""A small local SparkSession for examples, tests, the demo and benchmarks."""
from __future__ import annotations

import os
import sys
from typing import Any, Mapping


def worker_python_env() -> None:
    """Make Spark's Python workers use this interpreter (so they can import
    pyflowbuf and the same pyarrow), unless the user already chose one."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # A checkout that is not installed: let the workers find the package too.
    import pyflowbuf

    root = os.path.dirname(os.path.dirname(os.path.abspath(pyflowbuf.__file__)))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])


def local_session(app_name: str = "pyflowbuf", *, cores: int = 2, max_records_per_batch: int = 10_000,
                  shuffle_partitions: int = 2, conf: Mapping[str, Any] | None = None,
                  log_level: str = "ERROR"):
    """``SparkSession`` on ``local[cores]`` with the UI off, few shuffle
    partitions and Arrow batches of ``max_records_per_batch`` rows.

    ``getOrCreate`` semantics: an active session is reused (its static
    settings are not changed; the runtime SQL settings given here are set)."""
    worker_python_env()
    # A local master's traffic stays on loopback: without SPARK_LOCAL_IP the
    # JVM looks for the host's address, warns when the hostname resolves to
    # loopback and picks another interface. Read when the JVM starts, so a
    # session already running keeps its address; a user's choice is kept.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    runtime = {
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
        "spark.sql.execution.arrow.maxRecordsPerBatch": str(max_records_per_batch),
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.session.timeZone": "UTC",
    }
    builder = (SparkSession.builder.master(f"local[{cores}]").appName(app_name)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.python.worker.reuse", "true")
               .config("spark.sql.execution.pyspark.udf.simplifiedTraceback.enabled", "true"))
    for k, v in {**runtime, **dict(conf or {})}.items():
        builder = builder.config(k, str(v))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(log_level)
    for k, v in {**runtime, **{k: v for k, v in dict(conf or {}).items() if k.startswith("spark.sql.")}}.items():
        spark.conf.set(k, str(v))
    return spark
