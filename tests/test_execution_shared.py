"""One copy of a job's coordination for every placement (issue 28, item 2,
first step): ``runtime/execution.py`` holds the coordinator's start, the
restore point and its checks, the restored commits, the sinks' outputs, the
restart decision and the start of a restart; ``JobExecution`` (threads) and
``ClusterExecution`` (forked workers, Spark barrier tasks) use it. The
coordinator and the subtasks reach each other through declared gateways."""
import os
import re

import pytest

import pyflowbuf as fb
from pyflowbuf.checkpoint import CheckpointStorage
from pyflowbuf.checkpoint.errors import KeyKindError
from pyflowbuf import checkpointing as ckpt
from pyflowbuf.checkpointing.gateway import CoordinatorGateway, SubtaskGateway
from pyflowbuf.cluster.driver import ClusterExecution
from pyflowbuf.cluster.worker import WorkerCoordinator
from pyflowbuf.runtime.execution import Execution
from pyflowbuf.runtime.job import JobExecution

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXECUTIONS = ["pyflowbuf/runtime/job.py", "pyflowbuf/cluster/driver.py"]

# each of these calls is made in runtime/execution.py only, for every placement
SHARED = ["RestorePlan(", "restored_commits(", "prepare_outputs(", "restart_point(", "open_directory(",
          "CheckpointCoordinator(", "check_restore_point(", "check_no_other_job(", "restart_failures.append("]


def _calls(path, call):
    text = open(os.path.join(_ROOT, path), encoding="utf-8").read()
    return len(re.findall(r"(?<![\w])" + re.escape(call), text))


@pytest.mark.parametrize("call", SHARED)
def test_the_executions_hold_no_copy_of_the_coordination(call):
    copies = {p: n for p in EXECUTIONS if (n := _calls(p, call))}
    assert not copies, f"{call} is written in {copies}: use the one in runtime/execution.py (Execution)"
    assert _calls("pyflowbuf/runtime/execution.py", call) == 1


@pytest.mark.parametrize("cls", [JobExecution, ClusterExecution])
def test_both_executions_share_one_base_and_are_the_coordinators_gateway(cls):
    assert issubclass(cls, Execution) and issubclass(cls, SubtaskGateway)
    for name in ("trigger_sources", "notify_complete", "abort_checkpoint", "switch_to_unaligned",
                 "stop_after_savepoint"):
        assert getattr(cls, name) is not getattr(SubtaskGateway, name), f"{cls.__name__}.{name} is not its own"
        # written once, in Execution: a placement only says how a call reaches its subtasks (_send)
        assert name not in vars(cls), f"{cls.__name__} has its own {name}"
    assert "_send" in vars(cls)
    # one restart decision: each says only what its placement adds
    for name in ("_should_restart", "_open_checkpointing", "_restore_plan", "_commit_restored",
                 "_stop_checkpointing", "_begin_restart"):
        assert name not in vars(cls), f"{cls.__name__} has its own {name}"


def test_both_coordinators_are_the_gateway_of_the_subtasks(tmp_path):
    env = fb.Environment(checkpoint_interval=60, checkpoint_dir=tmp_path / "chk")
    config = ckpt.CheckpointSettings.from_env(env.job_spec())
    storage = CheckpointStorage(str(tmp_path / "chk"))
    assert isinstance(ckpt.CheckpointCoordinator(config, storage), CoordinatorGateway)
    assert isinstance(WorkerCoordinator(config, storage, send=None, collected=None), CoordinatorGateway)
    assert CoordinatorGateway in WorkerCoordinator.__mro__       # declared, not imitated


def test_the_restart_decision_is_one(tmp_path):
    """Each placement's restart rule, through the one decision."""
    env = fb.Environment(checkpoint_interval=60, checkpoint_dir=tmp_path / "chk", restart_attempts=1)
    env.from_sequence(0, 3).collect()
    job = JobExecution(env.job_spec())
    job.coordinator = object()
    job.failure = ("t", "op", ValueError("x"), "")
    assert job._should_restart()
    job.failure = ("t", "op", KeyKindError("x"), "")
    assert not job._should_restart()                 # a restart would meet it again
    job.failure = ("t", "op", ValueError("x"), "")
    job.restarts = 1
    assert not job._should_restart()                 # restart_attempts spent
    job.restarts, job._user_cancelled = 0, True
    assert not job._should_restart()                 # the user cancelled


def test_a_cluster_restart_decision_keeps_its_rules(tmp_path):
    env = fb.Environment(workers=2, checkpoint_interval=60, checkpoint_dir=tmp_path / "chk", restart_attempts=1)
    env.from_sequence(0, 3).collect()
    ex = ClusterExecution(env.job_spec())
    ex.coordinator = object()
    ex.failure = ("worker 0", "op", "ValueError: x", "")
    assert ex._should_restart()
    ex.failure = ("worker 0", "op", "KeyKindError: x", "")     # a worker's text names its type
    assert not ex._should_restart()
    ex.failure, ex.local = ("worker 0", "op", "ValueError: x", ""), object()
    assert not ex._should_restart()                  # a job with an iterator


def test_no_copy_of_the_restart_decision_is_left_by_name():
    for p in EXECUTIONS:
        text = open(os.path.join(_ROOT, p), encoding="utf-8").read()
        assert not re.search(r"def _should_restart\b|def _stop_checkpointing\b", text), p


@pytest.mark.parametrize("cls", [JobExecution, ClusterExecution])
def test_one_loop_runs_the_attempts_of_every_placement(cls):
    """The restart loop and the job's end (final commit, checkpoints stopped,
    done set) are Execution._watch; a placement says only how an attempt is
    awaited, restarted and let go."""
    assert "_watch" not in vars(cls), f"{cls.__name__} has its own attempt loop"
    for name in ("_await_attempt", "_restart", "_restart_failed", "_no_attempt_follows"):
        assert name in vars(cls), f"{cls.__name__} does not say {name}"


def test_the_thread_placement_is_a_launcher(tmp_path):
    """A job in this process places its subtasks through a ThreadLauncher:
    the coordinator's calls reach the subtasks' mailboxes through it."""
    from pyflowbuf.runtime.launcher import ThreadLauncher

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
    for cls in (JobExecution, ClusterExecution):
        assert "raise_if_failed" not in vars(cls), f"{cls.__name__} has its own raise_if_failed"
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
