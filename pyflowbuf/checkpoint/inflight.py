"""In-flight data of unaligned checkpoints as the storage writes it: each
item (a buffer or an event a barrier overtook) is a 16-byte header (u16 data
type, u16 flags, u32 width or event kind, i64 event payload; little-endian)
and the buffer's bytes (empty for an event)."""
from __future__ import annotations

import struct

from pyflowbuf.checkpoint.storage import CheckpointStateError

_ITEM_HEADER = struct.Struct("<HHIq")     # type, flags, width (event kind), aux


def encode_inflight(items) -> list:
    """In-flight items ``(type, width, flags, aux, payload)`` as the views the
    storage writes: a 16-byte header, then the payload (empty for an event).
    Payloads are written as they are, with no copy on the way."""
    views = []
    for dtype, width, flags, aux, payload in items:
        views.append(memoryview(_ITEM_HEADER.pack(dtype, flags, width, aux)))
        views.append(memoryview(payload if payload is not None else b""))
    return views


def decode_inflight(views) -> list:
    """``encode_inflight`` read back: the items, payloads as bytes."""
    if len(views) % 2:
        raise CheckpointStateError("in-flight data: a header without its payload")
    items = []
    for i in range(0, len(views), 2):
        dtype, flags, width, aux = _ITEM_HEADER.unpack(bytes(views[i]))
        payload = bytes(views[i + 1])
        items.append((dtype, width, flags, aux, payload if dtype != _EVENT_TYPE else None))
    return items


_EVENT_TYPE = 2     # FB_DATA_EVENT


