"""Shared Hypothesis strategies for pyflowbuf tests."""
import math
import random

from hypothesis import strategies as st

MIN_SEGMENT = 256
MAX_TEST_SEGMENT = 65536
SEGMENT_SIZES = [1 << k for k in range(8, 17)]  # 256 .. 65536
LENGTH_PREFIX = 4

segment_sizes = st.sampled_from(SEGMENT_SIZES)
small_segment_sizes = st.sampled_from(SEGMENT_SIZES[:4])  # 256 .. 2048


def boundary_sizes(segment_size):
    """Record sizes that sit on the edges of a segment, the length prefix
    (4 bytes) included: a record that exactly fills a segment, one that leaves
    1..3 bytes (so the next prefix is split), spans of two and three segments."""
    s = segment_size
    p = LENGTH_PREFIX
    sizes = {0, 1, 2, 3, 4, 5, 7, 8, 9,
             s - p - 1, s - p, s - p + 1, s - p - 3, s - p - 2,
             s - 1, s, s + 1,
             2 * s - p, 2 * s - 1, 2 * s, 2 * s + 1,
             3 * s - 2 * p, 3 * s + 1}
    return sorted(x for x in sizes if x >= 0)


def record_sizes(segment_size, max_segments=3):
    """A record size: mostly boundary values, sometimes anything up to
    ``max_segments`` segments."""
    return st.one_of(
        st.sampled_from(boundary_sizes(segment_size)),
        st.integers(0, 64),
        st.integers(0, max_segments * segment_size + 1),
    )


def payload(size, seed):
    """Deterministic pseudo-random bytes (cheap for large sizes)."""
    return random.Random(seed).randbytes(size)


@st.composite
def record_streams(draw, segment_size=None, max_records=24, max_segments=3):
    """``(segment_size, [bytes, ...])`` with sizes around the segment edges."""
    if segment_size is None:
        segment_size = draw(segment_sizes)
    sizes = draw(st.lists(record_sizes(segment_size, max_segments), max_size=max_records))
    seed = draw(st.integers(0, 2**32 - 1))
    return segment_size, [payload(n, seed + i) for i, n in enumerate(sizes)]


def segments_needed(records, segment_size, flushes=0):
    """Upper bound of the segments a writer fills with ``records`` (each
    framed by a 4-byte length) plus one partial buffer per flush."""
    framed = sum(len(r) + LENGTH_PREFIX for r in records)
    return max(1, math.ceil(framed / segment_size) + flushes + 1)


int64s = st.integers(-(2**63), 2**63 - 1)
float64s = st.floats(allow_nan=True, allow_infinity=True)
texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=200)


@st.composite
def pool_shapes(draw, max_total=16):
    """``(total_segments, min_size, max_size)`` with min <= max."""
    total = draw(st.integers(1, max_total))
    max_size = draw(st.integers(1, max_total + 2))
    min_size = draw(st.integers(0, max_size))
    return total, min_size, max_size


# A write program for the serde differential test: records and flushes.
def write_ops(segment_size, max_ops=30):
    rec = st.tuples(st.just("write"), record_sizes(segment_size, 2), st.integers(0, 2**31))
    return st.lists(st.one_of(rec, rec, rec, st.just(("flush",))), max_size=max_ops)
