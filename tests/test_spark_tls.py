"""A job on a SparkCluster whose Spark encrypts its own traffic
(``spark.authenticate`` + ``spark.network.crypto.enabled``) runs, with its
exchange, control channel and output relays over mutual TLS: before issue 31
it was refused. No process runs a TLS relay thread (the control channel and
the output relays use Python's ssl on the socket itself, the exchange the
core's libssl). One SparkSession on ``local-cluster[2,1,1024]``: slow."""
import os
import secrets
import threading

import pytest

pyspark = pytest.importorskip("pyspark")

import pyflowbuf as fb  # noqa: E402
from pyflowbuf.spark import SparkCluster  # noqa: E402
from spark_helpers import local_cluster_session  # noqa: E402

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def spark():
    session = local_cluster_session("pyflowbuf-spark-tls", **{
        "spark.authenticate": "true", "spark.authenticate.secret": secrets.token_hex(16),
        "spark.network.crypto.enabled": "true"})
    yield session
    session.stop()


def test_a_job_runs_on_an_encrypting_spark_cluster_over_tls(spark, capsys):
    def prints(x):      # defined here: the closure travels by value, the test module is not on the executors
        relays = [t.name for t in threading.enumerate() if t.name.startswith("pyflowbuf-tls")]
        print(f"tls worker {os.getpid()} relay threads {relays}")
        return x

    # the driver's threads while the job runs (its listener's channels live as long as the job)
    seen, stop = set(), threading.Event()

    def watch():
        while not stop.wait(0.05):
            seen.update(t.name for t in threading.enumerate() if t.name.startswith("pyflowbuf-tls"))
    watcher = threading.Thread(target=watch)
    watcher.start()

    cluster = SparkCluster(spark, workers=2)
    env = fb.Environment(parallelism=2, cluster=cluster)
    words = [f"w{i % 37}" for i in range(20_000)]
    counts = (env.from_collection(words).map(lambda w: (w, 1), kind="struct")
                 .key_by(lambda kv: kv[0]).reduce(lambda a, b: (a[0], a[1] + b[1]), kind="struct").collect())
    env.from_sequence(0, 4, parallelism=2).map(prints, parallelism=2).sink(lambda x: None, parallelism=2)
    try:
        env.execute(timeout=300)
    finally:
        stop.set()
        watcher.join()
    final = {}
    for k, n in counts.result:
        final[k] = max(final.get(k, 0), n)
    assert final == {f"w{i}": len(range(i, 20_000, 37)) for i in range(37)}
    ex = env.last_execution
    cfg = ex.tls.for_attempt(0)
    assert cfg is not None and cfg.fingerprints          # on by itself: the job's CA, pinned
    metrics = env.metrics()
    assert sum(m["remote_buffers_in"] for m in metrics.values()) > 0     # the exchange crossed TLS
    out = capsys.readouterr().out
    assert "tls worker" in out                                            # the output relay too
    assert "relay threads []" in out and "relay threads ['" not in out    # no relay thread in the tasks
    assert not seen                                                       # nor in the driver
    assert ex.launcher._listener is None or ex.launcher._listener.refused == 0
