"""SparkCluster's errors before and at submission (issue 27): executors whose
Python lacks pyflowbuf, a function that cannot be pickled for them, a
memory:// sink, and the wait for executors that register slowly.

The session of this module is built with ``SparkSession.builder`` as a user
would, with ``PYSPARK_PYTHON`` at a Python of the driver's version that lacks
pyflowbuf's dependencies (the base interpreter of this virtual environment):
the executors cannot import pyflowbuf. The pickling and location checks run
in the driver, before anything is submitted, so they need no working executor.
"""
import logging
import os
import re
import subprocess
import sys
import threading

import pytest

pyspark = pytest.importorskip("pyspark")

import pyflowbuf as fb  # noqa: E402
from pyflowbuf import errors  # noqa: E402
from pyflowbuf.spark import SparkCluster  # noqa: E402
from pyflowbuf.spark import cluster as cluster_mod  # noqa: E402

pytestmark = [pytest.mark.timeout(600)]


def _python_without_pyflowbuf():
    """A Python of the driver's version in which ``import pyflowbuf`` fails
    (with the PYTHONPATH the executors inherit), or None."""
    candidates = [os.path.join(sys.base_prefix, "bin", "python3"), "/usr/bin/python3", "/usr/local/bin/python3"]
    for py in dict.fromkeys(candidates):
        if not os.path.exists(py) or os.path.realpath(py) == os.path.realpath(sys.executable) \
                and sys.prefix == sys.base_prefix:
            continue
        probe = ("import sys\n"
                 f"assert sys.version_info[:2] == {tuple(sys.version_info[:2])!r}\n"
                 "try:\n    import pyflowbuf\nexcept ImportError:\n    sys.exit(0)\nsys.exit(3)\n")
        res = subprocess.run([py, "-c", probe], cwd="/", env=os.environ, capture_output=True, timeout=60)
        if res.returncode == 0:
            return py
    return None


WRONG_PYTHON = _python_without_pyflowbuf()


@pytest.fixture(scope="module")
def spark():
    if WRONG_PYTHON is None:
        pytest.skip("no Python of the driver's version without pyflowbuf on this machine")
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    saved = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = WRONG_PYTHON         # read when the SparkContext starts
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()
    session = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("pyflowbuf-spark-cluster-errors")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.executorEnv.SPARK_LOCAL_IP", "127.0.0.1")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
        if saved is None:
            os.environ.pop("PYSPARK_PYTHON", None)
        else:
            os.environ["PYSPARK_PYTHON"] = saved


def _jobs(spark):
    return len(spark.sparkContext.statusTracker().getJobIdsForGroup(None))


def test_executors_without_pyflowbuf_say_so_in_the_first_line(spark):
    env = fb.Environment(parallelism=2, cluster=SparkCluster(spark, workers=2, start_timeout=300))
    env.from_sequence(0, 100).key_by(lambda x: x % 3).map(lambda x: x, parallelism=2).collect()
    with pytest.raises(errors.ExecutorEnvironmentError) as info:
        env.execute(timeout=300)
    first = str(info.value).splitlines()[0]
    assert first.startswith("Spark's executors cannot run pyflowbuf: their Python " + WRONG_PYTHON)
    assert "cannot import it" in first and "PYSPARK_PYTHON" in first
    assert "spark.submit.pyFiles" in first and "addPyFile" in first and "venv" in first
    assert "Py4J" not in str(info.value) and len(str(info.value).splitlines()) == 1


def test_a_key_function_that_cannot_be_pickled_names_its_operator_and_variable(spark):
    lock = threading.Lock()
    jobs = _jobs(spark)
    env = fb.Environment(parallelism=2, cluster=SparkCluster(spark, workers=2))
    (env.from_sequence(0, 100).key_by(lambda x: x % 3 if lock else 0)
        .reduce(lambda a, b: a + b, name="sums").collect())
    with pytest.raises(errors.ConfigurationError,
                       match=r"operator 'sums' cannot be shipped to Spark's executors: its key_by function "
                             r".*<lambda> \(.*test_spark_cluster_errors.py:\d+\): closure variable 'lock' holds "
                             r"a _thread.lock, which cannot be pickled \(TypeError: .*\); create such an object "
                             r"inside the function or in an operator's open\(\)"):
        env.execute(timeout=120)
    assert _jobs(spark) == jobs         # nothing was submitted


def test_a_function_holding_the_spark_session_names_it(spark):
    jobs = _jobs(spark)
    env = fb.Environment(parallelism=2, cluster=SparkCluster(spark, workers=2))

    def enrich(x):
        return (x, spark.version)

    env.from_sequence(0, 100).map(enrich, name="enrich").collect()
    with pytest.raises(errors.ConfigurationError,
                       match=r"operator 'enrich' cannot be shipped .*enrich \(.*\): closure variable 'spark' "
                             r"holds a pyspark\..*SparkSession.*only in the driver"):
        env.execute(timeout=120)
    assert _jobs(spark) == jobs


def test_a_memory_sink_is_refused_before_submission(spark):
    jobs = _jobs(spark)
    env = fb.Environment(parallelism=2, cluster=SparkCluster(spark, workers=2))
    env.from_sequence(0, 100).write_text("memory://pyflowbuf-spark-errors/out")
    with pytest.raises(errors.ConfigurationError, match=r"sink 'write_text': 'memory:///.*' is in one process's "
                                                        r"memory"):
        env.execute(timeout=120)
    assert _jobs(spark) == jobs


# ---------------------------------------------------------------- waiting for executors (no session)

class _FakeContext:
    """What SparkCluster's slot check reads of a SparkContext: a cluster
    master whose size the settings do not tell."""
    master = "spark://nowhere:7077"

    def getConf(self):
        return self

    def get(self, key, default=None):
        return {"spark.master": self.master}.get(key, default)


@pytest.fixture
def clock(monkeypatch):
    """The module's time.monotonic/time.sleep on a fake clock: the test says
    when executors register, in seconds of that clock, without waiting."""
    now = [1000.0]

    class FakeTime:
        @staticmethod
        def monotonic():
            return now[0]

        @staticmethod
        def sleep(s):
            now[0] += s

    monkeypatch.setattr(cluster_mod, "time", FakeTime)
    return now


def _registering(cluster, clock, at, slots=2):
    """free_slots(): 0 until ``at`` seconds from now, then ``slots``."""
    start = clock[0]
    cluster.free_slots = lambda: slots if clock[0] - start >= at else 0


def test_slow_executors_are_waited_for_up_to_start_timeout_with_progress(clock, caplog):
    cluster = SparkCluster(_FakeContext(), workers=2, start_timeout=60)
    _registering(cluster, clock, at=30)          # a real cluster: 30 s to register its executors
    with caplog.at_level(logging.INFO, logger="pyflowbuf.spark"):
        cluster._check_slots()
    waits = [r.getMessage() for r in caplog.records if "waiting for executors" in r.getMessage()]
    assert len(waits) >= 5 and "0 of 2 task slots free" in waits[0] and "start_timeout=60" in waits[0]


def test_executors_not_there_within_start_timeout_fail_naming_the_slots(clock):
    cluster = SparkCluster(_FakeContext(), workers=2, start_timeout=20)
    _registering(cluster, clock, at=30)
    with pytest.raises(errors.NotEnoughSlotsError,
                       match=r"workers=2\): the job cannot start: the cluster has 0 free task slots .* needs 2 .*"
                             r"start_timeout=20 s"):
        cluster._check_slots()
    assert 20 <= clock[0] - 1000.0 < 21


@pytest.mark.parametrize("master, conf, expected", [
    ("local-cluster[2,1,1024]", {}, 2), ("local-cluster[3, 4, 2048]", {}, 12),
    ("local[4]", {}, 4), ("local", {}, 1), ("local[3,2]", {}, 3),
    ("spark://h:7077", {"spark.executor.instances": "5", "spark.executor.cores": "2"}, 10),
    ("yarn", {}, None)])
def test_the_slots_a_master_will_have(master, conf, expected):
    class Ctx(_FakeContext):
        def get(self, key, default=None):
            return {"spark.master": master, **conf}.get(key, default)
    Ctx.master = master
    assert SparkCluster(Ctx(), workers=1).expected_slots() == expected
    if expected:
        assert SparkCluster(Ctx(), workers=1, task_cpus=2).expected_slots() in (expected // 2, 0)


def test_a_cluster_too_small_is_refused_at_once(clock):
    class Ctx(_FakeContext):
        master = "local-cluster[2,1,1024]"

        def get(self, key, default=None):
            return {"spark.master": self.master}.get(key, default)
    cluster = SparkCluster(Ctx(), workers=3)
    cluster.free_slots = lambda: 0
    with pytest.raises(errors.NotEnoughSlotsError, match=r"workers=3\).*has 2 task slots"):
        cluster._check_slots()
    assert clock[0] == 1000.0           # no wait


@pytest.mark.parametrize("text, says", [
    ('Traceback ...\nRuntimeError: pyflowbuf executor check: {"error": "it has pyflowbuf 0.0.9 at /x/pyflowbuf/'
     '__init__.py, the driver 0.1.0", "python": "/opt/py/bin/python3", "version": "3.11.2"}\n\tat org.apache...',
     r"their Python /opt/py/bin/python3 \(Python 3\.11\.2\) \(the driver asked for PYSPARK_PYTHON='py'\) cannot "
     r"import it \(it has pyflowbuf 0\.0\.9 .*\)\. Set PYSPARK_PYTHON"),
    ('java.io.IOException: Cannot run program "/no/python": error=2, No such file or directory\n\tat ...',
     r"cannot start their Python '/no/python'.*error=2.*Set PYSPARK_PYTHON"),
    ("[PYTHON_VERSION_MISMATCH] Python in worker has different version: 3.10 than that in driver: 3.11, PySpark "
     "cannot run with different minor versions.\n", r"another Python than the driver.*3\.10 than that in driver"),
])
def test_what_spark_says_of_the_executors_python_becomes_one_typed_line(text, says):
    problem = cluster_mod.executor_problem(text, "py")
    assert isinstance(problem, errors.ExecutorEnvironmentError)
    assert len(str(problem).splitlines()) == 1 and re.search(says, str(problem)), str(problem)


def test_other_spark_errors_are_left_as_they_are():
    assert cluster_mod.executor_problem("org.apache.spark.SparkException: Job aborted: task lost", "py") is None
