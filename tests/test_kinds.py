"""Record kinds: the ``struct`` kind (structured records that cross processes
without pickle), the one kind check every operator's output gets whatever the
chaining, and the key hash that is the same in every process."""
from __future__ import annotations

import collections
import datetime
import enum
import math
import multiprocessing
import os
import pickle
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf import errors, stable_hash
from pyflowbuf._core.memory import NetworkBufferPool
from pyflowbuf._core.channel import BufferQueue
from pyflowbuf._core.serde import RecordReader, RecordWriter
from pyflowbuf import serializers as S
from pyflowbuf.operators import basic as ops

from reference_model import ref_stable_hash

pytestmark = pytest.mark.timeout(180)

CHAINING = pytest.mark.parametrize("chaining", [True, False], ids=["chained", "unchained"])
needs_fork = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")


def same(a, b) -> bool:
    """Equal and of exactly the same types all the way down (floats by their bits,
    dicts in the same order)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return struct.pack("<d", a) == struct.pack("<d", b)
    if type(a) in (tuple, list):
        return len(a) == len(b) and all(map(same, a, b))
    if type(a) is dict:
        return len(a) == len(b) and all(same(k1, k2) and same(v1, v2)
                                        for (k1, v1), (k2, v2) in zip(a.items(), b.items()))
    return a == b


scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-(2**300), 2**300),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.binary(max_size=12))
hashables = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3).map(tuple), max_leaves=6)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple),
                            st.dictionaries(hashables, inner, max_size=4)),
    max_leaves=24)


def _pipe(kind, segments=64, segment_size=256):
    nbp = NetworkBufferPool(segments, segment_size)
    q = BufferQueue(nbp)
    return nbp, q, RecordWriter(nbp.create_pool(1, segments), [q], kind=kind)


# ------------------------------------------------------------------ the struct kind: codec


@given(st.lists(values, max_size=30))
def test_struct_round_trip_keeps_types_exactly(records):
    for r in records:
        assert same(S.unpack_struct(S.pack_struct(r)), r), r
    # through segments, records spanning 256-byte buffers
    nbp, q, w = _pipe("struct", segments=256)
    w.write_batch(records)
    w.end_input()
    got = list(RecordReader(q, kind="struct"))
    assert len(got) == len(records) and all(map(same, got, records))


def test_struct_keeps_the_container_types_and_extremes_apart():
    cases = [(), [], {}, ((),), [()], ([],), {(): []}, {(1, "a"): (b"x", None)}, {None: 1, True: 2, 2.5: 3},
             (True, 1, 1.0), [False, 0, 0.0, -0.0], 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 2**1000,
             -(2**1000), math.inf, -math.inf, "", "✓" * 1000, b"\x00" * 70_000, [[[[[]]]]]]
    for c in cases:
        assert same(S.unpack_struct(S.pack_struct(c)), c), c
    assert math.isnan(S.unpack_struct(S.pack_struct(math.nan)))
    # a dict key of every supported kind, tuples included
    d = {(1, (2, "x")): "tuple key", b"k": 1, "k": 2, 7: 3, None: 4}
    assert same(S.unpack_struct(S.pack_struct(d)), d)


def test_struct_is_compact_and_faster_than_pickle_on_word_pairs():
    rec = ("word", 1)
    assert len(S.pack_struct(rec)) < len(pickle.dumps(rec, 5))


class _Point:
    def __init__(self, x):
        self.x = x


class _Color(enum.IntEnum):
    RED = 1


class _Str(str):
    pass


_Pair = collections.namedtuple("_Pair", "a b")


@pytest.mark.parametrize("bad, type_name", [
    ({1, 2}, "set"), (frozenset({1}), "frozenset"), (_Point(1), "_Point"), (bytearray(b"x"), "bytearray"),
    (_Pair(1, 2), "_Pair"), (_Color.RED, "_Color"), (_Str("s"), "_Str"), (1 + 2j, "complex"),
    (datetime.date(2024, 1, 1), "date"), (collections.OrderedDict(a=1), "OrderedDict"),
    (("ok", [1, {"deep": {3}}]), "set"),
])
def test_struct_refuses_what_it_cannot_carry_exactly(bad, type_name):
    with pytest.raises(errors.RecordTypeError, match=type_name) as info:
        S.pack_struct(bad)
    assert isinstance(info.value, TypeError) and "pickle" in str(info.value)
    nbp, q, w = _pipe("struct")
    w.write(("good", 1))
    with pytest.raises(errors.RecordTypeError, match=r"record 1 of the batch \(1 written before it\)"):
        w.write_batch([("also good", 2), bad])
    w.end_input()
    assert list(RecordReader(q, kind="struct")) == [("good", 1), ("also good", 2)]


def test_struct_refuses_cycles_and_absurd_nesting():
    cyc = [1]
    cyc.append(cyc)
    with pytest.raises(errors.RecordTypeError, match="nested deeper"):
        S.pack_struct(cyc)
    deep = ()
    for _ in range(1000):
        deep = (deep,)
    with pytest.raises(errors.RecordTypeError, match="nested deeper"):
        S.pack_struct(deep)


@pytest.mark.parametrize("garbage", [
    b"", b"\xff", b"\x06\x05ab", b"\x08\x05\x00", b"\x0a\x03\x00\x00", b"\x00\x00",
    b"\x03" + b"\xff" * 11, b"\x06\x02\xff\xfe", b"\x0a\x01\x09\x00\x00",   # a list as a dict key
    b"\x08\x01" * 500 + b"\x00",                                             # nesting deeper than the limit
    pickle.dumps(("x", 1)), b"\x05\x00\x00",
    # what an attacker would send to a pickle reader: must not run
    b"cos\nsystem\n(S'echo pwned > /tmp/pyflowbuf-pwned'\ntR.",
])
def test_corrupt_struct_records_raise_corrupt_record_error(garbage):
    with pytest.raises(errors.CorruptRecordError):
        S.unpack_struct(garbage)
    assert not os.path.exists("/tmp/pyflowbuf-pwned")


@given(st.binary(max_size=64))
def test_struct_decoder_never_fails_otherwise(data):
    try:
        S.unpack_struct(data)
    except errors.CorruptRecordError:
        pass


@given(values, st.data())
def test_damaged_struct_records_decode_or_raise_corrupt_record_error(value, data):
    raw = bytearray(S.pack_struct(value))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    for damaged in (bytes(raw), bytes(raw[:cut])):
        try:
            S.unpack_struct(damaged)
        except errors.CorruptRecordError:
            pass


def test_corrupt_struct_bytes_in_a_buffer_fail_the_reader():
    nbp, q, w = _pipe("bytes")
    w.write_batch([S.pack_struct(("fine", 1)), b"\x06\x09abc"])
    w.end_input()
    r = RecordReader(q, kind="struct")
    assert r.read(timeout=0) == ("fine", 1)
    with pytest.raises(errors.CorruptRecordError):
        r.read(timeout=0)


def test_struct_batch_codec():
    recs = [(f"w{i}", i) for i in range(1000)]
    packed = S.get_serializer("struct")
    assert packed.name == "struct" and not packed.in_process_only
    data = S.pack_struct_batch(recs)
    assert all(type(b) is bytes for b in data)
    assert S.unpack_struct_batch(data) == recs
    assert S.unpack_struct_batch([memoryview(b) for b in data]) == recs


@given(st.lists(st.one_of(st.integers(-(2**70), 2**70), st.integers(-(2**300), 2**300),
                          st.floats(allow_nan=True, allow_infinity=True)), max_size=60))
def test_number_kind_round_trip_keeps_int_and_float_exactly(records):
    # ints of any size and floats (NaN, -0.0 by their bits) through 256-byte buffers
    nbp, q, w = _pipe("number", segments=256)
    w.write_batch(records)
    w.end_input()
    got = list(RecordReader(q, kind="number"))
    assert len(got) == len(records) and all(map(same, got, records))


# ------------------------------------------------------------------ inference


@pytest.mark.parametrize("value, kind", [
    (("w", 1), "struct"), ([1, 2.5, None], "struct"), ({"a": [1, (2, b"x")], 3: {}}, "struct"),
    ((), "struct"), ({(1, 2): True}, "struct"), ((2**100, "big"), "struct"),
    ((1, {2}), "pickle"), ({"a": _Point(1)}, "pickle"), (_Pair(1, 2), "pickle"), ({1, 2}, "pickle"),
    (1, "number"), (1.5, "number"), ("s", "str"), (b"b", "bytes"), (None, "pickle"), (True, "pickle"),
    (2**64, "number"), (_Point(1), "pickle"),
])
def test_infer_kind(value, kind):
    assert S.infer_kind(value) == kind


def test_unknown_kind_name_is_a_value_error():
    with pytest.raises(ValueError, match="integer"):
        S.get_serializer("integer")


# ------------------------------------------------------------------ struct streams in pipelines


def _word_lines():
    return [" ".join(f"w{(i * 7 + j) % 23}" for j in range(i % 9)) for i in range(600)]


def _final_counts(records):
    final = {}
    for w, c in records:
        final[w] = max(final.get(w, 0), c)
    return final


def _word_count(env, source):
    return (source.flat_map(str.split)
                  .map(lambda w: (w, 1))
                  .key_by(lambda kv: kv[0])
                  .reduce(lambda a, b: (a[0], a[1] + b[1]))
                  .collect())


@needs_fork
def test_readme_word_count_across_workers_without_pickle(tmp_path):
    lines = _word_lines()
    path = tmp_path / "words.txt"
    path.write_text("\n".join(lines) + "\n")
    env = fb.Environment(workers=2, parallelism=2)
    counts = _word_count(env, env.read_text(str(path)))
    env.execute(timeout=90)
    assert all(type(r) is tuple and type(r[1]) is int for r in counts.result)
    assert _final_counts(counts.result) == collections.Counter(w for ln in lines for w in ln.split())


@needs_fork
def test_word_count_from_a_collection_across_workers():
    lines = _word_lines()
    env = fb.Environment(workers=2, parallelism=2)
    counts = _word_count(env, env.from_collection(lines))
    env.execute(timeout=90)
    assert _final_counts(counts.result) == collections.Counter(w for ln in lines for w in ln.split())


@CHAINING
def test_word_count_in_process(chaining):
    lines = _word_lines()
    env = fb.Environment(parallelism=2, chaining=chaining)
    counts = _word_count(env, env.from_collection(lines))
    env.execute(timeout=60)
    assert _final_counts(counts.result) == collections.Counter(w for ln in lines for w in ln.split())


@CHAINING
def test_struct_streams_in_process_keep_types(chaining):
    data = [{"id": i, "tags": [f"t{i}", None], "pos": (i * 0.5, -i), "raw": bytes([i % 256])} for i in range(300)]
    env = fb.Environment(parallelism=2, chaining=chaining, segment_size=1024)
    h = env.from_collection(data).map(lambda d: d).rebalance().map(lambda d: d).collect()
    env.execute(timeout=60)
    got = sorted(h.result, key=lambda d: d["id"])
    assert all(map(same, got, data))


@needs_fork
def test_declared_struct_kind_across_workers():
    env = fb.Environment(workers=2, parallelism=2)
    out = (env.from_collection([(i, str(i)) for i in range(1000)], kind="struct")
              .map(lambda t: {"n": t[0], "s": [t[1], None]}, kind="struct")
              .collect(parallelism=1))
    env.execute(timeout=60)
    got = sorted(out.result, key=lambda d: d["n"])
    assert got == [{"n": i, "s": [str(i), None]} for i in range(1000)]
    assert all(type(d["s"]) is list for d in got)


@needs_fork
def test_pickle_only_records_still_need_allow_pickle_across_workers():
    data = [(i, {i, i + 1}) for i in range(20)]          # sets: not a struct record
    env = fb.Environment(workers=2, parallelism=2)
    env.from_collection(data).map(lambda r: r).collect()
    with pytest.raises(errors.JobFailedError, match="allow_pickle"):
        env.execute(timeout=60)

    env = fb.Environment(workers=2, parallelism=2)
    env.from_sequence(0, 100, parallelism=1).map(lambda x: _Point(x)).collect(parallelism=1)
    with pytest.raises(errors.JobFailedError, match="allow_pickle"):
        env.execute(timeout=60)

    env = fb.Environment(workers=2, parallelism=2, allow_pickle=True)
    out = env.from_collection(data).map(lambda r: r).collect()
    env.execute(timeout=60)
    assert sorted(out.result) == data


def test_key_by_on_a_batch_object_stream():
    # arrays [key, v, v, v]: the reduce keeps the key and adds the rest
    arrays = [np.array([i % 3, i, 2 * i, 1], dtype=np.int64) for i in range(30)]
    env = fb.Environment(parallelism=2, chaining=False)
    h = (env.from_collection(arrays, kind="numpy")
            .key_by(lambda a: int(a[0]))
            .reduce(lambda a, b: np.concatenate([a[:1], a[1:] + b[1:]]))
            .collect())
    env.execute(timeout=60)
    assert len(h.result) == 30
    final = {}
    for a in h.result:
        k = int(a[0])
        if k not in final or a[3] > final[k][3]:
            final[k] = a
    for k in range(3):
        mine = [a for a in arrays if a[0] == k]
        assert final[k].tolist() == [k, sum(int(a[1]) for a in mine), sum(int(a[2]) for a in mine), len(mine)]


# ------------------------------------------------------------------ one kind check, whatever the chaining


def _failure(env, timeout=30):
    with pytest.raises(errors.JobFailedError) as info:
        env.execute(timeout)
    cause = info.value.__cause__
    return info.value, cause


@CHAINING
def test_flat_map_returning_a_str_is_refused(chaining):
    env = fb.Environment(chaining=chaining)
    env.from_collection(["a b", "c d"]).flat_map(lambda s: s.upper(), name="shout").collect()
    exc, cause = _failure(env)
    assert isinstance(cause, errors.RecordTypeError) and isinstance(cause, TypeError)
    assert "'shout'" in str(cause) and "str" in str(cause) and "iterable" in str(cause)


@CHAINING
def test_process_returning_bytes_is_refused(chaining):
    env = fb.Environment(chaining=chaining)
    (env.from_collection(["a", "b"]).key_by(lambda s: s)
        .process(lambda k, v, st: v.encode(), name="proc").map(lambda x: x).collect())
    exc, cause = _failure(env)
    assert isinstance(cause, errors.RecordTypeError) and "'proc'" in str(cause) and "bytes" in str(cause)


# ---- issue 18, item 3: the shape of what flat_map/process return, and numbers

@CHAINING
@pytest.mark.parametrize("returned", [lambda k, x: (k, x), lambda k, x: {k: x}],
                         ids=["tuple", "dict"])
def test_process_returning_a_tuple_or_dict_is_refused_not_split(chaining, returned):
    # (k, x) once came out as the separate records k and x: [0, 0, 1, 1, ...]
    env = fb.Environment(chaining=chaining)
    (env.from_sequence(0, 4).key_by(lambda x: x % 2)
        .process(lambda k, x, s: returned(k, x), name="pairs").collect())
    exc, cause = _failure(env)
    assert isinstance(cause, errors.RecordTypeError), repr(cause)
    assert "'pairs'" in str(cause) and "[" in str(cause) and "yield" in str(cause)


@CHAINING
def test_flat_map_returning_a_dict_is_refused_not_its_keys(chaining):
    env = fb.Environment(chaining=chaining)
    env.from_collection([{"a": 1}, {"b": 2}]).flat_map(lambda d: d, name="explode").collect()
    exc, cause = _failure(env)
    assert isinstance(cause, errors.RecordTypeError) and "'explode'" in str(cause) and "dict" in str(cause)


@CHAINING
def test_process_records_that_are_tuples_come_out_whole(chaining):
    env = fb.Environment(chaining=chaining)
    h1 = (env.from_sequence(0, 4).key_by(lambda x: x % 2)
             .process(lambda k, x, s: [(k, x)], name="listed").collect())
    h2 = (env.from_sequence(0, 4).flat_map(lambda x: ((x, i) for i in range(2)), name="gen").collect())
    h3 = env.from_sequence(0, 4).flat_map(lambda x: iter({x}), name="it").collect()
    env.execute(timeout=30)
    assert sorted(h1.result) == [(0, 0), (0, 2), (1, 1), (1, 3)]
    assert sorted(h2.result) == [(x, i) for x in range(4) for i in range(2)]
    assert sorted(h3.result) == [0, 1, 2, 3]


numbers = st.lists(st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=False)), min_size=1, max_size=30)


def _run_numbers(records, chaining, kind=None, fn=lambda x: x):
    env = fb.Environment(chaining=chaining, parallelism=1)
    h = env.from_collection(records).map(fn, name="numbers", kind=kind).map(lambda x: x, name="after").collect()
    env.execute(timeout=30)
    return h.result


@given(numbers)
def test_ints_and_floats_come_back_exactly_chained_or_not(records):
    # a float stream whose later records were ints gave [0.5, 1, 2] chained and
    # [0.5, 1.0, 2.0] unchained; an int stream failed on its first float
    for chaining in (True, False):
        out = _run_numbers(records, chaining)
        assert same(out, records), (chaining, out)


@given(st.lists(st.one_of(st.integers(-(2**53), 2**53), st.floats(allow_nan=False)), min_size=1, max_size=30))
def test_a_declared_float64_stream_gives_floats_chained_or_not(records):
    want = [float(x) for x in records]
    for chaining in (True, False):
        assert same(_run_numbers(records, chaining, kind="float64"), want), chaining


@CHAINING
def test_halving_ints_widens_instead_of_failing(chaining):
    env = fb.Environment(chaining=chaining)
    h = env.from_collection([0, 1, 2, 3]).map(lambda x: 0 if x == 0 else x / 2).collect()
    env.execute(timeout=30)
    assert same(h.result, [0, 0.5, 1.0, 1.5])


@pytest.mark.parametrize("records, kind", [([1, 2], "int64"), (range(5), "int64"), ((1.5, 2.0), "float64"),
                                           ([1, 0.5], "number"), ([0.5, 1], "number"), ([1, 2**64], "number"),
                                           ([1, "x"], "number"), (range(2**64, 2**64 + 2), "number")])
def test_a_collection_of_numbers_takes_its_kind_from_all_its_records(records, kind):
    # every record of a list is known when the stream is declared: plain ints
    # stay int64 (a union with from_sequence works), mixed ones are number
    assert fb.Environment().from_collection(records).node.kind == kind


@CHAINING
def test_numpy_numbers_in_a_number_stream_come_back_as_int_and_float(chaining):
    env = fb.Environment(chaining=chaining)
    h = (env.from_collection([0, 1, 2, 3]).map(lambda x: x if x < 2 else np.float64(x) / 4 if x == 2 else np.int32(x),
                                               name="mixed").map(lambda x: x, name="after").collect())
    env.execute(timeout=30)
    assert [(type(x), x) for x in h.result] == [(int, 0), (int, 1), (float, 0.5), (int, 3)]


@CHAINING
def test_numpy_scalars_in_a_declared_numpy_stream_are_0d_arrays_chained_or_not(chaining):
    env = fb.Environment(chaining=chaining)
    h = (env.from_collection([np.int64(3), np.float32(0.5)], kind="numpy").map(lambda x: x, kind="numpy")
            .collect())
    env.execute(timeout=30)
    assert [(type(x), x.ndim, x.dtype) for x in h.result] == [(np.ndarray, 0, np.int64), (np.ndarray, 0, np.float32)]


@needs_fork
def test_a_number_stream_crosses_workers_with_exact_types():
    env = fb.Environment(workers=2, parallelism=2)
    h = (env.from_sequence(0, 200).map(lambda x: x if x % 3 else x / 2, name="mixed")
            .rebalance().map(lambda x: x, name="after").collect())
    env.execute(timeout=90)
    want = [x if x % 3 else x / 2 for x in range(200)]
    assert sorted(map(repr, h.result)) == sorted(map(repr, want))     # repr: 0.0 is not 0


@CHAINING
def test_a_declared_int64_stream_refuses_a_float_naming_the_operator(chaining):
    env = fb.Environment(chaining=chaining)
    (env.from_collection([0, 1, 2]).map(lambda x: 0 if x == 0 else x / 2, name="halve", kind="int64")
        .map(lambda x: x, name="after").collect())
    exc, cause = _failure(env)
    assert isinstance(cause, errors.RecordTypeError) and "'halve'" in str(cause) and "int64" in str(cause)


def _scalar_cases():
    import pandas as pd
    return [
        ([pd.Timestamp("2024-01-01"), pd.Timestamp("2024-01-02", tz="UTC")], None),
        ([pd.Timedelta(1), pd.Timedelta("1s")], None),
        ([np.datetime64("2024-01-01"), np.datetime64("2024-01-01T00:00:01")], None),
        ([np.timedelta64(5, "s")], None),
        ([np.bool_(True), np.bool_(False)], None),
        ([np.int64(3), np.int32(-4), np.uint8(7)], lambda xs: [int(x) for x in xs]),
        ([np.float64(2.5), np.float32(0.5), np.float16(1.5)], lambda xs: [float(x) for x in xs]),
    ]


@CHAINING
@pytest.mark.parametrize("case", range(7))
def test_numpy_and_pandas_scalars_round_trip_chained_or_not(chaining, case):
    records, convert = _scalar_cases()[case]
    env = fb.Environment(chaining=chaining, allow_pickle=True)
    h = env.from_collection(records).map(lambda x: x, name="same").map(lambda x: x, name="after").collect()
    env.execute(timeout=30)
    want = convert(records) if convert else records
    assert [type(x) for x in h.result] == [type(x) for x in want]
    assert all(a == b for a, b in zip(h.result, want))


@CHAINING
@pytest.mark.parametrize("odd, odd_type", [("fifty", "str"), (None, "NoneType"), (True, "bool")])
def test_mixed_records_fail_the_same_way_chained_or_not(chaining, odd, odd_type):
    env = fb.Environment(chaining=chaining)
    (env.from_collection(list(range(100)))
        .map(lambda x: x if x != 50 else odd, name="mixer")
        .map(lambda x: x, name="after")
        .collect())
    exc, cause = _failure(env)
    assert isinstance(cause, errors.RecordTypeError), repr(cause)
    msg = str(cause)
    assert "'mixer'" in msg and repr(odd) in msg and odd_type in msg and "number" in msg
    assert "'mixer'" in str(exc)


@CHAINING
def test_the_offending_value_is_shown_truncated(chaining):
    env = fb.Environment(chaining=chaining)
    (env.from_collection(list(range(10)))
        .map(lambda x: x if x != 5 else "z" * 100_000, name="mixer")
        .map(lambda x: x, name="after")
        .collect())
    exc, cause = _failure(env)
    assert isinstance(cause, errors.RecordTypeError) and "zzzz" in str(cause)
    assert len(str(cause)) < 1000


@CHAINING
def test_struct_stream_with_a_record_it_cannot_carry(chaining):
    env = fb.Environment(chaining=chaining)
    (env.from_collection(list(range(20)))
        .map(lambda x: (x, "ok") if x != 7 else (x, {x}), name="pairs")
        .map(lambda x: x, name="after")
        .collect())
    exc, cause = _failure(env)
    assert isinstance(cause, errors.RecordTypeError)
    assert "'pairs'" in str(cause) and "set" in str(cause) and "struct" in str(cause)


def test_a_source_record_that_does_not_fit_shows_its_value():
    env = fb.Environment(chaining=False)
    env.from_collection([1, 2, "three"], name="numbers").rebalance().collect()
    exc, cause = _failure(env)
    assert isinstance(cause, errors.RecordTypeError)
    assert "'three'" in str(cause) and "number" in str(cause) and "'numbers'" in str(exc)


@CHAINING
def test_a_declared_kind_is_the_one_checked(chaining):
    env = fb.Environment(chaining=chaining)
    (env.from_collection(list(range(50)))
        .map(lambda x: str(x) if x != 30 else x, name="to_text", kind="str")
        .map(lambda x: x, name="after", kind="pickle")
        .collect())
    exc, cause = _failure(env)
    assert isinstance(cause, errors.RecordTypeError)
    assert "'to_text'" in str(cause) and "30 (int)" in str(cause) and "'str'" in str(cause)


@CHAINING
def test_a_declared_pickle_kind_takes_any_object_after_a_plain_first_record(chaining):
    data = [(1, "a"), _Point(2), {3}, None]
    env = fb.Environment(chaining=chaining)
    h = env.from_collection(data, kind="pickle").map(lambda x: x, kind="pickle").map(lambda x: x, kind="pickle").collect()
    env.execute(timeout=30)
    assert [type(x) for x in h.result] == [tuple, _Point, set, type(None)]


def test_declared_output_kind_is_checked_on_chained_outputs():
    op = ops.Map("typed", lambda x: x)
    op.out_kind = "str"
    op.open(0, 1)
    assert op.process_batch(["a", "b"]) == ["a", "b"]
    with pytest.raises(errors.RecordTypeError, match=r"'typed'.*1 \(int\).*'str'"):
        op.process_batch(["c", 1])


def test_operators_accept_what_the_writer_accepts():
    # and hand on what a reader would return: the same values chained or not
    op = ops.Map("floats", lambda x: x)
    op.out_kind = "float64"
    op.open(0, 1)
    out = op.process_batch([1.5, 2, True, np.float32(0.5)])
    assert out == [1.5, 2.0, 1.0, 0.5] and {type(x) for x in out} == {float}
    op = ops.Map("ints", lambda x: x)
    op.out_kind = "int64"
    op.open(0, 1)
    out = op.process_batch([1, np.int64(2)])
    assert out == [1, 2] and {type(x) for x in out} == {int}
    with pytest.raises(errors.RecordTypeError, match="int64"):
        op.process_batch([2**64])
    with pytest.raises(errors.RecordTypeError, match="int64"):
        op.process_batch([2.5])
    op = ops.Map("numbers", lambda x: x)
    op.open(0, 1)
    out = op.process_batch([1, 2.5, 2**70])     # the first record says number
    assert out == [1, 2.5, 2**70] and [type(x) for x in out] == [int, float, int]
    # NumPy numbers, float subclasses and IntEnums are plainly ints or floats
    out = op.process_batch([np.float64(0.25), np.float32(0.5), np.int64(7), _Color.RED])
    assert out == [0.25, 0.5, 7, 1] and [type(x) for x in out] == [float, float, int, int]
    import decimal
    for odd in (True, np.bool_(True), decimal.Decimal("0.1"), "1"):
        with pytest.raises(errors.RecordTypeError, match="number"):
            op.process_batch([1, odd])
    op = ops.Map("anything", lambda x: x)
    op.open(0, 1)
    assert op.process_batch([None, 1, "x"]) == [None, 1, "x"]   # the first record says pickle


# ------------------------------------------------------------------ stable key hash


def test_equal_keys_hash_equal():
    assert stable_hash(1) == stable_hash(1.0) == stable_hash(True)
    assert stable_hash(0) == stable_hash(0.0) == stable_hash(-0.0) == stable_hash(False)
    assert stable_hash(2**64) == stable_hash(float(2**64))
    assert stable_hash(-(2**80)) == stable_hash(float(-(2**80)))
    assert stable_hash(2.5) != stable_hash(2)
    assert stable_hash(b"ab") == stable_hash(bytearray(b"ab")) == stable_hash(memoryview(b"ab"))
    assert stable_hash((1, "a")) == stable_hash((1.0, "a"))
    assert stable_hash(frozenset({1, 2, 3})) == stable_hash(frozenset({3.0, 2, 1}))
    assert stable_hash(frozenset({1, 2})) != stable_hash(frozenset({1, 3}))
    assert stable_hash(np.int64(7)) == stable_hash(7)
    assert stable_hash(_Color.RED) == stable_hash(1) and stable_hash(_Str("s")) == stable_hash("s")
    assert stable_hash(_Pair(1, "a")) == stable_hash((1, "a"))
    assert stable_hash("file\udc80") == ref_stable_hash("file\udc80")  # lone surrogates (os.fsdecode)
    assert stable_hash(2**64 + 5) != stable_hash(2**64 + 6)


@pytest.mark.parametrize("key, type_name", [
    (datetime.datetime(2024, 1, 1), "datetime"), (_Point(1), "_Point"), (enum.Enum("E", "A").A, "E"),
    (object(), "object"), ((1, object()), "object"), (frozenset({object()}), "object"), ({1: 2}, "dict"),
])
def test_keys_without_a_stable_hash_are_refused(key, type_name):
    with pytest.raises(errors.KeyTypeError, match=type_name) as info:
        stable_hash(key)
    assert isinstance(info.value, TypeError) and "key function" in str(info.value)


_KEYS_CODE = ("from pyflowbuf import stable_hash; "
              "keys = [None, frozenset(f'k{i}' for i in range(40)), frozenset({(1, 'a'), (2, 'b'), None}), "
              "('a', None, 1.5), 2**100, -(2**70), 3.25, float('inf'), True, 'key-1', b'k']; "
              "print([stable_hash(k) for k in keys])")


def test_stable_hash_of_none_frozensets_floats_and_big_ints_is_the_same_in_every_process():
    outs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", _KEYS_CODE], env=env, capture_output=True, text=True,
                                check=True, timeout=60).stdout)
    assert len(outs) == 1, outs


hash_keys = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(2**200), 2**200), st.text(max_size=6),
              st.binary(max_size=6), st.floats(allow_nan=False)),
    lambda inner: st.one_of(st.lists(inner, max_size=3).map(tuple), st.frozensets(inner, max_size=3)),
    max_leaves=10)


@given(st.lists(hash_keys, max_size=20))
def test_stable_hash_matches_reference(keys):
    for k in keys:
        assert stable_hash(k) == ref_stable_hash(k), k


@CHAINING
def test_keyed_reduce_on_none_and_frozenset_keys(chaining):
    data = [(None if i % 3 == 0 else frozenset({i % 3, "x"}), 1) for i in range(300)]
    env = fb.Environment(parallelism=3, chaining=chaining, allow_pickle=True)
    h = (env.from_collection(data, kind="pickle").key_by(lambda kv: kv[0])
            .reduce(lambda a, b: (a[0], a[1] + b[1]), kind="pickle").collect())
    env.execute(timeout=60)
    final = {}
    for k, c in h.result:
        final[k] = max(final.get(k, 0), c)
    assert final == {None: 100, frozenset({1, "x"}): 100, frozenset({2, "x"}): 100}
