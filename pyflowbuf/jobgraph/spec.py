"""``JobSpec``: the job as the runtime receives it. ``Environment.execute()``
(and every other entry that starts a job) builds one from its graph and its
settings; the execution, the deployment, the subtasks, the debloater, the
workers and a ``SparkCluster``'s executors read it, never the user's
``Environment``. So a setting can be followed from where it is given to where
it acts, and a job travels to another process or host as one pickled value
(with cloudpickle: the nodes hold the user's functions).

Example::

    import pyflowbuf as fb
    from pyflowbuf.runtime.job import JobExecution

    environment = fb.Environment(parallelism=2)
    out = environment.from_collection(["a b", "b"]).flat_map(str.split).collect()
    spec = environment.job_spec()
    del environment                     # the runtime needs the spec only
    JobExecution(spec).run(timeout=60)
    sorted(out.result)                  # ['a', 'b', 'b']
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pyflowbuf.checkpoint.keygroups import DEFAULT_MAX_PARALLELISM
from pyflowbuf.config import CheckpointConfig, DebloatConfig, MetricsConfig, NetworkConfig, RestartConfig
from pyflowbuf.jobgraph.graph import plan


@dataclass(eq=False)
class JobSpec:
    """Everything a job's run reads: its name, its graph (``nodes``, each
    ``Node`` with every fact declared) and its settings, resolved (the
    checkpoint directory is the job's own when none was given).

    ``workers``: subtasks spread over this many forked worker processes
    (None: threads of one process; a cluster places them itself).
    ``control_port``: the job's control endpoint (None: none).
    ``default_checkpoint_dir``: no ``checkpoint_dir`` was given, so
    ``checkpoint_config.directory`` is the job's default one (a restore
    from ``"latest"`` then also looks for checkpoints of older releases)."""

    name: str
    nodes: list
    parallelism: int = 1
    max_parallelism: int = DEFAULT_MAX_PARALLELISM
    chaining: bool = True
    max_batch: int = 1024
    allow_pickle: bool = False
    workers: int | None = None
    control_port: int | None = None
    network_config: NetworkConfig = field(default_factory=NetworkConfig)
    checkpoint_config: CheckpointConfig = field(default_factory=CheckpointConfig)
    restart_config: RestartConfig = field(default_factory=RestartConfig)
    debloat_config: DebloatConfig = field(default_factory=DebloatConfig)
    metrics_config: MetricsConfig = field(default_factory=MetricsConfig)
    default_checkpoint_dir: bool = False
    # Environment(tls=...): True, a pyflowbuf.net.TLSConfig or None; the driver
    # makes each attempt's TLSConfig from it and hands that to the workers
    tls: Any = None

    def plan(self) -> tuple[list, list]:
        """``(vertices, edges)``: the tasks after chaining and the exchanges
        between them (``jobgraph.graph.plan``)."""
        return plan(self.nodes, self.chaining)

    def replace(self, **changes) -> "JobSpec":
        """A copy with ``changes`` (the same nodes)."""
        return dataclasses.replace(self, **changes)

    def for_worker(self, bind_host: str) -> "JobSpec":
        """The spec a worker on another host runs its part of the job from:
        listening on ``bind_host``; the driver serves the metrics (log,
        Prometheus, live view) and the control endpoint for the whole job,
        so the worker has neither."""
        return self.replace(workers=None, control_port=None, tls=None,
                            network_config=self.network_config.replace(bind_host=bind_host),
                            metrics_config=MetricsConfig(interval=self.metrics_config.interval))
