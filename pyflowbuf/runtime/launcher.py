"""Where a job's subtasks run when they run here: ``ThreadLauncher`` places
an attempt's subtasks on threads of this process and is how the execution
starts, joins and cancels them and hands them the coordinator's calls.

The execution (``runtime/execution.py``) owns the job's coordination,
restarts, restore and failure policy; a launcher owns only placement. The
other launchers place subtasks in worker processes: ``WorkerLauncher`` forks
them from a zygote (``pyflowbuf/cluster/driver.py``), ``SparkLauncher`` runs
them as Spark barrier tasks (``pyflowbuf/spark/cluster.py``). Each worker runs
its share of the job on a ``ThreadLauncher`` of its own.

Example::

    from pyflowbuf.runtime.job import JobExecution

    job = JobExecution(environment.job_spec())
    assert job.launcher.what == "subtask threads"
"""
from __future__ import annotations


class ThreadLauncher:
    """One attempt's subtasks (``Subtask`` threads) in this process.

    The coordinator's calls arrive as the messages a worker is sent
    (``("trigger", id, options)``, ``("complete", id)``, ``("abort", id)``,
    ``("unaligned", id)``) and go into the subtasks' mailboxes: a trigger to
    the sources only; a completion and an abort as control mails, which run
    in a task a failed stop-with-savepoint froze (an abort thaws it)."""

    what = "subtask threads"

    def __init__(self):
        self.tasks: list = []       # the current attempt's subtasks (Deployment builds them)
        self.started: list = []     # those whose thread was started

    def place(self, tasks) -> None:
        """The subtasks of a new attempt, not started yet."""
        self.tasks = list(tasks)
        self.started = []

    def launch(self) -> None:
        """Start every subtask's thread; those started are in ``started`` when one fails to."""
        for t in self.tasks:
            t.start()
            self.started.append(t)

    def join(self, timeout=None) -> None:
        """Until every started subtask has ended (``timeout``: per subtask)."""
        for t in self.started:
            t.join(timeout)

    def cancel(self) -> None:
        """Every subtask stops: its blocked waits wake at once and raise inside it."""
        for t in self.tasks:
            t.cancel()

    def send(self, msg) -> None:
        what, checkpoint_id, *rest = msg
        if what == "trigger":
            options = rest[0] if rest else None
            for t in self.tasks:
                if t.source is not None:
                    t.post(lambda t=t: t.trigger_checkpoint(checkpoint_id, options))
        elif what == "complete":
            for t in self.tasks:
                t.post_control(lambda t=t: t.notify_checkpoint_complete(checkpoint_id))
        elif what == "abort":
            for t in self.tasks:
                t.post_control(lambda t=t: t.abort_checkpoint(checkpoint_id))
        elif what == "unaligned":
            for t in self.tasks:
                t.post(lambda t=t: t.switch_to_unaligned(checkpoint_id))
        else:
            raise ValueError(f"ThreadLauncher.send: unknown call {what!r}")
