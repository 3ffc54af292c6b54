"""Wire format of the remote exchange: Flink's NettyMessage framing.

Every frame is ``[length i32][magic u32 0xBADC0FFE][id u8][body]``, big-endian,
``length`` counting the 9-byte header. The message ids are Flink's (section 2 of
reference/flink-network.md); ids 64-66 are pyflowbuf's authentication handshake,
which Flink does not have (it relies on SSL).

A BufferResponse is the 49-byte header below, then ``size`` payload bytes that
the sender hands to ``sendmsg`` straight from the segment and the receiver
``recv_into``s straight into a segment. The header is Flink's 34 bytes plus the
Buffer metadata pyflowbuf keeps (record width of fixed-width buffers, flags).
An event travels as a 12-byte payload ``kind i32 | aux i64`` (Flink serializes
its events into the payload too).

Decoding never trusts a length: every frame is checked against the limits
before its body is read, and every violation raises ProtocolError.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

from pyflowbuf._core import netio as _wire
from pyflowbuf._core.memory import DEFAULT_SEGMENT_SIZE
from pyflowbuf.errors import ProtocolError

# The constants the C send and receive loops share are defined on the C side
# (csrc/fb_net.h, fb_ring.h); the rest of the protocol is only Python's.
MAGIC = _wire.WIRE_MAGIC
PROTOCOL_VERSION = 1

BUFFER_RESPONSE = _wire.WIRE_BUFFER_RESPONSE
ERROR_RESPONSE = 1
PARTITION_REQUEST = 2
TASK_EVENT_REQUEST = 3          # Flink's; not supported here
CANCEL_PARTITION_REQUEST = 4
CLOSE_REQUEST = 5
ADD_CREDIT = _wire.WIRE_ADD_CREDIT
RESUME_CONSUMPTION = 7
ACK_ALL_USER_RECORDS_PROCESSED = 8  # Flink's; not supported here
BACKLOG_ANNOUNCEMENT = 9
NEW_BUFFER_SIZE = 10
SEGMENT_ID = 11                 # Flink's hybrid shuffle; not supported here
CHALLENGE = 64
AUTH_RESPONSE = 65
AUTH_OK = 66

MESSAGE_NAMES = {
    BUFFER_RESPONSE: "BufferResponse", ERROR_RESPONSE: "ErrorResponse",
    PARTITION_REQUEST: "PartitionRequest", TASK_EVENT_REQUEST: "TaskEventRequest",
    CANCEL_PARTITION_REQUEST: "CancelPartitionRequest", CLOSE_REQUEST: "CloseRequest",
    ADD_CREDIT: "AddCredit", RESUME_CONSUMPTION: "ResumeConsumption",
    ACK_ALL_USER_RECORDS_PROCESSED: "AckAllUserRecordsProcessed",
    BACKLOG_ANNOUNCEMENT: "BacklogAnnouncement", NEW_BUFFER_SIZE: "NewBufferSize",
    SEGMENT_ID: "SegmentId", CHALLENGE: "Challenge", AUTH_RESPONSE: "AuthResponse",
    AUTH_OK: "AuthOk",
}
SUPPORTED = frozenset(MESSAGE_NAMES) - {TASK_EVENT_REQUEST, ACK_ALL_USER_RECORDS_PROCESSED, SEGMENT_ID}

FRAME_HEADER = struct.Struct(">iIB")
FRAME_HEADER_SIZE = FRAME_HEADER.size                      # 9
BUFFER_HEADER = struct.Struct(">16siiiBBiIH")
BUFFER_HEADER_SIZE = FRAME_HEADER_SIZE + BUFFER_HEADER.size  # 49
_BUFFER_FULL = struct.Struct(">iIB16siiiBBiIH")
EVENT_PAYLOAD = struct.Struct(">iq")
RECEIVER_ID_SIZE = _wire.WIRE_RECEIVER_ID_SIZE

# data_type byte of a BufferResponse: the Buffer's type, plus a bit for the
# priority lane (an unaligned barrier overtaking queued data).
DATA_RECORDS = _wire.WIRE_DATA_RECORDS
DATA_FIXED = _wire.WIRE_DATA_FIXED
DATA_EVENT = _wire.WIRE_DATA_EVENT
PRIORITY_BIT = 0x80
_TYPE_NAMES = ("records", "fixed", "event")
TYPE_CODES = {"records": DATA_RECORDS, "fixed": DATA_FIXED, "event": DATA_EVENT}

DEFAULT_MAX_CONTROL_FRAME = 64 * 1024
MAX_PARTITION_ID = 1024
MAX_KIND_NAME = 64
MAX_ERROR_TEXT = 8192
NONCE_SIZE = 32
MAC_SIZE = 32

# PartitionRequest flags
FLAG_BLOCK_ON_BARRIER = 1

# AuthResponse modes
MODE_CREDIT = 0
MODE_TCP = 1


class BufferResponse(NamedTuple):
    receiver_id: bytes
    subpartition: int
    seq: int
    backlog: int
    data_type: int          # DATA_* | PRIORITY_BIT
    compressed: int
    size: int
    width: int
    flags: int
    payload: bytes = b""    # filled only by FrameDecoder (tests); the network path reads into segments

    @property
    def is_event(self):
        return self.data_type & ~PRIORITY_BIT == DATA_EVENT

    @property
    def priority(self):
        return bool(self.data_type & PRIORITY_BIT)

    @property
    def type_name(self):
        return _TYPE_NAMES[self.data_type & ~PRIORITY_BIT]


class ErrorResponse(NamedTuple):
    receiver_id: bytes | None   # None: fatal for the whole connection
    error_kind: str
    message: str


class PartitionRequest(NamedTuple):
    partition_id: str
    subpartition: int
    receiver_id: bytes
    credit: int
    kind: str = "bytes"
    flags: int = 0


class CancelPartitionRequest(NamedTuple):
    receiver_id: bytes


class CloseRequest(NamedTuple):
    pass


class AddCredit(NamedTuple):
    credit: int
    receiver_id: bytes


class ResumeConsumption(NamedTuple):
    receiver_id: bytes


class BacklogAnnouncement(NamedTuple):
    backlog: int
    receiver_id: bytes


class NewBufferSize(NamedTuple):
    size: int
    receiver_id: bytes


class Challenge(NamedTuple):
    version: int
    max_buffer_size: int
    nonce: bytes


class AuthResponse(NamedTuple):
    version: int
    mode: int
    nonce: bytes
    mac: bytes


class AuthOk(NamedTuple):
    mac: bytes


# ---------------------------------------------------------------- encoding

def _frame(msg_id: int, body: bytes) -> bytes:
    return FRAME_HEADER.pack(FRAME_HEADER_SIZE + len(body), MAGIC, msg_id) + body


def _rid(receiver_id: bytes) -> bytes:
    if not isinstance(receiver_id, bytes) or len(receiver_id) != RECEIVER_ID_SIZE:
        raise ValueError("a receiver id is 16 bytes")
    return receiver_id


def _i32(name, v, lo=0):
    if not isinstance(v, int) or not lo <= v < 1 << 31:
        raise ValueError(f"{name} must be an int in {lo}..2**31-1, got {v!r}")
    return v


def encode_buffer_header(receiver_id, subpartition, seq, backlog, data_type, size, width=0, flags=0):
    """The 49 bytes that precede a buffer's payload (payload sent separately)."""
    return _BUFFER_FULL.pack(BUFFER_HEADER_SIZE + size, MAGIC, BUFFER_RESPONSE, receiver_id,
                             subpartition, seq, backlog, data_type, 0, size, width, flags)


def encode_event(receiver_id, subpartition, seq, backlog, kind, aux, flags=0, priority=False):
    dt = DATA_EVENT | (PRIORITY_BIT if priority else 0)
    return (encode_buffer_header(receiver_id, subpartition, seq, backlog, dt, EVENT_PAYLOAD.size, 0, flags)
            + EVENT_PAYLOAD.pack(kind, aux))


def encode_error(receiver_id, error_kind, message):
    kind_b = str(error_kind).encode()[:MAX_KIND_NAME]
    text = str(message).encode("utf-8", "replace")[:MAX_ERROR_TEXT]
    head = b"\x01" + _rid(receiver_id) if receiver_id is not None else b"\x00"
    return _frame(ERROR_RESPONSE, head + bytes([len(kind_b)]) + kind_b + text)


def encode_partition_request(partition_id, subpartition, receiver_id, credit, kind="bytes", flags=0):
    pid = partition_id.encode("utf-8")
    kb = kind.encode("ascii")
    if not 0 < len(pid) <= MAX_PARTITION_ID:
        raise ValueError(f"partition id must be 1..{MAX_PARTITION_ID} UTF-8 bytes")
    if not 0 < len(kb) <= MAX_KIND_NAME:
        raise ValueError(f"kind name must be 1..{MAX_KIND_NAME} ASCII bytes")
    body = (_rid(receiver_id) + struct.pack(">iiH", _i32("subpartition", subpartition),
                                            _i32("credit", credit), flags)
            + bytes([len(kb)]) + kb + struct.pack(">H", len(pid)) + pid)
    return _frame(PARTITION_REQUEST, body)


def encode_cancel(receiver_id):
    return _frame(CANCEL_PARTITION_REQUEST, _rid(receiver_id))


def encode_close():
    return _frame(CLOSE_REQUEST, b"")


_ADD_CREDIT = struct.Struct(">iIBi16s")

# The layouts above must be the ones the C loops read and write.
if (FRAME_HEADER_SIZE, BUFFER_HEADER_SIZE, _ADD_CREDIT.size) != (
        _wire.WIRE_FRAME_HEADER_SIZE, _wire.WIRE_BUFFER_HEADER_SIZE, _wire.WIRE_ADD_CREDIT_SIZE):
    raise ImportError("pyflowbuf.net.frames: the frame layouts differ from the compiled core's "
                      "(csrc/fb_net.h): rebuild the extension")


def encode_add_credit(credit, receiver_id):
    return _ADD_CREDIT.pack(FRAME_HEADER_SIZE + 20, MAGIC, ADD_CREDIT, _i32("credit", credit, 1), receiver_id)


def encode_resume(receiver_id):
    return _frame(RESUME_CONSUMPTION, _rid(receiver_id))


def encode_backlog_announcement(backlog, receiver_id):
    return _frame(BACKLOG_ANNOUNCEMENT, struct.pack(">i", _i32("backlog", backlog)) + _rid(receiver_id))


def encode_new_buffer_size(size, receiver_id):
    return _frame(NEW_BUFFER_SIZE, struct.pack(">i", _i32("size", size, 1)) + _rid(receiver_id))


def encode_challenge(max_buffer_size, nonce):
    return _frame(CHALLENGE, struct.pack(">Bi", PROTOCOL_VERSION, max_buffer_size) + nonce)


def encode_auth_response(mode, nonce, mac):
    return _frame(AUTH_RESPONSE, bytes([PROTOCOL_VERSION, mode]) + nonce + mac)


def encode_auth_ok(mac):
    return _frame(AUTH_OK, mac)


def encode(msg) -> bytes:
    """Encode any message tuple (BufferResponse payload included)."""
    t = type(msg)
    if t is BufferResponse:
        return encode_buffer_header(msg.receiver_id, msg.subpartition, msg.seq, msg.backlog,
                                    msg.data_type, msg.size, msg.width, msg.flags) + msg.payload
    if t is ErrorResponse:
        return encode_error(msg.receiver_id, msg.error_kind, msg.message)
    if t is PartitionRequest:
        return encode_partition_request(msg.partition_id, msg.subpartition, msg.receiver_id,
                                        msg.credit, msg.kind, msg.flags)
    if t is CancelPartitionRequest:
        return encode_cancel(msg.receiver_id)
    if t is CloseRequest:
        return encode_close()
    if t is AddCredit:
        return encode_add_credit(msg.credit, msg.receiver_id)
    if t is ResumeConsumption:
        return encode_resume(msg.receiver_id)
    if t is BacklogAnnouncement:
        return encode_backlog_announcement(msg.backlog, msg.receiver_id)
    if t is NewBufferSize:
        return encode_new_buffer_size(msg.size, msg.receiver_id)
    if t is Challenge:
        return _frame(CHALLENGE, struct.pack(">Bi", msg.version, msg.max_buffer_size) + msg.nonce)
    if t is AuthResponse:
        return _frame(AUTH_RESPONSE, bytes([msg.version, msg.mode]) + msg.nonce + msg.mac)
    if t is AuthOk:
        return encode_auth_ok(msg.mac)
    raise TypeError(f"not a message: {msg!r}")


# ---------------------------------------------------------------- decoding

def parse_frame_header(data, max_buffer_size, max_control_frame=DEFAULT_MAX_CONTROL_FRAME):
    """``(length, msg_id)`` of the frame starting at ``data[0:9]``; checks magic,
    id and length against the limits before anything else is read."""
    length, magic, msg_id = FRAME_HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic number 0x{magic:08X} (expected 0x{MAGIC:08X}): not a pyflowbuf peer "
                            "or a corrupt stream")
    if msg_id not in MESSAGE_NAMES:
        raise ProtocolError(f"unknown message id {msg_id}")
    if msg_id not in SUPPORTED:
        raise ProtocolError(f"unsupported message {MESSAGE_NAMES[msg_id]} (id {msg_id})")
    if length < FRAME_HEADER_SIZE:
        raise ProtocolError(f"frame length {length} is shorter than the 9-byte header")
    if msg_id == BUFFER_RESPONSE:
        limit = BUFFER_HEADER_SIZE + max_buffer_size
        if length < BUFFER_HEADER_SIZE:
            raise ProtocolError(f"BufferResponse frame of {length} bytes is shorter than its header")
    else:
        limit = max_control_frame
    if length > limit:
        raise ProtocolError(f"oversized frame: {MESSAGE_NAMES[msg_id]} of {length} bytes exceeds the "
                            f"limit of {limit} bytes")
    return length, msg_id


def parse_buffer_header(length, data, offset=FRAME_HEADER_SIZE):
    """Decode and check the 40 bytes after the frame header of a BufferResponse."""
    (rid, sub, seq, backlog, dt, compressed, size, width, flags) = BUFFER_HEADER.unpack_from(data, offset)
    if sub < 0 or seq < 0 or backlog < 0:
        raise ProtocolError(f"negative field in BufferResponse (subpartition={sub}, seq={seq}, backlog={backlog})")
    base = dt & ~PRIORITY_BIT
    if base > DATA_EVENT:
        raise ProtocolError(f"unknown buffer data type {dt}")
    if compressed:
        raise ProtocolError("compressed buffers are not supported")
    if size < 0 or length != BUFFER_HEADER_SIZE + size:
        raise ProtocolError(f"BufferResponse size {size} does not match frame length {length}")
    if base == DATA_EVENT and size != EVENT_PAYLOAD.size:
        raise ProtocolError(f"event payload of {size} bytes (expected {EVENT_PAYLOAD.size})")
    if base == DATA_FIXED and width <= 0:
        raise ProtocolError("fixed-width buffer with record width 0")
    return BufferResponse(rid, sub, seq, backlog, dt, compressed, size, width, flags)


def _need(body, n, name):
    if len(body) != n:
        raise ProtocolError(f"{name} body of {len(body)} bytes (expected {n})")


def _positive(v, name, lo=1):
    if v < lo:
        raise ProtocolError(f"{name} must be >= {lo}, got {v}")
    return v


def decode_control(msg_id, body):
    """Decode the body of any frame other than BufferResponse."""
    body = bytes(body)
    name = MESSAGE_NAMES.get(msg_id, str(msg_id))
    if msg_id == ADD_CREDIT:
        _need(body, 20, name)
        credit, rid = struct.unpack(">i16s", body)
        return AddCredit(_positive(credit, "credit"), rid)
    if msg_id == PARTITION_REQUEST:
        if len(body) < 16 + 10 + 1 + 2:
            raise ProtocolError(f"truncated PartitionRequest body of {len(body)} bytes")
        rid = body[:16]
        sub, credit, flags = struct.unpack_from(">iiH", body, 16)
        klen = body[26]
        kind_b = body[27:27 + klen]
        off = 27 + klen
        if klen == 0 or len(kind_b) != klen or off + 2 > len(body):
            raise ProtocolError("truncated PartitionRequest kind")
        (plen,) = struct.unpack_from(">H", body, off)
        pid_b = body[off + 2:]
        if plen == 0 or plen > MAX_PARTITION_ID or len(pid_b) != plen:
            raise ProtocolError(f"bad partition id length {plen} ({len(pid_b)} bytes present)")
        try:
            pid = pid_b.decode("utf-8")
            kind = kind_b.decode("ascii")
        except UnicodeDecodeError:
            raise ProtocolError("partition id or kind is not valid text") from None
        _positive(sub, "subpartition", 0)
        _positive(credit, "credit", 0)
        return PartitionRequest(pid, sub, rid, credit, kind, flags)
    if msg_id == ERROR_RESPONSE:
        if not body:
            raise ProtocolError("empty ErrorResponse")
        off = 1
        rid = None
        if body[0] == 1:
            rid = body[1:17]
            if len(rid) != 16:
                raise ProtocolError("truncated ErrorResponse receiver id")
            off = 17
        elif body[0] != 0:
            raise ProtocolError(f"bad ErrorResponse flag {body[0]}")
        if off >= len(body):
            raise ProtocolError("truncated ErrorResponse")
        klen = body[off]
        kind_b = body[off + 1:off + 1 + klen]
        if len(kind_b) != klen:
            raise ProtocolError("truncated ErrorResponse kind")
        text = body[off + 1 + klen:]
        return ErrorResponse(rid, kind_b.decode("utf-8", "replace"), text.decode("utf-8", "replace"))
    if msg_id == CANCEL_PARTITION_REQUEST:
        _need(body, 16, name)
        return CancelPartitionRequest(body)
    if msg_id == CLOSE_REQUEST:
        _need(body, 0, name)
        return CloseRequest()
    if msg_id == RESUME_CONSUMPTION:
        _need(body, 16, name)
        return ResumeConsumption(body)
    if msg_id == BACKLOG_ANNOUNCEMENT:
        _need(body, 20, name)
        backlog, rid = struct.unpack(">i16s", body)
        return BacklogAnnouncement(_positive(backlog, "backlog", 0), rid)
    if msg_id == NEW_BUFFER_SIZE:
        _need(body, 20, name)
        size, rid = struct.unpack(">i16s", body)
        return NewBufferSize(_positive(size, "buffer size"), rid)
    if msg_id == CHALLENGE:
        _need(body, 5 + NONCE_SIZE, name)
        version, mbs = struct.unpack_from(">Bi", body)
        return Challenge(version, _positive(mbs, "max buffer size"), body[5:])
    if msg_id == AUTH_RESPONSE:
        _need(body, 2 + NONCE_SIZE + MAC_SIZE, name)
        if body[1] not in (MODE_CREDIT, MODE_TCP):
            raise ProtocolError(f"unknown flow-control mode {body[1]}")
        return AuthResponse(body[0], body[1], body[2:2 + NONCE_SIZE], body[2 + NONCE_SIZE:])
    if msg_id == AUTH_OK:
        _need(body, MAC_SIZE, name)
        return AuthOk(body)
    raise ProtocolError(f"unexpected message id {msg_id}")


def decode_event_payload(data):
    return EVENT_PAYLOAD.unpack_from(data, 0)


class FrameDecoder:
    """Incremental decoder over a byte stream (copies payloads; the network
    path uses protocol.FrameReader, which reads payloads into segments, but
    both share the checks above). ``feed`` returns the complete messages; a
    partial frame waits for more bytes and never makes the decoder read past
    the end of what it was given."""

    def __init__(self, max_buffer_size=DEFAULT_SEGMENT_SIZE, max_control_frame=DEFAULT_MAX_CONTROL_FRAME):
        self.max_buffer_size = max_buffer_size
        self.max_control_frame = max_control_frame
        self._buf = bytearray()
        self.consumed = 0   # bytes of complete frames decoded so far

    def feed(self, data) -> list:
        self._buf += data
        out = []
        buf = self._buf
        pos = 0
        while len(buf) - pos >= FRAME_HEADER_SIZE:
            length, msg_id = parse_frame_header(memoryview(buf)[pos:pos + FRAME_HEADER_SIZE],
                                                self.max_buffer_size, self.max_control_frame)
            if len(buf) - pos < length:
                break
            frame = bytes(buf[pos:pos + length])
            if msg_id == BUFFER_RESPONSE:
                h = parse_buffer_header(length, frame)
                out.append(h._replace(payload=frame[BUFFER_HEADER_SIZE:]))
            else:
                out.append(decode_control(msg_id, frame[FRAME_HEADER_SIZE:]))
            pos += length
        del buf[:pos]
        self.consumed += pos
        return out

    @property
    def pending(self):
        """Bytes of an incomplete frame waiting for more input."""
        return len(self._buf)
