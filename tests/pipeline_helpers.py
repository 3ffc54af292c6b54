"""Checks shared by the pipeline test modules: after a job, every segment is
back in its pool and no thread of the job is left; the committed output of a
part-file sink."""

import os


def job_threads(job) -> list:
    """Threads of ``job`` still alive (tasks, metrics sampler, watcher)."""
    threads = list(job.tasks)
    if job.sampler is not None:
        threads.append(job.sampler)
    watcher = getattr(job, "_watcher", None)
    if watcher is not None:
        threads.append(watcher)
    return [t for t in threads if t.is_alive()]


def assert_clean(env) -> None:
    """After a job: every segment back in the pool, no thread of it alive."""
    job = env.last_execution
    pool = job.network_pool
    assert pool.available_segments == pool.total_segments, (pool.available_segments, pool.total_segments)
    assert job_threads(job) == []


def run(env, timeout=60):
    env.execute(timeout)
    assert_clean(env)


def read_parts(directory):
    """The lines of the committed part files of a write_text directory (hidden
    in-progress files are not output)."""
    lines = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("part-"):
            with open(os.path.join(directory, name)) as fh:
                lines += fh.read().splitlines()
    return lines
