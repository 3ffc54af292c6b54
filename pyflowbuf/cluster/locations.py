"""The file locations a job's tasks reach (its checkpoint directory, its file
sinks' directories, its file sources' paths), and the check that each is
reachable from every process the tasks run in.

A ``memory://`` location is one process's memory: a job in one process may
use it, but a worker process (``workers=N``, a ``SparkCluster``'s barrier
task) would write into its own copy, which the driver never sees, and read a
copy taken when it started. Refused before any worker starts, as a
``memory://`` checkpoint directory is (``driver.check_every_process``).

Example::

    from pyflowbuf.cluster.locations import check_shared_locations, file_locations

    for what, where in file_locations(spec):
        print(what, where)                  # "sink 'write_text'", "/data/out"
    check_shared_locations(spec, workers=2)     # spec: the JobSpec (Environment.job_spec())
"""
from __future__ import annotations

import os

from pyflowbuf import errors
from pyflowbuf.connectors import filesystems as fsx


def file_locations(spec):
    """(what, location) of every file location the job's tasks reach: the
    checkpoint directory, the file sinks' directories, the file sources' paths."""
    if spec.checkpoint_config.directory is not None:
        yield "checkpoint_dir", os.fspath(spec.checkpoint_config.directory)
    for node in spec.nodes:
        if node.file_output is not None:
            yield f"sink {node.name!r}", node.file_output.path
        for p in node.input_paths or ():
            yield f"source {node.name!r}", p


def check_shared_locations(spec, workers: int) -> None:
    """Refuse a file sink or source at a ``memory://`` location when the
    job's tasks run in ``workers`` processes other than this one: a sink's
    parts would stay in a worker's memory (the driver, which commits them,
    would find nothing), and a source would read the copy of the driver's
    memory the worker started with. (The checkpoint directory has its own
    check, with the checkpoint settings.)"""
    for what, location in file_locations(spec):
        if what == "checkpoint_dir" or not fsx.is_process_local(location):
            continue
        if what.startswith("sink"):
            why = "its parts would stay in the workers' memory, where the driver never commits them"
        else:
            why = "each worker would read its own process's memory, not the files this process holds there"
        raise errors.ConfigurationError(
            f"{what}: {location!r} is in one process's memory (memory://), and this job's tasks run in "
            f"{workers} other processes (workers={workers} or a SparkCluster's tasks): {why}. Use a location "
            "every process reaches (a local path, file://, s3://, ...), or run the job in one process")
