"""The zygote: the process that forks a job's worker processes (``workers=N``).

A driver that forks its workers itself forks from a process whose threads
run (the checkpoint coordinator, the metrics relay, the output relay, the
driver's monitor, which forks a restart's workers). A child forked while
another thread held a lock (the allocator's under ASan, which does not lock
it around ``fork()``; logging's; any C library's) starts with that lock held
forever. So the execution's ``start`` has ``WorkerLauncher.open`` fork the
zygote first, before the execution starts a thread of its own, and the
zygote forks every worker of every attempt on request. The zygote is single-threaded from then on: it
does nothing but wait on its socket and on its children's exits, so each
worker is forked from a process with one thread. (Threads the caller's
process had already started are its own: the zygote is forked before ours,
not before theirs, and inherits what a fork inherits of them.)

The zygote holds the job as it was when it was forked: the graph and its
functions. What the driver decides later travels with each request, never
by inherited memory: the worker's index, the attempt and its secret, the
part-file sinks' decisions (``OUTPUT_DECISIONS``), and, as descriptors
(``SCM_RIGHTS``), the worker's control pipe, its stdout pipe and its
faulthandler file. The checkpoint to restore and the workers' addresses
follow on the control pipe, as before.

Protocol, on a ``SOCK_SEQPACKET`` socketpair, one pickled tuple a message
(both ends are this program's own processes):

- driver to zygote: ``("fork", payload)`` with descriptors; ``("kill", pid)``;
  ``("exit",)``.
- zygote to driver: ``("forked", pid, threads)`` (``threads``: the zygote's
  thread count when it forked, from ``/proc``; None elsewhere) or
  ``("refused", text)``; ``("exited", pid, exitcode)`` when it reaps a worker
  (``exitcode`` as ``multiprocessing`` reports it: ``-N`` for signal N).

Workers are the zygote's children: it reaps them (a pidfd each, where
Linux has them) and reports their exits; ``kill`` goes through it, so a pid
is never signalled after it was reaped (and perhaps reused). Nothing is left
behind: a worker dies with the zygote (``PR_SET_PDEATHSIG``), and the zygote
kills its workers and exits on ``exit``, or when its socket reaches EOF
because the driver died (and, where the driver forked it from its main
thread, with the driver, by ``PR_SET_PDEATHSIG``).
"""
from __future__ import annotations

import os
import pickle
import selectors
import signal
import socket
import sys
import threading
import time
import weakref

from pyflowbuf import errors

MAX_MESSAGE = 1 << 16
MAX_FDS = 8
# the part-file sinks' attributes the driver sets before (and on) each attempt:
# FileOutput.prepare (seq_start) and runtime.restore.commit_outputs (the rest)
OUTPUT_DECISIONS = ("seq_start", "restored_state", "uid", "parallelism")
PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1


def _prctl(option, arg) -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg)
        except OSError:
            pass


def set_process_name(name: str) -> None:
    """The name ``ps`` and ``/proc/<pid>/comm`` show (15 bytes at most)."""
    if sys.platform.startswith("linux"):
        import ctypes
        _prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def die_with_parent() -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def thread_count():
    """This process's threads, as the kernel counts them (None without /proc)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def output_decisions(outputs) -> list:
    """What the driver decided for each part-file sink, to send a worker."""
    return [{a: getattr(o, a) for a in OUTPUT_DECISIONS} for o in outputs]


def apply_output_decisions(outputs, decisions) -> None:
    for o, d in zip(outputs, decisions, strict=True):
        for a, v in d.items():
            setattr(o, a, v)


# the driver's ends of the zygotes running now: a process forked from the
# driver (a later job's zygote, anyone's fork) must not hold them, or a zygote
# would not see EOF when the driver dies
_OPEN: "weakref.WeakSet[Zygote]" = weakref.WeakSet()


def _forget_in_child() -> None:
    for z in list(_OPEN):
        sock, z._sock, z._alive = z._sock, None, False
        if sock is not None:
            sock.close()
    _OPEN.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _send(sock, msg, fds=()):
    data = pickle.dumps(msg)
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def _recv(sock):
    """One message and the descriptors with it; (None, []) at EOF."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return pickle.loads(data), fds


class Zygote:
    """The driver's end of a zygote: ``fork`` a worker, ``wait`` for its
    exit status, ``kill`` it, ``close``. Thread-safe (the driver's monitor and
    the joining thread both use it).

    ``run(payload, fds)`` is what a forked worker runs (in the zygote's copy
    of this program, as it was when the zygote was forked); it must not
    return."""

    def __init__(self, run, name="pfb-zygote"):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent = os.getpid()
        from_main = threading.current_thread() is threading.main_thread()
        pid = os.fork()
        if pid == 0:        # the zygote
            code = 1
            try:
                ours.close()
                _zygote_main(theirs, run, parent, from_main, name)
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        self.pid = pid
        self._sock = ours
        self._lock = threading.Lock()       # one reader or writer of the socket at a time
        self._exits: dict = {}              # worker pid -> exit code
        self._replies: list = []
        self._alive = True
        self.threads_at_fork: list = []     # the zygote's thread count at each fork (the tests read it)
        _OPEN.add(self)

    # ---- requests ----
    def fork(self, payload, fds) -> int:
        """Fork a worker running ``run(payload, fds)``; its pid."""
        with self._lock:
            self._check_alive()
            try:
                _send(self._sock, ("fork", payload), fds)
            except OSError as exc:
                self._gone()
                raise self._gone_error() from exc
            while not self._replies:
                if not self._read(None):
                    raise self._gone_error()
            reply = self._replies.pop(0)
        if reply[0] == "refused":
            raise errors.FlowBufError(f"the zygote could not fork a worker: {reply[1]}")
        _, pid, threads = reply
        self.threads_at_fork.append(threads)
        return pid

    def kill(self, pid) -> None:
        """SIGKILL to worker ``pid`` unless it was reaped already."""
        with self._lock:
            if pid in self._exits or not self._alive:
                return
            try:
                _send(self._sock, ("kill", pid))
            except OSError:
                self._gone()

    def wait(self, pid, timeout):
        """Worker ``pid``'s exit code once it exited, within ``timeout``
        seconds; None if it runs on (or the zygote is gone)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if pid in self._exits:
                    return self._exits[pid]
                if not self._alive:
                    return None
                left = deadline - time.monotonic()
                # a slice at a time: another thread may need the socket
                self._read(max(0.0, min(left, 0.1)))
                if pid in self._exits:
                    return self._exits[pid]
                if left <= 0:
                    return None

    def close(self, timeout=5.0) -> None:
        """The zygote kills what is left of its workers and exits; reaped here."""
        with self._lock:
            if self._sock is None:
                return
            if self._alive:
                try:
                    _send(self._sock, ("exit",))
                except OSError:
                    pass
            self._sock.close()      # (EOF ends it too)
            self._sock = None
            self._alive = False
            _OPEN.discard(self)
        deadline = time.monotonic() + timeout
        while True:
            try:
                done, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if not done:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass

    # ---- under the lock ----
    def _read(self, timeout) -> bool:
        """Take one message if one comes within ``timeout``; False once the zygote is gone."""
        import select
        if not self._alive:
            return False
        r, _, _ = select.select([self._sock], [], [], timeout)
        if not r:
            return True
        try:
            msg, fds = _recv(self._sock)
        except OSError:
            msg, fds = None, []
        for fd in fds:
            os.close(fd)
        if msg is None:
            self._gone()
            return False
        if msg[0] == "exited":
            self._exits[msg[1]] = msg[2]
        else:
            self._replies.append(msg)
        return True

    def _gone(self):
        self._alive = False

    def _check_alive(self):
        if not self._alive or self._sock is None:
            raise self._gone_error()

    def _gone_error(self):
        return errors.FlowBufError(
            f"the zygote (pid {self.pid}) that forks this job's worker processes has exited: no worker can be "
            "started; the job fails (it died, or was killed, outside pyflowbuf)")


def _zygote_main(sock, run, parent, from_main, name):
    """The zygote's loop: fork on request, reap and report, until told to
    exit or the driver is gone. One thread throughout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # a Ctrl-C is the driver's to act on
    set_process_name(name)
    if from_main:
        # (the signal follows the forking *thread*'s end: only the main thread's is the driver's end)
        die_with_parent()
    if os.getppid() != parent:
        return          # the driver died before the line above
    children: dict = {}             # pid -> its pidfd, or None
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    pidfd_open = getattr(os, "pidfd_open", None)

    def reap(pid):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, None
        if not done:
            return
        fd = children.pop(pid)
        if fd is not None:
            sel.unregister(fd)
            os.close(fd)
        code = os.waitstatus_to_exitcode(status) if status is not None else None
        try:
            _send(sock, ("exited", pid, code))
        except OSError:
            pass        # the driver is gone: the loop sees EOF

    def fork(payload, fds):
        threads = thread_count()
        me = os.getpid()
        try:
            pid = os.fork()
        except OSError as exc:
            _send(sock, ("refused", f"{type(exc).__name__}: {exc}"))
            return
        if pid == 0:        # a worker
            code = 1
            try:
                sel.close()
                sock.close()
                for fd in children.values():
                    if fd is not None:
                        os.close(fd)
                die_with_parent()
                if os.getppid() != me:
                    return      # the zygote died before the line above
                run(payload, fds)
                code = 0
            finally:
                os._exit(code)
        fd = None
        if pidfd_open is not None:
            try:
                fd = pidfd_open(pid)
                sel.register(fd, selectors.EVENT_READ, pid)
            except OSError:
                fd = None
        children[pid] = fd
        _send(sock, ("forked", pid, threads))

    try:
        while True:
            # without pidfds: look for exits a few times a second
            for key, _ in sel.select(None if pidfd_open is not None else 0.1):
                if key.fileobj is not sock:
                    reap(key.data)
                    continue
                try:
                    msg, fds = _recv(sock)
                except OSError:
                    msg, fds = None, []
                if msg is None or msg[0] == "exit":
                    return
                try:
                    if msg[0] == "fork":
                        fork(msg[1], fds)
                    elif msg[0] == "kill" and msg[1] in children:
                        os.kill(msg[1], signal.SIGKILL)
                finally:
                    for fd in fds:
                        os.close(fd)
            if pidfd_open is None:
                for pid in list(children):
                    reap(pid)
    finally:
        # the job ended, or the driver is gone: no worker outlives the zygote
        for pid in list(children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in list(children):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
