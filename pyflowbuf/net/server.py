"""The producer side of the remote exchange: NetworkServer exports
ResultSubpartitions (BufferQueues) and ships their buffers to remote
InputChannels over one TCP connection per consumer process."""
from __future__ import annotations

import collections
import errno
import logging
import socket
import threading
import time

from pyflowbuf._core import netio
from pyflowbuf._core.channel import BufferQueue, InputGate
from pyflowbuf._core.events import BARRIER, END_OF_PARTITION
from pyflowbuf._core.memory import DEFAULT_SEGMENT_SIZE, Notifier
from pyflowbuf.errors import (AuthenticationError, CancelledError, ConnectionLostError, FlowBufError,
                              ProtocolError, RemoteError)
from pyflowbuf.net import frames as F
from pyflowbuf.net import protocol as P
from pyflowbuf.net import tls as T
from pyflowbuf.net.credit import BACKLOG, DATA, EVENT, SenderView

log = logging.getLogger("pyflowbuf.net")

_MAX_BATCH_BUFFERS = 16
_SAFETY_WAKE_S = 1.0
# A pending handshake is never evicted younger than this (nor than the
# handshake timeout): a real client answers the challenge within one round
# trip, so it always completes while slow clients are evicted around it.
_EVICTION_GRACE_S = 0.5
# accept() failing for want of descriptors or memory fails again at once:
# back off instead of spinning while other connections release theirs.
_ACCEPT_BACKOFF_S = 0.05
_ACCEPT_RESOURCE_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
_MAX_ERRORS = 256


class _Export:
    __slots__ = ("partition_id", "subpartition", "queue", "kind", "on_release", "on_buffer_size",
                 "state", "buffer_size")

    def __init__(self, partition_id, subpartition, queue, kind, on_release, on_buffer_size):
        self.partition_id = partition_id
        self.subpartition = subpartition
        self.queue = queue
        self.kind = kind
        self.on_release = on_release
        self.on_buffer_size = on_buffer_size
        self.state = "ready"      # -> consuming -> finished | released
        self.buffer_size = None


class NetworkServer:
    """Exports subpartitions to consumers in other processes.

    ``export(partition_id, subpartition, queue)`` makes a BufferQueue (the one a
    RecordWriter fills) requestable by ``(partition_id, subpartition)``; a
    consumer's ConnectionManager then sends a PartitionRequest and the server
    streams the queue's buffers as they are finished, against the consumer's
    credit. Each subpartition is consumed once, as in Flink's pipelined
    partitions; once its end-of-partition is sent it is done.

    If the consumer goes away (connection lost, protocol error, cancel) before
    end-of-partition, the queue is cancelled and ``on_release(exc)`` of the
    export (or the server's ``on_error(partition_id, subpartition, exc)``) is
    called: the runtime should then cancel the producing task (e.g.
    ``RecordWriter.cancel()``), which would otherwise wait forever for its
    buffers to be recycled.

    Listens on 127.0.0.1 unless ``host`` says otherwise; between hosts pass the
    interface address (or "0.0.0.0") and give consumers ``(host, port)``.
    Only peers that prove knowledge of ``secret`` (HMAC-SHA256 challenge-response)
    can request anything.

    Connection limits: a client must finish the handshake within
    ``handshake_timeout`` seconds of being accepted (a deadline for the whole
    handshake, not per read; None: no deadline). Only authenticated
    connections count against ``max_connections``; one more that
    authenticates is refused with a TooManyConnections ErrorResponse (the
    consumer sees RemoteError). Connections still in the handshake are
    bounded separately by ``max_pending_handshakes``: when that many are
    pending, the oldest one is dropped for the newcomer (once it has had
    min(0.5 s, handshake_timeout) to answer), so clients that never
    authenticate cannot starve those that do, however often they reconnect.
    Threads and sockets are thus at most ``max_connections +
    max_pending_handshakes`` plus the acceptor.

    ``errors`` holds ``(peer, exception)`` of the latest connections that
    failed (at most 256).
    """

    def __init__(self, secret, host="127.0.0.1", port=0, *, max_buffer_size=DEFAULT_SEGMENT_SIZE,
                 dead_peer_timeout=P.DEFAULT_DEAD_PEER_TIMEOUT,
                 handshake_timeout=P.DEFAULT_HANDSHAKE_TIMEOUT, max_connections=256,
                 max_pending_handshakes=64, on_error=None, tls=None):
        self._secret = P.check_secret(secret)
        self.tls = _check_tls(tls)
        if handshake_timeout is not None and not (_is_number(handshake_timeout) and handshake_timeout > 0):
            raise ValueError(f"handshake_timeout must be a number > 0 or None, got {handshake_timeout!r}")
        if not _is_int(max_connections) or max_connections < 1:
            raise ValueError(f"max_connections must be an int >= 1, got {max_connections!r}")
        if not _is_int(max_pending_handshakes) or max_pending_handshakes < 1:
            raise ValueError(f"max_pending_handshakes must be an int >= 1, got {max_pending_handshakes!r}")
        self.host = host
        self._port = port
        self.max_buffer_size = int(max_buffer_size)
        self.dead_peer_timeout = dead_peer_timeout
        self.handshake_timeout = handshake_timeout
        self.max_connections = max_connections
        self.max_pending_handshakes = max_pending_handshakes
        self.on_error = on_error
        self._exports = {}
        self._lock = threading.Lock()
        # notified whenever a pending handshake ends (admitted or gone): the
        # acceptor waits on it for room
        self._room = threading.Condition(self._lock)
        self._conns = set()          # every connection with a thread, under _lock
        # connection -> accept time, in accept order; until its thread ends or it is admitted
        self._pending = {}
        self._active = set()         # authenticated: what max_connections counts
        self._sock = None
        self._acceptor = None
        self._closed = False
        # Bounded: clients that keep failing the handshake would otherwise grow
        # it without end (and each exception's traceback holds its connection).
        self.errors = collections.deque(maxlen=_MAX_ERRORS)
        self._buffers_sent = 0    # of connections already closed
        self._bytes_sent = 0
        self._announcements = 0
        self._parks = 0
        self._credit_parks = 0

    # ------------------------------------------------------------ lifecycle
    def start(self):
        """Bind and listen; returns the ``(host, port)`` consumers connect to."""
        if self._sock is not None:
            return self.address
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, self._port))
        s.listen(64)
        self._sock = s
        self._acceptor = threading.Thread(target=self._accept_loop, name="pyflowbuf-net-accept", daemon=True)
        self._acceptor.start()
        return self.address

    @property
    def address(self):
        if self._sock is None:
            raise RuntimeError("the server is not started")
        return self._sock.getsockname()[:2]

    def close(self):
        """Stop accepting, close every connection (open subpartitions are
        released with CancelledError)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True   # under the lock: the acceptor adds no connection after this
            conns = list(self._conns)
            self._room.notify_all()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        for c in conns:
            c.close(CancelledError("the NetworkServer was closed"))
        if self._acceptor is not None:
            self._acceptor.join(5)
        for c in conns:
            c.join(5)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ exports
    def export(self, partition_id, subpartition, queue, *, kind="bytes", allow_pickle=False,
               on_release=None, on_buffer_size=None):
        """Make ``queue`` requestable as ``(partition_id, subpartition)``.

        ``kind`` is the record kind the stream carries; a consumer must request
        the same kind. Streams of pickled Python objects cross the network only
        with ``allow_pickle=True`` here and on the consumer.
        ``on_buffer_size(size)`` receives the consumer's NewBufferSize
        announcements (buffer debloating)."""
        if not isinstance(queue, BufferQueue):
            raise TypeError(f"queue must be a BufferQueue, got {type(queue).__name__}")
        if not isinstance(partition_id, str) or not 0 < len(partition_id.encode()) <= F.MAX_PARTITION_ID:
            raise ValueError(f"partition_id must be a non-empty str of at most {F.MAX_PARTITION_ID} bytes")
        if not isinstance(subpartition, int) or not 0 <= subpartition < 1 << 31:
            raise ValueError(f"subpartition must be an int >= 0, got {subpartition!r}")
        if kind == "pickle" and not allow_pickle:
            raise ValueError("a pickle stream would send pickled Python objects over the network; "
                             "pass allow_pickle=True (and trust every consumer) to export it")
        if queue.network_pool.segment_size > self.max_buffer_size:
            raise ValueError(f"segments of {queue.network_pool.segment_size} B exceed the server's "
                             f"max_buffer_size={self.max_buffer_size}")
        key = (partition_id, subpartition)
        with self._lock:
            if key in self._exports and self._exports[key].state in ("ready", "consuming"):
                raise ValueError(f"{key} is already exported")
            self._exports[key] = _Export(partition_id, subpartition, queue, kind, on_release, on_buffer_size)

    def unexport(self, partition_id, subpartition):
        with self._lock:
            ex = self._exports.get((partition_id, subpartition))
            if ex is not None and ex.state != "consuming":
                del self._exports[(partition_id, subpartition)]

    def export_state(self, partition_id, subpartition):
        """"ready", "consuming", "finished", "released" or None."""
        ex = self._exports.get((partition_id, subpartition))
        return None if ex is None else ex.state

    def _claim(self, req):
        """The export a PartitionRequest asks for, or an ErrorResponse frame."""
        with self._lock:
            ex = self._exports.get((req.partition_id, req.subpartition))
            if ex is None:
                return None, F.encode_error(req.receiver_id, "PartitionNotFound",
                                            f"partition {req.partition_id!r} subpartition {req.subpartition} "
                                            "is not exported here")
            if ex.state != "ready":
                return None, F.encode_error(req.receiver_id, "PartitionAlreadyConsumed",
                                            f"{(req.partition_id, req.subpartition)} is {ex.state}")
            if req.kind != ex.kind:
                return None, F.encode_error(req.receiver_id, "KindMismatch",
                                            f"the consumer reads {req.kind!r} records but "
                                            f"{(req.partition_id, req.subpartition)} carries {ex.kind!r}")
            ex.state = "consuming"
            return ex, None

    def _release(self, ex, exc):
        """A consumer stopped before end-of-partition."""
        with self._lock:
            if ex.state != "consuming":
                return
            ex.state = "released"
        q = ex.queue
        q.cancel()
        while True:   # nobody will consume what is queued: give the segments back
            x = q.pop_buffer()
            if x is None:
                break
            if type(x) is not tuple:
                x.recycle()
        for cb, args in ((ex.on_release, (exc,)), (self.on_error, (ex.partition_id, ex.subpartition, exc))):
            if cb is not None:
                try:
                    cb(*args)
                except Exception:  # a broken callback must not take the I/O thread down
                    log.exception("on_release/on_error callback failed")

    def _finished(self, ex):
        with self._lock:
            ex.state = "finished"

    # ------------------------------------------------------------ accepting
    def _accept_loop(self):
        while not self._closed:
            try:
                sock, peer = self._sock.accept()
            except OSError as e:
                if self._closed:
                    return
                if e.errno in _ACCEPT_RESOURCE_ERRNOS:
                    time.sleep(_ACCEPT_BACKOFF_S)
                continue
            accepted = time.monotonic()
            with self._lock:
                room = self._make_room()
            if not room:
                sock.close()
                return
            try:
                conn = _ServerConnection(self, sock, peer, accepted)
            except Exception:   # e.g. no descriptor left for its Notifier: the acceptor must live on
                log.exception("pyflowbuf.net: cannot serve a connection from %s", peer)
                sock.close()
                time.sleep(_ACCEPT_BACKOFF_S)
                continue
            with self._lock:   # only this thread adds: the room made above is still there
                if self._closed:
                    conn.wire.close()
                    return
                self._pending[conn] = accepted
                self._conns.add(conn)
            conn.start()

    def _make_room(self):
        """Wait (under _lock) until a pending handshake may start, evicting the
        oldest pending one once it has had its grace time; False if the
        server closed meanwhile.

        Evicted connections stay in _pending until their thread ends, so
        there are never more than max_pending_handshakes handshake threads.
        Every pass evicts one connection or waits, so the acceptor never spins."""
        grace = _EVICTION_GRACE_S
        if self.handshake_timeout is not None:
            grace = min(grace, self.handshake_timeout)
        while not self._closed and len(self._pending) >= self.max_pending_handshakes:
            oldest = next((c for c in self._pending if not c.closed), None)
            if oldest is None:   # all already dropped: their threads are ending
                self._room.wait(_SAFETY_WAKE_S)
                continue
            age = time.monotonic() - self._pending[oldest]
            if age < grace:
                self._room.wait(grace - age)
                continue
            # close() only shuts the socket down and wakes the pump: safe under
            # the lock, and it keeps _admit from letting the victim in meanwhile
            oldest.close(ProtocolError(
                f"the client had not authenticated {age:.2f} s after it was accepted while "
                f"max_pending_handshakes={self.max_pending_handshakes} handshakes were pending; "
                "dropped for a newer connection"))
            self._room.wait(_SAFETY_WAKE_S)
        return not self._closed

    def _admit(self, conn):
        """The handshake's ``admit``: move ``conn`` from pending to
        authenticated if max_connections allows."""
        with self._lock:
            if conn.closed:   # evicted or the server closed: the socket is already shut down
                raise ConnectionLostError("the connection was closed during the handshake")
            if len(self._active) >= self.max_connections:
                raise P.HandshakeRefused(
                    "TooManyConnections",
                    f"the producer already serves max_connections={self.max_connections} consumer connections")
            del self._pending[conn]
            self._active.add(conn)
            conn.authenticated = True
            self._room.notify_all()

    def _forget(self, conn):
        with self._lock:
            self._conns.discard(conn)
            self._active.discard(conn)
            if self._pending.pop(conn, None) is not None:
                self._room.notify_all()

    @property
    def connections(self):
        """Open connections, authenticated or still in the handshake."""
        return len(self._conns)

    def stats(self):
        """Connections and views open now (``pending_handshakes``: connections
        not yet authenticated); buffers and bytes sent in total."""
        with self._lock:
            conns = list(self._conns)
            pending = len(self._pending)
        return {"connections": len(conns), "pending_handshakes": pending,
                "views": sum(len(c.views) for c in conns),
                "buffers_sent": self._buffers_sent + sum(c.buffers_sent for c in conns),
                "bytes_sent": self._bytes_sent + sum(c.bytes_sent for c in conns),
                "writer_parks": self._parks + sum(c.pump.parks for c in conns),
                "writer_credit_parks": self._credit_parks + sum(c.pump.credit_parks for c in conns),
                "backlog_announcements": self._announcements + sum(c.announcements for c in conns)}


class _ServerConnection:
    """One consumer process, served by one thread: the handshake, then a
    SendPump that sends buffers against credit and applies AddCredit without
    the GIL, parked on the socket and the writer's Notifier at once. It comes
    back to Python for every other frame the consumer sends (requests,
    cancel, close), and for events, the priority lane, backlog announcements
    and views opened or cancelled."""

    def __init__(self, server, sock, peer, accepted):
        self.server = server
        # with TLS the loops below use the TLS socket (or the relay's local end) as they use a TCP socket
        self.tcp = sock
        self.tls = None if server.tls is None else T.wrap(sock, server.tls, server_side=True, peer=peer)
        if self.tls is not None:
            sock = self.tls.local
        self.sock = sock
        self.peer = peer
        self.accepted = accepted  # time.monotonic(): the handshake deadline counts from here
        self.authenticated = False
        self.views = {}
        self._views_version = None
        self.notifier = Notifier()
        self.wire = netio.Wire(sock)
        self.pump = netio.SendPump(self.wire, self.notifier)
        self.closed = False
        self.credit_based = True
        self.error = None
        self._buffers_sent = 0    # by the Python path; the pump counts its own
        self._bytes_sent = 0
        self.announcements = 0
        self._thread = threading.Thread(target=self._run, name=f"pyflowbuf-net-srv-{peer}", daemon=True)

    @property
    def buffers_sent(self):
        return self._buffers_sent + self.pump.buffers_sent

    @property
    def bytes_sent(self):
        return self._bytes_sent + self.pump.bytes_sent

    def start(self):
        self._thread.start()

    def join(self, timeout):
        self._thread.join(timeout)

    def close(self, exc=None):
        if self.closed:
            return
        self.closed = True
        self.error = exc
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self.tls is not None:
            self.tls.close()
        self.pump.close()

    def _send(self, data):
        self.wire.send(data)

    # ------------------------------------------------------------ the loop
    def _run(self):
        srv = self.server
        exc = None
        try:
            P.configure_socket(self.tcp, srv.dead_peer_timeout)
            reader = P.FrameReader(self.sock, srv.max_buffer_size)
            deadline = None if srv.handshake_timeout is None else self.accepted + srv.handshake_timeout
            if self.tls is not None:   # TLS first, then the HMAC challenge inside it (attempt fencing)
                self.tls.handshake(deadline)
                self.tls.start()
            mode = P.server_handshake(self.sock, reader, srv._secret, srv.max_buffer_size,
                                      deadline=deadline, admit=lambda: srv._admit(self))
            self.credit_based = mode == F.MODE_CREDIT
            if not self.pump.reads_credit:
                raise FlowBufError("this system offers no pollable wake-up (eventfd or pipe) for the network writer")
            pump = self.pump
            while not self.closed:
                if pump.take_dirty():
                    pump.set_views(list(self.views.values()))
                # buffers out, AddCredit in, GIL released
                rc = pump.run(_SAFETY_WAKE_S, reader)
                if rc == netio.CLOSED:
                    break
                if rc == netio.FRAME:
                    length, msg_id = reader.read_header()
                    if msg_id == F.BUFFER_RESPONSE:
                        raise ProtocolError("a consumer sent a BufferResponse")
                    self._handle(reader.read_control(length, msg_id))
                    continue
                # an event, the priority lane, a backlog announcement, a
                # cancelled view, or a safety wake-up: one pass in Python
                self._python_pass()
                pump.set_views(list(self.views.values()))
        except _Closed:
            pass
        except P.HandshakeRefused as e:
            log.warning("pyflowbuf.net: refused an authenticated client %s: %s", self.peer, e)
        except socket.timeout:
            if self.authenticated:   # ETIMEDOUT from the kernel (keepalive): no timeout is set after the handshake
                exc = ConnectionLostError("connection lost: the peer stopped answering")
            else:
                exc = ProtocolError(f"the client did not authenticate within {srv.handshake_timeout} s")
        except (FlowBufError, OSError) as e:
            exc = e if isinstance(e, FlowBufError) else ConnectionLostError(f"connection lost: {e}")
            if isinstance(e, ProtocolError) and not isinstance(e, AuthenticationError):
                P.tell_peer(self.wire, e)
        except Exception as e:  # a bug: still tear down cleanly
            log.exception("server connection failed")
            exc = e
        finally:
            self._teardown(exc)

    def _handle(self, msg):
        t = type(msg)
        if t is F.AddCredit:
            v = self.views.get(msg.receiver_id)
            if v is not None:   # credit for a view already finished is dropped
                v.add_credit(msg.credit)
                self.notifier.notify()
        elif t is F.PartitionRequest:
            self._open_view(msg)
        elif t is F.CancelPartitionRequest:
            v = self.views.get(msg.receiver_id)
            if v is not None:   # the writer releases it (it owns the view's buffers)
                v.cancelled = CancelledError("the consumer cancelled the partition request")
                self.pump.mark_dirty()
        elif t is F.ResumeConsumption:
            v = self.views.get(msg.receiver_id)
            if v is not None:
                v.resume()
                self.notifier.notify()
        elif t is F.NewBufferSize:
            v = self.views.get(msg.receiver_id)
            if v is not None:
                v.export.buffer_size = msg.size
                # the producer's RecordWriter caps the next buffers of this
                # subpartition at it (at most a segment; a record never waits on it)
                v.export.queue.buffer_size = msg.size
                if v.export.on_buffer_size is not None:
                    try:
                        v.export.on_buffer_size(msg.size)
                    except Exception:
                        log.exception("on_buffer_size callback failed")
        elif t is F.CloseRequest:
            raise _Closed()
        elif t is F.ErrorResponse:
            raise RemoteError(f"the consumer reported: {msg.error_kind}: {msg.message}", msg.error_kind)
        else:
            raise ProtocolError(f"unexpected {t.__name__} from a consumer")

    def _open_view(self, req):
        if req.receiver_id in self.views:
            raise ProtocolError("duplicate receiver id in PartitionRequest")
        ex, err = self.server._claim(req)
        if ex is None:
            self._send(err)
            return
        v = SenderView(ex.queue, req.receiver_id, req.subpartition, req.credit, self.credit_based,
                       bool(req.flags & F.FLAG_BLOCK_ON_BARRIER))
        v.export = ex
        # An InputGate is the only way to make the queue's pushes notify this
        # connection's writer; the gate itself is never read.
        v.gate_ref = InputGate([ex.queue], self.notifier)
        self.views[req.receiver_id] = v
        self._views_version = object()
        self.pump.mark_dirty()

    # ------------------------------------------------------------ writing
    def _python_pass(self):
        parts, bufs, done = self._collect()
        if not parts:
            return
        nbytes = 0
        for b in bufs:
            nbytes += b.size
        try:
            self.wire.sendmsg(parts)
        except BaseException as e:
            for v in done:   # their end-of-partition never left
                self.server._release(v.export, ConnectionLostError(f"connection lost: {e}"))
            raise
        finally:
            for mv in parts:
                if type(mv) is memoryview:
                    mv.release()
            for b in bufs:
                b.release()
        self._buffers_sent += len(bufs)
        self._bytes_sent += nbytes
        for v in done:
            self.server._finished(v.export)

    def _collect(self):
        """One gathered send: round robin over the views, one frame per view
        per round, so a view without credit never holds up the others."""
        parts, bufs, done = [], [], []
        views = self.views
        progress = True
        while progress and len(bufs) < _MAX_BATCH_BUFFERS:
            progress = False
            for v in list(views.values()):
                if v.cancelled is not None:
                    v.release()
                    views.pop(v.receiver_id, None)
                    self.server._release(v.export, v.cancelled)
                    continue
                out = v.poll()
                if out is None:
                    continue
                progress = True
                what, item, seq, backlog, prio = out
                if what == DATA:
                    dt = F.TYPE_CODES[item.data_type] | (F.PRIORITY_BIT if prio else 0)
                    parts.append(F.encode_buffer_header(v.receiver_id, v.subpartition, seq, backlog, dt,
                                                        item.size, item.width, item.flags))
                    parts.append(memoryview(item))
                    bufs.append(item)
                elif what == EVENT:
                    kind, aux, flags = item
                    if kind == BARRIER:
                        _barrier_passed(v, aux, prio)
                    parts.append(F.encode_event(v.receiver_id, v.subpartition, seq, backlog, kind, aux, flags, prio))
                    if kind == END_OF_PARTITION:
                        v.finished = True
                        del views[v.receiver_id]
                        done.append(v)
                elif what == BACKLOG:
                    parts.append(F.encode_backlog_announcement(backlog, v.receiver_id))
                    self.announcements += 1
        return parts, bufs, done

    def _teardown(self, exc):
        self.close(exc)
        exc = self.error or exc   # why we closed it, if we did, beats what recv saw then
        exc = T.explain(self.tls, exc)
        if exc is not None and not isinstance(exc, CancelledError):
            if not self.authenticated:
                # anyone who can connect causes these; their tracebacks would
                # keep this connection's reader and socket objects alive
                exc = exc.with_traceback(None)
            self.server.errors.append((self.peer, exc))
            if self.views:
                log.warning("pyflowbuf.net: connection from %s failed: %s", self.peer, exc)
        lost = exc if exc is not None else CancelledError("the consumer closed the connection")
        for v in list(self.views.values()):
            self.views.pop(v.receiver_id, None)
            if not v.finished:
                v.release()
                self.server._release(v.export, lost)
        self.wire.close()
        if self.tls is not None:
            self.tls.release()
        with self.server._lock:
            self.server._buffers_sent += self.buffers_sent
            self.server._bytes_sent += self.bytes_sent
            self.server._announcements += self.announcements
            self.server._parks += self.pump.parks
            self.server._credit_parks += self.pump.credit_parks
        self.server._forget(self)


def _barrier_passed(view, checkpoint_id, prio):
    """Barrier ``checkpoint_id`` leaves this sender: tell the producer what it
    overtook here (copies of the buffers still queued before it, its in-flight
    output for an unaligned checkpoint), or that an aligned one passed with
    nothing overtaken. Runs on the sender thread right after the barrier was
    taken, so the queue's head has not moved since."""
    sink = view.queue.overtaken_sink
    if sink is None:
        return
    if not prio:
        sink(checkpoint_id, None)
        return
    k = view.queue.overtaken(view.event_mark)
    if k >= 0:          # negative: the aligned barrier went first, it told already
        sink(checkpoint_id, view.queue.copy_front(k))


def _check_tls(tls):
    if tls is None:
        return None
    if not isinstance(tls, T.TLSConfig):
        raise TypeError(f"tls must be a pyflowbuf.net.TLSConfig or None, got {tls!r}")
    T.require_ssl()
    return tls


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class _Closed(Exception):
    """The consumer sent CloseRequest."""
