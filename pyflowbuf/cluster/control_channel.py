"""The control channel between a job's driver and a worker on another host.

With ``workers=N`` the driver forks its workers and talks to each over a
``multiprocessing`` pipe, which pickles. Between hosts that would let anyone
who reaches the port run code in the driver, so this channel:

* authenticates both ends with the exchange's HMAC-SHA256 challenge
  (``pyflowbuf.net.protocol``) under the attempt's secret before a single
  message is read: a connection of an older attempt, or of a stranger, is
  refused at the handshake;
* carries messages as frames of ``4-byte big-endian length + value``, the
  value in the checkpoint value format (``pyflowbuf.checkpoint.container``:
  MessagePack with tuples, bytes, NumPy and Arrow, never pickle unless the
  job opted in with ``allow_pickle=True``);
* bounds every frame (``MAX_MESSAGE``) so a peer cannot make the other end
  allocate without limit;
* with ``tls=`` (a ``pyflowbuf.net.TLSConfig``), runs inside mutual TLS 1.3
  made with Python's ``ssl`` on the TCP socket itself
  (``pyflowbuf.net.tls.SSLStream``): no thread per connection, and a
  readable socket still means a message is there. It carries few messages,
  so it does not need the exchange's loops in the compiled core.

``ControlChannel`` has the surface the driver's code uses on a pipe:
``send``, ``recv`` (``EOFError`` once the peer is gone), ``poll``,
``fileno`` (``multiprocessing.connection.wait`` works on it) and ``close``.
It reads exactly one frame at a time, so a readable socket means a message
(or the end) is there.

Example::

    listener = ControlListener(secret, host="127.0.0.1")
    address = listener.start()
    worker = connect_control(address, secret)         # in the worker
    worker.send(("hello", 0))
    ch = listener.accept(deadline=time.monotonic() + 10)
    ch.recv()            # ('hello', 0)
"""
from __future__ import annotations

import queue
import select
import socket
import struct
import threading
import time

from pyflowbuf.checkpoint import container
from pyflowbuf.checkpoint.errors import UnsupportedStateError
from pyflowbuf.errors import AuthenticationError, ProtocolError
from pyflowbuf.net import protocol as P
from pyflowbuf.net import tls as T

_LEN = struct.Struct(">I")
# collected records travel on this channel too: a frame may be large, but bounded
MAX_MESSAGE = 1 << 30
# the data exchange's handshake wants a maximum buffer size; the control channel has none
_NO_BUFFERS = 1 << 10


class ControlChannel:
    """One authenticated control connection (either end)."""

    def __init__(self, sock: socket.socket, *, allow_pickle: bool = False, peer=None, tls=None):
        self._sock = sock
        self._tls = tls       # with TLS: the SSLStream that ``sock`` is
        self.allow_pickle = allow_pickle
        self.peer = peer
        self._send_lock = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, msg) -> None:
        try:
            data = container.dumps(msg, allow_pickle=self.allow_pickle)
        except UnsupportedStateError as e:
            kind = msg[1][0] if isinstance(msg, tuple) and len(msg) > 1 and isinstance(msg[1], tuple) else msg
            raise ProtocolError(
                f"a {kind!r} message to the driver holds a value that is not plain data ({e}); what a "
                "worker on another host sends to the driver (collect() records, task state, metrics) must be "
                "plain: convert it, or pass Environment(allow_pickle=True) if every host is trusted") from e
        if len(data) > MAX_MESSAGE:
            raise ProtocolError(f"a control message of {len(data)} bytes is over the limit of {MAX_MESSAGE}")
        with self._send_lock:
            if self._closed:
                raise OSError("the control channel is closed")
            self._sendall(data)

    def _sendall(self, data: bytes) -> None:
        # header and body in one segment for small messages; a large one is
        # not copied to prepend four bytes
        if len(data) < 65536:
            self._sock.sendall(_LEN.pack(len(data)) + data)
        else:
            self._sock.sendall(_LEN.pack(len(data)))
            self._sock.sendall(data)

    def _read_exactly(self, n: int, what: str) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                k = self._sock.recv_into(view[got:])
            except OSError as e:
                raise EOFError(f"control channel lost: {e}") from e
            if k == 0:
                if got == 0 and what == "header":
                    raise EOFError("the peer closed the control channel")
                raise EOFError(f"the control channel closed in the middle of a message ({got} of {n} bytes)")
            got += k
        return buf

    def recv(self):
        """The next message; EOFError when the peer closed the channel or it
        broke, ProtocolError for a frame that is not a valid message."""
        (n,) = _LEN.unpack(self._read_exactly(_LEN.size, "header"))
        if n > MAX_MESSAGE:
            raise ProtocolError(f"a control frame announced {n} bytes, over the limit of {MAX_MESSAGE}")
        body = self._read_exactly(n, "body")
        try:
            return container.loads(body, allow_pickle=self.allow_pickle)
        except Exception as e:  # noqa: BLE001 - any malformed value is a protocol violation
            raise ProtocolError(f"a malformed control message: {type(e).__name__}: {e}") from e

    def poll(self, timeout: float | None = 0.0) -> bool:
        if self._closed:
            return True
        if self._tls is not None and self._tls.pending():
            return True
        r, _, _ = select.select([self._sock], [], [], timeout)
        return bool(r)

    def close(self) -> None:
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)   # wakes a thread blocked in recv
        except OSError:
            pass
        self._sock.close()

    @property
    def closed(self) -> bool:
        return self._closed


def connect_control(address, secret: bytes, *, timeout: float = P.DEFAULT_HANDSHAKE_TIMEOUT,
                    allow_pickle: bool = False, tls=None) -> ControlChannel:
    """The worker's end: connect to the driver's ControlListener and prove
    the secret (and check the driver's proof). Raises AuthenticationError on
    a wrong secret, OSError when the driver cannot be reached. ``tls`` (a
    ``pyflowbuf.net.TLSConfig``): mutual TLS 1.3 first, the handshake inside
    it (TLSError when the TLS handshake fails)."""
    secret = P.check_secret(secret)
    deadline = time.monotonic() + timeout
    sock = socket.create_connection(tuple(address), timeout=timeout)
    stream = None
    try:
        P.configure_socket(sock)
        if tls is not None:
            sock = stream = _tls_wrap(sock, tls, False, tuple(address), deadline)
        reader = P.FrameReader(sock, _NO_BUFFERS)
        P.client_handshake(sock, reader, secret, 0, deadline=deadline)
        _check_nothing_staged(reader)
    except BaseException as e:
        sock.close()
        if stream is not None and stream.error is not None and e is not stream.error:
            # the driver's alert after our handshake (it refused our certificate) beats the EOF seen then
            raise stream.error from None
        raise
    sock.settimeout(None)
    return ControlChannel(sock, allow_pickle=allow_pickle, peer=tuple(address), tls=stream)


def _tls_wrap(sock, tls, server_side, peer, deadline):
    """Mutual TLS on ``sock`` by ``deadline`` (TLSError naming the peer, the
    socket closed, if it fails); returns the SSLStream to use instead."""
    return T.SSLStream(T.handshake_socket(sock, tls, server_side=server_side, peer=peer, deadline=deadline),
                       peer)


def _check_nothing_staged(reader):
    # The party that authenticated last speaks first, so nothing may follow
    # the handshake's last frame in what the reader took off the socket.
    if reader._end != reader._start:
        raise ProtocolError("the peer sent data before the handshake ended")


_KEEP = object()


def _load(tls):
    """The server side's context, made now: a certificate file that cannot be
    read is a TLSUnavailableError for the caller, not the end of the accept
    thread at the first worker's connection."""
    if tls is not None:
        tls.context(True)


class ControlListener:
    """The driver's end: listens on ``host`` (never a wildcard: the address
    is what workers are told to connect to). A thread authenticates each
    connection under the current ``secret`` (``set_secret`` changes it for
    the next attempt), one at a time and each within ``handshake_timeout``;
    ``accept`` hands out the authenticated ones. A connection that fails the
    handshake (a wrong secret, a stranger, a worker of an attempt given up)
    is closed and counted in ``refused``; the listener goes on. Bounded: at
    most ``backlog`` authenticated channels wait for ``accept``; more are
    closed."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: int = 0, *, allow_pickle: bool = False,
                 handshake_timeout: float = P.DEFAULT_HANDSHAKE_TIMEOUT, backlog: int = 1024, tls=None):
        if host in ("", "0.0.0.0", "::"):
            raise ValueError(f"the control listener needs an address workers can connect to, not {host!r}")
        self.secret = P.check_secret(secret)
        self.tls = tls          # a TLSConfig: every connection is mutual TLS first (set_secret may change it)
        self.host = host
        self.port = port
        self.allow_pickle = allow_pickle
        self.handshake_timeout = handshake_timeout
        self.refused = 0
        self.errors: list = []
        self._sock = None
        self._thread = None
        self._ready: queue.Queue = queue.Queue(backlog)
        self._closed = threading.Event()

    def start(self):
        _load(self.tls)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((self.host, self.port))
            s.listen(64)
        except BaseException:
            s.close()
            raise
        self._sock = s
        self._thread = threading.Thread(target=self._accept_loop, name="pyflowbuf: control listener", daemon=True)
        self._thread.start()
        return self.address

    @property
    def address(self):
        return self._sock.getsockname()[:2]

    def set_secret(self, secret: bytes, tls=_KEEP) -> None:
        """The next attempt's secret (and, if given, its TLSConfig)."""
        if tls is not _KEEP:
            _load(tls)
            self.tls = tls
        self.secret = P.check_secret(secret)
        # what authenticated under the old secret and was not taken is stale
        while True:
            try:
                self._ready.get_nowait().close()
            except queue.Empty:
                break

    def _accept_loop(self):
        while not self._closed.is_set():
            try:
                r, _, _ = select.select([self._sock], [], [], 0.2)
                if not r:
                    continue
                sock, peer = self._sock.accept()
            except (OSError, ValueError):
                if self._closed.is_set():
                    return
                continue
            secret, tls, stream = self.secret, self.tls, None
            try:
                P.configure_socket(sock)
                deadline = time.monotonic() + self.handshake_timeout
                if tls is not None:
                    sock = stream = _tls_wrap(sock, tls, True, peer, deadline)
                reader = P.FrameReader(sock, _NO_BUFFERS)
                P.server_handshake(sock, reader, secret, _NO_BUFFERS, deadline=deadline)
                _check_nothing_staged(reader)
                sock.settimeout(None)
            except (AuthenticationError, ProtocolError, OSError, socket.timeout) as e:
                self.refused += 1
                if stream is not None and stream.error is not None:
                    e = stream.error
                self.errors = (self.errors + [(peer, e)])[-16:]
                sock.close()
                continue
            ch = ControlChannel(sock, allow_pickle=self.allow_pickle, peer=peer, tls=stream)
            if secret is not self.secret:
                ch.close()          # the secret changed meanwhile: of an attempt given up
                continue
            try:
                self._ready.put_nowait(ch)
            except queue.Full:
                ch.close()

    def accept(self, deadline: float) -> ControlChannel | None:
        """The next authenticated connection, or None at ``deadline``
        (time.monotonic())."""
        left = deadline - time.monotonic()
        if left <= 0 or self._closed.is_set():
            return None
        try:
            return self._ready.get(timeout=left)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._closed.set()
        if self._sock is not None:
            self._sock.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.handshake_timeout + 1)
        self.set_secret(self.secret)     # closes what was never taken
