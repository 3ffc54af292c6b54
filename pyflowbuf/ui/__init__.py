"""A web view of a running job, as Flink's web UI shows one: the graph of
operator chains coloured by busy and backpressured time, each chain's
subtasks, the Top N offenders, the checkpoint history with a per-subtask
timeline, and every operator's watermark. Served read-only, live, by the
process that coordinates the job (docs/monitoring.md, "The web view").

Open it with ``Environment(ui_port=0)``, ``job.serve_ui()`` or
``pyflowbuf run job.py --ui``; the URL goes to the ``pyflowbuf.ui`` logger
(INFO) and to ``job.ui_url``::

    environment = fb.Environment(parallelism=4, ui_port=0)   # 0: a free port on 127.0.0.1
    ...
    job = environment.execute_async()
    print(job.ui_url)                                   # http://127.0.0.1:<port>/
"""
from __future__ import annotations

import contextlib

from pyflowbuf.ui.server import LOOPBACK, UiServer, serve

__all__ = ["UiServer", "serve", "served_for", "LOOPBACK"]


@contextlib.contextmanager
def served_for(spec, job):
    """Around ``job.start()``: the view the job's ``spec`` asks for (``ui_port``; none
    without one) binds its port before the job starts, so a busy port fails
    a job that has not run; it serves once the job runs (``job.ui``), and
    closes if the job does not start."""
    port = spec.metrics_config.ui_port
    if port is None:
        yield
        return
    server = UiServer(job, port, spec.metrics_config.ui_host, plan=spec.plan())
    try:
        yield
    except BaseException:
        server.close()
        raise
    job.ui = server
    server.start()
