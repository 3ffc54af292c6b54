"""The lock a running job holds on its checkpoint directory.

Two jobs writing one ``checkpoint_dir`` would number their checkpoints
alike, remove each other's by retention and restore each other's state. The
job's driver (the process that runs the checkpoint coordinator; never its
workers) holds ``<checkpoint_dir>/_job.lock`` from the start of the job to
its end, whatever the end: the file names the job, the process (pid and its
start time), the host and when it was taken.

On a local file system the file is also ``flock``-ed: the kernel lets go of
it when the process dies, even by ``kill -9``, so a lock whose ``flock`` is
free is stale whatever its file says. Elsewhere (an fsspec URL: s3, hdfs,
``memory://``), best effort: a lock of this host is stale when its process
is gone or is another process with the same pid (its start time differs),
and a lock of this process is stale unless a job of this process holds it;
a lock of another host is taken as held (its process cannot be checked from
here): its holder is named so that it can be removed by hand. A stale lock
is taken over, with a WARNING on the ``pyflowbuf.checkpoint`` logger.

    lock = DirectoryLock.acquire("checkpoints/payments", job="payments")
    ...
    lock.release()

A second ``acquire`` while the first holds it raises
``CheckpointDirectoryInUseError``.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem

from pyflowbuf.checkpoint.errors import CheckpointDirectoryInUseError

try:
    import fcntl
except ImportError:         # not on Windows: the pid and start time decide alone
    fcntl = None

log = logging.getLogger("pyflowbuf.checkpoint")

LOCK_FILE = "_job.lock"
FORMAT = 1

# the locks this process holds, by token: what tells a lock of this process
# (the same pid) that is held from one left behind
_HELD: dict = {}
_HELD_LOCK = threading.Lock()


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux), or
    None where that cannot be read: two processes that had the same pid
    differ in it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        # the command name, in parentheses, may hold spaces: count after its end
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:         # PermissionError: another user's process
        return True
    return True


def holder_text(info: dict) -> str:
    """``job 'payments' (pid 4242 on host a, since 2026-11-27 21:40:01)``."""
    since = info.get("created")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return f"job {info.get('job')!r} (pid {info.get('pid')} on host {info.get('host')}, since {when})"


def stale_reason(info: dict) -> str | None:
    """Why the lock ``info`` describes is held by nobody any more, or None
    when its holder may be alive (or cannot be checked: another host)."""
    if info.get("host") != socket.gethostname():
        return None
    boot = info.get("boot_id")
    if boot is not None and _boot_id() is not None and boot != _boot_id():
        return "its host has restarted since"
    pid = info.get("pid")
    if not isinstance(pid, int):
        return "it names no process"
    if pid == os.getpid():
        with _HELD_LOCK:
            held = info.get("token") in _HELD
        return None if held else "no job of this process holds it"
    if not process_alive(pid):
        return f"process {pid} has ended"
    started = info.get("process_started")
    now = process_start_time(pid)
    if started is not None and now is not None and started != now:
        return f"pid {pid} is another process now"
    return None


class DirectoryLock:
    """A job's hold on its checkpoint directory (see the module docstring).
    ``acquire`` takes it or raises ``CheckpointDirectoryInUseError``;
    ``release`` (idempotent) gives it back."""

    def __init__(self, fs, root: str, job: str):
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self.path = f"{self.root}/{LOCK_FILE}"
        self.job = job
        self.token = uuid.uuid4().hex
        self.info = {"format": FORMAT, "job": job, "pid": os.getpid(), "host": socket.gethostname(),
                     "process_started": process_start_time(os.getpid()), "boot_id": _boot_id(),
                     "created": time.time(), "token": self.token}
        self._fd = None
        self.held = False
        self.took_over: dict | None = None      # the stale lock it replaced, if any
        self.ending = False                     # its job was cancelled or stopped: released soon
        self._released = threading.Event()

    @property
    def url(self) -> str:
        return self.fs.unstrip_protocol(self.root)

    @classmethod
    def acquire(cls, checkpoint_dir, job: str, storage_options=None) -> "DirectoryLock":
        fs, root = fsspec.core.url_to_fs(os.fspath(checkpoint_dir), **dict(storage_options or {}))
        lock = cls(fs, root, job)
        lock._acquire()
        return lock

    # ---- taking it ----
    def _in_use(self, info: dict):
        return CheckpointDirectoryInUseError(
            f"checkpoint_dir {self.url} is in use by {holder_text(info)}; this job is {self.job!r}. Two jobs "
            "must not share a checkpoint directory: give this job another checkpoint_dir, or another name "
            "with checkpoint_dir unset (each job then gets checkpoints/<name>). If that job is no longer "
            f"running, remove {self.fs.unstrip_protocol(self.path)}", path=self.url, holder=info)

    def _register(self):
        self.held = True
        with _HELD_LOCK:
            _HELD[self.token] = self

    def _took_over(self, info: dict, why: str):
        self.took_over = info
        log.warning("pyflowbuf: job %r takes over the lock of %s in %s: %s (a job that ended without "
                    "releasing it, e.g. killed)", self.job, holder_text(info), self.url, why)

    def _acquire(self):
        self.fs.makedirs(self.root, exist_ok=True)
        if isinstance(self.fs, LocalFileSystem) and fcntl is not None:
            try:
                self._acquire_local()
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                # a file system without flock (some network mounts): as for any URL
        self._acquire_generic()

    def _acquire_local(self):
        for _ in range(20):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    info = _read_fd(fd) or self._wait_for_content()
                    raise self._in_use(info or {"job": "?", "pid": "?", "host": "?"}) from None
                # the file may have been removed (released) between open and flock: hold the one at the path
                try:
                    same = os.path.samestat(os.fstat(fd), os.stat(self.path))
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    fd = None
                    continue
                old = _read_fd(fd)
                if old and old.get("token") != self.token:
                    # its flock was free: whoever wrote it has ended (the kernel let go of it)
                    self._took_over(old, stale_reason(old) or "its process no longer holds it")
                data = json.dumps(self.info).encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)
                os.fsync(fd)
                self._fd, fd = fd, None
                self._register()
                return
            finally:
                if fd is not None:
                    os.close(fd)
        raise self._in_use({"job": "?", "pid": "?", "host": "?"})

    def _wait_for_content(self) -> dict | None:
        """The holder's file, once it is written (it takes the flock first)."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            info = _read_path(self.path)
            if info:
                return info
            time.sleep(0.02)
        return None

    def _read_generic(self) -> dict | None:
        try:
            self.fs.invalidate_cache(self.root)
            with self.fs.open(self.path, "rb") as f:
                return _parse(f.read())
        except FileNotFoundError:
            return None

    def _acquire_generic(self):
        for _ in range(5):
            info = self._read_generic()
            if info is not None:
                why = stale_reason(info)
                if why is None:
                    raise self._in_use(info)
                self._took_over(info, why)
                try:
                    self.fs.rm(self.path)
                except FileNotFoundError:
                    pass
            elif self.fs.exists(self.path):
                # a file that is no lock of ours (empty, torn): the holder may be writing it
                time.sleep(0.05)
                if self._read_generic() is None and self.fs.exists(self.path):
                    raise self._in_use({"job": "?", "pid": "?", "host": "?"})
                continue
            try:
                with self.fs.open(self.path, "xb") as f:
                    f.write(json.dumps(self.info).encode())
            except FileExistsError:
                continue
            except (ValueError, NotImplementedError):       # no exclusive create here: write, then read back
                self.fs.pipe(self.path, json.dumps(self.info).encode())
            # best effort where creation is not exclusive: the last writer holds it
            now = self._read_generic()
            if now is not None and now.get("token") == self.token:
                self._register()
                return
            if now is not None:
                raise self._in_use(now)
        raise self._in_use(self._read_generic() or {"job": "?", "pid": "?", "host": "?"})

    # ---- giving it back ----
    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            self._release_file()
        finally:
            # unregistered only once the file is free: a waiter that finds no
            # holder (wait_for_ending_holder) may take the lock at once
            with _HELD_LOCK:
                _HELD.pop(self.token, None)
            self._released.set()

    def _release_file(self) -> None:
        try:
            if self._fd is not None:
                try:
                    # removed while still flock-ed: a waiting opener sees another file and retries
                    if os.path.samestat(os.fstat(self._fd), os.stat(self.path)):
                        os.unlink(self.path)
                except FileNotFoundError:
                    pass
                finally:
                    os.close(self._fd)
                    self._fd = None
                return
            info = self._read_generic()
            if info is not None and info.get("token") == self.token:
                self.fs.rm(self.path)
        except OSError as exc:
            log.warning("pyflowbuf: could not remove the lock %s of job %r: %s", self.path, self.job, exc)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def wait_for_ending_holder(info: dict | None, timeout: float) -> bool:
    """Whether the lock ``info`` describes belongs to a job of this process
    that is ending (cancelled or stopped: ``cancel()`` does not wait for the
    end) and was released within ``timeout`` seconds. A notebook's "cancel,
    then start the job again" then waits for the old job's last write instead
    of failing; a job of this process that still runs keeps its lock."""
    if not info or info.get("pid") != os.getpid():
        return False
    with _HELD_LOCK:
        lock = _HELD.get(info.get("token"))
    if lock is None:
        return True         # released meanwhile
    return lock.ending and lock._released.wait(timeout)


def _parse(data: bytes) -> dict | None:
    try:
        info = json.loads(data.decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return info if isinstance(info, dict) else None


def _read_fd(fd) -> dict | None:
    try:
        return _parse(os.pread(fd, 1 << 16, 0))
    except OSError:
        return None


def _read_path(path) -> dict | None:
    try:
        with open(path, "rb") as f:
            return _parse(f.read())
    except OSError:
        return None


def read_lock(fs, root: str) -> dict | None:
    """The lock file of the directory ``root`` (on ``fs``), None without one."""
    try:
        with fs.open(f"{root.rstrip('/')}/{LOCK_FILE}", "rb") as f:
            return _parse(f.read())
    except (FileNotFoundError, IsADirectoryError):
        return None


def _close_in_child():
    # a forked worker inherits the driver's descriptors, and with them its
    # flock: the lock is the driver's alone, and ends with the driver. (A
    # new mutex: another thread may have held the old one at the fork.)
    global _HELD_LOCK
    _HELD_LOCK = threading.Lock()
    for lock in list(_HELD.values()):
        if lock._fd is not None:
            try:
                os.close(lock._fd)
            except OSError:
                pass
            lock._fd = None
        lock.held = False
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)
