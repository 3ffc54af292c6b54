"""One pyflowbuf job across Spark executors: ``SparkCluster``.

``Environment(cluster=SparkCluster(spark, workers=N))`` runs a job the way
``Environment(workers=N)`` does (subtask i of every operator in worker
i % N, pyflowbuf's credit-based TCP exchange between workers, the checkpoint
coordinator, restarts and metrics in the driver), but each worker is a Spark
barrier task on whichever executor Spark picks instead of a forked process.
Spark places the tasks; pyflowbuf moves the records between them.

How one attempt runs:

1. the driver listens for control connections on ``spark.driver.host``
   (``pyflowbuf.cluster.control_channel``: HMAC-SHA256 handshake under a secret drawn
   for this attempt, then MessagePack frames; nothing is unpickled);
2. from a background thread it submits ``N`` barrier tasks under a job tag
   (``sc.range(N, numSlices=N).barrier().mapPartitions(...)``); the job
   (a ``JobDescription``: the settings and the graph) travels in the task
   closure, Spark's own trusted path;
3. each task starts a ``NetworkServer`` on its executor's address, connects
   to the driver, announces the server, receives every worker's address and
   the checkpoint to restore, and runs its share of the job
   (``pyflowbuf.cluster.driver.run_worker``). The task's function is shipped by value and imports pyflowbuf before
   it unpickles the job: executors whose Python lacks it fail the first
   attempt with ``ExecutorEnvironmentError`` naming that Python and the fix;
4. a failure (a task's error, or a control channel that closes early: a
   lost executor or Python worker) cancels the attempt's Spark job by its
   tag; the driver restores the latest complete checkpoint in a new attempt
   with a new secret, up to ``restart_attempts``.

Before anything is submitted the driver refuses, each with a
``ConfigurationError`` naming the setting: dynamic allocation, more workers
than free task slots (``NotEnoughSlotsError``, after waiting up to
``start_timeout`` for executors that register), a function of the job that
cannot be pickled (naming its operator and the variable at fault), ``tls=False``
while Spark encrypts its traffic (``allow_unencrypted=True`` opts out, with a
warning; by default TLS turns on by itself then: see ``SparkCluster``), a local checkpoint, sink or source path (not an fsspec URL) with a
master whose executors may run on other hosts, and a ``memory://`` location
(one process's memory) with any master.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import io
import json
import logging
import os
import re
import socket
import sys
import sysconfig
import threading
import time
import types
import uuid

from pyflowbuf import errors
from pyflowbuf._version import __version__
from pyflowbuf.api import Environment
from pyflowbuf.config import MetricsConfig
from pyflowbuf.cluster.control_channel import ControlListener, connect_control
from pyflowbuf.net.protocol import new_secret
from pyflowbuf.net.tls import AttemptTLS
from pyflowbuf.spark.tls import choose_tls, tls_setting
from pyflowbuf.connectors import filesystems as fsx
from pyflowbuf.cluster.locations import file_locations
from pyflowbuf.cluster.driver import CANCEL_GRACE_S, EXIT_STATUS_WAIT_S, RemoteLauncher
from pyflowbuf.runtime.execution import JobExecution
from pyflowbuf.cluster.worker import run_worker

log = logging.getLogger("pyflowbuf.spark")

# while the driver waits for executors to register: a log line this often
SLOTS_PROGRESS_S = 5.0
# after cancelJobsWithTag: how long the driver waits for Spark to end the job
CANCEL_WAIT_S = 30.0
# what of Spark's error message goes into a worker's failure
SPARK_ERROR_LIMIT = 8 * 1024
# a worker's printed text goes to the driver by whole lines, or in pieces of this size
OUTPUT_CHUNK = 64 * 1024
# after an attempt: how long the driver waits for the rest of the workers' output
OUTPUT_WAIT_S = 5.0


def _settings(env) -> dict:
    """The Environment's constructor arguments, as it holds them now."""
    return {k: v for k, v in env.configuration().items() if k != "cluster"}


class JobDescription:
    """What a worker on another host needs to run its part of a job: the
    Environment's settings and its graph (the nodes, with their functions).
    An Environment itself does not travel (it holds a lock and the state of
    a running job); this does, pickled with cloudpickle inside Spark's task
    closure. ``environment()`` rebuilds an Environment around the graph on
    the executor, listening on the executor's address. (A ``SparkCluster``
    ships the job's ``JobSpec`` instead, which the runtime runs as it is:
    this class stays for callers that want an Environment back.)

    Example::

        desc = JobDescription(env, workers=2)
        worker_env = desc.environment(bind_host="10.0.0.7")
    """

    def __init__(self, env, workers: int):
        self.settings = _settings(env)
        self.nodes = env.nodes
        self.workers = workers

    def environment(self, bind_host: str) -> Environment:
        # the driver serves metrics (log, Prometheus, live view) for the whole job
        # ... and the control endpoint: a worker's part of the job has none
        settings = {**self.settings, "workers": None, "control_port": None,
                    "network": self.settings["network"].replace(bind_host=bind_host),
                    "metrics": MetricsConfig(interval=self.settings["metrics"].interval)}
        env = Environment(**settings)
        env.nodes = self.nodes
        return env


def _local_master(master: str) -> bool:
    """True when every executor runs on the driver's host."""
    return master.startswith("local")


# ---- what runs first on an executor

# The barrier task's function, compiled here under a module name no executor
# can import, so that cloudpickle ships it by value: it runs on an executor
# whose Python lacks pyflowbuf, and says so (with that Python) instead of
# failing inside Spark's unpickling of the task, 60 lines down a Py4J trace.
_ENTRY_SOURCE = """
def barrier_task(payload, driver_version, marker):
    def run(iterator):
        import json, pickle, sys
        problem = None
        try:
            import pyflowbuf
            found = getattr(pyflowbuf, "__version__", None)
            if found != driver_version:
                problem = {"error": "it has pyflowbuf %s at %s, the driver %s" % (
                    found, getattr(pyflowbuf, "__file__", "?"), driver_version)}
            else:
                task = pickle.loads(payload)
        except ImportError as exc:
            problem = {"error": "%s: %s" % (type(exc).__name__, exc)}
        if problem is not None:
            problem.update(python=sys.executable, version=sys.version.split()[0])
            raise RuntimeError(marker + json.dumps(problem))
        return task(iterator)
    return run
"""
_ENTRY_MODULE = "pyflowbuf_spark_task_entry"     # never importable: by value
_ENTRY_MARKER = "pyflowbuf executor check: "


def _entry_function():
    namespace = {"__name__": _ENTRY_MODULE}
    exec(compile(_ENTRY_SOURCE, f"<{_ENTRY_MODULE}>", "exec"), namespace)  # noqa: S102 - our own constant source
    return namespace["barrier_task"]


def task_function(task, dumps=None):
    """The function Spark runs in each barrier task: ``task`` (pickled here,
    loaded on the executor once pyflowbuf imports there)."""
    if dumps is None:
        dumps = _spark_dumps()
    return _entry_function()(dumps(task), __version__, _ENTRY_MARKER)


def _spark_dumps():
    from pyspark import cloudpickle

    return cloudpickle.dumps


def executor_problem(text: str, python_exec: str | None = None):
    """An ExecutorEnvironmentError when Spark's error ``text`` says the
    executors' Python cannot run pyflowbuf's tasks; else None."""
    driver_python = f" (the driver asked for PYSPARK_PYTHON={python_exec!r})" if python_exec else ""
    fix = ("Set PYSPARK_PYTHON, before the SparkSession starts, to a Python that has pyflowbuf and its "
           "dependencies (numpy, fsspec, msgpack; pyarrow for Arrow jobs) on every executor host, or ship the package "
           "with the job: spark.submit.pyFiles / sc.addPyFile of a pyflowbuf wheel built for the executors' "
           "platform, or spark.archives of a conda-pack or venv-pack archive with PYSPARK_PYTHON pointing "
           "into it (docs/spark-cluster.md, \"Troubleshooting\")")
    m = re.search(re.escape(_ENTRY_MARKER) + r"(\{.*?\})\s*$", text, re.M)
    if m:
        try:
            found = json.loads(m.group(1))
        except ValueError:
            found = {}
        return errors.ExecutorEnvironmentError(
            f"Spark's executors cannot run pyflowbuf: their Python {found.get('python', '?')} "
            f"(Python {found.get('version', '?')}){driver_python} cannot import it "
            f"({found.get('error', '?')}). {fix}")
    m = re.search(r"Cannot run program \"([^\"]*)\"[^\n]*", text)
    if m:
        return errors.ExecutorEnvironmentError(
            f"Spark's executors cannot start their Python {m.group(1)!r}{driver_python}: {m.group(0)}. {fix}")
    m = re.search(r"Python in worker has different version[^\n]*", text)
    if m:
        return errors.ExecutorEnvironmentError(
            f"Spark's executors run another Python than the driver{driver_python}: {m.group(0)}. {fix}")
    return None


# ---- functions that cannot travel to the executors

def _global_names(code):
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _parts(obj):
    """(how it is reached, object) of what pickling ``obj`` pickles too."""
    if isinstance(obj, types.FunctionType):
        code = obj.__code__
        for name, cell in zip(code.co_freevars, obj.__closure__ or ()):
            try:
                yield f"closure variable {name!r}", cell.cell_contents
            except ValueError:      # an empty cell
                pass
        for name in sorted(_global_names(code)):
            if name in obj.__globals__ and not isinstance(obj.__globals__[name], types.ModuleType):
                yield f"global {name!r}", obj.__globals__[name]
        for i, value in enumerate(obj.__defaults__ or ()):
            yield f"default argument {i}", value
        for name, value in (obj.__kwdefaults__ or {}).items():
            yield f"default of {name!r}", value
    elif isinstance(obj, types.MethodType):
        yield "its object (self)", obj.__self__
        yield "its function", obj.__func__
    elif isinstance(obj, functools.partial):
        yield "its function", obj.func
        for i, value in enumerate(obj.args):
            yield f"argument {i}", value
        for name, value in obj.keywords.items():
            yield f"argument {name!r}", value
    elif isinstance(obj, dict):
        for k, value in list(obj.items())[:1000]:
            yield f"item {k!r}", value
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, value in enumerate(list(obj)[:1000]):
            yield f"item {i}", value
    elif not isinstance(obj, (type, types.ModuleType)) and isinstance(getattr(obj, "__dict__", None), dict) \
            and not _library_object(obj):
        for name, value in list(vars(obj).items()):
            yield f"attribute {name!r}", value


def _library_object(obj) -> bool:
    """An object of an installed library or the standard library (a
    SparkSession, a socket): named as it is, not taken apart."""
    module = sys.modules.get(type(obj).__module__)
    path = os.path.realpath(getattr(module, "__file__", None) or "")
    if not path or (type(obj).__module__ or "").startswith("pyflowbuf"):
        return False
    paths = sysconfig.get_paths()
    roots = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return any(path.startswith(root + os.sep) for root in roots)


def _pickle_error(obj, dumps):
    try:
        dumps(obj)
    except Exception as exc:  # noqa: BLE001 - whatever pickling raises is the answer
        return exc
    return None


def _describe_function(fn) -> str:
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def _user_code(obj) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return not (module == "pyflowbuf" or module.startswith("pyflowbuf."))


def unpicklable(nodes, dumps):
    """ConfigurationError naming the first operator of ``nodes`` with a
    function that cannot be pickled for the executors, the function, the
    variable it reaches that is at fault and the fix; None if all pickle."""
    for node in nodes:
        parts = [("its key_by function", inp.key_fn) for inp in node.inputs if inp.key_fn is not None]
        parts += [(f"its {name}", value) for name, value in vars(node).items()
                  if name not in ("inputs", "consumers", "collect_parts")]
        for what, value in parts:
            exc = _pickle_error(value, dumps)
            if exc is None:
                continue
            path, obj, seen = [(what, value)], value, {id(value)}
            while len(path) < 12:
                for how, part in _parts(obj):
                    if id(part) in seen:
                        continue
                    seen.add(id(part))
                    inner = _pickle_error(part, dumps)
                    if inner is not None:
                        path.append((how, part))
                        obj, exc = part, inner
                        break
                else:
                    break
            return errors.ConfigurationError(_unpicklable_text(node, path, exc))
    return None


def _unpicklable_text(node, path, exc):
    # the user's function nearest the culprit, and how it reaches it
    fn_at = max((i for i, (_, o) in enumerate(path[:-1])
                 if callable(o) and hasattr(o, "__code__") and _user_code(o)), default=None)
    culprit = path[-1][1]
    kind = f"{type(culprit).__module__}.{type(culprit).__qualname__}".replace("builtins.", "")
    if fn_at is not None:
        fn = path[fn_at][1]
        what = "its key_by function" if path[0][0] == "its key_by function" and fn_at == 0 else "its function"
        via = " -> ".join(how for how, _ in path[fn_at + 1:])
        where = f"{what} {_describe_function(fn)}: {via} holds a {kind}"
    else:
        where = " -> ".join(how for how, _ in path) + f" holds a {kind}"
    spark = "pyspark" in kind.lower() or "py4j" in kind.lower()
    fix = ("a SparkSession, SparkContext or DataFrame exists only in the driver: use its data instead "
           "(collect() it, or broadcast a value), not the object" if spark else
           "create such an object inside the function or in an operator's open() (on the executor), "
           "or pass plain values (numbers, strings, lists, dicts)")
    return (f"operator {node.name!r} cannot be shipped to Spark's executors: {where}, which cannot be "
            f"pickled ({type(exc).__name__}: {exc}); {fix}")


class SparkCluster:
    """Run a job's workers as Spark barrier tasks: pass it as
    ``Environment(cluster=...)``.

    Parameters
    ----------
    spark : the SparkSession (or its SparkContext) whose executors run the job.
    workers : worker tasks; subtask i of every operator runs in worker i % workers.
    task_cpus : cores each worker task asks Spark for (stage-level scheduling
        when it differs from ``spark.task.cpus``).
    port_range : ``(first, last)``: the ports the exchange's servers on the
        executors and the driver's control listener may take (for firewalls);
        None: any free port.
    start_timeout : seconds for every worker task to start and report to the
        driver; after a failure, for the new attempt to start. Also how long
        the driver waits for enough free task slots (executors that are still
        registering) before it gives up with ``NotEnoughSlotsError``.
    tls : mutual TLS 1.3 for the exchange, the control channel and the
        tasks' output relays. None (default): on by itself when Spark
        encrypts (``spark.network.crypto.enabled``, ``spark.ssl.enabled``,
        ``spark.ssl.rpc.enabled``), else ``Environment(tls=...)``; True: on
        (the job's own CA, one certificate per attempt); a
        ``pyflowbuf.net.TLSConfig``: on, with your files; False: off.
    allow_unencrypted : opt out of encryption while Spark's is on: the
        records cross the network in the clear (authenticated), with a
        warning. Needed for ``tls=False`` on an encrypting cluster.

    Example::

        import pyflowbuf as fb
        from pyflowbuf.spark import SparkCluster

        env = fb.Environment(parallelism=2, cluster=SparkCluster(spark, workers=2))
        counts = (env.from_collection(words).key_by(lambda w: w)
                     .reduce(lambda a, b: a, name="first").collect())
        env.execute()
    """

    def __init__(self, spark, workers: int, *, task_cpus: int = 1, port_range: tuple | None = None,
                 start_timeout: float = 60.0, allow_unencrypted: bool = False, tls=None):
        self.sc = getattr(spark, "sparkContext", spark)
        for name, value in (("workers", workers), ("task_cpus", task_cpus)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise errors.ConfigurationError(f"SparkCluster: {name} must be an int >= 1, got {value!r}")
        if port_range is not None:
            ok = (isinstance(port_range, (tuple, list)) and len(port_range) == 2
                  and all(isinstance(p, int) and not isinstance(p, bool) for p in port_range)
                  and 1 <= port_range[0] <= port_range[1] <= 65535)
            if not ok:
                raise errors.ConfigurationError(
                    f"SparkCluster: port_range must be (first, last) ports in 1..65535, got {port_range!r}")
            port_range = (int(port_range[0]), int(port_range[1]))
        if isinstance(start_timeout, bool) or not isinstance(start_timeout, (int, float)) or not start_timeout > 0:
            raise errors.ConfigurationError(f"SparkCluster: start_timeout must be seconds > 0, got {start_timeout!r}")
        self.workers = workers
        self.task_cpus = task_cpus
        self.port_range = port_range
        self.start_timeout = float(start_timeout)
        self.allow_unencrypted = bool(allow_unencrypted)
        self.tls = None if tls is None else (tls if tls is False else tls_setting(tls))

    def __repr__(self):
        return f"SparkCluster(workers={self.workers}, master={self.sc.master!r})"

    def effective_tls(self, job_spec):
        """The job's TLS setting on this cluster (None: off); see ``tls``."""
        return choose_tls(self.tls, job_spec.tls, self.allow_unencrypted, self._conf)

    def execution(self, job_spec) -> JobExecution:
        """The execution of the job ``job_spec`` (a ``JobSpec``: Environment
        calls this at execute()): the one ``JobExecution``, placing its
        subtasks as Spark barrier tasks (``SparkLauncher``)."""
        return JobExecution(job_spec, launcher=SparkLauncher(self, job_spec))

    # ---- the checks before submission ----
    def _conf(self, key, default=None):
        return self.sc.getConf().get(key, default)

    def check(self, job_spec) -> None:
        """Raise ConfigurationError naming the setting when the job cannot
        run as asked; nothing is submitted before this passed."""
        if self._conf("spark.dynamicAllocation.enabled", "false").lower() == "true":
            raise errors.ConfigurationError(
                "spark.dynamicAllocation.enabled=true: barrier tasks cannot run with dynamic allocation "
                "(Spark refuses them, SPARK-24942); run the pyflowbuf job on a session without it")
        self.effective_tls(job_spec)
        master = self._conf("spark.master", self.sc.master)
        for what, location in file_locations(job_spec):
            if fsx.is_process_local(location):
                raise errors.ConfigurationError(
                    f"{what}: {location!r} is in the driver's memory (memory://), and the Spark tasks run in "
                    "other processes: give a local path (local masters only) or an fsspec URL every "
                    "executor reaches")
            if not _local_master(master) and not fsx.is_url(location):
                raise errors.ConfigurationError(
                    f"{what}: {location!r} is a local path, but with master {master!r} the workers may run on "
                    "other hosts, which cannot reach it: give an fsspec URL every host reaches (s3://, "
                    "gs://, hdfs://, abfs://; file:///... names a shared mount, which must then be mounted "
                    "at that path on every host)")
        self._check_slots()

    def free_slots(self) -> int:
        """Task slots for tasks of ``task_cpus`` cores that no task uses now."""
        jsc = self.sc._jsc.sc()
        spark_cpus = int(self._conf("spark.task.cpus", "1"))
        try:
            profile = jsc.resourceProfileManager().defaultResourceProfile()
            slots = int(jsc.maxNumConcurrentTasks(profile))
        except Exception:  # noqa: BLE001 - an internal API another Spark version may lack
            slots = int(self.sc.defaultParallelism) // spark_cpus
        slots = slots * spark_cpus // self.task_cpus
        running = 0
        tracker = jsc.statusTracker()
        for info in tracker.getExecutorInfos():
            running += int(info.numRunningTasks())
        return slots - running * max(1, self.task_cpus // spark_cpus)

    def expected_slots(self) -> int | None:
        """The task slots (for tasks of ``task_cpus`` cores) the cluster has
        once all its executors registered, where the settings say: a local
        master, ``local-cluster[n,cores,mem]``, or ``spark.executor.instances``
        with ``spark.executor.cores``; None when they do not."""
        master = self._conf("spark.master", self.sc.master) or ""
        per_task = self.task_cpus      # the tasks' own resource profile when it differs from spark.task.cpus
        m = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]", master)
        if m:
            return int(m.group(1)) * (int(m.group(2)) // per_task)
        m = re.fullmatch(r"local(?:\[\s*(\d+|\*)\s*(?:,\s*\d+\s*)?\])?", master)
        if m:
            cores = m.group(1)
            cores = 1 if cores is None else (os.cpu_count() or 1) if cores == "*" else int(cores)
            return cores // per_task
        instances, cores = self._conf("spark.executor.instances"), self._conf("spark.executor.cores")
        if instances and cores and instances.isdigit() and cores.isdigit():
            return int(instances) * (int(cores) // per_task)
        return None

    def _check_slots(self) -> None:
        expected = self.expected_slots()
        if expected is not None and expected < self.workers:
            master = self._conf("spark.master", self.sc.master)
            raise errors.NotEnoughSlotsError(
                f"SparkCluster(workers={self.workers}): the cluster (master {master!r}) has {expected} task "
                f"slots for tasks of task_cpus={self.task_cpus}, and all workers must run at once (barrier "
                "tasks); lower workers, or give the session more executors or spark.executor.cores")
        self.wait_for_slots("the job cannot start")

    def wait_for_slots(self, what: str) -> None:
        """Until ``workers`` task slots are free: the executors of a session
        just started, or of a real cluster, register one by one, and a lost
        one comes back. Waits up to ``start_timeout``, logging its progress;
        then NotEnoughSlotsError naming the slots found and needed."""
        started = time.monotonic()
        deadline = started + self.start_timeout
        next_log = started + SLOTS_PROGRESS_S
        free = self.free_slots()
        while free < self.workers:
            now = time.monotonic()
            if now >= deadline:
                raise errors.NotEnoughSlotsError(
                    f"SparkCluster(workers={self.workers}): {what}: the cluster has {max(free, 0)} free task "
                    f"slots for tasks of task_cpus={self.task_cpus} and needs {self.workers} (barrier tasks "
                    f"start all at once); no more executors registered or became free within start_timeout="
                    f"{self.start_timeout:g} s. Give the executors longer (SparkCluster(start_timeout=...)), "
                    "lower workers, or give the session more executors or spark.executor.cores")
            if now >= next_log:
                log.info("SparkCluster(workers=%d): waiting for executors: %d of %d task slots free after "
                         "%.0f s (start_timeout=%g s)", self.workers, max(free, 0), self.workers, now - started,
                         self.start_timeout)
                next_log = now + SLOTS_PROGRESS_S
            time.sleep(0.25)
            free = self.free_slots()


class _TaskSpec:
    """What one attempt's barrier tasks carry (pickled into the closure)."""

    def __init__(self, description, driver, secret, attempt, port_range, start_timeout, allow_pickle,
                 cwd=None, workers=None, tls=None):
        self.description = description      # the JobSpec, which each task runs its part of
        self.workers = workers
        self.tls = tls          # the attempt's TLSConfig (the tasks' closure, as the secret), or None
        # With a local master the executors share the driver's host and files:
        # the job's relative paths (checkpoint_dir, file sinks and sources)
        # mean what they mean in the driver, as with workers=N. (A non-local
        # master refuses local paths before submission.)
        self.cwd = cwd
        self.driver = driver
        self.secret = secret
        self.attempt = attempt
        self.port_range = port_range
        self.start_timeout = start_timeout
        self.allow_pickle = allow_pickle

    def __call__(self, iterator):
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        for _ in iterator:
            pass
        yield run_barrier_task(self, ctx.partitionId(), [t.address for t in ctx.getTaskInfos()])

    def task_addresses(self):
        """This barrier task's index and every task's executor address."""
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        return ctx.partitionId(), [t.address for t in ctx.getTaskInfos()]


def control_secret(secret: bytes, attempt: int) -> bytes:
    """The control channel's secret of one attempt (the exchange's is
    ``attempt_secret``): a connection of another attempt fails the handshake."""
    return hmac.new(secret, b"pyflowbuf control %d" % attempt, hashlib.sha256).digest()


def run_barrier_task(spec, w, addresses, host=None):
    """Worker ``w`` of a job, in a Spark Python worker: returns its pid once
    its share of the job ended, leaving nothing of it behind."""
    if host is None:
        host = addresses[w].rsplit(":", 1)[0]
    host = socket.gethostbyname(host) if host and not host[0].isdigit() and ":" not in host else host
    info = {"executor": addresses[w], "host": host, "pid": os.getpid()}
    cwd = os.getcwd()
    if getattr(spec, "cwd", None) is not None:
        os.chdir(spec.cwd)      # back in the finally: Spark reuses this Python worker
    try:
        _run_barrier_task(spec, w, host, info)
    finally:
        os.chdir(cwd)
    return os.getpid()


class _ForwardedOutput(io.TextIOBase):
    """A barrier task's ``sys.stdout`` / ``sys.stderr`` while it runs: what
    the job's code prints (and warnings, a thread's uncaught traceback,
    whatever is written to ``sys.stdout``/``sys.stderr``) goes to the driver, whole lines at a time, over the
    task's output channel, where the caller sees it as with ``workers=N``.
    If the driver cannot be reached it goes where it went before (the
    executor's log)."""

    def __init__(self, channel, name, lock, before):
        super().__init__()
        self._channel = channel
        self._name = name
        self._lock = lock       # one per channel: frames of stdout and stderr never interleave
        self._before = before
        self._parts: list = []
        self._size = 0

    @property
    def encoding(self):
        return "utf-8"

    def writable(self):
        return True

    def fileno(self):
        # C-level writers (faulthandler) write where the stream wrote before
        return self._before.fileno()

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        with self._lock:
            self._parts.append(text)
            self._size += len(text)
            if "\n" in text or self._size >= OUTPUT_CHUNK:
                self._send()
        return len(text)

    def flush(self):
        with self._lock:
            self._send()

    def _send(self):
        text = "".join(self._parts)
        self._parts, self._size = [], 0
        if not text:
            return
        try:
            self._channel.send((self._name, text))
        except Exception:  # noqa: BLE001 - the driver is gone: the executor's own log keeps it
            try:
                self._before.write(text)
            except Exception:  # noqa: BLE001
                pass


def _run_barrier_task(spec, w, host, info):
    secret = control_secret(spec.secret, spec.attempt)
    tls = spec.tls
    output = connect_control(spec.driver, secret, timeout=spec.start_timeout, allow_pickle=False, tls=tls)
    saved = sys.stdout, sys.stderr
    try:
        output.send((spec.attempt, ("output", w)))
        lock = threading.Lock()
        sys.stdout = _ForwardedOutput(output, "stdout", lock, saved[0])
        sys.stderr = _ForwardedOutput(output, "stderr", lock, saved[1])
        conn = connect_control(spec.driver, secret, timeout=spec.start_timeout, allow_pickle=spec.allow_pickle,
                               tls=tls)
        try:
            conn.send((spec.attempt, ("hello", w, info)))
            job = spec.description.for_worker(bind_host=host)
            run_worker(job, w, spec.workers, spec.secret, conn, spec.attempt, host=host,
                       port_range=spec.port_range, info=info, join_control=True, tls=tls)
        finally:
            conn.close()
    finally:
        forwarded = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = saved      # Spark reuses this Python worker
        for stream in forwarded:
            if isinstance(stream, _ForwardedOutput):
                stream.flush()
        output.close()


class SparkLauncher(RemoteLauncher):
    """Starts a job's workers as Spark barrier tasks (see the module's
    docstring); the execution drives them as it drives forked ones
    (``RemoteLauncher`` holds the driver's side of them)."""

    what = "Spark barrier tasks"

    def __init__(self, cluster: SparkCluster, job_spec):
        self.cluster = cluster
        self.job_spec = job_spec
        self.sc = cluster.sc
        self.workers = cluster.workers
        self.start_timeout = cluster.start_timeout
        # the job travels as its JobSpec, pickled (cloudpickle) into the tasks' closure
        self.description = job_spec
        self.job_id = uuid.uuid4().hex[:12]
        self.tasks: dict = {}           # worker -> {executor, host, pid} of the current attempt
        self.attempts: list = []        # per attempt: its job tag
        self._listener = None
        self._thread = None
        self._tag = None
        self._error = None              # the Spark job's error, as text
        self._problem = None            # an ExecutorEnvironmentError read from that error
        self._lost_reported = False
        self._lock = threading.Lock()
        self._relays: list = []         # (output channel, thread) of the current attempt's workers

    def check(self, execution):
        super().check(execution)
        self.cluster.check(self.job_spec)
        execution.tls = AttemptTLS(self.cluster.effective_tls(self.job_spec), self.job_spec.name)
        # the job travels pickled in the tasks' closure: a function that cannot
        # be pickled is named here, with its operator, before anything is submitted
        dumps = _spark_dumps()
        exc = _pickle_error(self.description, dumps)
        if exc is not None:
            raise unpicklable(self.job_spec.nodes, dumps) or errors.ConfigurationError(
                f"the job cannot be pickled for Spark's executors: {type(exc).__name__}: {exc}")

    # ---- one attempt ----
    def _driver_host(self) -> str:
        host = self.sc.getConf().get("spark.driver.host", None) or "127.0.0.1"
        return host

    def _start_listener(self):
        host = self._driver_host()
        port_range = self.cluster.port_range
        ports = [0] if port_range is None else range(port_range[0], port_range[1] + 1)
        for port in ports:
            listener = ControlListener(new_secret(), host=host, port=port, allow_pickle=self.job_spec.allow_pickle)
            try:
                listener.start()
            except OSError:
                listener.close()
                continue
            return listener
        raise errors.PortUnavailableError(
            f"no free port in port_range={port_range!r} on {host} for the driver's control listener")

    def _wait_for_slots(self, attempt):
        """After a failure the lost executor may still be coming back: a
        barrier job submitted without the slots would fail (or wait) in Spark."""
        self.cluster.wait_for_slots(f"attempt {attempt} cannot start (no executor came back within "
                                    f"start_timeout={self.start_timeout:g} s)")

    def start_workers(self, attempt) -> dict:
        if attempt > 0:
            self._wait_for_slots(attempt)
        if self._listener is None:
            self._listener = self._start_listener()
        secret = self.execution.secret
        tls = self.execution.tls.for_attempt(attempt)
        self._listener.set_secret(control_secret(secret, attempt), tls=tls)
        spec = _TaskSpec(self.description, self._listener.address, secret, attempt, self.cluster.port_range,
                         self.start_timeout, self.job_spec.allow_pickle,
                         cwd=os.getcwd() if _local_master(self.sc.master) else None, workers=self.workers, tls=tls)
        tag = f"pyflowbuf-{self.job_id}-attempt-{attempt}"
        self._tag = tag
        self.attempts.append(tag)
        self._error = None
        self._problem = None
        self._lost_reported = False
        self.tasks = {}
        self._thread = threading.Thread(target=self._run_spark_job, args=(spec, tag, attempt),
                                        name="pyflowbuf: spark job", daemon=True)
        self._thread.start()
        conns: dict = {}
        try:
            deadline = time.monotonic() + self.start_timeout
            while len(conns) < self.workers:
                if not self._thread.is_alive():
                    if self._problem is not None:
                        raise self._problem
                    raise errors.JobFailedError(
                        f"the Spark job of attempt {attempt} ended before all {self.workers} workers started: "
                        f"{self._error or 'no error reported'}")
                ch = self._listener.accept(min(deadline, time.monotonic() + 0.5))
                if ch is None:
                    if time.monotonic() >= deadline:
                        raise errors.FlowBufError(
                            f"{self.workers - len(conns)} of {self.workers} Spark worker tasks did not start "
                            f"within start_timeout={self.start_timeout} s (running: {sorted(conns.values())})")
                    continue
                if not ch.poll(self.start_timeout):
                    ch.close()
                    continue
                try:
                    sent_attempt, msg = ch.recv()
                except (EOFError, errors.ProtocolError):
                    ch.close()
                    continue
                if msg[0] == "output" and sent_attempt == attempt:
                    self._relay(ch, msg[1])
                    continue
                w = msg[1] if msg[0] == "hello" else None
                if sent_attempt != attempt or not isinstance(w, int) or not 0 <= w < self.workers \
                        or w in conns.values():
                    ch.close()
                    continue
                conns[ch] = w
                self.tasks[w] = dict(msg[2])
            return conns
        except BaseException:
            for ch in conns:
                ch.close()
            self.stop_workers(graceful=False)
            raise

    def _relay(self, ch, w):
        """Print what worker ``w`` prints, on the ``sys.stdout`` / ``sys.stderr``
        the caller has at that moment (a notebook's, a redirect_stdout)."""
        def run():
            try:
                while True:
                    name, text = ch.recv()
                    out = sys.stderr if name == "stderr" else sys.stdout
                    if out is not None and isinstance(text, str):
                        out.write(text)
                        out.flush()
            except Exception:  # noqa: BLE001 - the end of the channel, or a caller's stream that broke
                pass

        thread = threading.Thread(target=run, name=f"pyflowbuf: output of worker {w}", daemon=True)
        thread.start()
        self._relays.append((ch, thread))

    def _end_relays(self):
        """Every worker's output has arrived (its task closed the channel) or,
        after OUTPUT_WAIT_S, is given up."""
        relays, self._relays = self._relays, []
        deadline = time.monotonic() + OUTPUT_WAIT_S
        for ch, thread in relays:
            thread.join(max(0.0, deadline - time.monotonic()))
            ch.close()

    def _run_spark_job(self, spec, tag, attempt):
        sc = self.sc
        try:
            sc.addJobTag(tag)
            sc.setInterruptOnCancel(True)
            sc.setJobDescription(f"pyflowbuf job {self.job_spec.name!r}, attempt {attempt}: "
                                 f"{self.workers} workers")
            self.submit(spec)
        except BaseException as exc:  # noqa: BLE001 - the driver reports it with the workers' failure
            text = str(exc)
            self._problem = executor_problem(text, getattr(sc, "pythonExec", None))
            if len(text) > SPARK_ERROR_LIMIT:
                text = text[:SPARK_ERROR_LIMIT] + "\n[... cut]"
            self._error = f"{type(exc).__name__}: {text}"
        finally:
            try:
                sc.removeJobTag(tag)
                sc.setJobDescription(None)
            except Exception:  # noqa: BLE001 - the session may be stopping
                pass

    def submit(self, spec):
        """Run one attempt's barrier tasks; returns when they all ended (in
        the launcher's background thread, under the attempt's job tag)."""
        sc = self.sc
        rdd = sc.range(self.workers, numSlices=self.workers)
        if self.cluster.task_cpus != int(sc.getConf().get("spark.task.cpus", "1")):
            from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

            profile = ResourceProfileBuilder().require(TaskResourceRequests().cpus(self.cluster.task_cpus)).build
            rdd = rdd.withResources(profile)
        rdd.barrier().mapPartitions(task_function(spec)).collect()

    def exit_report(self, w):
        """Why worker ``w`` closed its control channel without a word: a lost
        executor or Python worker; Spark's error, once the job has ended."""
        thread = self._thread
        if thread is not None:
            thread.join(EXIT_STATUS_WAIT_S)
        task = self.tasks.get(w, {})
        text = (f"worker {w} (Spark task on executor {task.get('executor', '?')}, pid {task.get('pid', '?')}) "
                "lost its control channel to the driver: its Python worker or executor ended")
        return text, (f"Spark reported: {self._error}" if self._error else "")

    def stop_workers(self, graceful: bool):
        """The attempt's Spark job has ended when this returns: waited for
        (the workers were told to stop, or finished), then cancelled by its tag."""
        thread = self._thread
        if thread is None:
            return
        if graceful:
            thread.join(CANCEL_GRACE_S)
        if thread.is_alive():
            try:
                self.sc.cancelJobsWithTag(self._tag)
            except Exception:  # noqa: BLE001 - a stopped session: its jobs are gone
                pass
            thread.join(CANCEL_WAIT_S)

    def lost(self):
        """The attempt's Spark job ended with an error (an executor lost,
        the stage aborted) although some control channels are still open."""
        thread = self._thread
        if thread is None or thread.is_alive() or self._error is None or self._lost_reported:
            return None
        self._lost_reported = True
        return (f"the Spark job of the attempt ({self._tag}) failed", f"Spark reported: {self._error}")

    def forget_attempt(self):
        self._end_relays()
        self._thread = None

    def close_workers(self):
        self.stop_workers(graceful=False)
        self._end_relays()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    @property
    def refused(self) -> int:
        """Control connections refused at the handshake (a wrong secret)."""
        return 0 if self._listener is None else self._listener.refused
