"""Wire format of the remote exchange: round trips, limits, and a fuzzed decoder."""
import os
import socket
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyflowbuf._core.memory import NetworkBufferPool
from pyflowbuf.errors import ConnectionLostError, ProtocolError
from pyflowbuf.net import frames as F
from pyflowbuf._core.netio import Wire
from pyflowbuf.net.protocol import FrameReader

MAX_BUF = 4096
rids = st.binary(min_size=16, max_size=16)
i31 = st.integers(0, 2**31 - 1)
pos31 = st.integers(1, 2**31 - 1)


def _buffer_response(draw_payload):
    return st.builds(
        lambda rid, sub, seq, backlog, dt, prio, width, flags, payload: F.BufferResponse(
            rid, sub, seq, backlog, dt | (F.PRIORITY_BIT if prio else 0), 0,
            len(payload) if dt != F.DATA_EVENT else 12, width if dt == F.DATA_FIXED else 0, flags,
            payload if dt != F.DATA_EVENT else F.EVENT_PAYLOAD.pack(5, -7)),
        rids, i31, i31, i31, st.sampled_from([F.DATA_RECORDS, F.DATA_FIXED, F.DATA_EVENT]), st.booleans(),
        st.integers(1, 2**32 - 1), st.integers(0, 65535), draw_payload)


messages = st.one_of(
    _buffer_response(st.binary(max_size=MAX_BUF)),
    st.builds(F.ErrorResponse, st.one_of(st.none(), rids),
              st.text(st.characters(codec="ascii"), max_size=20),
              st.text(max_size=200)),
    st.builds(F.PartitionRequest, st.text(min_size=1, max_size=100), i31, rids, i31,
              st.sampled_from(["bytes", "int64", "pickle", "str"]), st.integers(0, 65535)),
    st.builds(F.CancelPartitionRequest, rids),
    st.just(F.CloseRequest()),
    st.builds(F.AddCredit, pos31, rids),
    st.builds(F.ResumeConsumption, rids),
    st.builds(F.BacklogAnnouncement, i31, rids),
    st.builds(F.NewBufferSize, pos31, rids),
    st.builds(F.Challenge, st.just(F.PROTOCOL_VERSION), pos31, st.binary(min_size=32, max_size=32)),
    st.builds(F.AuthResponse, st.integers(0, 255), st.sampled_from([F.MODE_CREDIT, F.MODE_TCP]),
              st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32)),
    st.builds(F.AuthOk, st.binary(min_size=32, max_size=32)),
)


def _normalize(msg):
    if type(msg) is F.ErrorResponse:   # text is truncated/encoded on the way; compare what survives
        return msg._replace(error_kind=msg.error_kind.encode()[:F.MAX_KIND_NAME].decode(),
                            message=msg.message.encode()[:F.MAX_ERROR_TEXT].decode("utf-8", "replace"))
    return msg


@settings(max_examples=300, deadline=None)
@given(st.lists(messages, min_size=1, max_size=8), st.data())
def test_round_trip_in_any_chunking(msgs, data):
    wire = b"".join(F.encode(m) for m in msgs)
    dec = F.FrameDecoder(max_buffer_size=MAX_BUF)
    out = []
    pos = 0
    while pos < len(wire):
        n = data.draw(st.integers(1, len(wire) - pos))
        out += dec.feed(wire[pos:pos + n])
        pos += n
    assert out == [_normalize(m) for m in msgs]
    assert dec.pending == 0 and dec.consumed == len(wire)


def test_header_layout_matches_flink():
    h = F.encode_buffer_header(b"r" * 16, 3, 7, 9, F.DATA_RECORDS, 100, 0, 0)
    assert len(h) == F.BUFFER_HEADER_SIZE == 49
    length, magic, msg_id = struct.unpack_from(">iIb", h)
    assert (length, magic, msg_id) == (149, 0xBADC0FFE, 0)
    # Flink's 34-byte BufferResponse header follows the 9-byte frame header
    rid, sub, seq, backlog, dt, compressed, size = struct.unpack_from(">16siiibbi", h, 9)
    assert (rid, sub, seq, backlog, dt, compressed, size) == (b"r" * 16, 3, 7, 9, 0, 0, 100)
    assert F.encode_add_credit(5, b"x" * 16)[8] == F.ADD_CREDIT == 6
    assert F.encode_backlog_announcement(1, b"x" * 16)[8] == 9


def _frame(msg_id, body=b"", length=None, magic=F.MAGIC):
    return struct.pack(">iIB", 9 + len(body) if length is None else length, magic, msg_id) + body


BAD = {
    "bad magic": _frame(F.CLOSE_REQUEST, magic=0xDEADBEEF),
    "unknown id": _frame(200),
    "unsupported TaskEventRequest": _frame(F.TASK_EVENT_REQUEST),
    "unsupported SegmentId": _frame(F.SEGMENT_ID, b"\0" * 4),
    "length below header": _frame(F.CLOSE_REQUEST, length=4),
    "oversized control": _frame(F.ADD_CREDIT, length=F.DEFAULT_MAX_CONTROL_FRAME + 1),
    "oversized buffer": F.encode_buffer_header(b"r" * 16, 0, 0, 0, 0, MAX_BUF + 1),
    "negative length": _frame(F.CLOSE_REQUEST, length=-5),
    "zero credit": _frame(F.ADD_CREDIT, struct.pack(">i16s", 0, b"r" * 16)),
    "negative credit": _frame(F.ADD_CREDIT, struct.pack(">i16s", -3, b"r" * 16)),
    "short AddCredit": _frame(F.ADD_CREDIT, b"\0" * 5),
    "close with body": _frame(F.CLOSE_REQUEST, b"x"),
    "event with wrong size": F.encode_buffer_header(b"r" * 16, 0, 0, 0, F.DATA_EVENT, 3) + b"abc",
    "unknown data type": F.encode_buffer_header(b"r" * 16, 0, 0, 0, 5, 0),
    "fixed width 0": F.encode_buffer_header(b"r" * 16, 0, 0, 0, F.DATA_FIXED, 8, 0) + b"\0" * 8,
    "negative seq": F.encode_buffer_header(b"r" * 16, 0, -1, 0, 0, 0),
    "size/length mismatch": struct.pack(">iIB", 60, F.MAGIC, 0) + F.BUFFER_HEADER.pack(
        b"r" * 16, 0, 0, 0, 0, 0, 5, 0, 0) + b"x" * 11,
    "partition id length lies": _frame(F.PARTITION_REQUEST, b"r" * 16 + struct.pack(">iiH", 0, 2, 0)
                                       + b"\x05bytes" + struct.pack(">H", 50) + b"abc"),
    "partition id not utf-8": _frame(F.PARTITION_REQUEST, b"r" * 16 + struct.pack(">iiH", 0, 2, 0)
                                     + b"\x05bytes" + struct.pack(">H", 2) + b"\xff\xfe"),
    "error flag": _frame(F.ERROR_RESPONSE, b"\x07abc"),
    "bad mode": _frame(F.AUTH_RESPONSE, b"\x01\x09" + b"\0" * 64),
}


def _patch_compressed():
    h = bytearray(F.encode_buffer_header(b"r" * 16, 0, 0, 0, 0, 0))
    h[9 + 16 + 12 + 1] = 1   # the compressed flag
    return bytes(h)


BAD["compressed"] = _patch_compressed()


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_frames_raise_protocol_error(name):
    with pytest.raises(ProtocolError):
        F.FrameDecoder(max_buffer_size=MAX_BUF).feed(BAD[name])


def test_truncated_frame_waits_and_reads_nothing_past_it():
    frame = F.encode(F.AddCredit(3, b"r" * 16))
    dec = F.FrameDecoder()
    assert dec.feed(frame[:-1]) == []
    assert dec.pending == len(frame) - 1 and dec.consumed == 0
    assert dec.feed(frame[-1:] + b"\xba") == [F.AddCredit(3, b"r" * 16)]
    assert dec.consumed == len(frame) and dec.pending == 1


def test_encoders_refuse_bad_values():
    with pytest.raises(ValueError):
        F.encode_add_credit(0, b"r" * 16)
    with pytest.raises(ValueError):
        F.encode_partition_request("", 0, b"r" * 16, 2)
    with pytest.raises(ValueError):
        F.encode_partition_request("p", 0, b"short", 2)
    with pytest.raises(ValueError):
        F.encode_partition_request("x" * 2000, 0, b"r" * 16, 2)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_fuzz_decoder_only_raises_protocol_error(data):
    dec = F.FrameDecoder(max_buffer_size=256, max_control_frame=512)
    try:
        dec.feed(data)
    except ProtocolError:
        return
    assert dec.consumed + dec.pending == len(data)


@settings(max_examples=500, deadline=None)
@given(st.lists(messages, min_size=1, max_size=5), st.data())
def test_fuzz_corrupted_valid_streams(msgs, data):
    """Flip, drop or insert bytes in a valid stream: decoding yields a prefix of
    the messages or ProtocolError, never another exception."""
    wire = bytearray(b"".join(F.encode(m) for m in msgs))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(wire) - 1))
        op = data.draw(st.sampled_from(["flip", "drop", "insert"]))
        if op == "flip":
            wire[pos] ^= data.draw(st.integers(1, 255))
        elif op == "drop":
            del wire[pos]
        else:
            wire.insert(pos, data.draw(st.integers(0, 255)))
    dec = F.FrameDecoder(max_buffer_size=MAX_BUF)
    try:
        out = dec.feed(bytes(wire))
    except ProtocolError:
        return
    assert dec.consumed + dec.pending == len(wire)
    assert len(out) <= len(msgs) + 8


# ------------------------------------------------------------ the socket reader


def _pair():
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    return a, b


def test_frame_reader_receives_payload_into_segment_and_never_past_the_frame():
    nbp = NetworkBufferPool(4, 4096)
    pool = nbp.create_pool(2, 2)
    a, b = _pair()
    try:
        p1, p2 = os.urandom(3000), os.urandom(1000)
        rid = b"r" * 16
        wire = (F.encode_buffer_header(rid, 0, 0, 1, F.DATA_RECORDS, len(p1)) + p1
                + F.encode(F.BacklogAnnouncement(4, rid))
                + F.encode_buffer_header(rid, 0, 1, 0, F.DATA_RECORDS, len(p2)) + p2)
        a.sendall(wire)
        r = FrameReader(b, 4096)
        length, msg_id = r.read_header()
        h = r.read_buffer_header(length)
        assert h.size == 3000 and h.seq == 0
        buf = pool.request()
        r.read_payload_into(buf, h.size)
        buf.set_meta(h.size)
        assert bytes(memoryview(buf)) == p1
        length, msg_id = r.read_header()
        assert r.read_control(length, msg_id) == F.BacklogAnnouncement(4, rid)
        length, msg_id = r.read_header()
        h2 = r.read_buffer_header(length)
        # the staging rule: the second payload is still entirely in the socket
        assert len(b.recv(65536, socket.MSG_PEEK)) == len(p2)
        buf2 = pool.request()
        r.read_payload_into(buf2, h2.size)
        buf2.set_meta(h2.size)
        assert bytes(memoryview(buf2)) == p2
        buf.recycle()
        buf2.recycle()
    finally:
        a.close()
        b.close()


def test_frame_reader_truncated_and_closed():
    nbp = NetworkBufferPool(2, 4096)
    pool = nbp.create_pool(1, 1)
    a, b = _pair()
    a.sendall(F.encode_buffer_header(b"r" * 16, 0, 0, 0, F.DATA_RECORDS, 100) + b"x" * 40)
    a.close()
    r = FrameReader(b, 4096)
    length, _ = r.read_header()
    h = r.read_buffer_header(length)
    buf = pool.request()
    with pytest.raises(ProtocolError, match="truncated"):
        r.read_payload_into(buf, h.size)
    buf.recycle()
    b.close()
    a, b = _pair()
    a.close()
    with pytest.raises(ConnectionLostError):
        FrameReader(b, 4096).read_header()
    b.close()
    a, b = _pair()
    a.sendall(F.encode(F.AddCredit(1, b"r" * 16))[:12])
    a.close()
    with pytest.raises(ProtocolError, match="truncated"):
        r = FrameReader(b, 4096)
        length, msg_id = r.read_header()
        r.read_control(length, msg_id)
    b.close()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_socket_reader_only_raises_protocol_or_connection_errors(data):
    nbp = NetworkBufferPool(2, 256)
    pool = nbp.create_pool(1, 1)
    a, b = _pair()
    try:
        a.sendall(data)
        a.close()
        r = FrameReader(b, 256, 512)
        for _ in range(100):
            length, msg_id = r.read_header()
            if msg_id == F.BUFFER_RESPONSE:
                h = r.read_buffer_header(length)
                if h.is_event:
                    r.read_event()
                else:
                    buf = pool.request()
                    try:
                        r.read_payload_into(buf, h.size)
                    finally:
                        buf.recycle()
            else:
                r.read_control(length, msg_id)
    except (ProtocolError, ConnectionLostError):
        pass
    finally:
        b.close()
    assert pool.in_use == 0



def test_wire_sendmsg_survives_partial_sends_and_releases_its_views():
    import threading
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    # more parts than one sendmsg may carry (IOV_MAX 1024), some large, some empty
    parts = [os.urandom(n) for n in (10, 100_000, 3, 70_000, 1)] + [os.urandom(i % 7) for i in range(2500)]
    views = [memoryview(p) for p in parts]
    got = bytearray()

    def drain():
        while len(got) < sum(map(len, parts)):
            got.extend(b.recv(1000))
    t = threading.Thread(target=drain)
    t.start()
    Wire(a).sendmsg(views)
    t.join(10)
    assert bytes(got) == b"".join(parts)
    for v in views:
        v.release()      # would raise if sendmsg had left a view on them
    a.close()
    b.close()
