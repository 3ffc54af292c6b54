"""The SparkSession a Spark test module runs on: ``local-cluster[2,1,1024]``
(two executor JVMs), everything on loopback, one per module."""
import os


def local_cluster_session(app: str, **conf):
    """A new session on ``local-cluster[2,1,1024]`` named ``app``, with the
    settings ``conf`` (Spark keys) on top of the loopback ones; another
    module's session is stopped first (this one needs its own executors)."""
    from pyflowbuf.spark.session import worker_python_env

    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    worker_python_env()
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()
    builder = (SparkSession.builder.master("local-cluster[2,1,1024]").appName(app)
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.python.worker.reuse", "true")
               .config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
               .config("spark.executorEnv.SPARK_LOCAL_IP", "127.0.0.1"))
    for key, value in conf.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session
