"""Contracts that used to rest on copies staying equal (issue 28, point 4):
one definition of the key-group owner, used by routing and by state
assignment; one definition of the segment default; the batch kinds follow
the job's segment size."""
import inspect
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf._core import memory
from pyflowbuf._core.channel import BufferQueue
from pyflowbuf._core.memory import DEFAULT_SEGMENT_SIZE, NetworkBufferPool
from pyflowbuf._core.serde import RecordReader, RecordWriter
from pyflowbuf.checkpoint import keygroups as kg

from reference_model import ref_stable_hash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------ key-group owner

keys_st = st.lists(st.one_of(st.integers(-2**70, 2**70), st.text(max_size=6), st.binary(max_size=6),
                             st.floats(allow_nan=False), st.none(),
                             st.tuples(st.integers(-9, 9), st.text(max_size=2))), max_size=80)


@st.composite
def parallelisms(draw):
    p = draw(st.integers(1, 40))
    # powers of two (the default 128) take the writer's mask-and-shift path,
    # the others its divisions: both must agree with state assignment
    maxp = draw(st.one_of(st.sampled_from([m for m in (1 << i for i in range(16)) if m >= p]),
                          st.integers(p, 300), st.integers(p, 1 << 15)))
    return p, maxp


def routed(keys, p, maxp):
    """The channel RecordWriter.write_batch_keyed sends each key's record to."""
    nbp = NetworkBufferPool(64, 4096)
    queues = [BufferQueue(nbp) for _ in range(p)]
    writer = RecordWriter(nbp.create_pool(0, 64), queues, kind="int64")
    writer.write_batch_keyed(list(range(len(keys))), keys, None, maxp)
    writer.end_input()
    where = [None] * len(keys)
    for ch, q in enumerate(queues):
        for i in RecordReader(q, kind="int64"):
            where[i] = ch
    return where


@settings(max_examples=200, deadline=None)
@given(keys=keys_st, pm=parallelisms())
def test_routing_and_state_assignment_agree_on_every_key(keys, pm):
    """The subtask key_by sends a key to is the subtask whose key-group range
    (what a restore hands it) holds the key's group, for every key,
    parallelism and max_parallelism; and both are Flink's formula."""
    p, maxp = pm
    ranges = [kg.key_group_range(maxp, p, i) for i in range(p)]
    for key, ch in zip(keys, routed(keys, p, maxp)):
        group = kg.key_group(key, maxp)
        assert group == ref_stable_hash(key) % maxp
        assert ranges[ch][0] <= group < ranges[ch][1], (key, ch, ranges[ch])
        assert ch == kg.operator_index(maxp, p, group) == group * p // maxp


@settings(max_examples=100, deadline=None)
@given(pm=parallelisms())
def test_every_group_has_exactly_the_owner_whose_range_holds_it(pm):
    p, maxp = pm
    ranges = [kg.key_group_range(maxp, p, i) for i in range(p)]
    assert ranges[0][0] == 0 and ranges[-1][1] == maxp
    for (_, e0), (s1, _) in zip(ranges, ranges[1:]):
        assert e0 == s1
    for g in range(0, maxp, max(1, maxp // 64)):
        i = kg.operator_index(maxp, p, g)
        assert ranges[i][0] <= g < ranges[i][1]


def test_key_group_arguments_out_of_range_are_refused():
    with pytest.raises(ValueError, match="max_parallelism must be > 0"):
        kg.key_group("a", 0)
    with pytest.raises(ValueError, match="parallelism must be in 1..max_parallelism=4"):
        kg.key_group_range(4, 5, 0)
    with pytest.raises(ValueError, match="subtask index 3 is outside 0..2"):
        kg.key_group_range(8, 3, 3)
    with pytest.raises(ValueError, match="key group 8 is outside 0..7"):
        kg.operator_index(8, 3, 8)


# ------------------------------------------------------------ segment default

# A literal of the segment default (32 KiB) in code, outside its definition.
_SEGMENT_LITERAL = re.compile(r"\b32u?\s*\*\s*1024u?\b|\b32768\b")
_ALLOWED = {
    ("csrc/fb_arena.h", "#define FB_DEFAULT_SEGMENT_SIZE"),            # the definition
    ("pyflowbuf/checkpointing/inflight.py", "_ITEM_BYTES = "),      # a replay item's size, not a segment's
    ("pyflowbuf/api/environment.py", "max_parallelism"),              # the key-group bound (1 << 15)
}


def test_the_segment_default_is_written_once():
    found = []
    for top in ("pyflowbuf", "csrc"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if not name.endswith((".py", ".pyx", ".pxi", ".pxd", ".h", ".pyi")):
                    continue
                path = os.path.join(d, name)
                rel = os.path.relpath(path, ROOT)
                with open(path, encoding="utf-8") as f:
                    for n, line in enumerate(f, 1):
                        if _SEGMENT_LITERAL.search(line) and not any(
                                rel == a and what in line for a, what in _ALLOWED):
                            found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, ("the segment default is defined once (FB_DEFAULT_SEGMENT_SIZE, csrc/fb_arena.h) and "
                       "reaches Python as pyflowbuf._core.memory.DEFAULT_SEGMENT_SIZE; use that:\n"
                       + "\n".join(found))


def test_every_segment_default_is_the_one_definition():
    from pyflowbuf.exchange.debloat import DebloatSettings
    from pyflowbuf.net.frames import FrameDecoder
    from pyflowbuf.net.server import NetworkServer

    assert DEFAULT_SEGMENT_SIZE == 32 * 1024          # Flink's default
    assert memory.MIN_SEGMENT_SIZE == 256 and memory.MAX_SEGMENT_SIZE == 1 << 20
    assert fb.NetworkConfig().segment_size == DEFAULT_SEGMENT_SIZE
    assert NetworkBufferPool(1).segment_size == DEFAULT_SEGMENT_SIZE
    assert DebloatSettings().max_size == DEFAULT_SEGMENT_SIZE
    assert FrameDecoder().max_buffer_size == DEFAULT_SEGMENT_SIZE
    assert inspect.signature(NetworkServer).parameters["max_buffer_size"].default == DEFAULT_SEGMENT_SIZE
    pytest.importorskip("pyarrow")
    pytest.importorskip("pandas")
    from pyflowbuf import serializers_arrow as sa

    assert sa.DEFAULT_SEGMENT_SIZE == DEFAULT_SEGMENT_SIZE
    assert sa.ArrowSerializer().segment_size == sa.NumpySerializer().segment_size == DEFAULT_SEGMENT_SIZE
    assert sa.PandasSerializer().arrow.segment_size == DEFAULT_SEGMENT_SIZE


# ------------------------------------------- the batch kinds and segment_size

@pytest.mark.parametrize("segment_size, rows", [
    (1 << 18, 8000),    # 64 KB records inside one 256 KiB segment: aligned in place
    (4096, 1200),       # 10 KB records spanning 4 KiB segments: aligned once reassembled
])
def test_arrow_records_follow_the_jobs_segment_size(segment_size, rows):
    """The arrow kind aligns a record's payload for the segments it travels
    through. With the job's segment size, not the 32 KiB default, every
    batch is decoded in place: its column buffers are slices of the record,
    not copies Arrow had to make to realign them."""
    pa = pytest.importorskip("pyarrow")
    np = pytest.importorskip("numpy")
    seen = []

    def sink(batches):
        for b in batches:
            buf = b.column(0).buffers()[1]
            seen.append((b.num_rows, buf.address % 8, buf.parent is not None))

    env = fb.Environment(network=fb.NetworkConfig(segment_size=segment_size), chaining=False)
    data = [pa.record_batch([pa.array(np.arange(rows, dtype=np.int64) + i)], names=["x"]) for i in range(3)]
    (env.from_collection(data, kind="arrow").map(lambda b: b, kind="arrow")
        .sink(sink, batched=True))
    env.execute(60)
    assert seen == [(rows, 0, True)] * 3


def test_the_batch_kinds_take_a_segment_size_and_others_ignore_it():
    pytest.importorskip("pyarrow")
    pytest.importorskip("pandas")
    from pyflowbuf import serializers_arrow as sa
    from pyflowbuf.serializers import get_serializer

    for ser in (sa.ArrowSerializer(zero_copy=False), sa.NumpySerializer(), sa.PandasSerializer()):
        mine = ser.for_segment_size(4096)
        assert (mine.arrow if isinstance(mine, sa.PandasSerializer) else mine).segment_size == 4096
        assert ser.for_segment_size(DEFAULT_SEGMENT_SIZE) is ser       # unchanged: no copy
        assert (ser.arrow if isinstance(ser, sa.PandasSerializer) else ser).segment_size == DEFAULT_SEGMENT_SIZE
    assert sa.ArrowSerializer(zero_copy=False).for_segment_size(4096).zero_copy is False
    core = get_serializer("int64")
    assert core.for_segment_size(4096) is core


# ------------------------------------------ the operator contract's optional parts

_OPTIONAL = ("timestamped", "passes_records", "on_watermark", "metrics")
# (an exchange side's ``timestamped`` is not the operator's: it may stay a probe)
_PROBE = re.compile(r"\b(?:getattr|hasattr)\((?!side\b)[^,()]+,\s*[\"'](%s)[\"']" % "|".join(_OPTIONAL))


def test_the_optional_parts_of_an_operator_are_declared_with_their_defaults():
    from pyflowbuf.operators.basic import Map
    from pyflowbuf.operators.contracts import Operator

    class Nothing(Operator):
        def process_batch(self, batch):
            return batch

    op = Nothing("x")
    assert (op.timestamped, op.passes_records, op.on_watermark, op.metrics) == (False, False, None, None)
    m = Map("m", lambda x: x)
    assert m.on_watermark is None and m.metrics is None
    assert m.process_batch([1, 2]) == [1, 2]


def test_the_runtime_reads_the_optional_parts_without_probing():
    found = []
    for top in ("pyflowbuf/runtime", "pyflowbuf/testing.py"):
        path = os.path.join(ROOT, top)
        files = [path] if path.endswith(".py") else [
            os.path.join(d, n) for d, _, names in os.walk(path) for n in names if n.endswith(".py")]
        for f in files:
            with open(f, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if _PROBE.search(line):
                        found.append(f"{os.path.relpath(f, ROOT)}:{n}: {line.strip()}")
    assert not found, ("Operator declares these (pyflowbuf/operators/basic.py): read them as attributes\n"
                       + "\n".join(found))
