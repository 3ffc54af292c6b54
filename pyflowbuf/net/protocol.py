"""Socket plumbing shared by server and client: socket options, the frame
reader that receives payloads straight into segments, and the shared-secret
handshake. (Gathered sends are netio.Wire's.)"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time

from pyflowbuf.errors import AuthenticationError, ConnectionLostError, ProtocolError, RemoteError
from pyflowbuf.net import frames as F

DEFAULT_DEAD_PEER_TIMEOUT = 30.0
DEFAULT_HANDSHAKE_TIMEOUT = 10.0


class HandshakeRefused(Exception):
    """Raised by a server's ``admit`` callback to turn away a client that has
    proven the secret (e.g. the server already serves its maximum number of
    connections). ``server_handshake`` tells the client with an ErrorResponse
    of ``error_kind`` and re-raises."""

    def __init__(self, error_kind, message):
        super().__init__(message)
        self.error_kind = error_kind
        self.message = message


def new_secret() -> bytes:
    """A fresh 32-byte shared secret for a job's processes."""
    return os.urandom(32)


def check_secret(secret) -> bytes:
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be bytes or str, got {type(secret).__name__}")
    if len(secret) < 16:
        raise ValueError("secret must be at least 16 bytes (use pyflowbuf.net.new_secret())")
    return bytes(secret)


def configure_socket(sock, dead_peer_timeout=DEFAULT_DEAD_PEER_TIMEOUT):
    """No Nagle (control frames are small and latency-bound); keepalive and
    TCP_USER_TIMEOUT so a peer that vanished without closing (host died,
    cable cut) fails the connection within about ``dead_peer_timeout`` s. A
    killed process is noticed at once: its kernel closes the socket."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if dead_peer_timeout:
        idle = max(1, int(dead_peer_timeout / 2))
        intvl = max(1, int(dead_peer_timeout / 6))
        for name, val in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", intvl), ("TCP_KEEPCNT", 3),
                          ("TCP_USER_TIMEOUT", int(dead_peer_timeout * 1000))):
            opt = getattr(socket, name, None)
            if opt is not None:
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, opt, val)
                except OSError:
                    pass


def tell_peer(wire, error):
    """Best effort, never blocking: a fatal ErrorResponse naming ``error``
    before we close, so the peer reports why instead of a bare disconnect.
    ``wire`` is the connection's netio.Wire."""
    try:
        wire.send_nowait(F.encode_error(None, type(error).__name__, str(error)))
    except OSError:
        pass


class FrameReader:
    """Reads frames from a socket.

    Staging rule: at a frame start at most 49 bytes (one BufferResponse
    header) are ever requested, and a longer control frame is read only to
    its end. So the staging buffer never holds payload bytes, and every data
    payload lands in its segment with ``recv_into`` and no copy.
    """

    def __init__(self, sock, max_buffer_size, max_control_frame=F.DEFAULT_MAX_CONTROL_FRAME):
        self.sock = sock
        self.max_buffer_size = max_buffer_size
        self.max_control_frame = max_control_frame
        self._buf = bytearray(max(max_control_frame, F.BUFFER_HEADER_SIZE))
        self._mv = memoryview(self._buf)
        self._start = 0
        self._end = 0
        # A time.monotonic() deadline for everything this reader receives
        # (the handshake's): each recv may wait only for what is left of it,
        # so a peer trickling bytes cannot stretch a per-recv timeout forever.
        self.deadline = None

    def _recv(self, view, frame_pos, frame_len):
        if self.deadline is not None:
            _settimeout_until(self.sock, self.deadline)
        try:
            n = self.sock.recv_into(view)
        except socket.timeout:
            if self.sock.gettimeout() is not None:
                raise   # a timeout the caller set (the handshakes): it reports it
            # ETIMEDOUT on a blocking socket: keepalive or TCP_USER_TIMEOUT gave up
            raise ConnectionLostError("connection lost: the peer stopped answering") from None
        except OSError as e:
            raise ConnectionLostError(f"connection lost: {e}") from e
        if n == 0:
            if frame_pos == 0 and frame_len is None:
                raise ConnectionLostError("the peer closed the connection")
            raise ProtocolError(f"truncated frame: the connection closed after {frame_pos} of "
                                f"{frame_len if frame_len is not None else 'at least 9'} bytes")
        return n

    def _stage(self, want, limit, frame_len):
        """Have at least ``want`` bytes staged, reading at most ``limit``."""
        have = self._end - self._start
        if have >= want:
            return
        if self._start:
            self._buf[:have] = self._buf[self._start:self._end]
            self._start, self._end = 0, have
        while self._end < want:
            self._end += self._recv(self._mv[self._end:limit], self._end, frame_len)

    def read_header(self):
        """``(length, msg_id)`` of the next frame (checked against the limits)."""
        self._stage(F.FRAME_HEADER_SIZE, F.BUFFER_HEADER_SIZE, None)
        return F.parse_frame_header(self._mv[self._start:self._start + F.FRAME_HEADER_SIZE],
                                    self.max_buffer_size, self.max_control_frame)

    def read_buffer_header(self, length):
        self._stage(F.BUFFER_HEADER_SIZE, F.BUFFER_HEADER_SIZE, length)
        h = F.parse_buffer_header(length, self._buf, self._start + F.FRAME_HEADER_SIZE)
        self._start += F.BUFFER_HEADER_SIZE
        return h

    def read_body(self, length):
        """Body of a control frame (or an event payload: pass its frame length)."""
        self._stage(length, length, length)
        body = bytes(self._mv[self._start + F.FRAME_HEADER_SIZE:self._start + length])
        self._start += length
        return body

    def read_event(self):
        self._stage(F.EVENT_PAYLOAD.size, F.EVENT_PAYLOAD.size, F.EVENT_PAYLOAD.size)
        kind, aux = F.EVENT_PAYLOAD.unpack_from(self._buf, self._start)
        self._start += F.EVENT_PAYLOAD.size
        return kind, aux

    def read_payload_into(self, buf, size):
        """Receive ``size`` payload bytes straight into ``buf``'s segment.

        One recvmsg_into scatters the payload into the segment and whatever
        follows (at most the next 49-byte header, keeping the staging rule)
        into the staging buffer: one system call per buffer when data flows."""
        got = self._end - self._start
        stage = self._mv[:F.BUFFER_HEADER_SIZE]
        with buf.memory() as full:
            if got:  # cannot happen by the staging rule; kept for safety (at most 48 bytes)
                full[:got] = self._mv[self._start:self._end]
            self._start = self._end = 0
            while got < size:
                with full[got:size] as part:
                    try:
                        n = self.sock.recvmsg_into([part, stage])[0]
                    except OSError as e:
                        raise ConnectionLostError(f"connection lost: {e}") from e
                if n == 0:
                    raise ProtocolError(f"truncated frame: the connection closed after "
                                        f"{F.BUFFER_HEADER_SIZE + got} of {F.BUFFER_HEADER_SIZE + size} bytes")
                got += n
        if got > size:
            self._end = got - size
        stage.release()

    def discard(self, size):
        """Read and drop ``size`` payload bytes (data for a released channel)."""
        scratch = bytearray(min(size, 65536) or 1)
        left = size - (self._end - self._start)
        self._start = self._end = 0
        while left > 0:
            n = self._recv(memoryview(scratch)[:min(left, len(scratch))], size - left, size)
            left -= n

    def read_control(self, length, msg_id):
        return F.decode_control(msg_id, self.read_body(length))


# ---------------------------------------------------------------- handshake

def _settimeout_until(sock, deadline):
    """Give ``sock``'s next call what is left until ``deadline`` (time.monotonic());
    raises socket.timeout when nothing is left."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("deadline passed")
    sock.settimeout(left)


def _send_by(sock, data, deadline):
    if deadline is not None:
        _settimeout_until(sock, deadline)
    sock.sendall(data)


def _mac(secret, label, a, b, mode):
    return hmac.new(secret, label + a + b + bytes([mode]), hashlib.sha256).digest()


def _read_one(reader):
    # a TLS record (handshake, version 3.x) where a frame header belongs: its
    # "length" would be over 300 MB, so no real frame starts this way
    reader._stage(2, F.BUFFER_HEADER_SIZE, None)
    if reader._buf[reader._start] == 0x16 and reader._buf[reader._start + 1] == 0x03:
        raise ProtocolError("the peer speaks TLS and this side was started without tls=: give every process "
                            "of the job the same tls= setting")
    length, msg_id = reader.read_header()
    if msg_id == F.BUFFER_RESPONSE:
        raise ProtocolError("a BufferResponse before authentication")
    return reader.read_control(length, msg_id)


def server_handshake(sock, reader, secret, max_buffer_size, *, deadline=None, admit=None):
    """Challenge the client; returns its flow-control mode (MODE_CREDIT/MODE_TCP).

    ``deadline`` (time.monotonic(), or None for the socket's own timeout)
    bounds the whole handshake: every send and recv gets only the time left,
    and socket.timeout is raised once it has passed; the socket is left
    blocking (no timeout) afterwards. ``admit()``, if given, is called once
    the client has proven the secret and before it is told so (AuthOk); it
    may raise HandshakeRefused, which the client hears as an ErrorResponse."""
    return _within(sock, reader, deadline, _server_handshake, sock, reader, secret, max_buffer_size,
                   deadline, admit)


def _within(sock, reader, deadline, handshake, *args):
    """Run one side of the handshake with every read bounded by ``deadline``;
    afterwards the socket blocks again."""
    if deadline is None:
        return handshake(*args)
    reader.deadline = deadline
    try:
        return handshake(*args)
    finally:
        reader.deadline = None
        try:
            sock.settimeout(None)
        except OSError:
            pass   # already closed: the caller sees why from what was raised


def _server_handshake(sock, reader, secret, max_buffer_size, deadline, admit):
    nonce = os.urandom(F.NONCE_SIZE)
    _send_by(sock, F.encode_challenge(max_buffer_size, nonce), deadline)
    msg = _read_one(reader)
    if type(msg) is not F.AuthResponse:
        raise ProtocolError(f"expected AuthResponse, got {type(msg).__name__} before authentication")
    if msg.version != F.PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {msg.version} not supported (this side speaks {F.PROTOCOL_VERSION})")
    if not hmac.compare_digest(msg.mac, _mac(secret, b"pyflowbuf/1 client", nonce, msg.nonce, msg.mode)):
        try:
            _send_by(sock, F.encode_error(None, "AuthenticationFailed", "authentication failed"), deadline)
        except OSError:
            pass
        raise AuthenticationError("a client failed authentication (wrong shared secret)")
    if admit is not None:
        try:
            admit()
        except HandshakeRefused as e:
            try:
                _send_by(sock, F.encode_error(None, e.error_kind, e.message), deadline)
            except OSError:
                pass
            raise
    _send_by(sock, F.encode_auth_ok(_mac(secret, b"pyflowbuf/1 server", msg.nonce, nonce, msg.mode)), deadline)
    return msg.mode


def client_handshake(sock, reader, secret, mode, *, deadline=None):
    """Answer the server's challenge and check its proof; returns the server's
    maximum buffer size.

    ``deadline`` (time.monotonic(), or None for the socket's own timeout)
    bounds the whole handshake as in ``server_handshake``: a server that
    trickles its challenge a byte at a time cannot hold the consumer past it.
    socket.timeout is raised once it has passed; the socket is left blocking
    (no timeout) afterwards."""
    return _within(sock, reader, deadline, _client_handshake, sock, reader, secret, mode, deadline)


def _client_handshake(sock, reader, secret, mode, deadline):
    msg = _read_one(reader)
    if type(msg) is F.ErrorResponse:
        raise ProtocolError(f"server refused the connection: {msg.error_kind}: {msg.message}")
    if type(msg) is not F.Challenge:
        raise ProtocolError(f"expected Challenge, got {type(msg).__name__}")
    if msg.version != F.PROTOCOL_VERSION:
        raise ProtocolError(f"server speaks protocol version {msg.version}, this side {F.PROTOCOL_VERSION}")
    nonce = os.urandom(F.NONCE_SIZE)
    _send_by(sock, F.encode_auth_response(mode, nonce, _mac(secret, b"pyflowbuf/1 client", msg.nonce, nonce, mode)),
             deadline)
    ok = _read_one(reader)
    if type(ok) is F.ErrorResponse:
        if ok.error_kind != "AuthenticationFailed":   # authenticated, but turned away (e.g. TooManyConnections)
            raise RemoteError(f"server refused the connection: {ok.error_kind}: {ok.message}", ok.error_kind)
        raise AuthenticationError(f"server rejected authentication: {ok.message} (wrong shared secret?)")
    if type(ok) is not F.AuthOk:
        raise ProtocolError(f"expected AuthOk, got {type(ok).__name__}")
    if not hmac.compare_digest(ok.mac, _mac(secret, b"pyflowbuf/1 server", nonce, msg.nonce, mode)):
        raise AuthenticationError("the server failed authentication (wrong shared secret)")
    return msg.max_buffer_size

