"""Processing time: one thread per process that calls callbacks at wall-clock
(``time.time()``) deadlines. Processing-time timers (``pyflowbuf.time.timers``)
and periodic watermark emission (``pyflowbuf.time.watermarks``) both schedule
on it; a callback only posts a mail to its task, which does the work in its own
thread."""
from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from typing import Any, Callable


class ProcessingTimeService(threading.Thread):
    """Calls callbacks at wall-clock deadlines from one thread. Callbacks must
    be quick (they post mails); the thread parks on a condition between
    deadlines, never spinning."""

    # with nothing scheduled for this long the thread ends (a later schedule
    # starts a new one): no thread outlives the jobs that needed it
    IDLE_EXIT_S = 0.5

    def __init__(self):
        super().__init__(name="pyflowbuf: processing time", daemon=True)
        self._cv = threading.Condition()
        self._heap: list = []
        self._seq = itertools.count()
        self.stopped = False

    def schedule(self, deadline: float, callback: Callable[[], Any]) -> list | None:
        """Run ``callback()`` at ``deadline`` (time.time() seconds); returns a
        handle for ``cancel``, or None when this service has ended (use
        ``processing_time_service()``, which starts a new one)."""
        entry = [deadline, next(self._seq), callback]
        with self._cv:
            if self.stopped:
                return None
            heapq.heappush(self._heap, entry)
            if self._heap[0] is entry:
                self._cv.notify()
        return entry

    @staticmethod
    def cancel(handle) -> None:
        handle[2] = None        # dropped when its time comes

    def run(self):
        heap, cv = self._heap, self._cv
        while True:
            with cv:
                while True:
                    if heap:
                        wait = heap[0][0] - time.time()
                        if wait <= 0:
                            break
                        cv.wait(wait)
                    elif not cv.wait(self.IDLE_EXIT_S) and not heap:
                        self.stopped = True
                        return
                entry = heapq.heappop(heap)
            cb = entry[2]
            if cb is not None:
                try:
                    cb()
                except Exception:       # a callback only posts a mail; the task reports its own errors
                    pass


_service: ProcessingTimeService | None = None
_service_pid = None
_service_lock = threading.Lock()


def _after_fork_in_child():
    # the thread did not survive the fork, and the lock may have been held by
    # another thread of the parent at that moment
    global _service, _service_lock
    _service = None
    _service_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def processing_time_service() -> ProcessingTimeService:
    """This process's service (a forked worker starts its own)."""
    global _service, _service_pid
    with _service_lock:
        if _service is None or _service_pid != os.getpid() or _service.stopped:
            _service = ProcessingTimeService()
            _service_pid = os.getpid()
            _service.start()
        return _service


def schedule(deadline: float, callback: Callable[[], Any]) -> list:
    """``callback()`` at ``deadline`` on this process's processing-time thread
    (started, or started again after it ended idle, as needed)."""
    while True:
        handle = processing_time_service().schedule(deadline, callback)
        if handle is not None:
            return handle
