"""Writing snapshots off the subtasks' threads: one ``SnapshotWriter`` per
job attempt in each process, shared by its subtasks (``SubtaskCheckpoints``
hands it the write of each snapshot it took)."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor


class SnapshotWriter:
    """Writes a job's snapshots in the background, off the tasks' threads and
    several at a time (``threads``: writing is mostly waiting for the disk,
    an fsync above all, and with two threads the subtasks of one checkpoint
    queued behind each other's fsyncs; ``write_queue_ms`` in a checkpoint's
    phases shows that wait). Threads start as work comes. Once shut
    down it takes no more work and says so (``submit`` returns False)
    instead of raising: a network sender thread may report what a barrier
    overtook after the job's tasks have stopped (a failure, a restart, the
    end of input while consumers still drain), and that word belongs to an
    attempt that is over."""

    def __init__(self, threads: int = 8):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pyflowbuf: snapshot writer")
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn, *args) -> bool:
        with self._lock:       # no submit slips in between the check and a shutdown
            if self._closed:
                return False
            self._pool.submit(fn, *args)
            return True

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=wait)


def new_writer() -> SnapshotWriter:
    return SnapshotWriter()
