"""One job across Spark executors (issue 20): Environment(cluster=SparkCluster(...)).

One SparkSession for the module on ``local-cluster[2,1,1024]``: two real
executor JVMs with their own Python workers, everything on loopback. Spark
jobs are few: each costs seconds on a two-core machine.
"""
import os
import socket
import sys
import threading
import time

import pytest

pyspark = pytest.importorskip("pyspark")

import pyflowbuf as fb  # noqa: E402
from pyflowbuf import errors  # noqa: E402
from pyflowbuf.checkpoint import CheckpointStorage  # noqa: E402
from pyflowbuf.net import protocol as P  # noqa: E402
from pyflowbuf.cluster.control_channel import connect_control  # noqa: E402
from pyflowbuf.checkpointing.restore_point import latest_checkpoint  # noqa: E402
from pyflowbuf.spark import SparkCluster  # noqa: E402
from spark_helpers import local_cluster_session  # noqa: E402

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def spark():
    session = local_cluster_session("pyflowbuf-spark-cluster")
    yield session
    session.stop()


@pytest.fixture
def conf(spark):
    """Set a Spark setting on the running session's conf for one test."""
    jconf = spark.sparkContext._jsc.sc().conf()
    saved = {}

    def set_(key, value):
        saved.setdefault(key, jconf.getOption(key))
        jconf.set(key, value)

    yield set_
    for key, old in saved.items():
        if old.isDefined():
            jconf.set(key, old.get())
        else:
            jconf.remove(key)


# ---------------------------------------------------------------- the job

RECORDS = [(f"k{i % 13}", i / 2000.0) for i in range(30_000)]    # 15 s of event time


def windowed_counts(env):
    return (env.from_collection(RECORDS)
               .assign_timestamps(lambda r: r[1], out_of_orderness=0.5)
               .key_by(lambda r: r[0])
               .window(fb.Tumbling(1.0))
               .aggregate(fb.Count(), window_function=lambda key, w, n: (key, float(w.start), n))
               .collect())


def _says_where_it_runs():
    said = []       # a copy per barrier task (the closure travels pickled)

    def fn(r):
        if not said:
            said.append(r)
            print(f"hello from pid {os.getpid()}")
            print(f"a warning from pid {os.getpid()}", file=sys.stderr)
        return r
    return fn


def test_the_web_view_shows_every_subtask_with_its_executor_worker(spark):
    """Issue 30 on Spark: the view the driver serves lists every subtask with
    the worker (a Spark barrier task) it runs on, in a real browser."""
    ui_browser = pytest.importorskip("test_ui_browser")
    if ui_browser.CHROMIUM is None or ui_browser.sync_playwright is None:
        pytest.skip("no chromium or playwright (ci/setup.sh installs them)")
    from pipeline_helpers import cancel_and_join

    env = fb.Environment(parallelism=2, cluster=SparkCluster(spark, workers=2), metrics_interval=0.5,
                         ui_port=0, name="ui-on-spark")
    (env.from_sequence(0, None, rate_limit=2000).map(lambda x: x, name="map")
        .rebalance().sink(lambda b: None, batched=True, name="sink"))
    job = env.execute_async()
    b = None
    try:
        b = ui_browser.Browser()
        b.open(job.ui_url, "subtasks")
        b.page.wait_for_function(
            "() => document.querySelectorAll('tr.subtask').length === 4 && "
            "[...document.querySelectorAll('tr.subtask')].every(r => r.dataset.worker !== '')",
            timeout=ui_browser.WAIT_MS)
        rows = b.page.locator("tr.subtask")
        workers = {rows.nth(i).get_attribute("data-task"): rows.nth(i).get_attribute("data-worker")
                   for i in range(4)}
        assert set(workers.values()) == {"0", "1"}, workers
        b.shot("subtasks-spark")
        assert not b.errors, b.errors
    finally:
        cancel_and_join(job)
        if b is not None:
            b.page.close()          # before the server: a poll cut off is a console error
            b.close()
        job.ui.close()


def test_keyed_windowed_job_on_two_executors_equals_one_process(spark, capsys):
    ref_env = fb.Environment(parallelism=2)
    ref = windowed_counts(ref_env)
    ref_env.execute(timeout=60)

    cluster = SparkCluster(spark, workers=2)
    env = fb.Environment(parallelism=2, cluster=cluster)
    out = windowed_counts(env)
    (env.from_sequence(0, 100, parallelism=2).map(_says_where_it_runs(), parallelism=2)
        .sink(lambda x: None, parallelism=2))
    env.execute(timeout=300)

    assert sorted(out.result) == sorted(ref.result)
    # what the workers print reaches the caller's stdout and stderr
    pids = {m["pid"] for m in env.metrics().values()}
    printed = capsys.readouterr()
    assert sorted(printed.out.split("\n")) == sorted(["", *(f"hello from pid {p}" for p in pids)])
    assert sorted(printed.err.split("\n")) == sorted(["", *(f"a warning from pid {p}" for p in pids)])
    assert len(out.result) == 13 * 15
    metrics = env.metrics()
    pids = {m["pid"] for m in metrics.values()}
    assert len(pids) == 2 and os.getpid() not in pids          # two Python workers, not this process
    assert all(m["host"] == "127.0.0.1" and m["executor"] for m in metrics.values())
    # the keyed exchange crossed the network, on loopback
    assert sum(m["remote_buffers_in"] for m in metrics.values()) > 0
    ex = env.last_execution
    assert sorted(ex.addresses) == [0, 1]
    assert all(host == "127.0.0.1" for host, _ in ex.addresses.values())
    assert ex.launcher.attempts and ex.restarts == 0
    # the one execution of every placement (test_execution_shared.py: threads and workers=2)
    from pyflowbuf.runtime.execution import JobExecution
    from pyflowbuf.spark.cluster import SparkLauncher
    assert type(ex) is JobExecution and type(ex.launcher) is SparkLauncher


# ---------------------------------------------------------------- refusals

def _refused(cluster, env_kwargs=None, match=""):
    env = fb.Environment(parallelism=2, cluster=cluster, **(env_kwargs or {}))
    env.from_sequence(0, 10).collect()
    t0 = time.monotonic()
    with pytest.raises(errors.ConfigurationError, match=match):
        env.execute(timeout=60)
    return time.monotonic() - t0


def test_refusals_before_submission(spark, conf, tmp_path):
    sc = spark.sparkContext
    jobs_before = len(sc.statusTracker().getJobIdsForGroup(None))

    # more workers than the two executors' slots: refused at once, without
    # waiting start_timeout for executors that local-cluster[2,1,..] never adds
    assert _refused(SparkCluster(spark, workers=3), match=r"workers=3.*has 2 task slots") < 30

    conf("spark.dynamicAllocation.enabled", "true")
    _refused(SparkCluster(spark, workers=2), match="spark.dynamicAllocation.enabled")
    conf("spark.dynamicAllocation.enabled", "false")

    conf("spark.network.crypto.enabled", "true")
    # TLS turns on by itself (tests/test_spark_tls.py); turning it off is refused
    _refused(SparkCluster(spark, workers=2, tls=False), match="spark.network.crypto.enabled.*allow_unencrypted")
    conf("spark.network.crypto.enabled", "false")

    # a memory:// location is the driver's memory, whatever the master
    _refused(SparkCluster(spark, workers=2), {"checkpoint_interval": 1.0, "checkpoint_dir": "memory://ck"},
             match="checkpoint_dir.*memory://")
    conf("spark.master", "spark://elsewhere:7077")      # executors on other hosts
    _refused(SparkCluster(spark, workers=2), {"checkpoint_interval": 1.0, "checkpoint_dir": str(tmp_path)},
             match="checkpoint_dir: .* local path.*fsspec URL")
    env = fb.Environment(parallelism=2, cluster=SparkCluster(spark, workers=2))
    env.from_sequence(0, 10).write_text(str(tmp_path / "out"))
    with pytest.raises(errors.ConfigurationError, match="sink 'write_text'.* local path.*fsspec URL"):
        env.execute(timeout=60)
    (tmp_path / "in.txt").write_text("a\n")
    env = fb.Environment(parallelism=2, cluster=SparkCluster(spark, workers=2))
    env.read_text(str(tmp_path / "in.txt"), name="lines").collect()
    with pytest.raises(errors.ConfigurationError, match="source 'lines'.* local path.*fsspec URL"):
        env.execute(timeout=60)
    # the fsspec alternative passes the check (file:// names a mount every host has)
    cluster = SparkCluster(spark, workers=2)
    env = fb.Environment(parallelism=2, cluster=cluster, checkpoint_interval=1.0,
                         checkpoint_dir=(tmp_path / "ck").as_uri())
    env.read_text((tmp_path / "in.txt").as_uri()).write_text((tmp_path / "out2").as_uri())
    cluster.check(env)

    assert len(sc.statusTracker().getJobIdsForGroup(None)) == jobs_before    # nothing was submitted

    with pytest.raises(errors.ConfigurationError, match="workers"):
        SparkCluster(spark, workers=0)
    with pytest.raises(errors.ConfigurationError, match="port_range"):
        SparkCluster(spark, workers=2, port_range=(10, 5))
    with pytest.raises(errors.ConfigurationError, match="not also"):
        fb.Environment(workers=2, cluster=SparkCluster(spark, workers=2))


# ---------------------------------------------------------------- secrets and cancelling

def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_wrong_secret_refused_and_cancel_leaves_no_worker(spark):
    env = fb.Environment(parallelism=2, cluster=SparkCluster(spark, workers=2))
    (env.from_sequence(0, 10_000_000, rate_limit=2000)
        .key_by(lambda x: x % 5).map(lambda x: x, parallelism=2).collect())
    job = env.execute_async()
    try:
        deadline = time.monotonic() + 120
        while not (job.addresses and job.launcher.tasks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert job.addresses, "the workers did not start"
        control = job.launcher._listener.address
        with pytest.raises(errors.AuthenticationError):
            connect_control(control, b"w" * 32, timeout=10)
        refused_by = time.monotonic() + 60
        while job.launcher.refused < 1 and time.monotonic() < refused_by:
            time.sleep(0.05)
        assert job.launcher.refused == 1
        # the data port of a worker's exchange server
        host, port = job.addresses[0]
        with socket.create_connection((host, port), timeout=10) as sock:
            reader = P.FrameReader(sock, 1 << 20)
            with pytest.raises(errors.AuthenticationError):
                P.client_handshake(sock, reader, b"w" * 32, 0, deadline=time.monotonic() + 10)
        assert not job.done
        pids = [t["pid"] for t in job.launcher.tasks.values()]
    finally:
        job.cancel()
    job.join(60)                # a cancelled job ends without a failure
    sc = spark.sparkContext
    gone_by = time.monotonic() + 60
    while sc.statusTracker().getActiveJobsIds() and time.monotonic() < gone_by:
        time.sleep(0.2)
    assert not sc.statusTracker().getActiveJobsIds(), "the cancelled job's Spark job still runs"
    # a Python worker the job ran in has exited, or is Spark's idle worker again with nothing of ours
    _assert_nothing_left_in(spark, [p for p in pids if _pid_alive(p)])


def _assert_nothing_left_in(spark, pids):
    """Spark reuses its Python workers: nothing of ours may stay in them."""
    def leftovers(_):       # nested: pickled by value (executors cannot import this module)
        yield os.getpid(), sorted(t.name for t in threading.enumerate() if t.name.startswith("pyflowbuf"))

    seen = spark.sparkContext.parallelize(range(4), 4).mapPartitions(leftovers).collect()
    assert all(names == [] for _, names in seen), seen
    return {pid for pid, _ in seen} & set(pids)


# ---------------------------------------------------------------- failure and restart

N_FAIL = 12_000


def _fails_once(marker, ckdir):
    def fn(x):
        # once, as soon as a checkpoint has completed: the worker's task fails
        if not os.path.exists(marker):
            if x % 200 == 0 and latest_checkpoint(CheckpointStorage(ckdir), verify=False) is not None:
                with open(marker, "w") as f:
                    f.write(str(x))
                raise RuntimeError(f"injected failure at record {x}")
            if x >= N_FAIL // 2:
                time.sleep(0.005)   # the job is still running when the failure comes, however loaded the machine
        return x
    return fn


def _slow_until(marker, start):
    """Records from ``start`` on go slowly until ``marker`` exists (the test
    made its move): a bounded job still runs when it is interrupted."""
    def fn(x):
        if x >= start and not os.path.exists(marker):
            time.sleep(0.005)
        return x
    return fn


def test_task_failure_after_a_checkpoint_restarts_once_exactly_once(spark, tmp_path):
    """Also over fsspec: the checkpoints and a write_text sink under file://
    URLs, written by the executors' Python workers; the driver commits the
    parts through fsspec, exactly once across the restore."""
    marker, ckdir = str(tmp_path / "failed-once"), str(tmp_path / "checkpoints")
    env = fb.Environment(parallelism=2, cluster=SparkCluster(spark, workers=2), checkpoint_interval=0.3,
                         checkpoint_dir=(tmp_path / "checkpoints").as_uri(), restart_attempts=2)
    after = (env.from_sequence(0, N_FAIL, rate_limit=3000)
                .map(_fails_once(marker, ckdir), name="fails once")
                .key_by(lambda x: x % 7)
                .map(lambda x: x, parallelism=2, name="after"))
    out = after.collect()
    after.write_text((tmp_path / "out").as_uri(), parallelism=2)
    env.execute(timeout=300)
    lines = []
    for name in sorted(os.listdir(tmp_path / "out")):
        assert name.startswith("part-"), name       # nothing left in progress
        lines += (tmp_path / "out" / name).read_text().splitlines()
    assert sorted(map(int, lines)) == list(range(N_FAIL))
    assert os.path.exists(marker)
    ex = env.last_execution
    assert ex.restarts == 1
    assert "injected failure" in ex.restart_failures[0][2]
    assert ex.restored_from is not None and ex.restored_from >= 1
    assert len(ex.launcher.attempts) == 2
    assert sorted(out.result) == list(range(N_FAIL))         # every record once: none lost, none twice

    # Spark reuses its Python workers: nothing of ours may be left in them
    pids = {t["pid"] for t in ex.launcher.tasks.values()}
    assert _assert_nothing_left_in(spark, pids), "no Python worker of the job was reused: the check saw none"


# ---------------------------------------------------------------- run_dataflow

def test_run_dataflow_with_key_by_across_partitions_equals_pandas(spark):
    import pandas as pd
    from pyspark.sql import functions as F

    from pyflowbuf.spark import run_dataflow

    n = 20_000
    # 3 partitions (brought to 2 workers), every key's rows in each of them
    df = spark.range(0, n, numPartitions=3).select(
        F.concat(F.lit("k"), (F.col("id") * 7 % 11).cast("string")).alias("key"), (F.col("id") / 1000.0).alias("t"))
    pdf = pd.DataFrame({"key": [f"k{(i * 7) % 11}" for i in range(n)], "t": [i / 1000.0 for i in range(n)]})

    def build(batches):
        return (batches.flat_map(lambda b: zip(b.column("key").to_pylist(), b.column("t").to_pylist()))
                       .assign_timestamps(lambda r: r[1], out_of_orderness=0.5)
                       .key_by(lambda r: r[0])
                       .window(fb.Tumbling(1.0))
                       .aggregate(fb.Count(), window_function=lambda key, w, c: (key, float(w.start), c)))

    out = run_dataflow(df, build, "key string, start double, n long", workers=2)
    got = out.toPandas().sort_values(["key", "start"]).reset_index(drop=True)
    ref = (pdf.assign(start=(pdf["t"] // 1.0).astype(float)).groupby(["key", "start"]).size()
              .rename("n").reset_index().sort_values(["key", "start"]).reset_index(drop=True))
    pd.testing.assert_frame_equal(got, ref, check_dtype=False)


# ---------------------------------------------------------------- a lost executor (last: it replaces one)

def _parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _executor_jvm(python_worker_pid):
    """The executor JVM a Spark Python worker belongs to (worker -> daemon -> JVM)."""
    pid = python_worker_pid
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"java" in f.read().split(b"\0")[0]:
                return pid
        pid = _parent(pid)
    raise AssertionError(f"no JVM above Python worker {python_worker_pid}")


def _wait_for_executors(cluster, slots=2, timeout=120):
    """Until the killed executor's replacement has registered (Spark's
    standalone worker starts a new JVM): the tests after it need both."""
    deadline = time.monotonic() + timeout
    while cluster.free_slots() < slots:
        assert time.monotonic() < deadline, f"fewer than {slots} task slots {timeout} s after the kill"
        time.sleep(0.25)
    return time.monotonic()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="finds the executor's JVM through /proc")
def test_sigkill_of_an_executor_jvm_with_none_back_within_start_timeout_fails_clearly(spark, tmp_path):
    """The restart after a lost executor waits start_timeout for a free slot
    per worker; a new executor JVM takes longer than 1.5 s to start and
    register, so the job fails, naming the setting, instead of waiting (or
    leaving a barrier job that Spark would only give up on after minutes)."""
    cluster = SparkCluster(spark, workers=2, start_timeout=1.5)
    env = fb.Environment(parallelism=2, cluster=cluster, checkpoint_interval=0.3,
                         checkpoint_dir=str(tmp_path / "ck"), restart_attempts=2)
    (env.from_sequence(0, 10_000_000, rate_limit=3000)
        .key_by(lambda x: x % 7).map(lambda x: x, parallelism=2).collect())
    job = env.execute_async()
    deadline = time.monotonic() + 120
    while not (job.launcher.tasks and any(c["status"] == "completed" for c in env.checkpoints())):
        assert time.monotonic() < deadline and not job.done, "no checkpoint completed"
        time.sleep(0.1)
    os.kill(_executor_jvm(job.launcher.tasks[1]["pid"]), 9)
    killed = time.monotonic()
    with pytest.raises(errors.JobFailedError, match=r"no executor came back within start_timeout=1\.5|"
                                                    r"did not start within start_timeout=1\.5") as info:
        job.join(120)
    failed_after = time.monotonic() - killed
    assert "recovery" in str(info.value)
    assert job.restarts == 1
    assert "lost its control channel" in job.restart_failures[0][2] or "Spark job" in job.restart_failures[0][2]
    assert failed_after < 60, f"the job took {failed_after:.1f} s to fail"
    back = _wait_for_executors(cluster) - killed
    print(f"failed {failed_after:.1f} s after the kill; the executor was back after {back:.1f} s")
    assert not spark.sparkContext.statusTracker().getActiveJobsIds(), "the failed attempt's Spark job still runs"


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="finds the executor's JVM through /proc")
def test_sigkill_of_an_executor_jvm_recovers_exactly_once(spark, tmp_path):
    n = 15_000
    killed = str(tmp_path / "killed")
    env = fb.Environment(parallelism=2, cluster=SparkCluster(spark, workers=2, start_timeout=120),
                         checkpoint_interval=0.3, checkpoint_dir=str(tmp_path / "ck"), restart_attempts=2)
    out = (env.from_sequence(0, n, rate_limit=3000)
              .key_by(lambda x: x % 7).map(_slow_until(killed, n // 2), parallelism=2).collect())
    job = env.execute_async()
    deadline = time.monotonic() + 120
    while not (job.launcher.tasks and any(c["status"] == "completed" for c in env.checkpoints())):
        assert time.monotonic() < deadline and not job.done, "no checkpoint completed"
        time.sleep(0.1)
    victim = _executor_jvm(job.launcher.tasks[1]["pid"])
    assert victim != os.getpid()
    os.kill(victim, 9)
    with open(killed, "w"):
        pass
    job.join(300)
    assert job.restarts == 1
    assert "lost its control channel" in job.restart_failures[0][2] or "Spark job" in job.restart_failures[0][2]
    assert job.restored_from is not None
    assert sorted(out.result) == list(range(n))
    _wait_for_executors(SparkCluster(spark, workers=2))


# ---------------------------------------------------------------- the main job's step

def test_the_main_jobs_spark_cluster_step_with_relative_paths(spark, tmp_path, monkeypatch):
    """Step 5 of the demonstration on this module's session, as the demo runs
    it: the windowed word count over two barrier tasks, one injected failure,
    exactly once, with its paths relative to the driver's working directory.
    The executors' Python workers run elsewhere (Spark's work directory):
    relative paths used to land there, so the task states of a checkpoint
    were not beside its _metadata and the failure, which waits for a
    checkpoint the executor can see, never came."""
    import pathlib

    from pyflowbuf.spark.cluster_demo import run_cluster_demo

    monkeypatch.chdir(tmp_path)
    res = run_cluster_demo(pathlib.Path("out"), quick=True, spark=spark, verbose=False)
    assert res["exactly_once"] and res["restarts"] == 1 and res["restored_from"] is not None
    assert res["worker_processes"] == 2 and res["hosts"] == ["127.0.0.1"]
    chk = tmp_path / "out" / "spark-cluster-checkpoints"
    meta = CheckpointStorage(str(chk)).latest()          # verified: every task file is there whole
    assert meta is not None and len(meta.tasks) >= 2
    assert os.getcwd() == str(tmp_path)
