"""One execution of a job for every placement (issue 28, item 2):
``runtime/execution.py`` ``JobExecution`` owns the coordination, restarts,
restore and the failure rule, whether its subtasks run on threads here
(``ThreadLauncher``), in forked workers (``WorkerLauncher``) or as Spark
barrier tasks (``SparkLauncher``, checked in test_spark_cluster.py). A
launcher places the subtasks and reports to the execution through one
declared interface (``AttemptEvents``); the coordinator and the subtasks
reach each other through declared gateways."""
import ast
import os
import re

import pytest

import pyflowbuf as fb
from pyflowbuf.checkpoint import CheckpointStorage
from pyflowbuf.checkpoint.errors import KeyKindError
from pyflowbuf import checkpointing as ckpt
from pyflowbuf.checkpointing.gateway import CoordinatorGateway, SubtaskGateway
from pyflowbuf.cluster.driver import ClusterExecution, ForkLauncher, RemoteLauncher, WorkerLauncher
from pyflowbuf.cluster.worker import WorkerCoordinator
from pyflowbuf.runtime.execution import JobExecution as TheExecution
from pyflowbuf.runtime.job import JobExecution
from pyflowbuf.runtime.launcher import AttemptEvents, Launcher, ThreadLauncher

from pipeline_helpers import wait_for

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEMENTS = ["pyflowbuf/runtime/job.py", "pyflowbuf/runtime/launcher.py", "pyflowbuf/cluster/driver.py",
              "pyflowbuf/spark/cluster.py"]

# each of these calls is made in runtime/execution.py only, for every placement
SHARED = ["RestorePlan(", "restored_commits(", "prepare_outputs(", "restart_point(", "open_directory(",
          "CheckpointCoordinator(", "check_restore_point(", "check_no_other_job(", "restart_failures.append("]

# what makes a class an execution: the coordinator's gateway to the subtasks,
# the launcher's events, or a derivation of the execution itself
EXECUTION_ROLE = {"SubtaskGateway", "AttemptEvents", "JobExecution", "Execution", "ClusterExecution"}


def _calls(path, call):
    text = open(os.path.join(_ROOT, path), encoding="utf-8").read()
    return len(re.findall(r"(?<![\w])" + re.escape(call), text))


@pytest.mark.parametrize("call", SHARED)
def test_the_placements_hold_no_copy_of_the_coordination(call):
    copies = {p: n for p in PLACEMENTS if (n := _calls(p, call))}
    assert not copies, f"{call} is written in {copies}: use the one in runtime/execution.py (JobExecution)"
    assert _calls("pyflowbuf/runtime/execution.py", call) == 1


def execution_classes(source: str, path: str = "<source>") -> list:
    """The classes in ``source`` that take the execution's role (derive from
    one of ``EXECUTION_ROLE``), as ``path:name``; Protocol declarations are not."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            bases = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                     if isinstance(b, (ast.Name, ast.Attribute))}
            if bases & EXECUTION_ROLE and "Protocol" not in bases:
                found.append(f"{path}:{node.name}")
    return found


def test_exactly_one_class_takes_the_execution_role():
    found = []
    for folder, _, files in os.walk(os.path.join(_ROOT, "pyflowbuf")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found += execution_classes(open(path, encoding="utf-8").read(), os.path.relpath(path, _ROOT))
    assert found == ["pyflowbuf/runtime/execution.py:JobExecution"], found
    # the scan sees a second one where there is one
    planted = "class SparkExecution(JobExecution):\n    pass\nclass Other(gateway.SubtaskGateway):\n    pass\n"
    assert execution_classes(planted) == ["<source>:SparkExecution", "<source>:Other"]


def test_the_old_names_are_the_one_execution():
    assert JobExecution is TheExecution
    assert ForkLauncher is WorkerLauncher and issubclass(WorkerLauncher, RemoteLauncher)
    assert issubclass(RemoteLauncher, Launcher) and issubclass(ThreadLauncher, Launcher)
    assert issubclass(JobExecution, SubtaskGateway) and issubclass(JobExecution, AttemptEvents)
    env = fb.Environment(workers=2)
    env.from_sequence(0, 3).collect()
    ex = ClusterExecution(env.job_spec())
    assert type(ex) is JobExecution and isinstance(ex.launcher, WorkerLauncher)


def test_threads_and_workers_run_through_the_same_execution_class(tmp_path):
    kinds = {}
    for workers in (None, 2):
        env = fb.Environment(parallelism=2, workers=workers)
        out = env.from_sequence(0, 100).map(lambda x: x * 2).collect()
        env.execute(timeout=60)
        assert sorted(out.result) == [x * 2 for x in range(100)]
        kinds[workers] = (type(env.last_execution), type(env.last_execution.launcher))
    assert kinds == {None: (JobExecution, ThreadLauncher), 2: (JobExecution, WorkerLauncher)}


def test_both_coordinators_are_the_gateway_of_the_subtasks(tmp_path):
    env = fb.Environment(checkpoint_interval=60, checkpoint_dir=tmp_path / "chk")
    config = ckpt.CheckpointSettings.from_env(env.job_spec())
    storage = CheckpointStorage(str(tmp_path / "chk"))
    assert isinstance(ckpt.CheckpointCoordinator(config, storage), CoordinatorGateway)
    assert isinstance(WorkerCoordinator(config, storage, send=None, collected=None), CoordinatorGateway)
    assert CoordinatorGateway in WorkerCoordinator.__mro__       # declared, not imitated


def test_the_restart_decision_is_one(tmp_path):
    """Every placement's restart rule, through the one decision."""
    env = fb.Environment(checkpoint_interval=60, checkpoint_dir=tmp_path / "chk", restart_attempts=1)
    env.from_sequence(0, 3).collect()
    job = JobExecution(env.job_spec())
    job.coordinator = object()
    job.failure = ("t", "op", ValueError("x"), "")
    assert job._should_restart()
    job.failure = ("t", "op", KeyKindError("x"), "")
    assert not job._should_restart()                 # a restart would meet it again
    job.failure = ("worker 0", "op", "KeyKindError: x", "")     # as a worker's text names its type
    assert not job._should_restart()
    job.failure = ("t", "op", ValueError("x"), "")
    job.restarts = 1
    assert not job._should_restart()                 # restart_attempts spent
    job.restarts, job._user_cancelled = 0, True
    assert not job._should_restart()                 # the user cancelled


def test_a_job_with_an_iterator_on_workers_is_not_restarted(tmp_path):
    env = fb.Environment(workers=2, checkpoint_interval=60, checkpoint_dir=tmp_path / "chk", restart_attempts=1)
    env.from_sequence(0, 3).collect()
    ex = ClusterExecution(env.job_spec())
    ex.coordinator = object()
    ex.failure = ("worker 0", "op", "ValueError: x", "")
    assert ex._should_restart()
    env = fb.Environment(workers=2, checkpoint_interval=60, checkpoint_dir=tmp_path / "chk2", restart_attempts=1)
    env.from_sequence(0, 3).to_iterator()
    ex = ClusterExecution(env.job_spec())
    ex.coordinator = object()
    ex.failure = ("worker 0", "op", "ValueError: x", "")
    assert not ex._should_restart()                  # records handed out would be handed out again


def test_one_loop_and_one_coordination_for_every_placement():
    """The restart loop, the restart, the failure rule and the coordinator's
    calls are the execution's; a launcher says only where subtasks run."""
    for cls in (ThreadLauncher, RemoteLauncher, WorkerLauncher):
        for name in ("_watch", "_restart", "_should_restart", "subtask_failed", "raise_if_failed",
                     "trigger_sources", "_open_checkpointing", "_restore_plan", "_commit_restored"):
            assert not hasattr(cls, name), f"{cls.__name__} has {name}"


def test_the_thread_placement_is_a_launcher(tmp_path):
    """A job in this process places its subtasks through a ThreadLauncher:
    the coordinator's calls reach the subtasks' mailboxes through it."""
    env = fb.Environment(checkpoint_interval=60, checkpoint_dir=tmp_path / "chk")
    env.from_sequence(0, 3).collect()
    job = JobExecution(env.job_spec())
    assert isinstance(job.launcher, ThreadLauncher) and job.tasks is job.launcher.tasks

    class Task:
        source = None

        def __init__(self, source=None):
            self.source, self.mails = source, []

        def post(self, fn):
            self.mails.append(("mail", fn))

        def post_control(self, fn):
            self.mails.append(("control", fn))

    src, other = Task(source=object()), Task()
    job.launcher.place([src, other])
    job.trigger_sources(7)
    assert [k for k, _ in src.mails] == ["mail"] and other.mails == []      # a trigger goes to sources only
    job.abort_checkpoint(7)
    job.notify_complete(7)
    job.switch_to_unaligned(8)
    assert [k for k, _ in other.mails] == ["control", "control", "mail"]
    with pytest.raises(ValueError, match="unknown call"):
        job.launcher.send(("bogus", 1))


def test_one_failure_message_for_every_placement(tmp_path):
    """raise_if_failed is written once; the message names the task, the
    operator, what it raised and where its traceback was taken."""
    env = fb.Environment(workers=2)
    env.from_sequence(0, 3).collect()
    job = JobExecution(fb.Environment().job_spec())
    exc = ValueError("bad record")
    job.failure = ("map (1/2)", "map", exc, "TB")
    with pytest.raises(fb.errors.JobFailedError) as info:
        job.raise_if_failed()
    assert str(info.value).endswith("failed: operator 'map' in task 'map (1/2)' raised ValueError: bad record"
                                    "\n\nOriginal traceback:\nTB")
    assert info.value.__cause__ is exc
    ex = ClusterExecution(env.job_spec())
    ex.failure = ("worker 1", "map", "ValueError: bad record", "TB")
    with pytest.raises(fb.errors.JobFailedError) as info:
        ex.raise_if_failed()
    assert str(info.value).endswith("raised ValueError: bad record\n\nOriginal traceback (in the worker process):\nTB")
    assert info.value.__cause__ is None


class _Task:
    """What the execution reads of a subtask that failed."""

    def __init__(self, name, op):
        self.task_name, self.current_operator = name, op


def _raised(exc):
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001
        return e


def test_a_secondary_failure_arriving_first_does_not_hide_the_real_one_in_threads():
    """A subtask here loses its remote peer (secondary) before another one
    raises the error that caused it all: the job fails with the real one."""
    job = JobExecution(fb.Environment().job_spec())
    job._remote_failed(_raised(fb.errors.ConnectionLostError("the peer closed the connection")))
    assert job.cancelled and job.failure[1] == "remote exchange"
    job.task_failed(_Task("map (1/2)", "map"), _raised(ValueError("bad record")))
    job.task_failed(_Task("map (2/2)", "map"), _raised(fb.errors.CancelledError("cancelled")))
    with pytest.raises(fb.errors.JobFailedError, match=r"operator 'map' in task 'map \(1/2\)' raised "
                                                       r"ValueError: bad record"):
        job.raise_if_failed()
    job.task_failed(_Task("map (2/2)", "map"), _raised(KeyError("later")))
    assert "bad record" in str(job.failure[2])          # the first real failure stays


@pytest.mark.parametrize("placement", ["threads", "workers"])
def test_one_failure_rule_for_every_placement(placement):
    spec_env = fb.Environment(workers=2 if placement == "workers" else None)
    spec_env.from_sequence(0, 3).collect()
    spec = spec_env.job_spec()
    ex = ClusterExecution(spec) if placement == "workers" else JobExecution(spec)
    ex.subtask_failed("worker 1", "remote exchange", "ConnectionLostError: lost", "", secondary=True)
    ex.subtask_failed("worker 0", "map", "ValueError: bad record", "TB", secondary=False)
    ex.subtask_failed("worker 1", "map", "CancelledError: cancelled", "", secondary=True)
    assert ex.failure == ("worker 0", "map", "ValueError: bad record", "TB")
    # a secondary failure after a cancel is no failure at all
    ex = ClusterExecution(spec) if placement == "workers" else JobExecution(spec)
    ex.cancel()
    ex.subtask_failed("worker 1", "remote exchange", "ConnectionLostError: lost", "", secondary=True)
    assert ex.failure is None
    # fencing: the word of an attempt already given up starts nothing
    ex = ClusterExecution(spec) if placement == "workers" else JobExecution(spec)
    ex.attempt = 1
    ex.subtask_failed("worker 0", "map", "ValueError: late", "", attempt=0)
    assert ex.failure is None and not ex.cancelled


def test_a_user_cancel_while_threads_run_ends_the_job_without_a_failure():
    env = fb.Environment(parallelism=2)
    env.from_generator(lambda: iter(int, 1)).map(lambda x: x).collect()     # unbounded
    job = env.execute_async()
    assert wait_for(lambda: job.ran and any(t.state == "RUNNING" for t in job.tasks), timeout=30)
    job.cancel()
    job.join(60)
    assert job.failure is None and job.cancelled
