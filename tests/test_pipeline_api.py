"""The job API end to end: every source, operator, sink and partitioner, with
chaining on and off, parallelism 1 and > 1; typed streams; keyed state against
a pure-Python reference; text files; rate limits; the buffer timeout; and the
error paths for bad configuration and wrong record kinds."""
from __future__ import annotations

import collections
import math
import os
import pickle
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf.errors import JobFailedError

from pipeline_helpers import assert_clean, run  # noqa: E402

pytestmark = pytest.mark.timeout(120)

CHAINING = pytest.mark.parametrize("chaining", [True, False], ids=["chained", "unchained"])
PARALLELISM = pytest.mark.parametrize("p", [1, 3], ids=["p1", "p3"])


# --------------------------------------------------------------------------- operators


@CHAINING
@PARALLELISM
def test_map_filter_flat_map(chaining, p):
    env = fb.Environment(parallelism=p, chaining=chaining)
    n = 20_000
    h = (env.from_sequence(0, n)
         .map(lambda x: x * 3)
         .filter(lambda x: x % 2 == 0)
         .flat_map(lambda x: [x, -x] if x % 4 == 0 else [x])
         .collect())
    run(env)
    expected = []
    for x in range(n):
        y = x * 3
        if y % 2 == 0:
            expected += [y, -y] if y % 4 == 0 else [y]
    assert sorted(h.result) == sorted(expected)


@CHAINING
def test_parallelism_one_forward_chain_preserves_order(chaining):
    env = fb.Environment(parallelism=1, chaining=chaining, segment_size=4096)
    data = [f"r{i}" for i in range(30_000)]
    h = (env.from_collection(data)
         .map(lambda s: s + "!")
         .filter(lambda s: not s.endswith("7!"))
         .flat_map(lambda s: [s, s.upper()])
         .collect())
    run(env)
    expected = [y for s in data if not (s + "!").endswith("7!") for y in (s + "!", (s + "!").upper())]
    assert h.result == expected           # exact order, not sorted


@CHAINING
def test_operator_parallelism_differs_per_operator(chaining):
    env = fb.Environment(parallelism=2, chaining=chaining)
    h = (env.from_collection(list(range(5000)))            # parallelism 1
         .map(lambda x: x + 1, parallelism=3)                # rebalance 1 -> 3
         .filter(lambda x: x % 5 != 0, parallelism=3)        # forward, chained
         .map(lambda x: x * 2)                               # rebalance 3 -> 2
         .collect(parallelism=1))                            # rebalance 2 -> 1
    run(env)
    assert sorted(h.result) == sorted((x + 1) * 2 for x in range(5000) if (x + 1) % 5 != 0)
    vertices, edges = env.plan()
    want = ["rebalance"] * 3 if chaining else ["forward"] + ["rebalance"] * 3
    assert sorted(e.partitioner for e in edges) == want


def test_chaining_fuses_forward_operators_of_equal_parallelism():
    def build(chaining):
        env = fb.Environment(parallelism=2, chaining=chaining)
        env.from_sequence(0, 10).map(lambda x: x).filter(bool).rebalance().map(lambda x: x).collect()
        return env.plan()
    vertices, edges = build(True)
    assert [v.name for v in vertices] == ["sequence -> map -> filter", "map -> collect"]
    assert [e.partitioner for e in edges] == ["rebalance"]
    vertices, edges = build(False)
    assert len(vertices) == 5 and len(edges) == 4


@CHAINING
@PARALLELISM
def test_map_batches_on_a_record_stream_sees_records(chaining, p):
    env = fb.Environment(parallelism=p, chaining=chaining)
    h = env.from_sequence(0, 1000).map_batches(lambda x: x + 0.5, kind="float64").collect()
    run(env)
    assert sorted(h.result) == [x + 0.5 for x in range(1000)]


# --------------------------------------------------------------------------- sources


@CHAINING
def test_from_iterable_pulls_lazily(chaining):
    """A plain iterator is consumed only as far as the job can write."""
    pulled = []

    def it():
        for i in range(10_000):
            pulled.append(i)
            yield i

    env = fb.Environment(chaining=chaining)
    h = env.from_iterable(it(), kind="int64").map(lambda x: x * 2).collect()
    run(env)
    assert h.result == [2 * i for i in range(10_000)]
    assert pulled == list(range(10_000))


@CHAINING
def test_from_generator_and_from_collection(chaining):
    env = fb.Environment(chaining=chaining, parallelism=2)
    a = env.from_generator(lambda: (i * i for i in range(3000))).rebalance().map(lambda x: x).collect()
    b = env.from_collection(("x", "y", "z")).collect()
    run(env)
    assert sorted(a.result) == [i * i for i in range(3000)]
    assert sorted(b.result) == ["x", "y", "z"]


@CHAINING
@pytest.mark.parametrize("p", [1, 2, 3])
def test_from_sequence_strides_over_parallel_subtasks(chaining, p):
    env = fb.Environment(parallelism=p, chaining=chaining)
    h = env.from_sequence(5, 10_005, 3).collect()
    run(env)
    assert sorted(h.result) == list(range(5, 10_005, 3))
    # forward: subtask i of the sink saw exactly source subtask i's stride, in order
    parts = h._parts
    for i in range(p):
        assert parts[i] == list(range(5 + 3 * i, 10_005, 3 * p))


def test_from_sequence_negative_step():
    env = fb.Environment(parallelism=2)
    h = env.from_sequence(100, -100, -7).collect()
    run(env)
    assert sorted(h.result) == sorted(range(100, -100, -7))


def test_unbounded_sequence_through_iterator():
    env = fb.Environment(parallelism=2, chaining=False)
    h = env.from_sequence(0, None).map(lambda x: x + 1).to_iterator()
    gen = env.execute_iter(h)
    got = [next(gen) for _ in range(5000)]
    gen.close()
    assert_clean(env)
    assert len(set(got)) == 5000 and min(got) >= 1


@CHAINING
@PARALLELISM
def test_execute_iter_yields_every_record(chaining, p):
    env = fb.Environment(parallelism=p, chaining=chaining)
    h = env.from_sequence(0, 50_000).filter(lambda x: x % 3).to_iterator()
    got = list(env.execute_iter(h))
    assert_clean(env)
    assert sorted(got) == [x for x in range(50_000) if x % 3]


# --------------------------------------------------------------------------- partitioners


@CHAINING
def test_rebalance_spreads_records_evenly(chaining):
    env = fb.Environment(parallelism=1, chaining=chaining)
    n = 30_000
    h = env.from_collection(list(range(n))).rebalance().map(lambda x: x, parallelism=3).collect(parallelism=3)
    run(env)
    assert sorted(h.result) == list(range(n))
    sizes = [len(h._parts[i]) for i in range(3)]
    assert max(sizes) - min(sizes) <= 3, sizes
    for part in h._parts.values():     # one producer per channel: its order is kept
        assert part == sorted(part)


@CHAINING
@PARALLELISM
def test_broadcast_reaches_every_subtask(chaining, p):
    env = fb.Environment(parallelism=p, chaining=chaining)
    data = [f"b{i}" for i in range(2000)]
    h = env.from_collection(data).broadcast().map(lambda s: s, parallelism=3).collect(parallelism=3)
    run(env)
    for i in range(3):
        assert h._parts[i] == data            # every subtask sees everything, in order
    assert sorted(h.result) == sorted(data * 3)


@CHAINING
@PARALLELISM
def test_key_by_sends_each_key_to_one_subtask(chaining, p):
    env = fb.Environment(parallelism=p, chaining=chaining)
    n = 20_000
    h = env.from_sequence(0, n).key_by(lambda x: x % 37).map(lambda x: x, parallelism=4).collect(parallelism=4)
    run(env)
    assert sorted(h.result) == list(range(n))
    owner = {}
    for sub, part in h._parts.items():
        for x in part:
            assert owner.setdefault(x % 37, sub) == sub
    assert len(set(owner.values())) > 1        # keys did spread


@CHAINING
def test_forward_with_equal_parallelism_is_pointwise(chaining):
    env = fb.Environment(parallelism=3, chaining=chaining)
    h = env.from_sequence(0, 3000).forward().map(lambda x: x).forward().collect()
    run(env)
    for i in range(3):
        assert h._parts[i] == list(range(i, 3000, 3))


def test_forward_with_unequal_parallelism_raises():
    env = fb.Environment(parallelism=2)
    env.from_sequence(0, 10).forward().map(lambda x: x, parallelism=3).collect()
    with pytest.raises(ValueError, match="forward"):
        env.execute(10)
    env = fb.Environment()
    env.from_collection([1, 2]).forward().map(lambda x: x, parallelism=2).collect()
    with pytest.raises(ValueError, match="parallelism"):
        env.execute(10)


def test_default_partitioner_is_forward_or_rebalance():
    env = fb.Environment(parallelism=2, chaining=False)
    env.from_sequence(0, 10).map(lambda x: x).map(lambda x: x, parallelism=3).collect(parallelism=3)
    _, edges = env.plan()
    assert [e.partitioner for e in edges] == ["forward", "rebalance", "forward"]


# --------------------------------------------------------------------------- sinks


@CHAINING
@PARALLELISM
def test_sink_function_per_record_and_batched(chaining, p):
    env = fb.Environment(parallelism=p, chaining=chaining)
    seen, batches = [], []
    lock = threading.Lock()

    def one(x):
        with lock:
            seen.append(x)

    def many(batch):
        with lock:
            batches.append(list(batch))

    s = env.from_sequence(0, 10_000)
    s.map(lambda x: x + 1).sink(one)
    s2 = env.from_sequence(0, 10_000)
    s2.sink(many, batched=True)
    run(env)
    assert sorted(seen) == list(range(1, 10_001))
    assert sorted(x for b in batches for x in b) == list(range(10_000))
    assert all(isinstance(b, list) and b for b in batches)


@CHAINING
@pytest.mark.parametrize("p", [1, 2])
def test_read_text_write_text_round_trip(tmp_path, chaining, p):
    lines = [f"line {i} – ünïcödé ✓ {'x' * (i % 50)}" for i in range(5000)] + ["", "  spaced  "]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    env = fb.Environment(parallelism=p, chaining=chaining)
    env.read_text(src).map(lambda s: s[::-1], parallelism=p).write_text(out)
    run(env)
    # one layout whatever the parallelism: a part file per subtask
    assert sorted(os.listdir(out)) == [f"part-{i:05d}-000000.txt" for i in range(p)]
    if p == 1:
        assert (out / "part-00000-000000.txt").read_text(encoding="utf-8").split("\n")[:-1] == \
            [s[::-1] for s in lines]
    else:
        got = []
        for name in sorted(os.listdir(out)):
            got += (out / name).read_text(encoding="utf-8").split("\n")[:-1]
        assert sorted(got) == sorted(s[::-1] for s in lines)


def test_read_text_strips_crlf_and_reads_without_trailing_newline(tmp_path):
    src = tmp_path / "crlf.txt"
    src.write_bytes(b"a\r\nb\r\n\r\nc")
    env = fb.Environment(chaining=False)
    h = env.read_text(src).collect()
    run(env)
    assert h.result == ["a", "b", "", "c"]


def test_read_text_missing_file():
    env = fb.Environment()
    with pytest.raises(FileNotFoundError):
        env.read_text("/nonexistent/definitely/not/here.txt")


# --------------------------------------------------------------------------- typed streams

class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)

    def __hash__(self):
        return hash((self.x, self.y))

    def __repr__(self):
        return f"Point({self.x}, {self.y})"


TYPED = {
    "int64": [0, 1, -1, 2**63 - 1, -(2**63)] + list(range(-500, 500)),
    "float64": [0.0, -0.0, 1.5, -1e308, 5e-324, math.inf, -math.inf] + [i / 7 for i in range(1000)],
    "str": ["", "a", "ü" * 3, "\x00nul", "✓" * 5000, "x" * 40_000] + [str(i) for i in range(1000)],
    "bytes": [b"", b"\x00", b"y" * 4095, b"z" * 4096, b"w" * 5000, b"q" * 70_000] + [bytes([i % 256]) * (i % 40) for i in range(1000)],
    "pickle": [None, (1, "a"), {"k": [1, 2]}, 2**70, True, Point(1, 2), frozenset({3})] + [(i, str(i)) for i in range(1000)],
}


@CHAINING
@pytest.mark.parametrize("kind", sorted(TYPED))
def test_typed_streams_round_trip(chaining, kind):
    data = TYPED[kind]
    env = fb.Environment(parallelism=1, chaining=chaining, segment_size=8192)
    # a stream's kind is its first record's: mixed objects whose first one at some subtask
    # is a plain tuple would infer 'struct', so the mixed pickle stream says so
    kw = {"kind": "pickle"} if kind == "pickle" else {}
    h = env.from_collection(data).map(lambda x: x, **kw).rebalance().map(lambda x: x, parallelism=2, **kw).collect()
    run(env)
    got = h.result
    assert len(got) == len(data)
    if kind == "float64":
        key = lambda v: (math.copysign(1, v), v)  # noqa: E731 - keeps -0.0 apart from 0.0
        assert sorted(got, key=key) == sorted(data, key=key)
    elif kind == "pickle":
        assert sorted(map(pickle.dumps, got)) == sorted(map(pickle.dumps, data))
    else:
        assert sorted(got) == sorted(data)
        assert all(type(x) is type(data[0]) for x in got)   # bytes come back as bytes


@CHAINING
def test_explicit_kind_is_used(chaining):
    env = fb.Environment(chaining=chaining)
    h = env.from_generator(lambda: iter([1, 2, 3]), kind="pickle").map(lambda x: (x, x), kind="pickle").collect()
    run(env)
    assert h.result == [(1, 1), (2, 2), (3, 3)]


ROW = np.dtype([("key", "<i8"), ("value", "<f8")])   # 16-byte rows


def _arrays(n_arrays, rows):
    out = []
    for i in range(n_arrays):
        a = np.zeros(rows, ROW)
        a["key"] = np.arange(rows) + i * rows
        a["value"] = a["key"] * 0.5
        out.append(a)
    return out


@CHAINING
def test_from_arrays_map_batches_rows(chaining):
    arrays = _arrays(20, 3000)          # 48 KB per array: spans segments

    def double(chunk):
        assert isinstance(chunk, np.ndarray) and chunk.dtype == ROW
        out = chunk.copy()
        out["value"] *= 2
        return out

    env = fb.Environment(chaining=chaining, segment_size=16 * 1024)
    h = env.from_arrays(arrays).map_batches(double).collect()
    run(env)
    got = np.concatenate(h.result)
    want = np.concatenate(arrays)
    assert np.array_equal(got["key"], want["key"])          # order kept, p = 1
    assert np.array_equal(got["value"], want["value"] * 2)


@CHAINING
def test_from_arrays_generator_with_dtype_and_kind_change(chaining):
    def gen():
        for a in _arrays(5, 1000):
            yield a

    env = fb.Environment(chaining=chaining, parallelism=2)
    h = (env.from_arrays(gen, dtype=ROW)
         .map_batches(lambda a: a["key"].astype("<i4"), kind=np.dtype("<i4"))
         .rebalance()
         .map_batches(lambda a: a + 1, parallelism=2)
         .collect())
    run(env)
    got = np.sort(np.concatenate(h.result))
    assert got.dtype == np.dtype("<i4")
    assert np.array_equal(got, np.arange(5000, dtype="<i4") + 1)


def test_from_arrays_broadcast_rows():
    env = fb.Environment(chaining=False)
    h = env.from_arrays(_arrays(3, 100)).broadcast().map_batches(lambda a: a, parallelism=2).collect(parallelism=2)
    run(env)
    for i in range(2):
        assert np.array_equal(np.concatenate(h._parts[i]), np.concatenate(_arrays(3, 100)))


def test_rows_are_readonly_views_but_collect_keeps_copies():
    """Rows come back as views over segments; collect() copies so the pool is free."""
    seen = []
    env = fb.Environment(chaining=False, segment_size=4096, output_buffers=(1, 2))
    h = (env.from_arrays(_arrays(40, 1000))
         .map_batches(lambda a: (seen.append(a.flags.writeable), a)[1])
         .collect())
    run(env)           # 40 x 16 KB through a 2-segment pool: collect must not pin them
    assert not any(seen)
    assert sum(len(a) for a in h.result) == 40_000


def test_from_arrays_needs_dtype_for_iterators():
    env = fb.Environment()
    with pytest.raises(ValueError, match="dtype"):
        env.from_arrays(iter(_arrays(1, 3)))


def test_large_bytes_records_are_not_pinned_by_collect():
    """Records >= 4 KiB are read zero-copy; collecting many of them through a
    small pool must neither deadlock nor hold segments afterwards."""
    env = fb.Environment(chaining=False, segment_size=8192, output_buffers=(1, 3))
    data = [bytes([i % 251]) * 6000 for i in range(300)]
    h = env.from_collection(data).map(lambda b: b).collect()
    run(env, timeout=30)
    assert h.result == data
    assert all(type(b) is bytes for b in h.result)


# --------------------------------------------------------------------------- keyed state


def _reference_reduce(pairs):
    state, out = {}, collections.defaultdict(list)
    for k, v in pairs:
        state[k] = state[k] + v if k in state else v
        out[k].append(state[k])
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs=st.lists(st.tuples(st.one_of(st.integers(-5, 5), st.sampled_from(["a", "b", "cc", ""])),
                                st.integers(-1000, 1000)), max_size=300),
       p=st.integers(1, 3), chaining=st.booleans())
def test_keyed_reduce_matches_dict_reference(pairs, p, chaining):
    env = fb.Environment(parallelism=p, chaining=chaining, segment_size=1024)
    h = (env.from_collection(pairs, kind="pickle")
         .key_by(lambda kv: kv[0])
         .reduce(lambda a, b: (a[0], a[1] + b[1]))
         .collect())
    env.execute(30)
    assert_clean(env)
    got = collections.defaultdict(list)
    for k, v in h.result:
        got[k].append(v)
    # every input emits the updated aggregate; per key, in input order
    want = _reference_reduce(pairs)
    assert dict(got) == dict(want)
    for part in h._parts.values():           # a key lives in exactly one subtask
        for k, _ in part:
            assert all(kk != k for other in h._parts.values() if other is not part for kk, _ in other)


def _count_and_sum(key, record, state):
    state["n"] = state.get("n", 0) + 1
    state["sum"] = state.get("sum", 0) + record[1]
    if state["n"] % 3 == 0:
        return [(key, state["n"], state["sum"])]
    return None


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs=st.lists(st.tuples(st.integers(0, 8), st.integers(-50, 50)), max_size=300),
       p=st.integers(1, 3), chaining=st.booleans())
def test_keyed_process_state_matches_reference(pairs, p, chaining):
    env = fb.Environment(parallelism=p, chaining=chaining, segment_size=1024)
    h = (env.from_collection(pairs, kind="pickle")
         .key_by(lambda kv: kv[0])
         .process(_count_and_sum, kind="pickle")
         .collect())
    env.execute(30)
    assert_clean(env)
    want, state = [], {}
    for k, v in pairs:
        n, s = state.get(k, (0, 0))
        state[k] = (n + 1, s + v)
        if (n + 1) % 3 == 0:
            want.append((k, n + 1, s + v))
    assert sorted(h.result) == sorted(want)


@CHAINING
def test_word_count_with_string_keys(chaining):
    text = ["the quick brown fox", "jumps over the lazy dog", "the end"] * 300
    env = fb.Environment(parallelism=3, chaining=chaining)
    h = (env.from_collection(text)
         .flat_map(str.split)
         .key_by(lambda w: w)
         .process(lambda k, w, st: (st.__setitem__("n", st.get("n", 0) + 1), [(k, st["n"])])[1])
         .collect(parallelism=1))
    run(env)
    final = {}
    for k, n in h.result:
        final[k] = max(final.get(k, 0), n)
    assert final == dict(collections.Counter(w for line in text for w in line.split()))


# --------------------------------------------------------------------------- rate limit, buffer timeout


@pytest.mark.parametrize("limiter", ["number", "object"])
def test_rate_limit_is_respected(limiter):
    n, rate = 600, 1000.0
    rl = rate if limiter == "number" else fb.RateLimiter(records_per_s=rate)
    env = fb.Environment(chaining=False)
    h = env.from_collection(list(range(n)), rate_limit=rl).map(lambda x: x).collect()
    t0 = time.monotonic()
    run(env)
    elapsed = time.monotonic() - t0
    assert h.result == list(range(n))
    assert elapsed >= n / rate * 0.8, elapsed
    assert elapsed < n / rate * 4 + 2, elapsed        # throttled, not stalled


def test_rate_limit_on_parallel_sequence():
    n, rate = 800, 2000.0
    env = fb.Environment(parallelism=2)
    h = env.from_sequence(0, n, rate_limit=rate).collect()
    t0 = time.monotonic()
    run(env)
    elapsed = time.monotonic() - t0
    assert sorted(h.result) == list(range(n))
    # each of the two subtasks has its own limiter: n/2 records at `rate`
    assert elapsed >= (n / 2) / rate * 0.8, elapsed


def _trickle(count, gap):
    def gen():
        for i in range(count):
            time.sleep(gap)
            yield (i, time.monotonic())
    return gen


@pytest.mark.parametrize("buffer_timeout", [0.05, 0.3])
@CHAINING
def test_trickle_reaches_sink_within_buffer_timeout(buffer_timeout, chaining):
    """Records far too few to fill a buffer still arrive within the timeout."""
    arrivals = []
    env = fb.Environment(chaining=chaining, buffer_timeout=buffer_timeout)
    (env.from_generator(_trickle(8, 0.12), kind="pickle")
        .map(lambda r: r)
        .rebalance()
        .filter(lambda r: True)
        .rebalance()
        .sink(lambda r: arrivals.append(time.monotonic() - r[1])))
    run(env)
    assert len(arrivals) == 8
    assert max(arrivals) < buffer_timeout + 0.25, arrivals


@pytest.mark.parametrize("buffer_timeout", [0.1, 0.4])
def test_busy_stage_still_flushes_on_buffer_timeout(buffer_timeout):
    """A stage that keeps receiving input but rarely emits (a selective filter)
    ships its sparse output on the buffer timeout, not when a buffer fills."""
    arrivals = []
    env = fb.Environment(chaining=False, buffer_timeout=buffer_timeout, segment_size=32 * 1024)
    (env.from_sequence(0, 6000, rate_limit=3000)
        .map(lambda x: (x, time.monotonic()), kind="pickle")
        .filter(lambda r: r[0] % 1000 == 0)
        .sink(lambda r: arrivals.append(time.monotonic() - r[1])))
    run(env)
    assert len(arrivals) == 6
    assert max(arrivals) < buffer_timeout + 0.3, arrivals


@CHAINING
@PARALLELISM
def test_buffer_timeout_zero_ships_per_record(chaining, p):
    env = fb.Environment(parallelism=p, chaining=chaining, buffer_timeout=0)
    h = env.from_sequence(0, 3000).map(lambda x: x + 1).rebalance().filter(lambda x: x % 2).collect()
    run(env)
    assert sorted(h.result) == [x for x in range(1, 3001) if x % 2]
    arrivals = []
    env = fb.Environment(chaining=chaining, buffer_timeout=0)
    (env.from_generator(_trickle(5, 0.05), kind="pickle").rebalance()
        .sink(lambda r: arrivals.append(time.monotonic() - r[1])))
    run(env)
    assert len(arrivals) == 5 and max(arrivals) < 0.2, arrivals


# --------------------------------------------------------------------------- running, metrics


def test_execute_async_join_and_metrics():
    env = fb.Environment(parallelism=2, chaining=False, metrics_interval=0.05)
    h = env.from_sequence(0, 200_000).map(lambda x: x).collect()
    job = env.execute_async()
    assert job.join(60) is job
    assert_clean(env)
    assert len(h.result) == 200_000
    summary = job.summary()
    assert set(summary) == {t.task_name for t in job.tasks}
    for m in summary.values():
        assert m["state"] == "FINISHED"
        assert 0 <= m["busy_ms_per_s"] <= 1000 and m["level"] in ("OK", "LOW", "HIGH")
    metrics = env.metrics()
    assert metrics and all("records_out" in m for m in metrics.values())
    sources = [m for name, m in summary.items() if name.startswith("sequence")]
    assert sum(m["records_out"] for m in sources) == 200_000


def test_two_pipelines_in_one_job_and_the_env_runs_once():
    env = fb.Environment(parallelism=2)
    a = env.from_sequence(0, 100).map(lambda x: -x).collect()
    b = env.from_collection(["p", "q"]).collect()
    run(env)
    assert sorted(a.result) == sorted(-x for x in range(100)) and sorted(b.result) == ["p", "q"]
    with pytest.raises(fb.errors.AlreadyExecutedError, match="new Environment"):
        run(env)             # an Environment executes its graph once, as Flink's does
    assert sorted(a.result) == sorted(-x for x in range(100))


def test_empty_sources():
    env = fb.Environment(parallelism=2, chaining=False)
    a = env.from_collection([]).map(lambda x: x).collect()
    b = env.from_sequence(0, 0).rebalance().map(lambda x: x).collect()
    c = env.from_generator(lambda: iter(())).key_by(lambda x: x).reduce(lambda x, y: x).collect()
    run(env)
    assert a.result == b.result == c.result == []


# --------------------------------------------------------------------------- error paths


@pytest.mark.parametrize("kwargs, param", [
    ({"parallelism": 0}, "parallelism"),
    ({"parallelism": -2}, "parallelism"),
    ({"parallelism": 1.5}, "parallelism"),
    ({"parallelism": True}, "parallelism"),
    ({"max_batch": 0}, "max_batch"),
    ({"num_segments": 0}, "num_segments"),
    ({"buffer_timeout": -0.1}, "buffer_timeout"),
    ({"buffer_timeout": float("nan")}, "buffer_timeout"),
    ({"output_buffers": (4, 2)}, "output_buffers"),
    ({"output_buffers": (1, 0)}, "output_buffers"),
    ({"metrics_interval": 0}, "metrics_interval"),
    ({"segment_size": 1000}, "segment_size"),
    ({"segment_size": 128}, "segment_size"),
    ({"segment_size": 4 * 1024 * 1024}, "segment_size"),
])
def test_bad_configuration_raises_value_error_naming_it(kwargs, param):
    with pytest.raises(ValueError, match=param):
        env = fb.Environment(**kwargs)      # checked here, or at the latest at execute()
        env.from_collection([1, 2, 3]).rebalance().map(lambda x: x).collect()
        env.execute(10)


@pytest.mark.parametrize("bad", [0, -5])
def test_bad_rate_limit(bad):
    with pytest.raises(ValueError, match="records_per_s"):
        fb.RateLimiter(records_per_s=bad)
    env = fb.Environment()
    with pytest.raises(ValueError, match="rate_limit"):   # when the source is declared
        env.from_collection([1, 2], rate_limit=bad)


def test_bad_operator_arguments():
    env = fb.Environment()
    s = env.from_collection([1, 2, 3])
    with pytest.raises(ValueError, match="parallelism"):
        s.map(lambda x: x, parallelism=0)
    with pytest.raises(TypeError):
        s.map(42)
    with pytest.raises(TypeError):
        s.key_by("not callable")
    with pytest.raises(TypeError):
        env.from_generator([1, 2])
    h = s.to_iterator()
    with pytest.raises(ValueError, match="execute_iter"):
        env.execute()
    with pytest.raises(TypeError):
        env.execute_iter(object())
    assert isinstance(h, fb.IteratorSink)


def test_unknown_kind_raises():
    env = fb.Environment(chaining=False)
    src = env.from_collection([1, 2])
    with pytest.raises(ValueError, match="no-such-kind"):      # when the stream is declared
        src.map(lambda x: x, kind="no-such-kind")


@CHAINING
@pytest.mark.parametrize("explicit", [True, False], ids=["kind=int64", "inferred"])
def test_str_into_int64_stream_fails_the_job(chaining, explicit):
    env = fb.Environment(chaining=chaining)
    kw = {"kind": "int64"} if explicit else {}
    (env.from_collection(list(range(100)))
        .map(lambda x: x if x != 50 else "fifty", name="mixer", **kw)
        .rebalance()
        .map(lambda x: x, name="after")
        .collect())
    with pytest.raises(JobFailedError) as info:
        env.execute(30)
    msg = str(info.value)
    assert "'mixer'" in msg and "TypeError" in msg and "record" in msg
    assert isinstance(info.value.__cause__, TypeError)
    assert_clean(env)


def test_float_into_str_stream_and_wrong_row_dtype_fail_the_job():
    env = fb.Environment(chaining=False)
    env.from_collection(["a", "b", 1.5]).rebalance().collect()
    with pytest.raises(JobFailedError, match="iterable"):
        env.execute(30)
    assert_clean(env)
    env = fb.Environment(chaining=False)
    env.from_arrays(_arrays(3, 10)).map_batches(lambda a: a["key"], name="wrong_dtype").collect()
    with pytest.raises(JobFailedError, match="wrong_dtype") as info:
        env.execute(30)
    assert "dtype" in str(info.value)
    assert_clean(env)


def test_key_by_on_rows_stream_fails_clearly():
    env = fb.Environment(chaining=False)
    env.from_arrays(_arrays(2, 10)).key_by(lambda r: r).map_batches(lambda a: a).collect()
    with pytest.raises(JobFailedError, match="key_by"):
        env.execute(30)
    assert_clean(env)


def test_record_too_large_fails_the_job():
    env = fb.Environment(chaining=False, max_record_size=1000)
    env.from_collection([b"x" * 10, b"y" * 5000], name="big").rebalance().collect()
    with pytest.raises(JobFailedError, match="big") as info:
        env.execute(30)
    assert isinstance(info.value.__cause__, fb.errors.RecordTooLargeError)
    assert_clean(env)


@pytest.mark.parametrize("kind", ["arrow", "pandas", "numpy"])
def test_batch_object_streams_collect_without_pinning_segments(kind):
    """Arrow RecordBatches, DataFrames and NumPy arrays as records are decoded
    zero-copy over segments; many of them collected through a small pool must
    neither deadlock nor keep segments after the job."""
    pa = pytest.importorskip("pyarrow")
    base = {"a": np.arange(300, dtype=np.int64), "b": np.arange(300) * 0.5}
    if kind == "arrow":
        data = [pa.record_batch({"a": base["a"] + i, "b": base["b"]}) for i in range(100)]
    elif kind == "pandas":
        pd = pytest.importorskip("pandas")
        data = [pd.DataFrame({"a": base["a"] + i, "b": base["b"]}) for i in range(100)]
    else:
        data = [base["a"] + i for i in range(100)]
    env = fb.Environment(chaining=False, output_buffers=(1, 4))
    h = env.from_collection(data).map_batches(lambda b: b).rebalance().map_batches(lambda b: b).collect()
    run(env, timeout=30)
    got = h.result
    assert len(got) == 100
    for g, d in zip(got, data):
        if kind == "arrow":
            assert g.equals(d)
        elif kind == "pandas":
            assert g.equals(d)
        else:
            assert np.array_equal(g, d)


def test_iterator_sink_records_own_their_memory_so_callers_may_keep_them():
    # 2000 records of 8 KB through a 64-segment arena: holding them all would
    # pin every segment if they were views over the pool
    env = fb.Environment(num_segments=64)
    it = env.from_collection([bytes([i % 256]) * 8000 for i in range(2000)], kind="bytes").map(lambda b: b).to_iterator()
    got = list(env.execute_iter(it))
    assert len(got) == 2000 and all(type(g) is bytes for g in got)
    assert got[5] == bytes([5]) * 8000


def test_source_read_ahead_is_bounded_by_bytes():
    pulled = []

    def big_records():
        for i in range(200):
            pulled.append(i)
            yield bytes(64 * 1024)

    consumed = []
    env = fb.Environment(segment_size=32 * 1024, chaining=False)

    def slow_sink(rec):
        consumed.append(len(pulled))
        time.sleep(0.002)

    env.from_generator(big_records, kind="bytes").sink(slow_sink)
    env.execute(timeout=60)
    # the source never runs far ahead of the sink: a 64 KiB record is 2 segments,
    # so the pull size stays at 1-2 records and the lead is bounded by the pool
    leads = [p - i for i, p in enumerate(consumed)]
    assert max(leads) <= 16
