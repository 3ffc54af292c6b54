"""A small pure-Python reference implementation for differential tests.

* ``RefNetworkPool`` / ``RefLocalPool``: a ``deque`` of free segment indices
  and one ``Lock`` (a ``Condition`` for blocking requests), with the same
  min/max/token rules as ``csrc/fb_arena.h``:

  - a pool's minimum is reserved from ``unreserved`` when it is created (or
    raised), so its first ``min`` requests always succeed;
  - a request beyond the minimum takes one token from ``unreserved`` and the
    recycle gives it back;
  - ``in_use`` never passes ``max`` through a request;
  - ``destroy`` gives the unused reservation back at once, in-use segments come
    back as they are recycled.

  Invariant: ``len(free) == unreserved + sum(max(0, min - in_use))``.

* Record framing: a 4-byte little-endian length and the payload, spanning
  segments freely; ``RefRecordStream`` says which buffers a RecordWriter hands
  over, ``parse_records`` reads them back.

* ``ref_stable_hash``: FNV-1a + the murmur3 64-bit finalizer, as in
  ``csrc/fb_serde.h``; numbers by value (an integral float as its int, ints
  beyond 64 bits by their bytes), frozensets by an order-free sum, no hash().
"""
import math
import struct
import threading
import time
from collections import deque

from pyflowbuf import errors

# --------------------------------------------------------------------------- pools


class RefBuffer:
    def __init__(self, pool, seg):
        self.pool = pool
        self.segment_index = seg
        self.recycled = False

    def recycle(self):
        if self.recycled:
            raise errors.BufferRecycledError("buffer already recycled (double release)")
        self.recycled = True
        self.pool._recycle(self.segment_index)

    release = recycle


class RefNetworkPool:
    def __init__(self, num_segments, segment_size=32 * 1024):
        if not isinstance(num_segments, int) or num_segments < 1:
            raise ValueError(f"num_segments must be >= 1, got {num_segments}")
        if segment_size & (segment_size - 1) or not 256 <= segment_size <= 1 << 20:
            raise ValueError(f"segment_size must be a power of two, got {segment_size}")
        self.total_segments = num_segments
        self.segment_size = segment_size
        self.free = deque(range(num_segments))
        self.unreserved = num_segments
        self.cond = threading.Condition(threading.Lock())
        self.pools = []

    def create_pool(self, min_size, max_size):
        if min_size < 0:
            raise ValueError(f"min_size must be >= 0, got {min_size}")
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        if min_size > max_size:
            raise ValueError(f"min_size ({min_size}) must be <= max_size ({max_size})")
        with self.cond:
            if self.unreserved < min_size:
                raise errors.InsufficientBuffersError(
                    f"required {min_size}, only {self.unreserved} unreserved")
            self.unreserved -= min_size
            pool = RefLocalPool(self, min_size, max_size)
            self.pools.append(pool)
            return pool

    @property
    def available_segments(self):
        return len(self.free)

    @property
    def unreserved_segments(self):
        return self.unreserved

    @property
    def in_use_segments(self):
        return self.total_segments - len(self.free)

    @property
    def live_pools(self):
        return sum(1 for p in self.pools if not p.destroyed)

    def check_invariant(self):
        with self.cond:
            reserved = sum(max(0, p.min - p.in_use_) for p in self.pools if not p.destroyed)
            assert len(self.free) == self.unreserved + reserved, (len(self.free), self.unreserved, reserved)
            assert 0 <= self.unreserved <= self.total_segments


class RefLocalPool:
    def __init__(self, network_pool, min_size, max_size):
        self.network_pool = network_pool
        self.min = min_size
        self.max = max_size
        self.in_use_ = 0
        self.destroyed = False
        self.cancelled = False

    # -- what the core exposes
    @property
    def in_use(self):
        return 0 if self.destroyed else self.in_use_

    @property
    def min_size(self):
        return 0 if self.destroyed else self.min

    @property
    def max_size(self):
        return 0 if self.destroyed else self.max

    def would_grant(self):
        """Whether a request succeeds now (call with the lock held)."""
        if self.in_use_ >= self.max:
            return False
        return self.in_use_ < self.min or self.network_pool.unreserved > 0

    def _take(self):
        a = self.network_pool
        if self.in_use_ >= self.min:
            a.unreserved -= 1
        self.in_use_ += 1
        return RefBuffer(self, a.free.popleft())

    def request(self):
        with self.network_pool.cond:
            if self.destroyed:
                raise errors.PoolDestroyedError("the LocalBufferPool was destroyed")
            return self._take() if self.would_grant() else None

    def request_blocking(self, timeout=None):
        if timeout is not None and timeout < 0:
            raise ValueError("timeout must be >= 0 or None")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.network_pool.cond:
            while True:
                if self.destroyed:
                    raise errors.PoolDestroyedError("the LocalBufferPool was destroyed")
                if self.would_grant():
                    return self._take()
                if self.cancelled:
                    raise errors.CancelledError("cancelled")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise errors.BufferRequestTimeout(f"no buffer within {timeout} s")
                self.network_pool.cond.wait(left)

    def _recycle(self, seg):
        a = self.network_pool
        with a.cond:
            a.free.append(seg)
            self.in_use_ -= 1
            if self.in_use_ >= self.min:
                a.unreserved += 1
            a.cond.notify_all()

    def cancel_waiters(self):
        with self.network_pool.cond:
            self.cancelled = True
            self.network_pool.cond.notify_all()

    def set_size(self, min_size=None, max_size=None):
        a = self.network_pool
        with a.cond:
            if self.destroyed:
                raise errors.PoolDestroyedError("the LocalBufferPool was destroyed")
            new_min = self.min if min_size is None else min_size
            new_max = self.max if max_size is None else max_size
            if new_min < 0:
                raise ValueError(f"min_size must be >= 0, got {new_min}")
            if new_max < 1:
                raise ValueError(f"max_size must be >= 1, got {new_max}")
            if new_min > new_max:
                raise ValueError(f"min_size ({new_min}) must be <= max_size ({new_max})")
            delta = max(self.in_use_, new_min) - max(self.in_use_, self.min)
            if delta > a.unreserved:
                raise errors.InsufficientBuffersError(f"cannot guarantee min_size={new_min}")
            a.unreserved -= delta
            self.min, self.max = new_min, new_max
            a.cond.notify_all()

    def destroy(self):
        a = self.network_pool
        with a.cond:
            if self.destroyed:
                return
            a.unreserved += max(0, self.min - self.in_use_)
            self.min = 0
            self.destroyed = True
            a.cond.notify_all()


# --------------------------------------------------------------------------- records

LENGTH = struct.Struct("<I")


def frame(record):
    return LENGTH.pack(len(record)) + bytes(record)


class RefRecordStream:
    """The buffers a single-channel RecordWriter hands over: records are framed
    and packed back to back; a buffer is handed over when it is exactly full or
    on flush (an empty buffer is never handed over)."""

    def __init__(self, segment_size):
        self.segment_size = segment_size
        self.buffers = []
        self.cur = bytearray()
        self.layout = []  # per record: (buffer of the last prefix byte, of the first and last payload byte)

    def _where(self, k):
        """Buffer index the k-th byte from now will land in."""
        return len(self.buffers) + (len(self.cur) + k) // self.segment_size

    def write(self, record):
        n = len(record)
        hdr_end = self._where(3)
        self.layout.append((hdr_end, self._where(4) if n else hdr_end, self._where(3 + n) if n else hdr_end))
        data = memoryview(frame(record))
        while len(data):
            k = min(self.segment_size - len(self.cur), len(data))
            self.cur += data[:k]
            data = data[k:]
            if len(self.cur) == self.segment_size:
                self.buffers.append(bytes(self.cur))
                self.cur = bytearray()

    def in_one_buffer(self, i):
        """Record i (prefix end and payload) lies in one buffer."""
        a, b, c = self.layout[i]
        return a == b == c

    def spans(self, i):
        """Record i's payload spans buffers."""
        _, b, c = self.layout[i]
        return b != c

    def flush(self):
        if self.cur:
            self.buffers.append(bytes(self.cur))
            self.cur = bytearray()


def parse_records(buffers):
    """Records framed across ``buffers`` (an iterable of bytes-likes)."""
    stream = b"".join(bytes(b) for b in buffers)
    out, pos = [], 0
    while pos < len(stream):
        if pos + 4 > len(stream):
            raise errors.CorruptRecordError("stream ends inside a length prefix")
        (n,) = LENGTH.unpack_from(stream, pos)
        pos += 4
        if pos + n > len(stream):
            raise errors.CorruptRecordError("stream ends inside a record")
        out.append(stream[pos:pos + n])
        pos += n
    return out


def fixed_buffer_counts(segment_size, width, batch_sizes):
    """Records per buffer for consecutive ``write_array`` calls of ``width``-byte
    rows (no flush in between): buffers are filled to ``segment_size // width``."""
    per = segment_size // width
    total = sum(batch_sizes)
    full, rest = divmod(total, per)
    return [per] * full + ([rest] if rest else [])


# --------------------------------------------------------------------------- hashing

_M = (1 << 64) - 1


def mix64(h):
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & _M
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & _M
    h ^= h >> 33
    return h


def fnv1a(data):
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & _M
    return mix64(h)


_NONE_HASH = 0x6A09E667F3BCC909
_FROZENSET_SEED = 0x2545F4914F6CDD1D
_FLOAT_SALT = 0x243F6A8885A308D3


def _ref_int_hash(key):
    if -(1 << 63) <= key < (1 << 63):
        return mix64(key & _M)
    return fnv1a(key.to_bytes((key.bit_length() + 8) // 8, "little", signed=True))


def ref_stable_hash(key):
    """Keys that compare equal hash equal (1 == 1.0 == True); nothing uses hash()."""
    if key is None:
        return _NONE_HASH
    if isinstance(key, float):
        if math.isfinite(key) and key == math.floor(key):
            return _ref_int_hash(int(key))
        return mix64(struct.unpack("<Q", struct.pack("<d", key))[0] ^ _FLOAT_SALT)
    if isinstance(key, int):
        return _ref_int_hash(int(key))
    if isinstance(key, str):
        return fnv1a(key.encode("utf-8", "surrogatepass"))
    if isinstance(key, (bytes, bytearray, memoryview)):
        return fnv1a(bytes(key))
    if isinstance(key, tuple):
        h = 0x9E3779B97F4A7C15
        for item in key:
            h = mix64(h ^ ref_stable_hash(item))
        return h
    if isinstance(key, frozenset):
        h = _FROZENSET_SEED
        for item in key:
            h = (h + ref_stable_hash(item)) & _M
        return mix64(h ^ len(key))
    raise TypeError(f"no stable hash for {type(key).__name__}")