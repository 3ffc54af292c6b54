"""Durable checkpoint storage (pyflowbuf.checkpoint): format, codec,
layout, completion, retention, damage detection and the pickle opt-in."""
import logging
import os
import struct
import threading
import uuid

import fsspec
import msgpack
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pyflowbuf import errors
from pyflowbuf.checkpoint import (
    CheckpointNotFoundError,
    CheckpointStateError,
    CheckpointStorage,
    CorruptCheckpointError,
    PickleNotAllowedError,
    TaskStateHandle,
    TaskStateNotFoundError,
    UnsupportedStateError,
    dumps,
    encode_value,
    loads,
)
from pyflowbuf.checkpoint import codec as V
from pyflowbuf.checkpoint import container as C
from pyflowbuf.checkpoint import storage as S
from pyflowbuf.checkpoint.errors import _Corrupt

# ----------------------------------------------------------------- helpers


def _reset_memory_fs():
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs.clear()
    MemoryFileSystem.pseudo_dirs.append("")


@pytest.fixture
def memfs():
    _reset_memory_fs()
    yield fsspec.filesystem("memory")
    _reset_memory_fs()


@pytest.fixture(params=["memory", "local"])
def url(request, tmp_path, memfs):
    if request.param == "memory":
        return f"memory://ckpt-{uuid.uuid4().hex[:8]}"
    return str(tmp_path / "ckpt")


def same(a, b):
    """Deep equality that also demands the same types, compares floats by their
    bits (NaN, -0.0) and arrays by dtype, shape and bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, complex):
        return same(a.real, b.real) and same(a.imag, b.imag)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)  # insertion order kept
    if hasattr(a, "equals"):  # Arrow
        return a.equals(b)
    return a == b


def task_files(storage, cid):
    d = storage.checkpoint_path(cid)
    return sorted(p.rsplit("/", 1)[-1] for p in storage.fs.ls(d, detail=False))


def chk_dirs(storage):
    return sorted(int(p.rsplit("-", 1)[-1]) for p in storage.fs.ls(storage.root, detail=False))


def checkpoint(storage, cid, states, **kw):
    handles = [storage.write_task_state(cid, key, state) for key, state in states.items()]
    return storage.complete(cid, handles, **kw)


def task_path(storage, cid, key):
    return f"{storage.checkpoint_path(cid)}/{S.task_file_name(key)}"


def rewrite(storage, path, fn):
    data = bytearray(storage.fs.cat_file(path))
    with storage.fs.open(path, "wb") as f:
        f.write(bytes(fn(data)))


# ----------------------------------------------------------------- strategies

hashable = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.binary(max_size=8)
    | st.floats(allow_nan=False),
    lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=3),
    max_leaves=6)

numpy_arrays = hnp.arrays(
    dtype=hnp.scalar_dtypes() | hnp.byte_string_dtypes() | hnp.unicode_string_dtypes()
    | hnp.nested_dtypes(max_itemsize=64),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6))

leaves = (
    st.none() | st.booleans() | st.integers() | st.integers(min_value=2**63, max_value=2**200)
    | st.integers(max_value=-2**63 - 1, min_value=-2**200) | st.floats() | st.complex_numbers()
    | st.text(st.characters(codec=None, exclude_categories=())) | st.binary()
    | numpy_arrays | hnp.from_dtype(np.dtype("float64")) | hnp.from_dtype(np.dtype("int16"))
    | hnp.from_dtype(np.dtype("U5")) | hnp.from_dtype(np.dtype("datetime64[ms]")))

plain_values = st.recursive(
    leaves,
    lambda inner: (st.lists(inner, max_size=4) | st.tuples(inner, inner)
                   | st.dictionaries(hashable, inner, max_size=4) | st.sets(hashable, max_size=4)
                   | st.frozensets(hashable, max_size=4)),
    max_leaves=20)


# ----------------------------------------------------------------- codec and container


@given(plain_values)
def test_value_roundtrip(value):
    assert same(loads(dumps(value)), value)


@settings(max_examples=25)
@given(value=plain_values)
def test_value_roundtrip_through_memory_storage(value):
    _reset_memory_fs()
    storage = CheckpointStorage("memory://prop", retained=1)
    handle = storage.write_task_state(1, "op[0]", value)
    storage.complete(1, [handle])
    assert same(storage.read_task_state(1, "op[0]").state, value)


@pytest.mark.parametrize("arr", [
    np.asfortranarray(np.arange(24, dtype="<i4").reshape(2, 3, 4)),
    np.asfortranarray(np.arange(30000.0).reshape(100, 300)),  # out-of-band, Fortran order
    np.arange(40000, dtype=">u8")[::3],  # non-contiguous, big-endian
    np.zeros((0, 5), dtype="f4"),
    np.array(3.5),
    np.arange(5000).astype("M8[s]"),
    np.zeros(700, dtype=np.dtype([("k", "<i2"), ("v", "<f8", (3,)), ("s", "S3")], align=True)),
    np.zeros(4, dtype=np.dtype({"names": ["a", "b"], "formats": ["<i4", "<f8"], "offsets": [0, 12],
                                "itemsize": 24})),
], ids=["fortran", "fortran-oob", "strided-bigendian", "empty", "0d", "datetime", "struct-aligned",
        "struct-offsets"])
def test_numpy_arrays_roundtrip_writable(arr):
    back = loads(dumps({"a": arr}))["a"]
    assert back.dtype == arr.dtype and back.shape == arr.shape
    assert np.array_equal(back, arr)
    assert back.flags.writeable
    if arr.flags.f_contiguous and not arr.flags.c_contiguous:
        assert back.flags.f_contiguous


def test_large_array_goes_out_of_band_without_copy():
    arr = np.arange(1 << 16, dtype=np.float64)
    enc = encode_value({"w": arr, "small": np.arange(3)})
    assert len(enc.buffers) == 1 and np.shares_memory(np.asarray(enc.buffers[0]), arr)
    assert len(enc.tree) < 200
    off, length = _first_oob_entry(dumps({"w": arr}))
    assert length == arr.nbytes and off % 64 == 0  # aligned in the file


def _first_oob_entry(data):
    """(file offset, length) of the first out-of-band buffer of a dumps() file."""
    at = C._FILE_HEADER.size
    kind, flags, name_len, plen, _ = C._SEC_HEADER.unpack_from(data, at)
    payload = at + C._SEC_HEADER.size + name_len
    n, _, _ = C._VALUE_PREFIX.unpack_from(data, payload)
    assert n >= 1
    off, length = C._PAIR.unpack_from(data, payload + C._VALUE_PREFIX.size)
    return payload + off, length


def test_arrow_roundtrip():
    pa = pytest.importorskip("pyarrow")
    batch = pa.record_batch({"x": list(range(100)), "s": [str(i) for i in range(100)]})
    table = pa.table({"y": [1.5, None, 3.0]})
    back = loads(dumps({"b": batch.slice(10, 20), "t": table}))
    assert back["b"].equals(batch.slice(10, 20)) and back["t"].equals(table)


@pytest.mark.parametrize("value, where, type_name", [
    ({"c": [1, __import__("collections").defaultdict(int)]}, "state['c'][1]", "collections.defaultdict"),
    ((1, {2: object()}), "state[1][2]", "object"),
    ({"arr": np.array([1, "x"], dtype=object)}, "state['arr']", "numpy.ndarray"),
    (__import__("enum").IntEnum("E", "A").A, "state", "E"),
])
def test_not_plain_data_is_refused_at_snapshot_naming_type_and_place(value, where, type_name):
    with pytest.raises(UnsupportedStateError) as ei:
        dumps(value)
    assert ei.value.where == where and type_name in ei.value.type_name
    assert type_name in str(ei.value) and "allow_pickle=True" in str(ei.value)
    assert isinstance(ei.value, TypeError) and isinstance(ei.value, errors.FlowBufError)


def test_too_deep_nesting_is_refused_at_write_not_at_read():
    v = ()
    for _ in range(V.MAX_EXT_DEPTH + 5):
        v = (v,)
    with pytest.raises(UnsupportedStateError, match="deeper"):
        dumps(v)
    ok = ()
    for _ in range(V.MAX_EXT_DEPTH - 1):
        ok = (ok,)
    assert loads(dumps(ok)) == ok


_unpickled = []


def _mark_unpickled():
    _unpickled.append(True)
    return "ran"


class Evil:
    def __reduce__(self):
        return (_mark_unpickled, ())


def test_pickle_only_with_opt_in_and_never_run_without():
    _unpickled.clear()
    data = dumps({"x": [Evil()]}, allow_pickle=True)
    with pytest.raises(PickleNotAllowedError) as ei:
        loads(data)
    assert "Evil" in ei.value.type_name and isinstance(ei.value, PermissionError)
    assert _unpickled == []
    assert loads(data, allow_pickle=True) == {"x": ["ran"]}
    assert _unpickled == [True]


def _file_with_tree(tree: bytes, buffers=()):
    """A VALUE file with valid checksums around an arbitrary tree: what a hostile
    writer could produce."""
    import io
    out = io.BytesIO()
    w = C._ContainerWriter(out, C.FILE_VALUE)
    w.value_section(C.SEC_VALUE, "value", V.EncodedValue(tree, [memoryview(b) for b in buffers], []))
    w.end()
    return out.getvalue()


@pytest.mark.parametrize("tree", [
    msgpack.packb(msgpack.ExtType(V.EXT_NDARRAY, msgpack.packb(["|O", [2], False, b"\0" * 16]))),
    msgpack.packb(msgpack.ExtType(V.EXT_NDARRAY, msgpack.packb(["<f8", [3], False, b"\0" * 16]))),
    msgpack.packb(msgpack.ExtType(V.EXT_NDARRAY, msgpack.packb(["<f8", [2], False, 5]))),
    msgpack.packb(msgpack.ExtType(V.EXT_NPSCALAR, msgpack.packb(["|O", b"\0" * 8]))),
    msgpack.packb(msgpack.ExtType(99, b"")),
    msgpack.packb({msgpack.ExtType(V.EXT_TUPLE, msgpack.packb([[1]])): 1}),
    b"\xc1",
], ids=["object-array", "short-data", "bad-buffer-index", "object-scalar", "unknown-ext", "unhashable-key",
        "invalid-msgpack"])
def test_hostile_values_with_valid_checksums_are_corrupt_not_crashes(tree):
    with pytest.raises(CorruptCheckpointError):
        loads(_file_with_tree(tree))


@pytest.mark.parametrize("descr, data", [("|O", b"\0" * 16), ("|O", b""), ("T", b"")])
def test_dtypes_holding_pointers_are_refused(descr, data):
    shape = [len(data) // 8]
    tree = msgpack.packb(msgpack.ExtType(V.EXT_NDARRAY, msgpack.packb([descr, shape, False, data])))
    with pytest.raises(CorruptCheckpointError, match="pointers"):
        loads(_file_with_tree(tree))


def test_hostile_pickle_with_valid_checksums_is_refused():
    _unpickled.clear()
    import pickle
    tree = msgpack.packb(msgpack.ExtType(V.EXT_PICKLE, msgpack.packb(["int", pickle.dumps(Evil())])))
    with pytest.raises(PickleNotAllowedError):
        loads(_file_with_tree(tree))
    assert _unpickled == []


_sample = dumps({"a": np.arange(2000, dtype="i8"), "b": ["x" * 50, (1, 2.5)]})


@given(st.integers(0, len(_sample) - 1), st.integers(1, 255))
def test_any_altered_byte_is_detected(pos, xor):
    bad = bytearray(_sample)
    bad[pos] ^= xor
    with pytest.raises(CorruptCheckpointError):
        loads(bad)


@given(st.integers(0, len(_sample) - 1))
def test_any_truncation_is_detected(n):
    with pytest.raises(CorruptCheckpointError):
        loads(_sample[:n])


def test_trailing_bytes_are_detected():
    with pytest.raises(CorruptCheckpointError, match="after the END"):
        loads(_sample + b"\0")


# ----------------------------------------------------------------- storage: writing and reading


def test_layout_metadata_and_reading_from_a_new_instance(url):
    storage = CheckpointStorage(url)
    h1 = storage.write_task_state(3, "src[0]", {"offset": 1234})
    assert h1.size > 0 and h1.state_bytes > 0 and h1.inflight_bytes == 0 and h1.alignment == "aligned"
    with storage.task_writer(3, "count/1", alignment="unaligned") as w:
        w.write_inflight("gate0/ch1", [b"abc", memoryview(b"defg")])
        w.write_state({"counts": {"a": 3}})
    h2 = w.handle
    assert h2.inflight_bytes == 7 and h2.alignment == "unaligned" and h2.inflight_buffers == 2
    assert task_files(storage, 3) == sorted([h1.file, h2.file])  # no temporary file left
    meta = storage.complete(3, [h1, h2.to_dict()], trigger_time=1000.0, properties={"job": "wc", "p": (1, 2)})
    assert "_metadata" in task_files(storage, 3)
    assert (meta.checkpoint_id, meta.status, meta.trigger_time) == (3, "COMPLETED", 1000.0)
    assert meta.duration == pytest.approx(meta.completion_time - 1000.0)

    fresh = CheckpointStorage(url)  # what a recovering process does
    latest = fresh.latest()
    assert latest == fresh.load_metadata(3)
    assert latest.tasks["count/1"] == h2 and latest.tasks["src[0]"] == h1
    assert latest.state_bytes == h1.state_bytes + h2.state_bytes and latest.inflight_bytes == 7
    assert latest.properties == {"job": "wc", "p": (1, 2)}
    snap = fresh.read_task_state(3, "count/1")
    assert snap.state == {"counts": {"a": 3}} and snap.alignment == "unaligned"
    assert [bytes(v) for v in snap.inflight["gate0/ch1"]] == [b"abc", b"defg"]
    assert snap.inflight["gate0/ch1"][0].readonly
    assert (snap.state_bytes, snap.inflight_bytes) == (h2.state_bytes, 7)
    assert fresh.read_task_state(3, "src[0]").state == {"offset": 1234}


def test_local_checkpoint_dir_is_a_plain_directory(tmp_path):
    storage = CheckpointStorage(tmp_path / "c")
    checkpoint(storage, 1, {"t": 1})
    assert sorted(os.listdir(tmp_path / "c" / "chk-1")) == sorted(["_metadata", S.task_file_name("t")])
    assert storage.url.startswith("file://")


def test_inflight_buffers_from_segments_are_written_one_write_each(memfs, make_network_pool):
    nbp = make_network_pool(4, 4096)
    pool = nbp.create_pool(4, 4)
    bufs = []
    for i in range(3):
        b = pool.request()
        mem = b.memory()
        mem[:100 + i] = bytes([65 + i]) * (100 + i)
        del mem
        b.set_meta(100 + i)
        bufs.append(b)
    storage = CheckpointStorage("memory://seg")
    writes = []
    real_open = storage.fs.open

    def recording_open(path, mode="rb", **kw):
        f = real_open(path, mode, **kw)
        if "w" in mode:
            real_write = f.write

            def write(data):
                writes.append(data)
                return real_write(data)
            f.write = write
        return f

    storage.fs.open = recording_open
    try:
        with storage.task_writer(1, "join[0]", alignment="unaligned") as w:
            w.write_inflight("in0", bufs[:2])
            w.write_inflight("in1", [bufs[2]])
            w.write_inflight("in0", [memoryview(b"tail")])  # appends to the channel
            w.write_state(None)
    finally:
        del storage.fs.open
    for b in bufs:
        owner = [d for d in writes if isinstance(d, memoryview) and d.obj is b]
        assert len(owner) == 1 and owner[0].nbytes == b.size  # the segment itself, not a joined copy
    storage.complete(1, [w.handle])
    snap = storage.read_task_state(1, "join[0]")
    assert [bytes(v) for v in snap.inflight["in0"]] == [b"A" * 100, b"B" * 101, b"tail"]
    assert [bytes(v) for v in snap.inflight["in1"]] == [b"C" * 102]
    assert snap.inflight_bytes == 100 + 101 + 102 + 4 and snap.state is None
    del owner
    writes.clear()  # the recorded views pin the segments
    for b in bufs:
        b.recycle()


def test_writer_exception_leaves_nothing_and_commit_needs_state(url):
    storage = CheckpointStorage(url)
    with pytest.raises(RuntimeError, match="boom"):
        with storage.task_writer(1, "t") as w:
            w.write_inflight("c", [b"x"])
            raise RuntimeError("boom")
    assert task_files(storage, 1) == []
    with pytest.raises(CheckpointStateError, match="write_state"):
        with storage.task_writer(1, "t"):
            pass
    assert task_files(storage, 1) == []
    w = storage.task_writer(1, "t")
    w.write_state(1)
    with pytest.raises(CheckpointStateError, match="already"):
        w.write_state(2)
    w.commit()
    with pytest.raises(CheckpointStateError, match="closed"):
        w.write_inflight("c", [b"x"])


def test_rewriting_a_task_replaces_its_file(url):
    storage = CheckpointStorage(url)
    storage.write_task_state(1, "t", "first")
    h = storage.write_task_state(1, "t", "second")
    storage.complete(1, [h])
    assert storage.read_task_state(1, "t").state == "second"
    assert task_files(storage, 1) == sorted(["_metadata", h.file])


def test_concurrent_task_writes(url):
    storage = CheckpointStorage(url)
    handles, errs = [], []

    def run(i):
        try:
            handles.append(storage.write_task_state(5, f"map[{i}]", {"i": i, "a": np.full(3000, i)}))
        except Exception as e:  # pragma: no cover - reported below
            errs.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errs == []
    storage.complete(5, handles)
    for i in range(8):
        st_ = storage.read_task_state(5, f"map[{i}]").state
        assert st_["i"] == i and (st_["a"] == i).all()


@given(st.lists(st.text(min_size=1, max_size=120), min_size=2, max_size=6, unique=True))
def test_task_file_names_are_safe_and_distinct(keys):
    names = [S.task_file_name(k) for k in keys]
    assert len(set(names)) == len(names)
    for n in names:
        assert S._TASK_FILE.match(n) and "/" not in n and not n.startswith(".") and len(n) <= 110


# ----------------------------------------------------------------- completion and retention


def test_retention_keeps_exactly_the_last_n_complete(url):
    storage = CheckpointStorage(url, retained=3)
    for cid in range(1, 7):
        checkpoint(storage, cid, {"t": cid})
        assert chk_dirs(storage) == list(range(max(1, cid - 2), cid + 1))
    assert [m.checkpoint_id for m in storage.list_complete()] == [4, 5, 6]
    assert [m.checkpoint_id for m in CheckpointStorage(url).list_complete()] == [4, 5, 6]


def test_default_retention_is_two_and_abandoned_dirs_below_are_removed(url):
    storage = CheckpointStorage(url)
    checkpoint(storage, 1, {"t": 1})
    storage.write_task_state(2, "t", 2)       # never completed: abandoned
    storage.write_task_state(4, "t", 4)       # in progress, newer than what completes next
    checkpoint(storage, 3, {"t": 3})
    assert chk_dirs(storage) == [1, 3, 4]
    checkpoint(storage, 5, {"t": 5})          # subsumes 4
    assert chk_dirs(storage) == [3, 5]
    assert storage.latest().checkpoint_id == 5


def test_retention_counts_only_intact_checkpoints(url):
    storage = CheckpointStorage(url, retained=2)
    checkpoint(storage, 1, {"t": 1})
    checkpoint(storage, 2, {"t": 2})
    storage.fs.rm(task_path(storage, 2, "t"))  # 2 torn: it must not count as a retained one
    checkpoint(storage, 3, {"t": 3})
    assert chk_dirs(storage) == [1, 3]


def test_complete_checks_the_acknowledged_files(url):
    storage = CheckpointStorage(url)
    h = storage.write_task_state(1, "t", 1)
    with pytest.raises(ValueError, match="checkpoint 1, not 2"):
        storage.complete(2, [h])
    with pytest.raises(ValueError, match="twice"):
        storage.complete(1, [h, h])
    rewrite(storage, task_path(storage, 1, "t"), lambda d: d[:-1])
    with pytest.raises(CorruptCheckpointError):
        storage.complete(1, [h])
    storage.fs.rm(task_path(storage, 1, "t"))
    with pytest.raises(CheckpointNotFoundError):
        storage.complete(1, [h])
    assert storage.latest() is None
    h = storage.write_task_state(1, "t", 1)
    storage.complete(1, [h])
    with pytest.raises(CheckpointStateError, match="already complete"):
        storage.complete(1, [h])


def test_abort_and_subsumed_checkpoints(url):
    storage = CheckpointStorage(url)
    storage.write_task_state(1, "t", 1)
    storage.abort(1)
    assert chk_dirs(storage) == []
    with pytest.raises(CheckpointStateError, match="aborted"):
        storage.write_task_state(1, "t", 1)
    w = storage.task_writer(2, "t")
    w.write_state(2)
    checkpoint(storage, 3, {"t": 3})
    with pytest.raises(CheckpointStateError, match="subsumed"):
        w.commit()
    with pytest.raises(CheckpointStateError, match="complete"):
        storage.abort(3)
    storage.abort(99)  # nothing there: fine
    assert storage.latest().checkpoint_id == 3


def test_metadata_properties_must_be_plain_data_even_with_pickle(url):
    storage = CheckpointStorage(url, allow_pickle=True)
    h = storage.write_task_state(1, "t", 1)
    with pytest.raises(UnsupportedStateError):
        storage.complete(1, [h], properties={"x": object()})
    assert storage.latest() is None


# ----------------------------------------------------------------- damage


def _flip_middle(data):
    data[len(data) // 2] ^= 0x10
    return data


def _forge_metadata(storage, cid, change):
    """Rewrite _metadata with valid checksums around altered content: only the
    checks of what it says can catch it."""
    import io
    meta = storage._read_metadata(cid).to_dict()
    change(meta)
    out = io.BytesIO()
    w = C._ContainerWriter(out, C.FILE_METADATA)
    w.value_section(C.SEC_METADATA, "metadata", encode_value(meta))
    w.end()
    storage.fs.pipe_file(f"{storage.checkpoint_path(cid)}/_metadata", out.getvalue())


def _claim_huge_file(meta):
    meta["tasks"][1]["size"] = 1 << 50


DAMAGE = {
    "metadata-forged-size": lambda s: _forge_metadata(s, 2, _claim_huge_file),
    "metadata-of-other-checkpoint": lambda s: s.fs.pipe_file(f"{s.checkpoint_path(2)}/_metadata",
                                                             s.fs.cat_file(f"{s.checkpoint_path(1)}/_metadata")),
    "task-truncated": lambda s: rewrite(s, task_path(s, 2, "b"), lambda d: d[:-10]),
    "task-byte-flipped": lambda s: rewrite(s, task_path(s, 2, "b"), _flip_middle),
    "task-missing": lambda s: s.fs.rm(task_path(s, 2, "b")),
    "task-from-other-checkpoint": lambda s: s.fs.pipe_file(task_path(s, 2, "b"),
                                                           s.fs.cat_file(task_path(s, 1, "b"))),
    "metadata-missing": lambda s: s.fs.rm(f"{s.checkpoint_path(2)}/_metadata"),
    "metadata-byte-flipped": lambda s: rewrite(s, f"{s.checkpoint_path(2)}/_metadata", _flip_middle),
    "metadata-empty": lambda s: s.fs.pipe_file(f"{s.checkpoint_path(2)}/_metadata", b""),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_torn_or_corrupt_checkpoint_is_reported_and_skipped(url, damage, caplog):
    storage = CheckpointStorage(url, retained=3)
    state1 = {"a": {"n": 1, "w": np.arange(5000)}, "b": {"n": 1, "w": np.arange(5000)}}
    checkpoint(storage, 1, state1)
    checkpoint(storage, 2, {"a": {"n": 2, "w": np.arange(5000)}, "b": {"n": 2, "w": np.arange(5000)}})
    DAMAGE[damage](storage)

    reader = CheckpointStorage(url)
    with caplog.at_level(logging.INFO, logger="pyflowbuf.checkpoint"):
        latest = reader.latest()
    assert latest is not None and latest.checkpoint_id == 1
    assert reader.read_task_state(1, "b").state["n"] == 1
    reported = [r for r in caplog.records if "checkpoint 2" in r.getMessage()]
    assert reported, caplog.text
    expected_status = "INCOMPLETE" if damage == "metadata-missing" else "CORRUPT"
    assert reported[0].levelno == (logging.INFO if expected_status == "INCOMPLETE" else logging.WARNING)
    assert {i.checkpoint_id: i.status for i in reader.scan()} == {1: "COMPLETED", 2: expected_status}
    assert [m.checkpoint_id for m in reader.list_complete()] == [1]
    if damage not in ("task-byte-flipped", "task-from-other-checkpoint"):  # these keep the size
        assert reader.latest(verify=False).checkpoint_id == 1
    error = CheckpointNotFoundError if damage == "metadata-missing" else CorruptCheckpointError
    with pytest.raises(error) as ei:
        reader.load_metadata(2)
    if error is CorruptCheckpointError:
        assert ei.value.checkpoint_id == 2
    with pytest.raises(error):
        reader.read_task_state(2, "b")


def test_flipped_byte_is_found_by_reading_even_without_full_verify(url):
    storage = CheckpointStorage(url)
    checkpoint(storage, 1, {"t": {"w": np.arange(1000)}})
    rewrite(storage, task_path(storage, 1, "t"), _flip_middle)
    assert storage.latest(verify=False).checkpoint_id == 1  # sizes still match: the cheap check passes
    assert storage.latest() is None
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        storage.read_task_state(1, "t")


def test_dropped_section_is_detected(url):
    storage = CheckpointStorage(url)
    with storage.task_writer(1, "t", alignment="unaligned") as w:
        w.write_inflight("c0", [b"x" * 100])
        w.write_state({"k": 1})
    storage.complete(1, [w.handle])
    path = task_path(storage, 1, "t")
    data = bytearray(storage.fs.cat_file(path))
    at = C._FILE_HEADER.size
    spans = []
    while at < len(data):
        _, _, name_len, plen, _ = C._SEC_HEADER.unpack_from(data, at)
        end = at + C._SEC_HEADER.size + name_len + plen + 4
        spans.append((at, end))
        at = end
    assert len(spans) == 4  # INFO, INFLIGHT, STATE, END
    start, end = spans[1]
    del data[start:end]
    # every remaining section is intact on its own: only the END record can tell
    with pytest.raises(_Corrupt, match="END record"):
        list(C._parse(C._MemSource(memoryview(data)), C.FILE_TASK_STATE))
    storage.fs.pipe_file(path, bytes(data))
    with pytest.raises(CorruptCheckpointError):
        storage.read_task_state(1, "t")
    assert storage.latest() is None


# ----------------------------------------------------------------- pickle opt-in through storage


class Point:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return type(other) is Point and other.x == self.x


def test_pickle_refused_without_opt_in_at_write(url):
    storage = CheckpointStorage(url)
    with pytest.raises(UnsupportedStateError) as ei:
        storage.write_task_state(1, "t", {"p": [Point(1)]})
    assert ei.value.type_name.endswith("Point") and ei.value.where == "state['p'][0]"
    assert not storage.fs.exists(storage.checkpoint_path(1))  # refused before any file
    with storage.task_writer(1, "t") as w:
        with pytest.raises(UnsupportedStateError):
            w.write_state(Point(2))
        w.write_state({"x": 2})  # the writer stays usable
    assert task_files(storage, 1) == [w.handle.file]


def test_pickle_written_with_opt_in_is_refused_by_reader_without(url):
    _unpickled.clear()
    writer = CheckpointStorage(url, allow_pickle=True)
    checkpoint(writer, 1, {"t": {"p": Point(3), "e": Evil()}})
    assert writer.read_task_state(1, "t").state["p"] == Point(3)
    _unpickled.clear()
    reader = CheckpointStorage(url)  # allow_pickle=False
    assert reader.latest().checkpoint_id == 1  # intact; only unpickling is refused
    with pytest.raises(PickleNotAllowedError) as ei:
        reader.read_task_state(1, "t")
    assert ei.value.type_name.endswith(("Point", "Evil"))
    assert _unpickled == []


# ----------------------------------------------------------------- bad input


def test_bad_arguments(url):
    with pytest.raises(ValueError):
        CheckpointStorage(url, retained=0)
    storage = CheckpointStorage(url)
    with pytest.raises(TypeError):
        storage.write_task_state(True, "t", 1)
    with pytest.raises(ValueError):
        storage.write_task_state(-1, "t", 1)
    with pytest.raises(TypeError):
        storage.write_task_state(1, "", 1)
    with pytest.raises(ValueError):
        storage.write_task_state(1, "t", 1, alignment="sideways")
    with pytest.raises(TypeError):
        storage.write_task_state(1, "t", 1, inflight={3: [b"x"]})
    with pytest.raises(ValueError):
        TaskStateHandle.from_dict({**storage.write_task_state(1, "t", 1).to_dict(), "file": "../../etc/passwd"})


def test_missing_checkpoint_and_task(url):
    storage = CheckpointStorage(url)
    assert storage.latest() is None and storage.list_complete() == [] and storage.scan() == []
    with pytest.raises(CheckpointNotFoundError) as ei:
        storage.read_task_state(7, "t")
    assert isinstance(ei.value, FileNotFoundError)
    checkpoint(storage, 7, {"t": 1})
    with pytest.raises(TaskStateNotFoundError) as ei:
        storage.read_task_state(7, "other")
    assert isinstance(ei.value, KeyError) and "other" in str(ei.value)
    storage.write_task_state(8, "t", 1)
    with pytest.raises(CheckpointNotFoundError, match="not complete"):
        storage.read_task_state(8, "t")
