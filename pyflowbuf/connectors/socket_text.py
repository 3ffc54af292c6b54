"""``socket_text``: lines of text from a TCP server, as Flink's
``socketTextStream`` and Spark's socket source read them (the word-count demo
fed by ``nc -lk 9999``).

The source is a TCP client with parallelism 1. It splits what the server
sends at ``delimiter`` (a ``"\\r"`` before a ``"\\n"`` delimiter is dropped),
decoding with ``encoding`` incrementally, so a character or a line split
across sends arrives whole. When the connection closes, the text after the
last delimiter is the last line of that connection.

Reconnecting: when the server closes the connection (or refuses it), the
source tries again after ``retry_delay`` seconds (> 0), doubling the wait after
each failed try up to ``max_retry_delay``. ``max_retries`` consecutive
failed tries end the source (None: never give up); a successful connection
resets the count and the wait. As in Flink, the stream ends when the server
has closed and the retries are exhausted: the job then finishes like one
reading a file. A source that never connected at all fails the job
(``ConnectionRefusedError`` naming the address) instead: nothing was read,
and ending quietly would look like an empty stream.

Waiting never spins: the source waits in ``select`` on the socket and on a
wake-up socket that the task's mails (checkpoint triggers, watermark ticks)
and a cancel write to, with a bounded timeout, and hands the task an empty
batch when nothing came, so the task stays responsive.

The source cannot rewind: what the server sent is gone once read. A restored
job reconnects and reads what the server sends from then on; lines read
after the last checkpoint and before a failure are not read again (the server
would have to send them again). So with checkpoints it needs
``checkpointing_mode="at_least_once"``, as in Flink (which gives no
guarantee for this source either), and it is refused with exactly-once.
"""
from __future__ import annotations

import codecs
import collections
import ipaddress
import math
import numbers
import select
import socket
import time

from pyflowbuf import errors

from pyflowbuf.connectors.sources import Source

# How long one pull may wait for data before the task gets an empty batch.
POLL_S = 0.2
# A line longer than this (no delimiter in sight) fails the job instead of
# filling the memory: the server does not send the delimiter the job expects.
MAX_LINE_CHARS = 64 << 20
RECV_BYTES = 1 << 16
CONNECT_TIMEOUT_S = 5.0


def is_loopback(host: str, port: int) -> bool:
    """Whether every address ``host`` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise errors.ConfigurationError(f"socket_text: cannot resolve host {host!r}: {exc}") from None
    addrs = {info[4][0] for info in infos}
    try:
        return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)
    except ValueError:
        return False


def _seconds(name, v, *, optional=False, positive=True):
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise errors.ConfigurationError(
            f"socket_text: {name} must be a finite number of seconds {'> 0' if positive else '>= 0'}, got {v!r}")
    return float(v)


def check_arguments(host, port, delimiter, encoding, max_retries, retry_delay, max_retry_delay, allow_remote):
    """The arguments of ``Environment.socket_text``, checked where the stream
    is declared; returns them normalized."""
    if not isinstance(host, str) or not host:
        raise errors.ConfigurationError(f"socket_text: host must be a non-empty str, got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65535:
        raise errors.ConfigurationError(f"socket_text: port must be an int in 1..65535, got {port!r}")
    if not isinstance(delimiter, str) or not delimiter:
        raise errors.ConfigurationError(f"socket_text: delimiter must be a non-empty str, got {delimiter!r}")
    try:
        codecs.getincrementaldecoder(encoding)
    except (LookupError, TypeError):
        raise errors.ConfigurationError(f"socket_text: unknown encoding {encoding!r}") from None
    if max_retries is not None and (isinstance(max_retries, bool) or not isinstance(max_retries, int)
                                    or max_retries < 0):
        raise errors.ConfigurationError(
            f"socket_text: max_retries must be an int >= 0, or None (retry for as long as the job runs), "
            f"got {max_retries!r}")
    retry_delay = _seconds("retry_delay", retry_delay)
    max_retry_delay = _seconds("max_retry_delay", max_retry_delay)
    if max_retry_delay < retry_delay:
        raise errors.ConfigurationError(
            f"socket_text: max_retry_delay ({max_retry_delay}) must be >= retry_delay ({retry_delay})")
    if not isinstance(allow_remote, bool):
        raise errors.ConfigurationError(f"socket_text: allow_remote must be True or False, got {allow_remote!r}")
    if not allow_remote and not is_loopback(host, port):
        raise errors.ConfigurationError(
            f"socket_text: {host}:{port} is not a loopback address. The socket source reads plain, "
            "unauthenticated text from whoever answers there; pass allow_remote=True to read from another "
            "machine on purpose")
    return retry_delay, max_retry_delay


def check_checkpointing(checkpoint_config, name) -> None:
    """The socket source cannot rewind: exactly-once checkpoints are refused."""
    if checkpoint_config.enabled and checkpoint_config.mode != "at_least_once":
        raise errors.ConfigurationError(not_rewindable_message(name))


def not_rewindable_message(name) -> str:
    return (f"source {name!r} (socket_text) cannot rewind: what the server sent is gone once read, so a "
            "recovery could not replay it and exactly-once checkpoints are impossible. Use "
            "Environment(checkpointing_mode='at_least_once') (after a restore the source reconnects and reads "
            "what the server sends from then on), or turn checkpoints off")


class SocketTextSource(Source):
    """Lines of text from a TCP server; see the module's docstring."""

    default_kind = "str"
    rewindable = False

    def __init__(self, host, port, delimiter="\n", *, encoding="utf-8", max_retries=5, retry_delay=0.5,
                 max_retry_delay=10.0, name="socket_text"):
        self.host, self.port = host, port
        self.delimiter = delimiter
        self.encoding = encoding
        self.max_retries = max_retries
        self.retry_delay = retry_delay
        self.max_retry_delay = max_retry_delay
        self.what = f"socket_text {name!r} ({host}:{port})"
        self.not_rewindable_because = not_rewindable_message(name)
        self._sock = None
        self._lines = collections.deque()
        self._text = ""                 # decoded text after the last delimiter
        self._decoder = None
        self._failures = 0              # consecutive failed connection attempts
        self._delay = retry_delay
        self._next_try = 0.0
        self._ever_connected = False
        self._last_error = None
        self._ended = False
        self.connections = 0            # connections made (tests and metrics read it)
        self._wake_r = self._wake_w = None

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        if parallelism != 1:
            raise errors.ConfigurationError(f"{self.what}: a socket source has parallelism 1")
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    def wakeup(self) -> None:
        """Make a waiting ``next_batch`` return now (a mail or a cancel came);
        any thread may call it."""
        w = self._wake_w
        if w is None:
            return
        try:
            w.send(b"\0")
        except OSError:
            pass        # already full of wake-ups, or closed: the waiter wakes anyway

    def _drain_wakeups(self):
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    # ---- reading ----
    def next_batch(self, max_records):
        deadline = time.monotonic() + POLL_S
        while True:
            if self._lines:
                n = min(max_records, len(self._lines))
                return [self._lines.popleft() for _ in range(n)]
            if self._ended:
                return None
            now = time.monotonic()
            if self._sock is None:
                if now >= self._next_try:
                    self._connect()
                    continue
                if not self._wait(None, min(self._next_try, deadline) - now):
                    return []
                continue
            if now >= deadline:
                return []
            if self._wait(self._sock, deadline - now) is self._sock:
                self._receive()
            else:
                return []           # woken up (a mail, a cancel) or the poll ran out

    def _wait(self, sock, timeout):
        """Wait up to ``timeout`` for ``sock`` to be readable (or closed) or a
        wake-up; returns ``sock`` when it is, None otherwise. poll, not
        select: a process with over 1024 open files is no problem."""
        poller = select.poll()
        wake = self._wake_r.fileno()
        poller.register(wake, select.POLLIN)
        if sock is not None:
            poller.register(sock.fileno(), select.POLLIN)
        ready = {fd for fd, _ in poller.poll(max(timeout, 0.0) * 1000.0)}
        if wake in ready:
            self._drain_wakeups()
        return sock if sock is not None and sock.fileno() in ready else None

    def _receive(self):
        try:
            data = self._sock.recv(RECV_BYTES)
        except (ConnectionError, TimeoutError, OSError) as exc:
            self._last_error = exc
            data = b""
        if not data:
            self._closed_by_server()
            return
        try:
            self._split(self._decoder.decode(data))
        except UnicodeDecodeError as exc:
            raise errors.RecordTypeError(
                f"{self.what}: the server sent bytes that are not {self.encoding} text ({exc.reason}); "
                "pass encoding= to socket_text") from None

    def _split(self, text):
        parts = (self._text + text).split(self.delimiter)
        self._text = parts.pop()
        if len(self._text) > MAX_LINE_CHARS:
            raise errors.RecordTooLargeError(
                f"{self.what}: more than {MAX_LINE_CHARS} characters without the delimiter "
                f"{self.delimiter!r}: the server does not send the lines the job expects (delimiter=)")
        if self.delimiter == "\n":
            parts = [p[:-1] if p.endswith("\r") else p for p in parts]
        self._lines.extend(parts)

    def _connect(self):
        try:
            sock = socket.create_connection((self.host, self.port), timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            self._last_error = exc
            self._retry_later()
            return
        sock.setblocking(False)
        self._sock = sock
        self._decoder = codecs.getincrementaldecoder(self.encoding)()
        self._failures = 0
        self._delay = self.retry_delay
        self._ever_connected = True
        self.connections += 1

    def _closed_by_server(self):
        """The connection ended: its last text is a line, then try again."""
        try:
            tail = self._decoder.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            raise errors.RecordTypeError(
                f"{self.what}: the connection closed inside a character: its last bytes are not "
                f"{self.encoding} text ({exc.reason}); pass encoding= to socket_text") from None
        self._split(tail)
        if self._text:
            last = self._text
            self._lines.append(last[:-1] if self.delimiter == "\n" and last.endswith("\r") else last)
            self._text = ""
        self._close_socket()
        self._retry_later()

    def _retry_later(self):
        self._failures += 1
        if self.max_retries is not None and self._failures > self.max_retries:
            if not self._ever_connected:
                raise ConnectionRefusedError(
                    f"{self.what}: could not connect ({self._failures} attempts, the last: {self._last_error}); "
                    "is the server running? (max_retries=, retry_delay= set how long the source tries)")
            self._ended = True
            return
        # each failure doubles the wait, up to the cap: a server that is down
        # for long is asked rarely, one that restarts at once is back soon
        self._next_try = time.monotonic() + self._delay
        self._delay = min(self._delay * 2, self.max_retry_delay)

    # ---- positions: nothing to rewind to (at-least-once restores reconnect) ----
    def position(self):
        return None

    def seek(self, position):
        pass

    def _close_socket(self):
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def close(self):
        self._close_socket()
        for s in (self._wake_r, self._wake_w):
            if s is not None:
                s.close()
        self._wake_r = self._wake_w = None
