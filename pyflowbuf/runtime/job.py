"""Where ``JobExecution`` was defined before it became the one execution of
every placement: it lives in ``runtime/execution.py`` now, and is importable
from here as before.

Example::

    from pyflowbuf.runtime.job import JobExecution

    job = JobExecution(environment.job_spec())
    job.run(timeout=60)
"""
from __future__ import annotations

from pyflowbuf.runtime.execution import CANCEL_GRACE_S, JobExecution

Execution = JobExecution       # the name of the shared base while there were two classes

__all__ = ["CANCEL_GRACE_S", "Execution", "JobExecution"]
