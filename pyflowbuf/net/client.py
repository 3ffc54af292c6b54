"""The consumer side of the remote exchange: a ConnectionManager keeps one
TCP connection per producer address and feeds RemoteInputChannels, each of
which delivers into a local BufferQueue that the consumer's InputGate reads."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

from pyflowbuf._core import netio
from pyflowbuf._core.channel import BufferQueue
from pyflowbuf._core.events import BARRIER, END_OF_PARTITION
from pyflowbuf._core.memory import LocalBufferPool, NetworkBufferPool, Notifier
from pyflowbuf.errors import (CancelledError, ChannelClosedError, ConnectionLostError, FlowBufError,
                              PartitionNotFoundError, ProtocolError, RemoteError)
from pyflowbuf.net import frames as F
from pyflowbuf.net import protocol as P
from pyflowbuf.net import tls as T
from pyflowbuf.net.credit import ReceiverCredit

log = logging.getLogger("pyflowbuf.net")

DEFAULT_EXCLUSIVE_BUFFERS = 2
DEFAULT_FLOATING_BUFFERS = 8
_RELEASED_MEMORY = 4096
_POLL_S = 0.2     # a wait bound used only while some channel lacks buffers
_BUFFER_FULL = F._BUFFER_FULL
_TYPE_NAMES = ("records", "fixed")


class RemoteInputChannel:
    """One InputChannel fed from a producer subpartition in another process.

    State: "requested" (PartitionRequest sent) -> "receiving" -> "finished"
    (end-of-partition arrived) | "failed" | "cancelled". On failure ``error``
    holds a typed exception, the local queue (and the attached gate, see
    ``attach_gate``) is cancelled so the consumer's reader stops with
    CancelledError, and ``on_error(channel, exc)`` is called.
    """

    def __init__(self, manager, conn, partition_id, subpartition, queue, credit, kind, flags, on_error,
                 request_timeout):
        self.manager = manager
        self.connection = conn
        self.partition_id = partition_id
        self.subpartition = subpartition
        self.queue = queue
        self.credit = credit
        self.kind = kind
        self.flags = flags
        self.on_error = on_error
        self.receiver_id = os.urandom(16)
        credit.bind(self.receiver_id, queue)
        self._state = "requested"
        self.error = None
        self.events_received = 0
        # where each aligned barrier went into the local queue: a priority
        # barrier of the same checkpoint (the alignment timeout converted it)
        # overtakes only what came before that one
        self.barrier_marks = {}
        self.gate = None
        self._deadline = time.monotonic() + request_timeout
        self._backoff = 0.02
        self.retry_at = None
        self._released = False

    @property
    def address(self):
        return self.connection.address

    # the receive loop keeps these with the credit (one place, no GIL needed)
    @property
    def state(self):
        if self._state == "requested" and self.credit.buffers_received:
            self._state = "receiving"
        return self._state

    @state.setter
    def state(self, value):
        self._state = value

    @property
    def expected_seq(self):
        return self.credit.expected_seq

    @expected_seq.setter
    def expected_seq(self, value):
        self.credit.expected_seq = value

    @property
    def buffers_received(self):
        return self.credit.buffers_received

    @buffers_received.setter
    def buffers_received(self, value):
        self.credit.buffers_received = value

    @property
    def bytes_received(self):
        return self.credit.bytes_received

    @bytes_received.setter
    def bytes_received(self, value):
        self.credit.bytes_received = value

    @property
    def active(self):
        return self.state in ("requested", "receiving")

    def attach_gate(self, gate):
        """Cancel ``gate`` too when this channel fails, so a RecordReader
        blocked on it raises instead of waiting for data that cannot come."""
        self.gate = gate
        if self.state == "failed":
            gate.cancel()

    def check(self):
        """Raise the channel's error, if it failed."""
        if self.error is not None:
            raise self.error

    def cancel(self):
        """Stop consuming: tell the producer, give the reserved buffers back."""
        if not self.active:
            return
        self.state = "cancelled"
        self.connection.forget(self)
        try:
            self.connection.send(F.encode_cancel(self.receiver_id))
        except (OSError, FlowBufError):
            pass
        self.manager._retire(self)

    def resume_consumption(self):
        """After an aligned barrier with ``block_on_barrier``: let the producer
        send again (Flink's ResumeConsumption)."""
        self.connection.send(F.encode_resume(self.receiver_id))

    def announce_buffer_size(self, size):
        """Buffer debloating: tell the producer the buffer size this channel wants."""
        self.connection.send(F.encode_new_buffer_size(size, self.receiver_id))

    def _fail(self, exc):
        if not self.active:
            return
        self.state = "failed"
        self.error = exc
        cb = self.on_error if self.on_error is not None else self.manager.on_error
        if cb is not None:   # before the reader wakes, so the error is recorded when it raises
            try:
                cb(self, exc)
            except Exception:
                log.exception("on_error callback failed")
        self.queue.cancel()
        if self.gate is not None:
            self.gate.cancel()
        self.manager._retire(self)

    def __repr__(self):
        return (f"RemoteInputChannel({self.partition_id!r}[{self.subpartition}] @ {self.address}, "
                f"{self.state}, received={self.buffers_received})")


class _ClientConnection:
    """The one connection to a producer process, and its reader thread."""

    def __init__(self, manager, address, sock, reader, max_buffer_size):
        self.manager = manager
        self.address = address
        self.sock = sock
        self.tls = None           # with TLS: the CoreTLS (or TLSRelay) whose ``local`` is ``sock``
        self.max_buffer_size = max_buffer_size
        reader.max_buffer_size = max_buffer_size   # the handshake's reader, with what it may hold staged
        self.reader = reader
        self.channels = {}
        self._released_ids = {}
        self.wire = netio.Wire(sock)
        # credit mode: data frames are received by a GIL-free loop
        self.pump = (netio.ReceivePump(self.wire, manager._wake, max_buffer_size, manager.notifier)
                     if manager.credit_based else None)
        self._version = 0         # bumped whenever the set of channels changes
        self._pump_version = -1
        self.closed = False
        self.error = None
        self.credit_error = None  # the first AddCredit that could not be sent (the control thread's)
        self._thread = threading.Thread(target=self._read_loop, name=f"pyflowbuf-net-cli-read-{address}",
                                        daemon=True)

    def send(self, data):
        if self.closed:
            raise ChannelClosedError(f"the connection to {self.address} is closed") from self.error
        self.wire.send(data)

    def add(self, ch):
        self.channels[ch.receiver_id] = ch
        self._version += 1

    def forget(self, ch):
        ch.credit.detach()
        self.channels.pop(ch.receiver_id, None)
        self._version += 1
        self._released_ids[ch.receiver_id] = None
        if len(self._released_ids) > _RELEASED_MEMORY:
            self._released_ids.pop(next(iter(self._released_ids)))

    def close(self, exc=None):
        if self.closed:
            return
        self.closed = True
        self.error = exc
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # ------------------------------------------------------------ reading
    def _read_loop(self):
        exc = None
        pump = self.pump
        try:
            while not self.closed:
                if pump is not None:
                    if self._pump_version != self._version:
                        self._pump_version = self._version
                        pump.set_channels([ch.credit for ch in list(self.channels.values())])
                    pump.run(self.reader)   # data frames, GIL released; returns at anything else
                self._read_one()
        except (FlowBufError, OSError) as e:
            exc = e if isinstance(e, FlowBufError) else ConnectionLostError(f"connection lost: {e}")
            if isinstance(e, ProtocolError):
                P.tell_peer(self.wire, e)
        except Exception as e:
            log.exception("client reader failed")
            exc = e
        finally:
            self._teardown(exc)

    def _read_one(self):
        r = self.reader
        r._stage(F.FRAME_HEADER_SIZE, F.BUFFER_HEADER_SIZE, None)
        start = r._start
        if r._end - start >= F.BUFFER_HEADER_SIZE and r._buf[start + 8] == F.BUFFER_RESPONSE:
            # fast path for the common frame: one unpack, the checks inline; anything
            # odd goes through parse_frame_header/parse_buffer_header for its error
            (length, magic, _, rid, sub, seq, backlog, dt, comp, size, width,
             flags) = _BUFFER_FULL.unpack_from(r._buf, start)
            base = dt & 0x7F
            if (magic != F.MAGIC or comp or length != F.BUFFER_HEADER_SIZE + size or size > r.max_buffer_size
                    or base > F.DATA_EVENT or sub < 0 or seq < 0 or backlog < 0
                    or (base == F.DATA_EVENT and size != F.EVENT_PAYLOAD.size)
                    or (base == F.DATA_FIXED and width <= 0)):
                length, msg_id = r.read_header()
                r.read_buffer_header(length)
                raise ProtocolError("malformed BufferResponse")  # not reached: the parsers raise
            r._start = start + F.BUFFER_HEADER_SIZE
        else:
            length, msg_id = r.read_header()
            if msg_id != F.BUFFER_RESPONSE:
                return self._read_control(r.read_control(length, msg_id))
            rid, sub, seq, backlog, dt, comp, size, width, flags, _ = r.read_buffer_header(length)
        ch = self.channels.get(rid)
        if ch is None:
            if rid in self._released_ids:
                r.discard(size)      # in flight when we cancelled
                return
            raise ProtocolError("BufferResponse for an unknown receiver id")
        if seq != ch.expected_seq:
            raise ProtocolError(f"sequence gap on {ch.partition_id!r}[{ch.subpartition}]: "
                                f"expected buffer #{ch.expected_seq}, got #{seq}")
        ch.expected_seq = (seq + 1) & 0x7FFFFFFF
        ch.state = "receiving"
        prio = dt > 0x7F
        if dt & 0x7F == F.DATA_EVENT:
            kind, aux = r.read_event()
            ch.events_received += 1
            if kind == END_OF_PARTITION:
                ch.state = "finished"     # before the consumer can see the end
                self.forget(ch)
                ch.queue.push_event(kind, aux, flags, prio)
                self.manager._retire(ch)
                return
            if kind == BARRIER:
                self._push_barrier(ch, aux, flags, prio)
            else:
                ch.queue.push_event(kind, aux, flags, prio)
        else:
            self._receive_data(ch, size, dt & 0x7F, width, flags, prio)
        cr = ch.credit
        cr.backlog = backlog
        fp = cr.floating_pool
        if fp is not None and cr.available < backlog + cr.initial_credit and fp.available:
            self.manager._poke()
        elif cr.granted - cr.taken <= cr.low_water:
            self.manager._wake.notify()

    @staticmethod
    def _push_barrier(ch, checkpoint_id, flags, prio):
        marks = ch.barrier_marks
        if not prio:
            marks[checkpoint_id] = ch.queue.push_position
            if len(marks) > 8:
                del marks[min(marks)]
            ch.queue.push_event(BARRIER, checkpoint_id, flags, False)
        else:
            ch.queue.push_event(BARRIER, checkpoint_id, flags, True, marks.get(checkpoint_id, -1))

    def _read_control(self, msg):
        t = type(msg)
        if t is F.BacklogAnnouncement:
            ch = self.channels.get(msg.receiver_id)
            if ch is not None:
                ch.credit.backlog = msg.backlog
                self.manager._poke()
        elif t is F.ErrorResponse:
            if msg.receiver_id is None:
                raise RemoteError(f"the producer at {self.address} failed: {msg.error_kind}: {msg.message}",
                                  msg.error_kind)
            ch = self.channels.get(msg.receiver_id)
            if ch is not None:
                self.manager._on_channel_error(ch, msg)
        else:
            raise ProtocolError(f"unexpected {t.__name__} from a producer")

    def _receive_data(self, ch, size, dt, width, flags, prio):
        cr = ch.credit
        if self.manager.credit_based:
            buf = cr.take()
            if buf is None:
                raise ProtocolError(f"the producer sent a buffer for {ch.partition_id!r}[{ch.subpartition}] "
                                    "without credit")
        else:
            buf = self.manager._take_blocking(ch, self)
            if buf is None:
                self.reader.discard(size)
                return
        try:
            if size > buf.capacity:
                raise ProtocolError(f"oversized buffer: {size} bytes do not fit a {buf.capacity}-byte segment")
            self.reader.read_payload_into(buf, size)
            buf.set_meta(size, _TYPE_NAMES[dt], width, flags)
        except BaseException:
            buf.recycle()
            raise
        ch.queue.push_buffer(buf, prio)
        ch.buffers_received += 1
        ch.bytes_received += size

    def _teardown(self, exc):
        self.close(exc)
        exc = self.error or exc   # why we closed it, if we did, beats what recv saw then
        if exc is None:
            sent = self.credit_error or (self.pump is not None and self.pump.send_error and
                                         os.strerror(self.pump.send_error))
            exc = ConnectionLostError(f"the connection to {self.address} was closed"
                                      + (f" (sending credit had failed: {sent})" if sent else ""))
        exc = T.explain(self.tls, exc)
        for ch in list(self.channels.values()):
            ch._fail(exc)
        self.channels.clear()
        self.wire.close()
        if self.tls is not None:
            self.tls.release()
        self.manager._conn_closed(self)


class ConnectionManager:
    """Remote input channels of one consumer process.

    One connection per producer address, opened on first use and shared by
    every channel to that address. Per channel, ``exclusive_pool`` holds its
    exclusive buffers (initial credit, default 2) and the gate-wide
    ``floating_pool`` gives floating buffers by backlog (default 8 per gate).
    Create the pools with ``create_input_pools`` (or pass
    ``notifier=manager.notifier`` to ``create_pool``) so the manager hears
    each recycle at once and turns it into credit.

    ``credit_based=False`` gives the pre-credit mode (TCP window only): the
    producer sends whatever it has and the connection's reader blocks when a
    channel has no free buffer, stalling every channel on that connection.

    ``connect_timeout`` bounds connecting and the handshake together, counted
    from the start of the connect (one deadline, not per read); a producer
    that does not finish the handshake by then fails with ConnectionLostError.

    Threads: one reader per connection (blocked in ``recv_into``, GIL
    released) and one control thread that re-reserves recycled buffers and
    sends AddCredit; both park when idle.
    """

    def __init__(self, secret, *, credit_based=True, connect_timeout=10.0,
                 dead_peer_timeout=P.DEFAULT_DEAD_PEER_TIMEOUT, partition_request_timeout=10.0,
                 on_error=None, tls=None):
        self._secret = P.check_secret(secret)
        if tls is not None and not isinstance(tls, T.TLSConfig):
            raise TypeError(f"tls must be a pyflowbuf.net.TLSConfig or None, got {tls!r}")
        if tls is not None:
            T.require_ssl()
        self.tls = tls
        self.credit_based = credit_based
        self.connect_timeout = connect_timeout
        self.dead_peer_timeout = dead_peer_timeout
        self.partition_request_timeout = partition_request_timeout
        self.on_error = on_error
        self.notifier = Notifier()   # told of every recycle into the input pools
        self._wake = Notifier()      # told of channel events and low credit
        self._conns = {}
        self._lock = threading.Lock()
        self._retired = []
        self._control = None
        self._closed = False
        self.control_credit_frames = 0   # AddCredit sent by the control thread

    # ------------------------------------------------------------ pools
    def create_input_pools(self, network_pool, num_channels, exclusive=DEFAULT_EXCLUSIVE_BUFFERS,
                           floating=DEFAULT_FLOATING_BUFFERS):
        """Pools for one gate: a list of ``num_channels`` exclusive pools
        (``exclusive`` segments each, guaranteed) and one floating pool (up to
        ``floating`` segments, or None for 0), all reporting recycles to this
        manager."""
        if not isinstance(network_pool, NetworkBufferPool):
            raise TypeError("network_pool must be a NetworkBufferPool")
        excl = [network_pool.create_pool(exclusive, exclusive, notifier=self.notifier) if exclusive else None
                for _ in range(num_channels)]
        fl = network_pool.create_pool(0, floating, notifier=self.notifier) if floating else None
        return excl, fl

    # ------------------------------------------------------------ channels
    def create_channel(self, address, partition_id, subpartition, queue, exclusive_pool=None,
                       floating_pool=None, *, exclusive_buffers=None, kind="bytes", allow_pickle=False,
                       block_on_barrier=False, on_error=None):
        """Request ``(partition_id, subpartition)`` from the producer at
        ``address`` = (host, port) and deliver its buffers into ``queue``.

        ``exclusive_buffers`` defaults to ``exclusive_pool.max_size`` (0
        without a pool: then the channel lives on floating buffers and the
        producer announces its backlog). ``kind`` must match the export;
        ``"pickle"`` needs ``allow_pickle=True``: unpickling bytes from the
        network runs code the producer chose. Returns a RemoteInputChannel.
        """
        if self._closed:
            raise ChannelClosedError("the ConnectionManager is closed")
        if not isinstance(queue, BufferQueue):
            raise TypeError(f"queue must be a BufferQueue, got {type(queue).__name__}")
        if kind == "pickle" and not allow_pickle:
            raise ValueError("a pickle stream unpickles bytes received from the network; pass "
                             "allow_pickle=True only if every producer is trusted")
        for p in (exclusive_pool, floating_pool):
            if p is not None and not isinstance(p, LocalBufferPool):
                raise TypeError("pools must be LocalBufferPools")
        if exclusive_buffers is None:
            exclusive_buffers = exclusive_pool.max_size if exclusive_pool is not None else 0
        if exclusive_pool is not None and exclusive_buffers > exclusive_pool.max_size:
            raise ValueError(f"exclusive_buffers={exclusive_buffers} exceeds the pool's max_size "
                             f"{exclusive_pool.max_size}")
        address = (address[0], int(address[1]))
        conn = self._connection(address)
        for p in (exclusive_pool, floating_pool):
            if p is not None and p.segment_size < conn.max_buffer_size:
                raise ValueError(f"receiving segments of {p.segment_size} B are smaller than the "
                                 f"producer's buffers ({conn.max_buffer_size} B)")
        credit = ReceiverCredit(exclusive_pool, floating_pool, exclusive_buffers)
        initial = credit.setup() if self.credit_based else 0
        flags = F.FLAG_BLOCK_ON_BARRIER if block_on_barrier else 0
        ch = RemoteInputChannel(self, conn, partition_id, subpartition, queue, credit, kind, flags,
                                on_error, self.partition_request_timeout)
        req = F.encode_partition_request(partition_id, subpartition, ch.receiver_id, initial, kind, flags)
        conn.add(ch)
        self._ensure_control()
        try:
            conn.send(req)
        except (OSError, FlowBufError) as e:
            ch._fail(ConnectionLostError(f"sending the partition request to {address} failed: {e}"))
        return ch

    def _on_channel_error(self, ch, msg):
        if msg.error_kind == "PartitionNotFound" and time.monotonic() + ch._backoff < ch._deadline:
            # the producer may not have exported it yet: retry with backoff, as Flink does
            ch.retry_at = time.monotonic() + ch._backoff
            ch._backoff = min(ch._backoff * 2, 1.0)
            self._poke()
            return
        cls = PartitionNotFoundError if msg.error_kind == "PartitionNotFound" else RemoteError
        ch.connection.forget(ch)
        ch._fail(cls(f"{ch.partition_id!r}[{ch.subpartition}] at {ch.address}: {msg.error_kind}: "
                     f"{msg.message}", msg.error_kind))

    def _retire(self, ch):
        """Hand a channel that stopped to the control thread, which owns the
        reserved buffers and gives them back."""
        with self._lock:
            self._retired.append(ch)
        self._poke()

    def _poke(self):
        self._wake.notify()
        self.notifier.notify()

    # ------------------------------------------------------------ connections
    def _connection(self, address):
        with self._lock:
            conn = self._conns.get(address)
            if conn is not None and not conn.closed:
                return conn
        conn = self._connect(address)
        with self._lock:
            old = self._conns.get(address)
            if old is not None and not old.closed:   # another thread won the race
                conn.close()
                conn._thread.start()
                return old
            self._conns[address] = conn
        conn._thread.start()
        return conn

    def _connect(self, address):
        deadline = time.monotonic() + self.connect_timeout
        delay = 0.02
        while True:
            try:
                sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
                break
            except (ConnectionRefusedError, socket.timeout) as e:
                if time.monotonic() + delay >= deadline:
                    raise ConnectionLostError(f"cannot connect to {address} within {self.connect_timeout} s: {e}")
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        relay = None
        try:
            P.configure_socket(sock, self.dead_peer_timeout)
            if self.tls is not None:   # TLS first, then the HMAC challenge inside it (attempt fencing)
                relay = T.wrap(sock, self.tls, server_side=False, peer=address)
                relay.handshake(deadline)
                relay.start()
                sock = relay.local
            reader = P.FrameReader(sock, 1 << 20)
            mode = F.MODE_CREDIT if self.credit_based else F.MODE_TCP
            # The connect's deadline, not a fresh timeout per recv: a server
            # trickling its challenge would otherwise hold us without end.
            max_buf = P.client_handshake(sock, reader, self._secret, mode, deadline=deadline)
        except socket.timeout:
            sock.close()
            _release(relay)
            raise ConnectionLostError(f"the server at {address} did not complete the handshake within "
                                      f"{self.connect_timeout} s (connect_timeout)") from None
        except BaseException as e:
            sock.close()
            _release(relay)
            if relay is not None and relay.error is not None and e is not relay.error:
                raise relay.error from None
            raise
        conn = _ClientConnection(self, address, sock, reader, max_buf)
        conn.tls = relay
        return conn

    def _conn_closed(self, conn):
        with self._lock:
            if self._conns.get(conn.address) is conn:
                del self._conns[conn.address]
        self._poke()

    @property
    def connections(self):
        return len(self._conns)

    # ------------------------------------------------------------ TCP-only mode
    def _take_blocking(self, ch, conn):
        """TCP-only mode: wait for any free buffer for ``ch``; meanwhile the
        socket is not read, so every channel on the connection waits (the
        head-of-line blocking credit-based flow control removes)."""
        cr = ch.credit
        n = self.notifier
        while True:
            token = n.prepare()
            for p in (cr.exclusive_pool, cr.floating_pool):
                if p is not None:
                    b = p.request()
                    if b is not None:
                        n.cancel()
                        return b
            if conn.closed:
                n.cancel()
                raise ConnectionLostError(f"the connection to {conn.address} closed")
            if not ch.active:   # cancelled meanwhile: its payload is dropped
                n.cancel()
                return None
            n.wait(token, _POLL_S)

    # ------------------------------------------------------------ control thread
    def _ensure_control(self):
        if self._control is None:
            with self._lock:
                if self._control is None:
                    self._control = threading.Thread(target=self._control_loop, name="pyflowbuf-net-credit",
                                                     daemon=True)
                    self._control.start()

    def _control_loop(self):
        """Parks on the recycle notifier only while some channel is hungry;
        otherwise on channel events alone, so recycles while the sender has
        credit to spare cost no wake-up and are collected in one pass."""
        pool_n, wake = self.notifier, self._wake
        while True:
            tw = wake.prepare()
            tp = pool_n.prepare()
            if self._closed:
                wake.cancel()
                pool_n.cancel()
                break
            try:
                timeout, hungry = self._service()
            except Exception:
                log.exception("credit control loop failed")
                timeout, hungry = _POLL_S, False
            if timeout == 0:
                wake.cancel()
                pool_n.cancel()
            elif hungry:
                wake.cancel()
                pool_n.wait(tp, timeout)
            else:
                pool_n.cancel()
                wake.wait(tw, timeout)
        self._drain_retired()

    def _drain_retired(self):
        with self._lock:
            retired, self._retired = self._retired, []
        for ch in retired:
            if not ch._released:
                ch._released = True
                ch.credit.release()

    def _service(self):
        """Turn recycled buffers into credit, one AddCredit per channel per
        pass; re-send partition requests whose retry is due. Returns how long
        the control thread may sleep (None: until notified) and whether it
        must hear every recycle."""
        self._drain_retired()
        wait = None
        hungry = False
        now = time.monotonic()
        credit_based = self.credit_based
        for conn in list(self._conns.values()):
            if conn.closed:
                continue
            out = []
            for ch in list(conn.channels.values()):
                if ch.retry_at is not None:
                    if now >= ch.retry_at:
                        ch.retry_at = None
                        credit = ch.credit.reset_announcement() if credit_based else 0
                        out.append(F.encode_partition_request(ch.partition_id, ch.subpartition, ch.receiver_id,
                                                              credit, ch.kind, ch.flags))
                    else:
                        left = ch.retry_at - now
                        wait = left if wait is None else min(wait, left)
                    continue
                if not credit_based or ch.state not in ("requested", "receiving"):
                    continue
                n, h = ch.credit.service()   # the receive loop may announce meanwhile
                if n:
                    out.append(F.encode_add_credit(n, ch.receiver_id))
                    self.control_credit_frames += 1
                if h:
                    hungry = True
            if out and conn.credit_error is None:
                try:
                    conn.send(b"".join(out) if len(out) > 1 else out[0])
                except (OSError, FlowBufError) as e:
                    # The producer closed its end (unread credit there makes
                    # it a reset), maybe right after the end-of-partition of
                    # every channel: what it sent is still in the socket. No
                    # more credit, but the reader reads on, and the stream's
                    # end says which channels are complete.
                    conn.credit_error = e
        if hungry:
            # normally a recycle notifies us; the bound covers pools created
            # without this manager's notifier
            wait = _POLL_S if wait is None else min(wait, _POLL_S)
        return wait, hungry

    # ------------------------------------------------------------ shutdown
    def close(self, timeout=5.0):
        """Close every connection (CloseRequest) and stop the threads."""
        if self._closed:
            return
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            try:
                conn.send(F.encode_close())
            except (OSError, FlowBufError):
                pass
            conn.close(CancelledError("the ConnectionManager was closed"))
        for conn in conns:
            conn._thread.join(timeout)
        self._closed = True
        self._poke()
        if self._control is not None:
            self._control.join(timeout)
        self._drain_retired()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _release(relay):
    if relay is not None:
        relay.close()
        relay.release()
