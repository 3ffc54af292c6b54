"""The container format shared by task state files, ``_metadata`` and ``dumps``:
a checksummed header, checksummed sections, an END record. ``_ContainerWriter``
writes it piece by piece from caller memory; ``_parse`` reads it back from memory
(``_MemSource``) or in bounded chunks from a file (``_StreamSource``);
``_split_value`` / ``_split_inflight`` cut a section's payload into its parts.

File format (version 1)
=======================
Task state files and ``_metadata`` share one container format; integers are
little-endian.

Header, 16 bytes::

    magic       8 bytes   b"\\x89PFBCKP\\n"
    version     u16       1
    file_kind   u16       1 = task state, 2 = checkpoint metadata, 3 = bare value
    header_crc  u32       CRC-32 (zlib.crc32) of the 12 bytes above

Then sections, each::

    kind        u16       1 INFO, 2 STATE, 3 INFLIGHT, 4 METADATA, 5 VALUE, 0xFFFF END
    flags       u16       bit 0: the value holds pickled objects; other bits are 0
    name_len    u32
    payload_len u64
    header_crc  u32       CRC-32 of the 16 bytes above (a reader trusts the
                          lengths only after this matches)
    name        name_len bytes, UTF-8 (an in-flight section's channel id)
    payload     payload_len bytes
    body_crc    u32       CRC-32 of name + payload

The last section is END; its payload is ``u64 sections_before_end, u64
offset_of_end``, and the file ends right after it, so a truncated file, a
dropped section or trailing garbage are all detected.

Value payload (INFO, STATE, METADATA, VALUE)::

    n_buffers   u32
    reserved    u32       0
    tree_len    u64
    n_buffers x (offset u64, length u64)   offsets from the payload's start
    tree        tree_len bytes: MessagePack (msgpack.org spec) of the value
    buffers     out-of-band raw bytes (NumPy array data, Arrow IPC streams),
                each starting at a 64-byte-aligned file offset, zero padding between

In-flight payload (one INFLIGHT section per channel and write call)::

    n_buffers   u32
    reserved    u32       0
    n_buffers x length u64
    the buffers' bytes, back to back (buffer boundaries are kept)

A task file holds INFO (``checkpoint_id``, ``task_key``, ``alignment``,
``created``, ``writer``), any number of INFLIGHT sections, exactly one STATE
section and END. ``_metadata`` holds one METADATA section and END.
"""
from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass
from typing import Iterator

from pyflowbuf.checkpoint.codec import EncodedValue, _byte_view, _Decoder, encode_value
from pyflowbuf.checkpoint.errors import CheckpointError, CorruptCheckpointError, PickleNotAllowedError, _Corrupt

MAGIC = b"\x89PFBCKP\n"
FORMAT_VERSION = 1
FILE_TASK_STATE, FILE_METADATA, FILE_VALUE = 1, 2, 3
SEC_INFO, SEC_STATE, SEC_INFLIGHT, SEC_METADATA, SEC_VALUE, SEC_END = 1, 2, 3, 4, 5, 0xFFFF
FLAG_PICKLE = 1

_FILE_HEADER = struct.Struct("<8sHHI")
_SEC_HEADER = struct.Struct("<HHIQI")
_SEC_HEADER_BODY = struct.Struct("<HHIQ")
_CRC = struct.Struct("<I")
_VALUE_PREFIX = struct.Struct("<IIQ")
_PAIR = struct.Struct("<QQ")
_U64 = struct.Struct("<Q")
_INFLIGHT_PREFIX = struct.Struct("<II")

_KNOWN_SECTIONS = {SEC_INFO, SEC_STATE, SEC_INFLIGHT, SEC_METADATA, SEC_VALUE, SEC_END}
_MAX_NAME = 1 << 16
_ALIGN = 64
_ZEROS = bytes(_ALIGN)
_VERIFY_CHUNK = 1 << 20

# ---------------------------------------------------------------------------- container writer


class _ContainerWriter:
    """Writes the container format to a binary file object, one write per piece,
    so caller memory (segments, arrays) goes to the file without being joined."""

    def __init__(self, f, file_kind: int):
        self._f = f
        self.pos = 0
        self.sections = 0
        head = struct.pack("<8sHH", MAGIC, FORMAT_VERSION, file_kind)
        self._raw(head + _CRC.pack(zlib.crc32(head)))

    def _raw(self, data):
        n = len(data) if isinstance(data, bytes) else data.nbytes
        if n:
            self._f.write(data)
            self.pos += n

    def section(self, kind: int, name: str, pieces, flags: int = 0) -> int:
        name_b = name.encode("utf-8")
        if len(name_b) > _MAX_NAME:
            raise ValueError(f"section name longer than {_MAX_NAME} bytes")
        plen = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
        head = _SEC_HEADER_BODY.pack(kind, flags, len(name_b), plen)
        self._raw(head + _CRC.pack(zlib.crc32(head)) + name_b)
        crc = zlib.crc32(name_b)
        for p in pieces:
            crc = zlib.crc32(p, crc)
            self._raw(p)
        self._raw(_CRC.pack(crc))
        self.sections += 1
        return plen

    def value_section(self, kind: int, name: str, enc: EncodedValue) -> int:
        n = len(enc.buffers)
        payload_at = self.pos + _SEC_HEADER.size + len(name.encode("utf-8"))
        cursor = _VALUE_PREFIX.size + _PAIR.size * n + len(enc.tree)
        table, body = [], []
        for buf in enc.buffers:
            pad = -(payload_at + cursor) % _ALIGN
            if pad:
                body.append(memoryview(_ZEROS)[:pad])
            cursor += pad
            table.append(_PAIR.pack(cursor, buf.nbytes))
            body.append(buf)
            cursor += buf.nbytes
        prefix = _VALUE_PREFIX.pack(n, 0, len(enc.tree)) + b"".join(table)
        flags = FLAG_PICKLE if enc.pickled else 0
        return self.section(kind, name, [prefix, enc.tree, *body], flags)

    def inflight_section(self, channel: str, views) -> int:
        prefix = _INFLIGHT_PREFIX.pack(len(views), 0) + b"".join(_U64.pack(v.nbytes) for v in views)
        self.section(SEC_INFLIGHT, channel, [prefix, *views])
        return sum(v.nbytes for v in views)

    def end(self):
        self.section(SEC_END, "", [_PAIR.pack(self.sections, self.pos)])


# ---------------------------------------------------------------------------- container reader


class _MemSource:
    """Parses from one in-memory buffer; payloads come back as views of it."""

    def __init__(self, data: memoryview):
        self.data = data
        self.pos = 0

    def take(self, n: int):
        if self.pos + n > len(self.data):
            raise _Corrupt(f"truncated: needs {self.pos + n} bytes, has {len(self.data)}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def payload(self, n: int, crc: int, keep: bool):
        view = self.take(n)
        return view, zlib.crc32(view, crc)

    def at_eof(self) -> bool:
        return self.pos == len(self.data)


class _StreamSource:
    """Parses from a file object in bounded chunks, checking CRCs without holding
    the payloads (unless asked to keep one)."""

    def __init__(self, f, size: int):
        self.f = f
        self.size = size  # known from the file system: lengths beyond it are corrupt, not allocated
        self.pos = 0
        self._chunk = None

    def _need(self, n: int):
        if self.pos + n > self.size:
            raise _Corrupt(f"truncated: needs {self.pos + n} bytes, has {self.size}")

    def _read_into(self, view: memoryview) -> int:
        got = 0
        while got < len(view):
            n = self.f.readinto(view[got:])
            if not n:
                break
            got += n
        self.pos += got
        return got

    def take(self, n: int):
        self._need(n)
        buf = bytearray(n)
        if self._read_into(memoryview(buf)) != n:
            raise _Corrupt(f"truncated at byte {self.pos}")
        return memoryview(buf)

    def payload(self, n: int, crc: int, keep: bool):
        if keep:
            view = self.take(n)
            return view, zlib.crc32(view, crc)
        self._need(n)
        if self._chunk is None:
            self._chunk = memoryview(bytearray(min(n, _VERIFY_CHUNK) or 1))
        left = n
        while left:
            part = self._chunk[:min(left, len(self._chunk))]
            got = self._read_into(part)
            if got != len(part):
                raise _Corrupt(f"truncated at byte {self.pos}")
            crc = zlib.crc32(part, crc)
            left -= got
        return None, crc

    def at_eof(self) -> bool:
        return not self.f.read(1)


@dataclass
class _Section:
    kind: int
    flags: int
    name: str
    payload: memoryview | None
    size: int


def _parse(src, expect_kind: int, keep=lambda kind: True) -> Iterator[_Section]:
    """Yield the sections of a container, END excluded, checking every CRC,
    length and the END record. Raises _Corrupt."""
    head = src.take(_FILE_HEADER.size)
    magic, version, file_kind, crc = _FILE_HEADER.unpack(head)
    if magic != MAGIC:
        raise _Corrupt("not a pyflowbuf checkpoint file (bad magic)")
    if zlib.crc32(head[:12]) != crc:
        raise _Corrupt("file header checksum mismatch")
    if version != FORMAT_VERSION:
        raise _Corrupt(f"format version {version}, this reader knows {FORMAT_VERSION}")
    if file_kind != expect_kind:
        raise _Corrupt(f"file kind {file_kind}, expected {expect_kind}")
    count = 0
    while True:
        start = src.pos
        sh = src.take(_SEC_HEADER.size)
        kind, flags, name_len, plen, hcrc = _SEC_HEADER.unpack(sh)
        if zlib.crc32(sh[:16]) != hcrc:
            raise _Corrupt(f"section header checksum mismatch at byte {start}")
        if kind not in _KNOWN_SECTIONS or flags & ~FLAG_PICKLE or name_len > _MAX_NAME:
            raise _Corrupt(f"unknown section kind {kind} / flags {flags:#x} at byte {start}")
        name_b = src.take(name_len)
        body_crc = zlib.crc32(name_b)
        payload, body_crc = src.payload(plen, body_crc, kind == SEC_END or keep(kind))
        (stored,) = _CRC.unpack(src.take(4))
        if stored != body_crc:
            raise _Corrupt(f"section checksum mismatch at byte {start} (kind {kind})")
        if kind == SEC_END:
            if plen != _PAIR.size or _PAIR.unpack(payload) != (count, start):
                raise _Corrupt("END record does not match the sections before it")
            if not src.at_eof():
                raise _Corrupt("bytes after the END section")
            return
        try:
            name = bytes(name_b).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Corrupt(f"section name is not UTF-8: {e}") from e
        count += 1
        yield _Section(kind, flags, name, payload, plen)


def _split_value(payload: memoryview):
    """(tree view, buffer views) of a value section payload."""
    if len(payload) < _VALUE_PREFIX.size:
        raise _Corrupt("value section too short")
    n, reserved, tree_len = _VALUE_PREFIX.unpack(payload[:_VALUE_PREFIX.size])
    table_end = _VALUE_PREFIX.size + _PAIR.size * n
    if reserved or table_end + tree_len > len(payload):
        raise _Corrupt("value section table does not fit its payload")
    cursor = table_end + tree_len
    buffers = []
    for i in range(n):
        off, length = _PAIR.unpack(payload[_VALUE_PREFIX.size + _PAIR.size * i:][:_PAIR.size])
        if off < cursor or off + length > len(payload):
            raise _Corrupt(f"out-of-band buffer {i} lies outside its section")
        buffers.append(payload[off:off + length])
        cursor = off + length
    return payload[table_end:table_end + tree_len], buffers


def _split_inflight(payload: memoryview) -> list:
    if len(payload) < _INFLIGHT_PREFIX.size:
        raise _Corrupt("in-flight section too short")
    n, reserved = _INFLIGHT_PREFIX.unpack(payload[:_INFLIGHT_PREFIX.size])
    at = _INFLIGHT_PREFIX.size + _U64.size * n
    if reserved or at > len(payload):
        raise _Corrupt("in-flight section table does not fit its payload")
    lengths = [_U64.unpack(payload[_INFLIGHT_PREFIX.size + 8 * i:][:8])[0] for i in range(n)]
    if at + sum(lengths) != len(payload):
        raise _Corrupt("in-flight buffer lengths do not add up to the section")
    views = []
    for length in lengths:
        views.append(payload[at:at + length].toreadonly())
        at += length
    return views


def _decode_section(sec: _Section, allow_pickle: bool):
    tree, buffers = _split_value(sec.payload)
    return _Decoder(buffers, allow_pickle).decode(tree)


def dumps(value, *, allow_pickle: bool = False) -> bytes:
    """A standalone file (kind 3) holding one value, in the checkpoint format."""
    out = io.BytesIO()
    w = _ContainerWriter(out, FILE_VALUE)
    w.value_section(SEC_VALUE, "value", encode_value(value, allow_pickle=allow_pickle))
    w.end()
    return out.getvalue()


def loads(data, *, allow_pickle: bool = False):
    """Inverse of ``dumps``. Arrays come back as views of ``data`` when it is
    writable (a bytearray), otherwise of a private copy."""
    mv = _byte_view(data)
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    try:
        sections = list(_parse(_MemSource(mv), FILE_VALUE))
        if [s.kind for s in sections] != [SEC_VALUE]:
            raise _Corrupt("expected exactly one value section")
        return _decode_section(sections[0], allow_pickle)
    except (PickleNotAllowedError, CheckpointError):
        raise
    except Exception as e:
        raise CorruptCheckpointError(str(e)) from e
