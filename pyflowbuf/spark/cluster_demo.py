"""The Spark-executors step of the main demo: the windowed word count of the
event-time step, run as ONE dataflow on Spark executors
(``Environment(cluster=SparkCluster(spark, workers=2))``), with a failure
injected once after a checkpoint, and checked exactly once against a
plain-Python count.

The session is ``local-cluster[2,1,1024]`` (two executor JVMs, each with its
own Python workers, all on loopback) when its executors register within a
minute on this machine, else ``local[2]`` (one JVM; the two barrier tasks are
still two Python processes).

    python -m pyflowbuf.spark.cluster_demo [--quick]
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import time
from pathlib import Path

import pyflowbuf as fb
from pyflowbuf.checkpoint import CheckpointStorage
from pyflowbuf.checkpointing.restore_point import latest_checkpoint
from pyflowbuf.spark.cluster import SparkCluster
from pyflowbuf.spark.session import worker_python_env

EXECUTORS_WAIT_S = 60.0


def _executors(sc) -> int:
    """Executors registered with the driver (the driver itself not counted)."""
    return max(0, sc._jsc.sc().getExecutorMemoryStatus().size() - 1)


def cluster_session(wait_s: float = EXECUTORS_WAIT_S, log=print):
    """A SparkSession on ``local-cluster[2,1,1024]`` once both executors have
    registered, or on ``local[2]`` when they do not within ``wait_s``.
    Returns (session, master)."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    worker_python_env()
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()           # an earlier step's local[n] session: executors need their own

    def build(master):
        b = (SparkSession.builder.master(master).appName("pyflowbuf-demo-cluster")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.python.worker.reuse", "true")
             .config("spark.executorEnv.SPARK_LOCAL_IP", "127.0.0.1"))
        if os.environ.get("PYTHONPATH"):      # a source checkout: the executors import it too
            b = b.config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
        s = b.getOrCreate()
        s.sparkContext.setLogLevel("ERROR")
        return s

    t0 = time.monotonic()
    try:
        session = build("local-cluster[2,1,1024]")
    except Exception as exc:    # noqa: BLE001 - any failure to start it: fall back, saying why
        log(f"  local-cluster did not start ({type(exc).__name__}: {exc}); using local[2]")
        return build("local[2]"), "local[2]"
    while _executors(session.sparkContext) < 2 and time.monotonic() - t0 < wait_s:
        time.sleep(0.5)
    if _executors(session.sparkContext) >= 2:
        return session, "local-cluster[2,1,1024]"
    log(f"  local-cluster's executors did not register within {wait_s:.0f} s; using local[2]")
    session.stop()
    return build("local[2]"), "local[2]"


def _fails_once(marker: str, checkpoint_dir: str):
    def fn(record):
        # once, after a checkpoint completed: the executor's task fails and the
        # driver restarts the job from that checkpoint (Spark's attemptNumber
        # stays 0 for barrier tasks, hence the marker file)
        if not os.path.exists(marker) and record[1] > 1.0:
            if latest_checkpoint(CheckpointStorage(checkpoint_dir), verify=False) is not None:
                with open(marker, "w") as f:
                    f.write(repr(record))
                raise RuntimeError("injected failure (the demo fails this task once)")
            # no checkpoint yet (a loaded machine): go slowly until one is
            # there, so that the failure comes before the job ends
            time.sleep(0.005)
        return record
    return fn


def cluster_job(env, records, words, marker: str, chk: str):
    """The demo's dataflow declared on ``env`` (a uid for each stateful
    operator, as a job that is restored should have); its collect() handle."""
    return (env.from_collection(records, rate_limit=words / 3).uid("words")      # about 3 s
               .map(_fails_once(marker, chk), name="fails-once")
               .assign_timestamps(lambda r: r[1], out_of_orderness=0.5).uid("event-time")
               .key_by(lambda r: r[0])
               .window(fb.Tumbling(1.0))
               .aggregate(fb.Count(), window_function=lambda w, win, n: (w, float(win.start), n))
               .uid("word-counts")
               .collect().uid("results"))


def run_cluster_demo(out: Path, quick: bool = False, *, spark=None, words: int = 24_000,
                     verbose: bool = True) -> dict:
    """Run the step; returns (and prints) a summary: the master, the
    executors' Python processes, restarts, the checkpoint restored from and
    whether every window's count equals the plain-Python count."""
    log = print if verbose else (lambda *a, **k: None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if quick:
        words //= 2
    vocabulary = ["stream", "buffer", "credit", "barrier", "window", "spark", "arrow", "flink"]
    rng = random.Random(11)
    records = [(rng.choice(vocabulary), i / 4000 + rng.uniform(-0.2, 0.2)) for i in range(words)]
    want: dict = {}
    for w, t in records:
        key = (w, float(t // 1.0))
        want[key] = want.get(key, 0) + 1

    t_session = time.perf_counter()
    own = spark is None
    master = None
    if own:
        spark, master = cluster_session(log=log)
    else:
        master = spark.sparkContext.master
    session_s = time.perf_counter() - t_session
    chk = out / "spark-cluster-checkpoints"
    marker = out / "spark-cluster-failed-once"
    shutil.rmtree(chk, ignore_errors=True)
    marker.unlink(missing_ok=True)
    try:
        env = fb.Environment(parallelism=2, cluster=SparkCluster(spark, workers=2), name="spark-cluster-demo",
                             checkpoint_interval=0.3, checkpoint_dir=str(chk), restart_attempts=1)
        counts = cluster_job(env, records, words, str(marker), str(chk))
        t0 = time.perf_counter()
        env.execute(300)
        ex = env.last_execution
        tasks = getattr(getattr(ex, "launcher", None), "tasks", {}) or {}
        got = {(w, start): n for w, start, n in counts.result}
        result = {
            "master": master,
            "session_start_s": round(session_s, 1),
            "words": words,
            "seconds": round(time.perf_counter() - t0, 2),
            "worker_processes": len({t.get("pid") for t in tasks.values()}),
            "hosts": sorted({str(t.get("host")) for t in tasks.values()}),
            "restarts": ex.restarts,
            "restored_from": ex.restored_from,
            "windows": len(got),
            "exactly_once": got == want and len(counts.result) == len(want),
        }
    finally:
        if own:
            spark.stop()
    for k, v in result.items():
        log(f"  {k:>26}: {v}")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="out")
    args = p.parse_args(argv)
    res = run_cluster_demo(Path(args.out), quick=args.quick)
    return 0 if res["exactly_once"] else 1


if __name__ == "__main__":
    sys.exit(main())
